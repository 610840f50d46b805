"""What the benchmark times: attention problems, grouped into suites.

Every case is float32 with N(0, 1) inputs and scale 1/sqrt(D). A case says
which systems run it and how its work is counted: FLOPs over the query/key
pairs the mask leaves visible (4 per pair and unit of D forward, 10 backward:
five products), and bytes of K and V (what decode streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BENCH_HEADS = {"MQA": (16, 1, 128), "one head": (1, 1, 64)}  # beside npattn.testing.MODEL_HEADS


def model_heads(model: str) -> tuple[int, int, int]:
    """(H_q, H_kv, D) of a model: npattn.testing's table of model heads, and the
    benchmark's own. Imported when first asked, so that a worker has pinned its
    threads before numpy loads."""
    from npattn.testing import MODEL_HEADS

    return {**MODEL_HEADS, **BENCH_HEADS}[model]


PEERS = ("numpy", "torch", "mlx", "jax", "ort-gqa", "ort-attention", "openvino-sdpa", "openvino-kv")


@dataclass(frozen=True)
class Case:
    """One attention problem: q (B, H_q, L, D), k and v (B, H_kv, S, D)."""

    id: str
    model: str
    B: int
    L: int
    S: int
    mask: str = "causal"  # "causal" (bottom-right) or "none"
    window: tuple | None = None  # (left, right) positions
    softcap: float | None = None
    backward: bool = False  # time sdpa_backward (and autograd's backward)
    one_thread: bool = False  # run on 1 thread instead of the run's T
    systems: tuple = ("npattn", *PEERS)

    @property
    def heads(self) -> tuple[int, int, int]:
        return model_heads(self.model)

    @property
    def decode(self) -> bool:
        return self.L == 1

    @property
    def label(self) -> str:
        h_q, h_kv, D = self.heads
        shape = f"L=S={self.L}" if self.L == self.S else f"L={self.L} S={self.S}"
        kind = "decode" if self.L == 1 else ("prefill" if self.L == self.S else "chunked prefill")
        text = f"{self.model} {h_q}/{h_kv}/{D} {kind} {shape}"
        if self.B != 1:
            text += f" B={self.B}"
        if self.mask == "none" and self.L > 1:
            text += ", no mask"
        if self.window:
            text += f", window {self.window[0] + 1}"
        if self.softcap:
            text += f", softcap {self.softcap:g}"
        if self.backward:
            text += ", backward"
        if self.one_thread:
            text += ", 1 thread"
        return text

    @property
    def pairs(self) -> int:
        """The query/key pairs the mask and window leave visible (bottom-right positions)."""
        L, S = self.L, self.S
        left = self.window[0] if self.window else None
        total = 0
        for i in range(L):
            hi = i + S - L if self.mask == "causal" else S - 1
            lo = i + S - L - left if left is not None else 0
            total += max(0, min(hi, S - 1) - max(lo, 0) + 1)
        return total

    @property
    def flops(self) -> int:
        """Useful FLOPs: 4 B H_q pairs D forward (q k^T and p v), 10 backward (five products)."""
        h_q, _, D = self.heads
        return (10 if self.backward else 4) * self.B * h_q * self.pairs * D

    @property
    def kv_bytes(self) -> int:
        _, h_kv, D = self.heads
        return 2 * self.B * h_kv * self.S * D * 4

    @property
    def score_bytes(self) -> int:
        """One float32 (B, H_q, L, S) array: what the NumPy formula materialises."""
        return self.B * self.heads[0] * self.L * self.S * 4


@dataclass
class Suite:
    """Cases timed together, reported in one table or plot."""

    name: str
    title: str
    cases: list = field(default_factory=list)


def sweep_sizes(quick: bool) -> list[int]:
    return [16, 64, 256, 1024, 4096] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def suites(quick: bool = False) -> list[Suite]:
    """Every suite of the benchmark; --quick shrinks the sizes to a smoke test."""

    def size(x: int) -> int:
        return max(64, x // 16) if quick else x

    small = ("npattn", "numpy", "torch", "mlx", "ort-gqa", "ort-attention", "openvino-sdpa", "openvino-kv")
    per_call = Suite("per-call", "Calls of every size: per-call latency")
    per_call.cases.append(Case("course", "course", 2, 3, 7, systems=small))
    per_call.cases.append(Case("one-head-decode-16", "one head", 1, 1, 16, systems=small))
    per_call.cases.append(Case("qwen2-prefill-32", "Qwen2-0.5B", 1, 32, 32, systems=small))
    for model, key in (("Qwen2-0.5B", "qwen2"), ("Qwen3-4B", "qwen3")):
        for S in sweep_sizes(quick):
            per_call.cases.append(Case(f"{key}-decode-{S}", model, 1, 1, S, systems=("npattn", "numpy", "torch")))

    prefill = Suite("prefill", "Model-sized prefill and decode")
    for model, key in (("Qwen3-4B", "qwen3"), ("Qwen2-0.5B", "qwen2")):
        for L in (512, 2048, 4096):
            prefill.cases.append(Case(f"{key}-prefill-{L}", model, 1, size(L), size(L)))
    prefill.cases.append(Case("gpt2-prefill-1024-b4", "GPT-2", 4, size(1024), size(1024)))
    prefill.cases.append(Case("qwen3-chunked-512-4096", "Qwen3-4B", 1, size(512), size(4096)))
    prefill.cases.append(Case("qwen3-decode-32768-b4", "Qwen3-4B", 4, 1, size(32768)))
    prefill.cases.append(Case("mqa-decode-65536", "MQA", 1, 1, size(65536)))
    prefill.cases.append(Case("qwen3-prefill-2048-1t", "Qwen3-4B", 1, size(2048), size(2048), one_thread=True))

    features = Suite("features", "Windows and softcap (SPEC section 6), npattn alone")
    alone = ("npattn",)
    features.cases += [
        Case("qwen3-prefill-16384-nowindow", "Qwen3-4B", 1, size(16384), size(16384), systems=alone),
        Case(
            "qwen3-prefill-16384-window-1024", "Qwen3-4B", 1, size(16384), size(16384), window=(1023, 0), systems=alone
        ),
        Case("qwen3-prefill-2048-nocap", "Qwen3-4B", 1, size(2048), size(2048), systems=alone),
        Case("qwen3-prefill-2048-softcap", "Qwen3-4B", 1, size(2048), size(2048), softcap=50.0, systems=alone),
        Case("qwen3-decode-32768-nowindow", "Qwen3-4B", 1, 1, size(32768), systems=alone),
        Case("qwen3-decode-32768-window-4096", "Qwen3-4B", 1, 1, size(32768), window=(4095, 0), systems=alone),
    ]

    backward = Suite("backward", "Gradients: npattn.sdpa_backward against PyTorch's autograd")
    for model, key in (("Qwen3-4B", "qwen3"), ("Qwen2-0.5B", "qwen2")):
        for L in (1024, 2048, 4096):
            backward.cases.append(
                Case(f"{key}-backward-{L}", model, 1, size(L), size(L), backward=True, systems=("npattn", "torch"))
            )
    every = [per_call, prefill, features, backward]
    ids = [case.id for suite in every for case in suite.cases]
    assert len(ids) == len(set(ids)), "a case id names one case: the results are stored by id"
    return every


# A decode loop of a Qwen2-0.5B-sized model, attention only: 24 layers, each
# with its own preallocated KV cache, a 128-token prompt, then 128 tokens.
DECODE_LOOP = {"model": "Qwen2-0.5B", "layers": 24, "prompt": 128, "new_tokens": 128}

# npattn's peak extra memory on a problem whose scores alone would be 8 GiB.
MEMORY_CASE = Case("qwen3-memory-8192", "Qwen3-4B", 1, 8192, 8192, systems=("npattn",))

"""The fuzzer's transformers cases: npattn.transformers' mask function and attention
function against the reference over transformers' own boolean mask.

A case draws what a transformers layer hands the attention function: a batch of
requests with a cache of P rows and L new ones, GQA heads, a mask function
(causal, bidirectional, a sliding window either way, chunked, or one a model
combined from a random table, as image tokens do), padding (none, left, right,
or a hole), scaling, softcap and sinks. npattn.transformers.mask makes its Mask
(a band with per-request key ranges where the padding allows, else a boolean
mask), npattn.transformers.attention computes; transformers' sdpa_mask draws the
same pattern as a (B, 1, L, S) boolean mask, and npattn.reference computes with
it. They must agree within npattn's own tolerance, on every kernel table.
"""

from __future__ import annotations

import numpy as np


def available() -> bool:
    """Whether PyTorch and transformers (and so npattn.transformers) import."""
    try:
        import npattn.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def problem(rng: np.random.Generator) -> dict:
    """One call of a layer's attention, as plain values (see the module's docstring)."""
    B, H_kv, group = (int(x) for x in rng.integers(1, 4, 3))
    L, past = int(rng.integers(1, 7)), int(rng.integers(0, 11))
    S, D = L + past, int(rng.choice([4, 8, 16, 33]))
    kind = str(rng.choice(["causal", "bidirectional", "sliding", "sliding both", "chunked", "table"]))
    padding = str(rng.choice(["none", "none", "left", "right", "hole"]))
    pad = None
    if padding != "none":
        pad = np.ones((B, S), bool)
        for b in range(B):
            n = int(rng.integers(0, S))  # tokens of padding
            if padding == "left":
                pad[b, :n] = False
            elif padding == "right":
                pad[b, S - n :] = False
            else:
                pad[b, rng.integers(0, S, n)] = False
    return {
        "B": B, "H_q": H_kv * group, "H_kv": H_kv, "L": L, "S": S, "past": past, "D": D,
        "kind": kind, "window": int(rng.integers(1, S + 2)), "chunk": int(rng.integers(1, 5)),
        "table": rng.random((S, S)) < 0.6, "padding": pad,
        "scaling": float(rng.choice([D**-0.5, 1.0, 0.1])),
        "softcap": None if rng.random() < 0.7 else float(rng.uniform(0.5, 20)),
        "sinks": None if rng.random() < 0.7 else rng.standard_normal(H_kv * group).astype(np.float32),
        "seed": int(rng.integers(2**31)),
    }  # fmt: skip


def mask_function(p: dict):
    """The transformers mask function of the case, and the local size its layer passes."""
    from transformers import masking_utils as mu

    kind = p["kind"]
    if kind == "causal":
        return mu.causal_mask_function, None
    if kind == "bidirectional":
        return mu.bidirectional_mask_function, None
    if kind == "sliding":
        return mu.sliding_window_causal_mask_function(p["window"]), p["window"]
    if kind == "sliding both":
        return mu.sliding_window_bidirectional_mask_function(p["window"]), p["window"]
    if kind == "chunked":
        import torch

        return mu.chunked_causal_mask_function(p["chunk"], torch.zeros(p["B"], dtype=torch.long)), p["chunk"]
    import torch

    table = torch.from_numpy(p["table"])

    def from_table(batch_idx, head_idx, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return mu.and_masks(mu.causal_mask_function, from_table), None


class _Layer:
    """What the attention function reads of a layer."""

    is_causal = True


def run(p: dict):
    """(npattn.transformers' result (B, H_q, L, D), transformers' mask (B, 1, L, S), the inputs)."""
    import torch
    from transformers.masking_utils import sdpa_mask

    import npattn.transformers as nt

    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["B"], p["H_q"], p["L"], p["D"], generator=g)
    k, v = (torch.randn(p["B"], p["H_kv"], p["S"], p["D"], generator=g) for _ in range(2))
    fn, local = mask_function(p)
    padding = None if p["padding"] is None else torch.from_numpy(p["padding"])
    made = nt.mask(p["B"], p["L"], p["S"], q_offset=p["past"], mask_function=fn, attention_mask=padding,
                   local_size=local)  # fmt: skip
    sinks = None if p["sinks"] is None else torch.from_numpy(p["sinks"])
    out, _ = nt.attention(_Layer(), q, k, v, made, scaling=p["scaling"], softcap=p["softcap"], s_aux=sinks)
    visible = sdpa_mask(p["B"], p["L"], p["S"], p["past"], 0, fn, attention_mask=padding, allow_is_causal_skip=False)
    return out.transpose(1, 2).numpy(), visible.numpy(), (q.numpy(), k.numpy(), v.numpy())


def check(p: dict) -> None:
    """The case's result against the reference over transformers' mask; raises AssertionError."""
    from tests.helpers import compare_with_nan, own_tolerance, reference_call

    got, visible, (q, k, v) = run(p)
    options = {"scale": p["scaling"], "mask": visible, "softcap": p["softcap"], "sinks": p["sinks"]}
    options = {name: x for name, x in options.items() if x is not None}
    want = reference_call(q, k, v, **options)
    rtol, atol = own_tolerance(q, k, v, got.dtype, **options)
    compare_with_nan(got, want, atol, rtol)


def describe(p: dict) -> str:
    shown = {name: (f"array{x.shape}" if isinstance(x, np.ndarray) else x) for name, x in p.items()}
    return "  " + "\n  ".join(f"{name} = {x!r}" for name, x in shown.items())

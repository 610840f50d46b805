"""Time npattn.sdpa against its CPU peers and the machine's sgemm ceiling.

One command, one run, the same thread count for every system::

    python benchmarks/bench.py --out benchmarks/results.json --plot benchmarks/results.png

Systems (all float32, causal attention aligned bottom-right unless said):

- ``npattn``  npattn.sdpa, ``threads=T``.
- ``numpy``   the tutorial's formula: scores = q @ k^T * scale + mask, softmax,
              @ v, GQA by reshape; NumPy's own OpenBLAS limited to T threads.
- ``torch``   torch.nn.functional.scaled_dot_product_attention, enable_gqa=True;
              is_causal=True only where L == S (its causal is top-left), an
              explicit bottom-right bool mask where L != S; torch.set_num_threads(T).
- ``mlx``     mx.fast.scaled_dot_product_attention on the CPU, mask="causal"
              (bottom-right); mx.eval forces the result.
- ``jax``     jax.nn.dot_product_attention, jitted, (B, L, H, D) layout prepared
              before timing; is_causal only where L == S (top-left), an explicit
              bool mask otherwise; block_until_ready.

Each group of cases with one thread count T runs in its own worker process,
pinned to T CPUs (sched_setaffinity) before anything is imported; each system is
also told T through whatever knob it has (benchmarks/README.md lists them). The
sgemm ceiling is a large sgemm through the very OpenBLAS that npattn loaded
(ctypes), at 1 thread and at T threads. Peak extra memory is measured in a fresh
process per case and system: peak RSS (VmHWM, reset through
/proc/self/clear_refs) minus RSS once inputs and output are allocated and touched.

The result: a JSON file with provenance, a PNG plot (benchmarks/plot.py) and a
Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SYSTEMS = ("npattn", "numpy", "torch", "mlx", "jax")
PEERS = SYSTEMS[1:]
LABELS = {"npattn": "npattn", "numpy": "NumPy", "torch": "PyTorch", "mlx": "MLX", "jax": "JAX"}
PACKAGES = {"npattn": "npattn", "numpy": "numpy", "torch": "torch", "mlx": "mlx", "jax": "jax"}
MEMORY_SYSTEMS = ("npattn", "numpy", "torch")  # measured in a fresh process per case
MiB, GiB = 2**20, 2**30

# ---------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------

MODELS = {
    # name: (H_q, H_kv, D)
    "Qwen3-4B": (32, 8, 128),
    "Qwen2-0.5B": (14, 2, 64),
    "GPT-2": (12, 12, 64),
    "MQA": (16, 1, 128),
}


@dataclass(frozen=True)
class Case:
    """One attention problem: float32, causal (bottom-right), q (B, H_q, L, D)."""

    id: str
    model: str
    B: int
    L: int
    S: int
    one_thread: bool = False  # run with 1 thread instead of the run's T
    timed: bool = True  # False: a memory-only case
    systems: tuple = SYSTEMS  # which systems this case is for

    @property
    def heads(self) -> tuple[int, int, int]:
        return MODELS[self.model]

    @property
    def label(self) -> str:
        h_q, h_kv, D = self.heads
        shape = f"L=S={self.L}" if self.L == self.S else f"L={self.L} S={self.S}"
        kind = "decode" if self.L == 1 else ("prefill" if self.L == self.S else "chunked prefill")
        text = f"{self.model} {h_q}/{h_kv}/{D} {kind} {shape}"
        if self.B != 1:
            text += f" B={self.B}"
        if self.one_thread:
            text += ", 1 thread"
        if not self.timed:
            text += " (memory)"
        return text

    @property
    def decode(self) -> bool:
        return self.L == 1

    @property
    def pairs(self) -> int:
        """(i, j) with j <= i + S - L: the query/key pairs the causal mask leaves visible."""
        L, S = self.L, self.S
        return sum(min(S, max(0, i + S - L + 1)) for i in range(L))

    @property
    def useful_flops(self) -> int:
        """4 B H_q pairs D: q @ k^T and p @ v over the visible pairs only."""
        h_q, _, D = self.heads
        return 4 * self.B * h_q * self.pairs * D

    @property
    def dense_flops(self) -> int:
        """What a system that computes every (i, j) pair does."""
        h_q, _, D = self.heads
        return 4 * self.B * h_q * self.L * self.S * D

    @property
    def kv_bytes(self) -> int:
        _, h_kv, D = self.heads
        return 2 * self.B * h_kv * self.S * D * 4

    @property
    def io_bytes(self) -> int:
        """q, k, v and the output, float32."""
        h_q, _, D = self.heads
        return 2 * self.B * h_q * self.L * D * 4 + self.kv_bytes

    @property
    def score_bytes(self) -> int:
        """One float32 (B, H_q, L, S) array: what the NumPy formula materialises."""
        return self.B * self.heads[0] * self.L * self.S * 4


def make_cases(quick: bool) -> list[Case]:
    """The issue's cases, or small ones for a smoke test (--quick)."""
    if quick:
        return [
            Case("qwen3-prefill-256", "Qwen3-4B", 1, 256, 256),
            Case("qwen2-prefill-256", "Qwen2-0.5B", 1, 256, 256),
            Case("gpt2-prefill-256", "GPT-2", 2, 256, 256),
            Case("qwen3-chunked-64-512", "Qwen3-4B", 1, 64, 512),
            Case("qwen3-decode-2048", "Qwen3-4B", 1, 1, 2048),
            Case("qwen3-decode-4096-b2", "Qwen3-4B", 2, 1, 4096),
            Case("mqa-decode-8192", "MQA", 1, 1, 8192),
            Case("qwen3-prefill-256-1t", "Qwen3-4B", 1, 256, 256, one_thread=True),
            Case("qwen3-memory-1024", "Qwen3-4B", 1, 1024, 1024, timed=False, systems=("npattn",)),
        ]
    return [
        Case("qwen3-prefill-512", "Qwen3-4B", 1, 512, 512),
        Case("qwen3-prefill-2048", "Qwen3-4B", 1, 2048, 2048),
        Case("qwen3-prefill-4096", "Qwen3-4B", 1, 4096, 4096),
        Case("qwen2-prefill-512", "Qwen2-0.5B", 1, 512, 512),
        Case("qwen2-prefill-2048", "Qwen2-0.5B", 1, 2048, 2048),
        Case("qwen2-prefill-4096", "Qwen2-0.5B", 1, 4096, 4096),
        Case("gpt2-prefill-1024-b4", "GPT-2", 4, 1024, 1024),
        Case("qwen3-chunked-512-4096", "Qwen3-4B", 1, 512, 4096),
        Case("qwen3-decode-8192", "Qwen3-4B", 1, 1, 8192),
        Case("qwen3-decode-32768-b4", "Qwen3-4B", 4, 1, 32768),
        Case("mqa-decode-65536", "MQA", 1, 1, 65536),
        Case("qwen3-prefill-2048-1t", "Qwen3-4B", 1, 2048, 2048, one_thread=True),
        # The NumPy formula would need 8 GiB of scores here: npattn only.
        Case("qwen3-memory-8192", "Qwen3-4B", 1, 8192, 8192, timed=False, systems=("npattn",)),
    ]


# ---------------------------------------------------------------------------
# Threads: pin the process first, then tell every library
# ---------------------------------------------------------------------------


def pin_process(threads: int) -> list[int]:
    """Restrict this process to `threads` CPUs and set the thread environment
    variables, before numpy, torch, mlx or jax is imported (their pools size
    themselves at start-up)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    if threads == 1:  # XLA's CPU client has no runtime knob; these make it single-threaded
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    return cpus


def npattn_dir() -> str:
    import npattn._core

    return os.path.dirname(os.path.abspath(npattn._core.__file__))


def limit_numpy_blas(threads: int) -> list[dict]:
    """Limit NumPy's BLAS (and any other BLAS/OpenMP pool found, except the
    OpenBLAS npattn carries: npattn runs that one single-threaded inside its
    own pool) to `threads`; returns threadpoolctl's view, or [] without it."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return []  # OPENBLAS_NUM_THREADS, set before numpy was imported, still holds
    ours = npattn_dir()
    controller = ThreadpoolController()
    for lib in controller.lib_controllers:
        if not os.path.abspath(lib.filepath).startswith(ours + os.sep):
            lib.set_num_threads(threads)
    return [lib.info() for lib in controller.lib_controllers]


# ---------------------------------------------------------------------------
# The sgemm ceiling, through the OpenBLAS npattn uses
# ---------------------------------------------------------------------------


class OpenBLAS:
    """The OpenBLAS library npattn's extension loaded, opened again with ctypes."""

    def __init__(self) -> None:
        from npattn import _core

        info = _core.blas_info()
        if info.startswith("scipy"):  # the bundled scipy-openblas32: prefixed names
            paths = sorted(glob.glob(os.path.join(npattn_dir(), "libscipy_openblas*.so*")))
            prefix = "scipy_"
        else:  # a system OpenBLAS build: find the library in this process's mappings
            paths = sorted(
                {p for p in mapped_files() if os.path.basename(p).startswith("libopenblas")}
            )
            prefix = ""
        if not paths:
            raise RuntimeError(f"cannot find the OpenBLAS library npattn uses ({info})")
        self.path = paths[0]
        lib = ctypes.CDLL(self.path)
        self.sgemm = getattr(lib, prefix + "cblas_sgemm")
        self.sgemm.restype = None
        self.sgemm.argtypes = [ctypes.c_int] * 6 + [
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self.set_num_threads = getattr(lib, prefix + "openblas_set_num_threads")
        self.set_num_threads.argtypes = [ctypes.c_int]
        self.get_num_threads = getattr(lib, prefix + "openblas_get_num_threads")
        self.get_num_threads.restype = ctypes.c_int

    def gflops(self, n: int, threads: int, repeats: int) -> dict:
        """Median GFLOP/s of C = A @ B, all (n, n) float32, on `threads` threads.
        OpenBLAS is left single-threaded afterwards, as npattn runs it."""
        import numpy as np

        rng = np.random.default_rng(1)
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        c = np.zeros((n, n), np.float32)
        row_major, no_trans = 101, 111
        call = partial(
            self.sgemm,
            row_major,
            no_trans,
            no_trans,
            n,
            n,
            n,
            1.0,
            a.ctypes.data,
            n,
            b.ctypes.data,
            n,
            0.0,
            c.ctypes.data,
            n,
        )
        self.set_num_threads(threads)
        try:
            times = time_calls(call, warmup=1, repeats=repeats, min_time=0.0)["times"]
        finally:
            self.set_num_threads(1)
        seconds = statistics.median(times)
        return {
            "n": n,
            "threads": threads,
            "ms": 1e3 * seconds,
            "times_ms": [1e3 * t for t in times],
            "gflops": 2 * n**3 / seconds / 1e9,
            "best_gflops": 2 * n**3 / min(times) / 1e9,
        }


def mapped_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]


# ---------------------------------------------------------------------------
# The systems: each returns (call, to_numpy) for a case, inputs prepared outside the clock
# ---------------------------------------------------------------------------


def make_inputs(case: Case, seed: int = 0):
    """q (B, H_q, L, D), k and v (B, H_kv, S, D), float32 N(0, 1), filled in place."""
    import numpy as np

    h_q, h_kv, D = case.heads
    rng = np.random.default_rng(seed)
    arrays = []
    for shape in ((case.B, h_q, case.L, D), (case.B, h_kv, case.S, D), (case.B, h_kv, case.S, D)):
        x = np.empty(shape, np.float32)
        rng.standard_normal(dtype=np.float32, out=x)
        arrays.append(x)
    return tuple(arrays)


def bottom_right_bool(L: int, S: int):
    """True where query i sees key j: j <= i + S - L."""
    import numpy as np

    return np.tri(L, S, S - L, dtype=bool)


def numpy_formula(q, k, v, scale, mask):
    """The tutorial's formula in float32 NumPy: the one `python -m npattn` times."""
    from npattn.__main__ import numpy_sdpa

    return numpy_sdpa(q, k, v, scale, mask)


def prepare(system: str, case: Case, q, k, v, threads: int) -> tuple[Callable, Callable, str]:
    """(call, to_numpy, note): call() computes and waits for the result;
    to_numpy(result) gives it as a (B, H_q, L, D) NumPy array."""
    import numpy as np

    scale = case.heads[2] ** -0.5
    L, S = case.L, case.S
    if system == "npattn":
        import npattn

        return partial(npattn.sdpa, q, k, v, scale, "causal", threads=threads), np.asarray, ""
    if system == "numpy":
        import npattn

        mask = npattn.causal_mask(L, S, np.float32) if L > 1 else None  # decode sees every key
        return partial(numpy_formula, q, k, v, scale, mask), np.asarray, ""
    if system == "torch":
        import torch
        import torch.nn.functional as F

        qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
        kw: dict[str, Any] = {"scale": scale, "enable_gqa": True}
        if L == S:
            kw["is_causal"] = True
            note = ""
        elif L > 1:
            kw["attn_mask"] = torch.from_numpy(bottom_right_bool(L, S))
            note = "explicit bottom-right bool mask (is_causal is top-left)"
        else:
            note = ""  # decode: the one query sees every key, no mask

        def call():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(qt, kt, vt, **kw)

        return call, lambda out: out.numpy(), note
    if system == "mlx":
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
        qm, km, vm = (mx.array(x) for x in (q, k, v))
        mx.eval(qm, km, vm)
        mask = "causal" if L > 1 else None  # MLX's "causal" is bottom-right

        def call():
            out = mx.fast.scaled_dot_product_attention(qm, km, vm, scale=scale, mask=mask)
            mx.eval(out)
            return out

        return call, lambda out: np.array(out), ""
    if system == "jax":
        import jax
        import jax.numpy as jnp

        cpu = jax.devices("cpu")[0]
        # JAX's layout is (B, T, N, H): transpose once, outside the clock
        qj, kj, vj = (jax.device_put(jnp.asarray(x.transpose(0, 2, 1, 3)), cpu) for x in (q, k, v))
        kw = {"scale": scale}
        note = ""
        if L == S:
            kw["is_causal"] = True
        elif L > 1:
            kw["mask"] = jax.device_put(jnp.asarray(bottom_right_bool(L, S)[None, None]), cpu)
            note = "explicit bottom-right bool mask (is_causal is top-left)"
        fn = jax.jit(partial(jax.nn.dot_product_attention, **kw)).lower(qj, kj, vj).compile()

        def call():
            return fn(qj, kj, vj).block_until_ready()

        return call, lambda out: np.asarray(out).transpose(0, 2, 1, 3), note
    raise ValueError(f"unknown system {system!r}")


def set_threads(system: str, threads: int) -> dict:
    """Tell `system` to use `threads` threads where it has a knob; report what it says."""
    if system == "torch":
        import torch

        torch.set_num_threads(threads)
        return {"torch.get_num_threads()": torch.get_num_threads()}
    if system == "jax":
        return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    return {}


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def time_calls(
    call: Callable, warmup: int, repeats: int, min_time: float, max_call: float = math.inf
) -> dict:
    """Warm up, then time at least `repeats` calls (more, up to 50, until
    `min_time` seconds are measured). A warm-up slower than `max_call` seconds
    is taken as the only sample."""
    result = None
    for _ in range(max(warmup, 1)):
        start = time.perf_counter()
        result = call()
        first = time.perf_counter() - start
        if first > max_call:
            return {"times": [first], "result": result, "single": True}
    del result
    times: list[float] = []
    result = None
    while len(times) < repeats or (sum(times) < min_time and len(times) < 50):
        del result
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return {"times": times, "result": result, "single": False}


def worker(spec: dict) -> dict:
    """Time spec["cases"] with spec["threads"] threads; runs in its own pinned process."""
    threads = spec["threads"]
    cpus = pin_process(threads)
    import npattn  # noqa: F401  (loads npattn's OpenBLAS)
    import numpy as np

    blas = OpenBLAS()
    out: dict[str, Any] = {"threads": threads, "cpus": cpus, "openblas_path": blas.path}
    ceiling_n = spec["ceiling_n"]
    ceilings = {}
    for t in spec["ceiling_threads"]:
        ceilings[str(t)] = blas.gflops(ceiling_n, t, spec["repeats"])
        log(f"  sgemm {ceiling_n}^3 on {t} thread(s): {ceilings[str(t)]['gflops']:.1f} GFLOP/s")
    out["ceiling"] = ceilings
    time.sleep(spec["settle"])

    out["threadpools"] = limit_numpy_blas(threads)
    out["thread_knobs"] = {}
    rates: dict[tuple, float] = {}  # (system, decode) -> dense GFLOP/s of the last case run
    # A warm-up call slower than max_call is the only sample; --skip-slow lowers the bar.
    max_call = (
        min(spec["max_call"], spec["slow_seconds"]) if spec["skip_slow"] else spec["max_call"]
    )
    cases_out = {}
    for c in spec["cases"]:
        case = Case(**{**c, "systems": tuple(c["systems"])})
        log(f"{case.label}  [{threads} thread(s)]")
        q, k, v = make_inputs(case)
        reference = None
        results = {}
        for system in spec["systems"]:
            if system not in case.systems:
                continue
            skip = skip_reason(system, case, spec, rates)
            if skip:
                results[system] = {"status": "skipped", "note": skip}
                log(f"    {LABELS[system]:<8} skipped: {skip}")
                continue
            try:
                out["thread_knobs"].setdefault(system, set_threads(system, threads))
                call, to_numpy, note = prepare(system, case, q, k, v, threads)
                timing = time_calls(
                    call, spec["warmup"], spec["repeats"], spec["min_time"], max_call
                )
                got = to_numpy(timing.pop("result"))
                if system == "npattn":
                    reference = got
                diff = None
                if reference is not None and system != "npattn":
                    diff = float(np.abs(got.astype(np.float32) - reference).max())
                del got, call
            except Exception as exc:  # noqa: BLE001 -- one system failing must not end the run
                results[system] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
                log(f"    {LABELS[system]:<8} ERROR {type(exc).__name__}: {exc}")
                continue
            finally:
                gc.collect()
            times_ms = [1e3 * t for t in timing["times"]]
            ms = statistics.median(times_ms)
            if timing["single"]:
                note = "; ".join(filter(None, [note, f"1 run: one call took > {max_call:g} s"]))
            results[system] = {
                "status": "ok",
                "ms": ms,
                "min_ms": min(times_ms),
                "runs": len(times_ms),
                "times_ms": times_ms,
                "max_abs_diff_vs_npattn": diff,
                "note": note,
            }
            rates[(system, case.decode)] = case.dense_flops / (ms / 1e3) / 1e9
            extra = f"  (max|diff| vs npattn {diff:.1e})" if diff is not None else ""
            log(f"    {LABELS[system]:<8} {ms:10.2f} ms  x{len(times_ms)}{extra}")
            time.sleep(spec["settle"])  # let this system's spinning threads go to sleep
        cases_out[case.id] = results
        del q, k, v, reference
        gc.collect()
    out["cases"] = cases_out
    out["thread_knobs"] = {
        s: {k: str(v) for k, v in d.items()} for s, d in out["thread_knobs"].items()
    }
    return out


def skip_reason(system: str, case: Case, spec: dict, rates: dict) -> str:
    """Why `system` should not run `case`, or ''."""
    if system == "numpy" and case.score_bytes > spec["numpy_max_bytes"]:
        return (
            f"would materialise {case.score_bytes / GiB:.1f} GiB of scores "
            f"(limit {spec['numpy_max_bytes'] / GiB:.1f} GiB)"
        )
    if system != "npattn" and spec["skip_slow"] and (system, case.decode) in rates:
        predicted = case.dense_flops / rates[(system, case.decode)] / 1e9
        if predicted > spec["slow_seconds"]:
            return (
                f"--skip-slow: about {predicted:.2g} s per call, predicted from the previous case"
            )
    return ""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Memory: one fresh process per case and system
# ---------------------------------------------------------------------------


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_worker(spec: dict) -> dict:
    """Peak RSS during one call minus RSS with inputs (and, for npattn, the
    output) allocated and touched; a result the system allocates itself is
    subtracted, so every system is charged only for what it needs beyond
    inputs and output. A mask the formula or PyTorch takes is an input."""
    threads = spec["threads"]
    pin_process(threads)
    import npattn
    import numpy as np

    system = spec["system"]
    case = Case(**{**spec["case"], "systems": tuple(spec["case"]["systems"])})
    q, k, v = make_inputs(case)
    h_q, _, D = case.heads
    scale = D**-0.5
    out_bytes = case.B * h_q * case.L * D * 4
    if system == "npattn":
        out = np.empty((case.B, h_q, case.L, D), np.float32)
        out.fill(0)  # touch every page
        call = partial(npattn.sdpa, q, k, v, scale, "causal", out=out, threads=threads)
        charged_out = 0
    elif system == "numpy":
        limit_numpy_blas(threads)
        mask = npattn.causal_mask(case.L, case.S, np.float32) if case.L > 1 else None
        call = partial(numpy_formula, q, k, v, scale, mask)
        charged_out = out_bytes
    elif system == "torch":
        import torch

        torch.set_num_threads(threads)
        call, _, _ = prepare("torch", case, q, k, v, threads)
        charged_out = out_bytes
    else:
        raise ValueError(system)
    gc.collect()
    baseline = proc_status_kib("VmRSS") * 1024
    try:  # "5" resets the peak (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = proc_status_kib("VmHWM") * 1024
    del result
    extra = max(0, peak - baseline - charged_out)
    return {
        "status": "ok",
        "extra_bytes": extra,
        "extra_mib": extra / MiB,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "hwm_reset": reset,
        "one_call_ms": 1e3 * seconds,
        "threads": threads,
    }


# ---------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------


def run_child(mode: str, spec: dict, timeout: float | None = None) -> dict:
    """Run this script as `--_worker` or `--_memory` on spec; its stderr is shown."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), mode, spec_path],
            stdout=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0 or not os.path.exists(result_path):
            return {"status": "error", "note": f"worker exited with status {proc.returncode}"}
        with open(result_path) as f:
            return json.load(f)


def child_main(mode: str, spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "--_worker":
        result = worker(spec)
    else:
        try:
            result = memory_worker(spec)
        except MemoryError:
            result = {"status": "error", "note": "MemoryError"}
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    return 0


def installed(system: str) -> str | None:
    """The installed version of a system's package, or None."""
    if importlib.util.find_spec(PACKAGES[system]) is None:
        return None
    try:
        return importlib.metadata.version(PACKAGES[system])
    except importlib.metadata.PackageNotFoundError:
        return "?"


def provenance(threads: int) -> dict:
    import npattn
    import numpy as np
    from npattn import _core

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", REPO, *args], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    cpu_model = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu_model:
                    cpu_model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = [
                        x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "fma"))
                    ]
    except OSError:
        pass
    versions = {s: installed(s) for s in SYSTEMS}
    versions["npattn"] = npattn.__version__
    versions["numpy"] = np.__version__
    for extra in ("jaxlib", "mlx-cpu", "threadpoolctl", "matplotlib"):
        try:
            versions[extra] = importlib.metadata.version(extra)
        except importlib.metadata.PackageNotFoundError:
            versions[extra] = None
    mem_total = ""
    try:
        with open("/proc/meminfo") as f:
            mem_total = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "npattn_file": npattn.__file__,
        "versions": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "blas_info": _core.blas_info(),
        "simd": _core.simd() if hasattr(_core, "simd") else None,
        "cpu_model": cpu_model,
        "cpu_flags": flags,
        "cpus_available": len(os.sched_getaffinity(0)),
        "memory": mem_total,
        "threads": threads,
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if k.startswith(("OPENBLAS", "OMP_", "MKL_", "NPATTN", "XLA_"))
        },
    }


def derive(case: Case, results: dict, ceiling: dict) -> dict:
    """npattn's GFLOP/s, % of the ceiling, K/V GB/s; every system's ratio to npattn."""
    d: dict[str, Any] = {}
    ours = results.get("npattn", {})
    for r in results.values():
        if r.get("status") == "ok":
            r["gflops"] = case.useful_flops / (r["ms"] / 1e3) / 1e9
            if case.decode:
                r["kv_gbs"] = case.kv_bytes / (r["ms"] / 1e3) / 1e9
    if ours.get("status") == "ok":
        t = "1" if case.one_thread else max(ceiling, key=int)
        d["ceiling_threads"] = int(t)
        d["pct_ceiling"] = 100 * ours["gflops"] / ceiling[t]["gflops"]
        for system, r in results.items():
            if system != "npattn" and r.get("status") == "ok":
                r["ratio_to_npattn"] = r["ms"] / ours["ms"]
    return d


def fmt_ms(x: float) -> str:
    return (
        f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"
    )


def markdown(data: dict) -> str:
    """The README's table: one row per case, peers as 'ms (ratio x)'."""
    systems = [s for s in data["systems"] if s != "npattn"]
    head = ["case", "threads", "npattn ms", "GFLOP/s", "% sgemm", "K/V GB/s"]
    head += [f"{LABELS[s]} ms (× npattn)" for s in systems]
    mem_systems = [s for s in MEMORY_SYSTEMS if s in data["systems"]]
    head += [f"extra MiB {LABELS[s]}" for s in mem_systems]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    for c in data["cases"]:
        case = Case(**{**c["case"], "systems": tuple(c["case"]["systems"])})
        res, mem, der = c["results"], c["memory"], c["derived"]
        if not res and not mem:
            continue  # a memory-only case run with --no-memory
        ours = res.get("npattn", {})
        row = [case.label.replace(" (memory)", "").replace(", 1 thread", ""), str(c["threads"])]
        if not case.timed:
            row += ["—"] * 4
        elif ours.get("status") == "ok":
            row += [
                fmt_ms(ours["ms"]),
                f"{ours['gflops']:.0f}",
                f"{der['pct_ceiling']:.0f}%" if not case.decode else "—",
                f"{ours['kv_gbs']:.1f}" if case.decode else "—",
            ]
        else:
            row += [f"error {note(ours.get('note', '?'))}"] + ["—"] * 3
        for s in systems:
            r = res.get(s)
            if not case.timed or s not in case.systems or r is None:
                row.append("—")
            elif r["status"] == "ok":
                cell = fmt_ms(r["ms"])
                if "ratio_to_npattn" in r:
                    cell += (
                        f" ({r['ratio_to_npattn']:.2f}×)"
                        if r["ratio_to_npattn"] < 10
                        else f" ({r['ratio_to_npattn']:.0f}×)"
                    )
                if r.get("note"):
                    cell += " " + note(f"{LABELS[s]}: {r['note']}")
                row.append(cell)
            else:
                row.append(f"{r['status']} {note(LABELS[s] + ': ' + r['note'])}")
        for s in mem_systems:
            m = mem.get(s)
            if m is None:
                row.append("—")
            elif m.get("status") == "ok":
                row.append(f"{m['extra_mib']:.1f}")
            else:
                row.append(f"{m.get('status')} {note(LABELS[s] + ': ' + m.get('note', ''))}")
        lines.append("| " + " | ".join(row) + " |")

    p = data["provenance"]
    ceil = data["ceiling"]
    ceil_text = ", ".join(
        f"{v['gflops']:.0f} GFLOP/s on {t} thread{'s' * (t != '1')}"
        for t, v in sorted(ceil.items(), key=lambda kv: int(kv[0]))
    )
    n = next(iter(ceil.values()))["n"] if ceil else 0
    out = "\n".join(lines)
    out += (
        f"\n\nfloat32, causal (bottom-right), B=1 unless said; median of "
        f"≥ {data['settings']['repeats']} runs after a warm-up. sgemm ceiling "
        f"({n}³ through npattn's own OpenBLAS): {ceil_text}. "
        "GFLOP/s counts only the visible query/key pairs (4·B·H_q·pairs·D); % sgemm is against the "
        "ceiling at the case's thread count. × npattn: a peer's time over npattn's (> 1: npattn is "
        "faster). extra MiB: peak RSS during one call beyond inputs and output.\n"
    )
    out += (
        f"\n{p['cpu_model']}, {p['cpus_available']} CPUs; npattn {p['versions']['npattn']} "
        f"({p['git_commit'][:10]}{', dirty' if p['git_dirty'] else ''}), {p['blas_info']}, "
        f"simd {p['simd']}; NumPy {p['versions']['numpy']}"
    )
    for s in ("torch", "mlx", "jax"):
        if p["versions"].get(s):
            out += f", {LABELS[s]} {p['versions'][s]}"
    out += f"; {p['date']}; load average {p['loadavg_before'][0]:.1f} before the run.\n"
    if notes:
        out += "\n" + "\n".join(f"[{i + 1}] {t}" for i, t in enumerate(notes)) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads for every system (default: the CPUs this process may use)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls at least (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument(
        "--min-time",
        type=float,
        default=1.0,
        help="repeat fast calls until this many seconds are measured (max 50 calls)",
    )
    parser.add_argument(
        "--max-call",
        type=float,
        default=30.0,
        help="a warm-up slower than this many seconds is the only sample",
    )
    parser.add_argument(
        "--skip-slow",
        action="store_true",
        help="skip a peer when its previous case predicts more than --slow-seconds "
        "per call, time a call slower than that once only, and skip the NumPy formula "
        "beyond 0.5 GiB of scores",
    )
    parser.add_argument(
        "--slow-seconds", type=float, default=5.0, help="what --skip-slow calls slow (default 5)"
    )
    parser.add_argument(
        "--numpy-max-gib",
        type=float,
        default=4.0,
        help="skip the NumPy formula when one scores array exceeds this",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    parser.add_argument("--only", default="", help="run only cases whose id contains this")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.3,
        help="seconds to sleep between systems so idle pools stop spinning",
    )
    args = parser.parse_args(argv)

    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SYSTEMS]
    if bad or "npattn" not in wanted:
        parser.error(
            f"--systems must include npattn and name only {', '.join(SYSTEMS)}; got {args.systems}"
        )
    missing = {s: "not installed" for s in wanted if installed(s) is None}
    systems = [s for s in wanted if s not in missing]
    cases = [c for c in make_cases(args.quick) if args.only in c.id]
    if not cases:
        parser.error(f"no case id contains {args.only!r}")
    numpy_max = 0.5 * GiB if args.skip_slow else args.numpy_max_gib * GiB

    spec_common = {
        "systems": systems,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "min_time": args.min_time,
        "max_call": args.max_call,
        "skip_slow": args.skip_slow,
        "slow_seconds": args.slow_seconds,
        "numpy_max_bytes": numpy_max,
        "settle": args.settle,
        "ceiling_n": 2048 if args.quick else 4096,
    }
    log(
        f"npattn benchmark: {len(cases)} cases, systems {', '.join(systems)}, "
        f"{args.threads} thread(s){'; missing: ' + ', '.join(missing) if missing else ''}"
    )

    load_before = os.getloadavg()  # other work on the machine shows up in every number
    # Timing: one pinned worker process per thread count.
    ceiling: dict[str, dict] = {}
    timed: dict[str, dict] = {}
    workers: dict[int, dict] = {}
    groups: dict[int, list[Case]] = {}
    for c in cases:
        if c.timed:
            groups.setdefault(1 if c.one_thread else args.threads, []).append(c)
    for threads in sorted(groups, reverse=True):
        log(f"\n== timing on {threads} thread(s), in a worker process ==")
        w = run_child(
            "--_worker",
            {
                **spec_common,
                "threads": threads,
                "cases": [asdict(c) for c in groups[threads]],
                "ceiling_threads": sorted({1, threads} - {int(t) for t in ceiling}),
            },
        )
        if w.get("status") == "error":
            log(f"worker failed: {w['note']}")
            return 1
        workers[threads] = {
            k: w[k] for k in ("cpus", "openblas_path", "threadpools", "thread_knobs")
        }
        for t, v in w["ceiling"].items():
            ceiling[t] = v
        timed.update(w["cases"])

    # Memory: a fresh process per case and system.
    memory: dict[str, dict] = {}
    if not args.no_memory:
        log("\n== peak extra memory, one process per case and system ==")
        for c in cases:
            threads = 1 if c.one_thread else args.threads
            memory[c.id] = {}
            for s in MEMORY_SYSTEMS:
                if s not in systems or s not in c.systems:
                    continue
                if s == "numpy" and c.score_bytes > numpy_max:
                    memory[c.id][s] = {
                        "status": "skipped",
                        "note": f"would materialise {c.score_bytes / GiB:.1f} GiB of scores",
                    }
                    continue
                m = run_child("--_memory", {"case": asdict(c), "system": s, "threads": threads})
                memory[c.id][s] = m
                shown = f"{m['extra_mib']:8.1f} MiB" if m.get("status") == "ok" else m.get("note")
                log(f"  {c.label:<52} {LABELS[s]:<8} {shown}")

    data: dict[str, Any] = {
        "provenance": {
            **provenance(args.threads),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "settings": {
            **{k: v for k, v in spec_common.items() if k != "systems"},
            "quick": args.quick,
            "threads": args.threads,
        },
        "systems": systems,
        "missing": missing,
        "ceiling": ceiling,
        "workers": {str(k): v for k, v in workers.items()},
        "cases": [],
    }
    for c in cases:
        results = timed.get(c.id, {})
        entry = {
            "case": asdict(c),
            "label": c.label,
            "threads": 1 if c.one_thread else args.threads,
            "pairs": c.pairs,
            "useful_gflop": c.useful_flops / 1e9,
            "kv_bytes": c.kv_bytes,
            "results": results,
            "memory": memory.get(c.id, {}),
        }
        entry["derived"] = derive(c, results, ceiling) if c.timed else {}
        data["cases"].append(entry)
    table = markdown(data)
    data["markdown"] = table
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        log(f"wrote {args.out}")
    if args.plot:
        sys.path.insert(0, HERE)
        from plot import plot

        plot(data, args.plot)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--_worker", "--_memory"):
        sys.exit(child_main(sys.argv[1], sys.argv[2]))
    sys.exit(main())

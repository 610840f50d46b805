"""How the benchmark measures: threads pinned before anything is imported,
warm-up then the median of calls timed in alternating rounds, the sgemm ceiling through npattn's own
OpenBLAS, the memory's streaming-read bandwidth, peak memory in a fresh
process, and a model's decode loop."""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from cases import DECODE_LOOP, Case, model_heads
from systems import SYSTEMS

MiB, GiB = 2**20, 2**30


def pin_process(threads: int) -> list[int]:
    """Restrict this process to `threads` CPUs and set the thread environment
    variables, before numpy, torch, mlx or jax sizes its pools."""
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


def limit_blas_pools(threads: int) -> list[dict]:
    """Limit NumPy's BLAS and any other BLAS/OpenMP pool (threadpoolctl) to `threads`,
    except the OpenBLAS npattn carries, which npattn runs single-threaded inside its own
    pool; returns threadpoolctl's view, or [] without it."""
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


def time_calls(call: Callable, warmup: int = 1, repeats: int = 5, min_time: float = 0.5, max_calls: int = 2000) -> dict:
    """Warm up, then time at least `repeats` calls, more (up to max_calls) until
    `min_time` seconds are measured; the median and all the times, in ms."""
    for _ in range(max(warmup, 1)):
        call()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_time and len(times) < max_calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    ms = [1e3 * t for t in times]
    return {"ms": statistics.median(ms), "min_ms": min(ms), "runs": len(ms), "times_ms": ms if len(ms) <= 50 else []}


def interleaved(calls: dict, rounds: int = 7, min_time: float = 0.3) -> dict:
    """Median ms of each plain call, timed by time_rounds in `rounds` alternating
    rounds (at least one call a round); the first exception is raised."""
    timed = time_rounds({name: (clocked(call), rounds) for name, call in calls.items()}, min_time, rounds=rounds)
    for t in timed.values():
        if isinstance(t, Exception):
            raise t
    return {name: t["ms"] for name, t in timed.items()}


def suite_args(doc: str | None):
    """The command line of a suite script (--threads, --out, --quick), the BLAS
    pools limited to --threads."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = parser.parse_args()
    limit_blas_pools(args.threads)
    return args


def finish_suite(args, data: dict, markdown: Callable[[dict], str]) -> None:
    """Prints a suite script's table and writes its record to --out."""
    print(markdown(data))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


def dtype_of(name: str):
    """The NumPy dtype of `name`, bfloat16 through ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def mapped_library(name: str, home: str, maps: str = "/proc/self/maps") -> str | None:
    """The mapped library whose file is `name` (libname.so, libname.so.0, libname.dylib,
    not libname64_.so: NumPy's libscipy_openblas64_ is another library), the one
    under `home` if several are mapped; None if none is."""
    with open(maps) as f:  # the libraries as this process mapped them
        mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    paths = sorted(p for p in mapped if os.path.basename(p).split(".")[0] == name)
    ours = [p for p in paths if os.path.abspath(p).startswith(home + os.sep)]
    return (ours or paths or [None])[0]


class OpenBLAS:
    """The OpenBLAS library npattn's extension loaded, opened again with ctypes."""

    def __init__(self) -> None:
        from npattn import _core

        info = _core.blas_info()
        # the bundled scipy-openblas32 has prefixed names; a system build does not
        name, prefix = ("libscipy_openblas", "scipy_") if info.startswith("scipy") else ("libopenblas", "")
        self.path = mapped_library(name, npattn_dir())
        if self.path is None:
            raise RuntimeError(f"cannot find the OpenBLAS library npattn uses ({info})")
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

    def gflops(self, n: int, threads: int) -> dict:
        """Median GFLOP/s of C = A @ B, all (n, n) float32, on `threads` threads.
        OpenBLAS is left single-threaded afterwards, as npattn runs it."""
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
            t = time_calls(call, repeats=5, min_time=0.0)
        finally:
            self.set_num_threads(1)
        return {"n": n, "threads": threads, "ms": t["ms"], "gflops": 2 * n**3 / (t["ms"] / 1e3) / 1e9}


def fma_peak(threads: int, seconds: float = 0.2, loop: str = "fma") -> dict:
    """The float32 FMA peak of `threads` cores for npattn's kernel table in use: its
    register-only FMA loop (npattn._core.fma_peak), one per Python thread at once
    (the GIL released), their GFLOP/s summed; median of 3. `loop` "bf16" or "tile":
    the bfloat16 ceilings instead (vdpbf16ps, the AMX tiles' tdpbf16ps; 0 where
    the table has none)."""
    from npattn import _core

    peak = getattr(_core, f"{loop}_peak")

    def one(out, i):
        out[i] = peak(seconds)

    runs = []
    for _ in range(3):
        got = [0.0] * threads
        workers = [threading.Thread(target=one, args=(got, i)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        runs.append(sum(got))
    return {"threads": threads, "gflops": statistics.median(runs), "kernels": _core.simd()}


def read_bandwidth(threads: int, gib: float = 1.0) -> dict:
    """The memory's streaming-read bandwidth: np.maximum.reduce over 1 GiB of float32
    (far beyond the caches), one part per thread, each part in its own Python thread
    (NumPy releases the GIL in the loop); median of 5."""
    a = np.ones(int(gib * GiB) // 4, np.float32)
    parts = np.array_split(a, threads)
    times = []
    for _ in range(6):
        workers = [threading.Thread(target=np.maximum.reduce, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    return {"threads": threads, "gbs": a.nbytes / seconds / 1e9, "bytes": a.nbytes}


def inputs(case: Case, seed: int = 0) -> tuple:
    """q (B, H_q, L, D), k and v (B, H_kv, S, D), float32 N(0, 1)."""
    h_q, h_kv, D = case.heads
    rng = np.random.default_rng(seed)
    shapes = ((case.B, h_q, case.L, D), (case.B, h_kv, case.S, D), (case.B, h_kv, case.S, D))
    return tuple(rng.standard_normal(s, dtype=np.float32) for s in shapes)


def clocked(call: Callable) -> Callable[[], float]:
    """`call`, returning the seconds it took."""

    def run() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return run


def prepare_case(system_name: str, case: Case, threads: int) -> tuple[Callable[[], float], np.ndarray, int]:
    """One system on one case, set up and run once: a call that runs it again and
    returns its seconds, its result (as NumPy, for the check), and the fewest calls
    to time."""
    system = SYSTEMS[system_name]
    q, k, v = (system.native(x) for x in inputs(case))
    if case.backward:
        forward, backward = system.backward(threads)
        out, saved = forward(q, k, v)
        dout = system.native(np.random.default_rng(1).standard_normal(tuple(out.shape), dtype=np.float32))
        if system_name == "npattn":
            return clocked(partial(backward, dout, q, k, v, out, saved)), np.asarray(out), 5

        def call() -> float:  # autograd needs a fresh graph each time: the forward is outside the clock
            fresh_out, fresh_saved = forward(q, k, v)
            start = time.perf_counter()
            backward(dout, q, k, v, fresh_out, fresh_saved)
            return time.perf_counter() - start

        return call, np.asarray(out.detach().numpy()), 5
    fn = system.attention(
        case.L, case.S, threads, window=case.window, softcap=case.softcap, causal=case.mask == "causal"
    )
    result = system.to_numpy(fn(q, k, v))  # first, so that a system that fails is never timed
    fewest = 5 if case.flops > 1e9 else 11
    if hasattr(fn, "timed"):  # a call that sets up each run outside the clock and times the rest
        return partial(fn.timed, q, k, v), result, fewest
    return clocked(partial(fn, q, k, v)), result, fewest


def time_rounds(calls: dict, min_time: float, rounds: int = 3, settle: float = 0.0, max_calls: int = 2000) -> dict:
    """Calls prepared by prepare_case ({name: (call, fewest)}), warmed up, then timed
    in `rounds` alternating rounds, so that drift on a shared machine hits every
    system alike: a round runs each call in turn until min_time / rounds seconds and
    its share of the fewest calls are measured, then sleeps `settle` seconds (idle
    pools stop spinning). Per name the median and all the times, in ms, or the
    exception that stopped it."""
    seconds: dict = {name: [] for name in calls}
    failed: dict = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (call, fewest) in calls.items():
            if name in failed:
                continue
            n, spent = 0, 0.0
            try:
                while n < (1 if r == 0 else -(-fewest // rounds)) or (
                    r > 0 and spent < min_time / rounds and n < max_calls // rounds
                ):
                    t = call()
                    n, spent = n + 1, spent + t
                    if r > 0:
                        seconds[name].append(t)
            except Exception as exc:
                failed[name] = exc
            time.sleep(settle)
    out: dict = {}
    for name, times in seconds.items():
        if name in failed:
            out[name] = failed[name]
            continue
        ms = [1e3 * t for t in times]
        out[name] = {
            "ms": statistics.median(ms),
            "min_ms": min(ms),
            "runs": len(ms),
            "times_ms": ms if len(ms) <= 50 else [],
        }
    return out


def decode_loop(system_name: str, threads: int, repeats: int = 3) -> dict:
    """DECODE_LOOP's attention, as a model calls it: per layer a preallocated KV cache
    (prompt + new tokens long) into which each step writes its row, and attention over
    the views of the rows written so far. Seconds of attention for the prompt's
    prefill and for the decode steps, the best of `repeats` runs."""
    system = SYSTEMS[system_name]
    h_q, h_kv, D = model_heads(DECODE_LOOP["model"])
    layers, prompt, new = DECODE_LOOP["layers"], DECODE_LOOP["prompt"], DECODE_LOOP["new_tokens"]
    rng = np.random.default_rng(3)
    total = prompt + new
    caches = [
        (
            rng.standard_normal((1, h_kv, total, D), dtype=np.float32),
            rng.standard_normal((1, h_kv, total, D), dtype=np.float32),
        )
        for _ in range(layers)
    ]
    native = [(system.native(k), system.native(v)) for k, v in caches]
    q_prompt = system.native(rng.standard_normal((1, h_q, prompt, D), dtype=np.float32))
    q_step = system.native(rng.standard_normal((1, h_q, 1, D), dtype=np.float32))
    prefill_fn = system.attention(prompt, prompt, threads)
    step_fn = system.attention(1, prompt + 1, threads)  # decode: the one query sees every key
    best = None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        for k, v in native:
            prefill_fn(q_prompt, k[:, :, :prompt], v[:, :, :prompt])
        t_prefill = time.perf_counter() - start
        t_decode = 0.0
        for t in range(prompt, total):
            start = time.perf_counter()
            for k, v in native:
                step_fn(q_step, k[:, :, : t + 1], v[:, :, : t + 1])
            t_decode += time.perf_counter() - start
        if best is None or t_prefill + t_decode < best[0] + best[1]:
            best = (t_prefill, t_decode)
    return {"prefill_s": best[0], "decode_s": best[1], "total_s": sum(best), "calls": layers * (1 + new)}


def peak_memory(system_name: str, case: Case, threads: int) -> dict:
    """Peak RSS during one call minus RSS with inputs and output allocated and touched
    (VmHWM reset through /proc/self/clear_refs); run in a fresh process."""
    import npattn

    q, k, v = inputs(case)
    h_q, _, D = case.heads
    out_bytes = case.B * h_q * case.L * D * 4
    if system_name == "npattn":
        out = np.ones((case.B, h_q, case.L, D), np.float32)  # every page touched
        call = partial(npattn.sdpa, q, k, v, out=out, threads=threads)
        charged_out = 0
    else:
        system = SYSTEMS[system_name]
        system.set_threads(threads)
        fn = system.attention(case.L, case.S, threads)
        q, k, v = (system.native(x) for x in (q, k, v))
        call = partial(fn, q, k, v)
        charged_out = out_bytes

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    gc.collect()
    baseline = status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    result = call()
    peak = status_kib("VmHWM") * 1024
    del result
    extra = max(0, peak - baseline - charged_out)
    return {"extra_mib": extra / MiB, "threads": threads}


def check_close(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| (each system's result against npattn's), NaN-safe."""
    if got.shape != want.shape:
        return math.inf
    return float(np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))

"""Half precision: float16 and bfloat16 inputs against npattn's float32 and PyTorch.

    python benchmarks/half.py [--threads T] [--out benchmarks/results/half.json] [--quick]

Each figure is a ratio within one run, of medians over interleaved rounds (the
calls of one row alternate, so that drift on a shared machine hits them all):

- **decode** (L = 1), Qwen3-4B and Qwen2-0.5B heads, S = 1024 .. 32768: npattn
  with float32, float16 and bfloat16 q, k, v (bfloat16 also under
  ``precision="fast"``), and a float32 q over each half cache; PyTorch's
  ``scaled_dot_product_attention`` in float32 and bfloat16.
  GB/s counts the bytes of K and V (half of float32's for a half cache), read
  against the streaming-read bandwidth measured in the same run;
- **prefill** (L = S, causal), Qwen3-4B heads, S = 2048 (and 4096 on 8 threads
  or more): npattn float32, float16 and bfloat16 under ``precision="highest"``
  and ``"fast"``; PyTorch float32 and bfloat16. GFLOP/s counts the visible
  pairs, 4 D flops each;
- **backward** (``sdpa_backward`` of that prefill), Qwen3-4B heads, L = S =
  2048: npattn float32, and bfloat16 ``q``, ``k``, ``v`` and ``dout`` under
  both precisions (PyTorch's autograd runs its forward pass again and is not
  timed here). GFLOP/s counts the five products, 10 D flops per pair.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import measure
import npattn
import report
from npattn.testing import MODEL_HEADS


def torch_sdpa(threads: int):
    """PyTorch's SDPA on NumPy inputs converted once (None without PyTorch)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def prepare(q, k, v, dtype, causal):
        tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).to(getattr(torch, dtype)) for x in (q, k, v))
        return lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)

    return prepare


def record(model: str, S: int, ms: dict, unit: str, amount: dict) -> dict:
    """A row of the record: each system's ms, its rate in `unit` (its amount, bytes
    or flops, per ms / 1e6: GB/s or GFLOP/s) and npattn float32's time over its own."""
    base = ms["npattn float32"]
    rates = {n: {"ms": t, unit: amount[n] / t / 1e6, "vs_npattn_f32": base / t} for n, t in ms.items()}
    return {"model": model, "S": S, "systems": rates}


def decode_row(rng, model, S, threads, torch_call) -> dict:
    H_q, H_kv, D = MODEL_HEADS[model]
    q32 = rng.standard_normal((1, H_q, 1, D), dtype=np.float32)
    k32, v32 = (rng.standard_normal((1, H_kv, S, D), dtype=np.float32) for _ in range(2))
    calls, read = {}, {}
    forms = [("float32", "float32", "highest"), ("float16", "float16", "highest")]
    forms += [("bfloat16", "bfloat16", "highest"), ("bfloat16", "bfloat16", "fast")]
    forms += [("float32", "float16", "highest"), ("float32", "bfloat16", "highest")]
    for q_name, kv_name, precision in forms:
        q_dtype, kv_dtype = measure.dtype_of(q_name), measure.dtype_of(kv_name)
        q, k, v = q32.astype(q_dtype), k32.astype(kv_dtype), v32.astype(kv_dtype)
        name = f"npattn {q_name}" if q_name == kv_name else f"npattn {q_name} q / {kv_name} kv"
        name += " fast" if precision == "fast" else ""
        calls[name] = lambda q=q, k=k, v=v, p=precision: npattn.sdpa(q, k, v, precision=p, threads=threads)
        read[name] = k.nbytes + v.nbytes
    if torch_call:
        for dtype in ("float32", "bfloat16"):
            calls[f"torch {dtype}"] = torch_call(q32, k32, v32, dtype, False)
            read[f"torch {dtype}"] = (4 if dtype == "float32" else 2) * 2 * k32.size
    return record(model, S, measure.interleaved(calls), "gbs", read)


def prefill_row(rng, model, S, threads, torch_call) -> dict:
    H_q, H_kv, D = MODEL_HEADS[model]
    q32 = rng.standard_normal((1, H_q, S, D), dtype=np.float32)
    k32, v32 = (rng.standard_normal((1, H_kv, S, D), dtype=np.float32) for _ in range(2))
    calls = {"npattn float32": lambda: npattn.sdpa(q32, k32, v32, threads=threads)}
    for name in ("float16", "bfloat16"):
        q, k, v = (x.astype(measure.dtype_of(name)) for x in (q32, k32, v32))
        for precision in ("highest", "fast"):
            calls[f"npattn {name} {precision}"] = lambda q=q, k=k, v=v, p=precision: npattn.sdpa(
                q, k, v, precision=p, threads=threads
            )
    if torch_call:
        for dtype in ("float32", "bfloat16"):
            calls[f"torch {dtype}"] = torch_call(q32, k32, v32, dtype, True)
    ms = measure.interleaved(calls, rounds=5)
    return record(model, S, ms, "gflops", dict.fromkeys(ms, 4.0 * D * H_q * S * (S + 1) / 2))


def backward_row(rng, model, S, threads) -> dict:
    H_q, H_kv, D = MODEL_HEADS[model]
    x32 = [rng.standard_normal((1, h, S, D), dtype=np.float32) for h in (H_q, H_kv, H_kv, H_q)]
    calls = {}
    for name, dtype, precision in (("float32", "float32", "highest"), ("bfloat16 highest", "bfloat16", "highest"),
                                   ("bfloat16 fast", "bfloat16", "fast")):  # fmt: skip
        q, k, v, dout = (x.astype(measure.dtype_of(dtype)) for x in x32)
        out, lse = npattn.sdpa(q, k, v, return_lse=True, precision=precision, threads=threads)
        calls[f"npattn {name}"] = lambda q=q, k=k, v=v, g=dout, o=out, s=lse, p=precision: npattn.sdpa_backward(
            g, q, k, v, o, s, precision=p, threads=threads
        )
    ms = measure.interleaved(calls, rounds=5)
    return record(model, S, ms, "gflops", dict.fromkeys(ms, 10.0 * D * H_q * S * (S + 1) / 2))


def main() -> None:
    args = measure.suite_args(__doc__)
    T = args.threads
    torch_call = torch_sdpa(T)
    rng = np.random.default_rng(0)
    keys = [1024, 4096, 8192, 32768] if not args.quick else [256, 1024]
    prefill_keys = ([2048, 4096] if T >= 8 else [2048]) if not args.quick else [256]
    decode = []
    for model in ("Qwen3-4B", "Qwen2-0.5B"):
        for S in keys:
            decode.append(decode_row(rng, model, S, T, torch_call))
            print(decode[-1], flush=True)
    prefill = []
    for S in prefill_keys:
        prefill.append(prefill_row(rng, "Qwen3-4B", S, T, torch_call))
        print(prefill[-1], flush=True)
    backward = [backward_row(rng, "Qwen3-4B", 2048 if not args.quick else 256, T)]
    print(backward[-1], flush=True)
    data = {
        "provenance": report.provenance(T),
        "read_bandwidth": measure.read_bandwidth(T),
        "fma_peak": measure.fma_peak(T),
        "bf16_peak": measure.fma_peak(T, loop="bf16"),
        "tile_peak": measure.fma_peak(T, loop="tile"),
        "decode": decode,
        "prefill": prefill,
        "backward": backward,
    }
    measure.finish_suite(args, data, markdown)


def markdown(data: dict) -> str:
    bw, fma = data["read_bandwidth"], data["fma_peak"]
    lines = [
        f"Read bandwidth {bw['gbs']:.1f} GB/s, float32 FMA peak {fma['gflops']:.0f} GFLOP/s "
        f"({fma['kernels']} kernels), on {bw['threads']} threads."
    ]
    ceilings = [(data.get(k) or {}).get("gflops", 0) for k in ("bf16_peak", "tile_peak")]
    if any(ceilings):  # records of earlier runs lack them
        lines[0] += f" bfloat16 ceilings: vdpbf16ps {ceilings[0]:.0f}, AMX tiles {ceilings[1]:.0f} GFLOP/s."

    def read(s):
        return f"{s['ms']:.3g} ms, {s['gbs']:.0f} GB/s"

    def compute(s):
        return f"{s['ms']:.4g} ms, {s['gflops']:.0f}"

    parts = (
        ("decode", "Decode (L = 1): ms, GB/s of K/V", "S", read),
        ("prefill", "Prefill (L = S, causal): ms, GFLOP/s", "L = S", compute),
        ("backward", "Backward of that prefill: ms, GFLOP/s", "L = S", compute),
    )
    for part, title, size, cell in parts:
        rows = data.get(part, [])  # records of earlier runs may lack a part
        if not rows:
            continue
        names = list(rows[0]["systems"])
        lines += ["", f"{title}, and npattn float32's time over this one's.", ""]
        lines += [f"| heads | {size} | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r in rows:
            cells = [f"{cell(s)}, {s['vs_npattn_f32']:.2f}x" for s in r["systems"].values()]
            lines.append(f"| {r['model']} | {r['S']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

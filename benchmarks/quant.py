"""8-bit KV caches read as stored: npattn over codes against its float caches and OpenVINO's u8 cache.

    python benchmarks/quant.py [--threads T] [--out benchmarks/results/quant.json] [--quick]

Each figure is a ratio within one run, of medians over interleaved rounds:

- **decode from memory** (L = 1), Qwen3-4B heads (32/8/128), S = 32768, B = 1
  and 8: npattn with float32, bfloat16, int8 (a scale per token), fp8 e4m3 (a
  scale per token), uint8 with a zero point per token (OpenVINO's layout),
  llama.cpp's q8_0 (int8 with a float16 scale per 32 elements), and int8 in
  pages of 16 and 32 rows; OpenVINO's stateful KV-cache model with
  ``KV_CACHE_PRECISION`` f32 and u8, its cache grown one token a step as in a
  decode. GB/s counts the bytes of K and V as each stores them (codes and
  scales), against the streaming-read bandwidth of the same run;
- **decode from the caches** (Qwen2-0.5B heads, 14/2/64, S = 4096, one
  request): float32 against int8, and int8 under ``precision="fast"``;
- **prefill** (L = S = 2048) and **chunked prefill** (L = 512 over S = 4096),
  Qwen3-4B heads, causal: bfloat16 q over bfloat16 K/V against over int8 K/V
  (a scale per token), under both precisions.

Ratios are npattn's bfloat16-cache (and float32-cache) time over the call's.
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


def caches(rng, B, H_kv, S, D) -> dict:
    """The same K and V in each format: name -> (k, v, keywords, bytes read)."""
    k32, v32 = (rng.standard_normal((B, H_kv, S, D), dtype=np.float32) for _ in range(2))
    out = {"float32": (k32, v32, {}, k32.nbytes * 2)}
    bf16 = measure.dtype_of("bfloat16")
    kb, vb = k32.astype(bf16), v32.astype(bf16)
    out["bfloat16"] = (kb, vb, {}, kb.nbytes * 2)
    forms = {
        "int8": dict(dtype="int8"),
        "fp8 e4m3": dict(dtype="float8_e4m3fn"),
        "uint8 + zero": dict(dtype="uint8", symmetric=False),
        "q8_0": dict(dtype="int8", group=32, scale_dtype=np.float16),
    }
    for name, how in forms.items():
        kq, vq = npattn.quantize(k32, **how), npattn.quantize(v32, **how)
        kw = {"k_scale": kq.scale, "v_scale": vq.scale}
        if kq.zero is not None:
            kw.update(k_zero=kq.zero, v_zero=vq.zero)
        read = sum(x.nbytes for x in (*kq, *vq) if x is not None)
        out[name] = (kq.codes, vq.codes, kw, read)
    return out


def paged(rng, k, v, scales, page_size) -> tuple:
    """k, v (B, H_kv, S, D) and their per-token scales as pages scattered at random:
    (key_pages, value_pages, block_table, context_lens, keywords)."""
    B, H_kv, S, D = k.shape
    n = S // page_size
    order = rng.permutation(B * n)
    table = order.reshape(B, n).astype(np.int32)

    def pages(x):
        p = np.empty((B * n, *x.shape[1:2], page_size, x.shape[-1]), x.dtype)
        p[order] = (
            x.reshape(B, x.shape[1], n, page_size, x.shape[-1]).transpose(0, 2, 1, 3, 4).reshape(B * n, *p.shape[1:])
        )
        return p

    kw = {name: pages(s) for name, s in scales.items()}
    return pages(k), pages(v), table, np.full(B, S, np.int64), kw


def openvino_decode(B, H_q, H_kv, D, S, precision: str, threads: int):
    """OpenVINO's stateful KV-cache model, its state set to S - 1 rows, then a step's
    call (a new token's q, k, v appended): the call timed as a decode loop makes it.
    None without OpenVINO."""
    try:
        import openvino as ov
    except ImportError:
        return None
    import openvino.opset6 as op6
    import openvino.opset13 as op

    from systems import openvino_grouped

    Q = op.parameter([B, H_q, -1, D], np.float32)
    K, V = (op.parameter([B, H_kv, -1, D], np.float32) for _ in range(2))
    beam = op.parameter([B], np.int32)
    empty = op.constant(np.zeros((B, H_kv, 0, D), np.float32))
    assigns, present = [], []
    for name, new in (("past_key", K), ("past_value", V)):
        cached = op6.read_value(empty, name, np.float32, [B, H_kv, -1, D])
        joined = op.concat([op.gather(cached, beam, op.constant(np.int64(0))), new], 2)
        assigns.append(op6.assign(joined, name))
        present.append(openvino_grouped(joined, H_kv, H_q // H_kv, D))
    node = op.scaled_dot_product_attention(Q, *present, causal=True)
    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": precision}
    request = ov.Core().compile_model(ov.Model([node.output(0)], assigns, [Q, K, V, beam]), "CPU", config)
    request = request.create_infer_request()
    rng = np.random.default_rng(1)
    for state in request.query_state():
        state.state = ov.Tensor(rng.standard_normal((B, H_kv, S - 1, D), dtype=np.float32))
    feeds = [rng.standard_normal(s, dtype=np.float32) for s in ((B, H_q, 1, D), (B, H_kv, 1, D), (B, H_kv, 1, D))]
    feeds.append(np.arange(B, dtype=np.int32))
    request.infer(feeds, share_inputs=True)  # the state into the plugin's own layout, once
    return lambda: request.infer(feeds, share_inputs=True, share_outputs=True)


def decode_row(rng, B, S, threads) -> dict:
    H_q, H_kv, D = MODEL_HEADS["Qwen3-4B"]
    q = rng.standard_normal((B, H_q, 1, D), dtype=np.float32)
    calls, read = {}, {}
    made = caches(rng, B, H_kv, S, D)
    for name, (k, v, kw, nbytes) in made.items():
        calls[f"npattn {name}"] = lambda k=k, v=v, kw=kw: npattn.sdpa(q, k, v, threads=threads, **kw)
        read[f"npattn {name}"] = nbytes
    k, v, kw, nbytes = made["int8"]
    for size in (16, 32):
        kp, vp, table, lens, pkw = paged(rng, k, v, kw, size)
        calls[f"npattn int8 pages of {size}"] = lambda kp=kp, vp=vp, t=table, n=lens, pkw=pkw: npattn.paged_attention(
            q, kp, vp, t, n, threads=threads, **pkw
        )
        read[f"npattn int8 pages of {size}"] = nbytes
    for precision in ("f32", "u8"):
        call = openvino_decode(B, H_q, H_kv, D, S, precision, threads)
        if call is not None:
            calls[f"openvino {precision}"] = call
            read[f"openvino {precision}"] = made["float32" if precision == "f32" else "uint8 + zero"][3]
    ms = measure.interleaved(calls, rounds=5)
    base, f32 = ms["npattn bfloat16"], ms["npattn float32"]
    systems = {n: {"ms": t, "gbs": read[n] / t / 1e6, "vs_bf16": base / t, "vs_f32": f32 / t} for n, t in ms.items()}
    return {"model": "Qwen3-4B", "B": B, "S": S, "systems": systems}


def in_cache_row(rng, S, threads) -> dict:
    H_q, H_kv, D = MODEL_HEADS["Qwen2-0.5B"]
    q = rng.standard_normal((1, H_q, 1, D), dtype=np.float32)
    k32, v32 = (rng.standard_normal((1, H_kv, S, D), dtype=np.float32) for _ in range(2))
    kq, vq = npattn.quantize(k32, "int8"), npattn.quantize(v32, "int8")
    kw = {"k_scale": kq.scale, "v_scale": vq.scale}
    calls = {
        "npattn float32": lambda: npattn.sdpa(q, k32, v32, threads=threads),
        "npattn int8": lambda: npattn.sdpa(q, kq.codes, vq.codes, threads=threads, **kw),
        "npattn int8 fast": lambda: npattn.sdpa(q, kq.codes, vq.codes, precision="fast", threads=threads, **kw),
    }
    ms = measure.interleaved(calls, rounds=7)
    return {
        "model": "Qwen2-0.5B",
        "S": S,
        "systems": {n: {"ms": t, "vs_f32": ms["npattn float32"] / t} for n, t in ms.items()},
    }


def prefill_row(rng, L, S, threads) -> dict:
    H_q, H_kv, D = MODEL_HEADS["Qwen3-4B"]
    bf16 = measure.dtype_of("bfloat16")
    q = rng.standard_normal((1, H_q, L, D), dtype=np.float32).astype(bf16)
    k32, v32 = (rng.standard_normal((1, H_kv, S, D), dtype=np.float32) for _ in range(2))
    kb, vb = k32.astype(bf16), v32.astype(bf16)
    kq, vq = npattn.quantize(k32, "int8"), npattn.quantize(v32, "int8")
    kw = {"k_scale": kq.scale, "v_scale": vq.scale}
    calls = {}
    for p in ("highest", "fast"):
        calls[f"bfloat16 K/V {p}"] = lambda p=p: npattn.sdpa(q, kb, vb, precision=p, threads=threads)
        calls[f"int8 K/V {p}"] = lambda p=p: npattn.sdpa(q, kq.codes, vq.codes, precision=p, threads=threads, **kw)
    ms = measure.interleaved(calls, rounds=5)
    systems = {n: {"ms": t, "vs_bf16": ms[f"bfloat16 K/V {n.rsplit(' ', 1)[1]}"] / t} for n, t in ms.items()}
    return {"model": "Qwen3-4B", "L": L, "S": S, "systems": systems}


def main() -> None:
    args = measure.suite_args(__doc__)
    T = args.threads
    rng = np.random.default_rng(0)
    S = 32768 if not args.quick else 2048
    decode = []
    for B in (1, 8) if not args.quick else (1,):
        decode.append(decode_row(rng, B, S, T))
        print(decode[-1], flush=True)
    in_cache = [in_cache_row(rng, 4096 if not args.quick else 512, T)]
    print(in_cache[-1], flush=True)
    shapes = [(2048, 2048), (512, 4096)] if not args.quick else [(128, 128), (64, 256)]
    prefill = [prefill_row(rng, L, S_, T) for L, S_ in shapes]
    print(prefill, flush=True)
    data = {
        "provenance": report.provenance(T),
        "read_bandwidth": measure.read_bandwidth(T),
        "decode": decode,
        "in_cache": in_cache,
        "prefill": prefill,
    }
    measure.finish_suite(args, data, markdown)


def markdown(data: dict) -> str:
    bw = data["read_bandwidth"]
    lines = [f"Read bandwidth {bw['gbs']:.1f} GB/s on {bw['threads']} threads.", ""]
    rows = data["decode"]
    names = list(rows[0]["systems"])
    lines += [
        "Decode (L = 1) from memory, Qwen3-4B heads: ms, GB/s of the cache as stored, npattn bfloat16's / "
        "float32's time over this one's.",
        "",
        "| B | S | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [
            f"{s['ms']:.3g} ms, {s['gbs']:.0f} GB/s, {s['vs_bf16']:.2f}x / {s['vs_f32']:.2f}x"
            for s in r["systems"].values()
        ]
        lines.append(f"| {r['B']} | {r['S']} | " + " | ".join(cells) + " |")
    for part, title, size in (("in_cache", "Decode from the caches, Qwen2-0.5B heads", "S"),
                              ("prefill", "Prefill, Qwen3-4B heads, bfloat16 q", "L / S")):  # fmt: skip
        rows = data[part]
        names = list(rows[0]["systems"])
        lines += ["", f"{title}: ms, and the comparison's ratio.", "", f"| {size} | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for r in rows:
            key = r["S"] if part == "in_cache" else f"{r['L']} / {r['S']}"
            cells = [
                f"{s['ms']:.3g} ms, {next(v for k, v in s.items() if k.startswith('vs_')):.2f}x"
                for s in r["systems"].values()
            ]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

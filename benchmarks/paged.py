"""Batches of requests and paged KV caches: npattn.paged_attention and sdpa's key ranges.

    python benchmarks/paged.py [--threads T] [--out benchmarks/results/paged.json] [--quick]

Each figure is a ratio within one run, of medians over interleaved rounds (the
two calls compared alternate, so that drift on a shared machine hits both):

- **paged decode**: ``paged_attention`` against ``sdpa(..., k_lengths=)`` on the
  same keys gathered into a dense cache (the speed of the dense decode on the
  same work, so 1.00 means paging costs nothing), for the Qwen3-4B and
  Qwen2-0.5B heads, pages of 16, 32 and 128 rows scattered at random, B = 1
  (16k keys) and B = 8 requests of 1k-32k keys;
- **ragged batch**: one ``sdpa`` call with ``k_lengths`` against the sum of the
  requests' separate calls, and against the same batch as an ``L x S`` bool
  mask;
- **paged chunked prefill**: a chunk of 512 queries over 4096 keys, paged
  against dense.

Also the streaming-read bandwidth and the bytes each decode reads, so that a
decode's GB/s reads against the machine's.
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


def dense_cache(rng, lengths, H_kv, D, dtype):
    """A dense (B, H_kv, S, D) key and value cache, S the longest request, zeros past
    each request's length."""
    B, S = len(lengths), max(lengths)
    k = rng.standard_normal((B, H_kv, S, D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((B, H_kv, S, D), dtype=np.float32).astype(dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = v[b, :, n:] = 0
    return k, v


def paged_cache(rng, k, v, lengths, page_size):
    """The same keys in pages scattered at random: (key_pages, value_pages, block_table)."""
    B, H_kv, S, D = k.shape
    live = -(-np.asarray(lengths) // page_size)
    order = rng.permutation(int(live.sum()))
    table = np.full((B, int(live.max())), -1, np.int32)
    kp = np.empty((len(order), H_kv, page_size, D), k.dtype)
    vp = np.empty_like(kp)
    at = 0
    for b, n in enumerate(live):
        table[b, :n] = order[at : at + n]
        for i in range(n):
            rows = slice(i * page_size, min((i + 1) * page_size, S))
            width = rows.stop - rows.start
            kp[order[at + i], :, :width], vp[order[at + i], :, :width] = k[b, :, rows], v[b, :, rows]
        at += n
    return kp, vp, table


def paged_vs_dense(rng, model, cache, lengths, page_size, L, dtype_name, threads):
    H_q, H_kv, D = MODEL_HEADS[model]
    k, v = cache
    kp, vp, table = paged_cache(rng, k, v, lengths, page_size)
    q = rng.standard_normal((len(lengths), H_q, L, D), dtype=np.float32).astype(k.dtype)
    cl = np.asarray(lengths, np.int32)
    S = table.shape[1] * page_size  # the dense cache padded to the table's rows, so both read the same keys
    if S > k.shape[2]:
        pad = ((0, 0), (0, 0), (0, S - k.shape[2]), (0, 0))
        k, v = np.pad(k, pad), np.pad(v, pad)
    paged = npattn.paged_attention(q, kp, vp, table, cl, threads=threads)
    dense = npattn.sdpa(q, k, v, k_lengths=cl, threads=threads)
    diff = float(np.max(np.abs(paged.astype(np.float64) - dense.astype(np.float64))))
    ms = measure.interleaved({
        "paged": lambda: npattn.paged_attention(q, kp, vp, table, cl, threads=threads),
        "dense": lambda: npattn.sdpa(q, k, v, k_lengths=cl, threads=threads),
    })  # fmt: skip
    read = int(cl.sum()) * H_kv * D * 2 * np.dtype(k.dtype).itemsize
    return {
        "model": model, "B": len(lengths), "keys": int(cl.sum()), "page_size": page_size, "L": L, "dtype": dtype_name,
        "paged_ms": ms["paged"], "dense_ms": ms["dense"], "paged_vs_dense": ms["dense"] / ms["paged"],
        "paged_gbs": read / ms["paged"] / 1e6, "max_abs_diff": diff,
    }  # fmt: skip


def ragged_batch(rng, model, lengths, threads):
    """One call with k_lengths, the requests' separate calls, and a bool mask."""
    H_q, H_kv, D = MODEL_HEADS[model]
    B, S = len(lengths), max(lengths)
    cl = np.asarray(lengths)
    q = rng.standard_normal((B, H_q, 1, D), dtype=np.float32)
    k = rng.standard_normal((B, H_kv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H_kv, S, D), dtype=np.float32)
    mask = np.arange(S)[None, None, None, :] < cl[:, None, None, None]  # (B, 1, 1, S)
    parts = [(q[b], k[b, :, : cl[b]], v[b, :, : cl[b]]) for b in range(B)]

    def separate():
        for qb, kb, vb in parts:
            npattn.sdpa(qb, kb, vb, threads=threads)

    def ranges():
        npattn.sdpa(q, k, v, k_lengths=cl, threads=threads)

    # two pairs, each alternated on its own: the mask's call reads all S keys of
    # every request, and the call timed after it in a round found the cache cold
    # (k_lengths after it ran at 0.82 of the separate calls on one thread, 1.02
    # without it)
    ms = measure.interleaved({"ranges": ranges, "separate": separate})
    by_mask = measure.interleaved({"ranges": ranges, "mask": lambda: npattn.sdpa(q, k, v, mask=mask, threads=threads)})
    return {
        "model": model, "B": B, "keys": int(cl.sum()), "ranges_ms": ms["ranges"], "separate_ms": ms["separate"],
        "mask_ms": by_mask["mask"], "ranges_vs_separate": ms["separate"] / ms["ranges"],
        "ranges_vs_mask": by_mask["mask"] / by_mask["ranges"],
    }  # fmt: skip


def main() -> None:
    args = measure.suite_args(__doc__)
    T = args.threads
    rng = np.random.default_rng(0)
    spread = [1024, 1536, 2560, 4096, 6144, 10240, 16384, 32768]
    one, prefill_keys = [16384], 4096
    if args.quick:
        spread, one, prefill_keys = [256, 512, 1024], [2048], 1024
    decode, prefill, ragged = [], [], []
    for model in ("Qwen3-4B", "Qwen2-0.5B"):
        H_q, H_kv, D = MODEL_HEADS[model]
        for lengths in (one, spread):
            cache = dense_cache(rng, lengths, H_kv, D, np.float32)
            for page_size in (16, 32, 128):
                decode.append(paged_vs_dense(rng, model, cache, lengths, page_size, 1, "float32", T))
                print(decode[-1], flush=True)
        cache = dense_cache(rng, spread, H_kv, D, measure.dtype_of("bfloat16"))
        decode.append(paged_vs_dense(rng, model, cache, spread, 32, 1, "bfloat16", T))
        print(decode[-1], flush=True)
        cache = dense_cache(rng, [prefill_keys], H_kv, D, np.float32)
        for page_size in (16, 128):
            prefill.append(paged_vs_dense(rng, model, cache, [prefill_keys], page_size, 512, "float32", T))
            print(prefill[-1], flush=True)
        ragged.append(ragged_batch(rng, model, spread, T))
        print(ragged[-1], flush=True)
    data = {
        "provenance": report.provenance(T),
        "read_bandwidth": measure.read_bandwidth(T),
        "decode": decode,
        "prefill": prefill,
        "ragged": ragged,
    }
    measure.finish_suite(args, data, markdown)


def markdown(data: dict) -> str:
    lines = [
        f"Read bandwidth: {data['read_bandwidth']['gbs']:.1f} GB/s on {data['read_bandwidth']['threads']} threads.",
        "",
    ]
    lines += [
        "| heads | B | keys | page | L | dtype | paged ms | dense ms | dense/paged | paged GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["decode"] + data["prefill"]:
        lines.append(
            f"| {r['model']} | {r['B']} | {r['keys']} | {r['page_size']} | {r['L']} | {r['dtype']} "
            f"| {r['paged_ms']:.3g} | {r['dense_ms']:.3g} | {r['paged_vs_dense']:.2f} | {r['paged_gbs']:.1f} |"
        )
    lines += [
        "",
        "| heads | B | keys | k_lengths ms | separate calls ms | bool mask ms | separate/ranges | mask/ranges |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["ragged"]:
        lines.append(
            f"| {r['model']} | {r['B']} | {r['keys']} | {r['ranges_ms']:.3g} | {r['separate_ms']:.3g} "
            f"| {r['mask_ms']:.3g} | {r['ranges_vs_separate']:.2f} | {r['ranges_vs_mask']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

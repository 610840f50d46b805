"""npattn.dask.sdpa on a distributed cluster against one npattn.sdpa call.

    python benchmarks/dask_keys.py [--out benchmarks/results/dask.json]

A context of 64k keys (Qwen2-0.5B heads, 14/2/64, float32) split into 8 key
chunks, on a LocalCluster of 2 worker processes with 1 thread each, for a
decode step (L = 1) and a chunk of 256 new queries. Three timings per case,
medians of repeated calls after a warm-up:

- one ``npattn.sdpa`` call on the whole arrays (2 threads, and 1);
- the chunking alone: the 8 partial calls and their merges, one after the
  other in this process on 1 thread (what splitting costs before any Dask);
- ``npattn.dask.sdpa`` on the cluster, the inputs already persisted on the
  workers (what a user whose data lives there waits for).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np

import npattn

HEADS, D, S, CHUNKS = (14, 2), 64, 65536, 8


def median_ms(call, repeats=7):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def chunked(q, k, v, L):
    """The partials of the 8 key chunks and their merge, in this process, 1 thread."""
    step = S // CHUNKS
    parts = [
        npattn.sdpa(q, k[..., s : s + step, :], v[..., s : s + step, :], q_offset=S - L, k_offset=s,
                    return_lse=True, threads=1)
        for s in range(0, S, step)
    ]  # fmt: skip
    return npattn.merge([p[0] for p in parts], [p[1] for p in parts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    import dask.array as da
    import distributed

    import npattn.dask

    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, HEADS[1], S, D), dtype=np.float32)
    v = rng.standard_normal((1, HEADS[1], S, D), dtype=np.float32)
    rows = []
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        dk = client.persist(da.from_array(k, chunks=(1, HEADS[1], S // CHUNKS, D)))
        dv = client.persist(da.from_array(v, chunks=(1, HEADS[1], S // CHUNKS, D)))
        distributed.wait([dk, dv])
        for L in (1, 256):
            q = rng.standard_normal((1, HEADS[0], L, D), dtype=np.float32)
            dq = client.persist(da.from_array(q, chunks=q.shape))
            want = npattn.sdpa(q, k, v)
            got = npattn.dask.sdpa(dq, dk, dv).compute()
            err = float(np.abs(got - want).max())
            row = {
                "case": f"Qwen2-0.5B 14/2/64, L={L}, S={S}",
                "one call, 2 threads ms": median_ms(partial(npattn.sdpa, q, k, v, threads=2)),
                "one call, 1 thread ms": median_ms(partial(npattn.sdpa, q, k, v, threads=1)),
                "8 partials + merge, 1 thread ms": median_ms(partial(chunked, q, k, v, L)),
                "dask, 2 workers x 1 thread ms": median_ms(npattn.dask.sdpa(dq, dk, dv).compute, 5),
                "largest difference from one call": err,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = list(rows[0])
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in r.values()) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"npattn": npattn.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

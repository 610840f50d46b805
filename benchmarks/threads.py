"""One process, two thread pools: an npattn call alone and between PyTorch's ops.

    python benchmarks/threads.py [--threads T] [--out threads.json] [--quick]

A decode call of Qwen3-0.6B's heads (16 query, 8 key/value heads, D = 128,
float32, S keys) is timed four ways, each the median of calls alternated in
rounds:

- **alone**: npattn.sdpa, called again and again;
- **after a matmul**: the same call right after a PyTorch matrix product the
  size of a decode step's projection (1 x 1024 by 1024 x 3072), timing the
  npattn call only: PyTorch's OpenMP threads have just finished their work;
- **in a model's rhythm**: after the matmul, then a second matmul timed after
  the npattn call (its cost tells what npattn's threads leave behind);
- PyTorch's own ``scaled_dot_product_attention`` the same two ways.

npattn's threads are those of each call's ``threads=``, the same as
PyTorch's (``torch.set_num_threads``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import measure
import report


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keys", default="1024,8192")
    args = parser.parse_args()
    import numpy as np
    import torch

    T = args.threads
    torch.set_num_threads(T)
    rng = np.random.default_rng(0)
    x = torch.randn(1, 1024)
    w = torch.randn(1024, 3072)
    rows = []
    for S in [int(s) for s in args.keys.split(",")]:
        q = rng.standard_normal((1, 16, 1, 128), dtype=np.float32)
        k, v = (rng.standard_normal((1, 8, S, 128), dtype=np.float32) for _ in range(2))
        calls = decode_calls(q, k, v, T)
        row = {"S": S, "threads": T}
        n = 50 if args.quick else 400
        for name, call in calls.items():
            alone, after, matmul_after, matmul_alone = [], [], [], []
            for _ in range(5):
                for _ in range(n // 5):
                    t0 = time.perf_counter()
                    call()
                    alone.append(time.perf_counter() - t0)
                for _ in range(n // 5):
                    torch.mm(x, w)
                    t0 = time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    torch.mm(x, w)
                    t2 = time.perf_counter()
                    after.append(t1 - t0)
                    matmul_after.append(t2 - t1)
                    t0 = time.perf_counter()
                    torch.mm(x, w)
                    matmul_alone.append(time.perf_counter() - t0)
            row[name] = {
                key: 1e6 * statistics.median(values)
                for key, values in (("alone_us", alone), ("after_matmul_us", after),
                                    ("matmul_after_us", matmul_after), ("matmul_alone_us", matmul_alone))
            }  # fmt: skip
            print(S, name, row[name], flush=True)
        rows.append(row)
    env = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NPATTN_TORCH_THREADS")}
    data = {"provenance": report.provenance(T), "rows": rows, "env": env}
    measure.finish_suite(args, data, markdown)


def decode_calls(q, k, v, threads: int) -> dict:
    """The same decode call by npattn (on its pool), npattn.torch (on PyTorch's threads) and PyTorch."""
    import numpy as np
    import torch

    import npattn
    import npattn.torch

    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    out = np.empty(q.shape[:-1] + v.shape[-1:], np.float32)
    return {
        "npattn": lambda: npattn.sdpa(q, k, v, out=out, threads=threads),
        "torch": lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True),
        "npattn.torch": lambda: npattn.torch.sdpa(tq, tk, tv, threads=threads),
    }


def markdown(data: dict) -> str:
    lines = [
        "| S | system | alone (us) | right after a matmul (us) | the next matmul (us) | a matmul alone (us) |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        for name in ("npattn", "npattn.torch", "torch"):
            s = r[name]
            lines.append(
                f"| {r['S']} | {name} | {s['alone_us']:.1f} | {s['after_matmul_us']:.1f} | "
                f"{s['matmul_after_us']:.1f} | {s['matmul_alone_us']:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

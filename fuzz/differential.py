"""Differential fuzzing of npattn.sdpa against the float64 reference (see fuzz/README.md).

    python -m fuzz.differential --calls 1000000            # about an hour on 2 cores
    python -m fuzz.differential --calls 30000 --seed 1     # CI's slice
    python -m fuzz.differential --replay 1:12345           # one case again, described

run from the repository root, where the test support package tests/helpers
imports as ``tests.helpers``. Each case is tests.helpers.random_problem(seed): the whole contract of
npattn.sdpa (ranks, broadcasting, GQA, empty sizes, layouts, dtypes, masks,
sinks, scale, window, softcap, positions, lse, threads, precision; one in four with
per-request key ranges k_start/k_lengths or an int-array q_offset; one in five of
the rest with k or v or both 8-bit codes and their scales: every format, grouping
and scale dtype), one in ten with NaN and infinities in q, k, v, now and then a
model-sized one; and one case
in ten is a paged_attention call instead, tests.helpers.random_paged_problem
(page sizes, shared pages, strided stores, int32 tables, every mask kind it
takes, window, sinks, softcap, q_offset, lse, precision); where PyTorch and
transformers import, one in twenty is a transformers layer's attention through
npattn.transformers (fuzz/glue.py). Three calls per
case, cycling through the kernel tables this CPU runs: the result against the
reference (the tolerance npattn's tests use; NaN and infinities where the
reference has them), a second call bitwise equal, a call into out= bitwise
equal and returning out, and every input unchanged. Any exception is a
finding too: every case is a valid call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np

import npattn
from fuzz import glue
from tests.helpers import (
    check,
    check_backward,
    check_paged,
    compare_with_nan,
    f64,
    kernels,
    own_tolerance,
    random_paged_problem,
    random_problem,
    reference_call,
    runnable_kernels,
    snapshot,
)

CALLS_PER_CASE = 3  # the forward pass's; a case with the backward pass makes two more
GLUE = glue.available()  # transformers' cases where PyTorch and transformers import


def is_paged(case: int) -> bool:
    """Whether the case is a paged_attention call (one in ten)."""
    return case % 10 == 4


def is_glue(case: int) -> bool:
    """Whether the case is a transformers layer's call (one in twenty, fuzz/glue.py)."""
    return GLUE and case % 20 == 13


def run_glue_case(seed: int, case: int, table: str) -> int:
    """A transformers layer's attention against the reference over transformers' mask."""
    with kernels(table):
        glue.check(glue.problem(np.random.default_rng([seed, case])))
    return 1


def paged(seed: int, case: int):
    """The case's paged problem: (q, key_pages, value_pages, block_table, context_lens, kwargs)."""
    return random_paged_problem(np.random.default_rng([seed, case]))


def run_paged_case(seed: int, case: int, table: str) -> int:
    """A paged_attention case: the result against the reference, a second call and a
    call into out= bitwise equal, the inputs unchanged."""
    q, kp, vp, bt, cl, kwargs = paged(seed, case)
    with kernels(table):
        first = check_paged(q, kp, vp, bt, cl, **kwargs)
        again = npattn.paged_attention(q, kp, vp, bt, cl, **kwargs)
        out = first[0] if kwargs.get("return_lse") else first
        buf = np.empty_like(out)
        into = npattn.paged_attention(q, kp, vp, bt, cl, out=buf, **kwargs)
    assert (into[0] if kwargs.get("return_lse") else into) is buf, "out= did not return out"
    for name, result in (("a second call", again), ("the call into out=", into)):
        pairs = zip(first, result) if kwargs.get("return_lse") else [(first, result)]
        for a, b in pairs:
            assert np.array_equal(a, b, equal_nan=True), f"{name} differs from the first"
    return CALLS_PER_CASE


def problem(seed: int, case: int):
    """The case's problem and whether it holds NaN or infinities."""
    rng = np.random.default_rng([seed, case])
    specials = case % 10 == 9
    return (*random_problem(rng, specials=specials, large=True), specials)


def with_backward(kwargs: dict, specials: bool) -> bool:
    """Whether the case runs the backward pass too: finite inputs, a scale of at most
    100 (beyond it the gradients overflow float32 while the reference's do not), and
    no codes (there is no gradient through them)."""
    codes = any(key in kwargs for key in ("k_scale", "v_scale"))
    return not specials and not codes and abs(kwargs.get("scale") or 1.0) <= 100


def run_case(seed: int, case: int, table: str) -> int:
    """The checks of one case; raises AssertionError (or anything) on a finding.
    Returns the number of calls made."""
    if is_paged(case):
        return run_paged_case(seed, case, table)
    if is_glue(case):
        return run_glue_case(seed, case, table)
    q, k, v, kwargs, specials = problem(seed, case)
    arrays = [x for x in (q, k, v, *kwargs.values()) if isinstance(x, np.ndarray)]
    before = snapshot(*arrays)
    with kernels(table):
        if specials:
            kwargs.pop("window", None)
            first = npattn.sdpa(q, k, v, **kwargs)
            want = reference_call(q, k, v, **kwargs)
            got = first[0] if kwargs.get("return_lse") else first
            want = want[0] if kwargs.get("return_lse") else want
            clean = [np.where(np.isfinite(f64(x)), f64(x), 0.0) for x in (q, k, v)]
            rtol, atol = own_tolerance(*clean, got.dtype, **kwargs)
            compare_with_nan(got, want, atol, rtol)
        else:
            first = check(q, k, v, **kwargs)
        again = npattn.sdpa(q, k, v, **kwargs)
        out = first[0] if kwargs.get("return_lse") else first
        buf = np.empty_like(out)
        into = npattn.sdpa(q, k, v, out=buf, **kwargs)
    assert (into[0] if kwargs.get("return_lse") else into) is buf, "out= did not return out"
    for name, result in (("a second call", again), ("the call into out=", into)):
        pairs = zip(first, result) if kwargs.get("return_lse") else [(first, result)]
        for a, b in pairs:
            assert np.array_equal(a, b, equal_nan=True), f"{name} differs from the first"
    assert snapshot(*arrays) == before, "an input changed"
    if not with_backward(kwargs, specials):
        return CALLS_PER_CASE
    out = first[0] if kwargs.get("return_lse") else first
    dout = np.random.default_rng([seed, case, 1]).standard_normal(out.shape).astype(out.dtype)
    with kernels(table):
        check_backward(q, k, v, dout, **kwargs)
    assert snapshot(*arrays) == before, "an input changed in the backward pass"
    return CALLS_PER_CASE + 2


def describe(seed: int, case: int) -> str:
    def show(x):
        if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and x.size <= 64:  # per-request ints: their values
            return f"array({x.tolist()}) {x.dtype} strides {x.strides}"
        if isinstance(x, np.ndarray):
            return f"array{x.shape} {x.dtype} strides {x.strides}"
        return repr(x)

    if is_glue(case):
        drawn = glue.problem(np.random.default_rng([seed, case]))
        return f"case {seed}:{case} (a transformers layer)\n" + glue.describe(drawn)
    if is_paged(case):
        q, kp, vp, bt, cl, kwargs = paged(seed, case)
        named = (("q", q), ("key_pages", kp), ("value_pages", vp), ("block_table", bt), ("context_lens", cl))
        lines = [f"case {seed}:{case} (paged_attention)"] + [f"  {name} = {show(x)}" for name, x in named]
        return "\n".join(lines + [f"  {name} = {show(x)}" for name, x in kwargs.items()])
    q, k, v, kwargs, specials = problem(seed, case)
    lines = [f"case {seed}:{case}" + (" (NaN/inf in q, k, v)" if specials else "")]
    lines += [f"  {name} = {show(x)}" for name, x in (("q", q), ("k", k), ("v", v))]
    lines += [f"  {name} = {show(x)}" for name, x in kwargs.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30000, help="sdpa calls (3 per case)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first case number")
    parser.add_argument("--replay", help="SEED:CASE: run one case, describe it, show the finding")
    parser.add_argument("--report", help="write the counts and findings as JSON here")
    parser.add_argument("--max-findings", type=int, default=20)
    args = parser.parse_args(argv)
    tables = runnable_kernels()

    if args.replay:
        seed, case = (int(x) for x in args.replay.split(":"))
        print(describe(seed, case))
        for table in tables:
            try:
                run_case(seed, case, table)
                print(f"{table}: ok")
            except Exception:
                print(f"{table}: FINDING\n{traceback.format_exc()}")
        return 0

    n_cases = max(1, args.calls // (CALLS_PER_CASE + 1))  # about one case in two runs backward
    findings, counts, start = [], {t: 0 for t in tables}, time.monotonic()
    backward_cases = done = 0
    for i in range(args.start, args.start + n_cases):
        table = tables[i % len(tables)]
        try:
            calls = run_case(args.seed, i, table)
            counts[table] += calls
            backward_cases += calls > CALLS_PER_CASE
        except Exception as e:
            findings.append({"case": f"{args.seed}:{i}", "kernels": table, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"FINDING {args.seed}:{i} ({table}): {type(e).__name__}: {str(e)[:300]}", flush=True)
            counts[table] += CALLS_PER_CASE
            if len(findings) >= args.max_findings:
                break
        done = i - args.start + 1
        if done % 1000 == 0:
            calls = sum(counts.values())
            rate = calls / (time.monotonic() - start)
            print(f"{calls} calls, {rate:.0f} calls/s, {len(findings)} findings", flush=True)
            report(args, done, backward_cases, counts, start, findings)  # so far, should the run be cut short
    n_calls, elapsed = report(args, done, backward_cases, counts, start, findings)
    print(
        f"{n_calls} calls ({done} cases, {backward_cases} with the backward pass) in {elapsed:.0f} s "
        f"over {', '.join(counts)}: {len(findings)} findings"
    )
    return 1 if findings else 0


def report(args, done: int, backward_cases: int, counts: dict, start: float, findings: list) -> tuple[int, float]:
    """Writes the counts and findings so far to --report (if given); returns (calls, seconds)."""
    elapsed = time.monotonic() - start
    n_calls = sum(counts.values())
    if args.report:
        summary = {
            "npattn": npattn.__version__,
            "seed": args.seed,
            "first_case": args.start,
            "cases": done,
            "cases_with_backward": backward_cases,
            "calls": n_calls,
            "calls_per_kernel_table": counts,
            "seconds": round(elapsed, 1),
            "findings": findings,
        }
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=1)
    return n_calls, elapsed


if __name__ == "__main__":
    sys.exit(main())

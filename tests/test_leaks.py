"""10,000 calls that mix success and error paths leak nothing.

After a warm-up, 10,000 more calls of npattn.sdpa, cycling through valid calls
(every dtype, mask kind, sinks, out=, copied layouts, lists) and invalid ones
(TypeError, ValueError, and MemoryError from the core's allocation hook), leave
flat:

- the process's resident memory (a leaked scratch buffer, a few KiB a call,
  would add tens of MiB),
- the blocks Python's allocator holds (a leaked Python object a call would add
  10,000),
- the reference counts of every input, mask, sinks and out array.
"""

import gc
import os
import sys

import numpy as np
import pytest

import npattn

N_CALLS = 10_000
# Under the ASan build of .ci/run (runtime preloaded) freed memory sits in a quarantine.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def rss_bytes():
    """The current resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_cases():
    """(name, function, expected exception or None, arrays whose refcounts must stay flat)."""
    rng = np.random.default_rng(11)

    def randn(shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    q, k, v = randn((2, 4, 5, 8)), randn((2, 2, 7, 8)), randn((2, 2, 7, 6))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    qt = randn((2, 5, 4, 8)).swapaxes(1, 2)  # transposed: read in place
    kr = randn((2, 2, 7, 16))[..., ::2]  # strided last axis: gathered tile by tile
    bool_mask = rng.random((5, 7)) < 0.7
    add_mask = np.where(bool_mask, 0.0, -np.inf).astype(np.float16)  # read as float16
    sinks = rng.uniform(-1, 1, 4)
    out = np.empty((2, 4, 5, 6), np.float32)
    lse = np.zeros((2, 4, 5), np.float32)
    big_v = np.full((2, 2, 7, 6), 1e38, np.float32)
    bad_out = np.empty((2, 4, 5, 5), np.float32)
    int_q = np.ones((2, 4, 5, 8), np.int32)
    q5 = randn((2, 5, 5, 8))
    decode_q, decode_k, decode_v = randn((1, 2, 1, 8)), randn((1, 1, 40000, 8)), randn((1, 1, 40000, 8))
    fail = npattn._core.debug_fail_alloc_after

    def failing_call():
        fail(0)
        try:
            npattn.sdpa(q, k, v, threads=1)
        finally:
            fail(-1)

    def failing_split_k():
        fail(2)  # the scratch and the exact path's table succeed, the split-K partials fail
        try:
            npattn.sdpa(decode_q, decode_k, decode_v, threads=2)
        finally:
            fail(-1)

    cases = [
        ("float32", lambda: npattn.sdpa(q, k, v), None, (q, k, v)),
        ("float64, no mask", lambda: npattn.sdpa(q64, k64, v64, mask=None, threads=2), None, (q64, k64, v64)),
        ("float16, top-left", lambda: npattn.sdpa(q16, k16, v16, mask="causal_top_left"), None, (q16, k16, v16)),
        ("bool mask, sinks", lambda: npattn.sdpa(q, k, v, mask=bool_mask, sinks=sinks), None, (bool_mask, sinks)),
        ("float16 mask", lambda: npattn.sdpa(q, k, v, mask=add_mask), None, (add_mask,)),
        ("out=", lambda: npattn.sdpa(q, k, v, out=out), None, (out,)),
        ("strided layouts", lambda: npattn.sdpa(qt, kr, v, scale=0.5), None, (qt, kr)),
        ("window, softcap, lse", lambda: npattn.sdpa(q, k, v, window=(2, 0), softcap=5.0, return_lse=True), None, ()),
        ("redone in double", lambda: npattn.sdpa(q, k, big_v), None, (big_v,)),
        ("weights", lambda: npattn.attention_weights(q, k, mask=bool_mask), None, ()),
        ("merge", lambda: npattn.merge([out, out], [lse, lse]), None, (out, lse)),
        ("lists", lambda: npattn.sdpa([[1.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]]), None, ()),
        ("decode, split-K", lambda: npattn.sdpa(decode_q, decode_k, decode_v, threads=2), None, (decode_q,)),
        ("bad dtype", lambda: npattn.sdpa(int_q, k, v), TypeError, (int_q,)),
        ("bad heads", lambda: npattn.sdpa(q5, k, v), ValueError, (q5,)),
        ("bad mask string", lambda: npattn.sdpa(q, k, v, mask="bogus"), ValueError, ()),
        ("bad mask shape", lambda: npattn.sdpa(q, k, v, mask=bool_mask.T), ValueError, ()),
        ("bad scale", lambda: npattn.sdpa(q, k, v, scale=float("nan")), ValueError, ()),
        ("bad threads", lambda: npattn.sdpa(q, k, v, threads=0), ValueError, ()),
        ("bad out", lambda: npattn.sdpa(q, k, v, out=bad_out), ValueError, (bad_out,)),
        ("out overlapping q", lambda: npattn.sdpa(q64, k64, v64[..., :8].copy(), out=q64[:, :, :5]), ValueError, ()),
        ("bad sinks", lambda: npattn.sdpa(q, k, v, sinks=sinks[:3]), ValueError, ()),
        ("core out of memory", failing_call, MemoryError, ()),
        ("split-K out of memory", failing_split_k, MemoryError, ()),
    ]
    watched = [q, k, v]
    for case in cases:
        watched.extend(a for a in case[3] if all(a is not w for w in watched))
    return cases, watched


def run(cases, n):
    for i in range(n):
        name, fn, error, _ = cases[i % len(cases)]
        if error is None:
            fn()
        else:
            try:
                fn()
            except error:
                pass
            else:
                raise AssertionError(f"{name}: no {error.__name__}")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_ten_thousand_calls_keep_memory_and_refcounts_flat():
    """10,000 calls mixing success, TypeError, ValueError and MemoryError: RSS, Python's
    allocated blocks and the inputs' refcounts end where they started."""
    cases, watched = make_cases()
    try:
        run(cases, 2000)  # warm-up: NumPy's caches, the pool's threads, first-touch pages
        gc.collect()
        refs_before = [sys.getrefcount(a) for a in watched]
        blocks_before = sys.getallocatedblocks()
        rss_before = rss_bytes()

        run(cases, N_CALLS)

        gc.collect()
        rss_after = rss_bytes()
        blocks_after = sys.getallocatedblocks()
        refs_after = [sys.getrefcount(a) for a in watched]
    finally:
        npattn._core.debug_fail_alloc_after(-1)

    print(
        f"RSS {rss_before / 2**20:.2f} -> {rss_after / 2**20:.2f} MiB; "
        f"Python blocks {blocks_before} -> {blocks_after}; refcounts {refs_before} -> {refs_after}"
    )
    assert refs_after == refs_before
    # A Python object leaked per call would add >= 10,000 blocks.
    assert blocks_after - blocks_before < 500, (blocks_before, blocks_after)
    if UNDER_ASAN:
        return  # ASan's quarantine holds freed memory; its LeakSanitizer checks instead
    # A core scratch buffer leaked per call would add >= 10,000 * 4 KiB = 40 MiB;
    # allow 4 MiB for the allocator's own fluctuation.
    assert rss_after - rss_before < 4 * 2**20, (rss_before, rss_after)

"""Property tests: npattn.sdpa == reference.sdpa on random problems of the whole
contract (helpers.random_problem: ranks, broadcasting, GQA, empty sizes,
layouts, dtypes, masks, sinks, scale, window, softcap, positions, lse,
threads), drawn by hypothesis, which keeps and replays the seeds that fail.
fuzz/differential.py runs the same problems by the million."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from helpers import check, compare_with_nan, f64, own_tolerance, random_problem, reference_call, snapshot

SEEDS = st.integers(0, 2**32 - 1)


@settings(max_examples=150, deadline=None)
@given(SEEDS)
def test_sdpa_equals_reference(seed):
    """sdpa == reference on float64 copies, for a random problem."""
    q, k, v, kwargs = random_problem(np.random.default_rng(seed))
    check(q, k, v, **kwargs)


@settings(max_examples=60, deadline=None)
@given(SEEDS)
def test_out_equals_return_repeats_bitwise_and_inputs_stay(seed):
    """sdpa(out=buf) fills buf with exactly what sdpa returns; a second call is bitwise
    equal; no input changes."""
    q, k, v, kwargs = random_problem(np.random.default_rng(seed))
    before = snapshot(q, k, v, *(x for x in kwargs.values() if isinstance(x, np.ndarray)))
    first = npattn.sdpa(q, k, v, **kwargs)
    out = first[0] if kwargs["return_lse"] else first
    buf = np.empty_like(out)
    again = npattn.sdpa(q, k, v, out=buf, **kwargs)
    assert (again[0] if kwargs["return_lse"] else again) is buf
    np.testing.assert_array_equal(buf, out)
    if kwargs["return_lse"]:
        np.testing.assert_array_equal(again[1], first[1])
    assert snapshot(q, k, v, *(x for x in kwargs.values() if isinstance(x, np.ndarray))) == before


@settings(max_examples=60, deadline=None)
@given(SEEDS)
def test_special_values_propagate_like_the_reference(seed):
    """NaN and infinities anywhere in q, k or v, every key visible: the result has NaN
    and infinities exactly where the reference has them, and matches it elsewhere."""
    rng = np.random.default_rng(seed)
    q, k, v, kwargs = random_problem(rng, dtypes=("float32", "float64"), specials=True)
    kwargs.pop("return_lse")
    kwargs.pop("window", None)
    got = npattn.sdpa(q, k, v, **kwargs)
    want = reference_call(q, k, v, **kwargs)
    clean = [np.where(np.isfinite(f64(x)), f64(x), 0.0) for x in (q, k, v)]
    rtol, atol = own_tolerance(*clean, got.dtype, **kwargs)
    compare_with_nan(got, want, atol, rtol, infinite_inputs=any(np.isinf(f64(x)).any() for x in (q, k, v)))

"""Property tests: npattn.sdpa == reference.sdpa on random problems of the whole
contract (helpers.random_problem: ranks, broadcasting, GQA, empty sizes,
layouts, dtypes, masks, sinks, scale, window, softcap, positions, lse,
threads), drawn by hypothesis, which keeps and replays the seeds that fail.
fuzz/differential.py runs the same problems by the million."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from helpers import (
    HEAD_LAYOUTS,
    SPECIAL_SIZE,
    check,
    compare_with_nan,
    f64,
    layout,
    own_tolerance,
    random_problem,
    reference_call,
    snapshot,
)

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
    exactly where the reference has NaN, its infinities, and matches it elsewhere (one
    outcome: random_problem keeps every finite weight far from underflow)."""
    rng = np.random.default_rng(seed)
    q, k, v, kwargs = random_problem(rng, dtypes=("float32", "float64"), specials=True)
    kwargs.pop("return_lse")
    kwargs.pop("window", None)
    got = npattn.sdpa(q, k, v, **kwargs)
    want = reference_call(q, k, v, **kwargs)
    clean = [np.where(np.isfinite(f64(x)), f64(x), 0.0) for x in (q, k, v)]
    rtol, atol = own_tolerance(*clean, got.dtype, **kwargs)
    compare_with_nan(got, want, atol, rtol)


def test_special_problems_have_one_right_answer():
    """The special problems' finite values lie within SPECIAL_SIZE and |scale| within
    1/sqrt(D), which keeps every finite weight far from underflow; compare_with_nan
    then holds NaN and infinities to the reference's exactly: inf for NaN fails."""
    for seed in range(200):
        q, k, v, kwargs = random_problem(np.random.default_rng(seed), specials=True)
        for x in (q, k, v):
            finite = f64(x)[np.isfinite(f64(x))]
            assert np.abs(finite).max(initial=0) <= SPECIAL_SIZE
        if kwargs.get("scale") is not None:
            assert abs(kwargs["scale"]) <= q.shape[-1] ** -0.5 * (1 + 1e-15)
    with pytest.raises(AssertionError, match="NaN where the reference has NaN"):
        compare_with_nan(np.array([np.inf, 1.0]), np.array([np.nan, 1.0]), 1e-6)
    with pytest.raises(AssertionError, match="the reference's infinities"):
        compare_with_nan(np.array([-np.inf, 1.0]), np.array([np.inf, 1.0]), 1e-6)


def test_a_layout_the_rank_cannot_have_is_refused(rng):
    """helpers.layout never turns a layout it cannot make into a contiguous array."""
    for kind in HEAD_LAYOUTS:
        with pytest.raises(ValueError, match="needs rank >= 3"):
            layout(rng, (4, 5), np.float32, kind)
        assert layout(rng, (2, 4, 5), np.float32, kind).shape == (2, 4, 5)
    with pytest.raises(ValueError, match="unknown kind"):
        layout(rng, (2, 4, 5), np.float32, "diagonal")

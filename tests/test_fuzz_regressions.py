"""Inputs the coverage-guided fuzzer (fuzz/fuzz_sdpa.py) found, kept as tests.

Each test names the fuzzer's finding it replays, reduced by hand to the
smallest call that shows it. All of them were scales so far from 1 that
folding scale * log2(e) into q overflowed or vanished in the computed dtype
where scale * (q . k) did not: sdpa now refuses such scales with a ValueError
naming scale (0 and magnitudes in 1e-30..1e30, or 1e-300..1e300 for float64,
are accepted), and the accepted extremes are checked against the reference.
"""

import numpy as np
import pytest

import npattn
from npattn import reference

REFUSED = pytest.raises(ValueError, match=r"^sdpa: scale must be 0 or of magnitude between")


def test_scale_of_minus_float64_max_is_refused():
    """crash-94ca464a: float64, rank 2, scale = -DBL_MAX, with a sink."""
    q = np.full((5, 1), 0.25)
    with REFUSED:
        npattn.sdpa(q, q, q, scale=-np.finfo(np.float64).max, sinks=[-1.33], threads=1)


@pytest.mark.parametrize("scale", [1e39, -3e38, 1.5e-212, 1e-31])
def test_scale_beyond_float32_range_is_refused(scale):
    """float32: a scale beyond 1e30 or below 1e-30 in magnitude (crash-89ba3b06, and the
    hypothesis finding: q = inf with scale 1.5e-212 gave NaN instead of a hidden key)."""
    q = np.ones((1, 1, 2, 4), np.float32)
    with REFUSED:
        npattn.sdpa(q, q, q, scale=scale, mask=None)


def test_scaled_products_overflowing_in_float64_is_refused():
    """crash-65c782f1: float64, scale 5e307: the terms of (q * scale) . k overflowed while
    q . k cancels to 0."""
    q = np.array([[2.0, 2.0]])
    k = np.array([[2.0, -2.0], [0.1, -0.1]])
    with REFUSED:
        npattn.sdpa(q, k, k[:, :1], mask=None, scale=5e307)


@pytest.mark.parametrize("dtype, scale", [(np.float32, 1e30), (np.float32, -1e-30), (np.float64, 1e300), (np.float64, 1e-300)])
def test_extreme_accepted_scales_match_the_reference(dtype, scale):
    """At the edges of the accepted range the result matches the reference, with q and k
    sized so that scale * (q . k) is moderate."""
    rng = np.random.default_rng(5)
    size = 1 / np.sqrt(abs(scale) * 8)  # |scale * q . k| about 1
    q = (rng.standard_normal((1, 2, 3, 8)) * size).astype(dtype)
    k = (rng.standard_normal((1, 2, 5, 8)) * size).astype(dtype)
    v = rng.standard_normal((1, 2, 5, 4)).astype(dtype)
    got = npattn.sdpa(q, k, v, scale=scale)
    want = reference.sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=scale)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)


def test_scale_zero_is_uniform_attention():
    """scale = 0 is accepted: every visible key weighs the same."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 1, 4, 8)).astype(np.float32) for _ in range(3))
    got = npattn.sdpa(q, k, v, scale=0.0, mask=None)
    np.testing.assert_allclose(got[0, 0], np.broadcast_to(v[0, 0].mean(axis=0), (4, 8)), atol=1e-6)

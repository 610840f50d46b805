"""Shared by the tests: the oracle comparison and the tolerances it uses.

The system under test is ``npattn.sdpa``; the oracle is ``npattn.reference.sdpa``
called on float64 copies of the same inputs.
"""

import npattn
import numpy as np
import pytest
from npattn import reference

# How many units of the result dtype's machine epsilon one logit of magnitude 1
# may be off by. A logit s = scale * q.k (+ mask) computed in float32 carries an
# error of a few ulps of |s|: the dot product of length D is summed in blocks by
# sgemm, then scaled and shifted. Softmax turns an absolute logit error e into a
# relative weight error of about e, so the output, a convex combination of v's
# rows, moves by at most about 2 e max|v|; the weighted sum over S adds a few
# ulps of max|v| more. Hence atol = ULPS * eps * (1 + max|logit|) * max|v|, with
# max|logit| bounded by Cauchy-Schwarz below (3-4x the true max at D = 128).
# Measured on unit-normal inputs over the shapes of test_sdpa.py: float32 NumPy's
# own formula reaches 0.08 of this tolerance and npattn 0.09, a margin of ~10x.
# For float64 both sides compute in double and differ only in summation order
# and exp; 64 ulps (1.4e-14 per unit, ~1e-12 on the model shapes) is still
# far below any real error, which shows up at 1e-3 or more; npattn measures
# under 0.01 of it.
ULPS = {np.dtype(np.float32): 4, np.dtype(np.float64): 64}


def as_float64(x):
    """A float64 copy of x, for the oracle."""
    return np.array(x, dtype=np.float64)


def _max_abs(x):
    """max |x| over finite entries, 0 for empty or None."""
    if x is None or isinstance(x, str):
        return 0.0
    x = np.asarray(x)
    if x.dtype == bool:
        return 0.0
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def _max_row_norm(x):
    x = as_float64(x)
    return float(np.sqrt((x * x).sum(axis=-1)).max()) if x.size else 0.0


def tolerance(q, k, v, scale=None, mask=None, sinks=None):
    """Absolute tolerance for sdpa(q, k, v, ...) in its result dtype; see ULPS."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dtype = np.result_type(q, k, v)
    factor = abs(q.shape[-1] ** -0.5 if scale is None else float(scale))
    # |scale * q_i . k_j| <= |scale| |q_i| |k_j| (Cauchy-Schwarz) bounds every score.
    logit = factor * _max_row_norm(q) * _max_row_norm(k) + _max_abs(mask) + _max_abs(sinks)
    v_size = _max_abs(v) or 1.0
    return ULPS[np.dtype(dtype)] * np.finfo(dtype).eps * (1.0 + logit) * v_size


def assert_matches_reference(q, k, v, **kwargs):
    """npattn.sdpa(q, k, v, **kwargs) == reference.sdpa on float64 copies, within tolerance.

    Returns npattn's result.
    """
    got = npattn.sdpa(q, k, v, **kwargs)
    ref_kwargs = {key: val for key, val in kwargs.items() if key not in ("out", "threads")}
    want = reference.sdpa(as_float64(q), as_float64(k), as_float64(v), **ref_kwargs)
    dtype = np.result_type(np.asarray(q), np.asarray(k), np.asarray(v))
    assert type(got) is np.ndarray
    assert got.dtype == dtype
    assert got.shape == want.shape
    atol = tolerance(q, k, v, kwargs.get("scale"), kwargs.get("mask"), kwargs.get("sinks"))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    return got


@pytest.fixture(scope="session")
def check():
    """The comparison against the oracle, as a fixture: check(q, k, v, **kwargs)."""
    return assert_matches_reference


@pytest.fixture
def rng():
    """A fixed-seed generator, fresh for every test."""
    return np.random.default_rng(20241129)

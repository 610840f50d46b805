"""The comparison with the float64 reference, forward and backward, and of error messages.

npattn's own float32 results are held to 4 ulps per unit of logit and of
max|v| (npattn.testing allows a peer 8); float64 to 64; float16 and bfloat16
results must be the reference correctly rounded, up to that float32 noise.
The tolerances themselves are npattn.testing's (tolerance, backward_tolerance).
"""

import re

import numpy as np
import pytest

import npattn
from npattn import reference, testing

from .codes import split_codes
from .inputs import f64

OWN_ULPS = testing.OWN_ULPS
backward_tolerance = testing.backward_tolerance  # npattn's own: OWN_ULPS of the dtype computed in

# what a tolerance reads
BOUND_KEYS = ("scale", "mask", "sinks", "window", "softcap", "q_offset", "k_offset", "k_start", "k_lengths")


def reference_call(q, k, v, **kwargs):
    """reference.sdpa on float64 copies, with npattn.sdpa's keyword arguments (codes
    as the float32 values they stand for)."""
    k, v, kwargs = split_codes(k, v, kwargs)
    ref_kwargs = {key: f64(val) if key in ("mask", "sinks") else val for key, val in kwargs.items()}
    ref_kwargs.pop("out", None)
    ref_kwargs.pop("threads", None)
    with np.errstate(all="ignore"):
        return reference.sdpa(f64(q), f64(k), f64(v), **ref_kwargs)


def own_tolerance(q, k, v, dtype, **kwargs):
    """(rtol, atol) npattn itself is held to: 4 / 64 ulps for float32 / float64;
    correctly rounded (rtol eps/2, atol half a subnormal, plus the float32 bound) for
    the half dtypes, and
    with precision="fast" the half type's ulps that testing.tolerance adds. Codes: the
    tolerance of the values they stand for."""
    k, v, kwargs = split_codes(k, v, kwargs)
    bound = {key: kwargs[key] for key in BOUND_KEYS if key in kwargs}
    if dtype.name in OWN_ULPS:
        return 0.0, testing.tolerance(q, k, v, dtype=dtype, ulps=OWN_ULPS[dtype.name], **bound)
    # no ulps of the half type itself: rtol is its rounding, and where the result is
    # subnormal, half the subnormal spacing; the float32 bound, and "fast"'s
    half = testing.tolerance(q, k, v, dtype=dtype, ulps=0, precision=kwargs.get("precision", "highest"), **bound)
    return testing.EPS[dtype.name] / 2, half + testing.TINY[dtype.name] / 2


def check(q, k, v, **kwargs):
    """npattn.sdpa(q, k, v, **kwargs) == the reference on float64 copies, within
    own_tolerance; lse too when asked for. Returns npattn's result."""
    got = npattn.sdpa(q, k, v, **kwargs)
    want = reference_call(q, k, v, **kwargs)
    if kwargs.get("return_lse"):
        (got, got_lse), (want, want_lse) = got, want
    dtype = npattn._args.result_dtype(*(np.asarray(x).dtype for x in (q, k, v)))  # codes take no part
    k, v, kwargs = split_codes(k, v, kwargs)
    assert type(got) is np.ndarray
    assert got.dtype == dtype, (got.dtype, dtype)
    assert got.shape == want.shape
    rtol, atol = own_tolerance(q, k, v, dtype, **kwargs)
    np.testing.assert_allclose(f64(got), representable(want, dtype), rtol=rtol, atol=atol)
    if kwargs.get("return_lse"):
        assert got_lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
        assert got_lse.shape == want_lse.shape
        want_lse = representable(want_lse, got_lse.dtype)
        np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        # lse is a logit: off by the logit error the output tolerance allows per unit of
        # v (the tolerance of a v of ones, with v's batch dims, which the batch shape that
        # per-request arguments broadcast to includes), plus the rounding of the log-sum
        # itself, a few ulps of |lse|
        ones = np.ones((*np.broadcast_shapes(np.shape(k)[:-1], np.shape(v)[:-1]), 1))
        logit_atol = own_tolerance(q, k, ones, dtype, **kwargs)[1]
        ulps = OWN_ULPS["float64" if dtype == np.float64 else "float32"]
        rtol = ulps * testing.EPS["float64" if dtype == np.float64 else "float32"]
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=rtol, atol=logit_atol)
        return got, got_lse
    return got


def overflow_threshold(dtype):
    """The magnitude from which a value rounds to infinity in dtype: the largest finite
    value plus half its ulp (below that, rounding gives the largest finite value)."""
    dtype = np.dtype(dtype).newbyteorder("=")  # ml_dtypes knows the native bfloat16 only
    info = pytest.importorskip("ml_dtypes").finfo(dtype) if dtype.name == "bfloat16" else np.finfo(dtype)
    return float(info.max) * (1 + float(info.eps) / 4)


def representable(want, dtype):
    """The float64 reference with the values that round beyond dtype's range as
    infinities, as a result in dtype must hold them."""
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(want) >= overflow_threshold(dtype), np.copysign(np.inf, want), want)


def compare_with_nan(got, want, atol, rtol=0.0):
    """got == want within atol (and rtol) wherever want is finite; NaN exactly where
    want has NaN, and the same infinities. (With infinities in v, a weight that
    underflows in one precision and not in the other would turn inf into NaN: the
    special problems of random_problem keep every finite weight far from underflow.)"""
    got, want = f64(got), f64(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN where the reference has NaN")
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite], want[infinite], err_msg="the reference's infinities")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


def snapshot(*arrays):
    """A byte-exact copy of each array (NaN payloads and -0.0 included)."""
    return [(a.shape, a.strides, a.tobytes()) for a in arrays]


def check_backward(q, k, v, dout, **kwargs):
    """npattn.sdpa_backward after npattn.sdpa(..., return_lse=True) == the float64
    reference's gradients within backward_tolerance: shapes and dtypes of the operands,
    dsinks float32 (float64 for float64 results) or None. Returns npattn's Grads."""
    bwd = {key: val for key, val in kwargs.items() if key not in ("return_lse", "out")}
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **bwd)
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, **bwd)
    ref = {key: f64(val) if key in ("mask", "sinks") else val for key, val in bwd.items()}
    ref.pop("threads", None)
    with np.errstate(all="ignore"):
        want = reference.sdpa_backward(f64(dout), f64(q), f64(k), f64(v), None, None, **ref)
    tolerances = backward_tolerance(q, k, v, dout, out.dtype, **kwargs)
    for name, got, operand, expected in zip(grads._fields, grads, (q, k, v), want):
        assert type(got) is np.ndarray, name
        assert got.shape == np.shape(operand) and got.dtype == np.asarray(operand).dtype, (name, got.shape, got.dtype)
        assert_within(got, expected, *tolerances[name], name)
    if kwargs.get("sinks") is None:
        assert grads.dsinks is None
    else:
        assert grads.dsinks.dtype == (np.float64 if out.dtype == np.float64 else np.float32)
        assert_within(grads.dsinks, want[3], *tolerances["dsinks"], "dsinks")
    return grads


def assert_within(got, want, rtol, atol, name):
    """|got - want| <= atol + rtol |want| everywhere, atol a float or an array that
    broadcasts; want is the float64 value, got in its own dtype. Where a value within
    that tolerance of want reaches got's dtype's overflow threshold, got's infinity of
    want's sign is that value rounded, and holds. The message names the worst element."""
    big = overflow_threshold(np.asarray(got).dtype)
    got, want = np.broadcast_arrays(f64(got), f64(want))
    with np.errstate(invalid="ignore"):
        limit = atol + rtol * np.abs(want)
        excess = np.abs(got - want) - limit
        rounded_over = np.isinf(got) & (np.sign(got) == np.sign(want)) & (np.abs(want) + limit >= big)
    bad = ~((excess <= 0) | (got == want) | rounded_over)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf)), got.shape)
        limit = np.broadcast_to(atol + rtol * np.abs(want), got.shape)[worst]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.size} elements beyond tolerance; worst at {worst}: "
            f"{got[worst]!r} vs {want[worst]!r}, allowed {limit:.3g}"
        )


# ---- errors ----


def assert_raises_naming(capfd, fn, exception, argument, substrings=(), function="sdpa"):
    """fn() raises `exception` whose message starts "<function>: ", names `argument`
    as a word and holds each of `substrings`; nothing is printed to stderr."""
    with pytest.raises(exception) as info:
        fn()
    message = str(info.value)
    prefix = f"{function}: "
    assert message.startswith(prefix), message
    assert re.search(rf"\b{argument}\b", message[len(prefix) :]), message
    for text in substrings:
        assert text in message, message
    assert capfd.readouterr().err == ""

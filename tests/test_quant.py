"""npattn.quantize and npattn.dequantize: the 8-bit formats of KV caches, their rounding,
their edge codes, and the reference computing from the values codes stand for."""

import numpy as np
import pytest

import npattn
from npattn import reference

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = ["int8", "uint8", "float8_e4m3fn", "float8_e5m2"]
SYMMETRIC = {"int8": True, "uint8": False, "float8_e4m3fn": True, "float8_e5m2": True}


def values(rng, shape=(2, 3, 5, 64)):
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))).astype(np.float32)


@pytest.mark.parametrize("group", [None, 32, 8, 1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_the_formats_rounding(rng, fmt, group):
    """dequantize(quantize(x)) is within half a code step of x: scale / 2 for the
    integer formats, half an ulp of the fp8 code (relative 2^-4 for e4m3, 2^-3 for
    e5m2) above the format's smallest normal; the scales' shape is (..., D // group)."""
    x = values(rng)
    q = npattn.quantize(x, fmt, group=group, symmetric=SYMMETRIC[fmt])
    G = 1 if group is None else 64 // group
    assert q.codes.shape == x.shape and q.codes.dtype.name == fmt and q.scale.shape == x.shape[:-1] + (G,)
    assert (q.zero is None) == SYMMETRIC[fmt]
    got = npattn.dequantize(*q)
    assert got.dtype == np.float32
    step = np.repeat(q.scale, 64 // G, axis=-1)
    err = np.abs(got - x)
    if fmt in ("int8", "uint8"):
        assert (err <= 0.5 * step * (1 + 1e-5) + 1e-6 * np.abs(x)).all()
    else:
        rel, tiny = {"float8_e4m3fn": (2.0**-4, 2.0**-6), "float8_e5m2": (2.0**-3, 2.0**-14)}[fmt]
        bound = rel * np.abs(x) + 0.5 * tiny * step * 2.0 ** -(3 if fmt == "float8_e4m3fn" else 2)
        assert (err <= bound * (1 + 1e-5) + 1e-7).all()


def test_symmetric_scale_is_the_largest_magnitude_over_the_largest_code():
    x = np.array([[1.0, -3.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    for fmt, top in (("int8", 127), ("float8_e4m3fn", 448), ("float8_e5m2", 57344)):
        q = npattn.quantize(x, fmt)
        np.testing.assert_array_equal(q.scale[:, 0], np.float32([3.0 / top, 1.0]))  # a zero row: scale 1
        assert float(np.asarray(q.codes, np.float32)[0, 1]) == -top


def test_asymmetric_uint8_maps_min_and_max_onto_0_and_255():
    x = np.array([[-1.0, 0.0, 2.5, 3.0]], np.float32)
    q = npattn.quantize(x, "uint8", symmetric=False)
    assert q.codes[0, 0] == 0 and q.codes[0, 3] == 255
    np.testing.assert_allclose(npattn.dequantize(*q), x, rtol=0, atol=q.scale[0, 0] / 2)


def test_codes_round_to_nearest_ties_to_even():
    """x / scale = k + 0.5 rounds to the even neighbour (2.5 -> 2, 3.5 -> 4, -2.5 -> -2)."""
    x = np.array([[2.5, 3.5, -2.5, 127.0]], np.float32)  # scale 1: largest magnitude 127
    q = npattn.quantize(x, "int8")
    assert q.scale[0, 0] == 1.0
    np.testing.assert_array_equal(q.codes, [[2, 4, -2, 127]])


def test_q8_0_blocks_read_as_two_arrays():
    """llama.cpp's q8_0 block (a float16 scale, then 32 int8 codes: 34 bytes) viewed
    through a structured dtype gives the codes and scales sdpa takes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = npattn.quantize(x, "int8", group=32, scale_dtype=np.float16)
    block = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
    assert block.itemsize == 34
    raw = np.empty((4, 2), block)
    raw["d"], raw["qs"] = q.scale, q.codes.reshape(4, 2, 32)
    codes, scale = raw["qs"].reshape(4, 64), raw["d"]  # what a user does with a q8_0 buffer
    np.testing.assert_array_equal(npattn.dequantize(codes, scale), npattn.dequantize(*q))
    assert q.scale.dtype == np.float16


def test_edge_codes_stand_for_their_values():
    """-128 and 127, 0 and 255, e4m3's +-448 and its NaN code, e5m2's infinities and a
    subnormal: scale * (code - zero) in float32."""
    np.testing.assert_array_equal(npattn.dequantize(np.int8([-128, 127]), np.float32(2)), [-256, 254])
    np.testing.assert_array_equal(npattn.dequantize(np.uint8([0, 255]), np.float32(1), np.float32(128)), [-128, 127])
    e4m3 = np.array([448, -448, np.nan], ml_dtypes.float8_e4m3fn)
    got = npattn.dequantize(e4m3, np.float32(0.5))
    assert got[0] == 224 and got[1] == -224 and np.isnan(got[2])
    e5m2 = np.array([np.inf, -np.inf, 2.0**-16], ml_dtypes.float8_e5m2)  # 2^-16: a subnormal
    np.testing.assert_array_equal(npattn.dequantize(e5m2, np.float32(4)), [np.inf, -np.inf, 2.0**-14])


def test_clamped_to_the_formats_range():
    """A value the float32 scale rounds past the largest code still lands on it."""
    x = np.array([[1.0, -1.0, 0.999999]], np.float32)
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        codes = np.asarray(npattn.quantize(x, fmt).codes, np.float32)
        assert np.isfinite(codes).all() and np.abs(codes).max() == {"int8": 127, "float8_e4m3fn": 448}.get(fmt, 57344)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x: npattn.quantize(x, "int4"), ValueError, "dtype"),
        (lambda x: npattn.quantize(x, "int8", group=5), ValueError, "group"),
        (lambda x: npattn.quantize(x, "uint8"), ValueError, "symmetric=False"),
        (lambda x: npattn.quantize(x, "float8_e4m3fn", symmetric=False), ValueError, "symmetric"),
        (lambda x: npattn.quantize(x.astype(np.int32), "int8"), TypeError, "floats"),
        (lambda x: npattn.quantize(np.where(x > 1, np.nan, x), "int8"), ValueError, "NaN"),
        (lambda x: npattn.quantize(x, "int8", scale_dtype=np.int8), ValueError, "scale_dtype"),
        (lambda x: npattn.dequantize(x, np.float32(1)), TypeError, "codes"),
        (lambda x: npattn.dequantize(np.int8(x), np.ones((3, 5), np.float32)), ValueError, "divide"),
        (lambda x: npattn.dequantize(np.int8(x), np.ones((7, 1), np.float32)), ValueError, "broadcast"),
        (lambda x: npattn.dequantize(np.int8(x), np.float32(np.inf)), ValueError, "infinity"),
        (lambda x: npattn.dequantize(np.int8(x), np.int32(1)), TypeError, "scale"),
        (
            lambda x: npattn.dequantize(x.astype(ml_dtypes.float8_e5m2), np.float32(1), np.float32(1)),
            ValueError,
            "zero",
        ),
    ],
)
def test_errors_name_the_argument(rng, call, error, words):
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    with pytest.raises(error, match=words):
        call(x)


# ---- the reference ----


def test_reference_computes_from_the_values_codes_stand_for(rng):
    """reference.sdpa over codes == reference.sdpa over dequantize(codes), with K and
    V in different formats and scale layouts; the result dtype is q's (and the float
    operands')."""
    q = rng.standard_normal((2, 4, 3, 64)).astype(np.float16)
    k, v = values(rng, (2, 2, 9, 64)), values(rng, (2, 2, 9, 64))
    kq = npattn.quantize(k, "uint8", symmetric=False)
    vq = npattn.quantize(v, "float8_e4m3fn", group=32)
    got = reference.sdpa(q, kq.codes, vq.codes, k_scale=kq.scale, k_zero=kq.zero, v_scale=vq.scale)
    want = reference.sdpa(q.astype(np.float64), npattn.dequantize(*kq), npattn.dequantize(*vq)).astype(np.float16)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="k_scale"):
        reference.sdpa(q, kq.codes, v)
    with pytest.raises(ValueError, match="v_scale"):
        reference.sdpa(q, k, v, v_scale=np.float32(1))

"""8-bit codes of K and V with their scales (SPEC section 14): random codes of every
format, scales of every grouping, and the float values they stand for, which the
reference computes from."""

import numpy as np

import npattn

from .inputs import dtype_of

#: The code formats, and whether each takes zero points.
FORMATS = {"int8": True, "uint8": True, "float8_e4m3fn": False, "float8_e5m2": False}

#: The largest code of each format (its scale's unit: values come out about 1).
LARGEST = {"int8": 127.0, "uint8": 255.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}

#: How scales are grouped: one per tensor, per head, per token, per channel, per
#: group of 8 (a group no table's vector spans), per group of 32 (llama.cpp's q8_0).
GROUPINGS = ("tensor", "head", "token", "channel", "group8", "group32")


def random_codes(rng, shape, fmt):
    """Codes of `shape` drawn over the whole format: every int8 and uint8 code; every
    finite fp8 code (subnormals and the largest included, NaN and e5m2's infinities
    left out)."""
    dtype = dtype_of(fmt)
    if fmt in ("int8", "uint8"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    bits = rng.integers(0, 256, size=shape).astype(np.uint8)
    values = bits.view(dtype)
    finite = np.isfinite(values.astype(np.float32))
    return np.where(finite, values, np.zeros((), dtype)).astype(dtype)


def group_count(grouping, width):
    """G of a grouping for rows `width` wide (per channel: the width; a group that does
    not divide it: one a row)."""
    size = {"channel": 1, "group8": 8, "group32": 32}.get(grouping)
    return width // size if size and width % size == 0 and width >= size else 1


def groups_shape(grouping, shape):
    """The shape of the scales of codes of `shape` (..., H, S, D) in a grouping: () per
    tensor, (H, 1, 1) per head, (..., S, 1) per token, (..., 1, 1, D) per channel (the
    same for every token), (..., S, D // size) per group."""
    *lead, D = shape
    if grouping == "tensor" or len(shape) < 2:
        return ()
    if grouping == "head":
        return (shape[-3], 1, 1) if len(shape) >= 3 else (1, 1)
    if grouping == "channel":
        return (*(1 for _ in lead), group_count(grouping, D))
    return (*lead, group_count(grouping, D))


def random_groups(rng, shape, fmt, grouping="token", dtype="float32", zero=None):
    """Scales (and zero points, where `zero` and the format takes them) for codes of
    `shape`: (scale, zero) with values about 1 / the largest code, of either sign now
    and then, in `dtype` (float32, float16 or bfloat16)."""
    gshape = groups_shape(grouping, shape)
    magnitude = rng.uniform(0.5, 2.0, size=gshape) / LARGEST[fmt]
    sign = np.where(rng.random(gshape) < 0.1, -1.0, 1.0)
    scale = np.asarray(magnitude * sign).astype(dtype_of(dtype))
    if zero is None:
        zero = FORMATS[fmt] and fmt == "uint8"
    z = None
    if zero and FORMATS[fmt]:
        middle = 128.0 if fmt == "uint8" else 0.0
        z = np.asarray(middle + rng.uniform(-20, 20, size=gshape)).astype(dtype_of(dtype))
    return scale, z


def values(codes, scale, zero=None):
    """The float32 values codes stand for (npattn.dequantize), or a float operand as it is."""
    if scale is None:
        return codes
    with np.errstate(over="ignore"):  # a huge scale's values are infinities, as the core's
        return npattn.dequantize(codes, scale, zero)


def coded(rng, shape, fmt, grouping="token", dtype="float32", zero=None, name="k"):
    """(codes, keywords): random codes of `shape` and their scale (and zero point) as
    sdpa's keywords for `name` ("k" or "v")."""
    codes = random_codes(rng, shape, fmt)
    scale, z = random_groups(rng, shape, fmt, grouping, dtype, zero)
    kwargs = {f"{name}_scale": scale}
    if z is not None:
        kwargs[f"{name}_zero"] = z
    return codes, kwargs


def split_codes(k, v, kwargs):
    """(k, v, kwargs): codes of k and v as the float32 values they stand for, and the
    keywords without their scales and zero points."""
    rest = {key: val for key, val in kwargs.items() if key not in ("k_scale", "k_zero", "v_scale", "v_zero")}
    k = values(k, kwargs.get("k_scale"), kwargs.get("k_zero"))
    v = values(v, kwargs.get("v_scale"), kwargs.get("v_zero"))
    return k, v, rest

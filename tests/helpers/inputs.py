"""Builders of inputs: q, k, v, masks, and views of every memory layout."""

import numpy as np
import pytest


def dtype_of(name):
    """The NumPy dtype called name; bfloat16 and the fp8 codes come from ml_dtypes (the
    test skips without it); a dtype as it is."""
    if isinstance(name, np.dtype):
        return name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return np.dtype(getattr(pytest.importorskip("ml_dtypes"), name))
    return np.dtype(name)


def randn(rng, shape, dtype=np.float32, scale=1.0):
    """Normal values of shape in dtype (drawn in float64, rounded once)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


_randn = randn  # layout's default, under a name its parameter does not hide


def qkv(rng, batch, H_q, H_kv, L, S, D, D_v=None, dtype=np.float32, dtypes=None):
    """Random q (*batch, H_q, L, D), k (*batch, H_kv, S, D), v (*batch, H_kv, S, D_v)."""
    D_v = D if D_v is None else D_v
    dtypes = dtypes or (dtype,) * 3
    shapes = ((*batch, H_q, L, D), (*batch, H_kv, S, D), (*batch, H_kv, S, D_v))
    return tuple(randn(rng, s, dt) for s, dt in zip(shapes, dtypes))


def f64(x):
    """x as float64 for the reference; None, strings and bool masks as they are."""
    if x is None or isinstance(x, str):
        return x
    x = np.asarray(x)
    return x if x.dtype == bool else x.astype(np.float64)


def make_mask(rng, kind, shape, dtype=np.float32, empty_rows=True):
    """A mask of `kind` ("bool", "additive", or a string or None, returned as is);
    array kinds get `shape`, ~70% visible, additive values exact in every float
    dtype. Without empty_rows every row sees its last key."""
    if kind not in ("bool", "additive"):
        return kind
    visible = rng.random(shape) < 0.7
    if not empty_rows:
        visible[..., -1] = True
    if kind == "bool":
        return visible
    bias = np.round(rng.standard_normal(shape) * 4) / 4
    return np.where(visible, bias, -np.inf).astype(dtype)


MASK_KINDS = ["causal", "causal_top_left", None, "bool", "additive"]


def unaligned(x):
    """A copy of x whose data starts one byte past an aligned address."""
    raw = np.empty(x.nbytes + 1, dtype=np.uint8)
    y = raw[1:].view(x.dtype).reshape(x.shape)
    y[...] = x
    return y


def read_only(x):
    y = np.array(x)
    y.setflags(write=False)
    return y


def layout(rng, shape, dtype, kind, make=None):
    """Random values of `shape` in a view with the memory layout `kind`; a ValueError for
    a kind the rank does not allow (layout_fits) or one not known. make(rng, shape,
    dtype) draws the values (default: randn; helpers.random_codes' for codes)."""
    if not layout_fits(kind, len(shape)):
        raise ValueError(f"layout: {kind!r} needs rank >= 3 (a head axis), got shape {shape}")
    randn = make or _randn
    lead, last = shape[:-1], shape[-1]
    if kind == "contiguous":
        return randn(rng, shape, dtype)
    if kind == "fortran":
        return np.asfortranarray(randn(rng, shape, dtype))
    if kind == "transposed":  # a (*B, L, H, D) buffer seen as (*B, H, L, D)
        *batch, H, L, D = shape
        return randn(rng, (*batch, L, H, D), dtype).swapaxes(-3, -2)
    if kind == "reversed_rows":
        return randn(rng, shape, dtype)[..., ::-1, :]
    if kind == "reversed_last":
        return randn(rng, shape, dtype)[..., ::-1]
    if kind == "strided_last":  # every other element: last axis not contiguous
        return randn(rng, (*lead, 2 * last), dtype)[..., ::2]
    if kind == "padded_rows":  # row stride larger than the row
        return randn(rng, (*lead, last + 3), dtype)[..., :last]
    if kind == "every_other_head":
        return randn(rng, (*shape[:-3], 2 * shape[-3], *shape[-2:]), dtype)[..., ::2, :, :]
    if kind == "zero_stride_rows":  # every row the same: stride 0 along L or S
        return np.broadcast_to(randn(rng, (*shape[:-2], 1, last), dtype), shape)
    if kind == "zero_stride_heads":
        return np.broadcast_to(randn(rng, (*shape[:-3], 1, *shape[-2:]), dtype), shape)
    if kind == "byteswapped":
        return randn(rng, shape, dtype).astype(np.dtype(dtype).newbyteorder("S"))
    if kind == "unaligned":
        return unaligned(randn(rng, shape, dtype))
    if kind == "read_only":
        return read_only(randn(rng, shape, dtype))
    raise ValueError(f"layout: unknown kind {kind!r}; one of contiguous, {', '.join(LAYOUTS)}")


HEAD_LAYOUTS = ("transposed", "every_other_head", "zero_stride_heads")  # these need a head axis


def layout_fits(kind, ndim):
    """Whether an array of rank `ndim` can have the layout `kind`."""
    return ndim >= 3 or kind not in HEAD_LAYOUTS


LAYOUTS = [
    "fortran",
    "transposed",
    "reversed_rows",
    "reversed_last",
    "strided_last",
    "padded_rows",
    "every_other_head",
    "zero_stride_rows",
    "zero_stride_heads",
    "byteswapped",
    "unaligned",
    "read_only",
]

"""Arguments of sdpa, attention_weights and sdpa_backward, converted for the core.

The C glue (csrc/module_args.c) reads every argument and checks it, raising the
error that names the argument, the rule it broke and what it got; it reads
NumPy arrays of float16, bfloat16, float32 and float64 in place, with any
strides, and plain numbers. What it cannot read in place comes here, to
``convert``, registered with the glue at import: other array types and
nested lists, byte-swapped or misaligned arrays (only their distinct
elements are copied, so a broadcast view stays small), float masks wider
than float64, and 0-d arrays of a scale. The glue then checks what
``convert`` returns as it checks an array given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core, _interop


def shape_str(x: Any) -> str:
    return str(tuple(np.shape(x)))


def is_bfloat16(dt: np.dtype) -> bool:
    """ml_dtypes.bfloat16, recognised without importing ml_dtypes."""
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def is_code(dt: np.dtype) -> bool:
    """int8, uint8, or ml_dtypes' float8_e4m3fn or float8_e5m2: the 8-bit codes k and v may hold."""
    return dt.itemsize == 1 and dt.name in ("int8", "uint8", "float8_e4m3fn", "float8_e5m2")


def tell_core(dt: np.dtype) -> None:
    """Tell the core ml_dtypes.bfloat16's dtype, or its float8 ones, when dt is one."""
    if is_bfloat16(dt):
        _core.set_bfloat16(dt)
    elif dt.itemsize == 1 and dt.name in ("float8_e4m3fn", "float8_e5m2"):
        _core.set_float8(dt)


def result_dtype(*dtypes: Any) -> np.dtype:
    """The dtype of a result computed from arrays of these dtypes: the core's
    promotion where all are floats it computes (as np.result_type; float16
    with bfloat16, which NumPy cannot promote, gives float32); otherwise
    np.result_type, for the caller to refuse."""
    dtypes = tuple(np.dtype(dt) for dt in dtypes)
    for dt in dtypes:
        tell_core(dt)
    floats = tuple(dt for dt in dtypes if not is_code(dt))  # codes take no part: they stand for floats
    dtypes = floats or dtypes
    result = _core.result_dtype(*dtypes)
    return np.result_type(*dtypes) if result is None else result


def asarray(fn: str, x: Any, name: str) -> np.ndarray:
    """x as a NumPy array, through _interop; a failed conversion names x."""
    try:
        a = _interop.asarray(x, f"{fn}: {name}")
    except (TypeError, ImportError):
        raise
    except MemoryError as e:
        raise MemoryError(f"{fn}: {name} could not be converted to an array: {e}") from e
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"{fn}: {name} could not be converted to an array: {e}") from None
    tell_core(a.dtype)
    return a


def readable(a: np.ndarray) -> np.ndarray:
    """a as the core reads it in place: aligned, native byte order, strides
    whole elements. Otherwise a copy of its distinct elements only (a
    zero-stride axis stays zero-stride), so a broadcast view stays small."""
    if a.flags.aligned and a.dtype.isnative and all(s % a.itemsize == 0 for s in a.strides):
        return a
    distinct = a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]
    try:
        copy = np.array(distinct, dtype=a.dtype.newbyteorder("="))
    except MemoryError:
        raise MemoryError(f"cannot copy an array of shape {distinct.shape} and dtype {a.dtype}") from None
    return np.broadcast_to(copy, a.shape)


def convert(fn: str, name: str, x: Any) -> np.ndarray:
    """The argument `name` of `fn` as an array the glue reads: floats (and a
    bool mask) readable in place; other dtypes as they are, for the glue to
    name."""
    a = asarray(fn, x, name)
    if name == "mask" and a.dtype.kind == "f" and a.dtype.itemsize > 8:
        # wider than float64, the widest the core reads: finite values stay finite
        with np.errstate(over="ignore"):
            wide, a = a, a.astype(np.float64)
        overflow = np.isinf(a) & np.isfinite(wide)
        if overflow.any():
            a[overflow] = np.copysign(np.finfo(np.float64).max, wide[overflow])
    if (is_float(a.dtype) and a.dtype.itemsize <= 8) or a.dtype.kind == "b":
        return readable(a)
    return a


_core.set_converter(convert)


def check_scale(fn: str, scale: Any, D: int) -> float:
    """scale as sdpa reads it (None: 1 / sqrt(D)), or the error that names it."""
    return _core.check_scale(fn, scale, D)


def check_mask(fn: str, mask: Any, full: tuple) -> Any:
    """mask as sdpa reads it for a result of shape full = (*B, H_q, L, S), or
    the error that names it."""
    return _core.check_mask(fn, mask, tuple(int(n) for n in full))


def unbroadcast(full: np.ndarray, shape: tuple) -> np.ndarray:
    """The gradient of a broadcast operand: `full` summed over the dims that
    broadcasting added or stretched, back to the operand's own `shape` (a
    rank-2 operand's head dim included)."""
    extra = full.ndim - len(shape)
    g = full.sum(axis=tuple(range(extra))) if extra > 0 else full
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g.reshape(shape)

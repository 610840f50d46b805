"""Arguments of sdpa, attention_weights and sdpa_backward, made ready for the core.

The C core reads NumPy arrays of float16, bfloat16, float32 and float64 in
place, with any strides, and plain numbers; npattn's functions hand their
arguments to it first as given (see csrc/module.c). When that does not work,
this module checks every argument, raising the error that names it, the rule
it broke and what it got, and converts what the core cannot read: other array
types and nested lists, byte-swapped or misaligned arrays (only their distinct
elements, so a broadcast view stays small), other dtypes of sinks and masks,
0-d arrays as numbers. Limits come from the core (``_core.BLAS_INT_MAX``).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _core, _interop

MASK_STRINGS = ("causal", "causal_top_left")
INT64_MAX = 2**63 - 1


def shape_str(x: Any) -> str:
    return str(tuple(np.shape(x)))


def is_bfloat16(dt: np.dtype) -> bool:
    """ml_dtypes.bfloat16, recognised without importing ml_dtypes."""
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or is_bfloat16(dt)


def result_dtype(*dtypes: np.dtype) -> np.dtype:
    """np.result_type of the inputs, pairwise; float16 with bfloat16 (which
    NumPy cannot promote) gives float32."""
    result = np.dtype(dtypes[0])
    for dt in dtypes[1:]:
        try:
            result = np.result_type(result, dt)
        except TypeError:
            result = np.dtype(np.float32)
    return result


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
    if is_bfloat16(a.dtype):
        _core.set_bfloat16(a.dtype)
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


def broadcast_batch(fn: str, shapes: dict, got: str) -> tuple:
    """The batch shapes broadcast by NumPy's rules, with any number of dims."""
    rank = max(len(s) for s in shapes.values())
    out = [1] * rank
    for s in shapes.values():
        for i, n in enumerate(s):
            j = rank - len(s) + i
            if n != out[j] and n != 1 and out[j] != 1:
                raise ValueError(f"{fn}: the batch dims of q, k and v do not broadcast; {got}")
            if n != 1:
                out[j] = n
    return tuple(out)


@dataclass
class Problem:
    """Checked and converted arguments, in the form _core reads."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    scale: float | None
    mask: Any
    sinks: np.ndarray | None
    window: tuple | None
    softcap: float | None
    q_offset: int | None
    k_offset: int
    threads: int | None
    dtype: np.dtype  # the result's
    shape: tuple  # the result's, without the last axis
    batch: tuple
    S: int
    inputs: tuple  # every array read, as given and as converted: out must overlap none


def operand(fn: str, x: Any, name: str) -> np.ndarray:
    if x is None:
        raise TypeError(f"{fn}: {name} must be an array of floats, got None")
    a = asarray(fn, x, name)
    if not is_float(a.dtype):
        raise TypeError(f"{fn}: {name} must be an array of floats, got dtype {a.dtype}")
    if a.dtype.itemsize > 8:
        raise TypeError(f"{fn}: {name} has dtype {a.dtype}; the widest dtype computed is float64")
    if a.ndim < 2:
        raise ValueError(f"{fn}: {name} must have rank >= 2 (..., L, D), got shape {shape_str(a)}")
    return a


def with_heads(x: np.ndarray) -> np.ndarray:
    """A rank-2 operand (L, D) reads as one head (1, L, D)."""
    return x[np.newaxis] if x.ndim == 2 else x


def check_scale(fn: str, scale: Any, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if not isinstance(scale, (numbers.Number, np.generic)) and hasattr(scale, "shape"):
        a = asarray(fn, scale, "scale")  # a 0-d array of NumPy, MLX or PyTorch
        if a.ndim != 0:
            raise TypeError(f"{fn}: scale must be a real number or a 0-d array, got an array of shape {a.shape}")
        scale = a[()]
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{fn}: scale must be a real number or None, got {type(scale).__name__}")
    try:
        s = float(scale)
    except OverflowError:
        raise ValueError(f"{fn}: scale must be finite, got {scale!r:.40}") from None
    if not math.isfinite(s):
        raise ValueError(f"{fn}: scale must be finite, got {s}")
    return s


def check_mask(fn: str, mask: Any, full: tuple) -> Any:
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask not in MASK_STRINGS:
            raise ValueError(f'{fn}: mask must be "causal", "causal_top_left", None or an array, got {mask!r}')
        return mask
    if isinstance(mask, (numbers.Number, np.generic, bytes)):
        raise TypeError(f"{fn}: mask must be a string, None, or a bool or float array, got {type(mask).__name__}")
    m = asarray(fn, mask, "mask")
    if m.dtype.kind != "b" and not is_float(m.dtype):
        raise TypeError(f"{fn}: mask must be a bool or float array, got dtype {m.dtype}")
    grows = m.ndim > len(full) or any(n not in (1, f) for n, f in zip(m.shape[::-1], full[::-1]))
    if grows:
        raise ValueError(f"{fn}: mask must broadcast to (*B, H_q, L, S) = {full}, got shape {shape_str(m)}")
    if m.dtype.kind == "f" and m.dtype.itemsize > 8:  # longdouble: the widest the core reads is float64
        with np.errstate(over="ignore"):
            wide = m
            m = m.astype(np.float64)
        overflow = np.isinf(m) & np.isfinite(wide)
        if overflow.any():
            m[overflow] = np.copysign(np.finfo(np.float64).max, wide[overflow])
    return readable(m)


def check_sinks(fn: str, sinks: Any, H_q: int) -> np.ndarray | None:
    if sinks is None:
        return None
    s = asarray(fn, sinks, "sinks")
    if s.dtype.kind not in "fiu" and not is_bfloat16(s.dtype):
        raise TypeError(f"{fn}: sinks must be real numbers, got dtype {s.dtype}")
    if s.shape != (H_q,):
        raise ValueError(f"{fn}: sinks must have shape (H_q,) = ({H_q},), got {shape_str(s)}")
    return np.array(s, dtype=np.float64)  # a small aligned copy the core reads


def check_int(fn: str, x: Any, name: str, low: int = -INT64_MAX) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(x).__name__}")
    x = int(x)
    if not low <= x <= INT64_MAX:
        raise ValueError(f"{fn}: {name} must be an int from {low} to 2**63 - 1, got {x}")
    return x


def check_window(fn: str, window: Any) -> tuple | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{fn}: window must be None or a pair (left, right) of ints >= 0 or None, got {window!r:.60}")
    return tuple(None if w is None else check_int(fn, w, f"window[{i}]", low=0) for i, w in enumerate(window))


def check_softcap(fn: str, softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{fn}: softcap must be a real number > 0 or None, got {type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{fn}: softcap must be a finite number > 0, got {c}")
    return c


def check_offsets(fn: str, q_offset: Any, k_offset: Any, mask: Any) -> tuple:
    if q_offset is not None:
        q_offset = check_int(fn, q_offset, "q_offset")
        if isinstance(mask, str) and mask == "causal_top_left":
            raise ValueError(
                f'{fn}: q_offset cannot be given with mask="causal_top_left", which means q_offset=0; '
                f'use mask="causal" with q_offset={q_offset}'
            )
    return q_offset, check_int(fn, k_offset, "k_offset")


def check_threads(fn: str, threads: Any) -> int:
    source = "threads"
    if threads is None:
        env = os.environ.get("NPATTN_NUM_THREADS")
        if env is None:
            return None
        source = "NPATTN_NUM_THREADS"
        try:
            threads = int(env)
        except ValueError:
            raise ValueError(f"{fn}: NPATTN_NUM_THREADS must be an int >= 1, got {env!r}") from None
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"{fn}: threads must be an int >= 1 or None, got {type(threads).__name__}")
    threads = int(threads)
    if not 1 <= threads <= _core.MAX_THREADS:
        raise ValueError(f"{fn}: {source} must be an int from 1 to {_core.MAX_THREADS}, got {threads}")
    return threads


def check_bool(fn: str, x: Any, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be True or False, got {type(x).__name__}")
    return bool(x)


def prepare(
    fn: str, q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, threads, has_v: bool = True
) -> Problem:
    """Checks and converts the arguments common to sdpa and its relatives."""
    given = (q, k, v, mask, sinks)  # as the caller gave them: out must overlap none
    q = operand(fn, q, "q")
    k = operand(fn, k, "k")
    v = operand(fn, v, "v") if has_v else None
    dtype = result_dtype(q.dtype, k.dtype, *([v.dtype] if has_v else []))
    rank2 = q.ndim == 2 and k.ndim == 2 and (not has_v or v.ndim == 2)
    got = f"got q {shape_str(q)}, k {shape_str(k)}" + (f", v {shape_str(v)}" if has_v else "")
    qh, kh = with_heads(q), with_heads(k)
    vh = with_heads(v) if has_v else None
    if qh.shape[-1] < 1:
        raise ValueError(f"{fn}: q and k need a row width D >= 1; {got}")
    if kh.shape[-1] != qh.shape[-1]:
        raise ValueError(f"{fn}: k's row width D must equal q's; {got}")
    if has_v and vh.shape[-2] != kh.shape[-2]:
        raise ValueError(f"{fn}: v must have as many rows S as k; {got}")
    if has_v and vh.shape[-3] != kh.shape[-3]:
        raise ValueError(f"{fn}: v must have as many heads as k; {got}")
    widths = (qh.shape[-1], vh.shape[-1]) if has_v else (qh.shape[-1],)
    if max(widths) > _core.BLAS_INT_MAX:
        raise ValueError(f"{fn}: D and D_v must be at most 2**31 - 1, what one BLAS call takes; {got}")
    if kh.shape[-3] < 1:
        raise ValueError(f"{fn}: k needs at least one head; {got}")
    if qh.shape[-3] % kh.shape[-3]:
        raise ValueError(f"{fn}: q has {qh.shape[-3]} heads, not a multiple of k's {kh.shape[-3]} heads; {got}")
    shapes = {"q": qh.shape[:-3], "k": kh.shape[:-3]}
    if has_v:
        shapes["v"] = vh.shape[:-3]
    batch = broadcast_batch(fn, shapes, got)
    H_q, L, D = qh.shape[-3:]
    S = kh.shape[-2]

    scale = check_scale(fn, scale, D)
    mask = check_mask(fn, mask, (*batch, H_q, L, S))
    sinks_array = check_sinks(fn, sinks, H_q)
    window = check_window(fn, window)
    softcap = check_softcap(fn, softcap)
    q_offset, k_offset = check_offsets(fn, q_offset, k_offset, mask)
    threads = check_threads(fn, threads)
    inputs = tuple(a for a in (*given, q, k, v, mask, sinks, sinks_array) if isinstance(a, np.ndarray))
    return Problem(
        q=readable(q),
        k=readable(k),
        v=readable(v) if has_v else None,
        scale=scale,
        mask=mask,
        sinks=sinks_array,
        window=window,
        softcap=softcap,
        q_offset=q_offset,
        k_offset=k_offset,
        threads=threads,
        dtype=dtype,
        shape=(L,) if rank2 else (*batch, H_q, L),
        batch=batch,
        S=S,
        inputs=inputs,
    )


def empty(fn: str, shape: tuple, dtype: np.dtype, what: str = "the result") -> np.ndarray:
    try:
        return np.empty(shape, dtype)
    except MemoryError:
        raise MemoryError(f"{fn}: cannot allocate {what}, shape {shape} of {dtype}") from None
    except ValueError:  # more elements than an array can index
        raise ValueError(f"{fn}: {what}, shape {shape} of {dtype}, is too large for an array") from None


def byte_range(a: np.ndarray) -> tuple:
    """The first and last byte a's elements span (None if a is empty)."""
    if a.size == 0:
        return None
    start = a.__array_interface__["data"][0]
    low = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
    high = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0)
    return start + low, start + high + a.itemsize - 1


def overlaps_itself(a: np.ndarray) -> bool:
    """Whether two indices of a reach the same element: with the axes sorted
    by stride, each must step past everything the smaller ones span."""
    if a.size == 0:
        return False
    axes = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    reach = 0
    for stride, n in axes:
        if stride <= reach + a.itemsize - 1:
            return True
        reach += stride * (n - 1)
    return False


def check_out(fn: str, out: Any, shape: tuple, dtype: np.dtype, inputs: tuple) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{fn}: out must be a numpy.ndarray or None, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{fn}: out must have the result's shape {tuple(shape)} and dtype {dtype}, "
            f"got shape {shape_str(out)} and dtype {out.dtype}"
        )
    if not out.flags.writeable:
        raise ValueError(f"{fn}: out must be writeable, got a read-only array")
    if not out.flags.aligned or not out.dtype.isnative or any(s % out.itemsize for s in out.strides):
        raise ValueError(f"{fn}: out must be aligned and in native byte order")
    if overlaps_itself(out):
        raise ValueError(f"{fn}: out must not overlap itself, got strides {out.strides} for shape {out.shape}")
    mine = byte_range(out)
    for x in inputs:
        theirs = byte_range(x)
        if mine and theirs and mine[0] <= theirs[1] and theirs[0] <= mine[1]:
            raise ValueError(f"{fn}: out must not share memory with an input (q, k, v, mask or sinks)")
    return out


def fitting(fn: str, x: Any, name: str, shape: tuple, what: str) -> np.ndarray:
    """A float operand that must have exactly `shape`, read as the core reads it."""
    a = asarray(fn, x, name)
    if not is_float(a.dtype) or a.dtype.itemsize > 8:
        raise TypeError(f"{fn}: {name} must be an array of floats, got dtype {a.dtype}")
    if a.shape != tuple(shape):
        raise ValueError(f"{fn}: {name} must have {what} {tuple(shape)}, got {shape_str(a)}")
    return readable(a)


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

"""The public ``sdpa``: validates and prepares arguments, then runs the C core."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Optional, Union

import numpy as np

from . import _core, _interop

__all__ = ["sdpa"]

MaskLike = Union[str, None, np.ndarray, Any]

_BLAS_INT_MAX = 2**31 - 1  # OpenBLAS's int: the largest size one call takes

_TooHardError = getattr(np, "exceptions", np).TooHardError

_MASK_STRINGS = {
    "causal": _core.MASK_CAUSAL,
    "causal_top_left": _core.MASK_CAUSAL_TOP_LEFT,
}


def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Optional[float] = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    out: Optional[np.ndarray] = None,
    threads: Optional[int] = None,
) -> np.ndarray:
    """Scaled dot-product attention with grouped-query attention.

    Computes, per query head and per query row::

        out = softmax(scale * q @ k^T + mask) @ v

    Parameters
    ----------
    q : array_like, shape (*Bq, H_q, L, D) or (L, D)
        Queries. Anything ``np.asarray`` takes, with any strides.
    k : array_like, shape (*Bk, H_kv, S, D) or (S, D)
        Keys. ``H_q`` must be a multiple of ``H_kv``.
    v : array_like, shape (*Bv, H_kv, S, D_v) or (S, D_v)
        Values. ``D_v`` may differ from ``D``.
    scale : float, optional
        Multiplies ``q @ k^T``. ``None`` (default) means ``1 / sqrt(D)``.
        Must be finite, and 0 or of magnitude between 1e-30 and 1e30 (1e-300
        and 1e300 for float64), since it is folded into ``q``.
    mask : {"causal", "causal_top_left", None} or array_like, default "causal"
        ``"causal"``: query ``i`` sees key ``j`` iff ``j <= i + (S - L)``,
        aligned to the bottom-right corner as MLX does (a decode step with
        ``L = 1`` sees every key). ``"causal_top_left"``: ``j <= i``, as
        PyTorch's ``is_causal=True``. ``None``: every key visible. A bool
        array broadcastable to ``(*B, H_q, L, S)``: ``True`` = visible. A
        floating array of that shape: added to the scaled scores (``-inf``
        hides), any float dtype.
    sinks : array_like, shape (H_q,), optional
        One logit per query head; ``exp(sink)`` joins that head's softmax
        denominator, unscaled and unmasked (attention sinks).
    out : numpy.ndarray, optional
        A writeable array of exactly the result's shape and dtype that
        overlaps no input; it is filled and returned.
    threads : int, optional
        Threads to compute with. ``None`` uses ``NPATTN_NUM_THREADS`` when
        set, else the CPUs this process may run on. The same inputs with the
        same ``threads`` give bitwise-identical results.

    Returns
    -------
    numpy.ndarray, shape (*B, H_q, L, D_v) or (L, D_v)
        ``B`` is the three batch shapes broadcast by NumPy's rules. The dtype
        is ``np.result_type(q, k, v)``. Rank-2 when all inputs are rank 2.

    Raises
    ------
    TypeError
        An argument of the wrong kind: an integer, bool, complex, object or
        string array; a mask that is a number or an integer array.
    ValueError
        Shapes that disagree, a bad scale, mask string, sinks, out or threads.
    MemoryError
        Scratch memory could not be allocated.
    KeyboardInterrupt
        Ctrl-C stops a long call within half a second.

    Notes
    -----
    Shape legend: ``B`` batch dims, ``H_q`` query heads, ``H_kv`` key/value
    heads, ``L`` query rows, ``S`` key rows, ``D`` query/key width, ``D_v``
    value width. Query head ``h`` reads key/value head
    ``h // (H_q // H_kv)`` (contiguous groups, as MLX, PyTorch and
    llama.cpp).

    A row that sees no key comes out as zeros, never NaN. float32 computes in
    float32 through ``sgemm``; float64 is a true double path through
    ``dgemm``; float16 and ``ml_dtypes.bfloat16`` are converted to float32
    tile by tile and the result is rounded back to the input dtype. Mixed
    dtypes promote by ``np.result_type`` (float16 with bfloat16 gives
    float32). The GIL is released while computing.

    Differences from peers:

    - MLX ``mx.fast.scaled_dot_product_attention``: its default mask is
      ``None`` and its scale is required; on the CPU a row that sees no key
      gives the mean of V (bool mask, or its ``"causal"`` with ``L > S``) or
      NaN (``-inf`` mask); inputs must be rank 4 with equal batch sizes;
      float64 is float32-accurate.
    - PyTorch ``F.scaled_dot_product_attention``: its default mask is
      ``None``; ``is_causal=True`` is top-left (our ``"causal_top_left"``);
      no sinks.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 8, 16, 64), dtype=np.float32)
    >>> k = rng.standard_normal((1, 2, 16, 64), dtype=np.float32)
    >>> v = rng.standard_normal((1, 2, 16, 64), dtype=np.float32)
    >>> npattn.sdpa(q, k, v).shape
    (1, 8, 16, 64)
    """
    q = _as_float_array(q, "q")
    k = _as_float_array(k, "k")
    v = _as_float_array(v, "v")
    dtype = _result_dtype(q.dtype, k.dtype, v.dtype)
    rank2 = q.ndim == 2 and k.ndim == 2 and v.ndim == 2
    got = f"got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"  # as given, before heads are added
    q, k, v = (_with_heads(x) for x in (q, k, v))
    batch = _check_shapes(q, k, v, got)
    H_q, L, D = q.shape[-3:]
    S, D_v = k.shape[-2], v.shape[-1]
    full = (*batch, H_q, L, S)

    scale = _check_scale(scale, D, dtype)
    mask_kind, mask = _prepare_mask(mask, full, dtype)
    sinks = _prepare_sinks(sinks, H_q)
    threads = _check_threads(threads)

    # The result first: a result too large to allocate fails before any copy.
    shape = (*batch, H_q, L, D_v)
    if out is None:
        result = _empty_result(shape, dtype)
    else:
        result = _check_out(out, shape[-2:] if rank2 else shape, dtype, (q, k, v, mask))
        if rank2:
            result = result[np.newaxis]  # a view: out is written in place

    # Read in place what BLAS can read; convert or copy the rest, once, before
    # broadcasting, so a shared k/v batch is never copied per batch.
    q = _native(q, dtype, blas=False)
    k = _native(k, dtype, blas=True)
    v = _native(v, dtype, blas=True)
    q = np.broadcast_to(q, (*batch, *q.shape[-3:]))
    k = np.broadcast_to(k, (*batch, *k.shape[-3:]))
    v = np.broadcast_to(v, (*batch, *v.shape[-3:]))

    if result.size == 0 or S == 0:
        result[...] = 0  # nothing to compute; rows that see no key are zeros
    else:
        _core.sdpa(q, k, v, result, scale, mask_kind, mask, sinks, threads, _is_bfloat16(dtype))
    if out is not None:
        return out
    return result.reshape(shape[-2:]) if rank2 else result


# ---- argument checks; every message names the argument, the rule, what it got ----


def _shape(x: np.ndarray) -> str:
    return str(tuple(x.shape))


def _asarray_named(x: Any, name: str) -> np.ndarray:
    try:
        return _interop.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"sdpa: {name} could not be converted to an array: {e}") from None


def _is_bfloat16(dt: np.dtype) -> bool:
    # ml_dtypes.bfloat16, recognised without importing ml_dtypes
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or _is_bfloat16(dt)


def _result_dtype(*dtypes: np.dtype) -> np.dtype:
    """np.result_type of the inputs; float16 with bfloat16 (which NumPy
    cannot promote) computes in float32."""
    try:
        dt = np.result_type(*dtypes)
    except TypeError:
        dt = np.dtype(np.float32)
    return dt


def _as_float_array(x: Any, name: str) -> np.ndarray:
    if x is None:
        raise TypeError(f"sdpa: {name} must be an array of floats, got None")
    a = _asarray_named(x, name)
    if not _is_float(a.dtype):
        raise TypeError(f"sdpa: {name} must be an array of floats, got dtype {a.dtype}")
    if a.dtype.itemsize > 8:
        raise TypeError(f"sdpa: {name} has dtype {a.dtype}; the widest dtype computed is float64")
    if a.ndim < 2:
        raise ValueError(f"sdpa: {name} must have rank >= 2 (..., L, D), got shape {_shape(a)}")
    return a


def _with_heads(x: np.ndarray) -> np.ndarray:
    # A rank-2 operand (L, D) reads as one head (1, L, D).
    return x[np.newaxis] if x.ndim == 2 else x


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray, got: str) -> tuple:
    if q.shape[-1] < 1:
        raise ValueError(f"sdpa: q and k need a row width D >= 1; {got}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"sdpa: k's row width D must equal q's; {got}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"sdpa: v must have as many rows S as k; {got}")
    if v.shape[-3] != k.shape[-3]:
        raise ValueError(f"sdpa: v must have as many heads as k; {got}")
    if max(q.shape[-1], v.shape[-1]) > _BLAS_INT_MAX:
        raise ValueError(f"sdpa: D and D_v must be at most 2**31 - 1, what one BLAS call takes; {got}")
    if k.shape[-3] < 1:
        raise ValueError(f"sdpa: k needs at least one head; {got}")
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"sdpa: q has {q.shape[-3]} heads, not a multiple of k's {k.shape[-3]} heads; {got}"
        )
    try:
        return tuple(np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except ValueError:
        raise ValueError(f"sdpa: the batch dims of q, k and v do not broadcast; {got}") from None


# The core folds scale * log2(e) into q, in the dtype it computes in; a scale
# this far from 1 would overflow or vanish there even where scale * (q . k)
# does not, so it is refused rather than computed wrongly.
_SCALE_RANGE = {np.dtype(np.float64): (1e-300, 1e300), np.dtype(np.float32): (1e-30, 1e30)}


def _check_scale(scale: Any, D: int, dtype: np.dtype) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        if not (isinstance(scale, np.ndarray) and scale.ndim == 0 and scale.dtype.kind in "fiu"):
            raise TypeError(f"sdpa: scale must be a real number or None, got {type(scale).__name__}")
    try:
        s = float(scale)
    except OverflowError:
        raise ValueError(f"sdpa: scale must be finite, got {scale!r:.40}") from None
    if not math.isfinite(s):
        raise ValueError(f"sdpa: scale must be finite, got {s}")
    computed = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    low, high = _SCALE_RANGE[computed]
    if s != 0 and not low <= abs(s) <= high:
        raise ValueError(
            f"sdpa: scale must be 0 or of magnitude between {low:g} and {high:g} "
            f"when computing in {computed}, got {s!r}"
        )
    return s


def _prepare_mask(mask: Any, full: tuple, dtype: np.dtype) -> tuple:
    if mask is None:
        return _core.MASK_NONE, None
    if isinstance(mask, str):
        if mask not in _MASK_STRINGS:
            raise ValueError(
                f'sdpa: mask must be "causal", "causal_top_left", None or an array, got {mask!r}'
            )
        return _MASK_STRINGS[mask], None
    if isinstance(mask, (numbers.Number, np.generic)):
        raise TypeError(
            f"sdpa: mask must be a string, None, or a bool or float array, got {type(mask).__name__}"
        )
    m = _asarray_named(mask, "mask")
    if m.dtype.kind == "b":
        kind = _core.MASK_BOOL
    elif _is_float(m.dtype):
        kind = _core.MASK_ADD
        m = _mask_in(m, np.float64 if dtype == np.float64 else np.float32)
    else:
        raise TypeError(f"sdpa: mask must be a bool or float array, got dtype {m.dtype}")
    m = _native(m, m.dtype, blas=False)
    try:
        m = np.broadcast_to(m, full)
    except ValueError:
        raise ValueError(
            f"sdpa: mask must broadcast to (*B, H_q, L, S) = {full}, got shape {_shape(m)}"
        ) from None
    return kind, m


def _mask_in(m: np.ndarray, dtype: type) -> np.ndarray:
    """An additive mask in the dtype computed in, converted before broadcasting
    so that it stays small. A finite value beyond that dtype's range becomes
    its largest finite value, not infinity: it still hides nothing by itself."""
    if m.dtype == dtype:
        return m
    with np.errstate(over="ignore"):
        converted = m.astype(dtype)
    overflow = np.isinf(converted) & np.isfinite(m)
    if overflow.any():
        converted[overflow] = np.copysign(np.finfo(dtype).max, m[overflow])
    return converted


def _prepare_sinks(sinks: Any, H_q: int) -> Optional[np.ndarray]:
    if sinks is None:
        return None
    s = _asarray_named(sinks, "sinks")
    if s.dtype.kind not in "fiu" and not _is_bfloat16(s.dtype):
        raise TypeError(f"sdpa: sinks must be real numbers, got dtype {s.dtype}")
    if s.shape != (H_q,):
        raise ValueError(f"sdpa: sinks must have shape (H_q,) = ({H_q},), got {_shape(s)}")
    return np.array(s, dtype=np.float64)  # a small aligned copy the core reads


def _check_threads(threads: Any) -> int:
    source = "threads"
    if threads is None:
        env = os.environ.get("NPATTN_NUM_THREADS")
        if env is None:
            return _available_cpus()
        source = "NPATTN_NUM_THREADS"
        try:
            threads = int(env)
        except ValueError:
            raise ValueError(f"sdpa: NPATTN_NUM_THREADS must be an int >= 1, got {env!r}") from None
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"sdpa: threads must be an int >= 1 or None, got {type(threads).__name__}")
    threads = int(threads)
    if not 1 <= threads <= 4096:
        raise ValueError(f"sdpa: {source} must be an int from 1 to 4096, got {threads}")
    return threads


def _available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _empty_result(shape: tuple, dtype: np.dtype) -> np.ndarray:
    try:
        return np.empty(shape, dtype)
    except MemoryError:
        raise MemoryError(f"sdpa: cannot allocate the result, shape {shape} of {dtype}") from None
    except ValueError:  # more elements than an array can index
        raise ValueError(f"sdpa: the result, shape {shape} of {dtype}, is too large for an array") from None


def _check_out(out: Any, shape: tuple, dtype: np.dtype, inputs: tuple) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"sdpa: out must be a numpy.ndarray or None, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"sdpa: out must have the result's shape {tuple(shape)} and dtype {dtype}, "
            f"got shape {_shape(out)} and dtype {out.dtype}"
        )
    if not out.flags.writeable:
        raise ValueError("sdpa: out must be writeable, got a read-only array")
    if not out.flags.aligned or not out.dtype.isnative:
        raise ValueError("sdpa: out must be aligned and in native byte order")
    for x in inputs:
        if x is not None and _overlaps(out, x):
            raise ValueError("sdpa: out must not overlap an input (q, k, v or mask)")
    return out


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except _TooHardError:
        return True  # too costly to prove apart: refuse rather than risk it


# ---- layout: what the core can read in place ----


def _native(x: np.ndarray, dtype: np.dtype, blas: bool) -> np.ndarray:
    """x in dtype, aligned and native-endian; for BLAS operands also with a
    contiguous last axis and a positive row stride of at least a row that
    fits a 32-bit int. Copies only when x is not already so."""
    if x.dtype != dtype or not x.dtype.isnative or not x.flags.aligned:
        x = np.array(x, dtype=np.dtype(dtype).newbyteorder("="))
    if any(s % x.itemsize for s in x.strides):
        x = np.ascontiguousarray(x)
    if blas and not _blas_readable(x):
        x = np.ascontiguousarray(x)
    return x


def _blas_readable(x: np.ndarray) -> bool:
    rows, width = x.shape[-2], x.shape[-1]
    item = x.itemsize
    if width > 1 and x.strides[-1] != item:
        return False
    if rows > 1:
        ld = x.strides[-2] // item
        if ld < max(width, 1) or ld > _BLAS_INT_MAX:
            return False
    return True

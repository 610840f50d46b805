"""8-bit codes of a KV cache: the formats, and quantize / dequantize.

A code stands for ``scale * (code - zero)``, computed in float32 (``zero`` is 0
for the symmetric formats). The scale (and the zero point) of a row of ``D``
elements comes in ``G`` groups along it: element ``d`` uses group
``d // (D // G)``, so one scale a row is ``G = 1`` and llama.cpp's ``q8_0`` is
int8 codes with a float16 scale per 32 elements, ``G = D / 32``.

=================  ==============  ===============  ===============================
format             codes           largest code     engines that keep it
=================  ==============  ===============  ===============================
``int8``           -128 .. 127     127              ONNX Runtime, llama.cpp q8_0
``uint8``          0 .. 255        (min, max)       OpenVINO (with a zero point)
``float8_e4m3fn``  fp8 e4m3        448              vLLM, SGLang
``float8_e5m2``    fp8 e5m2        57344            vLLM
=================  ==============  ===============  ===============================
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _interop

__all__ = ["Quantized", "quantize", "dequantize", "CODE_DTYPES"]

# name: (largest code, symmetric)
FORMATS = {
    "int8": (127.0, True),
    "uint8": (255.0, False),
    "float8_e4m3fn": (448.0, True),
    "float8_e5m2": (57344.0, True),
}
CODE_DTYPES = tuple(FORMATS)
SCALE_DTYPES = ("float32", "float16", "bfloat16")


class Quantized(NamedTuple):
    """What :func:`quantize` returns: ``codes``, and the ``scale`` and ``zero``
    (None for a symmetric format) that :func:`dequantize` and ``sdpa``'s
    ``k_scale`` / ``k_zero`` take."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None


def code_format(dtype: Any) -> str | None:
    """The code format of a NumPy dtype ('int8', 'uint8', 'float8_e4m3fn', 'float8_e5m2'), or None."""
    name = np.dtype(dtype).name
    return name if name in FORMATS else None


def _dtype_named(fn: str, name: str, dtype: Any) -> np.dtype:
    """The NumPy dtype of a code format given by name or dtype (fp8 through ml_dtypes)."""
    key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)
    try:
        key = np.dtype(dtype).name
    except TypeError:
        pass
    if key not in FORMATS:
        raise ValueError(f"{fn}: {name} must be one of {', '.join(repr(f) for f in FORMATS)}, got {dtype!r}")
    if key.startswith("float8"):
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError(
                f'{fn}: {key} codes are held by ml_dtypes: pip install ml_dtypes (or "npattn[bfloat16]")'
            ) from None
        return np.dtype(getattr(ml_dtypes, key))
    return np.dtype(key)


def _scale_dtype(fn: str, dtype: Any) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in SCALE_DTYPES:
        if str(dtype).rsplit(".", 1)[-1] == "bfloat16":
            return _interop.bfloat16(f"{fn}: scale_dtype")
        raise ValueError(f"{fn}: scale_dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return d


def quantize(
    x: Any, dtype: Any, *, group: int | None = None, symmetric: bool = True, scale_dtype: Any = np.float32
) -> Quantized:
    """8-bit codes of ``x`` along its last axis, with their scales (and zero points).

    Parameters
    ----------
    x : array_like of floats, shape (..., D)
        The values, a K or V cache for instance; any float dtype.
    dtype : {"int8", "uint8", "float8_e4m3fn", "float8_e5m2"} or the dtype
        The code format.
    group : int, optional
        Elements per scale along the last axis: ``None`` (default) is one
        scale a row, ``32`` is llama.cpp's ``q8_0``. Must divide ``D``.
    symmetric : bool, default True
        ``True``: ``scale = max|x| / largest code`` of each group, no zero
        point (int8, and the fp8 formats). ``False``: each group's min and
        max map onto the codes' ends with a zero point (``uint8``: 0 and 255).
    scale_dtype : float32, float16 or bfloat16, default float32
        The dtype the scales (and zero points) are stored in; the codes are
        computed with the float32 scale before it is stored (as llama.cpp does
        for ``q8_0``'s float16 scales).

    Returns
    -------
    Quantized
        ``codes`` of ``x``'s shape in ``dtype``; ``scale`` (and ``zero``, None
        when symmetric) of shape ``x.shape[:-1] + (G,)``, ``G = D // group``
        (1 without a group). Codes are rounded to nearest, ties to even, and
        clamped to the format's range; a group of zeros gets scale 1.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> x = np.array([[0.5, -1.0, 0.25, 2.0]], np.float32)
    >>> q = npattn.quantize(x, "int8")
    >>> q.codes, q.scale
    (array([[ 32, -64,  16, 127]], dtype=int8), array([[0.01574803]], dtype=float32))
    >>> npattn.dequantize(*q)
    array([[ 0.503937 , -1.007874 ,  0.2519685,  2.       ]], dtype=float32)
    """
    fn = "quantize"
    codes_dtype = _dtype_named(fn, "dtype", dtype)
    name = codes_dtype.name
    largest, symmetric_format = FORMATS[name]
    stored = _scale_dtype(fn, scale_dtype)
    if not isinstance(symmetric, (bool, np.bool_)):
        raise TypeError(f"{fn}: symmetric must be True or False, got {symmetric!r}")
    if symmetric and not symmetric_format:
        raise ValueError(f"{fn}: {name} codes are unsigned: quantize them with symmetric=False (a zero point)")
    if not symmetric and name != "uint8" and name != "int8":
        raise ValueError(f"{fn}: {name} codes are symmetric: a zero point is for int8 and uint8 (symmetric=False)")
    x = _interop.asarray(x, f"{fn}: x")
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"):
        raise TypeError(f"{fn}: x must be an array of floats, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{fn}: x needs a last axis of at least one element; got shape {x.shape}")
    D = x.shape[-1]
    size = D if group is None else group
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1 or D % size:
        raise ValueError(f"{fn}: group must divide the last axis, {D}; got {group!r}")
    x = np.asarray(x, np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{fn}: x holds NaN or infinity, which no scale represents")
    groups = x.reshape(*x.shape[:-1], D // size, size)
    if symmetric:
        amax = np.abs(groups).max(axis=-1)
        scale = np.where(amax > 0, amax / np.float32(largest), np.float32(1)).astype(np.float32)
        zero = None
        scaled = groups / scale[..., None]
        low, high = (-128.0, 127.0) if name == "int8" else (-largest, largest)
    else:
        low_value, high_value = groups.min(axis=-1), groups.max(axis=-1)
        span = high_value - low_value
        lo, hi = (0.0, 255.0) if name == "uint8" else (-128.0, 127.0)
        scale = np.where(span > 0, span / np.float32(hi - lo), np.float32(1)).astype(np.float32)
        # the group's min lands on the lowest code (a group of one value, on it)
        zero = (np.float32(lo) - low_value / scale).astype(np.float32)
        scaled = groups / scale[..., None] + zero[..., None]
        low, high = lo, hi
    scaled = np.clip(scaled, low, high)
    if name.startswith("float8"):
        codes = scaled.astype(codes_dtype)  # ml_dtypes rounds to nearest, ties to even
    else:
        codes = np.rint(scaled).astype(codes_dtype)  # rint: ties to even
    codes = codes.reshape(x.shape)
    return Quantized(codes, scale.astype(stored), None if zero is None else zero.astype(stored))


def dequantize(codes: Any, scale: Any, zero: Any = None) -> np.ndarray:
    """The float32 values ``scale * (code - zero)`` that codes stand for.

    Parameters
    ----------
    codes : array_like, shape (..., D)
        int8, uint8, ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.float8_e5m2``.
    scale : array_like of float32, float16 or bfloat16
        Broadcastable to ``codes.shape[:-1] + (G,)`` with ``G`` dividing ``D``:
        element ``d`` uses group ``d // (D // G)``. Finite.
    zero : array_like, optional
        The zero points, shaped as ``scale``; None is 0.

    Returns
    -------
    numpy.ndarray of float32, codes' shape
        Each value computed in float32: ``code - zero`` rounded, then times
        the scale rounded. This is what ``sdpa`` computes with, and what
        ``npattn.reference`` computes from.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> codes = np.array([[1, -2, 3, -4]], np.int8)
    >>> npattn.dequantize(codes, np.float32(0.5))
    array([[ 0.5, -1. ,  1.5, -2. ]], dtype=float32)
    """
    fn = "dequantize"
    codes = _interop.asarray(codes, f"{fn}: codes")
    if code_format(codes.dtype) is None:
        raise TypeError(f"{fn}: codes must be int8, uint8, float8_e4m3fn or float8_e5m2; got dtype {codes.dtype}")
    values = codes.astype(np.float32)
    scale = expand(fn, "scale", scale, codes.shape)
    if zero is not None:
        zero = expand(fn, "zero", zero, codes.shape)
        if code_format(codes.dtype).startswith("float8"):
            raise ValueError(f"{fn}: zero: {codes.dtype.name} codes are symmetric and take no zero point")
        values = values - zero
    return (values * scale).astype(np.float32)


def expand(fn: str, name: str, scale: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A scale (or zero point) as float32 of the codes' full ``shape``: checked
    (float dtype, finite, a last axis G that divides D, broadcastable), then each
    group's value repeated over its D // G elements."""
    s = _interop.asarray(scale, f"{fn}: {name}")
    if s.dtype.name not in SCALE_DTYPES:
        raise TypeError(f"{fn}: {name} must be float32, float16 or bfloat16; got dtype {s.dtype}")
    D = shape[-1]
    G = s.shape[-1] if s.ndim else 1
    if G < 1 or D % G:
        raise ValueError(
            f"{fn}: {name}'s last axis ({G} groups) must divide the codes' last axis ({D}); "
            f"got {name} {tuple(s.shape)}, codes {tuple(shape)}"
        )
    s = np.asarray(s, np.float32)
    if not np.isfinite(s).all():
        raise ValueError(f"{fn}: {name} holds NaN or infinity; got {name} {tuple(s.shape)}")
    grouped = shape[:-1] + (G,)
    try:
        s = np.broadcast_to(s if s.ndim else s.reshape(1), grouped)
    except ValueError:
        raise ValueError(
            f"{fn}: {name} {tuple(s.shape)} does not broadcast to the codes' groups {grouped} (codes {tuple(shape)})"
        ) from None
    return np.repeat(s, D // G, axis=-1)

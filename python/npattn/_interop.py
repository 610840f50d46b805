"""Arrays from other libraries (PyTorch, MLX, anything with DLPack) as NumPy
arrays, without a copy where the memory allows.

How each kind is read, and whether it is copied:

- NumPy arrays: as they are.
- PyTorch tensors: ``detach().numpy()`` (a view of the tensor's memory, with its
  strides, also for tensors that require grad). A tensor on another device is
  first copied to the CPU; one on the ``meta`` device holds no data and is a
  TypeError. bfloat16, which NumPy cannot hold, is viewed as int16 and its bits
  reinterpreted as ``ml_dtypes.bfloat16``: still no copy.
- MLX arrays: through the buffer protocol, which exports MLX's own CPU memory
  with its strides (evaluating the array first). bfloat16, whose buffer format
  ("bfloat16") NumPy cannot parse: a contiguous array's bytes are read as
  ``ml_dtypes.bfloat16`` (no copy); a strided one goes through
  ``view(mx.uint16)``, which MLX may copy.
- Anything else: ``np.asarray``; an object that NumPy can only wrap as a 0-d
  object array but that speaks DLPack goes through ``np.from_dlpack``.

Nothing here imports torch, MLX or ml_dtypes: a library is looked up in
``sys.modules`` (so only when the caller has imported it), and ml_dtypes is
imported only when a bfloat16 array arrives. Which converter a type takes is
decided once per type and remembered, so a call costs a dict lookup.

The way back, a NumPy result as the caller's library's array: :func:`to_mlx`
(MLX copies it) and :func:`to_torch` (no copy), bfloat16 through its bits, as
neither reads ml_dtypes'; :func:`like_dtype` picks the library a dtype names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def asarray(x: Any, name: str = "the array") -> np.ndarray:
    """``x`` as a NumPy array, sharing its memory wherever the layout allows.
    ``name`` (for example "sdpa: q") starts the message of an error."""
    if type(x) is np.ndarray:
        return x
    convert = _converters.get(type(x))
    if convert is None:
        convert = _converter(type(x))
    return convert(x, name)


def to_mlx(a: np.ndarray) -> Any:
    """A NumPy array as an ``mx.array`` (MLX copies it): bfloat16 through its bits,
    float64 kept as float64 (``mx.array`` alone would round it to float32)."""
    import mlx.core as mx  # the caller works in MLX: it is there

    if a.dtype.kind == "V":  # ml_dtypes.bfloat16, which mx.array does not read
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    if a.dtype == np.float64:
        return mx.array(a, dtype=mx.float64)
    return mx.array(a)


def float8(kind: str, name: str = "an fp8 array") -> np.dtype:
    """ml_dtypes' float8_e4m3fn or float8_e5m2, the dtypes NumPy holds fp8 codes in."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(
            f"{name} holds {kind} codes, which NumPy holds through ml_dtypes: "
            'pip install ml_dtypes (or pip install "npattn[bfloat16]")'
        ) from None
    return np.dtype(getattr(ml_dtypes, kind))


def to_torch(a: np.ndarray) -> Any:
    """A NumPy array as a ``torch.Tensor`` on the same memory; bfloat16 through its bits."""
    import torch  # the caller works in PyTorch: it is there

    if a.dtype.kind == "V":  # ml_dtypes.bfloat16, which torch.from_numpy does not know
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def like_dtype(a: np.ndarray, dtype: Any) -> Any:
    """``a`` as an array of the library whose dtype ``dtype`` is: an ``mx.array`` for
    MLX's (``mx.float32``), a ``torch.Tensor`` for PyTorch's (``torch.float16``), ``a``
    itself for NumPy's. A library is looked for only if the caller has imported it."""
    mx, torch = sys.modules.get("mlx.core"), sys.modules.get("torch")
    if mx is not None and isinstance(dtype, mx.Dtype):
        return to_mlx(a)
    if torch is not None and isinstance(dtype, torch.dtype):
        return to_torch(a)
    return a


def bfloat16(name: str = "a bfloat16 array") -> np.dtype:
    """ml_dtypes.bfloat16, the dtype NumPy holds bfloat16 in."""
    global _bfloat16
    if _bfloat16 is None:
        try:
            import ml_dtypes  # an optional extra: only a bfloat16 input needs it
        except ImportError:
            raise ImportError(
                f"{name} is bfloat16, which NumPy holds through ml_dtypes: "
                'pip install ml_dtypes (or pip install "npattn[bfloat16]")'
            ) from None
        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


_bfloat16: np.dtype | None = None
_converters: dict = {}  # type -> converter, filled as types arrive


def _converter(kind: type) -> Callable[[Any, str], np.ndarray]:
    """The converter for objects of type ``kind``, remembered for the next call."""
    torch = sys.modules.get("torch")
    mx = sys.modules.get("mlx.core")
    if issubclass(kind, np.ndarray):
        convert = _as_is
    elif torch is not None and issubclass(kind, torch.Tensor):
        convert = _from_torch
    elif mx is not None and issubclass(kind, mx.array):
        convert = _from_mlx
    else:
        return _from_other  # lists, scalars, other libraries: not remembered, each value may differ
    _converters[kind] = convert
    return convert


def _as_is(x: np.ndarray, name: str) -> np.ndarray:
    return x


def _from_other(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object and a.ndim == 0 and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return a


def _from_torch(x: Any, name: str) -> np.ndarray:
    torch = sys.modules["torch"]
    if x.is_cpu and not (x.requires_grad or x.is_neg() or x.is_conj()):  # the common case, in few steps
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(bfloat16(name))
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # codes NumPy holds through ml_dtypes
            return x.view(torch.uint8).numpy().view(float8(str(x.dtype).rsplit(".", 1)[1], name))
        return x.numpy()
    if x.device.type == "meta":
        raise TypeError(f"{name} is a torch tensor on the 'meta' device, which holds no data")
    t = x.detach()  # a view without autograd, so .numpy() is allowed
    if t.device.type != "cpu":
        t = t.cpu()  # the one case that must copy
    t = t.resolve_conj().resolve_neg()  # no-ops for real tensors
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16(name))
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().view(float8(str(t.dtype).rsplit(".", 1)[1], name))
    return t.numpy()


def _from_mlx(x: Any, name: str) -> np.ndarray:
    mx = sys.modules["mlx.core"]
    if x.dtype != mx.bfloat16:
        return np.asarray(x)  # the buffer protocol: MLX's memory, with its strides
    buffer = memoryview(x)  # evaluates x
    if buffer.c_contiguous:  # its bytes, read as bfloat16: no copy
        return np.frombuffer(buffer.cast("B"), bfloat16(name)).reshape(buffer.shape)
    return np.asarray(x.view(mx.uint16)).view(bfloat16(name))

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
  with its strides (evaluating the array first). bfloat16, which the buffer
  protocol cannot describe, goes through ``view(mx.uint16)``: the same memory
  for a contiguous array.
- Anything else: ``np.asarray``; an object that NumPy can only wrap as a 0-d
  object array but that speaks DLPack goes through ``np.from_dlpack``.

Nothing here imports torch, MLX or ml_dtypes: a library is looked up in
``sys.modules`` (so only when the caller has imported it), and ml_dtypes is
imported only when a bfloat16 array arrives.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def asarray(x: Any, name: str = "the array") -> np.ndarray:
    """``x`` as a NumPy array, sharing its memory wherever the layout allows.
    ``name`` (for example "sdpa: q") starts the message of an error."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(x, torch, name)
    mx = sys.modules.get("mlx.core")
    if mx is not None and isinstance(x, mx.array):
        return _from_mlx(x, mx, name)
    a = np.asarray(x)
    if a.dtype == object and a.ndim == 0 and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return a


def bfloat16(name: str = "a bfloat16 array") -> np.dtype:
    """ml_dtypes.bfloat16, the dtype NumPy holds bfloat16 in."""
    try:
        import ml_dtypes  # an optional extra: only a bfloat16 input needs it
    except ImportError:
        raise ImportError(
            f"{name} is bfloat16, which NumPy holds through ml_dtypes: "
            'pip install ml_dtypes (or pip install "npattn[bfloat16]")'
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def _from_torch(x: Any, torch: Any, name: str) -> np.ndarray:
    if x.device.type == "meta":
        raise TypeError(f"{name} is a torch tensor on the 'meta' device, which holds no data")
    t = x.detach()  # a view without autograd, so .numpy() is allowed
    if t.device.type != "cpu":
        t = t.cpu()  # the one case that must copy
    t = t.resolve_conj().resolve_neg()  # no-ops for real tensors
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16(name))
    return t.numpy()


def _from_mlx(x: Any, mx: Any, name: str) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        return np.asarray(x.view(mx.uint16)).view(bfloat16(name))
    return np.asarray(x)

"""Arrays from other libraries (PyTorch, MLX) as NumPy arrays, without a copy
where the memory allows."""

from __future__ import annotations

from typing import Any

import numpy as np


def asarray(x: Any) -> np.ndarray:
    """``np.asarray(x)``, plus the bfloat16 tensors NumPy cannot take directly:
    their bits are reinterpreted as ``ml_dtypes.bfloat16`` (imported only then)."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "torch" and str(getattr(x, "dtype", "")) == "torch.bfloat16":
        import ml_dtypes
        import torch

        bits = x.detach().cpu().view(torch.int16).numpy()  # shares memory on the CPU
        return bits.view(ml_dtypes.bfloat16)
    if module == "mlx" and str(getattr(x, "dtype", "")) == "mlx.core.bfloat16":
        import ml_dtypes
        import mlx.core as mx

        return np.asarray(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.asarray(x)

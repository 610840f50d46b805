"""The systems timed, one small class each: how to tell it the thread count,
how to hand it arrays, and how to call its attention (and its backward pass).

Every system computes the same thing: float32, causal with positions aligned
to the bottom-right corner (MLX's and npattn's "causal"; PyTorch and JAX get
is_causal only where L == S, since theirs is top-left, and an explicit
bottom-right bool mask otherwise), scale 1/sqrt(D).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

LABELS = {"npattn": "npattn", "numpy": "NumPy", "torch": "PyTorch", "mlx": "MLX", "jax": "JAX"}


def bottom_right(L: int, S: int) -> np.ndarray:
    """True where query i sees key j: j <= i + S - L."""
    return np.tri(L, S, S - L, dtype=bool)


class System:
    name = ""
    package = ""

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def version(self) -> str | None:
        """The installed version, or None when the system is missing."""
        if importlib.util.find_spec(self.package) is None:
            return None
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    def set_threads(self, threads: int) -> dict:
        """Tell the system its thread count where it has a knob; report what it says."""
        return {}

    def native(self, x: np.ndarray) -> Any:
        """A NumPy input as this system's array, outside the clock."""
        return x

    def attention(self, L: int, S: int, threads: int, window=None, softcap=None, causal=True) -> Callable:
        """f(q, k, v) -> the result, computed and waited for, on native arrays."""
        raise NotImplementedError

    def to_numpy(self, out: Any) -> np.ndarray:
        return np.asarray(out)


class Npattn(System):
    name = package = "npattn"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import npattn

        mask = "causal" if causal else None
        return partial(npattn.sdpa, mask=mask, window=window, softcap=softcap, threads=threads)

    def backward(self, threads):
        """(forward, backward): forward(q, k, v) -> (out, lse); backward(dout, q, k, v, out, lse) -> grads."""
        import npattn

        return (
            partial(npattn.sdpa, return_lse=True, threads=threads),
            partial(npattn.sdpa_backward, threads=threads),
        )


class Numpy(System):
    """The tutorial's formula (npattn.reference.formula), NumPy's own BLAS limited to T threads."""

    name = package = "numpy"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        from npattn.reference import causal_mask, formula

        mask = causal_mask(L, S, np.float32) if causal and L > 1 else None  # decode sees every key
        return partial(formula, mask=mask)


class Torch(System):
    name = package = "torch"

    def set_threads(self, threads):
        import torch

        torch.set_num_threads(threads)
        return {"torch.get_num_threads()": torch.get_num_threads()}

    def native(self, x):
        import torch

        return torch.from_numpy(x)

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import torch
        import torch.nn.functional as F

        kw: dict[str, Any] = {"enable_gqa": True}
        if causal and L == S:
            kw["is_causal"] = True
        elif causal and L > 1:
            kw["attn_mask"] = torch.from_numpy(bottom_right(L, S))

        def call(q, k, v):
            with torch.inference_mode():
                return F.scaled_dot_product_attention(q, k, v, **kw)

        return call

    def to_numpy(self, out):
        return out.detach().numpy()

    def backward(self, threads):
        """Autograd through F.scaled_dot_product_attention (its CPU flash backward)."""
        import torch.nn.functional as F

        def forward(q, k, v):
            q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[-3] != k.shape[-3])
            return out, (q, k, v)

        def backward(dout, q, k, v, out, saved):
            out.backward(dout)
            return tuple(x.grad for x in saved)

        return forward, backward


class Mlx(System):
    name = "mlx"
    package = "mlx"

    def native(self, x):
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
        a = mx.array(x)
        mx.eval(a)
        return a

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import mlx.core as mx

        mask = "causal" if causal and L > 1 else None  # MLX's "causal" is bottom-right

        def call(q, k, v):
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
            mx.eval(out)
            return out

        return call


class Jax(System):
    name = package = "jax"

    def set_threads(self, threads):
        return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}

    def native(self, x):
        import jax
        import jax.numpy as jnp

        # JAX's layout is (B, T, N, H): transpose once, outside the clock
        return jax.device_put(jnp.asarray(x.transpose(0, 2, 1, 3)), jax.devices("cpu")[0])

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import jax
        import jax.numpy as jnp

        kw: dict[str, Any] = {}
        if causal and L == S:
            kw["is_causal"] = True
        elif causal and L > 1:
            kw["mask"] = jnp.asarray(bottom_right(L, S)[None, None])
        compiled = {}

        def call(q, k, v):
            if q.shape not in compiled:
                compiled[q.shape] = jax.jit(partial(jax.nn.dot_product_attention, **kw)).lower(q, k, v).compile()
            return compiled[q.shape](q, k, v).block_until_ready()

        return call

    def to_numpy(self, out):
        return np.asarray(out).transpose(0, 2, 1, 3)


SYSTEMS = {s.name: s for s in (Npattn(), Numpy(), Torch(), Mlx(), Jax())}

"""npattn as a drop-in for ``mlx.core.fast.scaled_dot_product_attention``.

    import npattn.mlx
    out = npattn.mlx.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")

MLX's signature and semantics, computed by ``npattn.sdpa`` on the arrays' own
memory (read through the buffer protocol, no copy of a contiguous q, k or v),
returning an ``mx.array`` of the inputs' dtype whose gradient
(``mx.grad``, ``mx.vjp``) is ``npattn.sdpa_backward``, through an
``mx.custom_function``. Pure Python on npattn's public functions.
"""

from __future__ import annotations

try:
    import mlx.core as mx
except ImportError as e:  # the optional extra is missing
    raise ModuleNotFoundError(
        "npattn.mlx needs MLX (the package 'mlx'), which is not installed: pip install mlx (Linux: \"mlx[cpu]\")",
        name="mlx",
    ) from e

import numpy as np

import npattn

from . import _interop

__all__ = ["scaled_dot_product_attention"]

FN = "npattn.mlx.scaled_dot_product_attention"


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None):
    """``mx.fast.scaled_dot_product_attention``, computed by npattn.

    Parameters
    ----------
    q : mx.array, shape (B, N_q, T_q, D)
        Queries: float16, bfloat16, float32 or float64. npattn also takes
        any number of batch dims (or none), broadcast.
    k : mx.array, shape (B, N_kv, T_kv, D)
        Keys; ``N_q`` a multiple of ``N_kv`` (query head ``h`` reads key
        head ``h // (N_q // N_kv)``, as MLX).
    v : mx.array, shape (B, N_kv, T_kv, D_v)
        Values.
    scale : float
        Multiplies ``q @ k^T``; required, as in MLX.
    mask : {None, "causal"} or mx.array, optional
        ``None`` (default): every key visible. ``"causal"``: aligned to the
        bottom-right corner, as MLX (query ``i`` sees key ``j`` iff
        ``j <= i + T_kv - T_q``). A bool array broadcastable to
        ``(B, N_q, T_q, T_kv)``, ``True`` = visible, or an additive one of
        any float dtype (``-inf`` hides). No gradient flows to the mask.
    sinks : mx.array, shape (N_q,), optional
        One logit per query head joining its softmax denominator, as MLX's
        ``sinks=``; it gets a gradient.

    Returns
    -------
    mx.array, shape (B, N_q, T_q, D_v)
        In the inputs' dtype (NumPy's promotion when they differ).

    Notes
    -----
    One difference from MLX, on purpose: a row that sees no key (a bool
    mask that hides every key, MLX's ``"causal"`` with ``T_q > T_kv``, an
    additive mask of ``-inf`` across a row) is zeros here, and its
    gradients are zeros. MLX's CPU path gives the mean of V for a bool or
    causal mask and NaN for a ``-inf`` one. float64 is computed in double
    (MLX's is float32-accurate). The computation leaves MLX's graph: it
    runs eagerly, on the CPU, and cannot be traced by ``mx.compile`` or
    ``mx.vmap``.

    Examples
    --------
    >>> import mlx.core as mx, npattn.mlx
    >>> q = mx.random.normal((1, 8, 4, 64)); k = mx.random.normal((1, 2, 6, 64))
    >>> out = npattn.mlx.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
    >>> out.shape
    (1, 8, 4, 64)
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{FN}: {name} must be an mx.array, got {type(x).__name__}")
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'{FN}: mask must be None, "causal" or an array, got {mask!r}')
    elif mask is not None:
        if not isinstance(mask, (mx.array, np.ndarray)):
            raise TypeError(f'{FN}: mask must be None, "causal" or an array, got {type(mask).__name__}')
        mask = _interop.asarray(mask, f"{FN}: mask")  # a constant: no gradient
    if sinks is not None and not isinstance(sinks, mx.array):
        sinks = mx.array(sinks)
    return _attention(q, k, v, sinks, (scale, mask))[0]


@mx.custom_function
def _attention(q, k, v, sinks, options):
    """(out, lse): the forward pass, keeping the log-sum-exp for the backward."""
    scale, mask = options
    arrays = [_interop.asarray(x) for x in (q, k, v)]
    s = None if sinks is None else _interop.asarray(sinks)
    out, lse = npattn.sdpa(*arrays, scale, mask, sinks=s, return_lse=True)
    return _interop.to_mlx(out), _interop.to_mlx(lse)


@_attention.vjp
def _attention_vjp(primals, cotangents, outputs):
    q, k, v, sinks, (scale, mask) = primals
    arrays = [_interop.asarray(x) for x in (cotangents[0], q, k, v, *outputs)]
    s = None if sinks is None else _interop.asarray(sinks)
    grads = npattn.sdpa_backward(*arrays, scale, mask, sinks=s)
    dsinks = None if sinks is None else _interop.to_mlx(grads.dsinks).astype(sinks.dtype)
    return _interop.to_mlx(grads.dq), _interop.to_mlx(grads.dk), _interop.to_mlx(grads.dv), dsinks, (None, None)

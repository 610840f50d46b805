"""npattn as a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    import npattn.torch
    out = npattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

PyTorch's signature, defaults and semantics, computed by ``npattn.sdpa`` on the
tensors' own memory (no copy of q, k or v), returning a ``torch.Tensor`` of the
inputs' dtype (bfloat16 included) that autograd differentiates through
``npattn.sdpa_backward``. Pure Python on npattn's public functions: nothing is
built against PyTorch.
"""

from __future__ import annotations

import numbers
from typing import Any

try:
    import torch
except ImportError as e:  # the optional extra is missing
    raise ModuleNotFoundError(
        "npattn.torch needs PyTorch (the package 'torch'), which is not installed: "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        name="torch",
    ) from e

import numpy as np
from torch.autograd.function import once_differentiable

import npattn

from . import _interop

__all__ = ["scaled_dot_product_attention"]

try:  # PyTorch >= 2.3: the bias objects of torch.nn.attention.bias
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover - older PyTorch
    CausalBias = CausalVariant = None

FN = "npattn.torch.scaled_dot_product_attention"


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by npattn.

    Parameters
    ----------
    query : torch.Tensor, shape (N, ..., H_q, L, E)
        CPU tensor of float16, bfloat16, float32 or float64, any strides.
    key : torch.Tensor, shape (N, ..., H, S, E)
        Of query's dtype.
    value : torch.Tensor, shape (N, ..., H, S, E_v)
        Of query's dtype. ``E_v`` may differ from ``E``.
    attn_mask : torch.Tensor or CausalBias, optional
        A bool tensor broadcastable to ``(N, ..., H_q, L, S)``, ``True`` where
        a query attends (as PyTorch); a float tensor of that shape, added to
        the scaled scores (``-inf`` hides); or
        ``torch.nn.attention.bias.causal_lower_right(L, S)`` (npattn's
        ``"causal"``) or ``causal_upper_left(L, S)``. A mask gets no
        gradient, so a float mask that requires grad is an error.
    dropout_p : float, default 0.0
        Must be 0: npattn has no dropout (``ValueError`` otherwise).
    is_causal : bool, default False
        Causal with the mask aligned to the top-left corner, as PyTorch:
        query ``i`` sees key ``j`` iff ``j <= i`` (npattn's
        ``"causal_top_left"``). Not with ``attn_mask``.
    scale : float, optional
        ``None`` (default) means ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: ``H_q`` a multiple of ``H``, query head
        ``h`` reading key/value head ``h // (H_q // H)``. Without it the
        head dims must be equal or 1 (broadcast), as in PyTorch.

    Returns
    -------
    torch.Tensor, shape (N, ..., H_q, L, E_v)
        In the inputs' dtype, on the CPU, sharing memory with nothing. When
        grad is enabled and an input requires grad, it carries a
        ``grad_fn`` whose backward is ``npattn.sdpa_backward`` (from the
        log-sum-exp the forward pass saved).

    Raises
    ------
    TypeError
        Inputs that are not tensors, or of different or non-float dtypes.
    ValueError
        ``dropout_p`` other than 0, ``attn_mask`` with ``is_causal``, a
        causal bias of other lengths than (L, S), heads that neither group
        nor broadcast, tensors not on the CPU, a mask that requires grad;
        and every error of ``npattn.sdpa``.

    Notes
    -----
    Differences from PyTorch: no dropout; no gradient for ``attn_mask``;
    CPU tensors only; the result's threads are ``torch.get_num_threads()``.
    A row that sees no key is zeros in both (PyTorch >= 2.5).

    Examples
    --------
    >>> import torch, npattn.torch
    >>> q = torch.randn(1, 8, 4, 64, requires_grad=True)
    >>> k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    >>> out = npattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([1, 8, 4, 64])
    """
    operands = {"query": query, "key": key, "value": value}
    for name, t in operands.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{FN}: npattn computes on the CPU; {name} is on {t.device}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"{FN}: query, key and value must have the same dtype, got {query.dtype}, {key.dtype} and {value.dtype}"
        )
    if not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(f"{FN}: dropout_p must be 0.0, npattn has no dropout; got {dropout_p!r}")
    query, key, value = _heads(query, key, value, enable_gqa)
    mask = _mask(attn_mask, is_causal, query.shape[-2], key.shape[-2])
    threads = torch.get_num_threads()
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _Attention.apply(query, key, value, scale, mask, threads)
    q, k, v = (_interop.asarray(t) for t in (query, key, value))
    return _tensor(npattn.sdpa(q, k, v, scale, mask, threads=threads))


class _Attention(torch.autograd.Function):
    """npattn.sdpa forward (keeping the log-sum-exp), npattn.sdpa_backward backward."""

    @staticmethod
    def forward(ctx: Any, query, key, value, scale, mask, threads):
        q, k, v = (_interop.asarray(t) for t in (query, key, value))
        out, lse = npattn.sdpa(q, k, v, scale, mask, return_lse=True, threads=threads)
        result = _tensor(out)
        ctx.save_for_backward(query, key, value, result)  # in-place changes to any of them are caught
        ctx.lse, ctx.options = lse, (scale, mask, threads)
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout):
        query, key, value, result = ctx.saved_tensors
        scale, mask, threads = ctx.options
        arrays = (_interop.asarray(t) for t in (dout, query, key, value, result))
        grads = npattn.sdpa_backward(*arrays, ctx.lse, scale, mask, threads=threads)
        wanted = ctx.needs_input_grad
        dq, dk, dv = (_tensor(g) if wanted[i] else None for i, g in enumerate(grads[:3]))
        return dq, dk, dv, None, None, None


def _heads(query, key, value, enable_gqa: bool) -> tuple:
    """query, key and value with heads npattn groups: with enable_gqa, H_q a
    multiple of H (npattn's rule); without, head dims that broadcast (one of
    them 1), expanded where npattn's groups cannot express them."""
    heads = [t.shape[-3] if t.dim() >= 3 else 1 for t in (query, key, value)]
    got = f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if enable_gqa:
        if heads[1] != heads[2] or heads[1] < 1 or heads[0] % heads[1]:
            raise ValueError(
                f"{FN}: with enable_gqa, key and value must have equally many heads that divide query's; {got}"
            )
        return query, key, value
    if heads[0] == heads[1] == heads[2] or (heads[1] == heads[2] == 1):
        return query, key, value  # equal heads, or one key/value head for all: npattn's groups
    wide = max(heads)
    if any(h not in (1, wide) for h in heads):
        raise ValueError(f"{FN}: the head dims of query, key and value must be equal or 1 without enable_gqa; {got}")

    def expanded(t, h):  # a zero-stride view; autograd sums its gradient back
        if h == wide:
            return t
        shape = list(t.shape) if t.dim() >= 3 else [1, *t.shape]
        shape[-3] = wide
        return t.expand(shape)

    return tuple(expanded(t, h) for t, h in zip((query, key, value), heads))


def _mask(attn_mask, is_causal: bool, L: int, S: int) -> Any:
    """PyTorch's attn_mask and is_causal as npattn's mask."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{FN}: is_causal must be True or False, got {type(is_causal).__name__}")
    if is_causal:
        if attn_mask is not None:
            raise ValueError(f"{FN}: attn_mask must be None when is_causal=True (as in PyTorch)")
        return "causal_top_left"
    if attn_mask is None:
        return None
    if CausalBias is not None and isinstance(attn_mask, CausalBias):
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
            raise ValueError(
                f"{FN}: attn_mask is a causal bias for L={attn_mask.seq_len_q}, S={attn_mask.seq_len_kv}, "
                f"but query has L={L} rows and key S={S}"
            )
        return "causal" if attn_mask.variant == CausalVariant.LOWER_RIGHT else "causal_top_left"
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{FN}: attn_mask must be a torch.Tensor, a CausalBias or None, got {type(attn_mask).__name__}")
    if attn_mask.device.type != "cpu":
        raise ValueError(f"{FN}: npattn computes on the CPU; attn_mask is on {attn_mask.device}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{FN}: attn_mask requires grad, but npattn computes no gradient for the mask; pass attn_mask.detach()"
        )
    return _interop.asarray(attn_mask, f"{FN}: attn_mask")


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A NumPy result as a torch tensor on the same memory; bfloat16 through its bits."""
    if a.dtype.kind == "V":  # ml_dtypes.bfloat16, which torch.from_numpy does not know
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)

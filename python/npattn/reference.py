"""Scaled dot-product attention in plain NumPy: the reference npattn is tested against.

    out = softmax(scale * q @ k^T + mask) @ v        (per query head, per row)

This module computes in float64 and is written to be read: it follows the
tutorial step for step (scale, scores, mask, softmax, weighted sum of values)
and does grouped-query attention by reshaping, as the tutorial does.

Shapes, outermost first::

    q       (*B, H_q,  L, D)       B    batch dims, any number, broadcast by NumPy's rules
    k       (*B, H_kv, S, D)       H_q  query heads, a multiple of H_kv
    v       (*B, H_kv, S, D_v)     H_kv key/value heads
    mask    broadcastable to       L    query length (new tokens)
            (*B, H_q, L, S)        S    key/value length (the whole context)
    result  (*B, H_q, L, D_v)      D    q/k head size;  D_v  v head size

A rank-2 operand ``(L, D)`` reads as one head; if q, k and v are all rank 2 the
result is rank 2, ``(L, D_v)``.

Grouped-query attention: the H_q query heads form H_kv contiguous groups of
``n_repeats = H_q // H_kv``; query head ``h`` reads key/value head ``h // n_repeats``.

Causal rule: query ``i`` sees key ``j`` iff ``j <= i + (S - L)``. The mask is
aligned to the bottom-right corner, so the last query sees every key; during
decode (``L = 1``) the one query sees the whole context. ``"causal_top_left"``
is ``j <= i`` (PyTorch's ``is_causal=True``).

A row that sees no key (every score ``-inf``, no sink) comes out as zeros.
"""

import numbers

import numpy as np

__all__ = ["causal_mask", "sdpa"]

MASK_STRINGS = ("causal", "causal_top_left")


def causal_mask(L, S, dtype=np.float32):
    """The ``(L, S)`` additive causal mask: 0 where query i sees key j, -inf elsewhere.

    Bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + (S - L)``.

    >>> causal_mask(2, 4)
    array([[  0.,   0.,   0., -inf],
           [  0.,   0.,   0.,   0.]], dtype=float32)
    """
    visible = np.tril(np.ones((L, S), dtype=bool), k=S - L)
    return np.where(visible, 0.0, -np.inf).astype(dtype)


def _is_float(dtype):
    """NumPy's floats, and ml_dtypes.bfloat16 (which NumPy does not count as one)."""
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _result_dtype(*dtypes):
    """The dtype of the result: np.result_type, except that float16 with
    bfloat16, which NumPy cannot promote, gives float32."""
    try:
        return np.result_type(*dtypes)
    except TypeError:
        return np.dtype(np.float32)


def _additive_mask(mask, L, S):
    """Turn any accepted ``mask`` into a float64 array added to the scaled scores."""
    if isinstance(mask, str):
        if mask == "causal":
            return causal_mask(L, S, np.float64)
        if mask == "causal_top_left":
            visible = np.tril(np.ones((L, S), dtype=bool))
            return np.where(visible, 0.0, -np.inf)
        raise ValueError(f"sdpa: mask must be one of {MASK_STRINGS}, None or an array; got {mask!r}")
    if mask is None:
        return np.zeros((L, S))
    if isinstance(mask, (numbers.Number, np.generic)):
        raise TypeError(f"sdpa: mask must be a string, None or an array; got {mask!r}")
    mask = np.asarray(mask)
    if mask.dtype == bool:
        return np.where(mask, 0.0, -np.inf)  # True = visible
    if _is_float(mask.dtype):
        return mask.astype(np.float64)
    raise TypeError(f"sdpa: mask must be bool or floating; got dtype {mask.dtype}")


def _sink_logits(sinks, H_q):
    """One float64 logit per query head; -inf (exp(-inf) = 0) when there are no sinks."""
    if sinks is None:
        return np.full(H_q, -np.inf)
    sinks = np.asarray(sinks)
    if sinks.dtype.kind not in "iuf":
        raise TypeError(f"sdpa: sinks must be real numbers; got dtype {sinks.dtype}")
    if sinks.shape != (H_q,):
        raise ValueError(f"sdpa: sinks must have shape ({H_q},), one per query head; got {sinks.shape}")
    return sinks.astype(np.float64)


def sdpa(q, k, v, scale=None, mask="causal", *, sinks=None, out=None, threads=None):
    """Scaled dot-product attention with grouped-query attention, in float64.

    Same signature and semantics as ``npattn.sdpa``; ``threads`` is accepted
    and ignored. Returns an array of ``np.result_type(q, k, v)``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dtype = _result_dtype(q.dtype, k.dtype, v.dtype)
    if not _is_float(dtype):
        raise TypeError(f"sdpa: q, k and v must be floating arrays; got {q.dtype}, {k.dtype}, {v.dtype}")
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ValueError(f"sdpa: q, k and v need rank >= 2; got {q.shape}, {k.shape}, {v.shape}")
    all_rank_2 = q.ndim == k.ndim == v.ndim == 2

    # A rank-2 operand (L, D) is one head: (1, L, D). Compute in float64.
    q, k, v = (np.asarray(x[None] if x.ndim == 2 else x, dtype=np.float64) for x in (q, k, v))
    *Bq, H_q, L, D = q.shape
    *Bk, H_kv, S, D_k = k.shape
    *Bv, H_kv_v, S_v, D_v = v.shape
    if (D_k, H_kv_v, S_v) != (D, H_kv, S) or H_kv < 1 or H_q % H_kv:
        raise ValueError(f"sdpa: shapes do not fit together; got q {q.shape}, k {k.shape}, v {v.shape}")
    B = np.broadcast_shapes(tuple(Bq), tuple(Bk), tuple(Bv))

    # Step 1: the scale factor, 1/sqrt(D) unless given.
    factor = D**-0.5 if scale is None else float(scale)

    # GQA by reshape: query head h = g * n_repeats + r shares key/value head g.
    # q: (*B, H_q, L, D) -> (*B, H_kv, n_repeats, L, D); k, v: (*B, H_kv, 1, S, D)
    n_repeats = H_q // H_kv
    q = q.reshape(*Bq, H_kv, n_repeats, L, D)
    k = k.reshape(*Bk, H_kv, 1, S, D)
    v = v.reshape(*Bv, H_kv, 1, S, D_v)

    # Step 2: relevance scores, scaled; k is broadcast across the n_repeats axis.
    scores = (q @ k.swapaxes(-2, -1)) * factor  # (*B, H_kv, n_repeats, L, S)

    # Step 3: add the mask, broadcast to (*B, H_q, L, S) and grouped like the scores.
    bias = np.broadcast_to(_additive_mask(mask, L, S), (*B, H_q, L, S))
    scores = scores + bias.reshape(*B, H_kv, n_repeats, L, S)

    # Step 4: softmax over the keys; each head's sink logit joins its rows' max and sum.
    sink = _sink_logits(sinks, H_q).reshape(H_kv, n_repeats, 1, 1)
    # Subtract the row max so exp never overflows.
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    # A row that sees no key has max -inf: shift by 0 instead, so exp gives zeros, not NaN.
    row_max = np.where(row_max == -np.inf, 0.0, row_max)
    e = np.exp(scores - row_max)
    denom = e.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)
    # Such a row has e == 0 and denom == 0; dividing by 1 keeps it zeros.
    weights = e / np.where(denom == 0, 1.0, denom)

    # Step 5: weighted sum of values, then the groups back to H_q heads.
    result = (weights @ v).reshape(*B, H_q, L, D_v)
    result = result[0] if all_rank_2 else result
    result = result.astype(dtype)

    if out is None:
        return result
    if not isinstance(out, np.ndarray) or out.shape != result.shape or out.dtype != dtype:
        raise ValueError(f"sdpa: out must be a {dtype} array of shape {result.shape}")
    out[...] = result
    return out

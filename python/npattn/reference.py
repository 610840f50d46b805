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

Per-request key ranges (``k_start``, ``k_lengths``): request ``b`` reads only key rows
``k_start[b] <= j < k_start[b] + k_lengths[b]``, whose positions count from its first row
(``request_visible_keys``); the rows it does not read are zeros here, never used.

Positions: query row ``i`` sits at ``q_offset + i`` (default ``S - L``), key row
``j`` at ``k_offset + j`` (default 0). Causal rule: a key is visible iff its
position is at most the query's, so with the defaults query ``i`` sees key ``j``
iff ``j <= i + (S - L)``: the mask is aligned to the bottom-right corner, the
last query sees every key, and during decode (``L = 1``) the one query sees the
whole context. ``"causal_top_left"`` is ``q_offset = 0``, ``j <= i`` (PyTorch's
``is_causal=True``). A window ``(left, right)`` keeps keys with
``q_pos - left <= k_pos <= q_pos + right``.

A row that sees no key (every score ``-inf``, no sink) comes out as zeros, with
log-sum-exp ``-inf``.
"""

import dataclasses
import numbers
from typing import Any

import numpy as np

from ._args import result_dtype, unbroadcast
from ._quant import code_format, dequantize

__all__ = ["causal_mask", "sdpa", "paged_attention", "gather_pages", "sdpa_backward", "attention_weights", "formula"]

MASK_STRINGS = ("causal", "causal_top_left")


def causal_mask(L: int, S: int, dtype: Any = np.float32) -> np.ndarray:
    """The ``(L, S)`` causal mask: query i sees key j iff ``j <= i + (S - L)`` (bottom-right).

    For a float ``dtype`` it is the additive mask, 0 where query i sees key j
    and ``-inf`` elsewhere; for a bool ``dtype`` it is ``True`` where the key
    is visible, as every bool mask in npattn reads. Either one passed as
    ``sdpa(..., mask=causal_mask(L, S, dtype))`` equals ``mask="causal"``.

    ``dtype`` is a NumPy dtype (``bool`` included), or MLX's or PyTorch's
    (``mx.float32``, ``mx.bool_``, ``torch.float16``...); the result is a
    NumPy array whichever it is: ``mx.array(m)`` or ``torch.from_numpy(m)``
    converts it.

    Raises
    ------
    TypeError
        ``dtype`` is not a float or bool dtype (an integer dtype cannot hold
        ``-inf``).

    >>> causal_mask(2, 4)
    array([[  0.,   0.,   0., -inf],
           [  0.,   0.,   0.,   0.]], dtype=float32)
    >>> causal_mask(2, 4, bool)
    array([[ True,  True,  True, False],
           [ True,  True,  True,  True]])
    """
    dt = _numpy_dtype(dtype)
    visible = np.tril(np.ones((L, S), dtype=bool), k=S - L)
    if dt.kind == "b":
        return visible  # True = visible
    if not _is_float(dt):
        raise TypeError(f"causal_mask: dtype must be a float or bool dtype, got {dtype!r}")
    return np.where(visible, 0.0, -np.inf).astype(dt)


def _numpy_dtype(dtype):
    """A NumPy dtype from a NumPy, MLX or PyTorch dtype (``mx.float32``, ``torch.float16``)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        name = str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32", "torch.float16"
        if name == "bfloat16":
            from ._interop import bfloat16

            return bfloat16()
        try:
            return np.dtype(name)
        except TypeError:
            raise TypeError(f"causal_mask: dtype must be a float or bool dtype, got {dtype!r}") from None


def _is_float(dtype):
    """NumPy's floats, and ml_dtypes.bfloat16 (which NumPy does not count as one)."""
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def visible_keys(L, S, mask="causal", window=None, q_offset=None, k_offset=0):
    """The ``(L, S)`` bool array of keys each query may see by position alone.

    Query row ``i`` sits at ``q_offset + i`` and key row ``j`` at ``k_offset + j``.
    A string ``mask`` adds the causal rule; ``window=(left, right)`` keeps keys
    with ``q_pos - left <= k_pos <= q_pos + right`` (``None``: unbounded side).

    Positions are integers of any size: each rule is a bound on ``j - i``,
    computed exactly in Python integers (``k_pos <= q_pos`` is
    ``j - i <= q_offset - k_offset``), so offsets and window sides near 2**63
    cannot wrap around.
    """
    if isinstance(mask, str) and mask == "causal_top_left":
        q_offset = 0
    if q_offset is None:
        q_offset = S - L
    diagonal = int(q_offset) - int(k_offset)  # key j is at the query's position when j - i == diagonal
    # j - i lies in [-(L - 1), S - 1]: a bound beyond that range keeps or hides every key alike,
    # so each bound is clipped to it before it meets the int64 array of j - i.
    reach = L + S

    def bound(x):
        return max(-reach, min(reach, x))

    j_minus_i = np.arange(S, dtype=np.int64)[None, :] - np.arange(L, dtype=np.int64)[:, None]
    visible = np.ones((L, S), dtype=bool)
    if isinstance(mask, str):
        visible &= j_minus_i <= bound(diagonal)
    if window is not None:
        left, right = window
        if left is not None:
            visible &= j_minus_i >= bound(diagonal - int(left))
        if right is not None:
            visible &= j_minus_i <= bound(diagonal + int(right))
    return visible


def _per_request(fn, name, x, B):
    """An int or int array broadcast to the batch shape B, as Python ints per request."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{fn}: {name} must be an int or an array of ints, got dtype {a.dtype}")
    try:
        return np.broadcast_to(a, B)
    except ValueError:
        raise ValueError(f"{fn}: {name} must broadcast to the batch shape B = {B}, got shape {a.shape}") from None


def key_ranges(B, S, k_start=None, k_lengths=None, fn="sdpa"):
    """Per request b of the batch shape B, the key rows it reads: (start, length), each of shape B.

    Defaults ``k_start = 0``, ``k_lengths = S - k_start``; a range outside ``[0, S]`` is a
    ``ValueError`` naming the argument and the request.
    """
    start = _per_request(fn, "k_start", 0 if k_start is None else k_start, B).astype(object)
    length = S - start if k_lengths is None else _per_request(fn, "k_lengths", k_lengths, B).astype(object)
    length = np.asarray(length, dtype=object)  # for B = (), S - start is an int, not an array
    for b in np.ndindex(*B):
        where = f"[{', '.join(map(str, b))}]" if b else ""
        if not 0 <= start[b] <= S:
            raise ValueError(f"{fn}: k_start{where} = {start[b]} lies outside [0, S] = [0, {S}]")
        if length[b] < 0:
            raise ValueError(f"{fn}: k_lengths{where} = {length[b]} must be at least 0")
        if start[b] + length[b] > S:
            raise ValueError(f"{fn}: k_lengths{where} = {length[b]} runs past S = {S} (k_start{where} = {start[b]})")
    return start, length


def request_visible_keys(B, L, S, mask="causal", window=None, q_offset=None, k_offset=0, k_start=None, k_lengths=None):
    """The ``(*B, L, S)`` bool array of keys each request's queries may see: by position, and
    within the request's key range.

    Request ``b`` reads only key rows ``k_start[b] <= j < k_start[b] + k_lengths[b]``, and
    positions count from its first row: row ``j`` sits at ``k_offset + j - k_start[b]``.
    ``q_offset`` (an int, or an int array broadcastable to ``B``) defaults to
    ``k_offset + k_lengths[b] - L``, the bottom-right corner of the request's own context.
    """
    start, length = key_ranges(B, S, k_start, k_lengths)
    top_left = isinstance(mask, str) and mask == "causal_top_left"
    offsets = None if q_offset is None else _per_request("sdpa", "q_offset", q_offset, B)
    j = np.arange(S)
    visible = np.zeros((*B, L, S), dtype=bool)
    for b in np.ndindex(*B):
        if top_left:
            qo = 0
        elif offsets is None:
            qo = int(k_offset) + int(length[b]) - L  # bottom-right of this request's own keys
        else:
            qo = int(offsets[b])
        by_position = visible_keys(L, S, mask, window, qo, int(k_offset) - int(start[b]))
        visible[b] = by_position & ((start[b] <= j) & (j < start[b] + length[b]))
    return visible


@dataclasses.dataclass(frozen=True)
class _Options:
    """The options of a call, as sdpa takes them: what the scores and the keys
    each row sees depend on (the operands aside). One record that the reference
    and npattn.testing pass along, instead of each of its fields."""

    scale: Any = None
    mask: Any = "causal"
    sinks: Any = None
    window: Any = None
    softcap: Any = None
    q_offset: Any = None
    k_offset: Any = 0
    k_start: Any = None
    k_lengths: Any = None

    @property
    def per_request(self) -> bool:
        """Whether a request has key ranges or a position of its own."""
        return (
            self.k_start is not None
            or self.k_lengths is not None
            or (self.q_offset is not None and np.ndim(self.q_offset) > 0)
        )

    def replace(self, **changes: Any) -> "_Options":
        """The same options with some of them changed."""
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """As the keyword arguments of sdpa (the values themselves, never copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _visible(B, L, S, options):
    """The keys each row sees by position (the causal rule, window, per-request ranges
    and positions): (L, S), or (*B, 1, L, S) where a request has its own."""
    o = options
    if o.per_request:
        visible = request_visible_keys(B, L, S, o.mask, o.window, o.q_offset, o.k_offset, o.k_start, o.k_lengths)
        return visible[..., None, :, :]
    return visible_keys(L, S, o.mask, o.window, o.q_offset, o.k_offset)


def _additive_mask(mask, L, S):
    """Any accepted array ``mask`` as a float64 array added to the scores (strings: 0)."""
    if mask is None or isinstance(mask, str):
        if isinstance(mask, str) and mask not in MASK_STRINGS:
            raise ValueError(f"sdpa: mask must be one of {MASK_STRINGS}, None or an array; got {mask!r}")
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
    if sinks.dtype.kind not in "iuf" and not _is_float(sinks.dtype):
        raise TypeError(f"sdpa: sinks must be real numbers; got dtype {sinks.dtype}")
    if sinks.shape != (H_q,):
        raise ValueError(f"sdpa: sinks must have shape ({H_q},), one per query head; got {sinks.shape}")
    return sinks.astype(np.float64)


def _softmax_parts(q, k, options, v_batch=(), parts=None):
    """The probabilities and log-sum-exp of a call with these `options` (_Options),
    grouped: (*B, H_kv, n_repeats, L, S) and (..., L), B being the batch dims of q, k
    (and v_batch) broadcast.

    Also returns the shapes needed to ungroup them; into `parts` (a dict) it puts
    the scaled scores before the cap, the sink logits, and the factor.
    """
    q, k = np.asarray(q), np.asarray(k)
    if min(q.ndim, k.ndim) < 2:
        raise ValueError(f"sdpa: q and k need rank >= 2; got {q.shape}, {k.shape}")
    # A rank-2 operand (L, D) is one head: (1, L, D). Compute in float64.
    q, k = (np.asarray(x[None] if x.ndim == 2 else x, dtype=np.float64) for x in (q, k))
    *Bq, H_q, L, D = q.shape
    *Bk, H_kv, S, D_k = k.shape
    if D_k != D or H_kv < 1 or H_q % H_kv:
        raise ValueError(f"sdpa: shapes do not fit together; got q {q.shape}, k {k.shape}")

    scale, mask, softcap = options.scale, options.mask, options.softcap
    # Step 1: the scale factor, 1/sqrt(D) unless given.
    factor = D**-0.5 if scale is None else float(scale)

    # GQA by reshape: query head h = g * n_repeats + r shares key/value head g.
    # q: (*B, H_q, L, D) -> (*B, H_kv, n_repeats, L, D); k: (*B, H_kv, 1, S, D)
    n_repeats = H_q // H_kv
    q = q.reshape(*Bq, H_kv, n_repeats, L, D)
    k = k.reshape(*Bk, H_kv, 1, S, D)
    B = np.broadcast_shapes(tuple(Bq), tuple(Bk), tuple(v_batch))
    if options.per_request:
        # Per-request key ranges: rows outside a request's range are never read, so they are zeros here.
        k = np.where(_rows_read(B, S, options)[..., None, None, :, None], k, 0.0)

    # An infinite or NaN key (or a product that overflows) gives infinite or NaN scores,
    # without NumPy's "invalid value" or "overflow" warnings: those the mask or positions
    # hide are dropped below, the rest reach their rows.
    with np.errstate(invalid="ignore", over="ignore"):
        # Step 2: relevance scores, scaled; k is broadcast across the n_repeats axis.
        scores = (q @ k.swapaxes(-2, -1)) * factor  # (*B, H_kv, n_repeats, L, S)
        scores = np.broadcast_to(scores, (*B, *scores.shape[-4:]))

        if parts is not None:
            parts.update(scaled=scores, factor=factor)
        # Step 2b (Gemma 2): cap the scores smoothly at +-softcap.
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)

        # Step 3: add the mask, broadcast to (*B, H_q, L, S) and grouped like the scores,
        # and hide the keys that the positions (causal rule, window) rule out. A key the
        # mask hides (False, or -inf) is hidden whatever its score: an infinite or NaN
        # score plus -inf would be NaN, and a row depends only on the keys it sees.
        bias = np.broadcast_to(_additive_mask(mask, L, S), (*B, H_q, L, S)).reshape(*B, H_kv, n_repeats, L, S)
        scores = np.where(bias == -np.inf, -np.inf, scores + bias)
    # the positions' rule, each request's own keys and positions: (L, S) or (*B, 1, 1, L, S)
    visible = _visible(B, L, S, options)
    scores = np.where(visible[..., None, :, :] if options.per_request else visible, scores, -np.inf)

    # Step 4: softmax over the keys; each head's sink logit joins its rows' max and sum.
    sink = _sink_logits(options.sinks, H_q).reshape(H_kv, n_repeats, 1, 1)
    if parts is not None:
        parts["sink"] = sink
    # Subtract the row max so exp never overflows.
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    # A row that sees no key has max -inf: shift by 0 instead, so exp gives zeros, not NaN.
    row_max = np.where(row_max == -np.inf, 0.0, row_max)
    e = np.exp(scores - row_max)
    denom = e.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)
    # Such a row has e == 0 and denom == 0; dividing by 1 keeps it zeros.
    weights = e / np.where(denom == 0, 1.0, denom)
    # log of the denominator, in natural units: -inf for a row that sees nothing.
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(denom))[..., 0]
    if parts is not None:
        parts["lse"] = lse
    return weights, lse, (B, H_q, L, S)


def _values(fn, name, x, scale, zero):
    """K or V as float values: codes dequantized (float32, as npattn computes them),
    floats as they are. Codes need their scale; a float operand takes none."""
    x = np.asarray(x)
    if code_format(x.dtype) is None:
        for given, what in ((scale, "scale"), (zero, "zero")):
            if given is not None:
                raise ValueError(f"{fn}: {name}_{what} is for codes, but {name} is {x.dtype}")
        return x
    if scale is None:
        raise TypeError(f"{fn}: {name} holds {x.dtype} codes, which need {name}_scale")
    return dequantize(x, scale, zero)


def _float_dtype(*arrays):
    """The result dtype of the float operands (codes take no part: result_dtype)."""
    return result_dtype(*(np.asarray(a).dtype for a in arrays))


def _rows_read(B, S, options):
    """(*B, S) bool: the key rows each request reads."""
    start, length = key_ranges(B, S, options.k_start, options.k_lengths)
    start, end = np.asarray(start, dtype=np.int64), np.asarray(start + length, dtype=np.int64)
    j = np.arange(S)
    return (start[..., None] <= j) & (j < end[..., None])


def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
    softcap: Any = None,
    q_offset: Any = None,
    k_offset: Any = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: bool = False,
    precision: Any = "highest",
    out: Any = None,
    threads: Any = None,
) -> Any:
    """Scaled dot-product attention with grouped-query attention, in float64.

    Same signature and semantics as ``npattn.sdpa``; ``precision`` and
    ``threads`` are accepted and ignored (the reference is exact). Returns an
    array of ``np.result_type(q, k, v)`` (codes count as the float operands'
    dtype), and with ``return_lse`` also the log-sum-exp (float64 for float64
    results, else float32). K or V of 8-bit codes is first made the float32
    values it stands for (:func:`npattn.dequantize`), then computed with in
    float64.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dtype = _float_dtype(q, k, v)
    k, v = _values("sdpa", "k", k, k_scale, k_zero), _values("sdpa", "v", v, v_scale, v_zero)
    if not _is_float(dtype):
        raise TypeError(f"sdpa: q, k and v must be floating arrays; got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.ndim < 2:
        raise ValueError(f"sdpa: v needs rank >= 2; got {v.shape}")
    all_rank_2 = q.ndim == k.ndim == v.ndim == 2
    v = np.asarray(v[None] if v.ndim == 2 else v, dtype=np.float64)
    options = _Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    weights, lse, (B, H_q, L, S) = _softmax_parts(q, k, options, v.shape[:-3])
    *Bv, H_kv, S_v, D_v = v.shape
    if S_v != S or H_q % H_kv or weights.shape[-4] != H_kv:
        raise ValueError(f"sdpa: v does not fit q and k; got v {v.shape}")

    # Step 5: weighted sum of values, then the groups back to H_q heads.
    v = v.reshape(*Bv, H_kv, 1, S, D_v)
    if options.per_request:  # value rows a request does not read: zeros
        v = np.where(_rows_read(B, S, options)[..., None, None, :, None], v, 0.0)
    result = (weights @ v).reshape(*B, H_q, L, D_v)
    lse = lse.reshape(*B, H_q, L)
    # A row that sees no key (lse = -inf) is zeros, even where a value it does not
    # see holds NaN or infinity (0 * NaN would be NaN in the product above).
    result = np.where(lse[..., None] == -np.inf, 0.0, result)
    if all_rank_2:
        result, lse = result[0], lse[0]
    result = result.astype(dtype)

    if out is not None:
        if not isinstance(out, np.ndarray) or out.shape != result.shape or out.dtype != dtype:
            raise ValueError(f"sdpa: out must be a {dtype} array of shape {result.shape}")
        out[...] = result
        result = out
    if return_lse:
        return result, lse.astype(np.float64 if dtype == np.float64 else np.float32)
    return result


def gather_pages(key_pages: Any, value_pages: Any, block_table: Any, context_lens: Any, page_size: Any = None) -> Any:
    """A paged cache as a dense one: ``(k, v, lengths)``, ``k`` of shape ``(B, H_kv,
    max_pages * page_size, D)`` holding each request's live pages in table order
    (zeros past them), ``lengths`` the context lengths as int64; then
    ``sdpa(q, k, v, k_lengths=lengths)`` is ``paged_attention``. Raises the
    ``ValueError`` of a bad ``page_size``, context length or live table entry."""
    key_pages, value_pages = np.asarray(key_pages), np.asarray(value_pages)
    table, lengths = np.asarray(block_table), np.asarray(context_lens)
    P, H_kv, size, _ = key_pages.shape
    if page_size is not None and page_size != size:
        raise ValueError(f"paged_attention: page_size = {page_size} must equal key_pages.shape[2] = {size}")
    B, max_pages = table.shape
    lengths = np.broadcast_to(lengths, (B,)).astype(np.int64)
    S = max_pages * size
    k = np.zeros((B, H_kv, S, key_pages.shape[3]), key_pages.dtype)
    v = np.zeros((B, H_kv, S, value_pages.shape[3]), value_pages.dtype)
    for b in range(B):
        if not 0 <= lengths[b] <= S:
            raise ValueError(f"paged_attention: context_lens[{b}] = {lengths[b]} lies outside [0, {S}]")
        for i in range(-(-int(lengths[b]) // size)):  # the live pages
            page = int(table[b, i])
            if not 0 <= page < P:
                raise ValueError(f"paged_attention: block_table[{b}, {i}] = {page} is not a page of key_pages")
            k[b, :, i * size : (i + 1) * size] = key_pages[page]
            v[b, :, i * size : (i + 1) * size] = value_pages[page]
    return k, v, lengths


def paged_attention(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    context_lens: Any,
    page_size: Any = None,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
    softcap: Any = None,
    q_offset: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: bool = False,
    precision: Any = "highest",
    out: Any = None,
    threads: Any = None,
) -> Any:
    """Attention over a paged KV cache, in float64: the pages gathered, then :func:`sdpa`.

    Same signature and semantics as ``npattn.paged_attention``. Each request's
    live pages are copied into a dense cache of ``max_pages * page_size`` rows
    (:func:`gather_pages`; the rows past ``context_lens[b]`` never read), and
    the key ranges of ``sdpa`` do the rest: ``k_lengths=context_lens``, keys at
    positions ``0 .. context_lens[b] - 1``.
    """
    dtype = _float_dtype(q, key_pages, value_pages)
    key_pages = _values("paged_attention", "k", key_pages, k_scale, k_zero)  # pages of codes: their values
    value_pages = _values("paged_attention", "v", value_pages, v_scale, v_zero)
    k, v, lengths = gather_pages(key_pages, value_pages, block_table, context_lens, page_size)
    result = sdpa(
        q, k, v, scale, mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset, k_lengths=lengths,
        return_lse=return_lse,
    )  # fmt: skip
    out_part = result[0] if return_lse else result
    if out_part.dtype != dtype:
        out_part = out_part.astype(dtype)
    if out is not None:
        if not isinstance(out, np.ndarray) or out.shape != out_part.shape or out.dtype != dtype:
            raise ValueError(f"paged_attention: out must be a {dtype} array of shape {out_part.shape}")
        out[...] = out_part
        out_part = out
    return (out_part, result[1]) if return_lse else out_part


def attention_weights(
    q,
    k,
    scale=None,
    mask="causal",
    *,
    sinks=None,
    window=None,
    softcap=None,
    q_offset=None,
    k_offset=0,
    k_start=None,
    k_lengths=None,
    k_scale=None,
    k_zero=None,
    precision="highest",
    threads=None,
):
    """The probabilities ``softmax(...)``, shape ``(*B, H_q, L, S)``, in float64
    and then ``np.result_type(q, k)``; same semantics as ``npattn.attention_weights``."""
    q, k = np.asarray(q), np.asarray(k)
    dtype = _float_dtype(q, k)
    k = _values("attention_weights", "k", k, k_scale, k_zero)
    all_rank_2 = q.ndim == k.ndim == 2
    options = _Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    weights, _, (B, H_q, L, S) = _softmax_parts(q, k, options)
    weights = weights.reshape(*B, H_q, L, S)
    return (weights[0] if all_rank_2 else weights).astype(dtype)


def formula(q, k, v, scale=None, mask=None):
    """The tutorial's formula as a NumPy user writes it, in the inputs' dtype:
    scores, scale, mask, softmax, weighted sum; GQA by reshape. ``mask`` is an
    additive array (``causal_mask(L, S)``) or None.

    Unlike ``sdpa`` above it computes in the inputs' dtype and materialises
    every score, and a row that sees no key comes out NaN: this is the
    baseline ``python -m npattn`` and the benchmarks time npattn against.
    """
    *batch, h_q, L, D = q.shape
    h_kv = k.shape[-3]
    scale = D**-0.5 if scale is None else scale
    q = q.reshape(*batch, h_kv, h_q // h_kv, L, D)  # query head h reads kv head h // (h_q // h_kv)
    scores = q @ k[..., None, :, :].swapaxes(-1, -2) * q.dtype.type(scale)
    if mask is not None:
        scores = scores + mask
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v[..., None, :, :]).reshape(*batch, h_q, L, v.shape[-1])


def sdpa_backward(
    dout, q, k, v, out, lse, scale=None, mask="causal", *, sinks=None, window=None, softcap=None,
    q_offset=None, k_offset=0, k_start=None, k_lengths=None, precision="highest", threads=None,
):  # fmt: skip
    """The gradients of ``sum(dout * sdpa(q, k, v, ...))``, in float64: ``(dq, dk, dv, dsinks)``.

    Same signature and semantics as ``npattn.sdpa_backward``; ``out``, ``lse``
    and ``threads`` are accepted and the probabilities recomputed here. The
    forward pass, per head and query row i, and its derivative step by step,
    with g_i = dout_i:

        s_ij = scale q_i . k_j                   scores
        c_ij = softcap tanh(s_ij / softcap)      (c = s without a cap)
        x_ij = c_ij + mask_ij                    -inf hides
        p_ij = exp(x_ij - lse_i)                 lse_i = log(sum_j exp(x_ij) + exp(sink))
        o_i  = sum_j p_ij v_j

        dv_j  = sum_i p_ij g_i                   o is linear in v
        dp_ij = g_i . v_j                        o_i's slope along p_ij
        dx_ij = p_ij (dp_ij - D_i)               through softmax: D_i = sum_l p_il dp_il = g_i . o_i
        ds_ij = dx_ij (1 - (c_ij / softcap)^2)   through the cap (tanh' = 1 - tanh^2)
        dq_i  = scale sum_j ds_ij k_j            and the scale
        dk_j  = scale sum_i ds_ij q_i
        dsink = -sum_i exp(sink - lse_i) D_i     the sink's logit joins the softmax like a key with no value

    GQA: a key/value head's gradient sums its group's; an operand's broadcast
    batch dims are summed back to its own shape.
    """
    q, k, v, dout = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(dout)
    dtypes = q.dtype, k.dtype, v.dtype
    shapes = q.shape, k.shape, v.shape
    all_rank_2 = q.ndim == k.ndim == v.ndim == 2
    q64, k64, v64 = (np.asarray(x[None] if x.ndim == 2 else x, dtype=np.float64) for x in (q, k, v))
    parts = {}
    options = _Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    weights, _, (B, H_q, L, S) = _softmax_parts(q64, k64, options, v64.shape[:-3], parts)
    H_kv = k64.shape[-3]
    n_rep, D, D_v = H_q // H_kv, q64.shape[-1], v64.shape[-1]
    # everything grouped as (*B, H_kv, n_rep, rows, width); v and k shared by the group
    g = np.asarray(dout[None] if all_rank_2 else dout, dtype=np.float64).reshape(*B, H_kv, n_rep, L, D_v)
    qg = np.broadcast_to(q64, (*B, H_q, L, D)).reshape(*B, H_kv, n_rep, L, D)
    kg = np.broadcast_to(k64, (*B, H_kv, S, D))[..., None, :, :]
    vg = np.broadcast_to(v64, (*B, H_kv, S, D_v))[..., None, :, :]
    if options.per_request:  # rows a request does not read: zeros, gradient 0
        read = _rows_read(B, S, options)[..., None, None, :, None]
        kg, vg = np.where(read, kg, 0.0), np.where(read, vg, 0.0)
    o = weights @ vg  # (*B, H_kv, n_rep, L, D_v)

    dv = (weights.swapaxes(-1, -2) @ g).sum(axis=-3)  # dv_j = sum_i p_ij g_i, summed over the group
    dp = g @ vg.swapaxes(-1, -2)  # dp_ij = g_i . v_j
    Di = (g * o).sum(axis=-1, keepdims=True)  # D_i = g_i . o_i
    dx = weights * (dp - Di)  # through softmax (hidden keys have p = 0)
    if softcap is not None:
        capped = softcap * np.tanh(parts["scaled"] / softcap)
        dx = dx * (1 - (capped / softcap) ** 2)  # through the cap
    factor = parts["factor"]
    dq = factor * (dx @ kg)  # (*B, H_kv, n_rep, L, D)
    dk = factor * (dx.swapaxes(-1, -2) @ qg).sum(axis=-3)  # summed over the group
    dsinks = None
    if sinks is not None:
        # the sink's weight p_isink = exp(sink - lse_i), lse_i from the same softmax
        with np.errstate(divide="ignore", invalid="ignore"):
            p_sink = np.exp(parts["sink"] - parts["lse"][..., None])  # (*B, H_kv, n_rep, L, 1)
        p_sink = np.where(np.isfinite(parts["lse"])[..., None], p_sink, 0.0)
        dsinks = -(p_sink * Di).sum(axis=(-1, -2)).reshape(*B, H_q).sum(axis=tuple(range(len(B))))
        dsinks = dsinks.astype(np.float64 if result_dtype(*dtypes) == np.float64 else np.float32)

    dq = dq.reshape(*B, H_q, L, D)
    grads = [unbroadcast(gr, shape).astype(dt) for gr, shape, dt in zip((dq, dk, dv), shapes, dtypes)]
    return (*grads, dsinks)

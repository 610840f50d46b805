"""Checking an attention implementation: one line, and a message that says where
it is wrong and which usual mistake the result matches; the same for its
gradients.

    from npattn.testing import assert_attention_close, assert_attention_grads_close
    assert_attention_close(my_out, q, k, v, mask="causal")
    assert_attention_grads_close((dq, dk, dv), dout, q, k, v, mask="causal")

``actual`` may be a NumPy, MLX or PyTorch array; so may q, k, v, the mask and
the sinks. It is compared with ``npattn.reference.sdpa`` on float64 copies of
the inputs, within a tolerance derived from ``actual``'s dtype and the inputs
(:func:`tolerance`, the README's table), or within the ``rtol``/``atol`` given.

The tolerance, per query row: a logit ``s = scale * q.k + mask`` computed in a
dtype of machine epsilon ``eps`` is off by a few ulps of the terms it sums, at
most ``|scale| |q_i| |k_j|`` (Cauchy-Schwarz); softmax turns a logit error
``e`` into a relative weight error of about ``e``, so the output, a convex
combination of the rows of v the query sees, moves by about ``2 e max|v|``;
the weighted sum over the ``n`` keys it sees adds about ``sqrt(n)`` ulps of
``max|v|``. Hence, for row ``i``::

    atol_i = ulps * eps * (1 + max|logit_i| + sqrt(n_i)) * max|v|_i  +  floor

with ``max|logit_i|`` the bound ``|scale| |q_i| max|k_j|``, plus the largest
finite ``|mask_ij|``, plus ``|sink|``, plus the softcap, and ``max|v|_i``,
``max|k_j|``, ``max|mask_ij|`` taken over the keys ``j`` row ``i`` sees only
(a hidden key cannot move the result). ``ulps`` is 64 for float64 and 8 for
float32 (a peer's float32 kernel, such as MLX's or PyTorch's, uses a fraction
of it: npattn's own tests hold npattn to 4). ``floor``, ``ulps * (1 +
sqrt(n_i))`` of the dtype's smallest subnormal, is what the roundings of
subnormal terms add, where the relative bound vanishes.

float16 and bfloat16 results are allowed what an implementation that computes
in float32 and rounds its scaled inputs, its scores, its weights and its result
to the half type (each once, as MLX's and PyTorch's CPU paths do) can be off
by, plus the float32 bound above (4 ulps)::

    atol_i = 2 * eps_half * (1 + m_i) * max|v|_i  +  float32 bound  +  floor

with ``m_i`` the largest ``|s_ij + mask_ij| + |scale| |q_i * k_j|`` over the
keys row ``i`` sees, plus ``|sink|``: a score rounded to the half type moves by
half an ulp of itself, and the rounding of its scaled inputs, independent
errors over the ``D`` products ``q_id k_jd``, by half an ulp of their 2-norm;
softmax turns that into at most twice as much of ``max|v|`` on the output; the
weights and the result rounded add an ulp (the ``1``). No sum of ``n_i`` terms
is made in the half type, so no ``sqrt(n_i)`` of its ulps (the float32 bound
has them). This is what tells a half-precision result apart from a
near miss; docs/checking.md says how near.

``precision="fast"`` (SPEC section 11) adds, for float16 and bfloat16 results,
two ulps of the half type, ``2 * eps_half * max|v|_i``: rounding each weight
to the half type moves it by at most half an ulp relative (``eps_half / 2``),
and the output, a combination of v's rows whose weights sum to one, by at most
``eps_half / 2 * max|v|``; an implementation that normalises by the sum of the
unrounded weights adds as much again (one ulp), and the bound is doubled, as
``ulps`` doubles the float32 one. The dot-product instructions ``"fast"``
allows (AVX512-BF16, AMX) also flush a sum below float32's smallest normal
number to 0: each step of the ``n_i`` loses less than that number, so
``(n_i + 1) * 2**-126`` more (it matters only where ``max|v|_i`` is itself
near that number). For float32 and float64 ``"fast"`` computes as
``"highest"``, and the tolerance is the same.
"""

import math as _math
from typing import Any as _Any

import numpy as _np

from . import _args, _interop, reference

__all__ = [
    "assert_attention_close",
    "assert_attention_grads_close",
    "assert_paged_attention_close",
    "tolerance",
    "backward_tolerance",
    "max_logit",
    "PRECISIONS",
    "MODEL_HEADS",
    "ULPS",
    "OWN_ULPS",
    "EPS",
]


def __dir__() -> list[str]:
    return sorted(__all__)


#: Units of the dtype's epsilon per unit of logit and of max|v|, by dtype name.
ULPS = {"float64": 64, "float32": 8, "float16": 2, "bfloat16": 2}

#: What npattn's own float results are held to (its tests, python -m npattn);
#: its float16 and bfloat16 results are the reference correctly rounded.
OWN_ULPS = {"float64": 64, "float32": 4}

#: Machine epsilon, by dtype name.
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

#: float32's smallest normal number: the bfloat16 dot products of ``precision="fast"``
#: flush a sum below it to 0.
NORMAL_F32 = 2.0**-126

#: The smallest positive (subnormal) number, by dtype name.
TINY = {"float64": 2.0**-1074, "float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}

#: The head layouts npattn is tested and timed on, by model: ``(H_q, H_kv, D)``. The one
#: table of them: the tests, ``python -m npattn`` and the benchmarks read it.
MODEL_HEADS = {
    "course": (18, 6, 5),  # the course's odd GQA sizes
    "Qwen2-0.5B": (14, 2, 64),
    "Qwen3-4B": (32, 8, 128),
    "GPT-2": (12, 12, 64),
}

#: The values of ``precision=`` (SPEC section 11).
PRECISIONS = ("highest", "fast")

#: How many ulps of the half type ``precision="fast"`` adds to a float16 or bfloat16 bound.
FAST_HALF_ULPS = 2


def _values(fn: str, k: _Any, v: _Any, k_scale: _Any, v_scale: _Any, k_zero: _Any, v_zero: _Any) -> tuple:
    """K and V as values: codes as the float32 values their scales say they stand
    for (reference._values' rules: codes need a scale, floats take none)."""
    arrays = [None if x is None else _interop.asarray(x) for x in (k, v, k_scale, v_scale, k_zero, v_zero)]
    k, v, k_scale, v_scale, k_zero, v_zero = arrays
    return reference._values(fn, "k", k, k_scale, k_zero), reference._values(fn, "v", v, v_scale, v_zero)


def _f64(x: _Any) -> _Any:
    """A float64 NumPy copy of an array of any library; None, strings and bool masks as they are."""
    if x is None or isinstance(x, str):
        return x
    a = _interop.asarray(x)
    return a if a.dtype == bool else _np.asarray(a, dtype=_np.float64)


def _largest(x: _Any) -> float:
    """max |x| over finite entries; 0 for None, strings, bool masks and empty arrays."""
    if x is None or isinstance(x, str):
        return 0.0
    a = _np.asarray(x)
    if a.dtype == bool or a.size == 0:
        return 0.0
    a = a[_np.isfinite(a)]
    return float(_np.abs(a).max()) if a.size else 0.0


def _finite(x: _np.ndarray) -> _np.ndarray:
    """|x| with its non-finite entries as 0 (they give non-finite results, compared exactly)."""
    return _np.where(_np.isfinite(x), _np.abs(x), 0.0)


def _factor(scale: _Any, D: int) -> float:
    """|scale|, 1/sqrt(D) by default."""
    return abs(_args.check_scale("tolerance", scale, D)) if D else 1.0


def _check_precision(fn: str, precision: _Any) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f'{fn}: precision must be "highest" or "fast", got {precision!r}')
    return precision


def max_logit(q: _Any, k: _Any, scale=None, mask=None, sinks=None, softcap=None) -> float:
    """A bound on the largest logit's error scale: ``|scale| max|q_i| max|k_j|`` (Cauchy-
    Schwarz, which also bounds the sum of ``|q_d k_d|`` a dot product rounds), plus the
    largest finite ``|mask|`` and ``|sink|``, plus the cap (the error of its tanh); over every
    row and key (:func:`tolerance` takes each row's own keys)."""
    q, k = _f64(q), _f64(k)

    def row_norm(x):
        return float(_np.sqrt((x * x).sum(axis=-1)).max()) if x.size else 0.0

    with _np.errstate(over="ignore", invalid="ignore"):
        bound = _factor(scale, q.shape[-1]) * row_norm(q) * row_norm(k)
    return bound + _largest(_f64(mask)) + _largest(_f64(sinks)) + (float(softcap) if softcap else 0.0)


def _row_bounds(q, k, v, options):
    """Per query row of a call with these options (reference._Options), over the keys
    that row sees: (max|logit|, the half logit, max|v|,
    number of keys), each of shape (*B, H_q, L) (or (L,) for rank-2 operands). Inputs
    float64. max|logit| is the Cauchy-Schwarz bound |scale| |q_i| max|k_j| (plus the
    largest |mask|, |sink| and the cap), what a float32 dot product's rounding scales
    with; the half logit is the largest |s_ij + mask_ij| of the row's actual scores
    (capped), plus the spread of rounding its scaled inputs, |scale| |q_i * k_j| (the
    2-norm of the products: independent roundings), plus |sink|: what rounding the
    scores and their inputs to a half type scales with."""
    all_rank_2 = q.ndim == k.ndim == v.ndim == 2
    q, k, v = (x[None] if x.ndim == 2 else x for x in (q, k, v))
    H_q, L, D = q.shape[-3:]
    H_kv, S = k.shape[-3], k.shape[-2]
    n_rep = H_q // H_kv if H_kv else 0
    mask, sinks, softcap = options.mask, options.sinks, options.softcap
    # The keys each row sees: the positions' rule ((L, S), or (*B, 1, L, S) where a request
    # has its own keys), and a bool or -inf mask.
    B = _np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    visible = reference._visible(B, L, S, options)
    bias = _np.zeros((L, S))
    if mask is not None and not isinstance(mask, str):
        m = _np.asarray(mask)
        if m.dtype == bool:
            visible = visible & m
        else:
            visible = visible & ~(m == -_np.inf)
            bias = _finite(m)

    def per_key(x, norm):  # (*B, H_kv, S) -> (*B, H_q, 1, S): a query head's view of its group's keys
        a = _finite(x)
        a = _np.sqrt((a * a).sum(axis=-1)) if norm else a.max(axis=-1, initial=0.0)
        return _np.repeat(a, n_rep, axis=-2)[..., None, :]

    f = _factor(options.scale, D)
    with _np.errstate(over="ignore", invalid="ignore"):
        q_norm = _np.sqrt((_finite(q) ** 2).sum(axis=-1))  # (*B, H_q, L)
        k_row = _np.where(visible, per_key(k, True), 0.0).max(axis=-1, initial=0.0)
        v_row = _np.where(visible, per_key(v, False), 0.0).max(axis=-1, initial=0.0)
        bias_row = _np.where(visible, bias, 0.0).max(axis=-1, initial=0.0)
        n_row = _np.broadcast_to(visible, _np.broadcast_shapes(visible.shape, (H_q, L, S))).sum(axis=-1)
        sink = _finite(_np.asarray(sinks, dtype=_np.float64)).reshape(H_q, 1) if sinks is not None else 0.0
        logit = f * q_norm * k_row + bias_row + sink + (abs(float(softcap)) if softcap else 0.0)
        # the actual scores (*B, H_q, L, S), and the 2-norms of their products
        q_fin, k_all = (_np.where(_np.isfinite(x), x, 0.0) for x in (q, _np.repeat(k, n_rep, axis=-3)))
        scores = f * _np.abs(q_fin @ k_all.swapaxes(-1, -2))
        if softcap:
            scores = abs(float(softcap)) * _np.tanh(scores / abs(float(softcap)))
        spread = f * _np.sqrt(q_fin**2 @ (k_all**2).swapaxes(-1, -2))
        half_logit = _np.where(visible, _finite(scores + bias + spread), 0.0).max(axis=-1, initial=0.0) + sink
    logit, half_logit, v_row, n_row = _np.broadcast_arrays(logit, half_logit, v_row, n_row)
    if all_rank_2:
        logit, half_logit, v_row, n_row = logit[0], half_logit[0], v_row[0], n_row[0]
    return logit, half_logit, v_row, n_row


def _row_tolerance(q, k, v, options, name, ulps, precision):
    """(atol per row, its parts (the logit bound it used, max|v|, n)) for a result of
    dtype `name` of a call with these options (reference._Options)."""
    logit, half_logit, v_row, n_row = _row_bounds(q, k, v, options)
    ulps = ULPS[name] if ulps is None else ulps
    spread = 1.0 + logit + _np.sqrt(n_row)
    with _np.errstate(over="ignore", invalid="ignore"):
        if name not in ("float16", "bfloat16"):
            # the relative bound, and the roundings of subnormal terms (where it vanishes)
            atol = ulps * EPS[name] * spread * v_row + ulps * (1 + _np.sqrt(n_row)) * TINY[name]
            return atol, (logit, v_row, n_row)
        # the half type rounds the scores, their scaled inputs, the weights and the result,
        # each once: no sum of n terms in it (the float32 bound below has those)
        atol = ulps * EPS[name] * (1.0 + half_logit) * v_row + ulps * TINY[name]
        # the float32 computation the half result is rounded from
        atol = atol + 4 * EPS["float32"] * spread * v_row + 4 * (1 + _np.sqrt(n_row)) * TINY["float32"]
        if precision == "fast":
            atol = atol + FAST_HALF_ULPS * EPS[name] * v_row  # the weights rounded to the half type
            atol = atol + (n_row + 1) * NORMAL_F32  # sums below normal flushed to 0
    return atol, (half_logit, v_row, n_row)


def tolerance(
    q: _Any,
    k: _Any,
    v: _Any,
    scale: _Any = None,
    mask: _Any = None,
    *,
    sinks: _Any = None,
    window: _Any = None,
    softcap: float | None = None,
    q_offset: _Any = None,
    k_offset: int = 0,
    k_start: _Any = None,
    k_lengths: _Any = None,
    k_scale: _Any = None,
    v_scale: _Any = None,
    k_zero: _Any = None,
    v_zero: _Any = None,
    dtype: _Any = None,
    ulps: float | None = None,
    precision: str = "highest",
    rows: bool = False,
) -> _Any:
    """The absolute tolerance for an attention output of ``dtype`` on these inputs.

    ``atol_i = ulps * eps * (1 + max|logit_i| + sqrt(n_i)) * max|v|_i + floor``
    for each query row ``i``, over the ``n_i`` keys it sees (see the module's
    docstring); for float16 and bfloat16 ``ulps * eps * (1 + m_i) * max|v|_i``,
    ``m_i`` the row's largest actual score and the spread of rounding its
    inputs, plus the float32 bound, and with
    ``precision="fast"`` two ulps of the half type and ``(n_i + 1) * 2**-126``
    (sums flushed to 0). ``mask``, ``window`` and
    the offsets and key ranges say which keys a row sees, as in :func:`npattn.sdpa` (``mask``
    defaults to None here: every key). ``dtype`` defaults to the inputs'
    result dtype, ``ulps`` to ``ULPS[dtype]``. K or V of 8-bit codes take
    their ``k_scale`` / ``v_scale`` (and ``k_zero`` / ``v_zero``) as in
    :func:`npattn.sdpa`: the tolerance is that of the float32 values they
    stand for (:func:`npattn.dequantize`).

    Returns the largest ``atol_i`` (a bound for every row), or with
    ``rows=True`` the array of them, shaped ``(*B, H_q, L, 1)`` to broadcast
    against the output.
    """
    precision = _check_precision("tolerance", precision)
    k, v = _values("tolerance", k, v, k_scale, v_scale, k_zero, v_zero)
    if dtype is None:
        dtype = _args.result_dtype(*(_interop.asarray(x).dtype for x in (q, k, v)))
    name = _np.dtype(dtype).name
    if name not in ULPS:
        raise TypeError(f"tolerance: no tolerance for dtype {name}; float16, bfloat16, float32 or float64")
    q, k, v, mask, sinks = (_f64(x) for x in (q, k, v, mask, sinks))
    options = reference._Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    atol, _ = _row_tolerance(q, k, v, options, name, ulps, precision)
    if rows:
        return atol[..., None]
    floor = (ULPS[name] if ulps is None else ulps) * TINY[name]
    return float(atol.max(initial=floor))


# ---- the backward pass ----


def _backward_magnitudes(q, k, v, dout, options):
    """What each gradient's rounding errors scale with, in float64: every product of
    the backward pass taken in absolute values, with the reference's weights W
    (npattn.reference.sdpa_backward's steps; e_ij a bound on |ds_ij|):

        e_ij  = W_ij (|g_i|.|v_j| + |g_i|.(W|v|)_i)    |dp_ij| + |D_i|
        dq_i ~ |scale| sum_j e_ij |k_j|    dk_j ~ |scale| sum_i e_ij |q_i|
        dv_j ~ sum_i W_ij |g_i|            dsink ~ sum_i p_sink,i |g_i|.(W|v|)_i

    dk and dv summed over the group and broadcast batch dims, as the gradients are."""
    shapes = _np.shape(q), _np.shape(k), _np.shape(v)
    batch = _np.shape(dout)[:-3]  # the whole batch, v's dims included

    def whole(x):  # x broadcast along the whole batch
        return x if x.ndim == 2 else _np.broadcast_to(x, (*batch, *x.shape[-3:]))

    with _np.errstate(all="ignore"):
        W = reference.attention_weights(whole(q), whole(k), **options.keywords())
        lse = None
        if options.sinks is not None:
            zeros = _np.zeros((*whole(k).shape[:-1], 1))
            lse = reference.sdpa(whole(q), whole(k), zeros, return_lse=True, **options.keywords())[1]
    q, k, v, g = (_np.abs(x) for x in (q, k, v, dout))
    q, k, v, g, W = (x[None] if x.ndim == 2 else x for x in (q, k, v, g, W))
    H_q, H_kv = q.shape[-3], k.shape[-3]
    n_rep = H_q // max(H_kv, 1)
    k_all, v_all = (_np.repeat(x, n_rep, axis=-3) for x in (k, v))
    g_dot_o = (g * (W @ v_all)).sum(axis=-1, keepdims=True)
    e = W * (g @ v_all.swapaxes(-1, -2) + g_dot_o)
    f = _factor(options.scale, q.shape[-1])

    def grouped(full):  # (*B, H_q, S, w) -> (*B, H_kv, S, w), the group summed
        return full.reshape(*full.shape[:-3], H_kv, n_rep, *full.shape[-2:]).sum(axis=-3)

    dk = grouped(f * (e.swapaxes(-1, -2) @ q))
    dv = grouped(W.swapaxes(-1, -2) @ g)
    dsinks = _np.zeros(H_q)
    if lse is not None:  # the sink's weight exp(sink - lse)
        per_row = _np.exp(_np.asarray(options.sinks)[:, None] - lse) * g_dot_o[..., 0]  # (*B, H_q, L)
        per_head = per_row.sum(axis=-1)
        dsinks = per_head.sum(axis=tuple(range(per_head.ndim - 1)))
    return {
        "dq": _args.unbroadcast(f * (e @ k_all), shapes[0]),
        "dk": _args.unbroadcast(dk, shapes[1]),
        "dv": _args.unbroadcast(dv, shapes[2]),
        "dsinks": dsinks,
    }


def backward_tolerance(
    q: _Any,
    k: _Any,
    v: _Any,
    dout: _Any,
    dtype: _Any,
    scale: _Any = None,
    mask: _Any = "causal",
    *,
    sinks: _Any = None,
    window: _Any = None,
    softcap: float | None = None,
    q_offset: _Any = None,
    k_offset: int = 0,
    k_start: _Any = None,
    k_lengths: _Any = None,
    ulps: float | None = None,
    precision: str = "highest",
    **ignored: _Any,
) -> dict[str, tuple[float, _np.ndarray]]:
    """``{gradient: (rtol, atol)}`` for the gradients of :func:`npattn.sdpa_backward`
    (``"dq"``, ``"dk"``, ``"dv"``, ``"dsinks"``) against the float64 reference, ``atol``
    an array of the gradient's shape; ``dtype`` is the forward result's. The keywords are
    those of the ``sdpa`` call (``mask`` defaults to ``"causal"``, as there); its other
    keywords (``threads``, ``return_lse``, ``out``) are accepted and ignored.

    The derivation. A weight recomputed from the saved lse has its logit off by
    ``ulps eps (1 + m + log(S+1) + sqrt(n))``, so it is off by ``u``, the expm1 of
    that, relative (the logit error itself while it is small), ``m`` the logit bound of
    :func:`max_logit` (``log(S+1)`` bounds how far lse exceeds it), ``n`` the longest
    sum (rows, keys, widths), ``ulps`` ``OWN_ULPS`` of the dtype computed in (float32
    for the half dtypes). Every product of the pass then adds ulps of its terms, so
    each gradient is off by ``u`` times its magnitude: the same products taken in
    absolute values (``|dp_ij| + |D_i|`` through the softmax, then the sums over keys
    for dq and over rows for dk and dv); the cap's slope is at most 1. A float16 or
    bfloat16 result adds half its ulp to the terms through ``D_i = dout_i . o_i`` (the
    saved output is rounded to it). A weight below the computed dtype's smallest
    normal number may be lost (underflow): that adds, per weight, the most one weight
    moves a gradient, times the number of weights summed. A sum of subnormal terms
    rounds each: half a subnormal ulp per term summed. A gradient in a narrower dtype
    than the one computed in is correctly rounded to it: ``rtol`` eps/2, and half its
    smallest subnormal. With ``precision="fast"`` and a float16 or bfloat16 result,
    the weights and dS may be rounded to the half type before their products: two
    ulps of it times the gradient's magnitude more for ``dq``, ``dk`` and ``dv``, and
    the dot products flush a sum below float32's smallest normal number to 0: that
    number per term summed (and one).
    """
    precision = _check_precision("backward_tolerance", precision)
    dtype = _np.dtype(dtype)
    computed = "float64" if dtype == _np.float64 else "float32"
    ulps = OWN_ULPS[computed] if ulps is None else ulps
    q64, k64, v64, g64 = (_f64(x) for x in (q, k, v, dout))
    mask, sinks = _f64(mask), _f64(sinks)
    options = reference._Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    L, S, D, D_v = q64.shape[-2], k64.shape[-2], q64.shape[-1], v64.shape[-1]
    m = max_logit(q64, k64, scale, options.mask, options.sinks, softcap)
    n = max(L * (q64.size // max(L * D, 1)), S, D, D_v)
    logit_error = ulps * EPS[computed] * (1 + m + _np.log1p(S) + _np.sqrt(n))
    # a weight whose logit is off by that is off by expm1 of it relative: the logit error
    # itself only while it is small (capped where e**x would overflow)
    u = float(_np.expm1(min(logit_error, 700.0)))
    via_d = u + (EPS[dtype.name] / 2 if dtype.name != computed else 0.0)
    normal = float(_np.finfo(computed).smallest_normal)
    rows = _math.prod(_np.shape(dout)[:-1])  # every query row of the whole batch
    f = _factor(scale, D)

    def largest(x):
        return float(_np.abs(x).max(initial=0.0))

    g_size, v_size = float(_np.abs(g64).sum(axis=-1).max(initial=0.0)), largest(v64)
    per_weight = {  # the most one weight moves each gradient, times the weights summed
        "dq": f * 2 * g_size * v_size * largest(k64) * S,
        "dk": f * 2 * g_size * v_size * largest(q64) * rows,
        "dv": largest(g64) * rows,
        "dsinks": g_size * v_size * rows,
    }
    per_d = {  # what D_i = dout_i . o_i moves each gradient by, per unit of |o_i|, summed
        "dq": f * g_size * largest(k64),
        "dk": f * g_size * largest(q64) * rows,
        "dv": 0.0,
        "dsinks": g_size * rows,
    }
    tolerances = {}
    mags = _backward_magnitudes(q64, k64, v64, g64, options)
    for name, operand in (("dq", q), ("dk", k), ("dv", v), ("dsinks", None)):
        own = computed if operand is None else _interop.asarray(operand).dtype.name
        rtol = EPS[own] / 2 if own != computed else 0.0
        floor = 2 * normal * per_weight[name]  # weights lost to underflow
        floor += TINY[dtype.name] / 2 * per_d[name]  # an output underflowing in its dtype
        # a sum of subnormal terms rounds each: half an ulp per term summed (keys for dq,
        # rows for dk and dv), times the copies a broadcast operand's gradient adds up
        width = 1 if operand is None else max(_np.shape(operand)[-1], 1)
        copies = 1 if operand is None else max(1.0, rows / max(_np.size(operand) // width, 1))
        terms = {"dq": S, "dk": rows, "dv": rows, "dsinks": 0}[name]
        floor += TINY[computed] / 2 * (terms + 1) * copies
        floor += TINY[own] / 2  # the gradient's own rounding
        if precision == "fast" and dtype.name in ("float16", "bfloat16") and name != "dsinks":
            floor = floor + FAST_HALF_ULPS * EPS[dtype.name] * mags[name]  # P and dS rounded to the half type
            floor += NORMAL_F32 * (terms + 1) * copies  # sums below normal flushed to 0
        tolerances[name] = (rtol, (u if name == "dv" else via_d) * mags[name] + floor)
    return tolerances


# ---- the checker ----


def _beyond(got: _np.ndarray, want: _np.ndarray, atol: _Any, rtol: float) -> _np.ndarray:
    """Where got is not want within atol + rtol |want|: NaN exactly where want has NaN,
    an infinity exactly where want has it (inf - inf is no error)."""
    with _np.errstate(invalid="ignore", over="ignore"):
        err = _np.abs(got - want)
        nan_wrong = _np.isnan(got) != _np.isnan(want)
        return nan_wrong | (~_np.isnan(want) & ~(err <= atol + rtol * _np.abs(want)) & ~(got == want))


def _where(index: tuple, ndim: int) -> str:
    """An element's index named by the shape legend: (batch..., head, row, D_v index)."""
    names = ["row", "D_v index"] if ndim == 2 else ["head", "row", "D_v index"]
    batch = [f"batch {i}" for i in index[: ndim - len(names)]] if ndim > 3 else []
    parts = batch + [f"{n} {i}" for n, i in zip(names, index[-len(names) :])]
    return ", ".join(parts)


def _per_index(counts: _np.ndarray, total: int, most: int = 12) -> str:
    """'0-2: 45/45, 3: 0/45': the count of failing elements at each index, runs of
    equal counts joined."""
    runs: list[tuple[int, int, int]] = []
    for i, c in enumerate(int(x) for x in counts):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], i, c)
        else:
            runs.append((i, i, c))
    text = [f"{a}: {c}/{total}" if a == b else f"{a}-{b}: {c}/{total}" for a, b, c in runs[:most]]
    return ", ".join(text) + (f", ... ({len(runs) - most} more runs)" if len(runs) > most else "")


def _describe_mask(options: _Any, L: int, S: int) -> str:
    """What the checker takes the mask of these options (reference._Options) to mean, in words."""
    mask, q_offset, k_offset = options.mask, options.q_offset, options.k_offset
    if mask is None:
        return "None (every key visible)"
    if isinstance(mask, str):
        if mask == "causal_top_left":
            return '"causal_top_left" (top-left: query i sees key j iff j <= i, as PyTorch\'s is_causal=True)'
        if options.per_request:
            return (
                '"causal" per request (query i of request b at q_offset[b] + i, by default '
                "k_offset + k_lengths[b] - L; key row j at k_offset + j - k_start[b])"
            )
        qo = S - L if q_offset is None else int(q_offset)
        where = "default S - L" if q_offset is None else "q_offset"
        return (
            f'"causal" (bottom-right: query i sits at position {qo} + i ({where}), key j at {int(k_offset)} + j; '
            f"i sees j iff j <= i + {qo - int(k_offset)}; npattn's default, where MLX and PyTorch default to none)"
        )
    m = _np.asarray(mask)
    if m.dtype == bool:
        return f"a bool array of shape {m.shape}, True = visible ({int(m.sum())} of {m.size} True)"
    return f"an additive float array of shape {m.shape} ({int((m == -_np.inf).sum())} of {m.size} entries -inf)"


def _mask_and_scale(options: _Any, L: int, S: int, D: int) -> list[str]:
    """The lines of a message that say which mask and scale it checked against."""
    factor = D**-0.5 if options.scale is None else float(options.scale)
    return [
        f"  mask {_describe_mask(options, L, S)}",
        f"  scale {factor:.6g}" + (f" (the default 1/sqrt(D), D = {D})" if options.scale is None else " (given)"),
    ]


def _mistakes(q, k, v, options):
    """(what the mistake is, its changes or a result) for each usual mistake that
    differs from the call with these options (reference._Options): the changes, a
    dict, name options and operands (k, v); the results are computed by
    npattn.reference in float64."""
    D, D_v = q.shape[-1], v.shape[-1]
    scale, mask, q_offset, k_start, k_lengths = (
        options.scale, options.mask, options.q_offset, options.k_start, options.k_lengths
    )  # fmt: skip
    f = D**-0.5 if scale is None else float(_args.check_scale("assert_attention_close", scale, D))
    positions = {"q_offset": None} if q_offset is not None else {}
    if isinstance(mask, str) or mask is None:
        if mask != "causal":
            yield 'the bottom-right causal mask (mask="causal")', {"mask": "causal", **positions}
        if mask != "causal_top_left":
            what = "top-left instead of bottom-right causal alignment" if mask == "causal" else "a top-left causal mask"
            change = {"mask": "causal_top_left", **positions}
            yield f'{what} (mask="causal_top_left", PyTorch\'s is_causal=True)', change
    else:
        yield 'the bottom-right causal mask (mask="causal") instead of the array mask', {"mask": "causal"}
        yield 'a top-left causal mask (mask="causal_top_left") instead of the array mask', {"mask": "causal_top_left"}
        if mask.dtype == bool:
            yield "the bool mask inverted (True read as hidden)", {"mask": ~mask}
        elif f != 1 and _np.any(_np.isfinite(mask) & (mask != 0)):
            yield "the mask added before the scale (scale * (q @ k^T + mask))", {"mask": mask * f}
    if mask is not None:
        yield "no mask (mask=None): was the mask forgotten?", {"mask": None}
    if options.window is not None:
        yield "no window (window=None)", {"window": None}
    if k_start is not None or k_lengths is not None:
        everything = {"k_start": None, "k_lengths": None}
        yield "every key row read (no k_start, k_lengths): was the padding attended to?", everything
    if k_lengths is not None and _np.any(_np.asarray(k_start if k_start is not None else 0) != 0):
        yield "each request's keys taken from row 0 (k_start=0): a right-aligned cache starts at S - n", {"k_start": 0}
    if f != 1:
        yield "the scale missing (scale 1)", {"scale": 1.0}
        yield f"the scale applied twice (scale {f:.4g}**2 = {f * f:.4g})", {"scale": f * f}
    if scale is None and D_v != D:
        yield f"1/sqrt(D_v) instead of 1/sqrt(D) (D_v = {D_v}, D = {D})", {"scale": D_v**-0.5}
    if scale is None and D > 1:
        yield f"sqrt(D) instead of 1/sqrt(D) (scale {D**0.5:.4g})", {"scale": D**0.5}
    if options.softcap is not None:
        yield "no softcap (softcap=None)", {"softcap": None}
    if options.sinks is not None:
        yield "the sink missing (sinks=None)", {"sinks": None}
    H_q, H_kv = q.shape[-3] if q.ndim > 2 else 1, k.shape[-3] if k.ndim > 2 else 1
    if H_kv > 1 and H_q > H_kv:
        heads = _np.arange(H_q) % H_kv  # query head h reads key/value head h % H_kv
        yield (
            f"GQA groups interleaved: query head h reading key/value head h % H_kv instead of h // {H_q // H_kv} "
            "(contiguous groups)",
            {"k": _np.take(k, heads, axis=-3), "v": _np.take(v, heads, axis=-3)},
        )
    if k.shape == v.shape:
        yield "keys and values swapped (sdpa(q, v, k))", {"k": v, "v": k}
    yield "softmax over the query axis instead of the key axis", _wrong_axis(q, k, v, options)
    read_transposed = _transposed_reading(q, k, v, options)
    if read_transposed is not None:
        yield (
            "q, k and v read as (B, L, H, D), heads and rows swapped: arrays laid out as a model holds them go in "
            "as x.transpose(0, 2, 1, 3) (a view, no copy)",
            read_transposed.swapaxes(-2, -3),
        )


def _transposed_reading(q, k, v, options):
    """Attention over q, k, v under these options (reference._Options) with their heads
    and rows swapped, (B, L, H, D) read as (B, H, L, D), in that swapped layout: what a
    (B, L, H, D) array given for a (B, H, L, D) one computes. None where that reading is
    not attention (the swapped head counts do not divide, or an option does not fit it)."""
    if min(q.ndim, k.ndim, v.ndim) < 3:
        return None
    swapped = [x.swapaxes(-2, -3) for x in (q, k, v)]
    try:
        with _np.errstate(all="ignore"):
            return reference.sdpa(*swapped, **options.keywords())
    except (ValueError, TypeError):
        return None


def _wrong_axis(q, k, v, options):
    """The result of a softmax taken over the queries (axis -2 of the scores) instead of
    the keys: the reference's logits (log of its weights plus lse), normalised per key."""
    with _np.errstate(all="ignore"):
        weights = reference.attention_weights(q, k, **options.keywords())
        _, lse = reference.sdpa(q, k, _np.zeros((*k.shape[:-1], 1)), return_lse=True, **options.keywords())
        logits = _np.log(weights) + lse[..., None]
        top = logits.max(axis=-2, keepdims=True, initial=-_np.inf)
        e = _np.exp(logits - _np.where(top == -_np.inf, 0.0, top))
        total = e.sum(axis=-2, keepdims=True)
        p = e / _np.where(total == 0, 1.0, total)
        v_all = v if v.ndim == 2 else _np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
        return p @ v_all


def assert_attention_close(
    actual: _Any,
    q: _Any,
    k: _Any,
    v: _Any,
    scale: _Any = None,
    mask: _Any = "causal",
    *,
    sinks: _Any = None,
    window: _Any = None,
    softcap: float | None = None,
    q_offset: _Any = None,
    k_offset: int = 0,
    k_start: _Any = None,
    k_lengths: _Any = None,
    k_scale: _Any = None,
    v_scale: _Any = None,
    k_zero: _Any = None,
    v_zero: _Any = None,
    peer: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    precision: str = "highest",
) -> None:
    """Asserts that ``actual`` is attention over q, k, v, within tolerance; if it is
    not, says where, and which usual mistake it matches.

    Parameters
    ----------
    actual : array_like
        The output to check (NumPy, MLX or PyTorch), shape ``(*B, H_q, L, D_v)``.
    q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths
        What ``actual`` is meant to compute, with :func:`npattn.sdpa`'s
        meaning; note that ``mask`` defaults to ``"causal"`` (bottom-right)
        as in npattn, where MLX and PyTorch default to no mask.
    k_scale, v_scale, k_zero, v_zero : array_like, optional
        K or V of 8-bit codes and their scales (and zero points), as in
        :func:`npattn.sdpa`: checked against attention over the float32
        values they stand for (:func:`npattn.dequantize`), with their
        tolerance.
    peer : {"mlx", "torch"}, optional
        Where ``actual`` comes from, to explain a known difference in the
        message (MLX's CPU path on rows that see no key).
    rtol, atol : float, optional
        The tolerance, instead of the one derived by :func:`tolerance`.
    precision : {"highest", "fast"}, default "highest"
        The ``precision=`` ``actual`` was computed with (SPEC section 11).
        ``"fast"`` widens the derived tolerance of a float16 or bfloat16
        result by two ulps of its type times the row's ``max|v|`` (the
        weights rounded to the half type before ``P @ V``: half an ulp
        relative each, half an ulp of ``max|v|`` on the output, as much again
        for a sum of unrounded weights, doubled for margin), and by ``(n_i +
        1) * 2**-126`` for the sums the dot products flush to 0; for float32
        and float64 results it changes nothing.

    Raises
    ------
    AssertionError
        On failure, the message says what was checked against (mask and its
        alignment, scale, GQA grouping, dtype, tolerance and how it was
        derived); where the worst element is (batch, head, row, D_v index)
        with both values; how many elements fail, per head and per query row;
        whether the failing rows see no key; and which of the usual mistakes
        (no or the wrong mask, top-left instead of bottom-right, the scale
        missing, applied twice or ``1/sqrt(D_v)``, GQA groups interleaved,
        softmax over the wrong axis, keys and values swapped, a missing sink,
        a batch cache read whole or from row 0 instead of its key ranges)
        the result matches within tolerance, if one does.
    ValueError
        ``precision`` is neither ``"highest"`` nor ``"fast"``.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> from npattn.testing import assert_attention_close
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8), dtype=np.float32) for _ in range(3))
    >>> assert_attention_close(npattn.sdpa(q, k, v), q, k, v)
    >>> assert_attention_close(npattn.sdpa(q, k, v, mask=None), q, k, v)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: attention output differs from the float64 reference at ...
    """
    precision = _check_precision("assert_attention_close", precision)
    got = _interop.asarray(actual, "actual")
    if not _args.is_float(got.dtype):
        raise AssertionError(f"actual must be an array of floats, got dtype {got.dtype}")
    k, v = _values("assert_attention_close", k, v, k_scale, v_scale, k_zero, v_zero)
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    mask64, sinks64 = _f64(mask), _f64(sinks)
    if scale is not None:
        scale = _args.check_scale("assert_attention_close", scale, q64.shape[-1])
    options = reference._Options(scale, mask64, sinks64, window, softcap, q_offset, k_offset, k_start, k_lengths)
    with _np.errstate(all="ignore"):
        want, lse = reference.sdpa(q64, k64, v64, return_lse=True, **options.keywords())
    if got.shape != want.shape:
        raise AssertionError(_shape_mismatch(got, want, q64, k64, v64, options))
    # the coarser of the result's dtype and the inputs': a float64 result computed from
    # float32 inputs carries float32 rounding
    inputs = _args.result_dtype(*(_interop.asarray(x).dtype for x in (q, k, v))).name
    name = got.dtype.name if EPS.get(got.dtype.name, 0) >= EPS.get(inputs, 0) else inputs
    given = atol is not None
    if not given:
        atol_rows, parts = _row_tolerance(q64, k64, v64, options, name, None, precision)
        atol = atol_rows[..., None]
    rtol = 0.0 if rtol is None else float(rtol)
    got64 = _np.asarray(got, dtype=_np.float64)
    bad = _beyond(got64, want, atol, rtol)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return

    with _np.errstate(invalid="ignore", over="ignore"):
        excess = _np.abs(got64 - want) - (atol + rtol * _np.abs(want))
    excess = _np.where(_np.isnan(got64) != _np.isnan(want), _np.inf, _np.where(bad, excess, -_np.inf))
    worst = _np.unravel_index(int(_np.argmax(_np.nan_to_num(excess, nan=_np.inf))), got.shape)
    L, S, D = q64.shape[-2], k64.shape[-2], q64.shape[-1]
    H_q, H_kv = (q64.shape[-3], k64.shape[-3]) if got.ndim > 2 else (1, 1)
    if given:
        how = f"atol {atol:.3g} (given)"
    else:
        row = worst[:-1]
        logit, v_row, n_row = (float(x[row]) for x in parts)
        half = name in ("float16", "bfloat16")
        how = (
            f"atol {float(atol_rows[row]):.3g} = {ULPS[name]} * eps({name}) * (1 + max|logit| {logit:.4g}"
            + ("" if half else f" + sqrt(keys seen) {_np.sqrt(n_row):.3g}")
            + f") * max|v| {v_row:.4g}"
            + (" + the float32 bound" if half else "")
            + (
                " + 2 ulps of the half type and (keys seen + 1) * 2**-126 (precision='fast')"
                if precision == "fast" and "16" in name
                else ""
            )
            + " + the subnormal floor, over the keys the worst element's row sees (npattn.testing.tolerance)"
        )
    checked = [
        f"checked against npattn.reference.sdpa in float64: a {got.dtype.name} result of {inputs} inputs, "
        f"precision {precision!r}",
        *_mask_and_scale(options, L, S, D),
        f"  GQA: {H_q} query heads in {H_kv} contiguous groups; query head h reads key/value head "
        f"h // {max(H_q // max(H_kv, 1), 1)}",
    ]
    extras = [f"{key} {val!r}" for key, val in (("window", window), ("softcap", softcap)) if val is not None]
    ranges = (("k_start", k_start), ("k_lengths", k_lengths))
    extras += [f"{key} {_np.asarray(val).tolist()!r} per request" for key, val in ranges if val is not None]
    if sinks64 is not None:
        extras.append(f"sinks {_np.round(sinks64, 4).tolist()}")
    if extras:
        checked.append("  " + ", ".join(extras))

    with _np.errstate(invalid="ignore"):
        diff = _np.abs(got64 - want)
    lines = [
        f"attention output differs from the float64 reference at {n_bad} of {got.size} elements "
        f"({100 * n_bad / got.size:.3g}%)",
        f"worst at {_where(worst, got.ndim)}: actual {float(got64[worst])!r}, reference {float(want[worst])!r}"
        + ("" if _np.isnan(got64[worst]) or _np.isnan(want[worst]) else f" (|diff| {diff[worst]:.3g})"),
        f"tolerance: {how}, rtol {rtol:g}",
    ]
    per_head = bad.reshape(-1, H_q, L, got.shape[-1]).sum(axis=(0, 2, 3))
    per_row = bad.reshape(-1, H_q, L, got.shape[-1]).sum(axis=(0, 1, 3))
    lines.append(f"failing elements per head: {_per_index(per_head, got.size // max(H_q, 1))}")
    lines.append(f"failing elements per query row: {_per_index(per_row, got.size // max(L, 1))}")
    bad_rows = bad.any(axis=-1)
    no_key = _np.broadcast_to(lse == -_np.inf, bad_rows.shape)
    n_rows, n_empty = int(bad_rows.sum()), int((bad_rows & no_key).sum())
    if n_empty == 0:
        lines.append("the failing row sees" if n_rows == 1 else f"the {n_rows} failing rows all see")
        lines[-1] += " at least one key"
    else:
        lines.append(
            f"{n_empty} of the {n_rows} failing rows see no key (every key masked, no sink): "
            "npattn and PyTorch give 0 there"
        )
        if peer == "mlx":
            lines.append(
                "MLX's CPU path gives such rows the mean of V (a bool mask, or its causal mask with L > S) "
                "or NaN (a -inf mask): a known difference of MLX, not an error in the rest of the output"
            )
    lines.insert(
        1, _diagnosis(got64, q64, k64, v64, options, name, atol if given else None, rtol, precision, want, atol)
    )
    lines += checked
    raise AssertionError("\n".join(lines))


def assert_paged_attention_close(
    actual: _Any,
    q: _Any,
    key_pages: _Any,
    value_pages: _Any,
    block_table: _Any,
    context_lens: _Any,
    page_size: int | None = None,
    scale: _Any = None,
    mask: _Any = "causal",
    *,
    sinks: _Any = None,
    window: _Any = None,
    softcap: float | None = None,
    q_offset: _Any = None,
    peer: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    precision: str = "highest",
) -> None:
    """:func:`assert_attention_close` for a paged cache: asserts that ``actual`` is
    ``npattn.paged_attention`` over these pages, with the same keywords as that call.

    The pages are gathered (:func:`npattn.reference.gather_pages`) and the check
    is :func:`assert_attention_close`'s on the dense cache with
    ``k_lengths=context_lens``, so its message says where the result is wrong
    and which usual mistake it matches; a bad block table or context length is
    the ``ValueError`` ``paged_attention`` would raise.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> from npattn.testing import assert_paged_attention_close
    >>> rng = np.random.default_rng(0)
    >>> pages = rng.standard_normal((3, 1, 4, 8), dtype=np.float32)     # (P, H_kv, page_size, D)
    >>> table, lengths = np.array([[2, 0], [1, -1]]), np.array([6, 3])
    >>> q = rng.standard_normal((2, 2, 1, 8), dtype=np.float32)
    >>> assert_paged_attention_close(npattn.paged_attention(q, pages, pages, table, lengths),
    ...                              q, pages, pages, table, lengths)
    """
    pages = (_interop.asarray(x) for x in (key_pages, value_pages, block_table, context_lens))  # MLX's bfloat16 too
    k, v, lengths = reference.gather_pages(*pages, page_size)
    assert_attention_close(
        actual, q, k, v, scale, mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset,
        k_lengths=lengths, peer=peer, rtol=rtol, atol=atol, precision=precision,
    )  # fmt: skip


def _shape_mismatch(got, want, q, k, v, options) -> str:
    """What a result of the wrong shape says: where it is attention laid out (B, L, H, D),
    or attention over inputs that are, the mistake named."""
    said = f"actual has shape {got.shape}, but attention over these inputs has shape {want.shape}"
    if got.ndim < 3 or got.shape != want.swapaxes(-2, -3).shape:
        return said
    said += ": its heads and rows are swapped"
    got64 = _np.asarray(got, dtype=_np.float64)
    name = got.dtype.name if got.dtype.name in ULPS else "float64"
    atol = _row_tolerance(q, k, v, options, name, None, "highest")[0][..., None]
    if not _beyond(got64, want.swapaxes(-2, -3), atol.swapaxes(-2, -3), 0.0).any():
        return said + (
            "; it matches, within tolerance, this attention laid out (B, L, H, D): npattn's results are "
            "(B, H, L, D), so compare actual.transpose(0, 2, 1, 3)"
        )
    transposed = _transposed_reading(q, k, v, options)
    if transposed is not None:
        swapped = (x.swapaxes(-2, -3) for x in (q, k, v))
        atol = _row_tolerance(*swapped, options, name, None, "highest")[0][..., None]
        if not _beyond(got64, transposed, atol, 0.0).any():
            return said + (
                "; it matches, within tolerance, attention over q, k and v transposed: q, k and v are laid out "
                "(B, L, H, D), as models hold them, where npattn reads (B, H, L, D); pass x.transpose(0, 2, 1, 3) "
                "(a view, no copy)"
            )
    return said


def _diagnosis(got, q, k, v, options, name, atol, rtol, precision, want, want_atol) -> str:
    """Which of the usual mistakes `got` matches, in one sentence. A match must be
    earned: `got` lies within the mistake's tolerance of its result, and that
    tolerance separates the result from the right answer `want` and from every
    mistake `got` does not match (each lies outside it somewhere); otherwise a
    tolerance wider than the results differ (a half type's, with scores of a wrong
    scale) would name whatever it covers. Mistakes that `got` matches and that
    cannot be told apart from each other are named together."""
    tried, results = [], []  # (what, result, its tolerance)
    for what, change in _mistakes(q, k, v, options):
        tried.append(what.split(" (")[0].split(":")[0])
        operands, mistaken = {"q": q, "k": k, "v": v}, options
        with _np.errstate(all="ignore"):
            if isinstance(change, dict):
                operands.update((key, val) for key, val in change.items() if key in operands)
                mistaken = options.replace(**{key: val for key, val in change.items() if key not in operands})
                result = reference.sdpa(**operands, **mistaken.keywords())
            else:
                result = change
            if result.shape != got.shape:
                continue
            allowed = atol
            if allowed is None:
                q_, k_, v_ = operands["q"], operands["k"], operands["v"]
                allowed = _row_tolerance(q_, k_, v_, mistaken, name, None, precision)[0][..., None]
        results.append((what, result, allowed))

    def apart(a, b):  # b's result lies outside a's tolerance somewhere
        return bool(_beyond(b[1], a[1], a[2], rtol).any())

    matches = [c for c in results if not _beyond(got, c[1], c[2], rtol).any()]
    others = [c for c in results if c not in matches] + [("the right answer", want, want_atol)]
    earned = [c[0] for c in matches if all(apart(c, d) for d in others)]
    if earned:
        return "the result matches, within tolerance, " + "; and also ".join(earned)
    return "the result matches none of the usual mistakes tried: " + "; ".join(tried)


# ---- the gradients' checker ----

GRADIENTS = ("dq", "dk", "dv", "dsinks")


def _named_grads(actual_grads: _Any) -> dict[str, _Any]:
    """{"dq": ..., "dk": ..., "dv": ..., "dsinks": ...} from npattn.Grads, a sequence of 3 or 4
    arrays (PyTorch's q.grad, k.grad, v.grad; MLX's vjp cotangents), or a mapping."""
    if isinstance(actual_grads, dict):
        unknown = set(actual_grads) - set(GRADIENTS)
        if unknown:
            raise TypeError(f"actual_grads: unknown gradients {sorted(unknown)}; the names are {list(GRADIENTS)}")
        return {name: actual_grads.get(name) for name in GRADIENTS}
    if isinstance(actual_grads, (str, bytes)) or not hasattr(actual_grads, "__len__"):
        raise TypeError(f"actual_grads must be (dq, dk, dv[, dsinks]) or a mapping, got {type(actual_grads).__name__}")
    if len(actual_grads) not in (3, 4):
        raise TypeError(f"actual_grads must hold 3 or 4 gradients, (dq, dk, dv[, dsinks]); got {len(actual_grads)}")
    return dict(zip(GRADIENTS, [*actual_grads, None][:4]))


def _backward_mistakes(q, k, v, dout, options):
    """(what, {gradient: float64 result}) for each usual mistake of a backward pass,
    computed in float64 from the reference's weights, step by step as
    npattn.reference.sdpa_backward writes them (P, dP = dout V^T, D_i = dout_i . out_i,
    dS = P (dP - D), dq = scale dS K, dk = scale dS^T Q, dv = P^T dout), one step wrong."""
    q, k, v, g = (x[None] if x.ndim == 2 else x for x in (q, k, v, dout))
    squeeze = dout.ndim == 2
    H_q, H_kv, D = q.shape[-3], k.shape[-3], q.shape[-1]
    n_rep = H_q // H_kv
    B = g.shape[:-3]
    qb, kb, vb = (_np.broadcast_to(x, (*B, *x.shape[-3:])) for x in (q, k, v))
    lse = reference.sdpa(qb, kb, _np.zeros((*kb.shape[:-1], 1)), return_lse=True, **options.keywords())[1][..., None]
    weights = reference.attention_weights(qb, kb, **options.keywords())  # (*B, H_q, L, S)
    unread = (weights == 0).all(axis=-2)[..., None]  # keys no row weighs: their rows count for nothing
    k_all, v_all = (_np.where(unread, 0.0, _np.repeat(x, n_rep, axis=-3)) for x in (kb, vb))
    f = _factor(options.scale, D)
    cap = 1.0
    if options.softcap is not None:  # the cap's slope, 1 - tanh^2, on the scaled scores
        cap = 1 - _np.tanh(f * (qb @ k_all.swapaxes(-1, -2)) / options.softcap) ** 2

    def shaped(grad, operand):  # a gradient summed back to its operand's batch shape, rank 2 kept
        out = _args.unbroadcast(grad, (*operand.shape[:-3], *grad.shape[-3:]))
        return out[0] if squeeze else out

    def gradients(P, D_of=None, f_q=f, f_k=f, group="sum"):
        o = P @ v_all
        dp = g @ v_all.swapaxes(-1, -2)
        Di = (g * o).sum(axis=-1, keepdims=True) if D_of is None else D_of(P, o, dp)
        ds = P * (dp - Di) * cap
        full_dk, full_dv = f_k * (ds.swapaxes(-1, -2) @ qb), P.swapaxes(-1, -2) @ g  # per query head
        if group == "per query head":
            dk, dv = full_dk, full_dv
        elif group == "first":
            dk, dv = full_dk[..., ::n_rep, :, :], full_dv[..., ::n_rep, :, :]
        elif group == "interleaved":  # query head h into key/value head h % H_kv
            dk, dv = (x.reshape(*B, n_rep, H_kv, *x.shape[-2:]).sum(axis=-4) for x in (full_dk, full_dv))
        else:
            dk, dv = (x.reshape(*B, H_kv, n_rep, *x.shape[-2:]).sum(axis=-3) for x in (full_dk, full_dv))
            if group == "mean":
                dk, dv = dk / n_rep, dv / n_rep
        grads = {"dq": shaped(f_q * (ds @ k_all), q), "dk": shaped(dk, k), "dv": shaped(dv, v)}
        if options.sinks is not None:  # the sink's weight is what the keys' leave of 1
            p_sink = _np.where(_np.isfinite(lse), 1 - weights.sum(axis=-1, keepdims=True), 0.0)
            per_head = -(p_sink * Di).sum(axis=(-1, -2))
            grads["dsinks"] = per_head.reshape(-1, H_q).sum(axis=0)
        return grads

    with _np.errstate(all="ignore"):
        yield (
            "the softmax's D_i term missing: dS = P * dP, where dS = P * (dP - D_i), D_i = dout_i . out_i",
            (gradients(weights, D_of=lambda P, o, dp: 0.0)),
        )
        yield (
            "D_i taken as the plain row sum of dP, sum_j dP_ij, where it is sum_j P_ij dP_ij = dout_i . out_i",
            (gradients(weights, D_of=lambda P, o, dp: dp.sum(axis=-1, keepdims=True))),
        )
        # the forward loop's O before its division by l_i = sum_j exp(x_ij - max_j x_ij) = 1 / max_j P_ij
        unnormalised = lambda P, o, dp: (g * o).sum(axis=-1, keepdims=True) / P.max(axis=-1, keepdims=True)  # noqa: E731
        yield (
            "D_i taken from the wrong output: dout_i . O_i with O the forward loop's, not yet divided by l_i",
            (gradients(weights, D_of=unnormalised)),
        )
        if f != 1:
            yield (
                f"the scale ({f:.4g}) missing from dq and dk: dS K and dS^T Q unscaled",
                gradients(weights, f_q=1.0, f_k=1.0),
            )
            yield f"the scale ({f:.4g}) missing from dq: dS K unscaled", gradients(weights, f_q=1.0)
            yield f"the scale ({f:.4g}) missing from dk: dS^T Q unscaled", gradients(weights, f_k=1.0)
        if options.mask is not None or options.window is not None:
            free = options.replace(mask=None, window=None)
            if _np.ndim(options.mask) == 0 and options.mask == "causal_top_left" and free.q_offset is None:
                free = free.replace(q_offset=0)
            zeros = _np.zeros((*kb.shape[:-1], 1))
            free_lse = reference.sdpa(qb, kb, zeros, return_lse=True, **free.keywords())[1][..., None]
            every = reference.attention_weights(qb, kb, **free.keywords()) * _np.exp(free_lse - lse)  # all j
            every = _np.where(_np.isfinite(lse), every, 0.0)
            saved = (g * (weights @ v_all)).sum(axis=-1, keepdims=True)  # D_i from the forward's (masked) output
            forgotten = "the mask forgotten in the backward: P recomputed from the saved lse over every key"
            yield forgotten, gradients(every, D_of=lambda P, o, dp: saved)
            yield forgotten + ", D_i = sum_j P_ij dP_ij with it", gradients(every)
        if n_rep > 1:
            contiguous = f"query heads {n_rep} g .. {n_rep} g + {n_rep - 1} into key/value head g"
            yield (
                f"GQA groups not summed into their key/value head ({contiguous})",
                gradients(weights, group="per query head"),
            )
            yield (
                f"only the first query head of each group kept ({contiguous} summed)",
                gradients(weights, group="first"),
            )
            yield f"each group's mean instead of its sum ({contiguous})", gradients(weights, group="mean")
            if H_kv > 1:
                yield (
                    "GQA groups interleaved: query head h summed into key/value head h % H_kv, not h // n_rep",
                    (gradients(weights, group="interleaved")),
                )


def assert_attention_grads_close(
    actual_grads: _Any,
    dout: _Any,
    q: _Any,
    k: _Any,
    v: _Any,
    scale: _Any = None,
    mask: _Any = "causal",
    *,
    sinks: _Any = None,
    window: _Any = None,
    softcap: float | None = None,
    q_offset: _Any = None,
    k_offset: int = 0,
    k_start: _Any = None,
    k_lengths: _Any = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Asserts that ``actual_grads`` are the gradients of attention over q, k, v within
    tolerance; if not, says where each is wrong and which usual mistake it matches.

    The gradients are those of ``sum(dout * sdpa(q, k, v, ...))``, as
    :func:`npattn.sdpa_backward` and autograd give them, compared with
    :func:`npattn.reference.sdpa_backward` in float64.

    Parameters
    ----------
    actual_grads : sequence or mapping of array_like
        ``(dq, dk, dv)`` or ``(dq, dk, dv, dsinks)`` (an :class:`npattn.Grads`,
        PyTorch's ``(q.grad, k.grad, v.grad)``, MLX's ``mx.vjp`` cotangents),
        or a mapping with those names; NumPy, MLX or PyTorch arrays of the
        shapes of q, k, v (and ``(H_q,)``). A ``dsinks`` of None is not checked.
    dout : array_like, shape (*B, H_q, L, D_v)
        The gradient of the loss with respect to the output.
    q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths
        The forward call's, with :func:`npattn.sdpa`'s meaning; ``mask``
        defaults to ``"causal"`` as there.
    rtol, atol : float, optional
        The tolerance for every gradient, instead of the derived one.

    Raises
    ------
    AssertionError
        Naming each gradient that differs: where its worst element is (batch,
        head, row, column) with both values, how many elements fail, per head,
        the tolerance, and which usual mistake of a backward pass it matches
        within tolerance, if one does: the softmax's ``D_i`` term missing or
        taken from the wrong quantity (dP's plain row sum, the forward loop's
        unnormalised output), the scale missing from ``dq`` or ``dk``, the
        mask forgotten in the backward, GQA groups not summed into their
        key/value head (or one head kept, their mean, or interleaved), ``dk``
        and ``dv`` swapped.
    TypeError
        ``actual_grads`` is not 3 or 4 gradients.

    Notes
    -----
    The derived tolerance is :func:`backward_tolerance`'s for the forward
    result's dtype, at :data:`ULPS` (a peer's allowance, as the forward check
    takes) and, for float16 and bfloat16, with the weights and ``dS`` rounded
    to the half type before their products (``precision="fast"``'s terms), as
    MLX's and PyTorch's half-precision backward passes compute.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> from npattn.testing import assert_attention_grads_close
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8), dtype=np.float32) for _ in range(3))
    >>> out, lse = npattn.sdpa(q, k, v, return_lse=True)
    >>> dout = np.ones_like(out)
    >>> assert_attention_grads_close(npattn.sdpa_backward(dout, q, k, v, out, lse), dout, q, k, v)
    >>> dq, dk, dv, _ = npattn.sdpa_backward(dout, q, k, v, out, lse)
    >>> assert_attention_grads_close((dq, dv, dk), dout, q, k, v)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: attention gradients differ from the float64 reference: dk, dv (within tolerance: dq)
    ...
    """
    given = _named_grads(actual_grads)
    got = {name: None if x is None else _interop.asarray(x, f"actual_grads: {name}") for name, x in given.items()}
    for name, x in got.items():
        if x is not None and not _args.is_float(x.dtype):
            raise AssertionError(f"{name} must be an array of floats, got dtype {x.dtype}")
    q64, k64, v64, g64 = (_f64(x) for x in (q, k, v, dout))
    if scale is not None:
        scale = _args.check_scale("assert_attention_grads_close", scale, q64.shape[-1])
    mask, sinks = _f64(mask), _f64(sinks)
    options = reference._Options(scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths)
    with _np.errstate(all="ignore"):
        want = dict(zip(GRADIENTS, reference.sdpa_backward(g64, q64, k64, v64, None, None, **options.keywords())))
    inputs = _args.result_dtype(*(_interop.asarray(x).dtype for x in (q, k, v)))
    computed = "float64" if inputs == _np.float64 else "float32"
    # a peer's allowance: ULPS, and half-precision weights and dS rounded before their products
    own = [_interop.asarray(x) for x in (q, k, v, dout)]  # in their own dtypes, as NumPy arrays
    tolerances = backward_tolerance(*own, inputs, **options.keywords(), ulps=ULPS[computed], precision="fast")
    checks = {}  # gradient: (its float64 value, atol, rtol), for each one given
    for name in GRADIENTS:
        if got[name] is None or want[name] is None:
            continue
        if atol is not None:
            checks[name] = (_np.asarray(got[name], _np.float64), float(atol), 0.0 if rtol is None else float(rtol))
        else:
            rt, at = tolerances[name]
            checks[name] = (_np.asarray(got[name], _np.float64), at, rt if rtol is None else float(rtol))

    def agrees(name: str, value: _Any) -> bool:  # the gradient given is `value`, within tolerance
        value = _np.asarray(value, dtype=_np.float64)
        got64, at, rt = checks[name]
        if _np.shape(at) not in ((), got64.shape):  # a gradient of the wrong shape: the largest atol of the right one
            at = float(_np.max(at, initial=0.0))
        return value.shape == got64.shape and not _beyond(got64, value, at, rt).any()

    failing = [name for name in checks if not agrees(name, want[name])]
    if not failing:
        return
    mistakes = list(_backward_mistakes(q64, k64, v64, g64, options))
    if _np.shape(want["dk"]) == _np.shape(want["dv"]):
        mistakes.append(
            ("dk and dv swapped: dk is dv of these inputs, and dv is dk", {"dk": want["dv"], "dv": want["dk"]})
        )
    # a mistake every gradient given agrees with, the right ones included, before one that explains a gradient alone
    whole = [what for what, grads in mistakes if all(agrees(n, grads.get(n, want[n])) for n in checks)]
    lines = []
    for name in failing:
        lines += _gradient_failure(name, *checks[name], _np.asarray(want[name], _np.float64), atol is not None)
        alone = [what for what, grads in mistakes if name in grads and agrees(name, grads[name])]
        if whole:
            lines.append(f"  {name} matches, within tolerance, " + "; and also ".join(whole))
        elif alone:
            lines.append(f"  {name} alone matches, within tolerance, " + "; and also ".join(alone))
        else:
            lines.append(f"  {name} matches none of the usual backward mistakes tried")
    passed = [n for n in checks if n not in failing]
    head = "attention gradients differ from the float64 reference: " + ", ".join(failing)
    head += f" (within tolerance: {', '.join(passed)})" if passed else ""
    L, S, D = q64.shape[-2], k64.shape[-2], q64.shape[-1]
    H_q, H_kv = (q64.shape[-3], k64.shape[-3]) if q64.ndim > 2 else (1, 1)
    n_rep = H_q // max(H_kv, 1)
    checked = [
        f"checked against npattn.reference.sdpa_backward in float64: gradients of {inputs.name} inputs",
        *_mask_and_scale(options, L, S, D),
        f"  GQA: {H_q} query heads in {H_kv} contiguous groups of {n_rep}; key/value head g sums the gradients "
        f"of query heads {n_rep} g .. {n_rep} g + {n_rep - 1}"
        if n_rep > 1
        else f"  {H_q} query heads, each with its own key/value head",
    ]
    raise AssertionError("\n".join([head, *lines, *checked]))


def _gradient_failure(name, got, atol, rtol, want, given) -> list[str]:
    """The lines that say where one gradient differs from the reference: its shape, or its
    worst element, how many fail, per head, and the tolerance."""
    if got.shape != want.shape:
        return [f"{name} has shape {got.shape}, but {name} of these inputs has shape {want.shape}"]
    bad = _beyond(got, want, atol, rtol)
    n_bad = int(bad.sum())
    with _np.errstate(invalid="ignore", over="ignore"):
        excess = _np.where(bad, _np.abs(got - want) - (atol + rtol * _np.abs(want)), -_np.inf)
    worst = _np.unravel_index(int(_np.argmax(_np.nan_to_num(excess, nan=_np.inf))), got.shape)
    at_worst = float(_np.broadcast_to(atol, got.shape)[worst])
    where = f"head {worst[0]}" if name == "dsinks" else _where(worst, got.ndim).replace("D_v index", "column")
    lines = [
        f"{name}: {n_bad} of {got.size} elements beyond tolerance ({100 * n_bad / got.size:.3g}%); worst at "
        f"{where}: actual {float(got[worst])!r}, reference {float(want[worst])!r}",
        f"  tolerance: atol {at_worst:.3g}" + (" (given)" if given else " (npattn.testing.backward_tolerance)")
        + f", rtol {rtol:.3g}",
    ]  # fmt: skip
    if name != "dsinks" and got.ndim >= 3:
        heads = bad.reshape(-1, *got.shape[-3:]).sum(axis=(0, 2, 3))
        lines.append(f"  failing elements per head: {_per_index(heads, got.size // max(got.shape[-3], 1))}")
    return lines

"""Checking an attention implementation: one line, and a message that says where it is wrong.

    from npattn.testing import assert_attention_close
    assert_attention_close(my_out, q, k, v, mask="causal")

``actual`` may be a NumPy, MLX or PyTorch array; so may q, k, v, the mask and
the sinks. It is compared with ``npattn.reference.sdpa`` on float64 copies of
the inputs, within a tolerance derived from ``actual``'s dtype and the inputs
(:func:`tolerance`, the README's table), or within the ``rtol``/``atol`` given.

The tolerance: a logit ``s = scale * q.k + mask`` computed in a dtype of
machine epsilon ``eps`` is off by a few ulps of the terms it sums, at most
``|scale| |q_i| |k_j|`` (Cauchy-Schwarz); softmax turns a logit error ``e``
into a relative weight error of about ``e``, so the output, a convex
combination of v's rows, moves by about ``2 e max|v|``; the weighted sum over
``S`` keys adds about ``sqrt(S)`` ulps of ``max|v|``. Hence::

    atol = ulps * eps * (1 + max|logit| + sqrt(S)) * max|v|

with ``max|logit|`` the bound ``|scale| max|q_i| max|k_j|``, plus the largest
finite ``|mask|`` and ``|sink|``, plus the softcap. ``ulps`` is 64 for
float64, 8 for float32 (a peer's float32 kernel, such as MLX's or PyTorch's,
uses a fraction of it: npattn's own tests hold npattn to 4), and 2 for
float16 and bfloat16, plus the float32 bound, for an implementation that
rounds its scores and weights to the half dtype, as MLX's does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _args, _interop, reference

__all__ = ["assert_attention_close", "tolerance", "ULPS", "OWN_ULPS", "EPS"]

#: Units of the dtype's epsilon per unit of logit and of max|v|, by dtype name.
ULPS = {"float64": 64, "float32": 8, "float16": 2, "bfloat16": 2}

#: What npattn's own float results are held to (its tests, python -m npattn);
#: its float16 and bfloat16 results are the reference correctly rounded.
OWN_ULPS = {"float64": 64, "float32": 4}

#: Machine epsilon, by dtype name.
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _f64(x: Any) -> np.ndarray | None:
    """A float64 NumPy copy of an array of any library; None, strings and bool masks as they are."""
    if x is None or isinstance(x, str):
        return x
    a = _interop.asarray(x)
    return a if a.dtype == bool else np.asarray(a, dtype=np.float64)


def _largest(x: Any) -> float:
    """max |x| over finite entries; 0 for None, strings, bool masks and empty arrays."""
    if x is None or isinstance(x, str):
        return 0.0
    a = np.asarray(x)
    if a.dtype == bool or a.size == 0:
        return 0.0
    a = a[np.isfinite(a)]
    return float(np.abs(a).max()) if a.size else 0.0


def max_logit(q: Any, k: Any, scale=None, mask=None, sinks=None, softcap=None) -> float:
    """A bound on the largest logit's error scale: ``|scale| max|q_i| max|k_j|`` (Cauchy-
    Schwarz, which also bounds the sum of ``|q_d k_d|`` a dot product rounds), plus the
    largest finite |mask| and |sink|, plus the cap (the error of its tanh)."""
    q, k = _f64(q), _f64(k)
    factor = abs(q.shape[-1] ** -0.5 if scale is None else float(_args.check_scale("tolerance", scale, 1)))

    def row_norm(x):
        return float(np.sqrt((x * x).sum(axis=-1)).max()) if x.size else 0.0

    with np.errstate(over="ignore", invalid="ignore"):
        bound = factor * row_norm(q) * row_norm(k)
    return bound + _largest(_f64(mask)) + _largest(_f64(sinks)) + (float(softcap) if softcap else 0.0)


def tolerance(
    q: Any, k: Any, v: Any, scale=None, mask=None, *, sinks=None, softcap=None, dtype=None, ulps=None
) -> float:
    """The absolute tolerance for an attention output of ``dtype`` on these inputs.

    ``atol = ulps * eps * (1 + max|logit| + sqrt(S)) * max|v|`` (see the
    module's docstring); for float16 and bfloat16 the float32 bound is added.
    ``dtype`` defaults to the inputs' result dtype, ``ulps`` to
    ``ULPS[dtype]``.
    """
    if dtype is None:
        dtype = _args.result_dtype(*(_interop.asarray(x).dtype for x in (q, k, v)))
    name = np.dtype(dtype).name
    if name not in ULPS:
        raise TypeError(f"tolerance: no tolerance for dtype {name}; float16, bfloat16, float32 or float64")
    scale_of = 1.0 + max_logit(q, k, scale, mask, sinks, softcap) + np.sqrt(_interop.asarray(k).shape[-2])
    v_size = _largest(_f64(v)) or 1.0
    atol = (ULPS[name] if ulps is None else ulps) * EPS[name] * scale_of * v_size
    if name in ("float16", "bfloat16"):
        atol += 4 * EPS["float32"] * scale_of * v_size
    return float(atol)


def _where(index: tuple, ndim: int) -> str:
    """An element's index named by the shape legend: (batch..., head, row, column)."""
    names = ["row", "column"] if ndim == 2 else ["head", "row", "column"]
    batch = [f"batch {i}" for i in index[: ndim - len(names)]] if ndim > 3 else []
    parts = batch + [f"{n} {i}" for n, i in zip(names, index[-len(names) :])]
    return ", ".join(parts)


def assert_attention_close(
    actual: Any,
    q: Any,
    k: Any,
    v: Any,
    scale: float | None = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window=None,
    softcap: float | None = None,
    q_offset: int | None = None,
    k_offset: int = 0,
    peer: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Asserts that ``actual`` is attention over q, k, v, within tolerance.

    Parameters
    ----------
    actual : array_like
        The output to check (NumPy, MLX or PyTorch), shape ``(*B, H_q, L, D_v)``.
    q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset
        What ``actual`` is meant to compute, with :func:`npattn.sdpa`'s
        meaning; note that ``mask`` defaults to ``"causal"`` (bottom-right)
        as in npattn, where MLX and PyTorch default to no mask.
    peer : {"mlx", "torch"}, optional
        Where ``actual`` comes from, to explain a known difference in the
        message (MLX's CPU path on rows that see no key).
    rtol, atol : float, optional
        The tolerance, instead of the one derived by :func:`tolerance`.

    Raises
    ------
    AssertionError
        Saying where the worst element is (batch, head, row, column) with both
        values, the tolerance and how it was derived, how many elements fail,
        and whether the failing rows see no key.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> from npattn.testing import assert_attention_close
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8), dtype=np.float32) for _ in range(3))
    >>> assert_attention_close(npattn.sdpa(q, k, v), q, k, v)
    >>> assert_attention_close(npattn.sdpa(q, k, v, mask=None), q, k, v)
    Traceback (most recent call last):
    ...
    AssertionError: attention output differs from the float64 reference at ...
    """
    got = _interop.asarray(actual, "actual")
    if not _args.is_float(got.dtype):
        raise AssertionError(f"actual must be an array of floats, got dtype {got.dtype}")
    q64, k64, v64 = (_f64(x) for x in (q, k, v))
    mask64, sinks64 = _f64(mask), _f64(sinks)
    with np.errstate(all="ignore"):
        want, lse = reference.sdpa(
            q64,
            k64,
            v64,
            scale,
            mask64,
            sinks=sinks64,
            window=window,
            softcap=softcap,
            q_offset=q_offset,
            k_offset=k_offset,
            return_lse=True,
        )
    if got.shape != want.shape:
        raise AssertionError(f"actual has shape {got.shape}, but attention over these inputs has shape {want.shape}")
    name = got.dtype.name
    if atol is None:
        atol = tolerance(q64, k64, v64, scale, mask64, sinks=sinks64, softcap=softcap, dtype=got.dtype)
        ulps = ULPS.get(name)
        how = (
            f"atol {atol:.3g} = {ulps} * eps({name}) * (1 + max|logit| "
            f"{max_logit(q64, k64, scale, mask64, sinks64, softcap):.4g} + sqrt(S) {np.sqrt(k64.shape[-2]):.3g})"
            f" * max|v| {_largest(v64) or 1.0:.4g}"
            + (" + the float32 bound" if name in ("float16", "bfloat16") else "")
            + " (npattn.testing.tolerance)"
        )
    else:
        how = f"atol {atol:.3g} (given)"
    rtol = 0.0 if rtol is None else float(rtol)
    got64 = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(got64 - want)
        allowed = atol + rtol * np.abs(want)
        nan_wrong = np.isnan(got64) != np.isnan(want)
        bad = nan_wrong | (~np.isnan(want) & ~(err <= allowed))
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    excess = np.where(nan_wrong, np.inf, np.where(bad, err - allowed, -np.inf))
    worst = np.unravel_index(int(np.argmax(excess)), got.shape)
    lines = [
        f"attention output differs from the float64 reference at {n_bad} of {got.size} elements "
        f"({100 * n_bad / got.size:.3g}%)",
        f"worst at {_where(worst, got.ndim)}: actual {float(got64[worst])!r}, reference {float(want[worst])!r}"
        + ("" if np.isnan(got64[worst]) or np.isnan(want[worst]) else f" (|diff| {err[worst]:.3g})"),
        f"tolerance: {how}, rtol {rtol:g}",
    ]
    bad_rows = bad.any(axis=-1)
    no_key = np.broadcast_to(lse == -np.inf, bad_rows.shape)
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
    raise AssertionError("\n".join(lines))

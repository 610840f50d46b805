"""npattn on PyTorch tensors: ``sdpa`` in npattn's own terms, and a drop-in for
``torch.nn.functional.scaled_dot_product_attention``.

    import npattn.torch
    out = npattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = npattn.torch.sdpa(q, k, v, mask="causal", window=(127, 0))

Both compute with ``npattn.sdpa`` on the tensors' own memory (no copy of q, k
or v) and return a ``torch.Tensor`` of the inputs' dtype (bfloat16 included)
that autograd differentiates through ``npattn.sdpa_backward``. They are the
custom operators ``torch.ops.npattn.sdpa`` and ``torch.ops.npattn.sdpa_backward``
(``torch.library``, with fake implementations and autograd registered), so
``torch.compile`` (``fullgraph=True`` included) and ``torch.export`` see one
opaque operator where npattn runs. Pure Python on npattn's public functions:
nothing is built against PyTorch.
"""

from __future__ import annotations

import contextlib
import ctypes
import numbers
import os
from collections.abc import Iterator
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

import npattn

from . import _core, _interop

__all__ = ["scaled_dot_product_attention", "sdpa"]

try:  # PyTorch >= 2.3: the bias objects of torch.nn.attention.bias
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover - older PyTorch
    CausalBias = CausalVariant = None

FN = "npattn.torch.scaled_dot_product_attention"
MASK_KINDS = (
    "causal",
    "causal_top_left",
    "none",
    "array",
)  # the operator's mask_kind: a string mask, None, or an array


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: Any = "causal",
    *,
    sinks: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_offset: int | torch.Tensor | None = None,
    k_offset: int = 0,
    k_start: int | torch.Tensor | None = None,
    k_lengths: int | torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
    precision: str = "highest",
    threads: int | None = None,
) -> torch.Tensor:
    """:func:`npattn.sdpa` on tensors, with autograd.

    The arguments and their meaning are those of :func:`npattn.sdpa` (its
    default mask is ``"causal"``, bottom-right), given as tensors: ``q``,
    ``k``, ``v`` and ``sinks`` CPU tensors of one floating dtype, ``mask``
    ``"causal"``, ``"causal_top_left"``, ``None`` or a bool or float tensor,
    and ``q_offset``, ``k_start``, ``k_lengths`` ints or int tensors (one per
    request). ``k`` and ``v`` may hold 8-bit codes (``torch.int8``,
    ``torch.uint8``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``) with
    their ``k_scale`` / ``v_scale`` (and ``k_zero`` / ``v_zero``) tensors, read
    as stored; no gradient flows through codes. It runs as the operator ``torch.ops.npattn.sdpa``.

    Parameters
    ----------
    q, k, v : torch.Tensor
        Shapes ``(*Bq, H_q, L, D)``, ``(*Bk, H_kv, S, D)``, ``(*Bv, H_kv, S, D_v)``.
    scale, mask, window, softcap, q_offset, k_offset, k_start, k_lengths, precision
        As for :func:`npattn.sdpa`.
    k_scale, v_scale, k_zero, v_zero : torch.Tensor, optional
        The scales (and zero points) of codes, as for :func:`npattn.sdpa`.
    sinks : torch.Tensor, shape (H_q,), optional
        One logit per query head; it gets a gradient when it requires grad.
    threads : int, optional
        ``None`` means ``torch.get_num_threads()``.

    Returns
    -------
    torch.Tensor, shape (*B, H_q, L, D_v)
        In the inputs' dtype. When grad is enabled and ``q``, ``k``, ``v``
        or ``sinks`` requires grad, its backward is :func:`npattn.sdpa_backward`
        (the mask gets no gradient).

    Examples
    --------
    >>> import torch, npattn.torch
    >>> q = torch.randn(1, 8, 4, 64, requires_grad=True)
    >>> k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    >>> out = npattn.torch.sdpa(q, k, v, window=(2, 0))
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([1, 8, 4, 64])
    """
    fn = "npattn.torch.sdpa"
    operands = {"q": q, "k": k, "v": v, "sinks": sinks, "k_scale": k_scale, "v_scale": v_scale, "k_zero": k_zero}
    for name, t in {**operands, "v_zero": v_zero}.items():
        if t is not None:
            _check_tensor(fn, name, t)
    if isinstance(mask, torch.Tensor):
        _check_mask_tensor(fn, mask)
    elif not (mask is None or isinstance(mask, str)):
        raise TypeError(
            f"{fn}: mask must be 'causal', 'causal_top_left', None or a torch.Tensor, got {type(mask).__name__}"
        )
    return attention(
        q, k, v, scale=scale, mask=mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset,
        k_offset=k_offset, k_start=k_start, k_lengths=k_lengths, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero,
        v_zero=v_zero, precision=precision, threads=threads,
    )  # fmt: skip


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
    A row that sees no key is zeros in both (PyTorch >= 2.5). It runs as
    the operator ``torch.ops.npattn.sdpa``, which ``torch.compile`` traces
    as one node.

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
        _check_tensor(FN, name, t)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"{FN}: query, key and value must have the same dtype, got {query.dtype}, {key.dtype} and {value.dtype}"
        )
    if not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(f"{FN}: dropout_p must be 0.0, npattn has no dropout; got {dropout_p!r}")
    query, key, value = _heads(query, key, value, enable_gqa)
    mask = _mask(attn_mask, is_causal, query.shape[-2], key.shape[-2])
    return attention(query, key, value, scale=scale, mask=mask)


# ---- the operators ----


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: Any = "causal",
    sinks: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_offset: int | torch.Tensor | None = None,
    k_offset: int = 0,
    k_start: int | torch.Tensor | None = None,
    k_lengths: int | torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
    precision: str = "highest",
    threads: int | None = None,
) -> torch.Tensor:
    """npattn.sdpa on tensors whose kinds are checked: the operator where a graph
    is traced or a gradient may be needed, else a direct call (the same
    computation, without the dispatcher's cost on a small decode step)."""
    left, right = (None, None) if window is None else window
    if isinstance(mask, str) or mask is None:
        kind, array = ("none" if mask is None else mask), None
    else:
        kind, array = "array", mask
    codes = (k_scale, v_scale, k_zero, v_zero)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    )
    if needs_grad or torch.compiler.is_compiling():
        out, _ = torch.ops.npattn.sdpa(
            q, k, v, array, sinks, _per_request(k_start), _per_request(k_lengths), _per_request(q_offset), *codes,
            scale, kind, left, right, softcap, k_offset, precision, -1 if threads is None else threads,
        )  # fmt: skip
        return out
    with on_torch_threads():
        out = npattn.sdpa(
            *(_interop.asarray(t) for t in (q, k, v)), scale, _numpy_mask(kind, array),
            sinks=None if sinks is None else _interop.asarray(sinks), window=window, softcap=softcap,
            q_offset=_numpy_int(q_offset), k_offset=k_offset, k_start=_numpy_int(k_start),
            k_lengths=_numpy_int(k_lengths), precision=precision, threads=_threads(threads), **_codes(*codes),
        )  # fmt: skip
    return _interop.to_torch(out)


def _codes(k_scale: Any, v_scale: Any, k_zero: Any, v_zero: Any) -> dict[str, Any]:
    """The scales and zero points given, as npattn.sdpa's keywords (NumPy arrays)."""
    given = {"k_scale": k_scale, "v_scale": v_scale, "k_zero": k_zero, "v_zero": v_zero}
    return {name: _interop.asarray(x) for name, x in given.items() if x is not None}


def _threads(threads: int | None) -> int:
    """The operator's threads: None (-1 in the operator) is torch.get_num_threads(), read when it runs."""
    return torch.get_num_threads() if threads is None or threads == -1 else threads


def _per_request(x: int | torch.Tensor | None) -> torch.Tensor | None:
    """An int (or None) or int tensor as the operator's optional int tensor."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=torch.int64)


def _numpy_int(x: int | torch.Tensor | None) -> Any:
    return _interop.asarray(x) if isinstance(x, torch.Tensor) else x


def _numpy_mask(kind: str, array: torch.Tensor | None) -> Any:
    if kind == "array":
        return _interop.asarray(array)
    return None if kind == "none" else kind


def _options(mask, sinks, k_start, k_lengths, q_offset, k_scale, v_scale, k_zero, v_zero, scale, mask_kind,
             window_left, window_right, softcap, k_offset, precision) -> dict[str, Any]:  # fmt: skip
    """The operator's arguments as npattn.sdpa's keywords (NumPy arrays)."""
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"npattn::sdpa: mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if (mask_kind == "array") != (mask is not None):
        raise ValueError("npattn::sdpa: a mask tensor goes with mask_kind 'array', and only with it")
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return {
        "scale": scale,
        "mask": _numpy_mask(mask_kind, mask),
        "sinks": None if sinks is None else _interop.asarray(sinks),
        "window": window,
        "softcap": softcap,
        "q_offset": _numpy_int(q_offset),
        "k_offset": k_offset,
        "k_start": _numpy_int(k_start),
        "k_lengths": _numpy_int(k_lengths),
        "precision": precision,
        **_codes(k_scale, v_scale, k_zero, v_zero),
    }


@torch.library.custom_op("npattn::sdpa", mutates_args=())
def _sdpa_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_start: torch.Tensor | None,
    k_lengths: torch.Tensor | None,
    q_offset: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    scale: float | None,
    mask_kind: str,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    k_offset: int,
    precision: str,
    threads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """npattn.sdpa(q, k, v, ..., return_lse=True) as an operator: (out, lse)."""
    options = _options(mask, sinks, k_start, k_lengths, q_offset, k_scale, v_scale, k_zero, v_zero, scale, mask_kind,
                       window_left, window_right, softcap, k_offset, precision)  # fmt: skip
    arrays = (_interop.asarray(t) for t in (q, k, v))
    with on_torch_threads():
        out, lse = npattn.sdpa(*arrays, return_lse=True, threads=_threads(threads), **options)
    return _interop.to_torch(out), torch.from_numpy(np.asarray(lse))


@_sdpa_op.register_fake
def _(q, k, v, *options):
    out_shape, lse_shape = _result_shapes(q, k, v)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(out_shape, dtype=_result_dtype(q, k, v)), q.new_empty(lse_shape, dtype=wide)


@torch.library.custom_op("npattn::sdpa_backward", mutates_args=())
def _sdpa_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_start: torch.Tensor | None,
    k_lengths: torch.Tensor | None,
    q_offset: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    scale: float | None,
    mask_kind: str,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    k_offset: int,
    precision: str,
    threads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """npattn.sdpa_backward as an operator: (dq, dk, dv, dsinks), dsinks empty without sinks."""
    options = _options(mask, sinks, k_start, k_lengths, q_offset, k_scale, v_scale, k_zero, v_zero, scale, mask_kind,
                       window_left, window_right, softcap, k_offset, precision)  # fmt: skip
    arrays = [_interop.asarray(t) for t in (dout, q, k, v, out, lse)]
    with on_torch_threads():
        grads = npattn.sdpa_backward(*arrays, threads=_threads(threads), **options)
    dsinks = torch.empty(0, dtype=lse.dtype) if grads.dsinks is None else torch.from_numpy(grads.dsinks)
    return _interop.to_torch(grads.dq), _interop.to_torch(grads.dk), _interop.to_torch(grads.dv), dsinks


@_sdpa_backward_op.register_fake
def _(dout, q, k, v, out, lse, mask, sinks, *options):
    dsinks = lse.new_empty((0,) if sinks is None else tuple(sinks.shape))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, mask, sinks, k_start, k_lengths, q_offset, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, sinks, k_start, k_lengths, q_offset)
    ctx.options = options


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> tuple:
    q, k, v, out, lse, mask, sinks, k_start, k_lengths, q_offset = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.npattn.sdpa_backward(
        dout, q, k, v, out, lse, mask, sinks, k_start, k_lengths, q_offset, *ctx.options
    )
    wanted = ctx.needs_input_grad
    grads = [g if wanted[i] else None for i, g in enumerate((dq, dk, dv))]
    dsinks = dsinks.to(sinks.dtype) if sinks is not None and wanted[4] else None
    return (*grads, None, dsinks) + (None,) * (len(wanted) - 5)


torch.library.register_autograd("npattn::sdpa", _backward, setup_context=_setup_context)


def _result_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """npattn's result dtype: the floating operands' (codes are read as their scales' values)."""
    floats = [t.dtype for t in (q, k, v) if t.dtype.is_floating_point and t.element_size() > 1]
    dtype = floats[0]
    for d in floats[1:]:
        dtype = torch.promote_types(dtype, d)
    return dtype


def _result_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple, tuple]:
    """The shapes of npattn.sdpa's out and lse for these operands (rank 2 reads as one head)."""
    if q.dim() == k.dim() == v.dim() == 2:
        return (q.shape[0], v.shape[-1]), (q.shape[0],)
    batch = torch.broadcast_shapes(*(tuple(t.shape[:-3]) if t.dim() >= 3 else () for t in (q, k, v)))
    heads = q.shape[-3] if q.dim() >= 3 else 1
    return (*batch, heads, q.shape[-2], v.shape[-1]), (*batch, heads, q.shape[-2])


# ---- one set of threads ----


def _openmp_runtime() -> str | None:
    """The OpenMP runtime PyTorch's own threads run on, when its parallel backend is
    OpenMP: the library beside libtorch (its wheels ship libgomp, or libomp on
    macOS), else the one this process has mapped; None if there is none."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = ("libgomp", "libomp", "libiomp5")
    try:
        beside = sorted(f for f in os.listdir(lib) if f.startswith(names))
    except OSError:
        beside = []
    if beside:
        return os.path.join(lib, beside[0])
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError:
        return None
    found = sorted(p for p in mapped if os.path.basename(p).startswith(names))
    return found[0] if found else None


def _share_torch_threads() -> bool:
    """Hands npattn's core PyTorch's OpenMP runtime, so that calls made through
    this module run on PyTorch's own threads (NPATTN_TORCH_THREADS=0: on npattn's
    pool, as any other call)."""
    if os.environ.get("NPATTN_TORCH_THREADS", "1") == "0":
        return False
    path = _openmp_runtime()
    if path is None:
        return False
    try:
        runtime = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
        parallel, thread_num = runtime.GOMP_parallel, runtime.omp_get_thread_num
    except (OSError, AttributeError):  # not loaded, or not a runtime with these names
        return False
    address = ctypes.cast(parallel, ctypes.c_void_p).value, ctypes.cast(thread_num, ctypes.c_void_p).value
    _core.set_openmp(*address)
    return True


SHARES_TORCH_THREADS = _share_torch_threads()


@contextlib.contextmanager
def on_torch_threads() -> Iterator[None]:
    """npattn's calls inside run on PyTorch's OpenMP threads (where
    ``SHARES_TORCH_THREADS``), as PyTorch's own operations do."""
    was = _core.openmp_here(True)
    try:
        yield
    finally:
        _core.openmp_here(was)


# ---- PyTorch's spelling of the arguments ----


def _check_tensor(fn: str, name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{fn}: npattn computes on the CPU; {name} is on {t.device}")


def _check_mask_tensor(fn: str, mask: torch.Tensor) -> None:
    if mask.device.type != "cpu":
        raise ValueError(f"{fn}: npattn computes on the CPU; attn_mask is on {mask.device}")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{fn}: attn_mask requires grad, but npattn computes no gradient for the mask; pass attn_mask.detach()"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"{fn}: attn_mask must be a bool or floating tensor, got dtype {mask.dtype}")


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
    """PyTorch's attn_mask and is_causal as npattn's mask (a string, None or a tensor)."""
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
    _check_mask_tensor(FN, attn_mask)
    return attn_mask

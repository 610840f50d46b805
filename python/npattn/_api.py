"""The public functions: sdpa, attention_weights, merge (and sdpa_backward).

Each hands its arguments to the C glue by name, exactly as given, in one
call. The glue reads and checks each one, converting through
``_args.convert`` what it cannot read in place, computes, and raises the
error that names the argument; an option added to a signature is passed on
by name here and read in one place there (``OPTIONS`` in csrc/module.h).
"""

from __future__ import annotations  # signatures name the aliases (MaskLike), never their expansion

import functools
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, SupportsFloat, TypeAlias, overload

import numpy as np
from numpy.typing import DTypeLike

from . import _args, _core, _interop, reference

__all__ = ["sdpa", "paged_attention", "attention_weights", "merge", "sdpa_backward", "Grads", "Lse", "causal_mask"]


class _SupportsArray(Protocol):
    def __array__(self) -> np.ndarray: ...


# An array, or anything np.asarray makes one of (MLX arrays and torch tensors
# too), but never a string: so that a misspelt mask string is a type error.
ArrayLike: TypeAlias = (
    np.ndarray
    | _SupportsArray
    | Sequence[float]
    | Sequence[Sequence[float]]
    | Sequence[Sequence[Sequence[float]]]
    | Sequence[Sequence[Sequence[Sequence[float]]]]
)
MaskLike: TypeAlias = Literal["causal", "causal_top_left"] | None | ArrayLike
Scale: TypeAlias = SupportsFloat | _SupportsArray | None  # a number, a 0-d array, mx.rsqrt(D)
Window: TypeAlias = tuple[int | None, int | None] | None
Precision: TypeAlias = Literal["highest", "fast"]


@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: Literal[False] = False,
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray: ...
@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: Literal[True],
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: bool = False,
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]: ...


def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: bool = False,
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention with grouped-query attention.

    Computes, per query head and per query row::

        s   = scale * q @ k^T                   (softcap * tanh(s / softcap) with softcap)
        out = softmax(s + mask) @ v

    Parameters
    ----------
    q : array_like, shape (*Bq, H_q, L, D) or (L, D)
        Queries. Anything ``np.asarray`` takes (MLX arrays and PyTorch CPU
        tensors too), with any strides. Heads come before rows: arrays laid
        out ``(B, L, H, D)``, as models store them, go in as
        ``x.transpose(0, 2, 1, 3)``, which copies nothing. A PyTorch tensor
        that requires grad is read detached: no gradient flows back through
        this call (``npattn.torch.scaled_dot_product_attention`` gives
        autograd, and :func:`sdpa_backward` the gradients by hand).
    k : array_like, shape (*Bk, H_kv, S, D) or (S, D)
        Keys. ``H_q`` must be a multiple of ``H_kv``.
    v : array_like, shape (*Bv, H_kv, S, D_v) or (S, D_v)
        Values. ``D_v`` may differ from ``D``.
    scale : float, optional
        Multiplies ``q @ k^T``: any finite real number, or a 0-d array.
        ``None`` (default) means ``1 / sqrt(D)``.
    mask : {"causal", "causal_top_left", None} or array_like, default "causal"
        ``"causal"``: a key is visible iff its position is at most the
        query's, with positions aligned to the bottom-right corner as MLX does
        (query ``i`` sees key ``j`` iff ``j <= i + (S - L)``; a decode step with
        ``L = 1`` sees every key). ``"causal_top_left"``: ``j <= i``, as
        PyTorch's ``is_causal=True``. ``None``: every key visible. A bool
        array broadcastable to ``(*B, H_q, L, S)``: ``True`` = visible. A
        floating array of that shape, any float dtype: added to the scores
        (``-inf`` hides). Note that MLX and PyTorch default to no mask.
    sinks : array_like, shape (H_q,), optional
        One logit per query head; ``exp(sink)`` joins that head's softmax
        denominator, unscaled and unmasked (attention sinks, as in gpt-oss).
    window : (int or None, int or None), optional
        ``(left, right)``: a key is visible only if
        ``q_pos - left <= k_pos <= q_pos + right``, intersected with ``mask``.
        ``None`` on a side leaves it unbounded. A sliding window of ``W`` keys
        (Mistral, Gemma) is ``mask="causal", window=(W - 1, 0)``. Keys outside
        the window are never read.
    softcap : float, optional
        A finite number > 0: the scaled score ``s`` becomes
        ``softcap * tanh(s / softcap)`` before the mask is added (Gemma 2).
    q_offset, k_offset : int, optional
        Positions of query row 0 and key row 0. ``q_offset`` defaults to
        ``S - L`` (bottom-right), ``k_offset`` to 0; ``"causal_top_left"``
        means ``q_offset=0`` and cannot be given with one. Keys ``[s1, S)``
        of a causal problem are ``sdpa(q, k[..., s1:, :], v[..., s1:, :],
        q_offset=S - L, k_offset=s1, return_lse=True)``; ``merge`` joins the
        parts exactly.
        ``q_offset`` may also be an int array broadcastable to the batch
        shape ``B``: one position per request.
    k_start, k_lengths : int or array_like of ints, optional
        Per-request key ranges, each an int or an int array (any integer
        dtype) broadcastable to the batch shape ``B``. Request ``b`` sees
        only the key rows ``k_start[b] <= j < k_start[b] + k_lengths[b]``
        (defaults: ``k_start = 0``, ``k_lengths = S - k_start``); rows
        outside are never read, and tiles outside are skipped. Positions
        count from the first row read: row ``j`` sits at
        ``k_offset + j - k_start[b]``, and ``q_offset`` defaults to
        ``k_offset + k_lengths[b] - L``, the bottom-right corner of each
        request's own context. A right-padded cache is
        ``k_lengths=lengths``; a right-aligned batch cache (request ``b`` in
        the last ``n[b]`` rows) is ``k_start=S - n, k_lengths=n``; no
        ``L x S`` mask is needed. The ranges intersect every mask kind,
        ``window`` and ``sinks``. A range outside ``[0, S]`` is a
        ``ValueError`` naming the argument and the request.
    k_scale, v_scale : array_like, optional
        The scales of ``k`` and ``v`` where they hold 8-bit codes: ``int8``,
        ``uint8``, ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.float8_e5m2``
        (a KV cache as vLLM, OpenVINO, ONNX Runtime or llama.cpp keep it). A
        code stands for ``scale * (code - zero)``, computed in float32.
        float32, float16 or bfloat16, finite, broadcastable to
        ``k.shape[:-1] + (G,)`` with ``G`` dividing ``D`` (``D_v`` for
        ``v``): element ``d`` of a row uses group ``d // (D // G)``. So one
        scale per tensor is ``()``, per head ``(H_kv, 1, 1)``, per token
        ``(..., S, 1)``, per channel ``(..., 1, D)``, and llama.cpp's
        ``q8_0`` has ``G = D // 32`` float16 scales. :func:`npattn.quantize`
        makes codes and scales. Codes are read as stored, a byte an element,
        never into a dequantized copy; the result is :func:`sdpa` of the
        float32 values they stand for (float64 where ``q`` is float64).
        Either of ``k`` and ``v`` may hold codes, in its own format.
    k_zero, v_zero : array_like, optional
        Zero points of ``int8`` and ``uint8`` codes (OpenVINO's ``u8``
        cache), as the scales are given (their last axis 1 or ``G``). The fp8
        formats are symmetric and take none.
    return_lse : bool, default False
        Also return ``lse``, the natural log of each row's softmax
        denominator (sink included), shape ``(*B, H_q, L)``: float64 for
        float64 results, float32 otherwise; ``-inf`` for a row that sees no
        key and has no sink. It is an ``npattn.Lse``, a NumPy array that
        remembers the options this call computed under (``lse.options``,
        its defaults resolved), so that :func:`sdpa_backward` refuses
        options that differ.
    precision : {"highest", "fast"}, default "highest"
        ``"highest"``: float16 and bfloat16 results are correctly rounded from
        a float32 computation, subnormals included. ``"fast"`` allows, for half
        inputs only, the weights rounded to the half type before ``P @ V``
        and the CPU's half-precision dot products (within
        ``npattn.testing.tolerance(..., precision="fast")``): bfloat16 prefills
        where the CPU has bfloat16 dot products, and float16 ones on AMX-BF16
        tiles, use them; elsewhere it computes as ``"highest"``. float32 and
        float64 inputs compute the same either way.
    out : numpy.ndarray, optional
        A writeable array of exactly the result's shape and dtype that shares
        no memory with an input; it is filled and returned.
    threads : int, optional
        At most this many threads, the calling one included. ``None`` uses
        ``NPATTN_NUM_THREADS`` when set, else the CPUs this process may run
        on, capped by ``threadpoolctl.threadpool_limits`` (which lists npattn
        as user_api ``"npattn"``: ``threadpool_limits(2, user_api="npattn")``
        caps npattn alone, ``threadpool_limits(1)`` npattn and its BLAS).
        Small calls run on the calling thread alone. The same inputs with
        the same ``threads`` give bitwise-identical results.

    Returns
    -------
    out : numpy.ndarray, shape (*B, H_q, L, D_v) or (L, D_v)
        ``B`` is the three batch shapes broadcast by NumPy's rules. The dtype
        is ``np.result_type(q, k, v)``, codes taking no part (``q``'s where
        ``k`` and ``v`` both hold codes). Rank 2 when all inputs are rank 2.
    lse : npattn.Lse, shape (*B, H_q, L) or (L,)
        Only with ``return_lse=True``, as the pair ``(out, lse)``: an
        ``np.ndarray`` subclass whose ``options`` hold the ``scale``,
        ``mask``, ``sinks``, ``window``, ``softcap``, ``q_offset``,
        ``k_offset``, ``k_start`` and ``k_lengths`` this call computed
        under (see :class:`Lse`).

    Raises
    ------
    TypeError
        An argument of the wrong kind: an integer, bool, complex, object or
        string array (``k`` and ``v`` may hold codes); a mask that is a
        number or an integer array; codes without their scale; a scale that
        is not float32, float16 or bfloat16.
    ValueError
        Shapes that disagree; a bad scale, mask string, window, softcap,
        offset, sinks, out or threads; a ``k_scale`` (or ``v_scale``,
        ``k_zero``, ``v_zero``) that does not broadcast, whose groups do not
        divide ``D``, that holds NaN or infinity, or that is given for
        floats; a zero point for fp8 codes.
    MemoryError
        Scratch memory could not be allocated.
    KeyboardInterrupt
        Ctrl-C stops a long call within half a second.

    Notes
    -----
    Shape legend: ``B`` batch dims, ``H_q`` query heads, ``H_kv`` key/value
    heads, ``L`` query rows, ``S`` key rows, ``D`` query/key width, ``D_v``
    value width. Query head ``h`` reads key/value head
    ``h // (H_q // H_kv)`` (contiguous groups, as MLX, PyTorch and
    llama.cpp).

    A row that sees no key comes out as zeros, never NaN. float32 computes in
    float32 (through ``sgemm``), float64 in double (``dgemm``); float16 and
    ``ml_dtypes.bfloat16`` in float32, rounded back to the input dtype. A
    float32 result is exact wherever it is representable: tiles that overflow
    are recomputed in double. The GIL is released while computing. MLX and
    PyTorch inputs give a NumPy result: ``mx.array(npattn.sdpa(q, k, v))``
    or ``torch.from_numpy(...)`` brings it back.

    Differences from peers (the README's table has them all):

    - MLX ``mx.fast.scaled_dot_product_attention``: no mask by default and a
      required scale; on the CPU a row that sees no key gives the mean of V
      (bool mask, or its ``"causal"`` with ``L > S``) or NaN (``-inf``
      mask); rank 4 only; float64 is float32-accurate; no window, softcap
      or lse.
    - PyTorch ``F.scaled_dot_product_attention``: no mask by default; its
      ``is_causal=True`` is ``"causal_top_left"``; no sinks, window, softcap
      or lse.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 8, 4, 64), dtype=np.float32)   # (B, H_q, L, D)
    >>> k = rng.standard_normal((1, 2, 6, 64), dtype=np.float32)   # (B, H_kv, S, D)
    >>> v = rng.standard_normal((1, 2, 6, 32), dtype=np.float32)   # (B, H_kv, S, D_v)
    >>> npattn.sdpa(q, k, v).shape
    (1, 8, 4, 32)
    >>> out, lse = npattn.sdpa(q, k, v, window=(2, 0), return_lse=True)
    >>> lse.shape
    (1, 8, 4)

    An int8 cache with a scale per token, read as stored:

    >>> kq, vq = npattn.quantize(k, "int8"), npattn.quantize(v, "int8")
    >>> kq.codes.dtype, kq.scale.shape
    (dtype('int8'), (1, 2, 6, 1))
    >>> out8 = npattn.sdpa(q, kq.codes, vq.codes, k_scale=kq.scale, v_scale=vq.scale)
    >>> bool(np.allclose(out8, npattn.sdpa(q, npattn.dequantize(*kq), npattn.dequantize(*vq)), atol=1e-6))
    True
    """
    result = _core.sdpa(
        q=q, k=k, v=v, scale=scale, mask=mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset,
        k_offset=k_offset, k_start=k_start, k_lengths=k_lengths, return_lse=return_lse, precision=precision,
        out=out, threads=threads, k_scale=k_scale, k_zero=k_zero, v_scale=v_scale, v_zero=v_zero,
    )  # fmt: skip
    if not return_lse:
        return result
    out, lse, used = result
    # the lse remembers the options the core computed under, for sdpa_backward to compare
    return out, Lse._made(lse, _record(mask, sinks, used))


PagedMask: TypeAlias = Literal["causal", "causal_top_left"] | None


@overload
def paged_attention(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    context_lens: Any,
    page_size: int | None = None,
    scale: Scale = None,
    mask: PagedMask = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: Literal[False] = False,
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray: ...
@overload
def paged_attention(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    context_lens: Any,
    page_size: int | None = None,
    scale: Scale = None,
    mask: PagedMask = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: Literal[True],
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
def paged_attention(
    q: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    context_lens: Any,
    page_size: int | None = None,
    scale: Scale = None,
    mask: PagedMask = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_zero: Any = None,
    v_zero: Any = None,
    return_lse: bool = False,
    precision: Precision = "highest",
    out: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention over a paged KV cache, reading the pages in place.

    A batch of requests, each with its own context, whose keys and values
    live in fixed-size physical pages that a block table maps (vLLM's paged
    attention; tiny-llm's week 3, in the same positional order). Equal to
    :func:`sdpa` on each request's gathered keys and values, to float32
    rounding; no dense copy is made: each tile of keys is read from its
    pages (a prefill tile that crosses pages is copied into tile-sized scratch).

    Parameters
    ----------
    q : array_like, shape (B, H_q, L, D)
        One block of ``L`` query rows per request (``L = 1``: a decode step;
        larger: a prefill chunk).
    key_pages : array_like, shape (P, H_kv, page_size, D)
        The physical pages of keys, any strides: a ``(P, page_size, H_kv,
        D)`` store passes as ``pages.transpose(0, 2, 1, 3)``, no copy made.
    value_pages : array_like, shape (P, H_kv, page_size, D_v)
        The value pages, laid out as the key pages.
    block_table : array_like of ints, shape (B, max_pages)
        Request ``b``'s logical page ``i`` is physical page
        ``block_table[b, i]``. Entries past a request's live pages (those
        holding its first ``context_lens[b]`` keys) are ignored, so ``-1``
        may pad them; two requests may share a page (a common prompt
        prefix). A live entry outside ``[0, P)`` is a ``ValueError`` naming
        ``block_table[b, i]`` and its value.
    context_lens : array_like of ints, shape (B,)
        Request ``b``'s number of keys, from 0 to ``max_pages * page_size``.
        Its logical key ``j`` is row ``j % page_size`` of page
        ``block_table[b, j // page_size]`` and sits at position ``j``.
    page_size : int, optional
        Rows per page; must equal ``key_pages.shape[2]``, its default.
    scale : float, optional
        As for :func:`sdpa`; ``None`` means ``1 / sqrt(D)``.
    mask : {"causal", "causal_top_left", None}, default "causal"
        ``"causal"``: query row ``i`` of request ``b`` sits at position
        ``q_offset[b] + i``, by default ``context_lens[b] - L`` (the
        bottom-right corner: a decode step sees all its keys, a prefill
        chunk the keys up to its own rows). ``"causal_top_left"``:
        ``q_offset = 0``. ``None``: every key of the request visible.
    sinks, window, softcap
        As for :func:`sdpa`, in the request's key positions.
    q_offset : int or array_like of ints, optional
        Position of query row 0, for every request or one per request
        (shape ``(B,)``).
    k_scale, v_scale, k_zero, v_zero : array_like, optional
        Where the pages hold 8-bit codes, their scales and zero points, as
        for :func:`sdpa`, paged like the pages: broadcastable to
        ``(P, H_kv, page_size, G)`` and read through the same block table
        (a scale per token is ``(P, H_kv, page_size, 1)``, one per tensor
        ``()``). Only the pages of the requests' live entries are read, and
        only their scales need be finite.
    return_lse, precision, out, threads
        As for :func:`sdpa`. The ``lse`` is a plain array: there is no
        backward pass through pages.

    Returns
    -------
    out : numpy.ndarray, shape (B, H_q, L, D_v)
        In ``np.result_type(q, key_pages, value_pages)``, codes taking no
        part. A row that sees no
        key (``context_lens[b] = 0``, or a causal row before the request's
        first key) is zeros.
    lse : numpy.ndarray, shape (B, H_q, L)
        With ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError, MemoryError, KeyboardInterrupt
        As :func:`sdpa`, each naming the argument and, for the tables, the
        request and the entry.

    Examples
    --------
    Two requests of 5 and 2 keys in pages of 4 rows:

    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> key_pages = rng.standard_normal((3, 1, 4, 8), dtype=np.float32)    # (P, H_kv, page_size, D)
    >>> value_pages = rng.standard_normal((3, 1, 4, 8), dtype=np.float32)
    >>> block_table = np.array([[2, 0], [1, -1]])     # request 1 uses one page
    >>> q = rng.standard_normal((2, 2, 1, 8), dtype=np.float32)            # (B, H_q, L, D)
    >>> out = npattn.paged_attention(q, key_pages, value_pages, block_table, [5, 2])
    >>> k0 = np.concatenate([key_pages[2], key_pages[0]], axis=1)[:, :5]  # request 0, gathered
    >>> v0 = np.concatenate([value_pages[2], value_pages[0]], axis=1)[:, :5]
    >>> bool(np.allclose(out[0], npattn.sdpa(q[0], k0, v0), atol=1e-6))
    True
    """
    return _core.paged_attention(
        q=q, k=key_pages, v=value_pages, block_table=block_table, context_lens=context_lens, page_size=page_size,
        scale=scale, mask=mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset,
        return_lse=return_lse, precision=precision, out=out, threads=threads, k_scale=k_scale, k_zero=k_zero,
        v_scale=v_scale, v_zero=v_zero,
    )  # fmt: skip


def attention_weights(
    q: Any,
    k: Any,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    k_scale: Any = None,
    k_zero: Any = None,
    precision: Precision = "highest",
    threads: int | None = None,
) -> np.ndarray:
    """The attention probabilities ``softmax(s + mask)``, for plotting and teaching.

    The same scores as :func:`sdpa` with the same arguments, so that
    ``attention_weights(q, k) @ v`` matches ``sdpa(q, k, v)`` when
    ``H_q == H_kv``.

    Parameters
    ----------
    q, k, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, precision, threads
        As for :func:`sdpa`. Keys outside a request's range get weight 0.
    k_scale, k_zero : array_like, optional
        As for :func:`sdpa`, where ``k`` holds 8-bit codes.

    Returns
    -------
    numpy.ndarray, shape (*B, H_q, L, S) or (L, S)
        In the dtype ``sdpa`` would give, ``np.result_type(q, k)``. A row
        that sees no key is all zeros; with sinks a row sums to less than 1.
        The memory is the result itself: ``L * S`` per head.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> q = np.ones((2, 4), np.float32); k = np.ones((3, 4), np.float32)
    >>> npattn.attention_weights(q, k)
    array([[0.5       , 0.5       , 0.        ],
           [0.33333334, 0.33333334, 0.33333334]], dtype=float32)
    """
    return _core.attention_weights(
        q=q, k=k, scale=scale, mask=mask, sinks=sinks, window=window, softcap=softcap, q_offset=q_offset,
        k_offset=k_offset, k_start=k_start, k_lengths=k_lengths, precision=precision, threads=threads,
        k_scale=k_scale, k_zero=k_zero,
    )  # fmt: skip


def merge(outs: Sequence[Any], lses: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Combines partial results of the same queries over disjoint key sets, exactly.

    ``lse = logaddexp`` of the parts, ``out = sum(exp(lse_i - lse) * out_i)``:
    merging the parts of a split equals the unsplit call to float32
    rounding. Rows that see no key in any part give zeros and ``-inf``.

    Parameters
    ----------
    outs : sequence of array_like, each shape (*B, H_q, L, D_v)
        Results of :func:`sdpa` with ``return_lse=True`` over key sets that
        do not overlap (give ``sinks`` to one part only).
    lses : sequence of array_like, each shape (*B, H_q, L)
        Their ``lse``, in the same order.

    Returns
    -------
    (out, lse)
        ``out`` in the parts' result dtype, ``lse`` float64 if the parts are
        float64, else float32.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 8, 16)) for _ in range(3))
    >>> a = npattn.sdpa(q, k[..., :5, :], v[..., :5, :], q_offset=0, return_lse=True)
    >>> b = npattn.sdpa(q, k[..., 5:, :], v[..., 5:, :], q_offset=0, k_offset=5, return_lse=True)
    >>> out, lse = npattn.merge([a[0], b[0]], [a[1], b[1]])
    >>> bool(np.allclose(out, npattn.sdpa(q, k, v, mask="causal_top_left")))
    True
    """
    fn = "merge"
    if isinstance(outs, (str, bytes)) or isinstance(lses, (str, bytes)):
        raise TypeError(f"{fn}: outs and lses must be sequences of arrays")
    try:
        outs, lses = list(outs), list(lses)
    except TypeError:
        raise TypeError(f"{fn}: outs and lses must be sequences of arrays, got {type(outs).__name__}") from None
    if not outs or len(outs) != len(lses):
        raise ValueError(f"{fn}: outs and lses must be equally long, at least 1; got {len(outs)} and {len(lses)}")
    outs = [_args.asarray(fn, o, f"outs[{i}]") for i, o in enumerate(outs)]
    lses = [_args.asarray(fn, x, f"lses[{i}]") for i, x in enumerate(lses)]
    for name, parts in (("outs", outs), ("lses", lses)):
        for i, a in enumerate(parts):
            if not _args.is_float(a.dtype):
                raise TypeError(f"{fn}: {name}[{i}] must be an array of floats, got dtype {a.dtype}")
            if a.shape != parts[0].shape:
                raise ValueError(
                    f"{fn}: every part must have the same shape; {name}[0] {_args.shape_str(parts[0])}, "
                    f"{name}[{i}] {_args.shape_str(a)}"
                )
    if outs[0].ndim < 1 or outs[0].shape[:-1] != lses[0].shape:
        raise ValueError(
            f"{fn}: lse must have out's shape without its last axis; "
            f"got outs[0] {_args.shape_str(outs[0])}, lses[0] {_args.shape_str(lses[0])}"
        )
    dtype = _args.result_dtype(*(o.dtype for o in outs))
    wide = np.float64 if dtype == np.float64 else np.float32
    lse_all = np.stack([np.asarray(x, np.float64) for x in lses])  # (n, *B, H_q, L)
    with np.errstate(invalid="ignore", over="ignore"):
        top = lse_all.max(axis=0)
        shift = np.where(np.isfinite(top), top, 0.0)  # rows seen by no part: -inf
        weights = np.exp(lse_all - shift)  # 0 for a part that saw nothing
        total = weights.sum(axis=0)
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        lse = np.where(np.isnan(top), np.nan, lse)
        share = weights / np.where(total > 0, total, 1.0)
        out = sum(share[i][..., None] * np.asarray(o, np.float64) for i, o in enumerate(outs))
    return out.astype(dtype), lse.astype(wide)


class Lse(np.ndarray):
    """The ``lse`` that :func:`sdpa` returns with ``return_lse=True``: a NumPy
    array that remembers the options it was computed under.

    ``lse.options`` is a read-only mapping of the options the core computed
    under, its defaults resolved: ``scale`` (a float: ``1 / sqrt(D)`` for
    None), ``mask`` and ``sinks`` as given, ``window`` (``(left, right)``,
    None where unbounded), ``softcap`` (a float, or None), ``k_offset``, and
    each request's ``q_offset``, ``k_start`` and ``k_lengths``: ints where no
    request has its own, else read-only int64 copies of the batch shape ``B``
    (so a lengths buffer that the caller advances afterwards is not seen
    through). :func:`sdpa_backward` resolves its own options the same way and
    refuses any that differ, before computing, so that a forgotten ``mask=``
    cannot give the gradients of another problem. In every other respect it
    is the plain array: arithmetic on it gives plain arrays, and whatever is
    made from it (a slice, a copy, ``np.asarray(lse)``, an array read back
    from a file) has ``options`` None, which ``sdpa_backward`` accepts without
    comparing, as before.
    """

    options: Mapping[str, Any] | None = None

    @classmethod
    def _made(cls, lse: np.ndarray, options: dict[str, Any]) -> Lse:
        made = lse.view(cls)
        made.options = types.MappingProxyType(options)
        return made

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        # computed as on the plain arrays, so that a result carries no record
        def plain(x: Any) -> Any:
            return x.view(np.ndarray) if isinstance(x, Lse) else x

        if "out" in kwargs:
            kwargs["out"] = tuple(plain(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*(plain(x) for x in inputs), **kwargs)


# The options an lse records, in the order they are compared: a request's
# positions last, k_lengths before the q_offset whose default it moves.
_RECORDED = ("scale", "mask", "sinks", "window", "softcap", "k_offset", "k_start", "k_lengths", "q_offset")


def _record(mask: Any, sinks: Any, used: dict[str, Any]) -> dict[str, Any]:
    """The options an lse records: mask and sinks as given, the rest as the core used them."""
    record = {"scale": used["scale"], "mask": mask, "sinks": sinks}
    record.update((name, used[name]) for name in ("window", "softcap", "q_offset", "k_offset", "k_start", "k_lengths"))
    return record


def _same_array_option(given: Any, made: Any) -> bool:
    """A mask or sinks: the same string or None, or arrays of equal values (a bool
    mask equals the additive mask that hides the same keys)."""
    if given is None or made is None or isinstance(given, str) or isinstance(made, str):
        return type(given) is type(made) and given == made
    try:
        a, b = (_interop.asarray(x) for x in (given, made))
        shape = np.broadcast_shapes(a.shape, b.shape)
        if a.dtype.kind == b.dtype.kind == "b":
            return bool(np.array_equal(np.broadcast_to(a, shape), np.broadcast_to(b, shape)))
        a, b = (np.where(x, 0.0, -np.inf) if x.dtype.kind == "b" else np.asarray(x, np.float64) for x in (a, b))
        return bool(np.array_equal(np.broadcast_to(a, shape), np.broadcast_to(b, shape), equal_nan=True))
    except Exception:  # not arrays of numbers: the glue names what is wrong
        return False


def _described(x: Any) -> str:
    if x is None or isinstance(x, (str, int, float, tuple)):
        return repr(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)[:60]


def _disagreement(name: str, given: Any, now: Any, was: Any) -> str | None:
    """Why option `name`, given as `given` and used as `now`, is not what the lse
    was computed under (`was`); None where they agree. Resolved values are compared:
    floats to a relative 1e-12 (scale=None is 1 / sqrt(D), however it is written),
    a request's ints once broadcast to the batch shape."""
    if name in ("mask", "sinks"):
        if _same_array_option(given, was):
            return None
        now, was = _described(given), _described(was)
        if now == was:
            now += " of other values"
        return f"{name} is {now}, but lse was computed by sdpa with {name}={was}"
    if isinstance(now, np.ndarray) or isinstance(was, np.ndarray):
        now, was = np.broadcast_arrays(now, was)
        differ = np.flatnonzero(now != was)
        if differ.size == 0:
            return None
        at = np.unravel_index(differ[0], now.shape)
        index = f"[{', '.join(str(int(i)) for i in at)}]" if at else ""
        return (
            f"{name} is {_described(given)}, so {name}{index} = {now[at]}, "
            f"but lse was computed by sdpa with {name}{index} = {was[at]}"
        )
    if isinstance(now, float) and isinstance(was, float) and math.isclose(now, was, rel_tol=1e-12):
        return None
    if now == was:
        return None
    shown = _described(given) if given is None or given == now else f"{_described(given)} ({now!r})"
    return f"{name} is {shown}, but lse was computed by sdpa with {name}={was!r}"


def _check_options_agree(made: Mapping[str, Any], given: dict[str, Any], used: dict[str, Any]) -> None:
    """sdpa_backward's options, as given and as the core resolved them (`used`),
    against those its lse was computed under (`made`): a ValueError naming the first
    that differs. Called by the glue once it has read every argument, before computing."""
    for name in _RECORDED:
        if name not in made:
            continue
        why = _disagreement(name, given[name], used.get(name, given[name]), made[name])
        if why is not None:
            raise ValueError(f"sdpa_backward: {why}; pass sdpa_backward the options sdpa was given")


class Grads(NamedTuple):
    """The gradients :func:`sdpa_backward` returns, each of its operand's shape and dtype."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None  # (H_q,), float32 (float64 for float64 inputs); None without sinks


class _FromSdpa:
    """The default of sdpa_backward's ``lse``, which has none: it comes from the forward call."""

    def __repr__(self) -> str:
        return "<from sdpa(..., return_lse=True)>"


_FROM_SDPA: Any = _FromSdpa()


def _missing_lse(out: Any) -> str:
    """What to say when sdpa_backward is called without an lse."""
    said = (
        "sdpa_backward: lse is missing: the backward pass needs the forward call's log-sum-exp, which sdpa "
        "returns with return_lse=True: out, lse = npattn.sdpa(q, k, v, ..., return_lse=True), then "
        "sdpa_backward(dout, q, k, v, out, lse, ...)"
    )
    if isinstance(out, tuple) and len(out) == 2:
        said += "; out here is that pair: pass its two parts, sdpa_backward(dout, q, k, v, *result, ...)"
    return said


def sdpa_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any = _FROM_SDPA,
    scale: Scale = None,
    mask: MaskLike = "causal",
    *,
    sinks: Any = None,
    window: Window = None,
    softcap: float | None = None,
    q_offset: Any = None,
    k_offset: int = 0,
    k_start: Any = None,
    k_lengths: Any = None,
    precision: Precision = "highest",
    threads: int | None = None,
) -> Grads:
    """The gradients of ``sum(dout * sdpa(q, k, v, ...))``: the backward pass.

    FlashAttention-2's backward (arXiv:2307.08691): each tile recomputes its
    probabilities from the saved ``lse``, so memory stays O(tile), never
    ``L * S``. Call :func:`sdpa` with ``return_lse=True`` first, and give this
    function the same options: the ``lse`` sdpa returns remembers them
    (``lse.options``), and an option given here that differs from it is a
    ValueError naming that option, raised before anything is computed, so
    that a forgotten ``mask=`` (sdpa's ``mask=None``, the default
    ``"causal"`` here) cannot give the gradients of another problem. Options
    are compared as the core resolves them, so equal values count as the
    same option (an equal array, ``scale=None`` and ``1 / sqrt(D)``, a
    request's default ``q_offset`` and the same value written out), while a
    default that resolves otherwise does not (with ``k_lengths``, the
    default ``q_offset`` is each request's ``k_offset + k_lengths[b] - L``,
    not ``S - L``), and a ``k_lengths`` buffer changed in place since the
    forward call is refused. An ``lse`` that does not remember (a plain
    array: one read from a file, a slice, ``np.asarray(lse)``) is taken as
    it is, unchecked.

    Parameters
    ----------
    dout : array_like, shape (*B, H_q, L, D_v)
        The gradient of the loss with respect to the output.
    q, k, v : array_like
        As given to :func:`sdpa`.
    out, lse : array_like
        What ``sdpa(q, k, v, ..., return_lse=True)`` returned. ``lse`` has no
        default: a call without it is a ``TypeError`` that says where it comes from.
    scale, mask, sinks, window, softcap, q_offset, k_offset, precision, threads
        As given to :func:`sdpa`. The mask gets no gradient.
    k_start, k_lengths
        As given to :func:`sdpa`. Key rows a request does not read get a
        gradient of exactly 0 and are never read here either.

    Returns
    -------
    Grads
        ``(dq, dk, dv, dsinks)``: ``dq``, ``dk``, ``dv`` of the shapes and
        dtypes of ``q``, ``k``, ``v`` (a key/value head sums its group's
        gradients, and batch dims an operand was broadcast along are summed
        back, as autograd does); ``dsinks`` of shape ``(H_q,)``, float32
        (float64 for float64 inputs), or None without sinks.

    Raises
    ------
    TypeError
        ``k`` or ``v`` holding codes: there is no gradient through codes
        (compute it for ``npattn.dequantize(codes, scale, zero)``), and
        every TypeError of :func:`sdpa`.
    ValueError
        An option that differs from the one ``lse`` was computed under, and
        every error of :func:`sdpa`.

    Notes
    -----
    float32, float64 (in double) and float16/bfloat16 (in float32 tiles) as
    the forward pass. The same ``threads`` gives bitwise-identical gradients:
    each task owns the key/value head it writes. An operand broadcast along
    batch dims gets its gradient summed in place at its own shape, so ``k``
    and ``v`` shared by a batch cost no more memory than one entry's.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    >>> out, lse = npattn.sdpa(q, k, v, return_lse=True)
    >>> grads = npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse)
    >>> grads.dq.shape, grads.dsinks
    ((1, 2, 4, 8), None)
    >>> out, lse = npattn.sdpa(q, k, v, mask=None, return_lse=True)
    >>> npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse)  # mask=None forgotten  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: sdpa_backward: mask is 'causal', but lse was computed by sdpa with mask=None; ...
    """
    if lse is _FROM_SDPA or lse is None:
        raise TypeError(_missing_lse(out))
    made = lse.options if isinstance(lse, Lse) else None
    given = {"scale": scale, "mask": mask, "sinks": sinks, "window": window, "softcap": softcap,
             "q_offset": q_offset, "k_offset": k_offset, "k_start": k_start, "k_lengths": k_lengths}  # fmt: skip
    # the glue calls it once each argument is read (a bad one gets its own error first), before computing
    agree = None if made is None else functools.partial(_check_options_agree, made, given)
    dq, dk, dv, dsinks, operands = _core.sdpa_backward(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, scale=scale, mask=mask, sinks=sinks, window=window,
        softcap=softcap, q_offset=q_offset, k_offset=k_offset, k_start=k_start, k_lengths=k_lengths,
        precision=precision, threads=threads, agree=agree,
    )  # fmt: skip
    grads = []
    for full, own, given in zip((dq, dk, dv), operands, (q, k, v)):
        # each operand's own dtype: a byte-swapped array's gradient keeps its byte order
        dtype = given.dtype if isinstance(given, np.ndarray) else own.dtype
        # the core summed dk and dv (and dq, mostly) over the broadcast dims already
        g = full.reshape(own.shape) if full.size == own.size else _args.unbroadcast(full, own.shape)
        with np.errstate(over="ignore"):  # a gradient beyond a half dtype's range is inf, as sdpa's results
            grads.append(g.astype(dtype, copy=False))
    if dsinks is not None:
        dsinks = dsinks.sum(axis=0).astype(np.float64 if dq.dtype == np.float64 else np.float32)
    return Grads(grads[0], grads[1], grads[2], dsinks)


@overload
def causal_mask(L: int, S: int, dtype: DTypeLike = np.float32) -> np.ndarray: ...
@overload
def causal_mask(L: int, S: int, dtype: Any) -> Any: ...  # MLX's or PyTorch's dtype: its array


def causal_mask(L: int, S: int, dtype: Any = np.float32) -> Any:
    """The ``(L, S)`` causal mask of the tutorial, in the library of ``dtype``: query
    ``i`` sees key ``j`` iff ``j <= i + (S - L)`` (aligned to the bottom-right corner).

    Parameters
    ----------
    L, S : int
        Query rows and keys.
    dtype : dtype, default numpy.float32
        NumPy's (``bool`` included), MLX's (``mx.float32``, ``mx.bool_``...)
        or PyTorch's (``torch.float16``...). A float dtype gives the additive
        mask, 0 where the key is visible and ``-inf`` elsewhere; a bool dtype
        ``True`` where it is visible, as every bool mask in npattn reads.
        Either, passed as ``sdpa(..., mask=causal_mask(L, S, dtype))``, equals
        ``mask="causal"``.

    Returns
    -------
    numpy.ndarray, mx.array or torch.Tensor, shape (L, S)
        Of ``dtype``, as its library holds it: an ``mx.array`` for an MLX
        dtype, a ``torch.Tensor`` for a PyTorch one, else a NumPy array
        (:func:`npattn.reference.causal_mask` always gives the NumPy array).

    Raises
    ------
    TypeError
        ``dtype`` is not a float or bool dtype (an integer dtype cannot hold
        ``-inf``).

    Examples
    --------
    >>> import numpy as np, npattn
    >>> npattn.causal_mask(2, 4)
    array([[  0.,   0.,   0., -inf],
           [  0.,   0.,   0.,   0.]], dtype=float32)
    >>> npattn.causal_mask(2, 4, bool)
    array([[ True,  True,  True, False],
           [ True,  True,  True,  True]])
    """
    return _interop.like_dtype(reference.causal_mask(L, S, dtype), dtype)

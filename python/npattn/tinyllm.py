"""The attention ops of tiny-llm, the course, computed by npattn on a CPU.

The course (skyzh/tiny-llm) builds Qwen3 on MLX. Its week-1 attention is
plain MLX; its week-2 and week-3 kernels live in the course's C++/Metal
extension, ``tiny_llm_ext``, whose CPU path raises "the course extension is
GPU-only". This module has each of them with the course's name, signature,
shapes and checks, taking and returning ``mx.array`` (NumPy arrays are taken
too), computed by :func:`npattn.sdpa` and :func:`npattn.paged_attention`:

- week 1, ``src/tiny_llm/attention.py``: :func:`scaled_dot_product_attention_simple`,
  :func:`causal_mask`, :func:`scaled_dot_product_attention_grouped`;
- week 2, ``src/tiny_llm/week2_kernels.py``: :func:`scaled_dot_product_attention`
  and :func:`decode_attention_custom`, the decode attention (bfloat16 in, bfloat16 out);
- week 3, ``src/tiny_llm/attention.py``: :func:`paged_attention`;
- the extension's three attention ops, with its flattened shapes:
  ``ext.decode_attention``, ``ext.paged_attention`` and ``ext.paged_cache_update``
  (:class:`Extension`). ``from npattn.tinyllm import ext as tiny_llm_ext`` stands
  in for ``from extensions import tiny_llm_ext``.

Half-precision inputs are read as stored and the result is correctly rounded
from a float32 computation (the course's kernels accumulate in float32 too). A
query row that sees no key is zeros (the course's kernels give NaN there). A
rule of the course broken is the ``ValueError`` (or ``NotImplementedError``) its
Python raises, with the course's words in the message, where its C++ raises a
``RuntimeError``. Everything runs eagerly, on the CPU, whatever MLX stream is
current.
"""

from __future__ import annotations

from typing import Any

try:
    import mlx.core as mx
except ImportError as e:  # the optional extra is missing
    raise ModuleNotFoundError(
        "npattn.tinyllm needs MLX (the package 'mlx'), which is not installed: pip install mlx (Linux: \"mlx[cpu]\")",
        name="mlx",
    ) from e

import numpy as np

import npattn

from . import _interop

__all__ = [
    "scaled_dot_product_attention_simple",
    "causal_mask",
    "scaled_dot_product_attention_grouped",
    "scaled_dot_product_attention",
    "decode_attention_custom",
    "paged_attention",
    "Extension",
    "ext",
]

HALF_AND_SINGLE = ("float32", "float16", "bfloat16")  # the dtypes of the course's decode kernel
PAGED_DTYPES = ("float32", "bfloat16")  # the dtypes of its paged kernels


def _numpy(fn: str, name: str, x: Any) -> np.ndarray:
    """An operand as a NumPy array (an mx.array read in place where its layout allows)."""
    if x is None or isinstance(x, str):
        raise TypeError(f"{fn}: {name} must be an array, got {x!r}")
    return _interop.asarray(x, f"{fn}: {name}")


def _shapes(**arrays: np.ndarray) -> str:
    return ", ".join(f"{name} {tuple(a.shape)}" for name, a in arrays.items())


def _result(out: np.ndarray, shape: tuple[int, ...] | None = None) -> Any:
    """npattn's NumPy result as an mx.array, in the shape the course's op returns."""
    return _interop.to_mlx(out if shape is None else out.reshape(shape))


# ---- week 1: src/tiny_llm/attention.py ----


def scaled_dot_product_attention_simple(
    query: Any, key: Any, value: Any, scale: Any = None, mask: Any = None
) -> mx.array:
    """Week 1, day 1: ``softmax(scale * query @ key^T + mask) @ value``, one head per batch entry.

    Parameters
    ----------
    query : mx.array, shape (..., L, D)
        Any number of leading batch dims (or none).
    key : mx.array, shape (..., S, D)
    value : mx.array, shape (..., S, D_v)
    scale : float or mx.array, optional
        ``1 / sqrt(D)`` by default.
    mask : mx.array, optional
        Added to the scaled scores; broadcastable to ``(..., L, S)``; ``-inf``
        hides a key. The course's day 1 takes no mask strings: the causal mask
        comes on day 3 (:func:`causal_mask`, :func:`scaled_dot_product_attention_grouped`).

    Returns
    -------
    mx.array, shape (..., L, D_v)
        In the inputs' dtype.

    Examples
    --------
    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> q = mx.random.uniform(shape=(2, 4, 5)); k = mx.random.uniform(shape=(2, 4, 5))
    >>> tinyllm.scaled_dot_product_attention_simple(q, k, k).shape
    (2, 4, 5)
    """
    fn = "tinyllm.scaled_dot_product_attention_simple"
    q, k, v = (_numpy(fn, name, x) for name, x in (("query", query), ("key", key), ("value", value)))
    if mask is not None:
        mask = _numpy(fn, "mask", mask)  # a string too is refused: day 1 adds the mask to the scores
    return _result(npattn.sdpa(q, k, v, scale, mask))


def causal_mask(L: int, S: int, dtype: Any) -> mx.array:
    """Week 1, day 3: the ``(L, S)`` causal mask, 0 where query ``i`` sees key ``j``
    (``j <= i + S - L``: the bottom-right corner) and ``-inf`` elsewhere.

    ``dtype`` is MLX's (``mx.float32``, ``mx.bfloat16``...) or NumPy's; the result
    is an ``mx.array`` either way (see :func:`npattn.causal_mask`).

    Examples
    --------
    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> tinyllm.causal_mask(2, 3, mx.float32)
    array([[0, 0, -inf],
           [0, 0, 0]], dtype=float32)
    """
    return _result(npattn.reference.causal_mask(L, S, dtype))


def scaled_dot_product_attention_grouped(
    query: Any, key: Any, value: Any, scale: Any = None, mask: Any = None
) -> mx.array:
    """Week 1, day 3: attention with grouped-query attention (GQA).

    Parameters
    ----------
    query : mx.array, shape (..., H_q, L, D)
    key : mx.array, shape (..., H, S, D)
        ``H_q`` a multiple of ``H``: query head ``h`` reads key/value head
        ``h // (H_q // H)``.
    value : mx.array, shape (..., H, S, D_v)
    scale : float or mx.array, optional
        ``1 / sqrt(D)`` by default.
    mask : {None, "causal"} or mx.array, optional
        ``None``: every key visible. ``"causal"``: :func:`causal_mask`, for
        which the course asks ``S >= L``. An array broadcastable to
        ``(..., H_q, L, S)``, added to the scaled scores.

    Returns
    -------
    mx.array, shape (..., H_q, L, D_v)
        In the inputs' dtype.

    Raises
    ------
    ValueError
        A mask string other than ``"causal"``; ``"causal"`` with ``L > S``
        ("causal attention requires S >= L"); operands of fewer than 3 dims.

    Examples
    --------
    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> q = mx.random.uniform(shape=(18, 3, 5)); k = mx.random.uniform(shape=(6, 7, 5))
    >>> tinyllm.scaled_dot_product_attention_grouped(q, k, k, mask="causal").shape
    (18, 3, 5)
    """
    fn = "tinyllm.scaled_dot_product_attention_grouped"
    q, k, v = (_numpy(fn, name, x) for name, x in (("query", query), ("key", key), ("value", value)))
    if min(q.ndim, k.ndim, v.ndim) < 3:
        shapes = _shapes(query=q, key=k, value=v)
        raise ValueError(f"{fn}: query, key and value must have a head axis, (..., H, L, D); got {shapes}")
    L, S = q.shape[-2], k.shape[-2]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f'{fn}: mask must be None, "causal" or an array, got {mask!r}')
        if L > S:
            raise ValueError(f"{fn}: causal attention requires S >= L (mask='causal'), got L = {L}, S = {S}")
    elif mask is not None:
        mask = _numpy(fn, "mask", mask)
    return _result(npattn.sdpa(q, k, v, scale, mask))


# ---- week 2: src/tiny_llm/week2_kernels.py ----


def _week2_operands(fn: str, query: Any, key: Any, value: Any, mask: Any) -> tuple[np.ndarray, ...]:
    """q, k, v of week 2's attention, checked as the course checks them."""
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f'{fn}: unsupported attention mask: {mask!r} (None, "causal" or an array)')
    q, k, v = (_numpy(fn, name, x) for name, x in (("query", query), ("key", key), ("value", value)))
    H_q, H_kv = q.shape[-3] if q.ndim >= 3 else 0, k.shape[-3] if k.ndim >= 3 else 0
    if min(q.ndim, k.ndim) < 3 or k.shape != v.shape or H_kv == 0 or H_q % H_kv:
        raise ValueError(
            f"{fn}: incompatible grouped-query attention shapes: key and value of one shape (..., H_kv, S, D) "
            f"and H_q a multiple of H_kv; got {_shapes(query=q, key=k, value=v)}"
        )
    return q, k, v


def scaled_dot_product_attention(query: Any, key: Any, value: Any, scale: Any, mask: Any = None) -> mx.array:
    """Week 2, day 5: the readable attention that the decode kernel is checked against.

    Parameters
    ----------
    query : mx.array, shape (B, H_q, L, D)
        bfloat16 in the course's week 2 (any float dtype here); any number
        of batch dims.
    key, value : mx.array, shape (B, H_kv, S, D)
        Of one shape; ``H_q`` a multiple of ``H_kv``.
    scale : float
        Required, as in the course.
    mask : {None, "causal"} or mx.array, optional
        ``"causal"``: bottom-right (query ``i`` sees key ``j <= i + S - L``);
        an array broadcastable to ``(B, H_q, L, S)`` is added to the scores.

    Returns
    -------
    mx.array, shape (B, H_q, L, D)
        In the inputs' dtype: bfloat16 for the course's bfloat16 model.

    Raises
    ------
    ValueError
        "unsupported attention mask" for a mask string other than ``"causal"``;
        "incompatible grouped-query attention shapes".

    Examples
    --------
    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> q = mx.random.normal((1, 4, 1, 16)).astype(mx.bfloat16)
    >>> k = mx.random.normal((1, 2, 9, 16)).astype(mx.bfloat16)
    >>> tinyllm.scaled_dot_product_attention(q, k, k, 0.25, "causal").dtype
    mlx.core.bfloat16
    """
    fn = "tinyllm.scaled_dot_product_attention"
    q, k, v = _week2_operands(fn, query, key, value, mask)
    if mask is not None and not isinstance(mask, str):
        mask = _numpy(fn, "mask", mask)
    return _result(npattn.sdpa(q, k, v, scale, mask))


def decode_attention_custom(query: Any, key: Any, value: Any, scale: Any, mask: Any = None) -> mx.array:
    """Week 2, day 5: :func:`scaled_dot_product_attention` through the extension's
    ``decode_attention`` (:meth:`Extension.decode_attention`), as the course wires it:
    batch and heads flattened, an array mask broadcast to ``(B * H_q, L, S)`` in
    float32, ``"causal"`` passed as a flag.

    Parameters
    ----------
    query : mx.array, shape (B, H_q, L, D)
    key, value : mx.array, shape (B, H_kv, S, D)
        The same batch ``B`` as ``query``; one shape.
    scale : float
    mask : {None, "causal"} or mx.array, optional

    Returns
    -------
    mx.array, shape (B, H_q, L, D)

    Examples
    --------
    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> q = mx.random.normal((1, 4, 1, 128)).astype(mx.bfloat16)
    >>> k = mx.random.normal((1, 1, 31, 128)).astype(mx.bfloat16)
    >>> tinyllm.decode_attention_custom(q, k, k, 128**-0.5, "causal").shape
    (1, 4, 1, 128)
    """
    fn = "tinyllm.decode_attention_custom"
    q, k, v = _week2_operands(fn, query, key, value, mask)
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{fn}: query, key, and value batch dimensions must match: query (B, H_q, L, D), key and value "
            f"(B, H_kv, S, D); got {_shapes(query=q, key=k, value=v)}"
        )
    B, H_q, L, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    is_causal = isinstance(mask, str)
    has_mask = mask is not None and not is_causal
    if has_mask:
        flat_mask = np.broadcast_to(_numpy(fn, "mask", mask), (B, H_q, L, S)).astype(np.float32)
        flat_mask = flat_mask.reshape(B * H_q, L, S)
    else:
        flat_mask = np.zeros(1, np.float32)  # the course's placeholder: no mask
    out = Extension.decode_attention(
        q.reshape(B * H_q, L, D), k.reshape(B * H_kv, S, D), v.reshape(B * H_kv, S, D), flat_mask, scale,
        is_causal, has_mask, H_q, H_kv,
    )  # fmt: skip
    return out.reshape(B, H_q, L, D)


# ---- week 3: src/tiny_llm/attention.py ----


def paged_attention(
    query: Any,
    key_pages: Any,
    value_pages: Any,
    block_table: Any,
    context_lens: Any,
    page_size: int,
    scale: Any = None,
    mask: Any = None,
) -> mx.array:
    """Week 3: attention over a paged KV cache, with the course's checks of its tables.

    Parameters
    ----------
    query : mx.array, shape (B, H_q, L, D)
        float32 or bfloat16, the pages' dtype.
    key_pages, value_pages : mx.array, shape (P, H_kv, page_size, D)
        The physical pages, of one shape.
    block_table : mx.array of int32, shape (B, max_pages)
        Request ``b``'s logical page ``i`` is physical page
        ``block_table[b, i]``. Its live pages (the first
        ``ceil(context_lens[b] / page_size)``) are pages of ``key_pages``,
        none used twice in the batch; every entry past them is ``-1``.
    context_lens : mx.array of int32, shape (B,)
        Request ``b``'s number of keys: 0 (a free slot of the batch, whose
        rows come out as zeros) or at least ``L``.
    page_size : int
        Rows per page; ``key_pages.shape[2]``.
    scale : float, optional
        ``1 / sqrt(D)`` by default.
    mask : {None, "causal"}, optional
        ``"causal"``: query row ``i`` of request ``b`` sits at position
        ``context_lens[b] - L + i``.

    Returns
    -------
    mx.array, shape (B, H_q, L, D)

    Raises
    ------
    NotImplementedError
        An array mask, or a mask string other than ``"causal"``, as in the course.
    ValueError
        Each rule above, with the course's words: "must be int32", "must use
        the -1 sentinel", "is aliased", "is outside physical page storage",
        "is not covered by block_table", "must be zero or at least query
        length", "does not match page storage"...

    Examples
    --------
    Two requests of 5 and 2 keys in pages of 4 rows; request 1's second entry is unused:

    >>> import mlx.core as mx
    >>> from npattn import tinyllm
    >>> pages = mx.random.normal((3, 1, 4, 8))
    >>> table = mx.array([[2, 0], [1, -1]], dtype=mx.int32)
    >>> lengths = mx.array([5, 2], dtype=mx.int32)
    >>> q = mx.random.normal((2, 2, 1, 8))
    >>> tinyllm.paged_attention(q, pages, pages, table, lengths, 4, mask="causal").shape
    (2, 2, 1, 8)
    """
    fn = "tinyllm.paged_attention"
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise NotImplementedError(f"{fn}: Paged attention only supports mask=None or causal, got {mask!r}")
    q, kp, vp, table, lens = (
        _numpy(fn, name, x)
        for name, x in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages),
                        ("block_table", block_table), ("context_lens", context_lens))
    )  # fmt: skip
    if q.ndim != 4:
        raise ValueError(f"{fn}: query must be 4D [B, H_q, L, D], got {q.shape}")
    if kp.ndim != 4 or vp.shape != kp.shape:
        raise ValueError(
            f"{fn}: key pages and value pages must be 4D [P, H_kv, page_size, D] of the same shape; "
            f"got {_shapes(key_pages=kp, value_pages=vp)}"
        )
    if table.ndim != 2 or lens.ndim != 1:
        shapes = _shapes(block_table=table, context_lens=lens)
        raise ValueError(f"{fn}: block_table must be 2D and context_lens must be 1D; got {shapes}")
    for name, x in (("block_table", table), ("context_lens", lens)):
        if x.dtype != np.int32:
            raise ValueError(f"{fn}: block_table and context_lens must be int32; {name} is {x.dtype}")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise ValueError(f"{fn}: page_size must be a positive integer, got {page_size!r}")
    B, H_q, L, D = q.shape
    P, H_kv, stored_page_size, stored_dim = kp.shape
    if min(B, H_q, L, D, H_kv, stored_page_size, stored_dim) <= 0 or P <= 0:
        raise ValueError(f"{fn}: paged attention dimensions must be positive; got {_shapes(query=q, key_pages=kp)}")
    if H_q % H_kv:
        raise ValueError(f"{fn}: query heads must be divisible by K/V heads; got H_q = {H_q}, H_kv = {H_kv}")
    if stored_dim != D:
        raise ValueError(f"{fn}: query and page tensors must have the same head dimension; got {D} and {stored_dim}")
    if stored_page_size != page_size:
        raise ValueError(f"{fn}: page_size={page_size} does not match page storage {stored_page_size}")
    if table.shape[0] != B or lens.shape[0] != B:
        shapes = _shapes(query=q, block_table=table, context_lens=lens)
        raise ValueError(f"{fn}: query, block_table, and context_lens batch sizes must match; got {shapes}")
    if table.shape[1] == 0:
        raise ValueError(f"{fn}: block_table must provide at least one page slot, got {table.shape}")
    if not q.dtype == kp.dtype == vp.dtype or q.dtype.name not in PAGED_DTYPES:
        raise ValueError(
            f"{fn}: query, key pages, and value pages must have the same dtype, float32 or bfloat16; "
            f"got {q.dtype}, {kp.dtype}, {vp.dtype}"
        )
    _check_tables(fn, table, lens, L, page_size, P)
    factor = D**-0.5 if scale is None else float(scale)
    out = Extension.paged_attention(
        q.reshape(B * H_q, L, D), kp, vp, table, lens, factor, is_causal=mask == "causal", num_kv_heads=H_kv,
        num_heads=H_q,
    )  # fmt: skip
    return out.reshape(B, H_q, L, D)


def _check_tables(fn: str, table: np.ndarray, lens: np.ndarray, L: int, page_size: int, P: int) -> None:
    """The course's rules for the block table and the context lengths, request by request."""
    seen: dict[int, tuple[int, int]] = {}  # live page -> where it is used
    for b, (n, row) in enumerate(zip(lens.tolist(), table.tolist())):
        if n < 0:
            raise ValueError(f"{fn}: context_lens[{b}] must be nonnegative, got {n}")
        live = -(-n // page_size)
        if live > len(row):
            raise ValueError(
                f"{fn}: context_lens[{b}] is not covered by block_table: {n} keys need {live} pages of "
                f"{page_size}, the table has {len(row)} per request"
            )
        if 0 < n < L:
            raise ValueError(f"{fn}: context_lens[{b}] must be zero or at least query length {L}, got {n}")
        for i, page in enumerate(row):
            if i >= live:
                if page != -1:
                    raise ValueError(
                        f"{fn}: Unused block_table entry [{b}, {i}] must use the -1 sentinel, got {page} "
                        f"(request {b} has {n} keys: {live} live pages)"
                    )
            elif not 0 <= page < P:
                raise ValueError(
                    f"{fn}: Live page id {page} at block_table[{b}, {i}] is outside physical page storage "
                    f"(pages 0..{P - 1})"
                )
            elif page in seen:
                raise ValueError(
                    f"{fn}: Live page id {page} is aliased: block_table[{b}, {i}] and "
                    f"block_table[{seen[page][0]}, {seen[page][1]}] both use it"
                )
            else:
                seen[page] = (b, i)


# ---- the extension: tiny_llm_ext ----


class Extension:
    """The attention ops of the course's extension, ``tiny_llm_ext``, on a CPU.

    Each takes the extension's arguments, in its order, with its flattened
    shapes (batch and heads in one axis), and returns an ``mx.array``. The
    course's Python calls them as ``tiny_llm_ext.decode_attention(...)``:
    ``from npattn.tinyllm import ext as tiny_llm_ext`` (``ext`` is an instance)
    makes those calls run here. ``stream`` is accepted and ignored. The
    extension's other kernels (``quantized_matmul``, ``rms_norm``, ``rope``,
    ``swiglu``, ``quantized_embedding``) are not here: asking for one is an
    ``AttributeError`` that says so.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"tinyllm.ext has the course extension's attention ops only (decode_attention, paged_attention, "
            f"paged_cache_update); {name!r} is one of its other kernels, which npattn does not compute"
        )

    @staticmethod
    def decode_attention(
        query: Any,
        key: Any,
        value: Any,
        mask: Any,
        scale: float,
        is_causal: bool,
        has_mask: bool,
        num_heads: int,
        num_kv_heads: int,
        stream: Any = None,
    ) -> mx.array:
        """Week 2, day 5: the fused decode attention on flattened heads.

        Parameters
        ----------
        query : mx.array, shape (B * num_heads, L, D)
            float32, float16 or bfloat16; ``D <= 256``.
        key, value : mx.array, shape (B * num_kv_heads, S, D)
            ``query``'s dtype; of one shape. Query row ``r`` (batch ``r //
            num_heads``, head ``h = r % num_heads``) reads key/value row
            ``batch * num_kv_heads + h // (num_heads // num_kv_heads)``.
        mask : mx.array of float32
            With ``has_mask``, shape ``(B * num_heads, L, S)``, added to the
            scaled scores; else a placeholder (the course passes ``zeros((1,))``).
        scale : float
        is_causal : bool
            Query ``i`` sees key ``j <= i + S - L`` only (bottom-right).
        has_mask : bool
        num_heads, num_kv_heads : int

        Returns
        -------
        mx.array, shape (B * num_heads, L, D)
            In ``query``'s dtype.

        Raises
        ------
        ValueError
            Each of the extension's rules: "q, k, and v dtypes must match;
            mask must be float32", "incompatible attention shapes", "mask must
            have shape [B*Hq,L,S]".
        """
        fn = "tinyllm.ext.decode_attention"
        q, k, v, m = (_numpy(fn, name, x) for name, x in (("query", query), ("key", key), ("value", value),
                                                            ("mask", mask)))  # fmt: skip
        if q.dtype.name not in HALF_AND_SINGLE or not q.dtype == k.dtype == v.dtype or m.dtype != np.float32:
            raise ValueError(
                f"{fn}: q, k, and v dtypes must match (float32, float16 or bfloat16); mask must be float32; "
                f"got {q.dtype}, {k.dtype}, {v.dtype}, mask {m.dtype}"
            )
        if not 0 < num_kv_heads <= num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"{fn}: incompatible attention shapes: num_heads = {num_heads} must be a multiple of "
                f"num_kv_heads = {num_kv_heads}"
            )
        fits = q.ndim == k.ndim == 3 and k.shape == v.shape and q.shape[2] == k.shape[2] <= 256
        B = q.shape[0] // num_heads if fits else 0
        if not fits or q.shape[0] % num_heads or k.shape[0] != B * num_kv_heads:
            raise ValueError(
                f"{fn}: incompatible attention shapes: query (B * num_heads, L, D), key and value "
                f"(B * num_kv_heads, S, D), D <= 256; got {_shapes(query=q, key=k, value=v)} with num_heads = "
                f"{num_heads}, num_kv_heads = {num_kv_heads}"
            )
        L, D, S = q.shape[1], q.shape[2], k.shape[1]
        if has_mask and m.shape != (q.shape[0], L, S):
            raise ValueError(f"{fn}: mask must have shape [B*Hq,L,S] = {(q.shape[0], L, S)}, got {m.shape}")
        out = npattn.sdpa(
            q.reshape(B, num_heads, L, D), k.reshape(B, num_kv_heads, S, D), v.reshape(B, num_kv_heads, S, D),
            float(scale), m.reshape(B, num_heads, L, S) if has_mask else None,
            window=(None, 0) if is_causal else None,  # the causal band: key position <= query position
        )  # fmt: skip
        return _result(out, q.shape)

    @staticmethod
    def paged_attention(
        query: Any,
        key_pages: Any,
        value_pages: Any,
        block_table: Any,
        context_lens: Any,
        scale: float = 1.0,
        is_causal: bool = False,
        *,
        num_kv_heads: int,
        num_heads: int,
        stream: Any = None,
    ) -> mx.array:
        """Week 3: paged attention on flattened heads, reading the pages in place
        (:func:`npattn.paged_attention`).

        Parameters
        ----------
        query : mx.array, shape (B * num_heads, L, D)
            float32 or bfloat16.
        key_pages, value_pages : mx.array, shape (P, num_kv_heads, page_size, D)
            ``query``'s dtype; of one shape.
        block_table : mx.array of int32, shape (B, max_pages)
        context_lens : mx.array of int32, shape (B,)
        scale : float, default 1.0
        is_causal : bool, default False
            Query row ``i`` of request ``b`` sits at ``context_lens[b] - L + i``.
        num_kv_heads, num_heads : int
            Keyword arguments, as the course passes them.

        Returns
        -------
        mx.array, shape (B * num_heads, L, D)

        Raises
        ------
        ValueError
            Each of the extension's rules, in its words; a live table entry
            outside the pages or a context length beyond the table, as
            :func:`npattn.paged_attention` says it.
        """
        fn = "tinyllm.ext.paged_attention"
        q, kp, vp, table, lens = (
            _numpy(fn, name, x)
            for name, x in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages),
                            ("block_table", block_table), ("context_lens", context_lens))
        )  # fmt: skip
        if q.dtype.name not in PAGED_DTYPES or not q.dtype == kp.dtype == vp.dtype:
            raise ValueError(
                f"{fn}: q, key_pages, and value_pages must have the same float32 or bfloat16 dtype; "
                f"got {q.dtype}, {kp.dtype}, {vp.dtype}"
            )
        if table.dtype != np.int32 or lens.dtype != np.int32:
            raise ValueError(f"{fn}: block_table and context_lens must be int32; got {table.dtype}, {lens.dtype}")
        rules = [
            (q.ndim == 3, "q must be 3D [B * H_q, L, D]"),
            (kp.ndim == 4 and vp.ndim == 4, "page tensors must be 4D [P, H_kv, page_size, D]"),
            (table.ndim == 2 and lens.ndim == 1, "block_table must be 2D and context_lens must be 1D"),
            (0 < num_kv_heads <= num_heads and num_heads % num_kv_heads == 0,
             f"num_heads = {num_heads} must be divisible by num_kv_heads = {num_kv_heads}"),
            (q.shape[0] % num_heads == 0, f"q.shape[0] must be divisible by num_heads = {num_heads}"),
            (kp.shape == vp.shape, "key_pages and value_pages must have the same shape"),
            (kp.shape[1] == num_kv_heads, f"page tensor head count must equal num_kv_heads = {num_kv_heads}"),
            (q.shape[-1] == kp.shape[-1], "q and page tensors must have the same head dimension"),
            (table.shape[0] == lens.shape[0], "block_table and context_lens batch sizes must match"),
            (q.shape[0] // num_heads == table.shape[0], "q batch size must match block_table batch size"),
        ]  # fmt: skip
        for holds, rule in rules:  # in the extension's order: each assumes the ones before it
            if not holds:
                shapes = _shapes(query=q, key_pages=kp, value_pages=vp, block_table=table, context_lens=lens)
                raise ValueError(f"{fn}: {rule}; got {shapes}")
        B, L, D = table.shape[0], q.shape[1], q.shape[2]
        out = npattn.paged_attention(
            q.reshape(B, num_heads, L, D), kp, vp, table, lens, None, float(scale), "causal" if is_causal else None
        )
        return _result(out, q.shape)

    @staticmethod
    def paged_cache_update(pages: Any, values: Any, page_id: int, start: int, stream: Any = None) -> mx.array:
        """Week 3, day 3: ``pages`` with ``values`` written into page ``page_id``
        from row ``start`` on.

        Parameters
        ----------
        pages : mx.array, shape (P, H, page_size, D)
            float32 or bfloat16.
        values : mx.array, shape (1, H, length, D)
            ``pages``' dtype; ``start + length <= page_size``.
        page_id, start : int

        Returns
        -------
        mx.array, shape (P, H, page_size, D)
            A new array: ``pages`` itself is never written. (The course's GPU
            kernel writes into ``pages``' buffer and returns an array sharing
            it; its callers rebind, ``pages = paged_cache_update(pages, ...)``,
            which works the same with either.)

        Raises
        ------
        ValueError
            The extension's rules, in its words: "pages and values must have
            the same float32 or bfloat16 dtype", "expected pages [P, H,
            page_size, D] and values [1, H, length, D]", "values must match
            the page head count and head dimension", "destination slice is
            outside page storage".

        Examples
        --------
        >>> import mlx.core as mx
        >>> from npattn.tinyllm import ext
        >>> pages = ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.ones((1, 1, 2, 3)), 1, 1)
        >>> pages[1, 0, :, 0].tolist(), pages[0].sum().item()
        ([0.0, 1.0, 1.0, 0.0], 0.0)
        """
        fn = "tinyllm.ext.paged_cache_update"
        p, v = _numpy(fn, "pages", pages), _numpy(fn, "values", values)
        if p.dtype.name not in PAGED_DTYPES or v.dtype != p.dtype:
            raise ValueError(
                f"{fn}: pages and values must have the same float32 or bfloat16 dtype; got {p.dtype}, {v.dtype}"
            )
        if p.ndim != 4 or v.ndim != 4 or v.shape[0] != 1:
            shapes = _shapes(pages=p, values=v)
            raise ValueError(f"{fn}: expected pages [P, H, page_size, D] and values [1, H, length, D]; got {shapes}")
        if v.shape[1] != p.shape[1] or v.shape[3] != p.shape[3]:
            raise ValueError(
                f"{fn}: values must match the page head count and head dimension; got {_shapes(pages=p, values=v)}"
            )
        P, page_size, length = p.shape[0], p.shape[2], v.shape[2]
        if not 0 <= page_id < P or start < 0 or start + length > page_size:
            raise ValueError(
                f"{fn}: destination slice is outside page storage: {length} rows at page_id = {page_id}, "
                f"start = {start}, where pages holds {P} pages of {page_size} rows"
            )
        updated = mx.array(pages) if isinstance(pages, mx.array) else _interop.to_mlx(p)  # a new array
        updated[page_id, :, start : start + length, :] = values[0] if isinstance(values, mx.array) else _result(v[0])
        return updated


#: The extension's ops: ``from npattn.tinyllm import ext as tiny_llm_ext``.
ext = Extension()

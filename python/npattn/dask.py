"""Attention over Dask arrays: ``npattn.dask.sdpa`` (``pip install "npattn[dask]"``).

The same call as :func:`npattn.sdpa`, on arrays too large for one machine's
memory or time. Every block is one :func:`npattn.sdpa` call:

- batch and head chunks map one to one, a chunk of query heads with the
  key/value heads its GQA groups read (the query heads are rechunked where a
  boundary would split a group);
- query chunks get their own ``q_offset``, so the causal rule and windows hold
  across chunks; per-request key ranges (``k_start``, ``k_lengths``) are cut
  to each key chunk, each request's positions shifted so that they keep their
  differences;
- each key chunk gives a partial result with ``return_lse=True`` and its
  ``k_offset``; the partials are combined by :func:`npattn.merge` in a tree
  (``split_every`` at a time), so no task holds an ``L x S`` block, only
  ``(query chunk) x (key chunk)`` scores inside one call.

It runs on any Dask scheduler, a ``distributed`` cluster included, and equals
``npattn.sdpa`` on the whole arrays up to float32 rounding (float16 and
bfloat16 partials are kept in float32 until the end).

``import npattn`` never imports this module or Dask.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, Literal, overload

import numpy as np

try:
    import dask.array as da
except ImportError as e:  # the extra is not installed: say which
    raise ImportError(f'npattn.dask needs Dask: pip install "npattn[dask]" ({e})') from e

from . import _args
from ._api import merge
from ._api import sdpa as _sdpa

__all__ = ["sdpa"]

_INT64 = 2**63 - 1  # the offsets npattn.sdpa takes lie in [-_INT64, _INT64]


def _task_threads() -> int | None:
    """What the worker running this task grants it: in a distributed worker, the
    OMP_NUM_THREADS it was started with (Dask's nanny sets 1), else the CPUs over its
    task slots; in a thread of another scheduler's pool, 1; else npattn's default."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    if worker is not None:
        granted = os.environ.get("OMP_NUM_THREADS", "")
        if granted.isdigit() and int(granted) > 0:
            return int(granted)
        return max(1, (os.cpu_count() or 1) // max(1, worker.state.nthreads))
    return None if threading.current_thread() is threading.main_thread() else 1


def _offsets(q_pos: int, k_pos: int) -> tuple[int, int]:
    """(q_offset, k_offset) for npattn.sdpa, both within its range, that see the keys
    of a chunk whose first query sits at q_pos and first key at k_pos (exact ints).

    Only the difference q_pos - k_pos decides what a row sees (causal rule and window
    alike), so both are shifted together into range. A difference beyond 2 * (2**63 - 1)
    is clipped there: past it, every window side (below 2**63) keeps or hides every key
    alike."""
    diagonal = max(-2 * _INT64, min(2 * _INT64, q_pos - k_pos))
    k = max(-_INT64, min(_INT64, k_pos))
    q = k + diagonal
    if q > _INT64:
        q, k = _INT64, _INT64 - diagonal
    elif q < -_INT64:
        q, k = -_INT64, -_INT64 - diagonal
    return q, k


def _partial(
    q, k, v, mask, sinks, rows, starts, lengths, q_offsets, *groups, k_offset, q_offset, threads, options, wide, named
):
    """One block: (*b, g, r, l, d) queries against one key chunk; the packed result
    (*b, g, r, l, D_v + 1): the output, then lse, in `wide`. q_offset and k_offset are
    the positions of the whole q's first row and of this chunk's first key; with
    per-request ranges, starts and lengths are each request's rows of this chunk and
    q_offsets its first query's position, shifted so that only differences count.
    groups: this chunk's scales and zero points of codes, those `named`."""
    *batch, g, r, n_rows, d = q.shape
    flat = (*batch, g * r, n_rows)
    first = int(rows[0]) if rows.size else 0
    scales = {name: x[..., 0, :, :] for name, x in zip(named, groups)}
    ranges = {}
    if starts is not None:
        ranges = {"k_start": starts, "k_lengths": lengths}
        q_offset = np.asarray(q_offsets, dtype=np.int64) + first
    else:
        q_offset, k_offset = _offsets(q_offset + first, k_offset)
    out, lse = _sdpa(
        q.reshape(*flat, d).astype(wide, copy=False),
        _as_computed(k[..., 0, :, :], wide),
        _as_computed(v[..., 0, :, :], wide),
        mask=mask.reshape(*flat, mask.shape[-1]) if isinstance(mask, np.ndarray) else mask,
        sinks=None if sinks is None else sinks.reshape(g * r),
        q_offset=q_offset,
        k_offset=k_offset,
        return_lse=True,
        threads=_task_threads() if threads is None else threads,
        **ranges,
        **scales,
        **options,
    )
    packed = np.concatenate([out, lse[..., None].astype(wide)], axis=-1)
    return packed.reshape(*batch, g, r, n_rows, packed.shape[-1])


def _as_computed(x: np.ndarray, wide: np.dtype) -> np.ndarray:
    """K or V of a block in the dtype its partials are computed in; codes as they are."""
    return x if x.dtype.itemsize == 1 else x.astype(wide, copy=False)


def _merge_packed(*parts):
    """The packed partials of the same queries over disjoint key chunks, merged."""
    out, lse = merge([p[..., :-1] for p in parts], [p[..., -1] for p in parts])
    return np.concatenate([out, lse[..., None].astype(out.dtype)], axis=-1)


def _check_chunks(fn: str, x: Any, name: str) -> None:
    """A Dask array whose chunk sizes are unknown (nan, as after boolean indexing) cannot
    be split into calls: say which, and how to know them."""
    if isinstance(x, da.Array) and any(math.isnan(n) for chunks in x.chunks for n in chunks):
        axes = [axis for axis, chunks in enumerate(x.chunks) if any(math.isnan(n) for n in chunks)]
        raise ValueError(
            f"{fn}: {name} has unknown (nan) chunk sizes along axis {axes[0]} (shape {x.shape}); "
            f"call {name}.compute_chunk_sizes() first"
        )


@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
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
    precision: str = "highest",
    threads: int | None = None,
    split_every: int = 4,
) -> da.Array: ...


@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
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
    precision: str = "highest",
    threads: int | None = None,
    split_every: int = 4,
) -> tuple[da.Array, da.Array]: ...


@overload
def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
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
    precision: str = "highest",
    threads: int | None = None,
    split_every: int = 4,
) -> da.Array | tuple[da.Array, da.Array]: ...


def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any = None,
    mask: Any = "causal",
    *,
    sinks: Any = None,
    window: Any = None,
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
    precision: str = "highest",
    threads: int | None = None,
    split_every: int = 4,
) -> da.Array | tuple[da.Array, da.Array]:
    """:func:`npattn.sdpa` over Dask arrays; returns a Dask array (and lse).

    Parameters
    ----------
    q, k, v : dask.array.Array or array_like
        As for :func:`npattn.sdpa`, in any chunking; NumPy arrays are wrapped.
        The last axis (D, D_v) is taken whole.
    scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, return_lse, precision
        As for :func:`npattn.sdpa`: per-request key ranges and positions too, each
        request's range cut to each key chunk. An array mask may be a Dask array too; it
        is chunked like the scores' query and key chunks.
    k_scale, v_scale, k_zero, v_zero : dask.array.Array or array_like, optional
        As for :func:`npattn.sdpa`: ``k`` and ``v`` may hold 8-bit codes, with their
        scales (and zero points) chunked along with them. A NaN or infinite scale is
        found by the task that reads it.
    threads : int, optional
        Threads for each task's call. Default: what the worker running the
        task grants it (Dask's ``distributed`` workers start with
        ``OMP_NUM_THREADS=1``), so that workers times threads does not
        oversubscribe the machine.
    split_every : int, default 4
        How many partials one merge task combines.

    Returns
    -------
    dask.array.Array, or (out, lse) with ``return_lse=True``
        Chunked as q's batch, head and query chunks, ``D_v`` whole; the dtype
        of :func:`npattn.sdpa`'s result.

    Examples
    --------
    >>> import dask.array as da, numpy as np, npattn, npattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((1, 4, 64, 16)), chunks=(1, 2, 32, 16))
    >>> k = da.from_array(rng.standard_normal((1, 2, 256, 16)), chunks=(1, 1, 64, 16))
    >>> out = npattn.dask.sdpa(q, k, k)   # 4 key chunks per block, merged
    >>> np.allclose(out.compute(), npattn.sdpa(q.compute(), k.compute(), k.compute()))
    True
    """
    fn = "sdpa"
    q, k, v = (x if isinstance(x, da.Array) else da.asarray(x) for x in (q, k, v))
    codes = {"k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale, "v_zero": v_zero}
    codes = {name: x if isinstance(x, da.Array) else da.asarray(x) for name, x in codes.items() if x is not None}
    for x, name in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask"), *((x, name) for name, x in codes.items())):
        _check_chunks(fn, x, name)
    if int(split_every) < 2:
        raise ValueError(f"{fn}: split_every must be an int >= 2, got {split_every!r}")
    if isinstance(sinks, da.Array):
        sinks = sinks.compute()
    # The rules of npattn.sdpa, checked once on views of one query row and one key
    # (zero strides, no memory): a bad call fails here, not inside a task.
    probe = {"mask": mask if mask is None or isinstance(mask, str) else np.zeros(()), "sinks": sinks}
    L, S = q.shape[-2] if q.ndim >= 2 else 0, k.shape[-2] if k.ndim >= 2 else 0

    def view(x, rows):  # rows 0 or 1, or all of them with per-request ranges (zero strides either way)
        shape = (*x.shape[:-2], rows if ranged else min(rows, 1), x.shape[-1]) if x.ndim >= 2 else x.shape
        return np.broadcast_to(np.zeros((), dtype=x.dtype), shape)

    def groups_view(x):  # a scale's view, its rows (the axis before its groups) as view cuts k's
        shape = (*x.shape[:-2], x.shape[-2] if ranged else min(x.shape[-2], 1), x.shape[-1]) if x.ndim >= 2 else x.shape
        return np.broadcast_to(np.zeros((), dtype=x.dtype), shape)

    ranged = k_start is not None or k_lengths is not None or (q_offset is not None and np.ndim(q_offset) > 0)
    if ranged:  # the ranges against the whole S: no query row, so nothing is computed
        q_view, k_view, v_view = view(q, 0), view(k, S), view(v, S)
    else:
        q_view, k_view, v_view = view(q, L), view(k, S), view(v, S)
    probe.update((name, groups_view(x)) for name, x in codes.items())
    _sdpa(q_view, k_view, v_view, scale, window=window, softcap=softcap, q_offset=q_offset, k_offset=k_offset,
          k_start=k_start, k_lengths=k_lengths, precision=precision, threads=threads, **probe)  # fmt: skip
    if isinstance(mask, str) and mask == "causal_top_left":  # "causal" from 0; query chunks then shift it
        mask, q_offset = "causal", 0
    result_dtype = _args.result_dtype(q.dtype, k.dtype, v.dtype)  # codes take no part
    wide = np.dtype(np.float64 if result_dtype == np.float64 else np.float32)

    # One layout for every operand: (*B, H_kv, n_rep, rows, width), batch dims broadcast.
    rank2 = q.ndim == k.ndim == v.ndim == 2
    q, k, v = (x[None] if x.ndim == 2 else x for x in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    H_q, H_kv, D, D_v = q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]
    if math.prod((*batch, H_q, L)) == 0:  # no query row (an empty batch, H_q = 0 or L = 0): nothing to split
        out = da.zeros((*batch, H_q, L, D_v), dtype=result_dtype, chunks=-1)
        lse = da.zeros((*batch, H_q, L), dtype=wide, chunks=-1)
        if rank2:
            out, lse = out[0], lse[0]
        return (out, lse) if return_lse else out
    n_rep = H_q // H_kv
    q = da.broadcast_to(q, (*batch, *q.shape[-3:]))
    k = da.broadcast_to(k, (*batch, *k.shape[-3:]))
    v = da.broadcast_to(v, (*batch, *v.shape[-3:]))
    # Head chunks whole GQA groups: boundaries of q's heads on multiples of n_rep.
    cuts = sorted({min(H_kv, -(-int(c) // n_rep)) for c in np.cumsum(q.chunks[-3])} | {H_kv}) if H_q else [H_kv]
    kv_heads = tuple(np.diff([0, *cuts]).tolist()) if H_kv else (0,)
    b_chunks = tuple(q.chunks[: len(batch)])
    q = q.rechunk((*b_chunks, tuple(n * n_rep for n in kv_heads), q.chunks[-2], D))
    q = q.reshape(*batch, H_kv, n_rep, L, D, merge_chunks=False)
    s_chunks = k.chunks[-2]
    k = k.rechunk((*b_chunks, kv_heads, s_chunks, D))[..., None, :, :]
    v = v.rechunk((*b_chunks, kv_heads, s_chunks, D_v))[..., None, :, :]
    for name, x in codes.items():  # (*B, H_kv, S, G) in k's (v's) chunks, their groups whole
        G = x.shape[-1] if x.ndim else 1
        x = da.broadcast_to(x, (*batch, H_kv, S, G)).rechunk((*b_chunks, kv_heads, s_chunks, G))
        codes[name] = x[..., None, :, :]
    rows = da.arange(L, chunks=(q.chunks[-2],))

    if mask is not None and not isinstance(mask, str):
        mask = mask if isinstance(mask, da.Array) else da.asarray(mask)
        # sdpa's rules for the mask, on a view of its shape and dtype (no memory)
        _args.check_mask(fn, np.broadcast_to(np.zeros((), mask.dtype), mask.shape), (*batch, H_q, L, S))
        mask = da.broadcast_to(mask, (*batch, H_q, L, S)).rechunk((*b_chunks, H_q, q.chunks[-2], s_chunks))
        mask = mask.reshape(*batch, H_kv, n_rep, L, S, merge_chunks=False)
        mask = mask.rechunk((*b_chunks, kv_heads, n_rep, q.chunks[-2], s_chunks))
    sinks_array = None
    if sinks is not None:
        sinks_array = da.from_array(np.asarray(sinks, dtype=np.float64).reshape(H_kv, n_rep), chunks=(kv_heads, n_rep))

    bi = tuple(f"b{i}" for i in range(len(batch)))
    if ranged:  # each request's rows and first query position, over the batch (int64, as sdpa reads them)
        start = np.broadcast_to(np.asarray(0 if k_start is None else k_start, dtype=np.int64), batch)
        length = S - start if k_lengths is None else np.broadcast_to(np.asarray(k_lengths, dtype=np.int64), batch)
        if q_offset is None:
            first_q = k_offset + length - L if k_start is not None or k_lengths is not None else np.full(batch, S - L)
        else:
            first_q = np.broadcast_to(np.asarray(q_offset, dtype=np.int64), batch)

    def per_request(x):
        return da.from_array(np.array(x, dtype=np.int64), chunks=b_chunks), bi  # (ascontiguousarray makes 0-d 1-d)

    options = {"scale": scale, "window": window, "softcap": softcap, "precision": precision}
    parts, c0 = [], 0
    for j, n in enumerate(s_chunks or (0,)):
        ks, vs = k[..., c0 : c0 + n, :], v[..., c0 : c0 + n, :]
        args = [q, (*bi, "g", "r", "l", "d"), ks, (*bi, "g", "x", "s", "d"), vs, (*bi, "g", "x", "s", "e")]
        if isinstance(mask, da.Array):
            args += [mask[..., c0 : c0 + n], (*bi, "g", "r", "l", "s")]
        else:
            args += [mask, None]
        args += [sinks_array if j == 0 else None, ("g", "r") if j == 0 and sinks is not None else None]
        args += [rows, ("l",)]
        if ranged:  # this chunk's rows of each request; positions keep their differences
            cut_start = np.clip(start - c0, 0, n)
            cut_end = np.clip(start + length - c0, 0, n)
            cut_length = np.maximum(cut_end - cut_start, 0)
            args += [*per_request(cut_start), *per_request(cut_length), *per_request(first_q + start - cut_start)]
        else:
            args += [None, None, None, None, None, None]
        for name, x in codes.items():  # the groups' axis: one chunk, its own letter for k's and v's
            args += [x[..., c0 : c0 + n, :], (*bi, "g", "x", "s", "c" if name.startswith("k") else "w")]
        parts.append(
            da.blockwise(
                _partial,
                (*bi, "g", "r", "l", "e"),
                *args,
                k_offset=int(k_offset) + c0,  # exact ints: _partial shifts them into range
                q_offset=0 if ranged else (S - L if q_offset is None else int(q_offset)),  # ranged: q_offsets
                threads=threads,
                options=options,
                wide=wide,
                named=tuple(codes),
                adjust_chunks={"e": D_v + 1},
                concatenate=True,
                dtype=wide,
                meta=np.empty((0,) * (len(batch) + 5), dtype=wide),
            )  # fmt: skip
        )
        c0 += n
    while len(parts) > 1:  # the tree of merges
        groups = [parts[i : i + split_every] for i in range(0, len(parts), split_every)]
        parts = [g[0] if len(g) == 1 else da.map_blocks(_merge_packed, *g, dtype=wide) for g in groups]
    packed = parts[0].reshape(*batch, H_q, L, D_v + 1, merge_chunks=False)
    out, lse = packed[..., :-1].astype(result_dtype), packed[..., -1]
    if rank2:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out

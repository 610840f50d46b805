"""Paged caches for npattn.paged_attention: building one, drawing a random one, and
the comparison with the float64 reference; the tests (test_paged.py) and the
differential fuzzer share them."""

import numpy as np

import npattn
from npattn import reference

from .codes import FORMATS, GROUPINGS, random_codes, random_groups, split_codes
from .compare import own_tolerance, representable, snapshot
from .inputs import dtype_of, f64
from .problems import _has_ml_dtypes


def paged_problem(rng, B=3, H_q=4, H_kv=2, L=1, D=8, D_v=8, page_size=4, lengths=(0, 1, 4, 5), dtype=np.float32,
                  spare=3, shared=False):  # fmt: skip
    """(q, key_pages, value_pages, block_table, context_lens): each request's pages at
    random among P physical pages (a few spare), -1 past its live pages; with `shared`
    every request starts with request 0's first page."""
    lengths = np.array([lengths[b % len(lengths)] for b in range(B)], dtype=np.int64)
    live = -(-lengths // page_size)
    max_pages = max(1, int(live.max(initial=0)) + 1)
    P = int(live.sum()) + spare
    order = rng.permutation(P)
    table = np.full((B, max_pages), -1, np.int64)
    at = 0
    for b in range(B):
        table[b, : live[b]] = order[at : at + live[b]]
        at += live[b]
    if shared and B > 1 and live[0] > 0:
        table[1:, 0] = np.where(live[1:] > 0, table[0, 0], -1)
    q = rng.standard_normal((B, H_q, L, D)).astype(dtype)
    key_pages = rng.standard_normal((P, H_kv, page_size, D)).astype(dtype)
    value_pages = rng.standard_normal((P, H_kv, page_size, D_v)).astype(dtype)
    return q, key_pages, value_pages, table, lengths


def random_paged_problem(rng, dtypes=("float32", "float64", "float16", "bfloat16"), codes=True):
    """(q, key_pages, value_pages, block_table, context_lens, kwargs) of a random valid
    paged_attention call: GQA groups, page sizes from 1 to 33, context lengths from 0
    to several pages (one page exactly, a page plus one), shared pages, the pages'
    (P, page_size, H_kv, D) store as a transposed view or every other column, int32 or
    int64 tables, every mask kind it takes, window, sinks, softcap, q_offset (one or per
    request), return_lse, precision and threads; with `codes`, in one in five, pages of
    8-bit codes with their scales paged like them (every format and grouping)."""
    names = [n for n in dtypes if n != "bfloat16" or _has_ml_dtypes()]
    dtype = np.dtype(dtype_of(rng.choice(names)))
    H_kv = int(rng.integers(1, 4))
    H_q = H_kv * int(rng.integers(1, 5))
    page_size = int(rng.choice([1, 2, 4, 16, 33]))
    B = int(rng.integers(0, 5))
    lengths = [int(rng.choice([0, 1, page_size, page_size + 1, int(rng.integers(0, 4 * page_size + 2)), 300]))
               for _ in range(max(B, 1))]  # fmt: skip
    L = int(rng.choice([1, 1, 2, 5, 40]))
    D, D_v = int(rng.choice([1, 5, 16, 64])), int(rng.choice([0, 3, 16, 64]))
    q, kp, vp, table, cl = paged_problem(rng, B, H_q, H_kv, L, D, D_v, page_size, lengths, dtype,
                                         spare=int(rng.integers(0, 3)), shared=rng.random() < 0.3)  # fmt: skip
    store = rng.random()

    def stored(x):
        if store < 0.3 and x.ndim == 4:  # a (P, page_size, H_kv, D) store, passed transposed
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        if 0.3 <= store < 0.4 and x.ndim == 4:  # every other column: read through a gather
            return np.repeat(x, 2, axis=3)[..., ::2]
        return x

    kp, vp = stored(kp), stored(vp)
    if rng.random() < 0.5:
        table = table.astype(np.int32)
    kwargs = {}
    mask = rng.choice(["causal", "causal", "causal_top_left", None, "default"])
    if mask != "default":
        kwargs["mask"] = None if mask is None else str(mask)
    if rng.random() < 0.3:
        kwargs["window"] = (int(rng.integers(0, 20)), int(rng.integers(0, 3)) if rng.random() < 0.5 else None)
    if rng.random() < 0.2:
        kwargs["sinks"] = rng.standard_normal(H_q)
    if rng.random() < 0.2:
        kwargs["softcap"] = float(rng.choice([0.5, 5.0, 50.0]))
    if rng.random() < 0.2 and kwargs.get("mask") != "causal_top_left":
        kwargs["q_offset"] = rng.integers(-3, 310, size=len(cl)) if rng.random() < 0.5 else int(rng.integers(0, 50))
    if rng.random() < 0.3:
        kwargs["return_lse"] = True
    if rng.random() < 0.3:
        kwargs["precision"] = str(rng.choice(["highest", "fast"]))
    if rng.random() < 0.3:
        kwargs["threads"] = int(rng.integers(1, 4))
    if codes and _has_ml_dtypes() and rng.random() < 0.2:  # drawn last, so that the draws above stay
        pages = []
        for name, x in (("k", kp), ("v", vp)):
            if rng.random() < 0.3:
                pages.append(x)
                continue
            fmt = str(rng.choice(list(FORMATS)))
            grouping = str(rng.choice(GROUPINGS))
            scale, zero = random_groups(rng, x.shape, fmt, grouping, str(rng.choice(["float32", "float16"])),
                                        zero=FORMATS[fmt] and rng.random() < 0.5)  # fmt: skip
            pages.append(stored(np.ascontiguousarray(random_codes(rng, x.shape, fmt))))
            kwargs[f"{name}_scale"] = stored(scale) if grouping == "token" else scale
            if zero is not None:
                kwargs[f"{name}_zero"] = stored(zero) if grouping == "token" else zero
        kp, vp = pages
    return q, kp, vp, table, cl, kwargs


def check_paged(q, key_pages, value_pages, table, lengths, **kwargs):
    """npattn.paged_attention == the reference (npattn.reference.paged_attention on
    float64 copies) within the tolerance of sdpa on the gathered keys, lse too when
    asked for; the inputs unchanged. Pages of codes: against the float32 values they
    stand for. Returns npattn's result (and lse)."""
    inputs = (q, key_pages, value_pages, table, lengths, *(x for x in kwargs.values() if isinstance(x, np.ndarray)))
    before = snapshot(*map(np.asarray, inputs))
    got = npattn.paged_attention(q, key_pages, value_pages, table, lengths, **kwargs)
    dtype = npattn._args.result_dtype(q.dtype, key_pages.dtype, value_pages.dtype)  # codes take no part
    kp, vp, kwargs = split_codes(key_pages, value_pages, kwargs)  # codes as their values
    skip = ("threads", "out", "precision")
    ref_kwargs = {key: f64(val) if key == "sinks" else val for key, val in kwargs.items() if key not in skip}
    with np.errstate(all="ignore"):
        want = reference.paged_attention(f64(q), f64(kp), f64(vp), table, lengths, **ref_kwargs)
    if kwargs.get("return_lse"):
        (got, got_lse), (want, want_lse) = got, want
        np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    k, v, _ = reference.gather_pages(kp, vp, table, lengths)
    bound_keys = ("scale", "mask", "sinks", "window", "softcap", "q_offset", "precision")
    bound = {key: kwargs[key] for key in bound_keys if key in kwargs}
    rtol, atol = own_tolerance(q, k, v, np.dtype(dtype), k_lengths=lengths, **bound)
    np.testing.assert_allclose(f64(got), representable(want, np.dtype(dtype)), rtol=rtol, atol=atol)
    assert snapshot(*map(np.asarray, inputs)) == before, "an input changed"
    return (got, got_lse) if kwargs.get("return_lse") else got

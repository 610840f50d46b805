"""npattn.paged_attention: attention through a block table over physical pages.

Against the float64 reference (npattn.reference.paged_attention, which gathers
the pages and calls reference.sdpa) for every mask kind it takes, window,
sinks, softcap, offsets and dtypes, on the decode (streaming), prefill (gemm)
and split-K paths and every kernel table this CPU runs: pages in any order,
shared pages, context lengths 0, 1, a page and a page plus one, more query
rows than keys, strided page stores, the course's calling convention; and the
errors, each naming the argument, the request and the entry.
"""

import numpy as np
import pytest

import npattn
from helpers import assert_raises_naming, check_paged, kernels, paged_problem, random_paged_problem, runnable_kernels
from npattn import reference, testing


@pytest.mark.parametrize("page_size", [1, 4, 16, 33])
@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None])
def test_paged_matches_the_reference(rng, mask, L, page_size):
    """Decode (L = 1: streaming), short and long query blocks (gemm); pages of 1 row to
    more than a tile's; context lengths 0, 1, one page, a page plus one, and long."""
    lengths = (0, 1, page_size, page_size + 1, 150)
    q, kp, vp, table, cl = paged_problem(rng, B=5, L=L, page_size=page_size, lengths=lengths, D=16, D_v=12)
    check_paged(q, kp, vp, table, cl, mask=mask, return_lse=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"])
@pytest.mark.parametrize("L", [1, 20])
def test_paged_dtypes(rng, dtype, L):
    """Pages of every dtype, read as stored; the result in the inputs' dtype."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, kp, vp, table, cl = paged_problem(rng, B=4, L=L, page_size=8, lengths=(3, 8, 9, 70), D=32, D_v=16, dtype=dtype)
    check_paged(q, kp, vp, table, cl)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [None, (5, 0), (2, 3)], ids=str)
@pytest.mark.parametrize("L", [1, 9])
def test_paged_window_sinks_softcap(rng, L, window, softcap):
    """window, sinks and softcap in each request's key positions; a request with no key
    gives zeros and lse = its sink."""
    q, kp, vp, table, cl = paged_problem(rng, B=4, H_q=6, L=L, page_size=4, lengths=(0, 6, 13, 30))
    sinks = rng.standard_normal(6)
    check_paged(q, kp, vp, table, cl, window=window, sinks=sinks, softcap=softcap, return_lse=True)


@pytest.mark.parametrize("q_offset", [0, 7, [0, 3, 20, -2]], ids=str)
def test_paged_q_offset(rng, q_offset):
    """q_offset, one for every request or one per request, moves the causal band."""
    q, kp, vp, table, cl = paged_problem(rng, B=4, L=5, page_size=4, lengths=(2, 7, 16, 21))
    check_paged(q, kp, vp, table, cl, q_offset=q_offset)


def test_paged_shared_pages_and_every_order(rng):
    """Requests sharing a prefix page; pages in reversed and random physical order."""
    q, kp, vp, table, cl = paged_problem(rng, B=4, L=2, page_size=4, lengths=(9, 12, 5, 16), shared=True)
    assert len({table[b, 0] for b in range(4)}) == 1
    check_paged(q, kp, vp, table, cl)
    P = kp.shape[0]
    reverse = np.arange(P)[::-1]  # physical page p moves to P - 1 - p
    check_paged(q, kp[reverse], vp[reverse], np.where(table >= 0, P - 1 - table, -1), cl)


def test_paged_equals_dense_sdpa(rng):
    """The same keys paged and dense (sdpa with k_lengths on the gathered cache) agree to
    float32 rounding, on the decode and the prefill paths."""
    for L in (1, 30):
        q, kp, vp, table, cl = paged_problem(rng, B=3, H_q=14, H_kv=2, L=L, D=64, D_v=64, page_size=16,
                                             lengths=(100, 333, 17))  # fmt: skip
        got = npattn.paged_attention(q, kp, vp, table, cl)
        k, v, _ = reference.gather_pages(kp, vp, table, cl)
        want = npattn.sdpa(q, k, v, k_lengths=cl)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("layout", ["pages-rows-heads", "strided-rows", "strided-cols", "negative"])
def test_paged_strided_stores(rng, layout):
    """Page stores with any strides: (P, page_size, H_kv, D) transposed, every other
    row, every other column (read through the gather), reversed pages."""
    q, kp, vp, table, cl = paged_problem(rng, B=3, L=1, page_size=8, lengths=(5, 16, 40), D=16, D_v=16)
    if layout == "pages-rows-heads":
        store_k, store_v = (
            np.ascontiguousarray(kp.transpose(0, 2, 1, 3)),
            np.ascontiguousarray(vp.transpose(0, 2, 1, 3)),
        )
        kp2, vp2 = store_k.transpose(0, 2, 1, 3), store_v.transpose(0, 2, 1, 3)
    elif layout == "strided-rows":
        kp2, vp2 = np.repeat(kp, 2, axis=2)[:, :, ::2], np.repeat(vp, 2, axis=2)[:, :, ::2]
    elif layout == "strided-cols":
        kp2, vp2 = np.repeat(kp, 2, axis=3)[..., ::2], np.repeat(vp, 2, axis=3)[..., ::2]
    else:
        kp2, vp2 = kp[::-1].copy()[::-1], vp[::-1].copy()[::-1]
    np.testing.assert_array_equal(kp2, kp)
    for L in (1, 12):
        q = rng.standard_normal((3, 4, L, 16)).astype(np.float32)
        check_paged(q, kp2, vp2, table, cl)


def test_more_query_rows_than_keys(rng):
    """L > context_lens[b]: the causal rows before the request's first key are zeros, lse -inf."""
    q, kp, vp, table, cl = paged_problem(rng, B=3, L=10, page_size=4, lengths=(0, 3, 6))
    out, lse = check_paged(q, kp, vp, table, cl, return_lse=True)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(out[1, :, :7] == 0) and np.all(out[1, :, 7:] != 0)


def test_the_course_calling_convention(rng):
    """tiny-llm's order: (query, key_pages, value_pages, block_table, context_lens,
    page_size, scale, mask), int32 tables with -1 sentinels, a Python list of lengths."""
    q, kp, vp, table, cl = paged_problem(rng, B=3, H_q=6, H_kv=2, L=1, page_size=16, lengths=(20, 1, 33), D=8)
    table32 = table.astype(np.int32)
    assert (table32 == -1).any()
    got = npattn.paged_attention(q, kp, vp, table32, [int(n) for n in cl], 16, 0.5, "causal")
    want = check_paged(q, kp, vp, table, cl, page_size=16, scale=0.5, mask="causal")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", runnable_kernels())
def test_paged_on_every_kernel_table(rng, name):
    """Each kernel table this CPU runs reads the pages (the streaming decode, half pages too)."""
    for dtype in (np.float32, np.float16):
        q, kp, vp, table, cl = paged_problem(rng, B=4, H_q=8, H_kv=2, L=1, D=64, D_v=64, page_size=16,
                                             lengths=(1, 16, 17, 700), dtype=dtype)  # fmt: skip
        with kernels(name):
            check_paged(q, kp, vp, table, cl)


def test_split_decode_and_threads_bitwise(rng):
    """A long decode split across threads merges exactly; the same threads give the same bits."""
    q, kp, vp, table, cl = paged_problem(rng, B=1, H_q=14, H_kv=2, L=1, D=64, D_v=64, page_size=32, lengths=(5000,))
    results = {th: npattn.paged_attention(q, kp, vp, table, cl, threads=th) for th in (1, 2, 3)}
    check_paged(q, kp, vp, table, cl, threads=3)
    for th, r in results.items():
        np.testing.assert_array_equal(r, npattn.paged_attention(q, kp, vp, table, cl, threads=th))


def test_out_and_empty(rng):
    """out= is filled and returned; no request, no head or no query row returns empty."""
    q, kp, vp, table, cl = paged_problem(rng, B=2, L=3, page_size=4, lengths=(5, 8))
    out = np.full((2, 4, 3, 8), np.nan, np.float32)
    assert npattn.paged_attention(q, kp, vp, table, cl, out=out) is out
    np.testing.assert_array_equal(out, npattn.paged_attention(q, kp, vp, table, cl))
    assert npattn.paged_attention(q[:0], kp, vp, table[:0], cl[:0]).shape == (0, 4, 3, 8)
    assert npattn.paged_attention(q[:, :, :0], kp, vp, table, cl).shape == (2, 4, 0, 8)
    none = npattn.paged_attention(q, kp[:0], vp[:0], np.full((2, 3), -1), [0, 0])
    assert none.shape == (2, 4, 3, 8) and np.all(none == 0)


# ---- errors: each names the argument, the request and the entry ----

P_ERR = "paged_attention"


def test_bad_block_table_entry_names_it(rng, capfd):
    q, kp, vp, table, cl = paged_problem(rng, B=3, L=1, page_size=4, lengths=(5, 8, 3))
    P = kp.shape[0]
    for value in (P, -1, 10**12):
        bad = table.copy()
        bad[1, 1] = value
        assert_raises_naming(capfd, lambda b=bad: npattn.paged_attention(q, kp, vp, b, cl), ValueError,
                             "block_table", [f"block_table[1, 1] = {value}", f"P = {P}"], function=P_ERR)  # fmt: skip
    wide = table.astype(np.uint64)
    wide[1, 1] = 2**63  # beyond int64: named as given, not as the int64 it wraps to
    assert_raises_naming(capfd, lambda: npattn.paged_attention(q, kp, vp, wide, cl), ValueError, "block_table",
                         [f"block_table[1, 1] = {2**63} is not a page", f"P = {P}"], function=P_ERR)  # fmt: skip
    dead = table.copy()
    dead[2, 1:] = 10**9  # past request 2's live page: never read
    sentinel = table.astype(np.uint64)
    sentinel[2, 1:] = np.uint64(2**64 - 1)  # -1 as a uint64 table holds it: dead, so never read either
    want = npattn.paged_attention(q, kp, vp, table, cl)
    np.testing.assert_array_equal(npattn.paged_attention(q, kp, vp, dead, cl), want)
    np.testing.assert_array_equal(npattn.paged_attention(q, kp, vp, sentinel, cl), want)


def test_a_zero_stride_block_table_is_read_in_place(rng):
    """A broadcast (2, 2**40) view, each request's every entry one page, gives the
    result of its two live columns, bit for bit: only the live entries are read, so
    the view costs what they cost (0.3 copied it whole: 4 GiB of int64 for a
    (2, 2**28) view, a MemoryError for this one; issue 56, item 8)."""
    q, kp, vp, _, cl = paged_problem(rng, B=2, L=2, page_size=4, lengths=(5, 8))
    wide = np.broadcast_to(np.array([[0], [1]]), (2, 2**40))
    want = npattn.paged_attention(q, kp, vp, np.array([[0, 0], [1, 1]]), cl)
    np.testing.assert_array_equal(npattn.paged_attention(q, kp, vp, wide, cl), want)


def test_block_table_entries_beyond_int64_as_a_list(rng, capfd):
    """A list table with a Python int beyond int64 (NumPy holds it as an object): a
    live one is named with its value, a dead one is never read, so the call is valid
    (0.3 refused both with a TypeError about dtype object, SPEC section 12)."""
    q, kp, vp, table, cl = paged_problem(rng, B=3, L=1, page_size=4, lengths=(5, 8, 3))
    live, dead = table.tolist(), table.tolist()
    live[1][1] = 2**64
    dead[2][-1] = 2**64  # past request 2's one live page
    assert_raises_naming(capfd, lambda: npattn.paged_attention(q, kp, vp, live, cl), ValueError, "block_table",
                         [f"block_table[1, 1] = {2**64} is not a page"], function=P_ERR)  # fmt: skip
    want = npattn.paged_attention(q, kp, vp, table, cl)
    np.testing.assert_array_equal(npattn.paged_attention(q, kp, vp, dead, cl), want)
    holding_none = table.tolist()
    holding_none[0][0] = None
    assert_raises_naming(capfd, lambda: npattn.paged_attention(q, kp, vp, holding_none, cl), TypeError,
                         "block_table", ["NoneType"], function=P_ERR)  # fmt: skip


@pytest.mark.parametrize("length, text", [(-1, "context_lens[2] = -1"), (1, "past the last page")])
def test_bad_context_lens_names_the_request(rng, capfd, length, text):
    q, kp, vp, table, cl = paged_problem(rng, B=3, L=1, page_size=4, lengths=(5, 3, 3))
    S = table.shape[1] * 4
    bad = cl.copy()
    bad[2] = length if length < 0 else S + 1
    text = text if length < 0 else f"context_lens[2] = {S + 1} lies outside [0, max_pages * page_size] = [0, {S}]"
    assert_raises_naming(capfd, lambda: npattn.paged_attention(q, kp, vp, table, bad), ValueError, "context_lens",
                         [text], function=P_ERR)  # fmt: skip


def test_argument_errors(rng, capfd):
    q, kp, vp, table, cl = paged_problem(rng, B=2, L=1, page_size=4, lengths=(5, 3))
    call = npattn.paged_attention
    cases = [
        (
            lambda: call(q, kp, vp, table, cl, page_size=8),
            ValueError,
            "page_size",
            ["must equal key_pages.shape[2] = 4"],
        ),
        (lambda: call(q, kp, vp, table, cl, 4.0), TypeError, "page_size", []),
        (lambda: call(q, kp, vp, table.astype(float), cl), TypeError, "block_table", ["array of ints"]),
        (lambda: call(q, kp, vp, table[0], cl), ValueError, "block_table", ["(B, max_pages)"]),
        (lambda: call(q, kp, vp, table[:1], cl), ValueError, "block_table", ["B = 2"]),
        (lambda: call(q, kp, vp, table, [1.5, 2]), TypeError, "context_lens", []),
        (lambda: call(q, kp, vp, table, [1, 2, 3]), ValueError, "context_lens", ["batch shape"]),
        (
            lambda: call(q, kp, vp, table, np.array([5, 2**63], np.uint64)),
            ValueError,
            "context_lens",
            [f"context_lens[1] = {2**63} lies outside int64"],
        ),
        (lambda: call(q, kp, vp, table, [4, 2**64]), ValueError, "context_lens", [f"[1] = {2**64} lies outside"]),
        (lambda: call(q, kp, vp, table, cl, mask=np.ones((2, 4, 1, 12), bool)), TypeError, "mask", []),
        (lambda: call(q, kp, vp, table, cl, mask="top"), ValueError, "mask", []),
        (lambda: call(q, kp[..., :4], vp, table, cl), ValueError, "key_pages", ["row width D"]),
        (lambda: call(q, kp, vp[:, :, :2], table, cl), ValueError, "value_pages", ["page size"]),
        (lambda: call(q[0], kp, vp, table, cl), ValueError, "key_pages", ["(B, H_q, L, D)"]),
        (lambda: call(q, kp[:, :, :0], vp[:, :, :0], table, cl), ValueError, "page_size", [">= 1"]),
        (lambda: call(q[:, :3], kp, vp, table, cl), ValueError, "heads", ["multiple"]),
        (lambda: call(q, kp.astype(np.int32), vp, table, cl), TypeError, "key_pages", []),
        (lambda: call(q, kp, vp, table, cl, out=kp), ValueError, "out", []),
        (lambda: call(q, kp, vp, table, cl, threads=0), ValueError, "threads", []),
        (lambda: call(q, kp, vp, table, cl, precision="half"), ValueError, "precision", ["'half'"]),
    ]
    for fn, exc, name, texts in cases:
        assert_raises_naming(capfd, fn, exc, name, texts, function=P_ERR)


@pytest.mark.parametrize("mask", ["bogus", "Causal", ""])
def test_unknown_mask_string_lists_only_what_paged_attention_takes(rng, mask):
    """An unknown mask string lists "causal", "causal_top_left" and None, the values
    paged_attention takes, and no array, which it refuses (issue 56, item 4)."""
    q, kp, vp, table, cl = paged_problem(rng, B=2, L=1, page_size=4, lengths=(5, 3))
    with pytest.raises(ValueError) as info:
        npattn.paged_attention(q, kp, vp, table, cl, mask=mask)
    assert str(info.value) == f'paged_attention: mask must be "causal", "causal_top_left" or None, got {mask!r}'


def test_out_sharing_a_page_store_is_refused(rng, capfd):
    q, kp, vp, table, cl = paged_problem(rng, B=2, L=1, page_size=4, lengths=(5, 3), D=8, D_v=8)
    out = kp.reshape(-1)[: 2 * 4 * 8].reshape(2, 4, 1, 8)  # the result's shape, inside key_pages
    assert_raises_naming(capfd, lambda: npattn.paged_attention(q, kp, vp, table, cl, out=out), ValueError, "out",
                         ["share memory"], function=P_ERR)  # fmt: skip


def test_the_checker_takes_paged_calls(rng):
    """assert_paged_attention_close passes npattn's result and names a planted mistake."""
    q, kp, vp, table, cl = paged_problem(rng, B=3, H_q=4, L=3, page_size=4, lengths=(5, 9, 12))
    got = npattn.paged_attention(q, kp, vp, table, cl)
    testing.assert_paged_attention_close(got, q, kp, vp, table, cl)
    top_left = npattn.paged_attention(q, kp, vp, table, cl, mask="causal_top_left")
    with pytest.raises(AssertionError, match="top-left"):
        testing.assert_paged_attention_close(top_left, q, kp, vp, table, cl)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]"):
        testing.assert_paged_attention_close(got, q, kp, vp, np.where(table == table[1, 1], 99, table), cl)


@pytest.mark.parametrize("seed", range(40))
def test_random_paged_problems(seed):
    """The fuzzer's paged draws, a few of them here: every one a valid call within tolerance."""
    q, kp, vp, table, cl, kwargs = random_paged_problem(np.random.default_rng([7, seed]))
    check_paged(q, kp, vp, table, cl, **kwargs)

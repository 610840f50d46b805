"""npattn.tinyllm: the course's attention ops (tiny-llm, weeks 1-3) with its names,
signatures and MLX arrays, computed by npattn. Each is checked as the course's own
tests check it (result shape and dtype, against a reference) with npattn.testing's
checkers against the float64 reference, and each rule of the course is an error
that says it."""

import numpy as np
import pytest

from helpers import assert_raises_naming, dtype_of, paged_problem
from npattn import reference
from npattn.testing import assert_attention_close, assert_paged_attention_close

mx = pytest.importorskip("mlx.core")
tinyllm = pytest.importorskip("npattn.tinyllm")
ext = tinyllm.ext

MX = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def mlx(x, dtype="float32"):
    """A NumPy array as an mx.array of the named dtype (rounded once, from float64)."""
    return mx.array(np.asarray(x, np.float64).astype(np.float32)).astype(MX[dtype])


def uniform(rng, shape, dtype="float32"):
    return mlx(rng.uniform(size=shape), dtype)


def normal(rng, shape, dtype="float32"):
    return mlx(rng.standard_normal(shape), dtype)


def check_result(out, shape, dtype):
    """The course's checks of a result: an mx.array of the query's shape and dtype."""
    assert isinstance(out, mx.array), type(out)
    assert out.shape == tuple(shape), (out.shape, shape)
    assert out.dtype == MX[dtype], out.dtype


# ---- week 1 ----


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3), (2, 3, 3)])
@pytest.mark.parametrize("scale, with_mask", [(None, False), (0.5, True)])
def test_simple_attention_matches_the_reference(dtype, batch, scale, with_mask):
    """scaled_dot_product_attention_simple on the course's shapes (L = 4, D = 5, batch
    dims 0 to 3, uniform values, an additive uniform mask with scale 0.5)."""
    rng = np.random.default_rng(len(batch))
    q, k, v = (uniform(rng, (*batch, 4, 5), dtype) for _ in range(3))
    mask = uniform(rng, (*batch, 4, 4), dtype) if with_mask else None
    out = tinyllm.scaled_dot_product_attention_simple(q, k, v, scale=scale, mask=mask)
    check_result(out, (*batch, 4, 5), dtype)
    assert_attention_close(out, q, k, v, scale, mask)


def test_simple_attention_takes_mlx_scale():
    """scale may be an mx.array, as the course's mx.rsqrt(D)."""
    rng = np.random.default_rng(1)
    q, k, v = (normal(rng, (3, 4, 8)) for _ in range(3))
    out = tinyllm.scaled_dot_product_attention_simple(q, k, v, scale=mx.rsqrt(mx.array(8.0)))
    assert_attention_close(out, q, k, v, mask=None)


@pytest.mark.parametrize(
    "L, S, table",
    [
        (3, 3, [[0, -np.inf, -np.inf], [0, 0, -np.inf], [0, 0, 0]]),
        (3, 5, [[0, 0, 0, -np.inf, -np.inf], [0, 0, 0, 0, -np.inf], [0, 0, 0, 0, 0]]),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_mask_is_the_courses_table(L, S, table, dtype):
    """causal_mask(L, S, dtype): the course's hand-written tables, as an mx.array of dtype."""
    mask = tinyllm.causal_mask(L, S, MX[dtype])
    check_result(mask, (L, S), dtype)
    np.testing.assert_array_equal(np.array(mask.astype(mx.float32)), np.array(table, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch", [(), (10,), (2, 10)])
@pytest.mark.parametrize("scale", [None, 0.8])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_attention_matches_the_reference(dtype, batch, scale, causal):
    """scaled_dot_product_attention_grouped on the course's odd GQA sizes: H_q = 18 over
    H = 6, L = 3, S = 7, D = 5, batch dims 0 to 2, an additive mask or "causal"."""
    rng = np.random.default_rng(len(batch) + 3 * causal)
    q = uniform(rng, (*batch, 18, 3, 5), dtype)
    k, v = (uniform(rng, (*batch, 6, 7, 5), dtype) for _ in range(2))
    mask = "causal" if causal else uniform(rng, (*batch, 18, 3, 7), dtype)
    out = tinyllm.scaled_dot_product_attention_grouped(q, k, v, scale=scale, mask=mask)
    check_result(out, q.shape, dtype)
    assert_attention_close(out, q, k, v, scale, mask)


def test_grouped_attention_broadcasts_a_mask_over_heads():
    """A mask of shape (L, S), or (B, 1, L, S), broadcast over the heads, as the course's mx.broadcast_to does."""
    rng = np.random.default_rng(2)
    q, k, v = normal(rng, (2, 4, 3, 8)), normal(rng, (2, 2, 5, 8)), normal(rng, (2, 2, 5, 8))
    for mask in (normal(rng, (3, 5)), normal(rng, (2, 1, 3, 5))):
        assert_attention_close(tinyllm.scaled_dot_product_attention_grouped(q, k, v, mask=mask), q, k, v, mask=mask)


# ---- week 2 ----


def test_week2_attention_keeps_bfloat16():
    """The course's check of week 2's readable attention: bfloat16 in, bfloat16 out, an
    explicit mask hiding the last key broadcast over heads."""
    rng = np.random.default_rng(3)
    q = normal(rng, (2, 4, 3, 16), "bfloat16")
    k, v = (normal(rng, (2, 2, 5, 16), "bfloat16") for _ in range(2))
    mask = mx.broadcast_to(mx.array([0, 0, 0, 0, -mx.inf], dtype=mx.bfloat16), (2, 1, 3, 5))
    out = tinyllm.scaled_dot_product_attention(q, k, v, 16**-0.5, mask)
    check_result(out, q.shape, "bfloat16")
    assert_attention_close(out, q, k, v, 16**-0.5, mask)


@pytest.mark.parametrize("L, contexts", [(1, (1, 31, 128, 129, 256)), (8, (8, 31, 127, 256))])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("explicit", [False, True])
def test_decode_attention_custom_on_qwens_boundaries(L, contexts, gqa, explicit):
    """decode_attention_custom, through ext.decode_attention, on the course's sweep:
    D = 128, bfloat16, 4 query heads over 4 or 1 key/value heads, contexts on both sides
    of its dispatch bounds, "causal" or a float32 mask of -2 on every fifth key."""
    rng = np.random.default_rng(L * gqa)
    for S in contexts:
        q = normal(rng, (1, 4, L, 128), "bfloat16")
        k, v = (normal(rng, (1, 4 // gqa, S, 128), "bfloat16") for _ in range(2))
        mask = mlx(np.where(np.arange(S) % 5 == 0, -2.0, 0.0).reshape(1, 1, 1, S)) if explicit else "causal"
        out = tinyllm.decode_attention_custom(q, k, v, 128**-0.5, mask)
        check_result(out, q.shape, "bfloat16")
        assert_attention_close(out, q, k, v, 128**-0.5, mask)
        want = tinyllm.scaled_dot_product_attention(q, k, v, 128**-0.5, mask)
        np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_ext_decode_attention_with_a_mask_and_the_causal_flag(dtype):
    """ext.decode_attention on flattened heads, (B * H_q, L, D) over (B * H_kv, S, D),
    with an explicit mask and is_causal together: both apply."""
    rng = np.random.default_rng(4)
    B, H_q, H_kv, L, S, D = 2, 6, 2, 3, 9, 16
    q, k, v = (
        normal(rng, (B, H_q, L, D), dtype),
        normal(rng, (B, H_kv, S, D), dtype),
        normal(rng, (B, H_kv, S, D), dtype),
    )
    m = rng.standard_normal((B, H_q, L, S))
    out = ext.decode_attention(
        q.reshape(B * H_q, L, D), k.reshape(B * H_kv, S, D), v.reshape(B * H_kv, S, D),
        mlx(m.reshape(B * H_q, L, S)), 0.3, True, True, H_q, H_kv,
    )  # fmt: skip
    check_result(out, (B * H_q, L, D), dtype)
    both = np.where(reference.visible_keys(L, S, "causal"), m, -np.inf)  # the array and the causal band
    assert_attention_close(out.reshape(B, H_q, L, D), q, k, v, 0.3, mlx(both))


@pytest.mark.parametrize("fn", ["scaled_dot_product_attention", "decode_attention_custom"])
def test_week2_rejects_an_unknown_mask_string(fn):
    """A mask string other than "causal" is the course's ValueError, "unsupported attention mask"."""
    q, k = mx.zeros((1, 4, 1, 128), dtype=mx.bfloat16), mx.zeros((1, 1, 1, 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="unsupported attention mask"):
        getattr(tinyllm, fn)(q, k, k, 128**-0.5, "sliding")


# ---- week 3 ----


def paged(rng, dtype="float32", L=1, lengths=(0, 1, 4, 5), page_size=4):
    """A paged problem as the course holds it: mx.arrays, int32 tables, -1 past the live pages."""
    q, kp, vp, table, lens = paged_problem(rng, B=len(lengths), L=L, lengths=lengths, page_size=page_size)
    return (mlx(q, dtype), mlx(kp, dtype), mlx(vp, dtype), mx.array(table.astype(np.int32)),
            mx.array(lens.astype(np.int32)))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("L, lengths, page_size", [(1, (0, 1, 4, 5), 4), (3, (3, 9, 0, 16), 4), (2, (2, 33), 16)])
def test_paged_attention_matches_the_reference(dtype, mask, L, lengths, page_size):
    """paged_attention, through ext.paged_attention: equal to the reference on the gathered
    pages; a request of 0 keys (a free slot of the batch) gives zeros."""
    q, kp, vp, table, lens = paged(np.random.default_rng(L), dtype, L, lengths, page_size)
    out = tinyllm.paged_attention(q, kp, vp, table, lens, page_size, mask=mask)
    check_result(out, q.shape, dtype)
    assert_paged_attention_close(out, q, kp, vp, table, lens, page_size, mask=mask)
    for b, n in enumerate(lengths):
        if n == 0:
            assert not np.array(out[b].astype(mx.float32)).any()


def test_ext_paged_attention_on_flattened_heads():
    """ext.paged_attention with the extension's shapes and keywords: (B * H_q, L, D) in and out."""
    q, kp, vp, table, lens = paged(np.random.default_rng(5), "bfloat16", L=2, lengths=(2, 7, 5))
    B, H_q, L, D = q.shape
    out = ext.paged_attention(q.reshape(B * H_q, L, D), kp, vp, table, lens, 0.5, is_causal=True,
                              num_kv_heads=kp.shape[1], num_heads=H_q)  # fmt: skip
    check_result(out, (B * H_q, L, D), "bfloat16")
    assert_paged_attention_close(out.reshape(B, H_q, L, D), q, kp, vp, table, lens, scale=0.5, mask="causal")


def test_a_decode_loop_through_the_pages_matches_dense_attention():
    """The course's week-3 loop on a CPU: each step writes each request's new key and
    value with ext.paged_cache_update (rebinding the pages, as the course does) and
    attends with paged_attention; every step equals grouped attention on the keys so far."""
    rng = np.random.default_rng(6)
    H_q, H_kv, D, page_size, n_pages = 4, 2, 8, 4, 12
    key_pages = mx.zeros((n_pages, H_kv, page_size, D), dtype=mx.bfloat16)
    value_pages = mx.zeros_like(key_pages)
    free = [int(p) for p in rng.permutation(n_pages)]
    pages = [[], []]
    keys, values = [[], []], [[], []]
    for _ in range(9):
        for b in range(2):
            n = len(keys[b])
            if n % page_size == 0:
                pages[b].append(free.pop())
            k, v = normal(rng, (1, H_kv, 1, D), "bfloat16"), normal(rng, (1, H_kv, 1, D), "bfloat16")
            key_pages = ext.paged_cache_update(key_pages, k, pages[b][-1], n % page_size)
            value_pages = ext.paged_cache_update(value_pages, v, pages[b][-1], n % page_size)
            keys[b].append(k)
            values[b].append(v)
        table = mx.array([p + [-1] * (3 - len(p)) for p in pages], dtype=mx.int32)
        lens = mx.array([len(keys[0]), len(keys[1])], dtype=mx.int32)
        q = normal(rng, (2, H_q, 1, D), "bfloat16")
        out = tinyllm.paged_attention(q, key_pages, value_pages, table, lens, page_size, mask="causal")
        for b in range(2):
            k, v = mx.concatenate(keys[b], axis=2), mx.concatenate(values[b], axis=2)
            assert_attention_close(out[b : b + 1], q[b : b + 1], k, v, mask="causal")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_cache_update_writes_one_slice_into_a_new_array(dtype):
    """paged_cache_update(pages, values, page_id, start): page page_id's rows start..start +
    length - 1 are values; every other element, and the pages given, are unchanged."""
    rng = np.random.default_rng(7)
    pages, values = normal(rng, (3, 2, 4, 5), dtype), normal(rng, (1, 2, 3, 5), dtype)
    before = np.array(pages.astype(mx.float32))
    updated = ext.paged_cache_update(pages, values, 2, 1)
    check_result(updated, pages.shape, dtype)
    want = before.copy()
    want[2, :, 1:4] = np.array(values.astype(mx.float32))[0]
    np.testing.assert_array_equal(np.array(updated.astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(pages.astype(mx.float32)), before)


# ---- the course's rules, each an error that says it ----


def ok_paged():
    """A valid week-3 call: 2 requests of 5 and 2 keys, pages of 4 rows, L = 2."""
    q = mx.zeros((2, 4, 2, 8))
    pages = mx.zeros((4, 2, 4, 8))
    table = mx.array([[2, 0], [1, -1]], dtype=mx.int32)
    lens = mx.array([5, 2], dtype=mx.int32)
    return q, pages, table, lens


def paged_call(fn="tinyllm", q=None, pages=None, table=None, lens=None, page_size=4, **kwargs):
    """A valid paged call, week 3's Python function or the extension's op, with arguments replaced."""
    q0, pages0, table0, lens0 = ok_paged()
    q, pages = q0 if q is None else q, pages0 if pages is None else pages
    table, lens = table0 if table is None else table, lens0 if lens is None else lens
    if fn == "ext":
        B, H_q, L, D = q.shape if q.ndim == 4 else (2, 4, 2, 8)
        flat = q.reshape(B * H_q, L, D) if q.ndim == 4 else q
        heads = {"num_kv_heads": pages.shape[1] if pages.ndim == 4 else 2, "num_heads": 4, **kwargs}
        return lambda: ext.paged_attention(flat, pages, pages, table, lens, 1.0, True, **heads)
    return lambda: tinyllm.paged_attention(q, pages, pages, table, lens, page_size, **kwargs)


def ints(rows):
    return mx.array(rows, dtype=mx.int32)


PAGED_ERRORS = [
    ("an array mask", paged_call(mask=mx.zeros((2, 4))), NotImplementedError, "mask", ("mask=None or causal",)),
    ("a mask string", paged_call(mask="sliding"), NotImplementedError, "mask", ("'sliding'",)),
    (
        "a table of int64",
        paged_call(table=mx.array([[2, 0], [1, -1]], dtype=mx.int64)),
        ValueError,
        "block_table",
        ("int32",),
    ),
    ("lengths of int64", paged_call(lens=mx.array([5, 2], dtype=mx.int64)), ValueError, "context_lens", ("int32",)),
    (
        "an unused entry not -1",
        paged_call(table=ints([[2, 0], [1, 3]])),
        ValueError,
        "block_table",
        ("-1 sentinel", "[1, 1]"),
    ),
    ("a live page shared", paged_call(table=ints([[2, 0], [2, -1]])), ValueError, "block_table", ("aliased",)),
    (
        "a live page outside the pages",
        paged_call(table=ints([[2, 4], [1, -1]])),
        ValueError,
        "block_table",
        ("outside physical page storage", "[0, 1]"),
    ),
    ("a live page -1", paged_call(table=ints([[2, -1], [1, -1]])), ValueError, "block_table", ("outside",)),
    ("a context beyond the table", paged_call(lens=ints([9, 2])), ValueError, "context_lens", ("not covered",)),
    (
        "a context shorter than L",
        paged_call(lens=ints([5, 1])),
        ValueError,
        "context_lens",
        ("zero or at least query length 2",),
    ),
    ("a negative context", paged_call(lens=ints([5, -1])), ValueError, "context_lens", ("nonnegative",)),
    ("page_size not the pages'", paged_call(page_size=8), ValueError, "page_size", ("does not match",)),
    (
        "float16 pages",
        paged_call(pages=mx.zeros((4, 2, 4, 8), dtype=mx.float16)),
        ValueError,
        "dtype",
        ("float32 or bfloat16",),
    ),
    ("a query of rank 3", paged_call(q=mx.zeros((4, 2, 8))), ValueError, "query", ("4D",)),
    ("heads not divisible", paged_call(pages=mx.zeros((4, 3, 4, 8))), ValueError, "heads", ()),
    ("a batch unlike the table's", paged_call(q=mx.zeros((3, 4, 2, 8))), ValueError, "batch", ()),
]

EXT_PAGED_ERRORS = [
    (
        "an int64 table",
        paged_call("ext", table=mx.array([[2, 0], [1, -1]], dtype=mx.int64)),
        ValueError,
        "block_table",
        ("int32",),
    ),
    (
        "float16 pages",
        paged_call("ext", pages=mx.zeros((4, 2, 4, 8), dtype=mx.float16)),
        ValueError,
        "key_pages",
        ("same float32 or bfloat16 dtype",),
    ),
    ("num_heads not a multiple", paged_call("ext", num_kv_heads=3), ValueError, "num_heads", ("divisible",)),
    (
        "pages of other heads",
        paged_call("ext", pages=mx.zeros((4, 1, 4, 8)), num_kv_heads=2),
        ValueError,
        "num_kv_heads",
        (),
    ),
    (
        "a table of another batch",
        paged_call("ext", table=ints([[2, 0]])),
        ValueError,
        "block_table",
        ("batch sizes must match",),
    ),
]


def decode_call(dtype=mx.float32, mask_dtype=mx.float32, D=16, kv_rows=2, mask_shape=(4, 1, 5), **kwargs):
    """A valid ext.decode_attention call, B = 1, 4 heads over 2, L = 1, S = 5, with an explicit mask."""
    q, k = mx.zeros((4, 1, D), dtype=dtype), mx.zeros((kv_rows, 5, D), dtype=dtype)
    mask = mx.zeros(mask_shape, dtype=mask_dtype)
    args = {"num_heads": 4, "num_kv_heads": 2, **kwargs}
    return lambda: ext.decode_attention(q, k, k, mask, 0.25, False, True, args["num_heads"], args["num_kv_heads"])


DECODE_ERRORS = [
    ("float64 operands", decode_call(dtype=mx.float64), ValueError, "dtypes", ("float32, float16 or bfloat16",)),
    ("a float16 mask", decode_call(mask_dtype=mx.float16), ValueError, "mask", ("float32",)),
    ("D above 256", decode_call(D=264), ValueError, "D", ("256",)),
    ("key rows of another batch", decode_call(kv_rows=4), ValueError, "num_kv_heads", ()),
    ("num_heads not a multiple", decode_call(num_kv_heads=3), ValueError, "num_heads", ()),
    ("a mask of the wrong shape", decode_call(mask_shape=(4, 1, 4)), ValueError, "mask", ("[B*Hq,L,S]",)),
]

UPDATE_ERRORS = [
    ("values of another dtype", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((1, 1, 2, 3),
     dtype=mx.bfloat16), 0, 0), ValueError, "values", ("same float32 or bfloat16 dtype",)),
    ("float16 pages", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3), dtype=mx.float16), mx.zeros((1, 1, 2, 3),
     dtype=mx.float16), 0, 0), ValueError, "pages", ()),
    ("values of two requests", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((2, 1, 2, 3)), 0, 0),
     ValueError, "values", ("[1, H, length, D]",)),
    ("values of other heads", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((1, 2, 2, 3)), 0, 0),
     ValueError, "values", ("head count",)),
    ("a page past the last", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((1, 1, 2, 3)), 2, 0),
     ValueError, "page", ("outside page storage",)),
    ("rows past the page", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((1, 1, 2, 3)), 1, 3),
     ValueError, "page", ("outside page storage",)),
    ("a negative start", lambda: ext.paged_cache_update(mx.zeros((2, 1, 4, 3)), mx.zeros((1, 1, 2, 3)), 1, -1),
     ValueError, "start", ()),
]  # fmt: skip

ERRORS = [
    *(("tinyllm.paged_attention", *row) for row in PAGED_ERRORS),
    *(("tinyllm.ext.paged_attention", *row) for row in EXT_PAGED_ERRORS),
    *(("tinyllm.ext.decode_attention", *row) for row in DECODE_ERRORS),
    *(("tinyllm.ext.paged_cache_update", *row) for row in UPDATE_ERRORS),
]


@pytest.mark.parametrize("function, description, fn, exception, argument, substrings", ERRORS,
                         ids=[f"{row[0]}: {row[1]}" for row in ERRORS])  # fmt: skip
def test_a_broken_rule_raises_naming_it(capfd, function, description, fn, exception, argument, substrings):
    """Each of the course's rules broken: its exception, naming the function, the argument
    and the rule in the course's words; nothing printed."""
    assert_raises_naming(capfd, fn, exception, argument, substrings, function=function)


def test_ext_paged_attention_names_a_live_entry_outside_the_pages(capfd):
    """The extension leaves the table to its caller; here npattn.paged_attention's own
    check names the entry, before anything is read."""
    fn = paged_call("ext", table=ints([[2, 7], [1, -1]]))
    assert_raises_naming(capfd, fn, ValueError, "block_table", ("[0, 1] = 7",), function="paged_attention")


def test_grouped_causal_needs_as_many_keys_as_queries():
    """The course's week-1 rule: mask="causal" with L > S is refused, not rows of zeros."""
    q, k = mx.zeros((2, 7, 4)), mx.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="causal attention requires S >= L"):
        tinyllm.scaled_dot_product_attention_grouped(q, k, k, mask="causal")


def test_simple_attention_takes_no_mask_string():
    """Day 1's mask is an array added to the scores; "causal" is day 3's."""
    q = mx.zeros((3, 4))
    with pytest.raises(TypeError, match="mask must be an array"):
        tinyllm.scaled_dot_product_attention_simple(q, q, q, mask="causal")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpy_arrays_go_in_too(dtype):
    """NumPy operands (bfloat16 through ml_dtypes) give the same mx.array as MLX's."""
    rng = np.random.default_rng(8)
    q, k, v = (normal(rng, (2, 3, 8), dtype) for _ in range(3))
    as_numpy = [np.array(x.astype(mx.float32)).astype(dtype_of(dtype)) for x in (q, k, v)]
    out = tinyllm.scaled_dot_product_attention_grouped(*as_numpy, mask="causal")
    want = tinyllm.scaled_dot_product_attention_grouped(q, k, v, mask="causal")
    check_result(out, q.shape, dtype)
    assert mx.array_equal(out, want).item()


def test_the_extensions_other_kernels_are_said_to_be_missing():
    """ext.rms_norm (a kernel of the course's extension that npattn does not compute) is an
    AttributeError that names the ops ext has."""
    with pytest.raises(AttributeError, match=r"attention ops only .* 'rms_norm' is one of its other kernels"):
        ext.rms_norm(None, None, 1e-5)
    assert not hasattr(ext, "quantized_matmul")

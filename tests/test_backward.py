"""SPEC section 7: npattn.sdpa_backward == the float64 reference's gradients
(helpers.backward_tolerance) for every mask kind, window, softcap, sinks, GQA,
broadcast batch, layout, dtype, kernel table and thread count; == PyTorch's
autograd in float64; == finite differences of the forward pass; bitwise the same
for the same threads; and its own error rows."""

import subprocess
import sys

import numpy as np
import pytest

import npattn
from helpers import (
    LAYOUTS,
    MASK_KINDS,
    assert_raises_naming,
    assert_within,
    backward_tolerance,
    check_backward,
    dtype_of,
    f64,
    failing_allocations,
    kernels,
    layout,
    make_mask,
    pool_mode,
    qkv,
    randn,
    runnable_kernels,
)

OPTIONS = {
    "plain": {},
    "sinks": {"sinks": np.array([-1.0, 0.5, 2.0, 0.0, 1.5, -3.0])},
    "softcap": {"softcap": 2.0},
    "window": {"window": (3, 1)},
    "positions": {"q_offset": 5, "k_offset": -2, "scale": -0.7},
    "everything": {"sinks": np.linspace(-2, 2, 6), "softcap": 1.5, "window": (None, 2), "scale": 1.3},
}


def grads_of(q, k, v, dout, **kwargs):
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **kwargs)
    return npattn.sdpa_backward(dout, q, k, v, out, lse, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
def test_matches_reference(rng, mask, options, dtype):
    """Every mask kind with every option, GQA groups of 3, odd sizes, each dtype."""
    kwargs = dict(OPTIONS[options])
    if mask == "causal_top_left" and "q_offset" in kwargs:
        kwargs.pop("q_offset")
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (2,), 6, 2, 7, 9, 5, 3, dtype=dtype)
    dout = randn(rng, (2, 6, 7, 3), dtype)
    check_backward(q, k, v, dout, mask=make_mask(rng, mask, (6, 7, 9), dtype), **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_layouts_and_broadcast_batch(rng, kind, dtype):
    """Operands in every layout (byte-swapped too), broadcast along batch dims: each
    gradient has its operand's shape and dtype, the broadcast summed back."""
    dtype = dtype_of(dtype)
    q = layout(rng, (2, 3, 4, 5, 6), dtype, kind)
    k = layout(rng, (3, 2, 8, 6), dtype, kind)
    v = layout(rng, (1, 1, 2, 8, 5), dtype, kind)
    dout = layout(rng, (2, 3, 4, 5, 5), dtype, kind)
    mask = make_mask(rng, "additive", (4, 1, 8))
    check_backward(q, k, v, dout, mask=mask, sinks=np.arange(4.0) - 2)


@pytest.mark.parametrize("dtypes", [("float32", "float64", "float16"), ("bfloat16", "float32", "float32")], ids=str)
def test_mixed_dtypes(rng, dtypes):
    """Each gradient in its own operand's dtype; computed in the result dtype."""
    q, k, v = qkv(rng, (), 4, 2, 5, 7, 6, dtypes=[dtype_of(d) for d in dtypes])
    dout = randn(rng, (4, 5, 6), np.float32)
    check_backward(q, k, v, dout, sinks=[0.5, -0.5, 1.0, 0.0])


def test_rank_2(rng):
    """Rank-2 operands: one head."""
    q, k, v = (randn(rng, s) for s in ((5, 8), (9, 8), (9, 3)))
    check_backward(q, k, v, randn(rng, (5, 3)), mask="causal_top_left", softcap=4.0)


@pytest.mark.parametrize(
    "batch, H_q, H_kv, L, S, D_v",
    [((0,), 2, 1, 3, 4, 2), ((), 0, 1, 3, 4, 2), ((), 2, 1, 0, 4, 2), ((), 2, 1, 3, 0, 2), ((), 2, 1, 3, 4, 0)],
    ids=["no batch", "no heads", "no rows", "no keys", "no value width"],
)
def test_empty_sizes(rng, batch, H_q, H_kv, L, S, D_v):
    """Empty sizes give gradients of the operands' shapes; with no keys (only the sink
    sees a row) or no value width, every gradient is zero."""
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, 4, D_v)
    dout = randn(rng, (*batch, H_q, L, D_v))
    sinks = np.ones(H_q)
    grads = check_backward(q, k, v, dout, sinks=sinks)
    if S == 0 or D_v == 0:
        for g in grads:
            np.testing.assert_array_equal(g, 0)


@pytest.mark.parametrize(
    "batch, H_q, H_kv, L, S, D",
    [((1,), 8, 1, 64, 1500, 64), ((2,), 16, 8, 100, 100, 64), ((1,), 2, 1, 1, 4000, 128), ((1,), 32, 8, 300, 300, 32)],
    ids=["one head split across threads", "many heads", "one query row", "Qwen-like group of 4"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_model_sizes_and_threads(rng, batch, H_q, H_kv, L, S, D, dtype):
    """Sizes whose key blocks are split across threads (a head's dQ summed from parts)
    and sizes with a task per head: each thread count == the reference, and bitwise the
    same call after call."""
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    dout = randn(rng, (*batch, H_q, L, D), dtype)
    for threads in (1, 2, 3):
        first = check_backward(q, k, v, dout, threads=threads, window=(700, None), softcap=20.0)
        again = grads_of(q, k, v, dout, threads=threads, window=(700, None), softcap=20.0)
        for a, b in zip(first[:3], again[:3]):
            np.testing.assert_array_equal(a, b)


def test_helpers_joining_do_not_change_the_bits(rng):
    """A small problem with helper threads forced to join gives the single thread's bits."""
    q, k, v = qkv(rng, (2,), 4, 2, 9, 11, 8)
    dout = randn(rng, (2, 4, 9, 8))
    alone = grads_of(q, k, v, dout, threads=4, sinks=np.ones(4))
    with pool_mode(2):
        joined = grads_of(q, k, v, dout, threads=4, sinks=np.ones(4))
    for a, b in zip(alone, joined):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("table", runnable_kernels())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernel_tables(rng, table, dtype):
    """Every SIMD table this CPU runs (the forward pass's softmax, conversions)."""
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (1,), 4, 2, 33, 70, 24, dtype=dtype)
    with kernels(table):
        check_backward(q, k, v, randn(rng, (1, 4, 33, 24), dtype), softcap=3.0, sinks=np.zeros(4))


@pytest.mark.parametrize("table", runnable_kernels())
@pytest.mark.parametrize("precision", ["highest", "fast"])
def test_bfloat16_gradients_and_subnormal_values(rng, table, precision):
    """bfloat16 q, k, v and dout (the table's bfloat16 dot products where it has them:
    S^T and dP^T under either precision, and under "fast" the products with the
    weights and dS rounded to bfloat16) within each precision's tolerance: odd rows,
    keys and widths, softcap, sinks, a window. A subnormal value, which those
    instructions read as 0, sends its tile to float32: a subnormal q against large
    keys, subnormal keys against large queries, a subnormal dout against large values
    and subnormal values against a large dout (dout scaled so that no gradient
    overflows)."""
    bf16 = dtype_of("bfloat16")
    tiny = float(pytest.importorskip("ml_dtypes").finfo(bf16).smallest_subnormal)
    with kernels(table):
        for H_q, H_kv, L, S, D, D_v in ((4, 2, 33, 70, 24, 24), (2, 1, 7, 301, 16, 8), (8, 2, 65, 90, 64, 32)):
            q, k, v = qkv(rng, (1,), H_q, H_kv, L, S, D, D_v, dtype=bf16)
            dout = randn(rng, (1, H_q, L, D_v), bf16)
            check_backward(q, k, v, dout, precision=precision)
            check_backward(q, k, v, dout, precision=precision, softcap=3.0, sinks=np.zeros(H_q), window=(40, 0))

        def subnormal(x):
            units = rng.integers(1, 2**7, size=x.shape) * rng.choice([-1, 1], size=x.shape)
            return (units * tiny).astype(bf16)

        def scaled(x, power):
            return (x.astype(np.float32) * np.float32(2.0**power)).astype(bf16)

        q, k, v = qkv(rng, (1,), 2, 1, 7, 40, 16, 16, dtype=bf16)
        dout = randn(rng, (1, 2, 7, 16), bf16)
        for args in (
            (subnormal(q), scaled(k, 125), v, scaled(dout, -20)),
            (scaled(q, 125), subnormal(k), v, scaled(dout, -20)),
            (q, k, scaled(v, 125), subnormal(dout)),
            (q, k, subnormal(v), scaled(dout, 120)),
        ):
            check_backward(*args, precision=precision)


def test_extremes_are_redone_in_double(rng):
    """float32 inputs whose intermediate products overflow float32 (values 1e36, so
    dP = dO . V reaches 1e37 * D) but whose gradients are representable."""
    q, k, v = qkv(rng, (1,), 2, 1, 6, 8, 4)
    v = v * np.float32(1e36)
    dout = randn(rng, (1, 2, 6, 4)) * np.float32(1e-30)
    grads = check_backward(q, k, v, dout)
    assert all(np.isfinite(g).all() for g in grads[:3])


def test_tiny_operands_and_a_huge_scale_do_not_underflow(rng):
    """float32, q and k about 1e-12, scale 1e23 (logits of order 1), v and dout about
    1e-16: the gradients are normal floats, within float32 rounding of the reference.
    0.2 formed dS . q and dS . k (about 1e-44, subnormal) before the scale and was 6% off."""
    q, k, v = qkv(rng, (1,), 4, 2, 9, 13, 8, 6)
    dout = randn(rng, (1, 4, 9, 6))
    q, k, v, dout = q * np.float32(1e-12), k * np.float32(1e-12), v * np.float32(1e-16), dout * np.float32(1e-16)
    grads = check_backward(q, k, v, dout, scale=1e23)
    assert all(np.abs(g).min() > np.finfo(np.float32).smallest_normal for g in grads[:3])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_one_hot_softmax_has_zero_dq_and_dk(rng, dtype):
    """Logits of about 1e10 (|q . k| about 1e4, scale 1e6): every row's softmax is
    one-hot, so the exact dq and dk are 0: dS_ij = P_ij (dP_ij - D_i) is 0 at the key
    of weight 1, whose value the output is, and the weight of every other key is 0.
    0.2 set D_i = dout . out against the recomputed dout . v_j, and their rounding,
    magnified by the scale, came out as inf in float16 and as garbage in float32. (dv
    is not checked: a weight recomputed from a float32 lse of 1e10, whose ulp is 1024,
    is 0 or 1.)"""
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (2,), 4, 2, 7, 11, 16, 24)
    q, k = (x * 50 for x in (q, k))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    dout = randn(rng, (2, 4, 7, 24), dtype)
    out, lse = npattn.sdpa(q, k, v, mask=None, scale=1e6, return_lse=True)
    weights = npattn.attention_weights(q, k, mask=None, scale=1e6)
    assert set(np.unique(f64(weights))) == {0.0, 1.0}  # one-hot
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, mask=None, scale=1e6)
    np.testing.assert_array_equal(f64(grads.dq), 0)
    np.testing.assert_array_equal(f64(grads.dk), 0)
    assert np.isfinite(f64(grads.dv)).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nan_in_a_query_row_reaches_only_the_keys_it_sees(rng, dtype):
    """NaN in query row 0, which sees key 0 only (causal, L = S = 300, more than one key
    block): dq's row 0, and dk's and dv's key 0, are NaN; every other gradient is what it
    is without the NaN. 0.2 made dk and dv NaN for all keys of key 0's block (hidden keys'
    weights exp(s - NaN) and 0 * NaN in the products). The forward pass keeps the NaN in
    row 0 too."""
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (1,), 2, 1, 300, 300, 8, 4, dtype=dtype)
    dout = randn(rng, (1, 2, 300, 4), dtype)
    clean_out, clean_lse = npattn.sdpa(q, k, v, return_lse=True)
    clean = npattn.sdpa_backward(dout, q, k, v, clean_out, clean_lse)
    q = q.copy()
    q[0, 1, 0, 3] = np.nan
    out, lse = npattn.sdpa(q, k, v, return_lse=True)
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(np.delete(out[0, 1], 0, axis=0)).all()
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, got, want, nan_rows in zip(("dq", "dk", "dv"), grads, clean, ([(1, 0)], [(0, 0)], [(0, 0)])):
        nan = np.zeros(got.shape, bool)
        for head, row in nan_rows:
            nan[0, head, row] = True
        assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any(), name
        np.testing.assert_allclose(got[~nan], want[~nan], rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=name)


@pytest.mark.parametrize("mask", ["causal", "additive"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_equals_torch_autograd_float64(rng, mask, scale):
    """PyTorch's autograd through F.scaled_dot_product_attention in float64, GQA by
    enable_gqa, the mask given to both as the same additive array."""
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng, (2,), 6, 2, 7, 11, 8, 5, dtype=np.float64)
    dout = randn(rng, (2, 6, 7, 5), np.float64)
    bias = np.where(npattn.reference.visible_keys(7, 11), 0.0, -np.inf) if mask == "causal" else None
    if mask == "additive":
        bias = make_mask(rng, "additive", (6, 7, 11), np.float64, empty_rows=False)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(bias), scale=scale, enable_gqa=True
    )
    out.backward(torch.from_numpy(dout))
    grads = grads_of(q, k, v, dout, mask=bias, scale=scale)
    tolerance = backward_tolerance(q, k, v, dout, np.dtype(np.float64), mask=bias, scale=scale)
    for name, got, t in zip(("dq", "dk", "dv"), grads, (tq, tk, tv)):
        assert_within(got, t.grad.numpy(), *tolerance[name], name)


def test_finite_differences(rng):
    """Each gradient entry == the central difference of sum(dout * sdpa(...)) in float64,
    through every option at once: mask, sinks, softcap, window, GQA, broadcast batch.
    Step h = 1e-6: truncation h^2 and rounding eps / h, both far under the 1e-7 allowed."""
    q, k, v = qkv(rng, (2,), 2, 1, 3, 5, 3, 2, dtype=np.float64)
    k = k[:1]  # broadcast along the batch
    dout = randn(rng, (2, 2, 3, 2), np.float64)
    kwargs = {
        "mask": make_mask(rng, "additive", (2, 3, 5), np.float64, empty_rows=False),
        "softcap": 1.2,
        "window": (3, 1),
        "q_offset": 1,
    }
    sinks = np.array([0.3, -0.4])

    def loss(q, k, v, sinks):
        return float((dout * npattn.sdpa(q, k, v, sinks=sinks, **kwargs)).sum())

    grads = grads_of(q, k, v, dout, sinks=sinks, **kwargs)
    h = 1e-6
    operands = [q, k, v, sinks]
    for index, (x, grad) in enumerate(zip(operands, grads)):
        numeric = np.empty_like(x)
        for i in np.ndindex(x.shape):
            shifted = []
            for step in (h, -h):
                y = x.copy()
                y[i] += step
                shifted.append(loss(*operands[:index], y, *operands[index + 1 :]))
            numeric[i] = (shifted[0] - shifted[1]) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=grads._fields[index])
    assert np.abs(grads.dsinks).min() > 1e-3  # the sinks matter here


def test_grads_is_a_named_tuple(rng):
    q, k, v = qkv(rng, (), 2, 1, 3, 4, 5)
    grads = grads_of(q, k, v, np.ones((2, 3, 5), np.float32))
    assert isinstance(grads, tuple) and grads._fields == ("dq", "dk", "dv", "dsinks")
    dq, dk, dv, dsinks = grads
    assert dq is grads.dq and dsinks is None


# ---- errors ----

Q, K, V = (np.ones(s, np.float32) for s in ((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 6)))
OUT, LSE = npattn.sdpa(Q, K, V, return_lse=True)


def backward(**change):
    arguments = {"dout": np.ones_like(OUT), "q": Q, "k": K, "v": V, "out": OUT, "lse": LSE, **change}
    return lambda: npattn.sdpa_backward(**arguments)


ERROR_ROWS = [
    ("dout of the wrong shape", backward(dout=np.ones((1, 4, 3, 5))), ValueError, "dout", ("(1, 4, 3, 6)",)),
    ("dout of ints", backward(dout=np.ones(OUT.shape, int)), TypeError, "dout", ("int64",)),
    ("dout complex", backward(dout=np.ones(OUT.shape, complex)), TypeError, "dout", ()),
    ("dout None", backward(dout=None), TypeError, "dout", ()),
    ("out of the wrong shape", backward(out=OUT[..., :2]), ValueError, "out", ("(1, 4, 3, 6)",)),
    ("lse of the wrong shape", backward(lse=LSE[..., None]), ValueError, "lse", ("(1, 4, 3)",)),
    ("lse of a rank-2 problem", backward(lse=np.ones(3)), ValueError, "lse", ()),
    ("q of the wrong width", backward(q=np.ones((1, 4, 3, 7))), ValueError, "q", ()),
    ("sinks of the wrong length", backward(sinks=np.ones(3)), ValueError, "sinks", ()),
    ("threads 0", backward(threads=0), ValueError, "threads", ()),
    ("softcap negative", backward(softcap=-1.0), ValueError, "softcap", ()),
]


@pytest.mark.parametrize("description, fn, exception, argument, substrings", ERROR_ROWS, ids=[r[0] for r in ERROR_ROWS])
def test_invalid_input_raises_naming_the_argument(capfd, description, fn, exception, argument, substrings):
    """The message starts "sdpa_backward: " and names the argument; nothing on stderr."""
    assert_raises_naming(capfd, fn, exception, argument, substrings, function="sdpa_backward")


@pytest.mark.parametrize(
    "dtype, L, S, threads, n_alloc",
    [
        (np.float64, 40, 50, 1, 1),  # scratch
        (np.float64, 1, 3000, 2, 2),  # scratch, dQ partials
        (np.float32, 40, 50, 1, 2),  # scratch, the exact path's table
        (np.float32, 1, 3000, 2, 3),  # and the partials
    ],
)
def test_core_allocation_failure_is_memory_error(capfd, dtype, L, S, threads, n_alloc):
    """Every allocation of the backward core, made to fail in turn, gives MemoryError; the
    next call works; with exactly enough allocations the call succeeds."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (1,), 2, 1, L, S, 16, 8, dtype=dtype)
    dout = randn(rng, (1, 2, L, 8), dtype)
    out, lse = npattn.sdpa(q, k, v, return_lse=True, threads=threads)
    want = npattn.sdpa_backward(dout, q, k, v, out, lse, threads=threads)
    for n in range(n_alloc):
        with failing_allocations(n), pytest.raises(MemoryError, match=r"^sdpa_backward: could not allocate"):
            npattn.sdpa_backward(dout, q, k, v, out, lse, threads=threads)
    with failing_allocations(n_alloc):
        got = npattn.sdpa_backward(dout, q, k, v, out, lse, threads=threads)
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)
    assert f64(got.dq).shape == q.shape
    assert capfd.readouterr().err == ""


BROADCASTS = {
    "k, v over a batch of 4": ((4,), (1,), (1,)),
    "k, v without batch dims": ((3,), (), ()),
    "k, v over the first of two dims": ((2, 3), (1, 3), (1, 3)),
    "k, v over the second of two dims": ((3, 2), (3, 1), (3, 1)),
    "k and v over different dims": ((2, 3), (1, 3), (2, 1)),
    "q, k over the same dim": ((1, 3), (1, 3), (2, 3)),
    "q alone": ((1, 3), (2, 3), (2, 3)),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("batches", BROADCASTS.values(), ids=list(BROADCASTS))
@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
def test_broadcast_operands_sum_their_gradients(rng, mask, batches, threads):
    """k and v (and q) broadcast along batch dims: each gradient, summed in place over
    the dims its operand was broadcast along, == the reference's summed gradient."""
    bq, bk, bv = batches
    q = randn(rng, (*bq, 6, 5, 4))
    k, v = randn(rng, (*bk, 2, 9, 4)), randn(rng, (*bv, 2, 9, 3))
    B = np.broadcast_shapes(bq, bk, bv)
    dout = randn(rng, (*B, 6, 5, 3))
    with pool_mode(2):  # helpers join however small the problem
        mask = make_mask(rng, mask, (*B, 6, 5, 9))
        check_backward(q, k, v, dout, mask=mask, sinks=np.linspace(-1, 1, 6), threads=threads)


def test_an_empty_batch_gives_zero_gradients_to_broadcast_operands(rng):
    """k and v broadcast along an empty batch dim: dk and dv, sums over no entry, are
    zeros of their own shapes (the core visits no entry)."""
    q, dout = randn(rng, (0, 3, 4, 5, 8)), randn(rng, (0, 3, 4, 5, 6))
    k, v = randn(rng, (1, 1, 2, 300, 8)), randn(rng, (1, 2, 300, 6))
    grads = check_backward(q, k, v, dout, sinks=np.ones(4))
    for g in grads:
        np.testing.assert_array_equal(g, 0)


def test_broadcast_gradients_are_bitwise_repeatable(rng):
    """The same threads give the same bits when k and v are summed over a batch."""
    q, dout = randn(rng, (2, 5, 4, 7, 16)), randn(rng, (2, 5, 4, 7, 8))
    k, v = randn(rng, (1, 5, 2, 300, 16)), randn(rng, (1, 5, 2, 300, 8))
    with pool_mode(2):
        first = grads_of(q, k, v, dout, threads=3, mask=None)
        again = grads_of(q, k, v, dout, threads=3, mask=None)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


PEAK_MEMORY = r"""
import resource
import numpy as np
import npattn

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

# k and v broadcast over a batch of 64 decode steps: dk and dv are 4 MiB together.
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 2, 4096, 64)).astype(np.float32)
v = rng.standard_normal((1, 2, 4096, 64)).astype(np.float32)
q = rng.standard_normal((64, 4, 1, 64)).astype(np.float32)
out, lse = npattn.sdpa(q, k, v, return_lse=True, threads=1)
dout = np.ones_like(out)
one = npattn.sdpa_backward(dout[:1], q[:1], k, v, out[:1], lse[:1], threads=1)  # batch 1: the baseline
before = peak()
grads = npattn.sdpa_backward(dout, q, k, v, out, lse, threads=1)
print(peak() - before, grads.dk.nbytes + grads.dv.nbytes, grads.dk.shape == k.shape)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_broadcast_kv_gradients_take_their_own_size_not_the_batch():
    """k, v broadcast over a batch of 64: the backward's peak memory beyond the same call
    at batch 1 stays within a few times dk and dv's size (it was 64 copies of them,
    summed afterwards: issue 19, item 8)."""
    done = subprocess.run([sys.executable, "-c", PEAK_MEMORY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grown, grads, own_shape = done.stdout.split()
    assert own_shape == "True"
    grown, grads = int(grown), int(grads)
    assert grown < 3 * grads + (8 << 20), f"peak grew {grown >> 20} MiB for {grads >> 20} MiB of dk, dv"

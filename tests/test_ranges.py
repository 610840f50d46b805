"""Per-request key ranges (k_start, k_lengths) and per-request q_offset.

npattn.sdpa and attention_weights with ranges == the float64 reference for
every mask kind, window, sinks, softcap and dtype; a right-aligned batch cache
equals one call per request on its slice; rows outside a range are never
read (NaN there changes nothing); the decode (streaming), prefill (gemm) and
split-K paths agree with the reference; sdpa_backward gives unread rows a
gradient of exactly 0; ranges outside [0, S] name the argument and the
request.
"""

import numpy as np
import pytest

import npattn
from helpers import MASK_KINDS, check, check_backward, f64, make_mask, own_tolerance, qkv
from npattn import reference, testing

# (k_start, k_lengths) for a batch of 4 requests over S = 11 keys: empty, one key,
# all of them, a middle slice, and an empty range at k_start = S
RANGES = [
    ([0, 0, 0, 3], [0, 1, 11, 5]),
    ([11, 10, 0, 4], [0, 1, 11, 7]),
    (None, [11, 3, 0, 1]),
    ([0, 2, 5, 11], None),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("window", [None, (2, 0), (None, 1)], ids=str)
@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
@pytest.mark.parametrize("k_start, k_lengths", RANGES, ids=str)
def test_ranges_with_every_mask_kind(rng, mask, window, dtype, k_start, k_lengths):
    """Ranges intersect every mask kind and window; lse comes back too."""
    q, k, v = qkv(rng, (4,), 6, 2, 5, 11, 8, 5, dtype=dtype)
    m = make_mask(rng, mask, (4, 6, 5, 11), dtype)
    check(q, k, v, mask=m, window=window, k_start=k_start, k_lengths=k_lengths, return_lse=True)


@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
@pytest.mark.parametrize("k_start, k_lengths", RANGES, ids=str)
def test_attention_weights_with_ranges(rng, mask, k_start, k_lengths):
    """The weights of keys outside a request's range are exactly 0; the rest are the reference's."""
    q, k, _ = qkv(rng, (4,), 4, 2, 3, 11, 8, dtype=np.float64)
    m = make_mask(rng, mask, (4, 4, 3, 11), np.float64)
    got = npattn.attention_weights(q, k, mask=m, k_start=k_start, k_lengths=k_lengths)
    want = reference.attention_weights(q, k, mask=m, k_start=k_start, k_lengths=k_lengths)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    start = np.zeros(4, int) if k_start is None else np.array(k_start)
    end = start + (11 - start if k_lengths is None else np.array(k_lengths))
    j = np.arange(11)
    outside = (j < start[:, None]) | (j >= end[:, None])  # (B, S)
    assert np.all(np.broadcast_to(outside[:, None, None, :], got.shape) <= (got == 0))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("mask", ["causal", None])
def test_ranges_with_sinks_and_softcap(rng, mask, softcap):
    """A sink joins each request's denominator, even one with no key (out 0, lse = sink)."""
    q, k, v = qkv(rng, (4,), 4, 2, 3, 11, 8, 6)
    sinks = rng.standard_normal(4)
    ranges = {"k_start": [0, 11, 2, 4], "k_lengths": [11, 0, 1, 5]}
    out, lse = check(q, k, v, mask=mask, sinks=sinks, softcap=softcap, return_lse=True, **ranges)
    assert np.all(out[1] == 0)
    np.testing.assert_allclose(lse[1], np.broadcast_to(sinks[:, None], (4, 3)), rtol=1e-6)


@pytest.mark.parametrize(
    "k_start, k_lengths",
    [
        (3, None),  # one int for every request
        (np.array([[0], [4]]), 5),  # (B1, 1) against B = (2, 3)
        (np.array([1, 0, 6]), np.array([[2, 9, 3], [0, 4, 5]])),  # (B2,) and (B1, B2)
        ([2], [[5], [1]]),
    ],
    ids=["scalar", "B1x1", "B2-and-B1xB2", "lists"],
)
def test_broadcasting(rng, k_start, k_lengths):
    """k_start and k_lengths broadcast to the batch shape B, by NumPy's rules."""
    q, k, v = qkv(rng, (2, 3), 4, 2, 2, 11, 8)
    check(q, k, v, k_start=k_start, k_lengths=k_lengths, return_lse=True)


@pytest.mark.parametrize("int_dtype", [np.int8, np.uint8, np.int32, np.uint64, np.int64])
def test_any_integer_dtype(rng, int_dtype):
    """Any integer dtype reads as the same ranges."""
    q, k, v = qkv(rng, (3,), 2, 1, 2, 9, 8)
    got = npattn.sdpa(q, k, v, k_start=np.array([0, 3, 9], int_dtype), k_lengths=np.array([9, 2, 0], int_dtype))
    want = npattn.sdpa(q, k, v, k_start=[0, 3, 9], k_lengths=[9, 2, 0])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_right_aligned_cache_is_one_call_per_request(rng, L, dtype):
    """The course's right-aligned batch cache (request b in the last n[b] rows) is
    k_start=S - n, k_lengths=n: equal to a call per request on its own slice."""
    S, n = 13, np.array([13, 5, 1, 0])
    q, k, v = qkv(rng, (4,), 4, 2, L, S, 8, 6, dtype=dtype)
    got = npattn.sdpa(q, k, v, k_start=S - n, k_lengths=n)
    for b in range(4):
        part = (q[b], k[b, :, S - n[b] :], v[b, :, S - n[b] :])
        _, atol = own_tolerance(*part, np.dtype(dtype))
        np.testing.assert_allclose(got[b], npattn.sdpa(*part), rtol=0, atol=atol)
        np.testing.assert_allclose(f64(got[b]), reference.sdpa(*(f64(x) for x in part)), rtol=0, atol=atol)


@pytest.mark.parametrize("L", [1, 3, 40])
def test_padding_is_never_read(rng, L):
    """A right-padded cache whose padding holds NaN: the rows past k_lengths are never
    read, so the result, lse and weights are those of the unpadded requests."""
    S, n = 70, np.array([70, 33, 1, 0])
    q, k, v = qkv(rng, (4,), 4, 2, L, S, 16, 8)
    for b in range(4):
        k[b, :, n[b] :] = np.nan
        v[b, :, n[b] :] = np.nan
    for mask in ["causal", None, "causal_top_left"]:
        out, lse = check(q, k, v, mask=mask, k_lengths=n, return_lse=True)
        weights = npattn.attention_weights(q, k, mask=mask, k_lengths=n)
        assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(weights).any()
        for b in range(4):
            alone = npattn.sdpa(q[b], k[b, :, : n[b]], v[b, :, : n[b]], mask=mask)
            _, atol = own_tolerance(q[b], k[b, :, : n[b]], v[b, :, : n[b]], np.dtype(np.float32))
            np.testing.assert_allclose(out[b], alone, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "L, threads, heads",
    [(1, 1, (8, 2)), (1, 4, (2, 1)), (64, 2, (4, 2)), (2, 4, (1, 1))],
    ids=["decode-stream", "decode-split-k", "prefill-gemm", "split-k-two-rows"],
)
def test_paths(rng, L, threads, heads):
    """Decode (streaming kernels), prefill (gemms) and split-K over few heads (threads > 1)
    all give the reference's result per request."""
    S = 3000
    q, k, v = qkv(rng, (3,), heads[0], heads[1], L, S, 64)  # enough work for 4 threads: split-K for few units
    k_start, k_lengths = [0, 700, 2999], [3000, 2100, 1]
    check(q, k, v, k_start=k_start, k_lengths=k_lengths, threads=threads, return_lse=True)
    check(q, k, v, k_start=k_start, k_lengths=k_lengths, threads=threads, window=(600, 0))


@pytest.mark.parametrize("mask", ["causal", None, "bool"])
@pytest.mark.parametrize(
    "q_offset, k_start, k_lengths",
    [
        ([0, 5, -2], None, None),  # positions alone
        (np.array([[3], [0]]), 2, None),  # (B1, 1) against B = (2, 3)
        (4, [0, 1, 2], [9, 4, 0]),  # one int with ranges: positions count from each k_start
        ([7, 2, 0], [0, 1, 2], [9, 4, 8]),
    ],
    ids=["alone", "broadcast", "scalar-with-ranges", "array-with-ranges"],
)
def test_array_q_offset(rng, mask, q_offset, k_start, k_lengths):
    """q_offset may be an int array broadcastable to B: one position per request."""
    batch = (2, 3)
    q, k, v = qkv(rng, batch, 4, 2, 3, 10, 8)
    m = make_mask(rng, mask, (*batch, 4, 3, 10))
    check(q, k, v, mask=m, q_offset=q_offset, k_start=k_start, k_lengths=k_lengths, window=(5, 1), return_lse=True)


def test_default_q_offset_is_each_requests_bottom_right(rng):
    """By default query row 0 of request b sits at k_offset + k_lengths[b] - L: the same
    result as giving that array."""
    q, k, v = qkv(rng, (3,), 2, 1, 4, 12, 8)
    n = np.array([12, 6, 2])
    got = npattn.sdpa(q, k, v, k_start=12 - n, k_lengths=n, k_offset=100)
    given = npattn.sdpa(q, k, v, k_start=12 - n, k_lengths=n, k_offset=100, q_offset=100 + n - 4)
    np.testing.assert_array_equal(got, given)
    check(q, k, v, k_start=12 - n, k_lengths=n, k_offset=100)


def test_rank2_takes_scalar_ranges(rng):
    """Rank-2 operands have B = (): one request, its range an int."""
    q, k, v = qkv(rng, (), 1, 1, 3, 9, 8)
    got = check(q[0], k[0], v[0], k_start=2, k_lengths=5)
    np.testing.assert_allclose(got, npattn.sdpa(q[0], k[0, 2:7], v[0, 2:7]), rtol=0, atol=1e-6)


def test_assert_attention_close_takes_ranges(rng):
    """npattn.testing checks a ranged result against the reference with the same
    ranges, and refuses the result computed without them."""
    q, k, v = qkv(rng, (3,), 4, 2, 2, 9, 8)
    kw = {"k_start": [0, 4, 9], "k_lengths": [9, 3, 0]}
    testing.assert_attention_close(npattn.sdpa(q, k, v, **kw), q, k, v, **kw)
    with pytest.raises(AssertionError, match="k_lengths"):
        testing.assert_attention_close(npattn.sdpa(q, k, v), q, k, v, **kw)


def test_reference_names_the_request(rng):
    """The reference refuses a range outside [0, S] as sdpa does."""
    q, k, v = qkv(rng, (2,), 1, 1, 2, 7, 4)
    with pytest.raises(ValueError, match=r"k_lengths\[1\] = 9 runs past S = 7 \(k_start\[1\] = 2\)"):
        reference.sdpa(q, k, v, k_start=[0, 2], k_lengths=[1, 9])
    with pytest.raises(ValueError, match=r"k_lengths\[1\] = 9 runs past S = 7 \(k_start\[1\] = 2\)"):
        npattn.sdpa(q, k, v, k_start=[0, 2], k_lengths=[1, 9])


@pytest.mark.parametrize(
    "q_offset, k_offset, k_start",
    [(-(2**63), 1, None), (-(2**63), 2**62, None), ([-(2**63)], 0, 0), (-(2**63) + 1, 2**63 - 1, [3])],
)
def test_diagonal_below_int64_hides_every_key(rng, q_offset, k_offset, k_start):
    """A request's diagonal q_offset - k_offset + k_start below -2**63 (its first step
    wrapping past int64) hides every key under "causal": rows of zeros, lse -inf."""
    q, k, v = qkv(rng, (1,), 2, 1, 3, 6, 4, dtype=np.float64)
    out, lse = check(q, k, v, q_offset=q_offset, k_offset=k_offset, k_start=k_start, return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("softcap, sinks", [(None, False), (3.0, True)])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool"], ids=str)
@pytest.mark.parametrize("k_start, k_lengths", RANGES, ids=str)
def test_backward_with_ranges(rng, mask, softcap, sinks, dtype, k_start, k_lengths):
    """sdpa_backward with key ranges == the reference's gradients; keys a request does
    not read get dk = dv = 0 exactly."""
    q, k, v = qkv(rng, (4,), 4, 2, 5, 11, 8, 6, dtype=dtype)
    dout = rng.standard_normal((4, 4, 5, 6)).astype(dtype)
    m = make_mask(rng, mask, (4, 4, 5, 11))
    s = rng.standard_normal(4) if sinks else None
    grads = check_backward(
        q, k, v, dout, mask=m, softcap=softcap, sinks=s, window=(4, 2), k_start=k_start, k_lengths=k_lengths
    )
    start = np.zeros(4, int) if k_start is None else np.array(k_start)
    end = start + (11 - start if k_lengths is None else np.array(k_lengths))
    j = np.arange(11)
    outside = (j < start[:, None]) | (j >= end[:, None])  # (B, S)
    assert np.all(grads.dk[outside[:, None, :].repeat(2, axis=1)] == 0)
    assert np.all(grads.dv[outside[:, None, :].repeat(2, axis=1)] == 0)


@pytest.mark.parametrize("threads", [1, 4])
def test_backward_never_reads_padding(rng, threads):
    """A right-padded cache whose padding holds NaN: the gradients are those of zero
    padding, bit for bit, with dk = dv = 0 on the padding; split-K over few heads
    (threads=4, many key blocks) and one thread alike."""
    S, n = 1500, np.array([1500, 700, 1])
    q, k, v = qkv(rng, (3,), 2, 1, 4, S, 16)
    dout = rng.standard_normal((3, 2, 4, 16)).astype(np.float32)
    check_backward(q, k, v, dout, k_lengths=n, threads=threads)
    zero_k, zero_v, nan_k, nan_v = k.copy(), v.copy(), k.copy(), v.copy()
    for b in range(3):
        zero_k[b, :, n[b] :] = zero_v[b, :, n[b] :] = 0
        nan_k[b, :, n[b] :] = nan_v[b, :, n[b] :] = np.nan
    runs = []
    for kk, vv in ((zero_k, zero_v), (nan_k, nan_v)):
        out, lse = npattn.sdpa(q, kk, vv, k_lengths=n, return_lse=True, threads=threads)
        runs.append(npattn.sdpa_backward(dout, q, kk, vv, out, lse, k_lengths=n, threads=threads))
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(runs[1], name), getattr(runs[0], name), err_msg=name)
    for b in range(3):
        assert np.all(runs[1].dk[b, :, n[b] :] == 0) and np.all(runs[1].dv[b, :, n[b] :] == 0)


def test_backward_with_array_q_offset(rng):
    """sdpa_backward takes an array q_offset, with and without ranges."""
    q, k, v = qkv(rng, (2, 3), 2, 1, 3, 10, 8, dtype=np.float64)
    dout = rng.standard_normal((2, 3, 2, 3, 8))
    check_backward(q, k, v, dout, q_offset=np.array([[3], [0]]))
    check_backward(q, k, v, dout, q_offset=[7, 2, 0], k_start=[0, 1, 2], k_lengths=[9, 4, 8], window=(3, 1))


@pytest.mark.parametrize("threads", [1, 2])
def test_backward_ranges_with_kv_broadcast_sum_each_request_own_gradients(threads):
    """k and v broadcast over a batch of requests with their own key ranges: dk and dv
    (at k's and v's own batch shape) are the sums of each request's separate gradients,
    zeros on the keys no request reads."""
    rng = np.random.default_rng(1)
    q, do = rng.standard_normal((3, 4, 5, 8)), rng.standard_normal((3, 4, 5, 6))
    k, v = rng.standard_normal((1, 2, 9, 8)), rng.standard_normal((1, 2, 9, 6))
    k_start, k_lengths = np.array([1, 3, 0]), np.array([2, 5, 7])  # key 8 unread by all
    out, lse = npattn.sdpa(q, k, v, k_start=k_start, k_lengths=k_lengths, return_lse=True, threads=threads)
    got = npattn.sdpa_backward(do, q, k, v, out, lse, k_start=k_start, k_lengths=k_lengths, threads=threads)
    want_dk, want_dv = np.zeros_like(k), np.zeros_like(v)
    for b in range(3):
        each = reference.sdpa_backward(
            do[b : b + 1], q[b : b + 1], k, v, None, None, k_start=k_start[b], k_lengths=k_lengths[b]
        )
        want_dk += each[1]
        want_dv += each[2]
    assert got.dk.shape == k.shape and got.dv.shape == v.shape
    np.testing.assert_allclose(got.dk, want_dk, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got.dv, want_dv, rtol=1e-12, atol=1e-13)
    assert not got.dk[..., 8, :].any() and not got.dv[..., 8, :].any()


def test_reference_takes_k_start_alone_for_one_request(rng):
    """With batch shape B = () (rank-3 operands here) and k_start alone, the reference's
    default k_lengths = S - k_start is the request's own: the call equals one on the slice
    (the reference took S - k_start for an array and failed)."""
    q, k, v = (x[0] for x in qkv(rng, (1,), 2, 1, 3, 9, 8, dtype=np.float64))
    for k_start in (2, np.array(2, np.int16), np.uint8(9)):
        got = reference.sdpa(q, k, v, k_start=k_start, return_lse=True)
        want = reference.sdpa(q, k[:, int(k_start) :], v[:, int(k_start) :], return_lse=True)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-15)
        np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
        check(q, k, v, k_start=k_start, return_lse=True)


def test_lse_tolerance_reads_the_batch_dims_of_v(rng):
    """The batch shape B that per-request arguments broadcast to includes v's batch dims:
    the check of lse (a tolerance taken with a v of ones) computes at that B too."""
    q, k, _ = qkv(rng, (), 2, 1, 3, 7, 8)
    v = rng.standard_normal((2, 1, 7, 4)).astype(np.float32)
    check(q, k, v, k_lengths=np.array([7, 3]), q_offset=np.array([4, 0]), return_lse=True)

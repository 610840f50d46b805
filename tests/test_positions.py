"""SPEC section 6: positions, windows, softcap, log-sum-exp, merge and attention
weights. npattn.sdpa == the reference for every combination with the mask
kinds, sinks, dtypes, layouts and threads; splitting the keys and merging the
parts equals the whole call; keys outside a window are never read."""

import numpy as np
import pytest

import npattn
from helpers import MASK_KINDS, check, f64, layout, make_mask, own_tolerance, qkv, reference_call
from npattn import reference

WINDOWS = [None, (0, 0), (3, 0), (None, 2), (5, 5), (0, None)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
def test_window_with_every_mask_kind(rng, mask, window, dtype):
    """A window intersects every kind of mask; lse comes back too."""
    q, k, v = qkv(rng, (2,), 6, 2, 9, 13, 8, 5, dtype=dtype)
    check(q, k, v, mask=make_mask(rng, mask, (2, 6, 9, 13), dtype), window=window, return_lse=True)


@pytest.mark.parametrize(
    "q_offset, k_offset", [(None, 0), (0, 0), (40, 35), (-3, 0), (7, -4), (2**62, 2**62), (-(2**62), 2**62)]
)
@pytest.mark.parametrize("mask", ["causal", None, "bool"])
@pytest.mark.parametrize("window", [None, (4, 1)], ids=str)
def test_positions(rng, q_offset, k_offset, mask, window):
    """q_offset and k_offset place the rows; huge offsets saturate rather than wrap."""
    q, k, v = qkv(rng, (1,), 4, 2, 6, 11, 8)
    check(
        q,
        k,
        v,
        mask=make_mask(rng, mask, (4, 6, 11)),
        window=window,
        q_offset=q_offset,
        k_offset=k_offset,
        return_lse=True,
    )


BIG = 2**63 - 1


@pytest.mark.parametrize(
    "q_offset, k_offset, window, causal",
    [
        (2**62 + 3, -(2**62) - 2, (BIG, 0), False),  # q - k = 2^63 + 5: keys from i + 6 on, causal side open
        (2**62 + 3, -(2**62) - 2, (BIG, None), True),  # the same band from causal
        (-(2**62) - 1, 2**62, (None, BIG), False),  # q - k = -2^63 - 1: keys up to i - 2
        (2**62, -(2**62), (2, 0), False),  # q - k = 2^63: no key
        (-(2**62), 2**62, (0, BIG), False),  # q - k = -2^63: keys from i on
    ],
)
def test_offsets_whose_difference_passes_int64(rng, q_offset, k_offset, window, causal):
    """q_offset - k_offset beyond +-2^63 with a window that brings the band back within
    the keys: row i sees exactly the keys j with lo <= (q_offset + i) - (k_offset + j) <= hi,
    evaluated in Python's exact integers."""
    L, S = 5, 9
    q, k, _ = qkv(rng, (1,), 1, 1, L, S, 4)
    left, right = window
    got = npattn.attention_weights(
        q, k, mask="causal" if causal else None, window=window, q_offset=q_offset, k_offset=k_offset
    )
    want = np.zeros((L, S), bool)
    for i in range(L):
        for j in range(S):
            gap = (q_offset + i) - (k_offset + j)  # how far key j lies behind row i
            want[i, j] = (left is None or gap <= left) and (right is None or -gap <= right) and (not causal or gap >= 0)
    np.testing.assert_array_equal(got[0, 0] != 0, want)


def test_default_positions_are_bottom_right_and_top_left_is_q_offset_zero(rng):
    """The defaults (q_offset = S - L, k_offset = 0) give "causal" exactly, and
    "causal_top_left" is "causal" with q_offset=0, bitwise."""
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8)
    np.testing.assert_array_equal(npattn.sdpa(q, k, v, threads=1), npattn.sdpa(q, k, v, q_offset=4, threads=1))
    np.testing.assert_array_equal(
        npattn.sdpa(q, k, v, mask="causal_top_left", threads=1), npattn.sdpa(q, k, v, q_offset=0, threads=1)
    )


@pytest.mark.parametrize("softcap", [0.3, 5.0, 50.0, 1e4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("mask", ["causal", "additive"])
def test_softcap(rng, softcap, dtype, mask):
    """softcap * tanh(s / softcap) on the scaled scores, before the mask, with sinks."""
    q, k, v = qkv(rng, (2,), 8, 2, 17, 40, 32, dtype=dtype)
    q = (q * 3).astype(dtype)  # logits of several units: the cap bites
    check(
        q,
        k,
        v,
        mask=make_mask(rng, mask, (17, 40), dtype),
        softcap=softcap,
        sinks=np.linspace(-1, 1, 8),
        return_lse=True,
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", ["prefill", "decode", "course"])
def test_model_shapes_with_window_softcap_and_lse(rng, shape, threads):
    """Model-sized calls with a sliding window, a cap, sinks and lse, on 1 to 3 threads,
    decode splitting its keys."""
    batch, H_q, H_kv, L, S, D = {
        "prefill": ((1,), 14, 2, 300, 300, 64),
        "decode": ((1,), 32, 8, 1, 3000, 128),
        "course": ((2,), 18, 6, 3, 7, 5),
    }[shape]
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D)
    check(q, k, v, window=(127, 0), softcap=30.0, sinks=rng.standard_normal(H_q), return_lse=True, threads=threads)


@pytest.mark.parametrize("kind", ["transposed", "reversed_rows", "strided_last", "zero_stride_heads", "byteswapped"])
def test_layouts_with_window_and_lse(rng, kind):
    """Strided and odd memory with a window and lse."""
    q = layout(rng, (2, 4, 7, 8), np.float32, kind)
    k = layout(rng, (2, 2, 10, 8), np.float32, kind)
    v = layout(rng, (2, 2, 10, 6), np.float32, kind)
    check(q, k, v, window=(2, 1), return_lse=True)


def test_lse_of_rows_that_see_no_key(rng):
    """lse is -inf for a row that sees no key, the sink for one that sees only its sink
    (S = 0), and float32 for float32, float64 for float64, shaped (*B, H_q, L)."""
    q, k, v = qkv(rng, (2,), 2, 1, 4, 3, 8)
    out, lse = npattn.sdpa(q, k, v, return_lse=True)  # causal, L > S: row 0 sees nothing
    assert lse.shape == (2, 2, 4) and lse.dtype == np.float32
    assert (lse[..., 0] == -np.inf).all() and np.isfinite(lse[..., 1:]).all()
    out, lse = npattn.sdpa(q.astype(np.float64), k[..., :0, :], v[..., :0, :], sinks=[0.5, -2.0], return_lse=True)
    assert lse.dtype == np.float64
    np.testing.assert_array_equal(lse, np.broadcast_to([[0.5], [-2.0]], (2, 2, 4)))
    np.testing.assert_array_equal(out, 0)
    out, lse = npattn.sdpa(q[0, 0], k[0, 0], v[0, 0], return_lse=True)  # rank 2
    assert out.shape == (4, 8) and lse.shape == (4,)


def test_window_reads_only_the_windows_keys(rng):
    """Decode with a window reads only the window's keys, and a prefill row's band keeps
    it to its tiles: NaN in every key before the window changes nothing, bitwise."""
    for L, S, W in [(1, 20000, 512), (300, 3000, 64)]:
        q, k, v = qkv(rng, (1,), 4, 1, L, S, 32)
        clean = npattn.sdpa(q, k, v, window=(W - 1, 0), threads=2)
        first_row_sees = S - L - (W - 1)  # the earliest key any row may see
        k[..., :first_row_sees, :] = np.nan
        v[..., :first_row_sees, :] = np.nan
        np.testing.assert_array_equal(npattn.sdpa(q, k, v, window=(W - 1, 0), threads=2), clean)


# ---- splitting the keys, and merging the parts ----


@pytest.mark.parametrize("trial", range(12))
def test_split_keys_and_merge_equals_the_whole_call(rng, trial):
    """Keys cut at random points into 1 to 4 parts, each computed with its k_offset (and
    the whole problem's q_offset), sinks given to one part only: merge(parts) equals the
    unsplit call to float32 rounding, lse included."""
    L, S = int(rng.integers(1, 40)), int(rng.integers(1, 300))
    q, k, v = qkv(rng, (2,), 6, 3, L, S, 16)
    mask = ["causal", "causal_top_left", None][trial % 3]
    kwargs = {"mask": "causal" if mask == "causal_top_left" else mask, "window": (None, (20, 0))[trial % 2]}
    q_offset = 0 if mask == "causal_top_left" else S - L
    sinks = rng.standard_normal(6) if trial % 4 == 0 else None
    cuts = sorted(set(rng.integers(0, S + 1, size=int(rng.integers(0, 4))).tolist()) | {0, S})
    outs, lses = [], []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        o, s = npattn.sdpa(
            q,
            k[..., a:b, :],
            v[..., a:b, :],
            q_offset=q_offset,
            k_offset=a,
            return_lse=True,
            sinks=sinks if i == 0 else None,
            **kwargs,
        )
        outs.append(o)
        lses.append(s)
    got, got_lse = npattn.merge(outs, lses)
    want, want_lse = npattn.sdpa(q, k, v, q_offset=q_offset, return_lse=True, sinks=sinks, **kwargs)
    _, atol = own_tolerance(q, k, v, np.dtype(np.float32))
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * atol)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-6, atol=1e-6)


def test_merge_rows_seen_by_no_part_are_zero_and_minus_inf():
    """Rows that no part saw: zeros and -inf; a row one part saw: that part exactly."""
    outs = [np.zeros((1, 2, 3)), np.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])]
    lses = [np.full((1, 2), -np.inf), np.array([[0.7, -np.inf]])]
    out, lse = npattn.merge(outs, lses)
    np.testing.assert_array_equal(out, [[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    np.testing.assert_array_equal(lse, [[0.7, -np.inf]])
    assert out.dtype == np.float64 and lse.dtype == np.float64


def test_merge_is_exact_where_float_parts_would_overflow():
    """lse far beyond exp's range (1e4) merges exactly: weights exp(lse_i - lse)."""
    outs = [np.ones((1, 2), np.float32), 3 * np.ones((1, 2), np.float32)]
    lses = [np.array([1e4]), np.array([1e4 + np.log(3)])]
    out, lse = npattn.merge(outs, lses)
    np.testing.assert_allclose(out, [[2.5, 2.5]], rtol=2**-23)
    np.testing.assert_allclose(lse, [1e4 + np.log(4)], rtol=1e-7)
    assert out.dtype == np.float32 and lse.dtype == np.float32


@pytest.mark.parametrize(
    "outs, lses, error, text",
    [
        ([], [], ValueError, "at least 1"),
        ([np.zeros((2, 3))], [], ValueError, "equally long"),
        ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2, ValueError, "outs[1]"),
        ([np.zeros((2, 3))] * 2, [np.zeros(2), np.zeros(3)], ValueError, "lses[1]"),
        ([np.zeros((2, 3))], [np.zeros(3)], ValueError, "without its last axis"),
        ([np.zeros((2, 3), int)], [np.zeros(2)], TypeError, "outs[0]"),
        ([np.zeros((2, 3))], [np.zeros(2, complex)], TypeError, "lses[0]"),
        ("abc", "abc", TypeError, "sequences"),
        (5, 5, TypeError, "sequences"),
        ([[[1.0], [2.0, 3.0]]], [np.zeros(2)], ValueError, "outs[0]"),
    ],
)
def test_merge_errors_name_the_part(outs, lses, error, text):
    """Mismatched or invalid parts: an error that starts "merge: " and names the part."""
    with pytest.raises(error, match=r"^merge: ") as info:
        npattn.merge(outs, lses)
    assert text in str(info.value)


# ---- attention weights ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mask": None},
        {"window": (2, 0)},
        {"softcap": 2.0, "sinks": [0.0, 1.0, -1.0, 2.0]},
        {"mask": "bool"},
        {"q_offset": 1, "k_offset": 3},
    ],
    ids=str,
)
def test_attention_weights_equal_the_reference(rng, kwargs, dtype):
    """attention_weights == the reference's probabilities, in sdpa's result dtype."""
    q, k, _ = qkv(rng, (2,), 4, 2, 5, 9, 8, dtype=dtype)
    if kwargs.get("mask") == "bool":
        kwargs = {"mask": make_mask(rng, "bool", (4, 5, 9))}
    got = npattn.attention_weights(q, k, **kwargs)
    want = reference.attention_weights(
        f64(q), f64(k), **{key: f64(val) if key in ("mask", "sinks") else val for key, val in kwargs.items()}
    )
    assert got.dtype == dtype and got.shape == (2, 4, 5, 9)
    tol = {np.float32: 1e-6, np.float64: 1e-14, np.float16: 2e-3}[dtype]  # probabilities are at most 1
    np.testing.assert_allclose(f64(got), want, rtol=0, atol=tol)


def test_attention_weights_at_v_is_sdpa(rng):
    """attention_weights(q, k) @ v == sdpa(q, k, v) for H_q == H_kv; rows that see no
    key are zeros; rank 2 gives (L, S)."""
    q, k, v = qkv(rng, (2,), 3, 3, 6, 4, 8, dtype=np.float64)
    weights = npattn.attention_weights(q, k, softcap=4.0)
    np.testing.assert_allclose(weights @ v, npattn.sdpa(q, k, v, softcap=4.0), rtol=0, atol=1e-13)
    np.testing.assert_array_equal(weights[..., :2, :], 0)  # causal, L > S: rows 0, 1 see nothing
    assert npattn.attention_weights(q[0, 0], k[0, 0]).shape == (6, 4)
    want = reference_call(q, k, v, softcap=4.0)
    np.testing.assert_allclose(weights @ v, want, rtol=0, atol=1e-13)

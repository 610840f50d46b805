"""The reference itself: against a naive loop and hand-written tables.

npattn.reference is the oracle for every other test, so it is checked here
against things that share none of its code: a per-head, per-row loop with an
explicit exp and an explicit sum, and visibility tables written out by hand
from the causal rule.
"""

import math
import warnings

import numpy as np
import pytest

import npattn
from npattn import reference


def naive_sdpa(q, k, v, scale=None, visible=None, bias=None, sinks=None, softcap=None, with_lse=False):
    """softmax(cap(scale * q.k) + bias) @ v one (batch, head, row) at a time, in Python floats.

    q (B, H_q, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v); visible and bias
    are (B, H_q, L, S) or None; sinks (H_q,) or None; cap(s) = softcap *
    tanh(s / softcap). With with_lse, also log(sum of exp) per row (-inf: no key).
    """
    B, H_q, L, D = q.shape
    _, H_kv, S, D_v = v.shape
    group = H_q // H_kv
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = np.zeros((B, H_q, L, D_v))
    lse = np.full((B, H_q, L), -math.inf)
    for b in range(B):
        for h in range(H_q):
            g = h // group  # contiguous groups of query heads share one kv head
            for i in range(L):
                logits = []
                for j in range(S):
                    if visible is not None and not visible[b, h, i, j]:
                        continue
                    s = scale * sum(float(q[b, h, i, d]) * float(k[b, g, j, d]) for d in range(D))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        s += float(bias[b, h, i, j])
                    logits.append((s, j))
                sink = [] if sinks is None else [float(sinks[h])]
                top = max([s for s, _ in logits] + sink, default=None)
                if top is None or top == -math.inf:
                    continue  # sees no key: stays zero
                weights = [(math.exp(s - top), j) for s, j in logits]
                total = sum(w for w, _ in weights) + sum(math.exp(s - top) for s in sink)
                lse[b, h, i] = top + math.log(total)
                for w, j in weights:
                    out[b, h, i] += (w / total) * v[b, g, j]
    return (out, lse) if with_lse else out


def normal(rng, *shapes):
    """Unit-normal float64 arrays, one per shape."""
    return tuple(rng.standard_normal(shape) for shape in shapes)


def visible_keys(mask, L, S, sdpa=reference.sdpa, dtype=np.float64):
    """Which keys each query sees under `mask`, read off sdpa's output.

    With q = 0 every score is equal, so each row's weights are uniform over
    the keys it sees; with v = the identity, row i of the output is those
    weights, and a key is visible iff its weight is > 0.
    """
    q, k, v = np.zeros((L, 1), dtype), np.zeros((S, 1), dtype), np.eye(S, dtype=dtype)
    return (sdpa(q, k, v, mask=mask) > 0).astype(int)


# Hand-written from the rule: "causal" lets query i see key j iff j <= i + (S - L).
CAUSAL_L3_S5 = [  # S - L = 2: row i sees keys 0 .. i + 2
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 1, 1, 1],
]
CAUSAL_L5_S3 = [  # S - L = -2: rows 0 and 1 see nothing, row i sees keys 0 .. i - 2
    [0, 0, 0],
    [0, 0, 0],
    [1, 0, 0],
    [1, 1, 0],
    [1, 1, 1],
]
# "causal_top_left" lets query i see key j iff j <= i.
TOP_LEFT_L3_S5 = [
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 1, 1, 0, 0],
]
TOP_LEFT_L5_S3 = [
    [1, 0, 0],
    [1, 1, 0],
    [1, 1, 1],
    [1, 1, 1],
    [1, 1, 1],
]
TABLES = [
    ("causal", 3, 5, CAUSAL_L3_S5),
    ("causal", 5, 3, CAUSAL_L5_S3),
    ("causal_top_left", 3, 5, TOP_LEFT_L3_S5),
    ("causal_top_left", 5, 3, TOP_LEFT_L5_S3),
]


SDPAS = {  # the tables pin the oracle and the system under test alike
    "reference": (reference.sdpa, np.float64),
    "npattn-float32": (npattn.sdpa, np.float32),
    "npattn-float64": (npattn.sdpa, np.float64),
}


@pytest.mark.parametrize("sdpa", list(SDPAS))
@pytest.mark.parametrize("mask, L, S, table", TABLES)
def test_causal_visibility_matches_hand_written_table(mask, L, S, table, sdpa):
    """Visible keys of sdpa(mask=...) == the table written out by hand."""
    np.testing.assert_array_equal(visible_keys(mask, L, S, *SDPAS[sdpa]), table)


@pytest.mark.parametrize("L, S, table", [(3, 5, CAUSAL_L3_S5), (5, 3, CAUSAL_L5_S3)])
def test_causal_mask_matches_hand_written_table(L, S, table):
    """causal_mask(L, S) == 0 where the table says visible, -inf elsewhere."""
    want = np.where(np.array(table, dtype=bool), 0.0, -np.inf)
    got = reference.causal_mask(L, S)
    assert got.dtype == np.float32
    assert got.shape == (L, S)
    np.testing.assert_array_equal(got, want)


def test_causal_mask_square_is_lower_triangular():
    """causal_mask(4, 4) == the tutorial's 4x4 example."""
    inf = np.inf
    want = [[0, -inf, -inf, -inf], [0, 0, -inf, -inf], [0, 0, 0, -inf], [0, 0, 0, 0]]
    np.testing.assert_array_equal(reference.causal_mask(4, 4), want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_causal_mask_dtype(dtype):
    """causal_mask(L, S, dtype).dtype == dtype."""
    assert reference.causal_mask(2, 3, dtype).dtype == dtype


@pytest.mark.parametrize("L, S", [(0, 0), (0, 4), (4, 0)])
def test_causal_mask_empty(L, S):
    """causal_mask of an empty size has shape (L, S)."""
    assert reference.causal_mask(L, S).shape == (L, S)


@pytest.mark.parametrize(
    "H_q, H_kv, L, S, D, D_v",
    [(1, 1, 3, 3, 4, 4), (4, 2, 3, 5, 4, 3), (6, 3, 5, 3, 2, 5), (6, 1, 1, 6, 3, 2), (4, 4, 2, 2, 1, 1)],
)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "float"])
def test_reference_equals_naive_loop(rng, H_q, H_kv, L, S, D, D_v, mask):
    """reference.sdpa == the naive per-head, per-row loop, for every mask kind and GQA."""
    B = 2
    q = rng.standard_normal((B, H_q, L, D))
    k = rng.standard_normal((B, H_kv, S, D))
    v = rng.standard_normal((B, H_kv, S, D_v))
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    visible, bias = None, None
    if mask == "causal":
        visible = np.broadcast_to(j <= i + (S - L), (B, H_q, L, S))
    elif mask == "causal_top_left":
        visible = np.broadcast_to(j <= i, (B, H_q, L, S))
    elif mask == "bool":
        mask = visible = rng.random((B, H_q, L, S)) < 0.7
    elif mask == "float":
        mask = bias = rng.standard_normal((B, H_q, L, S))
    got = reference.sdpa(q, k, v, scale=0.7, mask=mask)
    want = naive_sdpa(q, k, v, scale=0.7, visible=visible, bias=bias)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_reference_default_scale_is_inverse_sqrt_d(rng):
    """reference.sdpa(scale=None) == the naive loop with scale 1/sqrt(D)."""
    q, k, v = normal(rng, (1, 2, 3, 9), (1, 2, 4, 9), (1, 2, 4, 2))
    want = naive_sdpa(q, k, v, scale=1 / 3)
    np.testing.assert_allclose(reference.sdpa(q, k, v, mask=None), want, rtol=1e-12, atol=1e-14)


def test_reference_default_mask_is_causal(rng):
    """reference.sdpa(q, k, v) == reference.sdpa(q, k, v, mask="causal")."""
    q, k, v = normal(rng, (2, 3, 4), (2, 5, 4), (2, 5, 4))
    np.testing.assert_array_equal(reference.sdpa(q, k, v), reference.sdpa(q, k, v, mask="causal"))


def test_reference_sinks_equal_naive_loop(rng):
    """reference.sdpa(sinks=...) == the naive loop with exp(sink) in each row's denominator."""
    q = rng.standard_normal((2, 4, 3, 5))
    k = rng.standard_normal((2, 2, 6, 5))
    v = rng.standard_normal((2, 2, 6, 3))
    sinks = np.array([-1.0, 0.0, 2.5, 10.0])
    i, j = np.arange(3)[:, None], np.arange(6)[None, :]
    visible = np.broadcast_to(j <= i + 3, (2, 4, 3, 6))
    got = reference.sdpa(q, k, v, scale=1.3, sinks=sinks)
    want = naive_sdpa(q, k, v, scale=1.3, visible=visible, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_sink_joins_denominator_unscaled():
    """With equal scores, each of S weights is 1 / (S + exp(sink)), whatever the scale."""
    S = 4
    v = np.arange(S * 2, dtype=float).reshape(1, S, 2)
    q, k = np.zeros((1, 1, 3)), np.zeros((1, S, 3))
    for scale in (None, 0.1, 5.0):
        got = reference.sdpa(q, k, v, scale=scale, mask=None, sinks=[np.log(2.0)])
        np.testing.assert_allclose(got[0, 0], v[0].sum(axis=0) / (S + 2.0), rtol=1e-14)


def test_sink_is_unmasked():
    """A row that sees no key but has a sink comes out as zeros (the sink has no value)."""
    q, k, v = np.zeros((1, 2, 3)), np.ones((1, 2, 3)), np.ones((1, 2, 3))  # every score 0
    got = reference.sdpa(q, k, v, mask=np.array([[False, False], [True, True]]), sinks=[0.0])
    np.testing.assert_array_equal(got[0, 0], [0, 0, 0])
    np.testing.assert_allclose(got[0, 1], 2 / 3 * np.ones(3), rtol=1e-14)  # 2 keys + sink, 1/3 each


def test_sink_minus_inf_is_no_sink(rng):
    """sinks = -inf gives the same result as no sinks."""
    q, k, v = normal(rng, (2, 3, 4), (1, 5, 4), (1, 5, 2))
    np.testing.assert_allclose(reference.sdpa(q, k, v, sinks=[-np.inf, -np.inf]), reference.sdpa(q, k, v), rtol=1e-15)


@pytest.mark.parametrize("S", [1, 2, 7])
def test_decode_sees_every_key(rng, S):
    """Decode, L = 1: mask="causal" == mask=None (the one query sees every key)."""
    q, k, v = normal(rng, (3, 1, 4), (3, S, 4), (3, S, 4))
    np.testing.assert_array_equal(reference.sdpa(q, k, v), reference.sdpa(q, k, v, mask=None))
    assert (visible_keys("causal", 1, S) == 1).all()


def test_rows_that_see_no_key_are_zero(rng):
    """A row whose every key is masked out (bool, -inf, or causal with L > S) is 0, not NaN."""
    q, k, v = normal(rng, (2, 4, 3), (2, 5, 3), (2, 5, 2))
    seen = np.ones((2, 4, 5), dtype=bool)
    seen[0, 1] = False
    seen[1, 3] = False
    for mask in (seen, np.where(seen, 0.0, -np.inf)):
        out = reference.sdpa(q, k, v, mask=mask)
        np.testing.assert_array_equal(out[0, 1], 0)
        np.testing.assert_array_equal(out[1, 3], 0)
        assert np.isfinite(out).all()
    # causal with L = 4 > S = 2: rows 0 and 1 see no key
    out = reference.sdpa(q, k[:, :2], v[:, :2])
    np.testing.assert_array_equal(out[:, :2], 0)
    assert np.all(out[:, 2:] != 0)


@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None])
def test_no_keys_gives_zeros(mask):
    """S == 0: every row sees no key, so the result is zeros of shape (*B, H_q, L, D_v)."""
    out = reference.sdpa(np.ones((2, 4, 3, 5)), np.ones((2, 2, 0, 5)), np.ones((2, 2, 0, 6)), mask=mask)
    assert out.shape == (2, 4, 3, 6)
    np.testing.assert_array_equal(out, 0)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, out_shape",
    [
        ((2, 0, 3), (2, 4, 3), (2, 4, 5), (2, 0, 5)),  # L = 0
        ((0, 2, 3), (1, 2, 3), (1, 2, 5), (0, 2, 5)),  # H_q = 0
        ((2, 2, 3), (1, 2, 3), (1, 2, 0), (2, 2, 0)),  # D_v = 0
        ((0, 1, 2, 3), (0, 1, 2, 3), (1, 2, 5), (0, 1, 2, 5)),  # batch 0
    ],
)
def test_empty_sizes(q_shape, k_shape, v_shape, out_shape):
    """Empty sizes give an empty result of the right shape."""
    assert reference.sdpa(np.ones(q_shape), np.ones(k_shape), np.ones(v_shape)).shape == out_shape


def test_rank_2_is_the_tutorial_simple_attention(rng):
    """All-rank-2 q, k, v give the rank-2 softmax(q k^T / sqrt(D) + causal_mask) v."""
    q, k, v = normal(rng, (3, 4), (5, 4), (5, 2))
    scores = q @ k.T / 2 + reference.causal_mask(3, 5, np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    got = reference.sdpa(q, k, v)
    assert got.shape == (3, 2)
    np.testing.assert_allclose(got, weights @ v, rtol=1e-13)


def test_gqa_query_head_reads_kv_head_h_over_group():
    """Query head h reads key/value head h // (H_q // H_kv): contiguous groups."""
    H_q, H_kv = 6, 3
    v = np.arange(H_kv, dtype=float).reshape(H_kv, 1, 1) * np.ones((H_kv, 4, 1))  # kv head g holds g
    out = reference.sdpa(np.ones((H_q, 2, 3)), np.ones((H_kv, 4, 3)), v)
    np.testing.assert_allclose(out[:, :, 0], np.array([0, 0, 1, 1, 2, 2])[:, None] * np.ones((1, 2)))


def test_gqa_equals_repeated_kv_heads(rng):
    """GQA == multi-head attention on k, v with each kv head repeated H_q // H_kv times."""
    q, k, v = normal(rng, (2, 6, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3))
    want = reference.sdpa(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_allclose(reference.sdpa(q, k, v), want, rtol=1e-14)


def test_batch_broadcast_equals_explicit_repeat(rng):
    """k, v with batch 1 against q with batch 3 == k, v repeated along the batch."""
    q, k, v = normal(rng, (3, 2, 4, 5), (1, 1, 6, 5), (1, 1, 6, 2))
    want = reference.sdpa(q, np.repeat(k, 3, axis=0), np.repeat(v, 3, axis=0))
    np.testing.assert_array_equal(reference.sdpa(q, k, v), want)


def test_bool_mask_equals_additive_zero_minus_inf(rng):
    """A bool mask M == the additive mask where(M, 0, -inf)."""
    q, k, v = normal(rng, (2, 3, 4), (2, 5, 4), (2, 5, 2))
    m = rng.random((2, 3, 5)) < 0.5
    np.testing.assert_array_equal(
        reference.sdpa(q, k, v, mask=m), reference.sdpa(q, k, v, mask=np.where(m, 0.0, -np.inf))
    )


def test_large_scores_do_not_overflow(rng):
    """Scores near 1e4 stay finite: softmax subtracts the row max before exp."""
    q, k, v = normal(rng, (2, 3, 4), (2, 5, 4), (2, 5, 2))
    q, k = q * 100, k * 100
    out = reference.sdpa(q, k, v, scale=1.0, mask=None)
    assert np.isfinite(out).all()
    want = naive_sdpa(q[None], k[None], v[None], scale=1.0)[0]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)


def test_nan_in_visible_key_propagates(rng):
    """NaN in key j makes every row that sees key j NaN."""
    q, k, v = normal(rng, (1, 4, 3), (1, 4, 3), (1, 4, 2))
    k[0, 2, 1] = np.nan
    out = reference.sdpa(q, k, v)
    assert np.isnan(out[0, 2:]).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_key_hidden_by_a_mask_array_is_hidden_whatever_its_value(rng, bad, kind):
    """An infinite or NaN key that an array mask hides (False, or -inf) reaches no row
    that it hides from: those rows equal the naive loop's over the keys they see (which
    skips the key), as npattn's do. (A +inf or NaN score plus a -inf bias would make NaN
    rows of rows that never see the key.) Hidden from every row, it is hidden quietly: no
    NumPy warning."""
    L = S = 6
    q, k, v = normal(rng, (1, 2, L, 4), (1, 1, S, 4), (1, 1, S, 3))
    q[0, :, :, 0] = np.where(np.arange(L) % 2, 1.0, -1.0)  # +-inf scores, both signs
    k[0, 0, 4, 0] = bad
    visible = np.tril(np.ones((L, S), bool))
    mask = visible if kind == "bool" else np.where(visible, 0.0, -np.inf)
    out = reference.sdpa(q, k, v, mask=mask)
    want = naive_sdpa(q, k, v, visible=np.broadcast_to(visible, (1, 2, L, S)))
    np.testing.assert_allclose(out[0, :, :4], want[0, :, :4], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(npattn.sdpa(q, k, v, mask=mask)[0, :, :4], out[0, :, :4], rtol=1e-12, atol=1e-14)
    unseen = visible & (np.arange(S) != 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference.sdpa(q, k, v, mask=unseen if kind == "bool" else np.where(unseen, 0.0, -np.inf))


@pytest.mark.parametrize(
    "dtypes, want",
    [
        ((np.float32,) * 3, np.float32),
        ((np.float64,) * 3, np.float64),
        ((np.float16,) * 3, np.float16),
        ((np.float32, np.float64, np.float32), np.float64),
        ((np.float16, np.float32, np.float16), np.float32),
    ],
)
def test_result_dtype_is_result_type_of_inputs(dtypes, want):
    """The result's dtype is np.result_type(q, k, v)."""
    q, k, v = (np.ones((2, 3, 4), dtype=dt) for dt in dtypes)
    assert reference.sdpa(q, k, v).dtype == want


def test_out_is_filled_and_returned(rng):
    """reference.sdpa(out=buf) fills buf and returns it."""
    q, k, v = normal(rng, (2, 3, 4), (2, 5, 4), (2, 5, 2))
    buf = np.empty((2, 3, 2))
    assert reference.sdpa(q, k, v, out=buf) is buf
    np.testing.assert_array_equal(buf, reference.sdpa(q, k, v))


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3, 4), (2, 5, 3), (2, 5, 2)),  # D differs between q and k
        ((2, 3, 4), (2, 5, 4), (2, 6, 2)),  # S differs between k and v
        ((4, 3, 4), (2, 5, 4), (1, 5, 2)),  # H_kv differs between k and v
        ((3, 3, 4), (2, 5, 4), (2, 5, 2)),  # H_q not a multiple of H_kv
        ((2, 2, 3, 4), (3, 2, 5, 4), (3, 2, 5, 2)),  # batch dims do not broadcast
        ((4,), (5, 4), (5, 2)),  # rank 1
    ],
)
def test_mismatched_shapes_raise(shapes):
    """The reference refuses shapes that do not fit together instead of computing garbage."""
    q, k, v = (np.ones(s) for s in shapes)
    with pytest.raises(ValueError):
        reference.sdpa(q, k, v)


# ---- positions, windows, softcap, log-sum-exp (SPEC section 6) ----

# Hand-written from the rule: query i sits at q_offset + i, key j at k_offset + j;
# a window (left, right) keeps q_pos - left <= k_pos <= q_pos + right.
WINDOW_TABLES = [
    # causal, a sliding window of 2 keys (window=(1, 0)), L = S = 4
    ("causal", (1, 0), None, 0, 4, 4, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]),
    # no mask, a band of one key on each side, L = 3, S = 5 (q_offset S - L = 2)
    (None, (1, 1), None, 0, 3, 5, [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]),
    # causal, keys start at position 2: key j sits at 2 + j; queries at 3, 4, 5
    ("causal", None, 3, 2, 3, 4, [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
    # causal, queries before every key: rows see nothing
    ("causal", None, -5, 0, 2, 3, [[0, 0, 0], [0, 0, 0]]),
    # a window to the right only (look-ahead of 1), no mask
    (None, (0, 1), 0, 0, 3, 3, [[1, 1, 0], [0, 1, 1], [0, 0, 1]]),
]


@pytest.mark.parametrize("sdpa", list(SDPAS))
@pytest.mark.parametrize("mask, window, q_offset, k_offset, L, S, table", WINDOW_TABLES)
def test_window_and_positions_match_hand_written_tables(mask, window, q_offset, k_offset, L, S, table, sdpa):
    """Visible keys under a window and positions == the table written out by hand, for the
    reference and npattn alike."""
    fn, dtype = SDPAS[sdpa]
    q, k, v = np.zeros((L, 1), dtype), np.zeros((S, 1), dtype), np.eye(S, dtype=dtype)
    out = fn(q, k, v, mask=mask, window=window, q_offset=q_offset, k_offset=k_offset)
    np.testing.assert_array_equal((out > 0).astype(int), table)
    np.testing.assert_array_equal(reference.visible_keys(L, S, mask, window, q_offset, k_offset), np.array(table, bool))


# Positions far from zero: the same tables as above with both offsets shifted, and
# window sides of sys.maxsize (allowed: an unbounded side, written as an int).
HUGE = 2**63 - 1


@pytest.mark.parametrize(
    "mask, window, q_offset, k_offset, L, S, table",
    [
        ("causal", None, HUGE - 2, HUGE - 4, 3, 4, [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]),
        ("causal", (1, 0), HUGE, HUGE - 1, 2, 4, [[1, 1, 0, 0], [0, 1, 1, 0]]),
        (None, (2, 0), 2**62, -(2**62), 2, 3, [[0, 0, 0], [0, 0, 0]]),  # queries 2**63 past the keys
        (None, (None, HUGE), 0, 0, 2, 3, [[1, 1, 1], [1, 1, 1]]),
        ("causal", (HUGE, 0), None, 0, 2, 3, [[1, 1, 0], [1, 1, 1]]),
        (None, (HUGE, HUGE), -HUGE, -HUGE, 2, 2, [[1, 1], [1, 1]]),
    ],
)
def test_positions_are_exact_integers(mask, window, q_offset, k_offset, L, S, table):
    """Offsets near 2**63 and window sides of sys.maxsize: the visible keys are those of
    the rule in exact integers (no int64 position wraps around)."""
    np.testing.assert_array_equal(reference.visible_keys(L, S, mask, window, q_offset, k_offset), np.array(table, bool))
    v = np.eye(S)
    out = reference.sdpa(np.zeros((L, 1)), np.zeros((S, 1)), v, mask=mask, window=window, q_offset=q_offset,
                         k_offset=k_offset)  # fmt: skip
    np.testing.assert_array_equal(out > 0, np.array(table, bool))


@pytest.mark.parametrize("softcap", [None, 0.7, 30.0])
@pytest.mark.parametrize("case", ["window", "positions", "sinks", "mask"])
def test_reference_with_positions_softcap_and_lse_equals_naive_loop(rng, case, softcap):
    """reference.sdpa(..., return_lse=True) == the naive loop, output and lse, with a
    window, shifted positions, sinks or an additive mask, capped or not."""
    B, H_q, H_kv, L, S, D, D_v = 2, 4, 2, 5, 7, 3, 2
    q, k, v = normal(rng, (B, H_q, L, D), (B, H_kv, S, D), (B, H_kv, S, D_v))
    q, k = 2 * q, 2 * k  # logits of several units, so that the cap matters
    kwargs, visible, bias, sinks = {"mask": "causal"}, None, None, None
    q_pos, k_pos = np.arange(L)[:, None] + (S - L), np.arange(S)[None, :]
    causal = k_pos <= q_pos
    if case == "window":
        kwargs["window"] = (2, None)
        visible = causal & (k_pos >= q_pos - 2)
    elif case == "positions":
        kwargs.update(q_offset=10, k_offset=8)  # queries at 10..14, keys at 8..14
        visible = (k_pos + 8) <= (np.arange(L)[:, None] + 10)
    elif case == "sinks":
        kwargs["sinks"] = sinks = np.array([-1.0, 0.5, 3.0, -np.inf])
        visible = causal
    else:
        kwargs["mask"] = bias = np.where(rng.random((B, H_q, L, S)) < 0.7, rng.standard_normal((B, H_q, L, S)), -np.inf)
        visible = np.isfinite(bias)
        bias = np.where(visible, bias, 0.0)
    got, got_lse = reference.sdpa(q, k, v, softcap=softcap, return_lse=True, **kwargs)
    want, want_lse = naive_sdpa(
        q,
        k,
        v,
        visible=np.broadcast_to(visible, (B, H_q, L, S)),
        bias=bias,
        sinks=sinks,
        softcap=softcap,
        with_lse=True,
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-14)


def test_reference_attention_weights_are_the_softmax(rng):
    """reference.attention_weights rows are the naive loop's weights: applied to the
    identity as v they give them back, and they sum to 1 (less with a sink, 0 with no key)."""
    q, k = normal(rng, (2, 4, 3), (2, 6, 3))
    weights = reference.attention_weights(q, k, mask="causal", sinks=[0.5, -1.0])
    want = naive_sdpa(
        q[None],
        k[None],
        np.eye(6)[None, None].repeat(2, 1),
        sinks=[0.5, -1.0],
        visible=np.broadcast_to(np.tril(np.ones((4, 6), bool), 2), (1, 2, 4, 6)),
    )[0]
    np.testing.assert_allclose(weights, want, rtol=1e-12, atol=1e-15)
    assert (weights.sum(-1) < 1).all()
    np.testing.assert_array_equal(reference.attention_weights(q, k[:, :0]), np.zeros((2, 4, 0)))

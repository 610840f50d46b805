"""npattn.sdpa == npattn.reference.sdpa on float64 copies, over shapes, masks and layouts.

`check` (tests/helpers.py) runs both and compares them within the tolerance
npattn is held to (4 float32 ulps per unit of logit and of max|v|, 64 for
float64).
"""

import os
import warnings

import numpy as np
import pytest

import npattn
from helpers import LAYOUTS, MASK_KINDS, layout, make_mask, qkv, randn, run_script
from npattn import reference
from npattn.testing import MODEL_HEADS

# ---- the public API ----


def test_public_names():
    """npattn exposes sdpa, attention_weights, merge, causal_mask, reference, testing and a version."""
    for name in ("sdpa", "attention_weights", "merge", "causal_mask"):
        assert callable(getattr(npattn, name)), name
    assert npattn.reference is reference
    assert callable(npattn.testing.assert_attention_close)
    assert isinstance(npattn.__version__, str) and npattn.__version__


def test_default_mask_is_causal(rng):
    """sdpa(q, k, v) == sdpa(q, k, v, mask="causal"), bitwise, and != mask=None."""
    q, k, v = qkv(rng, (2,), 4, 2, 5, 7, 8)
    got = npattn.sdpa(q, k, v, threads=1)
    np.testing.assert_array_equal(got, npattn.sdpa(q, k, v, mask="causal", threads=1))
    assert not np.allclose(got, npattn.sdpa(q, k, v, mask=None, threads=1))


# ---- the course's shapes: H_q=18, H_kv=6, L=3, S=7, D=5 ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", ["additive", "causal"])
@pytest.mark.parametrize("scale", [None, 0.8])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_course_shapes(rng, check, batch, scale, mask, dtype):
    """sdpa == reference on the course's odd GQA shapes, with and without batch dims."""
    q, k, v = qkv(rng, batch, 18, 6, 3, 7, 5, dtype=dtype)
    if mask == "additive":
        mask = randn(rng, (*batch, 18, 3, 7), dtype)
    check(q, k, v, scale=scale, mask=mask)


# ---- model shapes: prefill (L = S), chunked prefill (L < S), decode (L = 1) ----

MODELS = ("Qwen2-0.5B", "Qwen3-4B", "GPT-2")  # heads from npattn.testing.MODEL_HEADS
PHASES = {  # (batch, L, S) per model, sized to keep each test well under a second
    "prefill": {"Qwen2-0.5B": ((1,), 300, 300), "Qwen3-4B": ((1,), 256, 256), "GPT-2": ((2,), 129, 129)},
    "chunked": {"Qwen2-0.5B": ((1,), 64, 300), "Qwen3-4B": ((1,), 33, 257), "GPT-2": ((2,), 100, 228)},
    "decode": {"Qwen2-0.5B": ((4,), 1, 1000), "Qwen3-4B": ((2,), 1, 777), "GPT-2": ((3,), 1, 513)},
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("model", MODELS)
def test_model_shapes(rng, check, model, phase, dtype):
    """sdpa == reference on real models' head counts in prefill, chunked prefill and decode."""
    H_q, H_kv, D = MODEL_HEADS[model]
    batch, L, S = PHASES[phase][model]
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    check(q, k, v)


@pytest.mark.parametrize(
    "L, S",
    [(1, 1), (2, 2), (63, 63), (64, 64), (65, 65), (127, 129), (129, 127), (1, 4097), (17, 600), (600, 17)],
)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None])
def test_sizes_around_tile_edges(rng, check, L, S, mask):
    """sdpa == reference for L and S just below, at and above powers of two."""
    q, k, v = qkv(rng, (), 2, 1, L, S, 16, 24)
    check(q, k, v, mask=mask)


@pytest.mark.parametrize("D, D_v", [(1, 1), (1, 7), (3, 300), (256, 8), (512, 512)])
def test_head_sizes(rng, check, D, D_v):
    """sdpa == reference for tiny and large row widths, D_v != D."""
    q, k, v = qkv(rng, (), 2, 2, 9, 33, D, D_v)
    check(q, k, v)
    check(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))


# ---- masks ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L, S", [(3, 8), (6, 6), (8, 3), (1, 9)])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds(rng, check, kind, L, S, dtype):
    """sdpa == reference for every kind of mask, with L < S, L == S and L > S."""
    q, k, v = qkv(rng, (2,), 4, 2, L, S, 8, 6, dtype=dtype)
    check(q, k, v, mask=make_mask(rng, kind, (2, 4, L, S), dtype))


@pytest.mark.parametrize(
    "shape",
    [
        (3, 5),
        (1, 1, 3, 5),
        (4, 1, 5),
        (4, 3, 1),
        (2, 1, 3, 5),
        (2, 4, 3, 5),
        (5,),
        (1, 5),
        (3, 1),
        (2, 1, 1, 1),
        (1, 4, 1, 1),
    ],
)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_broadcast_shapes(rng, check, kind, shape):
    """A mask of any shape that broadcasts to (*B, H_q, L, S) acts as that mask broadcast out."""
    q, k, v = qkv(rng, (2,), 4, 2, 3, 5, 8)
    mask = make_mask(rng, kind, shape)
    check(q, k, v, mask=mask)
    check(q, k, v, mask=np.broadcast_to(mask, (2, 4, 3, 5)).copy())


def test_causal_string_equals_causal_mask_array(rng, check):
    """mask="causal" == mask=causal_mask(L, S), the tutorial's additive mask."""
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8)
    by_name = check(q, k, v, mask="causal")
    by_array = check(q, k, v, mask=npattn.causal_mask(5, 9))
    np.testing.assert_allclose(by_name, by_array, rtol=0, atol=1e-5)  # ~40 float32 ulps of |out| <= 3


@pytest.mark.parametrize("S", [1, 5, 300])
def test_decode_sees_every_key(rng, S):
    """Decode, L = 1: mask="causal" == mask=None, bitwise."""
    q, k, v = qkv(rng, (2,), 8, 2, 1, S, 16)
    np.testing.assert_array_equal(npattn.sdpa(q, k, v, threads=2), npattn.sdpa(q, k, v, mask=None, threads=2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fully_masked_rows_are_zero(rng, check, dtype):
    """Rows that see no key (bool all False, float all -inf, causal with L > S) are 0, not NaN."""
    q, k, v = qkv(rng, (2,), 4, 2, 6, 4, 8, dtype=dtype)
    seen = rng.random((2, 4, 6, 4)) < 0.7
    seen[0, 1, 2] = False
    seen[1, 3, :] = False
    for mask in (seen, np.where(seen, 0.0, -np.inf)):
        out = check(q, k, v, mask=mask)
        np.testing.assert_array_equal(out[0, 1, 2], 0)
        np.testing.assert_array_equal(out[1, 3], 0)
        assert np.isfinite(out).all()
    out = check(q, k, v)  # causal, L = 6 > S = 4: rows 0 and 1 see no key
    np.testing.assert_array_equal(out[..., :2, :], 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_of_finfo_min_is_finite_not_hidden(rng, dtype):
    """A float mask of finfo(dtype).min (Hugging Face's padding value) is a finite logit.

    It does not hide: a row where every key gets finfo.min sees them all
    equally (the mean of v), as softmax(scores + mask) says; only -inf hides.
    """
    q, k, v = qkv(rng, (), 2, 1, 4, 5, 8, 3, dtype=dtype)
    lowest = np.finfo(dtype).min
    mask = np.zeros((4, 5), dtype)
    mask[0, :] = lowest  # every key at the lowest finite value: scores are absorbed, weights uniform
    mask[1, :2] = lowest  # some keys: exp(lowest - max) is exactly 0, as for -inf
    mask[2, :] = lowest / 2
    got = npattn.sdpa(q, k, v, mask=mask)
    tol = {np.float32: 1e-5, np.float64: 1e-12}[dtype]  # unit-normal inputs, |out| <= 3: many ulps
    mean = np.broadcast_to(v.astype(np.float64).mean(axis=-2), (2, 3))
    np.testing.assert_allclose(got[:, 0], mean, rtol=0, atol=tol)
    np.testing.assert_allclose(got[:, 2], mean, rtol=0, atol=tol)
    hidden = np.where(mask == lowest, -np.inf, 0.0)
    want = reference.sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask=hidden)
    np.testing.assert_allclose(got[:, 1::2], want[:, 1::2], rtol=0, atol=tol)


def test_no_python_warnings(rng):
    """sdpa issues no warnings (nothing reaches stderr), even for a float64 mask beyond float32's range."""
    q, k, v = qkv(rng, (), 2, 1, 4, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        npattn.sdpa(q, k, v, mask=np.full((4, 5), -1e300))
        npattn.sdpa(q, k, v, mask=np.full((4, 5), -np.inf))
        npattn.sdpa(q, k[:, :0], v[:, :0])  # S = 0


# ---- layouts: any strides ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_layouts(rng, check, kind, which, dtype):
    """sdpa on a strided, byte-swapped, misaligned or read-only view == reference on the same values."""
    shapes = {"q": (2, 6, 5, 12), "k": (2, 3, 9, 12), "v": (2, 3, 9, 7)}
    arrays = {
        name: layout(rng, shape, dtype, kind if which in (name, "all") else "contiguous")
        for name, shape in shapes.items()
    }
    check(arrays["q"], arrays["k"], arrays["v"], threads=2)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_mask_layouts(rng, check, kind):
    """A strided float or bool mask reads as its values: sdpa == reference."""
    q, k, v = qkv(rng, (2,), 6, 3, 5, 9, 12)
    mask = layout(rng, (2, 6, 5, 9), np.float32, kind)
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask > -0.5)


def test_transposed_model_layout(rng, check):
    """(B, L, H, D) projections viewed with .transpose(0, 2, 1, 3), as a model produces them."""
    B, L, H_q, H_kv, D = 2, 37, 14, 2, 64
    q = randn(rng, (B, L, H_q, D)).transpose(0, 2, 1, 3)
    k = randn(rng, (B, L, H_kv, D)).transpose(0, 2, 1, 3)
    v = randn(rng, (B, L, H_kv, D)).transpose(0, 2, 1, 3)
    check(q, k, v)


def test_kv_cache_slice(rng, check):
    """k, v as the first S rows of a preallocated cache (row stride > S's extent)."""
    cache_k = randn(rng, (1, 2, 512, 64))
    cache_v = randn(rng, (1, 2, 512, 64))
    q = randn(rng, (1, 8, 1, 64))
    check(q, cache_k[:, :, :77], cache_v[:, :, :77])


# ---- batch dims and ranks ----


@pytest.mark.parametrize(
    "qb, kb, vb",
    [
        ((3,), (1,), (1,)),  # one k/v batch serves every q batch
        ((1,), (3,), (3,)),  # one q batch against many k/v batches
        ((2, 1), (1, 3), (1, 3)),  # broadcast both ways
        ((2, 3), (3,), (3,)),  # k, v with fewer batch dims
        ((2, 3), (), ()),  # k, v without batch dims
        ((), (2,), (2,)),  # q without batch dims
        ((4,), (4,), (1,)),  # v alone broadcast
    ],
)
def test_batch_broadcast(rng, check, qb, kb, vb):
    """Batch dims broadcast by NumPy's rules; result batch = broadcast of all three."""
    q = randn(rng, (*qb, 4, 3, 8))
    k = randn(rng, (*kb, 2, 5, 8))
    v = randn(rng, (*vb, 2, 5, 6))
    got = check(q, k, v)
    assert got.shape == (*np.broadcast_shapes(qb, kb, vb), 4, 3, 6)


def test_kv_batch_one_equals_repeated(rng):
    """k, v with batch 1 against q with batch 3 == k, v repeated 3 times."""
    q = randn(rng, (3, 4, 5, 8))
    k, v = randn(rng, (1, 2, 7, 8)), randn(rng, (1, 2, 7, 8))
    np.testing.assert_array_equal(
        npattn.sdpa(q, k, v, threads=1), npattn.sdpa(q, np.repeat(k, 3, 0), np.repeat(v, 3, 0), threads=1)
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rank_2_gives_rank_2(rng, check, dtype):
    """All-rank-2 q (L, D), k (S, D), v (S, D_v) give a rank-2 (L, D_v) result."""
    q, k, v = randn(rng, (4, 8), dtype), randn(rng, (6, 8), dtype), randn(rng, (6, 3), dtype)
    assert check(q, k, v).shape == (4, 3)
    assert check(q, k, v, mask=None).shape == (4, 3)


def test_rank_2_mixed_with_heads(rng, check):
    """A rank-2 k, v (S, D) reads as one kv head shared by every query head."""
    q, k, v = randn(rng, (2, 4, 3, 8)), randn(rng, (6, 8)), randn(rng, (6, 5))
    assert check(q, k, v).shape == (2, 4, 3, 5)
    q2 = randn(rng, (3, 8))
    assert check(q2, randn(rng, (1, 6, 8)), randn(rng, (1, 6, 5))).shape == (1, 3, 5)


# ---- dtypes, inputs, scale, sinks ----


def test_lists_as_input(rng, check):
    """Nested lists are taken as np.asarray takes them (float64)."""
    q, k, v = qkv(rng, (), 2, 1, 3, 4, 5, dtype=np.float64)
    got = check(q.tolist(), k.tolist(), v.tolist(), mask=(rng.random((3, 4)) < 0.8).tolist(), sinks=[0.5, -1.0])
    assert got.dtype == np.float64


@pytest.mark.parametrize("scale", [0.8, 2, -1.5, np.float32(0.3), np.float64(1e-3), 0.0])
def test_scale_values(rng, check, scale):
    """Any finite real scale multiplies q @ k^T (ints, NumPy scalars, negative, 0)."""
    q, k, v = qkv(rng, (), 4, 2, 5, 7, 8)
    check(q, k, v, scale=scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_stay_finite(rng, check, dtype):
    """Logits in the hundreds do not overflow: the softmax is shifted by the row max."""
    q, k, v = qkv(rng, (2,), 4, 2, 17, 40, 16, dtype=dtype)
    out = check(q * 8, k * 8, v, scale=1.0)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_sinks(rng, check, kind, dtype):
    """sinks: exp(sink) joins each head's denominator, unscaled and unmasked, with every mask."""
    q, k, v = qkv(rng, (2,), 6, 2, 5, 8, 8, 4, dtype=dtype)
    sinks = np.array([-3.0, 0.0, 1.5, 4.0, -np.inf, 0.25], dtype=dtype)
    check(q, k, v, scale=0.6, mask=make_mask(rng, kind, (2, 6, 5, 8), dtype), sinks=sinks)


def test_sinks_with_rows_that_see_no_key(rng, check):
    """A row that sees no key but has a sink is 0; the sink still shrinks the rows that see keys."""
    q, k, v = qkv(rng, (), 2, 1, 6, 3, 8)
    out = check(q, k, v, sinks=[1.0, 2.0])  # causal with L > S: rows 0..2 see no key
    np.testing.assert_array_equal(out[:, :3], 0)
    without = npattn.sdpa(q, k, v)
    assert np.all(np.abs(out[:, 3:]) < np.abs(without[:, 3:]) + 1e-7)


def test_sinks_decode(rng, check):
    """sinks in decode (L = 1) on a model shape."""
    q, k, v = qkv(rng, (2,), 8, 2, 1, 600, 64)
    check(q, k, v, sinks=np.linspace(-2, 2, 8))


# ---- empty sizes ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, out_shape",
    [
        ((2, 4, 0, 8), (2, 2, 5, 8), (2, 2, 5, 6), (2, 4, 0, 6)),  # L = 0
        ((2, 4, 3, 8), (2, 2, 0, 8), (2, 2, 0, 6), (2, 4, 3, 6)),  # S = 0: zeros
        ((2, 0, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6), (2, 0, 3, 6)),  # H_q = 0
        ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 0), (2, 4, 3, 0)),  # D_v = 0
        ((0, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 6), (0, 4, 3, 6)),  # batch 0
        ((0, 8), (0, 8), (0, 6), (0, 6)),  # rank 2, L = S = 0
        ((3, 8), (0, 8), (0, 6), (3, 6)),  # rank 2, S = 0: zeros
    ],
)
@pytest.mark.parametrize("mask", MASK_KINDS)
def test_empty_sizes(check, q_shape, k_shape, v_shape, out_shape, dtype, mask):
    """Empty sizes give a result of the right shape and dtype; S = 0 gives zeros."""
    q, k, v = (np.ones(s, dtype) for s in (q_shape, k_shape, v_shape))
    L, S = q_shape[-2], k_shape[-2]
    if mask == "bool":
        mask = np.ones((L, S), bool)
    elif mask == "additive":
        mask = np.zeros((L, S), dtype)
    got = check(q, k, v, mask=mask)
    assert got.shape == out_shape
    if S == 0:
        np.testing.assert_array_equal(got, 0)


def test_no_keys_with_sinks_is_zero(check):
    """S = 0 with sinks: still zeros (the sink carries no value)."""
    got = check(np.ones((2, 3, 4)), np.ones((1, 0, 4)), np.ones((1, 0, 5)), sinks=[0.0, 1.0])
    np.testing.assert_array_equal(got, np.zeros((2, 3, 5)))


# ---- out= ----


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_out_is_filled_and_returned(rng, dtype):
    """sdpa(out=buf) returns buf itself, filled with what sdpa returns."""
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8, 6, dtype=dtype)
    buf = np.full((2, 4, 5, 6), np.nan, dtype)
    assert npattn.sdpa(q, k, v, out=buf, threads=2) is buf
    np.testing.assert_array_equal(buf, npattn.sdpa(q, k, v, threads=2))


def test_out_strided_view(rng):
    """out may be a strided view; only its elements are written."""
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8, 6)
    big = np.full((2, 5, 4, 12), 7.0, np.float32)  # (B, L, H, 2 * D_v) buffer
    view = big[..., ::2].transpose(0, 2, 1, 3)  # (B, H, L, D_v), non-contiguous
    assert npattn.sdpa(q, k, v, out=view, threads=1) is view
    np.testing.assert_array_equal(view, npattn.sdpa(q, k, v, threads=1))
    np.testing.assert_array_equal(big[..., 1::2], 7.0)


def test_out_rank_2(rng):
    """out works for the rank-2 form, and is returned as passed."""
    q, k, v = randn(rng, (4, 8)), randn(rng, (6, 8)), randn(rng, (6, 3))
    buf = np.empty((4, 3), np.float32)
    assert npattn.sdpa(q, k, v, out=buf, threads=1) is buf
    np.testing.assert_array_equal(buf, npattn.sdpa(q, k, v, threads=1))


def test_out_with_empty_result(rng):
    """out of an empty shape is returned as is."""
    q, k, v = qkv(rng, (2,), 4, 2, 0, 5, 8)
    buf = np.empty((2, 4, 0, 8), np.float32)
    assert npattn.sdpa(q, k, v, out=buf) is buf


# ---- threads ----


THREAD_COUNTS = [1, 2, 3, 8]
THREAD_SHAPES = {  # (batch, H_q, H_kv, L, S, D)
    "prefill": ((2,), 8, 2, 150, 150, 64),
    "chunked": ((1,), 4, 4, 40, 700, 32),
    "decode": ((1,), 4, 1, 1, 5000, 64),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", list(THREAD_SHAPES))
def test_same_threads_is_bitwise_reproducible(rng, check, shape, dtype):
    """Same inputs and same threads: bitwise-identical results run after run.

    Different thread counts may sum in a different order, so they agree only
    within the tolerance, each against the reference.
    """
    batch, H_q, H_kv, L, S, D = THREAD_SHAPES[shape]
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    for threads in THREAD_COUNTS:
        first = check(q, k, v, mask=None, threads=threads)
        for _ in range(3):
            np.testing.assert_array_equal(npattn.sdpa(q, k, v, mask=None, threads=threads), first)


def test_threads_none_uses_env_variable():
    """threads=None with NPATTN_NUM_THREADS=3 == threads=3, bitwise."""
    script = (
        "import numpy as np, npattn\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = (rng.standard_normal((1, 4, 1, 64), np.float32), rng.standard_normal((1, 1, 3000, 64), np.float32),"
        " rng.standard_normal((1, 1, 3000, 64), np.float32))\n"
        "assert np.array_equal(npattn.sdpa(q, k, v), npattn.sdpa(q, k, v, threads=3))\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NPATTN_NUM_THREADS="3")
    proc = run_script(script, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert proc.stderr == ""

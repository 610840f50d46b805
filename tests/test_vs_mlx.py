"""npattn.sdpa == mlx.core.fast.scaled_dot_product_attention (MLX on the CPU), and
every MLX row of the README's peer table (SPEC §3), pinned.

Masks are always passed explicitly, since the defaults differ (MLX: none).
npattn's "causal" is MLX's mask="causal" (both bottom-right); npattn's
"causal_top_left" has no MLX spelling and goes in as a bool array. MLX needs
scale= and rank-4 inputs. MLX wants an additive mask and sinks in the inputs'
dtype ("must promote to output type").

The tolerances are helpers.assert_parity's (npattn.testing's for the peer);
after the module, a line gives how many parity cases ran per dtype and the
largest |npattn - MLX|. The whole module skips where mlx is not installed.
"""

import numpy as np
import pytest

import npattn
from helpers import MASK_KINDS, PEER_SHAPES, ParityStats, assert_parity, peer_visible, qkv
from npattn import _interop, reference

mx = pytest.importorskip("mlx.core")
mx.set_default_device(mx.cpu)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# ---- the shapes and masks compared over, and the figures reported after the module ----

STATS = ParityStats(lambda: f"mlx {mx.__version__} (CPU)")
parity_summary = STATS.fixture()


# ---- helpers ----


def arrays(rng, batch, H_q, H_kv, L, S, D, D_v=None, dtype=mx.float32):
    """helpers.qkv's float32 q, k, v as MLX arrays of dtype (rounded from float32)."""
    return [mx.array(x).astype(dtype) for x in qkv(rng, batch, H_q, H_kv, L, S, D, D_v)]


def f64(x):
    """The exact float64 values of an MLX array, for the reference."""
    return np.array(x.astype(mx.float32), dtype=np.float64)


def mask_for(kind, rng, H_q, L, S, dtype):
    """(npattn mask, MLX mask) for one mask kind; random masks leave no row empty
    (empty rows have their own tests: there MLX differs)."""
    if kind in ("causal", None):
        return kind, kind
    if kind == "causal_top_left":
        return kind, mx.array(np.tril(np.ones((L, S), bool)))
    visible = peer_visible(rng, H_q, L, S)
    if kind == "bool":
        return visible, mx.array(visible)
    # additive: (L, S), broadcast over batch and heads; values exact in bfloat16
    bias = np.round(rng.standard_normal((L, S)) * 4) / 4
    bias = np.where(visible[0], bias, -np.inf).astype(np.float32)
    return bias, mx.array(bias).astype(dtype)


def mlx_sdpa(q, k, v, scale=None, mask=None, sinks=None):
    """MLX's sdpa, scale defaulting to 1/sqrt(D) as npattn's does; evaluated."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = {} if sinks is None else {"sinks": sinks}
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    mx.eval(out)
    return out


def check_parity(dtype_name, q, k, v, mask, mlx_mask, sinks=None):
    """npattn (on the MLX arrays) vs MLX vs reference (helpers.assert_parity)."""
    # MLX arrays go straight in; sinks as the same values in float32 (a bfloat16
    # MLX array as sinks: see test_mlx_masks_and_sinks)
    np_sinks = None if sinks is None else np.array(sinks.astype(mx.float32))
    got = npattn.sdpa(q, k, v, mask=mask, sinks=np_sinks)
    want = mlx_sdpa(q, k, v, mask=mlx_mask, sinks=sinks)
    assert type(got) is np.ndarray and got.shape == tuple(want.shape)
    assert got.dtype.name == dtype_name
    assert_parity(got, want, q, k, v, mask=mask, sinks=np_sinks, stats=STATS)


# ---- parity: course and model shapes, every mask kind, sinks, three dtypes ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_sdpa_equals_mlx(rng, shape, mask_kind, dtype_name):
    """npattn.sdpa(q, k, v, mask) == mx.fast.scaled_dot_product_attention with the same
    mask, and both == reference; inputs are MLX arrays of the dtype under test."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    q, k, v = arrays(rng, batch, H_q, H_kv, L, S, D, dtype=DTYPES[dtype_name])
    mask, mlx_mask = mask_for(mask_kind, rng, H_q, L, S, DTYPES[dtype_name])
    check_parity(dtype_name, q, k, v, mask, mlx_mask)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", ["causal", None, "bool"], ids=str)
@pytest.mark.parametrize("shape", ["course", "qwen2-0.5b-chunked", "qwen3-4b-decode", "gpt2-prefill"])
def test_sinks_equal_mlx(rng, shape, mask_kind, dtype_name):
    """sinks= (one logit per query head) means the same in both."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    mask, mlx_mask = mask_for(mask_kind, rng, H_q, L, S, dtype)
    sinks = mx.array(rng.standard_normal(H_q, dtype=np.float32) * 2).astype(dtype)
    check_parity(dtype_name, q, k, v, mask, mlx_mask, sinks=sinks)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_d_v_differs_from_d(rng, dtype_name):
    """D_v != D works in both, and agrees."""
    q, k, v = arrays(rng, (2,), 18, 6, 3, 7, 5, D_v=9, dtype=DTYPES[dtype_name])
    check_parity(dtype_name, q, k, v, "causal", "causal")


@pytest.mark.parametrize("L, S", [(3, 7), (7, 7), (1, 9)])
def test_causal_is_mlx_causal(rng, L, S):
    """npattn's default mask "causal" == MLX's mask="causal" (both bottom-right), and
    differs from "causal_top_left" when L != S."""
    q, k, v = arrays(rng, (2,), 4, 2, L, S, 8)
    want = np.array(mlx_sdpa(q, k, v, mask="causal"))
    np.testing.assert_allclose(npattn.sdpa(q, k, v), want, rtol=1e-5, atol=1e-6)
    if L != S:
        assert not np.allclose(npattn.sdpa(q, k, v, mask="causal_top_left"), want, rtol=1e-3, atol=1e-3)


# ---- the peer table, MLX's column ----


def test_default_mask_and_required_scale(rng):
    """MLX's scale is a required keyword and its default mask is None (npattn's "causal")."""
    q, k, v = arrays(rng, (2,), 18, 6, 3, 7, 5)
    with pytest.raises(TypeError):
        mx.fast.scaled_dot_product_attention(q, k, v)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=5**-0.5))
    np.testing.assert_allclose(npattn.sdpa(q, k, v, mask=None), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(npattn.sdpa(q, k, v), want, rtol=1e-3, atol=1e-3)


def mean_of_v(v, H_q):
    """What MLX's CPU path gives a row that sees no key: the plain mean of V's rows,
    per query head (the hidden scores become finfo.min, all equal, so softmax is uniform)."""
    v = np.repeat(f64(v), H_q // v.shape[-3], axis=-3)
    return v.mean(axis=-2)  # (*B, H_q, D_v)


def minus_inf_row(rng, dtype):
    """MLX q (2, 4, 3, 8), k and v (2, 2, 5, 8) of dtype, and a float32 additive
    (3, 5) mask whose row 1 is -inf everywhere: a row that sees no key."""
    q, k, v = arrays(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
    bias = np.zeros((3, 5), np.float32)
    bias[1] = -np.inf
    return q, k, v, bias


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_bool_masked_empty_row_is_mean_of_v_in_mlx_zeros_in_npattn(rng, dtype_name):
    """A row a bool mask hides from every key: MLX CPU gives the mean of V, npattn 0."""
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
    visible = np.ones((3, 5), bool)
    visible[1] = False
    want = f64(mlx_sdpa(q, k, v, mask=mx.array(visible)))
    got = npattn.sdpa(q, k, v, mask=visible)
    atol = 2 * float(mx.finfo(dtype).eps) * float(np.abs(f64(v)).max()) + 1e-6
    np.testing.assert_allclose(want[..., 1, :], mean_of_v(v, 4), rtol=0, atol=atol)
    np.testing.assert_array_equal(np.asarray(got[..., 1, :], np.float32), 0)
    np.testing.assert_allclose(np.asarray(got, np.float64)[..., ::2, :], want[..., ::2, :], rtol=0, atol=atol)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_minus_inf_masked_empty_row_is_nan_in_mlx_zeros_in_npattn(rng, dtype_name):
    """A row an additive mask sets to -inf everywhere: MLX CPU gives NaN, npattn 0."""
    dtype = DTYPES[dtype_name]
    q, k, v, bias = minus_inf_row(rng, dtype)
    want = f64(mlx_sdpa(q, k, v, mask=mx.array(bias).astype(dtype)))
    got = npattn.sdpa(q, k, v, mask=bias)
    assert np.isnan(want[..., 1, :]).all()
    assert not np.isnan(want[..., ::2, :]).any()
    np.testing.assert_array_equal(np.asarray(got[..., 1, :], np.float32), 0)


def test_causal_rows_that_see_no_key_are_mean_of_v_in_mlx_zeros_in_npattn(rng):
    """With L > S, mask="causal" leaves the first L - S rows no key: MLX CPU gives the
    mean of V there too (the table's "bool mask" case covers its own causal mask), npattn 0."""
    L, S = 6, 3
    q, k, v = arrays(rng, (1,), 4, 2, L, S, 8)
    want = f64(mlx_sdpa(q, k, v, mask="causal"))
    got = npattn.sdpa(q, k, v)
    np.testing.assert_allclose(want[..., : L - S, :], np.repeat(mean_of_v(v, 4)[..., None, :], L - S, -2), atol=1e-6)
    np.testing.assert_array_equal(got[..., : L - S, :], 0)
    np.testing.assert_allclose(got[..., L - S :, :], want[..., L - S :, :], rtol=1e-5, atol=1e-6)


def test_mlx_takes_rank_4_only(rng):
    """MLX takes exactly rank 4, with equal batch sizes; npattn also takes rank 3 and 2
    and broadcasts a k/v batch of 1, agreeing with MLX on the rank-4 equivalent."""
    q, k, v = arrays(rng, (1,), 4, 2, 3, 5, 8)
    want = np.array(mlx_sdpa(q, k, v, mask="causal"))
    for args in [(q[0], k[0], v[0]), (q[None], k[None], v[None])]:
        with pytest.raises(ValueError, match="rank 4"):
            mlx_sdpa(*args, mask="causal")
    np.testing.assert_allclose(npattn.sdpa(q[0], k[0], v[0]), want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(npattn.sdpa(q[0, 0], k[0, 0], v[0, 0]), want[0, 0], rtol=1e-5, atol=1e-6)
    q2 = mx.concatenate([q, q])
    with pytest.raises(ValueError, match="batch"):
        mlx_sdpa(q2, k, v, mask="causal")
    np.testing.assert_allclose(npattn.sdpa(q2, k, v), np.concatenate([want, want]), rtol=1e-5, atol=1e-6)


def test_float64_is_float32_accurate_in_mlx_true_double_in_npattn(rng):
    """float64 MLX arrays give a float64 result, but one only float32-accurate (~1e-7);
    npattn's float64 path is true double (~1e-15)."""
    xs = [rng.standard_normal(s) for s in [(1, 8, 16, 64), (1, 2, 32, 64), (1, 2, 32, 64)]]
    q, k, v = (mx.array(x, dtype=mx.float64) for x in xs)  # mx.array(x) alone would be float32
    want = np.array(mlx_sdpa(q, k, v, mask="causal"))
    ref = reference.sdpa(*xs)
    got = npattn.sdpa(*xs)
    assert want.dtype == got.dtype == np.float64
    assert np.abs(got - ref).max() < 1e-13
    assert 1e-10 < np.abs(want - ref).max() < 1e-5
    STATS.record("float64", got, want)


# ---- MLX arrays as npattn inputs ----


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_mlx_arrays_go_straight_in(rng, dtype_name):
    """MLX arrays of every float dtype go into npattn.sdpa; the result is a NumPy array in
    the matching dtype, bitwise equal to the call on the NumPy equivalents."""
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    q, k, v = arrays(rng, (2,), 18, 6, 3, 7, 5, dtype=DTYPES[dtype_name])
    got = npattn.sdpa(q, k, v, threads=1)
    assert type(got) is np.ndarray
    assert got.dtype.name == dtype_name
    as_numpy = [_interop.asarray(x) for x in (q, k, v)]
    assert all(type(a) is np.ndarray for a in as_numpy)
    np.testing.assert_array_equal(got, npattn.sdpa(*as_numpy, threads=1))


def buffer_address(x):
    """The address of an evaluated, contiguous MLX array's own memory."""
    return np.frombuffer(memoryview(x).cast("B"), np.uint8).ctypes.data


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_mlx_arrays_are_read_without_a_copy(rng, dtype_name):
    """An MLX array is read in place: the NumPy view starts at MLX's own buffer (bfloat16
    through its bits as ml_dtypes.bfloat16), and a transposed MLX view keeps its strides."""
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    x = mx.array(rng.standard_normal((2, 7, 6, 5), dtype=np.float32)).astype(DTYPES[dtype_name])
    mx.eval(x)
    a = _interop.asarray(x)
    assert a.ctypes.data == buffer_address(x)
    assert a.dtype.name == dtype_name
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.array(x.astype(mx.float32)))
    if dtype_name != "bfloat16":  # bfloat16's view(uint16) of a strided array may copy
        t = _interop.asarray(x.transpose(0, 2, 1, 3))
        assert not t.flags.c_contiguous and np.shares_memory(t, a)


@pytest.mark.parametrize(
    "dtype_name",
    [
        "float32",
        "float16",
        "bfloat16",
    ],
)
def test_mlx_masks_and_sinks(rng, dtype_name):
    """Masks and sinks may be MLX arrays too, of any float dtype: the same result as
    their values in NumPy float32."""
    pytest.importorskip("ml_dtypes")
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, (2,), 18, 6, 3, 7, 5, dtype=dtype)
    bias = np.zeros((3, 7), np.float32)
    bias[1, 2:] = -np.inf
    sinks = mx.array(rng.standard_normal(18, dtype=np.float32)).astype(dtype)
    got = npattn.sdpa(q, k, v, mask=mx.array(bias).astype(dtype), sinks=sinks, threads=1)
    want = npattn.sdpa(q, k, v, mask=bias, sinks=np.array(sinks.astype(mx.float32)), threads=1)
    np.testing.assert_array_equal(got, want)

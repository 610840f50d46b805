"""npattn.mlx.scaled_dot_product_attention == mlx.core.fast.scaled_dot_product_attention
(MLX on the CPU), called the same way: the same arguments go to both, forward and
gradient (mx.grad), on the parity tests' shapes (helpers.PEER_SHAPES), every mask
kind, sinks, three dtypes; and MLX's known difference on rows that see no key
(mean of V or NaN on its CPU path; zeros in npattn), pinned, not copied.

Forward: helpers.assert_parity; gradients: helpers.assert_gradient_parity.
"""

import numpy as np
import pytest

from helpers import (
    MASK_KINDS,
    PEER_SHAPES,
    ParityStats,
    assert_gradient_parity,
    assert_parity,
    backward_tolerance,
    check_backward,
)
from npattn import _interop, reference

mx = pytest.importorskip("mlx.core")
nm = pytest.importorskip("npattn.mlx")
mx.set_default_device(mx.cpu)

from test_vs_mlx import DTYPES, arrays, f64, mask_for, mean_of_v, minus_inf_row  # noqa: E402  (the parity tests' builders)

STATS = ParityStats(lambda: f"mlx {mx.__version__} (CPU, through npattn.mlx)")
parity_summary = STATS.fixture()


def call(fn, q, k, v, scale=None, mask=None, sinks=None):
    """fn(q, k, v, scale=..., mask=..., sinks=...), MLX's way; scale 1/sqrt(D) by default."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = {} if sinks is None else {"sinks": sinks}
    out = fn(q, k, v, scale=scale, mask=mask, **kwargs)
    mx.eval(out)
    return out


def gradients(fn, q, k, v, dout, mask, sinks=None):
    """The gradients of sum(dout * fn(...)) for q, k, v (and sinks), by mx.grad."""

    wide = mx.float64 if q.dtype == mx.float64 else mx.float32  # the sum, not rounded to a half dtype

    def loss(q, k, v, sinks):
        return (call(fn, q, k, v, mask=mask, sinks=sinks).astype(wide) * dout.astype(wide)).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2, 3) if sinks is not None else (0, 1, 2))(q, k, v, sinks)
    mx.eval(grads)
    return grads


# ---- parity: the same call to both, forward and gradient ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_equals_mlx_forward_and_gradient(rng, shape, mask_kind, dtype_name):
    """npattn.mlx(q, k, v, scale=, mask=) == mx.fast.scaled_dot_product_attention with the
    same arguments (MLX's spelling of each mask), and so do the gradients, both == reference."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    mask, mlx_mask = mask_for(mask_kind, rng, H_q, L, S, dtype)
    mine = call(nm.scaled_dot_product_attention, q, k, v, mask=mlx_mask)
    theirs = call(mx.fast.scaled_dot_product_attention, q, k, v, mask=mlx_mask)
    assert type(mine) is mx.array and mine.dtype == dtype and mine.shape == theirs.shape
    assert_parity(_interop.asarray(mine), theirs, q, k, v, mask=mask, stats=STATS)
    dout = arrays(rng, batch, H_q, H_q, L, L, D, dtype=dtype)[0]
    mine_grads = gradients(nm.scaled_dot_product_attention, q, k, v, dout, mlx_mask)
    theirs_grads = gradients(mx.fast.scaled_dot_product_attention, q, k, v, dout, mlx_mask)
    assert all(g.dtype == dtype for g in mine_grads)
    assert_gradient_parity(mine_grads, theirs_grads, q, k, v, dout, mask=mask)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", ["course", "qwen2-0.5b-chunked", "qwen3-4b-decode"])
def test_sinks_and_their_gradient_equal_mlx(rng, shape, dtype_name):
    """sinks= means the same in both, and its gradient (dsinks) agrees."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    sinks = mx.array(rng.standard_normal(H_q, dtype=np.float32) * 2).astype(dtype)
    mine = call(nm.scaled_dot_product_attention, q, k, v, mask="causal", sinks=sinks)
    theirs = call(mx.fast.scaled_dot_product_attention, q, k, v, mask="causal", sinks=sinks)
    assert_parity(_interop.asarray(mine), theirs, q, k, v, mask="causal", sinks=sinks, stats=STATS)
    dout = arrays(rng, batch, H_q, H_q, L, L, D, dtype=dtype)[0]
    mine_grads = gradients(nm.scaled_dot_product_attention, q, k, v, dout, "causal", sinks)
    theirs_grads = gradients(mx.fast.scaled_dot_product_attention, q, k, v, dout, "causal", sinks)
    assert mine_grads[3].dtype == dtype and mine_grads[3].shape == (H_q,)
    assert_gradient_parity(mine_grads, theirs_grads, q, k, v, dout, mask="causal", sinks=sinks)


def test_float64_is_true_double(rng):
    """float64 MLX arrays: a float64 result and gradients, computed in double (MLX's own
    are float32-accurate), within npattn's float64 bound of the reference."""
    xs = [rng.standard_normal(s) for s in [(1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 3)]]
    q, k, v = (mx.array(x, dtype=mx.float64) for x in xs)
    dout = rng.standard_normal((1, 4, 5, 3))
    out = call(nm.scaled_dot_product_attention, q, k, v, mask="causal")
    assert out.dtype == mx.float64
    np.testing.assert_allclose(np.array(out), reference.sdpa(*xs), rtol=0, atol=1e-14)
    grads = gradients(nm.scaled_dot_product_attention, q, k, v, mx.array(dout, dtype=mx.float64), "causal")
    want = check_backward(*xs, dout)  # npattn.sdpa_backward on NumPy, held to the reference
    tolerance = backward_tolerance(*xs, dout, np.dtype(np.float64))
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == mx.float64
        np.testing.assert_allclose(np.array(got), expected, rtol=0, atol=float(np.max(tolerance[name][1])))


# ---- rows that see no key: MLX's difference, documented, not copied ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_bool_masked_empty_row_is_zeros_where_mlx_gives_mean_of_v(rng, dtype_name):
    """A row a bool mask hides from every key: zeros from npattn.mlx (and no gradient
    through it), the mean of V from MLX's CPU path; the other rows agree."""
    dtype = DTYPES[dtype_name]
    q, k, v = arrays(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
    visible = np.ones((3, 5), bool)
    visible[1] = False
    mine = f64(call(nm.scaled_dot_product_attention, q, k, v, mask=mx.array(visible)))
    theirs = f64(call(mx.fast.scaled_dot_product_attention, q, k, v, mask=mx.array(visible)))
    atol = 2 * float(mx.finfo(dtype).eps) * float(np.abs(f64(v)).max()) + 1e-6
    np.testing.assert_array_equal(mine[..., 1, :], 0)
    np.testing.assert_allclose(theirs[..., 1, :], mean_of_v(v, 4), rtol=0, atol=atol)
    np.testing.assert_allclose(mine[..., ::2, :], theirs[..., ::2, :], rtol=0, atol=atol)
    dq = gradients(nm.scaled_dot_product_attention, q, k, v, mx.ones((2, 4, 3, 8), dtype), mx.array(visible))[0]
    np.testing.assert_array_equal(f64(dq)[..., 1, :], 0)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_minus_inf_masked_empty_row_is_zeros_where_mlx_gives_nan(rng, dtype_name):
    """A row an additive mask sets to -inf everywhere: zeros from npattn.mlx, NaN from MLX."""
    dtype = DTYPES[dtype_name]
    q, k, v, bias = minus_inf_row(rng, dtype)
    mask = mx.array(bias).astype(dtype)
    mine = f64(call(nm.scaled_dot_product_attention, q, k, v, mask=mask))
    theirs = f64(call(mx.fast.scaled_dot_product_attention, q, k, v, mask=mask))
    assert np.isnan(theirs[..., 1, :]).all()
    np.testing.assert_array_equal(mine[..., 1, :], 0)
    assert not np.isnan(mine).any()


def test_causal_with_more_queries_than_keys_is_zeros_where_mlx_gives_mean_of_v(rng):
    """mask="causal" with T_q > T_kv leaves the first T_q - T_kv rows no key: zeros from
    npattn.mlx, the mean of V from MLX; the rows that see keys agree."""
    L, S = 6, 3
    q, k, v = arrays(rng, (1,), 4, 2, L, S, 8)
    mine = f64(call(nm.scaled_dot_product_attention, q, k, v, mask="causal"))
    theirs = f64(call(mx.fast.scaled_dot_product_attention, q, k, v, mask="causal"))
    np.testing.assert_array_equal(mine[..., : L - S, :], 0)
    np.testing.assert_allclose(theirs[..., : L - S, :], np.repeat(mean_of_v(v, 4)[..., None, :], L - S, -2), atol=1e-6)
    np.testing.assert_allclose(mine[..., L - S :, :], theirs[..., L - S :, :], rtol=1e-5, atol=1e-6)


# ---- arguments, conversion and errors ----


def test_strided_and_bfloat16_inputs(rng):
    """Transposed (B, T, N, D) views, in float32 and bfloat16 (whose strided form MLX
    views as uint16 for NumPy), give the result of contiguous arrays."""
    for dtype in (mx.float32, mx.bfloat16):
        q, k, v = arrays(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
        views = [mx.contiguous(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v)]
        got = call(nm.scaled_dot_product_attention, *views, mask="causal")
        want = call(nm.scaled_dot_product_attention, q, k, v, mask="causal")
        np.testing.assert_array_equal(f64(got), f64(want))


def test_numpy_mask_and_list_sinks(rng):
    """A NumPy mask and sinks as a list are taken as their MLX equivalents."""
    q, k, v = arrays(rng, (1,), 2, 2, 3, 5, 4)
    visible = np.tril(np.ones((3, 5), bool), 2)
    got = call(nm.scaled_dot_product_attention, q, k, v, mask=visible, sinks=[0.5, -1.0])
    want = call(nm.scaled_dot_product_attention, q, k, v, mask=mx.array(visible), sinks=mx.array([0.5, -1.0]))
    np.testing.assert_array_equal(f64(got), f64(want))


def test_errors_name_the_argument(rng):
    q, k, v = arrays(rng, (1,), 4, 2, 3, 5, 8)
    fn = nm.scaled_dot_product_attention
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v)  # required, as in MLX
    with pytest.raises(ValueError, match="mask"):
        fn(q, k, v, scale=1.0, mask="causal_top_left")
    with pytest.raises(TypeError, match="mask"):
        fn(q, k, v, scale=1.0, mask=3)
    with pytest.raises(TypeError, match="q must be an mx.array"):
        fn(np.array(q), k, v, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        fn(q[:, :3], k, v, scale=1.0)

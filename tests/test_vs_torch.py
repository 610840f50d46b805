"""npattn.sdpa == torch.nn.functional.scaled_dot_product_attention (PyTorch CPU),
and every PyTorch row of the README's peer table (SPEC §3), pinned.

Masks are always passed explicitly, since the defaults differ: npattn's
"causal" is bottom-right, which PyTorch spells
``attn_mask=torch.nn.attention.bias.causal_lower_right(L, S)``; npattn's
"causal_top_left" is PyTorch's ``is_causal=True``. GQA needs
``enable_gqa=True`` in PyTorch.

The tolerances are helpers.assert_parity's (npattn.testing's for the peer);
after the module, a line gives how many parity cases ran per dtype and the
largest |npattn - torch|. The whole module skips where torch is not installed.
"""

import warnings

import numpy as np
import pytest

import npattn
from helpers import MASK_KINDS, PEER_SHAPES, ParityStats, assert_parity, peer_visible, qkv
from npattn import _interop

torch = pytest.importorskip("torch")
F = torch.nn.functional
causal_lower_right = pytest.importorskip("torch.nn.attention.bias").causal_lower_right

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ---- the shapes and masks compared over, and the figures reported after the module ----

STATS = ParityStats(lambda: f"torch {torch.__version__}")
parity_summary = STATS.fixture()


# ---- helpers ----


def tensors(rng, batch, H_q, H_kv, L, S, D, D_v=None, dtype=torch.float32):
    """helpers.qkv's float32 q, k, v as torch tensors of dtype (rounded from float32)."""
    return [torch.from_numpy(x).to(dtype) for x in qkv(rng, batch, H_q, H_kv, L, S, D, D_v)]


def f64(t):
    """The exact float64 values of a tensor, for the reference."""
    return t.detach().double().numpy()


def mask_for(kind, rng, batch, H_q, L, S, dtype):
    """(npattn mask, torch keyword arguments) for one mask kind; random masks leave no
    row empty (empty rows have their own tests)."""
    if kind in ("causal", "causal_top_left", None):
        torch_kwargs = {
            "causal": {"attn_mask": causal_lower_right(L, S)},
            "causal_top_left": {"is_causal": True},
            None: {},
        }[kind]
        return kind, torch_kwargs
    visible = peer_visible(rng, H_q, L, S)
    if kind == "bool":
        return visible, {"attn_mask": torch.from_numpy(visible)}
    # additive: (*batch, 1, L, S), broadcast over heads; values exact in bfloat16
    bias = np.round(rng.standard_normal((*batch, 1, L, S)) * 4) / 4
    bias = np.where(visible[0], bias, -np.inf)
    # PyTorch wants the query's dtype; npattn takes the same values as float32
    # (a bfloat16 tensor mask: see test_tensor_masks_and_sinks)
    return bias.astype(np.float32), {"attn_mask": torch.from_numpy(bias).to(dtype)}


def torch_sdpa(q, k, v, scale=None, **kwargs):
    """PyTorch's sdpa with GQA switched on when H_q != H_kv."""
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kwargs)


# ---- parity: course and model shapes, every mask kind, three dtypes ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_sdpa_equals_torch(rng, shape, mask_kind, dtype_name):
    """npattn.sdpa(q, k, v, mask) == F.scaled_dot_product_attention with the same mask,
    and both == reference; inputs are torch tensors of the dtype under test."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    dtype = DTYPES[dtype_name]
    q, k, v = tensors(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    mask, torch_kwargs = mask_for(mask_kind, rng, batch, H_q, L, S, dtype)
    got = npattn.sdpa(q, k, v, mask=mask)  # torch tensors go straight in
    want = torch_sdpa(q, k, v, **torch_kwargs)
    assert type(got) is np.ndarray and got.shape == tuple(want.shape)
    assert got.dtype == _interop.asarray(want).dtype  # same dtype as PyTorch's result
    assert_parity(got, want, q, k, v, mask=mask, stats=STATS)


@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
def test_sdpa_equals_torch_float64(rng, mask_kind):
    """float64: PyTorch computes in double too, so the two agree to ~1e-15."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5, dtype=torch.float64)
    mask, torch_kwargs = mask_for(mask_kind, rng, (2,), 18, 3, 7, torch.float64)
    got = npattn.sdpa(q, k, v, mask=mask)
    want = torch_sdpa(q, k, v, **torch_kwargs).numpy()
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    STATS.record("float64", got, want)


def test_default_scale_agrees_and_default_mask_differs(rng):
    """Both default scale to 1/sqrt(D); PyTorch's default mask is None, npattn's "causal"."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5)
    want = torch_sdpa(q, k, v).numpy()  # PyTorch's defaults: no mask, 1/sqrt(E)
    np.testing.assert_allclose(npattn.sdpa(q, k, v, mask=None), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(npattn.sdpa(q, k, v), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_explicit_scale_agrees(rng, scale):
    """scale= means the same in both."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5)
    want = torch_sdpa(q, k, v, scale=scale, is_causal=True).numpy()
    got = npattn.sdpa(q, k, v, scale=scale, mask="causal_top_left")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- the peer table, PyTorch's column ----


@pytest.mark.parametrize("L, S", [(3, 7), (7, 3), (5, 5), (1, 6)])
def test_is_causal_is_causal_top_left(rng, L, S):
    """PyTorch's is_causal=True == npattn's "causal_top_left" (j <= i), for L < S and L > S;
    npattn's default "causal" (bottom-right) differs from it whenever L != S."""
    q, k, v = tensors(rng, (2,), 4, 2, L, S, 8)
    want = torch_sdpa(q, k, v, is_causal=True).numpy()
    np.testing.assert_allclose(npattn.sdpa(q, k, v, mask="causal_top_left"), want, rtol=1e-5, atol=1e-6)
    if L != S:
        assert not np.allclose(npattn.sdpa(q, k, v, mask="causal"), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("L, S", [(3, 7), (7, 3), (1, 6)])
def test_causal_lower_right_is_causal(rng, L, S):
    """PyTorch's causal_lower_right(L, S) bias == npattn's default "causal", including
    the rows that see no key when L > S: zeros in both (PyTorch 2.13 still warns that
    they "will produce NaNs", but gives 0)."""
    q, k, v = tensors(rng, (2,), 4, 2, L, S, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Lower right causal bias will produce NaNs", UserWarning)
        bias = causal_lower_right(L, S)
    want = torch_sdpa(q, k, v, attn_mask=bias).numpy()
    np.testing.assert_allclose(npattn.sdpa(q, k, v), want, rtol=1e-5, atol=1e-6)
    if L > S:
        assert (want[..., : L - S, :] == 0).all()


def empty_row_masks(L, S, dtype):
    """A bool mask and an additive -inf mask, both hiding every key from row 1."""
    visible = np.ones((L, S), bool)
    visible[1] = False
    return visible, np.where(visible, 0.0, -np.inf).astype(dtype)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("path", ["fused", "math: rank 3", "math: D_v != D"])
def test_row_that_sees_no_key_is_zero_in_both(rng, path, dtype_name):
    """A row that sees no key is 0 in npattn and in PyTorch 2.13 (>= 2.5), on the fused
    CPU kernel and on the math path, for a bool and for a -inf additive mask."""
    dtype = DTYPES[dtype_name]
    q, k, v = tensors(rng, (1,), 4, 2, 3, 5, 8, D_v=6 if "D_v" in path else 8, dtype=dtype)
    if "rank 3" in path:
        q, k, v = q[0], k[0], v[0]
    bool_mask, add_mask = empty_row_masks(3, 5, np.float32)
    # the other rows: a peer's bound for the dtype (npattn.testing.tolerance)
    atol = npattn.testing.tolerance(
        q, k, v, mask=None, dtype=np.dtype(dtype_name if dtype_name != "bfloat16" else "float32")
    )
    atol = max(atol, 2 * torch.finfo(dtype).eps * float(np.abs(f64(v)).max()))
    for mask, torch_mask in [
        (bool_mask, torch.from_numpy(bool_mask)),
        (add_mask, torch.from_numpy(add_mask).to(dtype)),
    ]:
        want = torch_sdpa(q, k, v, attn_mask=torch_mask)
        got = npattn.sdpa(q, k, v, mask=mask)
        assert not torch.isnan(want).any()
        assert (want[..., 1, :] == 0).all()
        np.testing.assert_array_equal(np.asarray(got[..., 1, :], np.float32), 0)
        np.testing.assert_allclose(np.asarray(got, np.float64), f64(want), rtol=0, atol=atol)


def test_rank_2_3_and_d_v_not_d_agree_with_torch(rng):
    """npattn agrees with PyTorch's results at rank 4 with D_v != D, rank 3 and rank 2
    (whichever of its kernels PyTorch picks for each)."""
    q, k, v = tensors(rng, (2,), 4, 2, 3, 7, 8, D_v=6)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # equal heads: no enable_gqa needed
    for args in ((q, k, v), (q[0], k[0], v[0]), (q[0, 0], k[0, 0], v[0, 0])):
        want = torch_sdpa(*args, is_causal=True).numpy()
        got = npattn.sdpa(*args, mask="causal_top_left")
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        STATS.record("float32", got, want)


def test_torch_has_no_sinks(rng):
    """PyTorch's sdpa takes no sinks= (npattn and MLX do)."""
    q, k, v = tensors(rng, (1,), 2, 2, 3, 3, 4)
    with pytest.raises(TypeError, match="sinks"):
        F.scaled_dot_product_attention(q, k, v, sinks=torch.zeros(2))


# ---- torch tensors as npattn inputs ----


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_tensors_go_straight_in(rng, dtype_name):
    """Torch CPU tensors of every float dtype go into npattn.sdpa; the result is a NumPy
    array in the matching dtype, bitwise equal to the call on the NumPy equivalents."""
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = getattr(torch, dtype_name)
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5, dtype=dtype)
    got = npattn.sdpa(q, k, v, threads=1)
    arrays = [_interop.asarray(t) for t in (q, k, v)]
    assert type(got) is np.ndarray
    assert got.dtype == arrays[0].dtype
    assert got.dtype.name == dtype_name
    np.testing.assert_array_equal(got, npattn.sdpa(*arrays, threads=1))


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_tensors_are_read_without_a_copy(dtype_name):
    """A CPU tensor, also a transposed view or one that requires grad, is read as a NumPy
    view of its own memory: no copy (bfloat16 through its bits as ml_dtypes.bfloat16)."""
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = getattr(torch, dtype_name)
    base = torch.randn(2, 7, 6, 5).to(dtype)
    for t in [base, base.transpose(1, 2), base.clone().requires_grad_(True)]:
        a = _interop.asarray(t)
        assert a.ctypes.data == t.data_ptr()
        assert a.strides == tuple(s * t.element_size() for s in t.stride())
        assert a.dtype.name == dtype_name
        np.testing.assert_array_equal(np.asarray(a, np.float32), t.detach().float().numpy())


def test_tensor_layouts_and_grad(rng):
    """Tensors viewed from a (B, L, H, D) buffer as (B, H, L, D) give the result of
    contiguous NumPy arrays; a tensor that requires grad gives it bitwise."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5)
    want = npattn.sdpa(q.numpy(), k.numpy(), v.numpy(), threads=1)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not any(x.is_contiguous() for x in strided)
    np.testing.assert_allclose(npattn.sdpa(*strided, threads=1), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(npattn.sdpa(q.requires_grad_(True), k, v, threads=1), want)


@pytest.mark.parametrize(
    "dtype_name",
    [
        "float32",
        "float16",
        "bfloat16",
    ],
)
def test_tensor_masks_and_sinks(rng, dtype_name):
    """Masks and sinks may be torch tensors too, of any float dtype: the same result as
    their values in NumPy float32."""
    pytest.importorskip("ml_dtypes")
    dtype = getattr(torch, dtype_name)
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5, dtype=dtype)
    _, add_mask = empty_row_masks(3, 7, np.float32)
    mask = torch.from_numpy(add_mask).to(dtype)
    sinks = torch.from_numpy(rng.standard_normal(18, dtype=np.float32)).to(dtype)
    got = npattn.sdpa(q, k, v, mask=mask, sinks=sinks, threads=1)
    want = npattn.sdpa(q, k, v, mask=add_mask, sinks=sinks.float().numpy(), threads=1)
    np.testing.assert_array_equal(got, want)


def test_mask_that_requires_grad(rng):
    """A float mask tensor that requires grad is read like q, k and v (detached)."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5)
    _, add_mask = empty_row_masks(3, 7, np.float32)
    got = npattn.sdpa(q, k, v, mask=torch.from_numpy(add_mask).requires_grad_(True), threads=1)
    np.testing.assert_array_equal(got, npattn.sdpa(q, k, v, mask=add_mask, threads=1))

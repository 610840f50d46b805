"""npattn.sdpa == torch.nn.functional.scaled_dot_product_attention (PyTorch CPU),
and every PyTorch row of the README's peer table (SPEC §3), pinned.

Masks are always passed explicitly, since the defaults differ: npattn's
"causal" is bottom-right, which PyTorch spells
``attn_mask=torch.nn.attention.bias.causal_lower_right(L, S)``; npattn's
"causal_top_left" is PyTorch's ``is_causal=True``. GQA needs
``enable_gqa=True`` in PyTorch.

The tolerances are derived in ``parity_tolerances``; after the module, a line
gives how many parity cases ran per dtype and the largest |npattn - torch|.
The whole module skips where torch is not installed.
"""

import warnings

import npattn
import numpy as np
import pytest
from npattn import _interop, reference
from parity import MASKS, SHAPES, ParityStats

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ---- the shapes and masks compared over, and the figures reported after the module ----

STATS = ParityStats(lambda: f"torch {torch.__version__}")
record = STATS.record
parity_summary = STATS.fixture()


# ---- helpers ----


def tensors(rng, batch, H_q, H_kv, L, S, D, D_v=None, dtype=torch.float32):
    """Unit-normal q, k, v as torch tensors of dtype (drawn in float32, then rounded)."""
    D_v = D if D_v is None else D_v
    shapes = ((*batch, H_q, L, D), (*batch, H_kv, S, D), (*batch, H_kv, S, D_v))
    return [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(dtype) for s in shapes]


def f64(t):
    """The exact float64 values of a tensor, for the reference."""
    return t.detach().double().numpy()


def mask_for(kind, rng, batch, H_q, L, S, dtype):
    """(npattn mask, torch keyword arguments) for one mask kind.

    Random masks keep, in every row, the key the bottom-right diagonal reaches, so no
    row is empty (empty rows have their own tests).
    """
    if kind in ("causal", "causal_top_left", None):
        torch_kwargs = {
            "causal": {"attn_mask": causal_lower_right(L, S)},
            "causal_top_left": {"is_causal": True},
            None: {},
        }[kind]
        return kind, torch_kwargs
    visible = rng.random((H_q, L, S)) < 0.6
    visible[:, np.arange(L), np.minimum(np.arange(L) + S - L, S - 1)] = True
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


def max_logit(q, k, mask):
    """max |scale * q.k + mask| over visible entries, in float64 (GQA by repeat)."""
    q, k = f64(q), f64(k)
    k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    scores = np.abs(q @ np.swapaxes(k, -1, -2)) * q.shape[-1] ** -0.5
    bias = 0.0
    if mask is not None and not isinstance(mask, str):
        m = np.asarray(mask, dtype=np.float64) if not torch.is_tensor(mask) else f64(mask)
        bias = np.abs(m[np.isfinite(m)]).max(initial=0.0) if m.dtype != bool else 0.0
    return float(scores.max(initial=0.0)) + bias


def parity_tolerances(dtype, q, k, v, mask):
    """((rtol, atol) of npattn vs reference, (rtol, atol) of torch vs reference).

    float32 on the course's small shapes: the issue's rtol 1e-5 / atol 1e-6 for
    both. float32 on model shapes (D up to 128): 4 float32 ulps of (1 + m) V, the
    bound tests/conftest.py derives, with m = max |logit|, V = max |v|; measured:
    npattn up to 0.14, PyTorch 0.19 of it (0.13 and 0.17 of the small-shape one). For float16 and bfloat16 (eps = that dtype's
    machine epsilon), with inputs already in that dtype, so exact in float64:

    - npattn computes in float32 tiles and rounds the result once, to nearest:
      |err| <= ulp(out)/2 <= eps/2 |out|, so rtol = eps/2, plus that float32
      bound as atol for a value float32 noise tips across a rounding boundary.
      This asks for a correctly rounded result; measured: up to 0.99 of it, as
      a correctly rounded result must come close to half an ulp somewhere.
    - PyTorch's CPU kernel computes the logits, softmax and sums in float32 too,
      but rounds the probabilities to the input dtype before P @ V (eps/2 of
      sum p |v| <= eps/2 V) and then the output (eps/2 |out| <= eps/2 V):
      atol = eps V plus the float32 bound. Measured: 0.33 of it.
    """
    m = max_logit(q, k, mask)
    V = float(np.abs(f64(v)).max())
    f32_bound = 4 * np.finfo(np.float32).eps * (1 + m) * V
    if dtype == torch.float32:
        return ((1e-5, 1e-6),) * 2 if q.shape[-1] <= 8 else ((0.0, f32_bound),) * 2
    eps = torch.finfo(dtype).eps
    return (eps / 2, f32_bound), (0.0, eps * V + f32_bound)


# ---- parity: course and model shapes, every mask kind, three dtypes ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASKS, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sdpa_equals_torch(rng, shape, mask_kind, dtype_name):
    """npattn.sdpa(q, k, v, mask) == F.scaled_dot_product_attention with the same mask,
    and both == reference; inputs are torch tensors of the dtype under test."""
    batch, H_q, H_kv, L, S, D = SHAPES[shape]
    dtype = DTYPES[dtype_name]
    q, k, v = tensors(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    mask, torch_kwargs = mask_for(mask_kind, rng, batch, H_q, L, S, dtype)

    got = npattn.sdpa(q, k, v, mask=mask)  # torch tensors go straight in
    want = torch_sdpa(q, k, v, **torch_kwargs)
    ref_mask = f64(mask) if torch.is_tensor(mask) else mask
    ref = reference.sdpa(f64(q), f64(k), f64(v), mask=ref_mask)

    assert type(got) is np.ndarray and got.shape == tuple(want.shape)
    assert got.dtype == _interop.asarray(want).dtype  # same dtype as PyTorch's result
    got64, want64 = np.asarray(got, np.float64), f64(want)
    (rtol_n, atol_n), (rtol_t, atol_t) = parity_tolerances(dtype, q, k, v, mask)
    np.testing.assert_allclose(got64, ref, rtol=rtol_n, atol=atol_n, err_msg="npattn vs reference")
    np.testing.assert_allclose(want64, ref, rtol=rtol_t, atol=atol_t, err_msg="torch vs reference")
    # hence npattn vs torch within the sum of the two
    np.testing.assert_allclose(got64, want64, rtol=rtol_n + rtol_t, atol=atol_n + atol_t, err_msg="npattn vs torch")
    record(dtype_name, float(np.abs(got64 - want64).max(initial=0.0)))


@pytest.mark.parametrize("mask_kind", MASKS, ids=str)
def test_sdpa_equals_torch_float64(rng, mask_kind):
    """float64: PyTorch computes in double too, so the two agree to ~1e-15."""
    q, k, v = tensors(rng, (2,), 18, 6, 3, 7, 5, dtype=torch.float64)
    mask, torch_kwargs = mask_for(mask_kind, rng, (2,), 18, 3, 7, torch.float64)
    got = npattn.sdpa(q, k, v, mask=mask)
    want = torch_sdpa(q, k, v, **torch_kwargs).numpy()
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    record("float64", float(np.abs(got - want).max()))


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
    # the other rows: the float16/bfloat16 bound of parity_tolerances, ~ eps V
    atol = 2 * torch.finfo(dtype).eps * float(np.abs(f64(v)).max()) + 1e-5
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


def test_fused_kernel_only_at_rank_4_and_d_v_equal_d(rng):
    """PyTorch's fused CPU (flash) kernel takes rank 4 with D_v == D only; the math path
    takes the rest (rank 3, rank 2, D_v != D), and npattn agrees with it there."""
    q, k, v = tensors(rng, (2,), 4, 2, 3, 7, 8, D_v=6)
    rank_4_d_v = (q, k, v)
    rank_3 = (q[0], k[0], k[0].clone())
    rank_2 = (q[0, 0], k[0, 0], v[0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch says why it cannot
        for args in (rank_4_d_v, rank_3):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
                torch_sdpa(*args)
    with sdpa_kernel(SDPBackend.MATH):
        for args in (rank_4_d_v, rank_3, rank_2):
            want = torch_sdpa(*args, is_causal=True).numpy()
            got = npattn.sdpa(*args, mask="causal_top_left")
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            record("float32", float(np.abs(got - want).max()))


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

"""float16, bfloat16 and mixed dtypes: npattn.sdpa == npattn.reference.sdpa on
float64 copies, the result in the input dtype (np.result_type when mixed).

float16 and ml_dtypes.bfloat16 are computed in float32 tiles and rounded once,
to nearest, so the result must be the float64 reference correctly rounded, up
to float32 noise (helpers.own_tolerance). bfloat16 tests skip where ml_dtypes
is not installed.
"""

import numpy as np
import pytest

import npattn
from helpers import check, dtype_of, f64, make_mask, qkv, randn, run_script
from npattn import _interop, reference
from npattn.testing import MODEL_HEADS

DTYPE_NAMES = ["float16", "bfloat16"]


# ---- float16 and bfloat16 against the reference ----


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "additive"], ids=str)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_course_shapes_correctly_rounded(rng, batch, mask, name):
    """On the course's H_q=18, H_kv=6, L=3, S=7, D=5, every mask kind: the result is the
    reference rounded to the input dtype."""
    dtype = dtype_of(name)
    q, k, v = qkv(rng, batch, 18, 6, 3, 7, 5, dtype=dtype)
    check(q, k, v, mask=make_mask(rng, mask, (*batch, 18, 3, 7), dtype, empty_rows=False))


MODELS = {  # (batch, L, S): prefill, chunked prefill, decode; heads from npattn.testing.MODEL_HEADS
    "Qwen2-0.5B": [((1,), 96, 96), ((1,), 32, 160), ((2,), 1, 200)],
    "Qwen3-4B": [((1,), 64, 64), ((1,), 16, 100), ((1,), 1, 150)],
    "GPT-2": [((1,), 80, 80), ((2,), 24, 120), ((3,), 1, 129)],
}


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("phase", [0, 1, 2], ids=["prefill", "chunked", "decode"])
@pytest.mark.parametrize("model", list(MODELS))
def test_model_shapes_correctly_rounded(rng, model, phase, name):
    """Model head layouts in prefill, chunked prefill and decode, causal and with sinks."""
    dtype = dtype_of(name)
    (H_q, H_kv, D), phases = MODEL_HEADS[model], MODELS[model]
    batch, L, S = phases[phase]
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    check(q, k, v)
    check(q, k, v, sinks=randn(rng, H_q, dtype, 2.0), mask=None)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_scale_sinks_d_v_rank_2(rng, name):
    """scale, sinks in the input dtype, D_v != D and rank-2 operands."""
    dtype = dtype_of(name)
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8, D_v=3, dtype=dtype)
    check(q, k, v, scale=0.7, sinks=randn(rng, 4, dtype))
    got = check(q[0, 0], k[0, 0], v[0, 0], mask="causal_top_left")
    assert got.shape == (5, 3)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_strided_inputs(rng, name):
    """Transposed (B, L, H, D) views, negative strides and a non-contiguous last axis
    are read correctly: the reference, correctly rounded."""
    dtype = dtype_of(name)
    shapes = [(2, 5, 6, 16), (2, 7, 3, 16), (2, 7, 3, 32)]  # (B, L or S, H, D): a model's layout
    q, k, v = (randn(rng, s, dtype).transpose(0, 2, 1, 3) for s in shapes)  # (B, H, L, D) views
    check(q, k, v)
    check(q[:, ::-1], k[..., ::-1, :], v[:, :, ::-1, ::2], mask="causal_top_left")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_large_logits_computed_in_float32(rng, name):
    """Scores far beyond float16's range (|q.k| ~ 1e6 > 65504) stay finite and correct:
    the products are float32, not the input dtype."""
    dtype = dtype_of(name)
    q, k, v = qkv(rng, (1,), 2, 1, 4, 6, 64)
    q, k, v = (q * 100).astype(dtype), (k * 100).astype(dtype), v.astype(dtype)
    got = check(q, k, v, scale=1.0)
    assert np.isfinite(f64(got)).all()


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_rows_that_see_no_key_are_zero(rng, name):
    """A row that sees no key is 0 in the half dtype too; S == 0 gives zeros."""
    dtype = dtype_of(name)
    q, k, v = qkv(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
    visible = np.ones((3, 5), bool)
    visible[1] = False
    for mask in (visible, np.where(visible, 0.0, -np.inf).astype(dtype)):
        got = npattn.sdpa(q, k, v, mask=mask)
        assert got.dtype == dtype
        np.testing.assert_array_equal(f64(got[..., 1, :]), 0)
    empty = npattn.sdpa(q, k[..., :0, :], v[..., :0, :], mask=None)
    assert empty.dtype == dtype and empty.shape == (2, 4, 3, 8)
    np.testing.assert_array_equal(f64(empty), 0)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_out_in_the_half_dtype(rng, name):
    """out= of the input dtype is filled and returned; a float32 out is refused."""
    dtype = dtype_of(name)
    q, k, v = qkv(rng, (2,), 4, 2, 3, 5, 8, dtype=dtype)
    out = np.empty((2, 4, 3, 8), dtype)
    assert npattn.sdpa(q, k, v, out=out, threads=1) is out
    np.testing.assert_array_equal(out, npattn.sdpa(q, k, v, threads=1))
    with pytest.raises(ValueError, match="out"):
        npattn.sdpa(q, k, v, out=np.empty((2, 4, 3, 8), np.float32))


# ---- mixed dtypes promote by np.result_type ----

MIXED = [  # (q, k, v) dtypes and the result's
    (("float32", "float64", "float32"), "float64"),
    (("float64", "float32", "float32"), "float64"),
    (("float32", "float32", "float64"), "float64"),
    (("float16", "float32", "float32"), "float32"),
    (("float32", "float16", "float16"), "float32"),
    (("float16", "float16", "float64"), "float64"),
    (("bfloat16", "float32", "bfloat16"), "float32"),
    (("bfloat16", "bfloat16", "float64"), "float64"),
    (("float16", "bfloat16", "bfloat16"), "float32"),  # NumPy cannot promote these two
    (("float32", "bfloat16", "bfloat16"), "float32"),  # a float32 model over a half cache
    (("float32", "float16", "bfloat16"), "float32"),
    (("bfloat16", "float16", "float16"), "float32"),
    (("float16", "float32", "float16"), "float32"),
]


@pytest.mark.parametrize("names, result", MIXED, ids=lambda x: "-".join(x) if isinstance(x, tuple) else x)
def test_mixed_dtypes_promote(rng, names, result):
    """Mixed float dtypes compute in, and return, the promoted dtype: the reference on
    float64 copies within that dtype's bound. The reference, the Dask split and the
    checker promote by the same rule (npattn._args.result_dtype, read from the core)."""
    q, k, v = qkv(rng, (2,), 18, 6, 3, 7, 5, dtypes=[dtype_of(n) for n in names])
    assert check(q, k, v).dtype == np.dtype(result)
    assert reference.sdpa(q, k, v).dtype == np.dtype(result)


# ---- a float mask of any float dtype works with any input dtype ----

ALL_FLOATS = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("mask_name", ALL_FLOATS)
@pytest.mark.parametrize("input_name", ALL_FLOATS)
def test_float_mask_of_any_dtype(rng, input_name, mask_name):
    """An additive mask of any float dtype gives, with inputs of any float dtype, bitwise
    the result of the same values as a float64 mask, and matches the reference."""
    dtype, mask_dtype = dtype_of(input_name), dtype_of(mask_name)
    q, k, v = qkv(rng, (2,), 18, 6, 3, 7, 5, dtype=dtype)
    bias = make_mask(rng, "additive", (2, 1, 3, 7), np.float64, empty_rows=False)  # exact in every dtype
    got = check(q, k, v, mask=bias.astype(mask_dtype), threads=1)
    np.testing.assert_array_equal(got, npattn.sdpa(q, k, v, mask=bias, threads=1))


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_half_mask_values_are_read_exactly(rng, name):
    """A float16 / bfloat16 mask with values that are not round numbers is read exactly
    (converted, not reinterpreted): same as its values in float64."""
    dtype = np.dtype(name)
    q, k, v = qkv(rng, (1,), 4, 2, 3, 7, 8, dtype=dtype)
    for mask_name in DTYPE_NAMES:
        mask = randn(rng, (3, 7), dtype_of(mask_name), 3.0)
        got = npattn.sdpa(q, k, v, mask=mask, threads=1)
        np.testing.assert_array_equal(got, npattn.sdpa(q, k, v, mask=f64(mask).astype(dtype), threads=1))


# ---- the reference, for the half dtypes (SPEC §2: the same semantics as sdpa) ----


def test_reference_takes_a_bfloat16_mask(rng):
    """npattn.reference.sdpa takes a bfloat16 mask, as npattn.sdpa does."""
    bf16 = dtype_of("bfloat16")
    q, k, v = qkv(rng, (1,), 4, 2, 3, 7, 8)
    mask = make_mask(rng, "additive", (3, 7), bf16)
    np.testing.assert_allclose(reference.sdpa(q, k, v, mask=mask), reference.sdpa(q, k, v, mask=f64(mask)))


def test_reference_takes_float16_with_bfloat16(rng):
    """npattn.reference.sdpa(float16, bfloat16, bfloat16) returns float32, as npattn.sdpa."""
    q, k, v = qkv(rng, (1,), 4, 2, 3, 7, 8, dtypes=[dtype_of(n) for n in ("float16", "bfloat16", "bfloat16")])
    assert reference.sdpa(q, k, v).dtype == np.float32


# ---- ml_dtypes stays optional ----


def test_import_npattn_imports_no_ml_dtypes_torch_or_mlx():
    """import npattn, and float32 and float16 calls, import neither ml_dtypes nor torch
    nor mlx (checked in a fresh interpreter's sys.modules)."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import npattn\n"
        "after_import = sorted(m for m in ('ml_dtypes', 'torch', 'mlx') if m in sys.modules)\n"
        "for dt in (np.float32, np.float16):\n"
        "    x = np.ones((1, 2, 3, 4), dt)\n"
        "    npattn.sdpa(x, x, x)\n"
        "after_calls = sorted(m for m in ('ml_dtypes', 'torch', 'mlx') if m in sys.modules)\n"
        "print(after_import, after_calls)\n"
    )
    out = run_script(code)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr


class DLPackOnly:
    """An array from some other library that speaks only DLPack (no __array__, no buffer)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("name", ["float16", "float32"])
def test_dlpack_only_inputs_go_in(rng, name):
    """An object that offers only __dlpack__ is read through np.from_dlpack, in place."""
    q, k, v = qkv(rng, (2,), 4, 2, 3, 5, 8, dtypes=(np.dtype(name),) * 3)
    got = npattn.sdpa(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), threads=1)
    np.testing.assert_array_equal(got, npattn.sdpa(q, k, v, threads=1))
    assert np.shares_memory(_interop.asarray(DLPackOnly(q)), q)

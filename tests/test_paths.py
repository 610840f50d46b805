"""Every code path of the core agrees with the reference: each SIMD variant of
the softmax kernel (forced through a private hook), each tile-size regime
(narrow to very wide rows), split-K decode with its log-sum-exp merge, the
exact path for NaN, and the float16 conversions."""

import numpy as np
import pytest

import npattn
from npattn import _core

VARIANTS = ["portable", "avx2", "avx512"]


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Runs the test with one kernel variant forced; skips what this CPU lacks."""
    try:
        _core.debug_force_simd(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    try:
        yield request.param
    finally:
        _core.debug_force_simd("")


def normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# (H_q, H_kv, L, S, D, D_v): each row lands in another tile regime of attention.c
REGIMES = [
    pytest.param(8, 2, 300, 300, 64, 64, id="prefill-D64"),
    pytest.param(4, 1, 100, 700, 128, 128, id="chunked-D128"),
    pytest.param(3, 3, 37, 61, 8, 8, id="narrow-D8"),
    pytest.param(2, 1, 9, 140, 300, 200, id="wide-D300"),
    pytest.param(2, 2, 5, 70, 1024, 16, id="very-wide-D1024"),
    pytest.param(18, 6, 3, 7, 5, 5, id="course"),
]


@pytest.mark.parametrize("H_q, H_kv, L, S, D, D_v", REGIMES)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "float"])
def test_each_variant_and_tile_regime_matches_reference(variant, check, rng, H_q, H_kv, L, S, D, D_v, mask):
    """sdpa == reference for every kernel variant, tile regime and mask kind."""
    q = normal(rng, (2, H_q, L, D))
    k = normal(rng, (2, H_kv, S, D))
    v = normal(rng, (2, H_kv, S, D_v))
    if mask == "bool":
        mask = rng.random((H_q, L, S)) < 0.7
    elif mask == "float":
        mask = np.where(rng.random((L, S)) < 0.7, rng.standard_normal((L, S)), -np.inf).astype(np.float32)
    check(q, k, v, mask=mask)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mask", ["causal", None, "bool"])
def test_split_k_decode_matches_reference(variant, check, rng, threads, sinks, mask):
    """Decode with one kv head and many keys splits the keys across threads;
    the merged result equals the reference and repeats bitwise."""
    S = 5000
    q = normal(rng, (1, 4, 1, 64))
    k = normal(rng, (1, 1, S, 64))
    v = normal(rng, (1, 1, S, 48))
    kwargs = {"threads": threads}
    if sinks:
        kwargs["sinks"] = rng.standard_normal(4) * 3
    if mask == "bool":
        mask = rng.random((4, 1, S)) < 0.5
        mask[1] = False  # one head sees no key: zeros, or only its sink
    kwargs["mask"] = mask
    first = check(q, k, v, **kwargs)
    again = npattn.sdpa(q, k, v, **kwargs)
    assert np.array_equal(first, again, equal_nan=True)


def test_split_k_float64_matches_reference(check, rng):
    """The float64 merge is exact to float64 rounding."""
    q = rng.standard_normal((1, 2, 2, 32))
    k = rng.standard_normal((1, 1, 6000, 32))
    v = rng.standard_normal((1, 1, 6000, 32))
    check(q, k, v, threads=4, sinks=np.array([0.5, -1.0]))


def test_nan_in_a_visible_key_takes_the_exact_path(variant, rng):
    """A NaN score makes only the rows that see it NaN, in every variant."""
    q = normal(rng, (1, 2, 40, 16))
    k = normal(rng, (1, 1, 40, 16))
    v = normal(rng, (1, 1, 40, 16))
    k[0, 0, 20, 3] = np.nan  # causal: rows 20.. see key 20
    out = npattn.sdpa(q, k, v)
    assert np.isnan(out[:, :, 20:]).all()
    assert np.isfinite(out[:, :, :20]).all()
    ref = npattn.reference.sdpa(q[:, :, :20].astype(float), k[:, :, :20].astype(float), v[:, :, :20].astype(float))
    np.testing.assert_allclose(out[:, :, :20], ref, atol=1e-5)


def test_float16_conversions_in_each_variant(variant, rng):
    """float16 tiles convert the same way in every variant (F16C or portable):
    results within float16 rounding of the float64 reference."""
    q, k, v = (normal(rng, s, np.float16) for s in [(1, 4, 33, 64), (1, 2, 50, 64), (1, 2, 50, 64)])
    got = npattn.sdpa(q, k, v)
    want = npattn.reference.sdpa(q.astype(float), k.astype(float), v.astype(float))
    assert got.dtype == np.float16
    # one float16 rounding of a value |x| <= max|v| < 8: half an ulp at 8 is 2**-8
    np.testing.assert_allclose(got.astype(float), want, rtol=0, atol=2**-8)


def test_simd_reports_the_variant_in_use():
    """The hook reports the variant that runs; '' restores the best one."""
    best = _core.simd()
    assert best in VARIANTS
    _core.debug_force_simd("portable")
    try:
        assert _core.simd() == "portable"
    finally:
        _core.debug_force_simd("")
    assert _core.simd() == best
    with pytest.raises(ValueError):
        _core.debug_force_simd("neon")

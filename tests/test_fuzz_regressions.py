"""Inputs the fuzzers found, kept as tests, each reduced by hand to the smallest call.

0.1.0's coverage-guided fuzzer found scales so far from 1 that folding
scale * log2(e) into q overflowed or vanished where scale * (q . k) did not;
0.1.0 refused them. The core no longer folds anything into q: float32 tiles
that overflow are recomputed in double, and those calls now give the
reference's answer.
"""

import numpy as np
import pytest

import npattn
from helpers import check, check_backward, kernels, runnable_kernels
from helpers.compare import assert_within
from npattn import reference


def test_scale_of_minus_float64_max():
    """crash-94ca464a: float64, rank 2, scale = -DBL_MAX, with a sink: every score is
    about -1e307, so the sink takes all the weight and the result is exactly 0, as in
    the reference."""
    q = np.full((5, 1), 0.25)
    got = npattn.sdpa(q, q, q, scale=-np.finfo(np.float64).max, sinks=[-1.33], threads=1)
    np.testing.assert_array_equal(got, reference.sdpa(q, q, q, scale=-np.finfo(np.float64).max, sinks=[-1.33]))
    np.testing.assert_array_equal(got, 0)


@pytest.mark.parametrize("scale", [1e39, -3e38, 1.5e-212, 1e-31])
def test_scales_beyond_float32_range(scale):
    """crash-89ba3b06 and a hypothesis finding: float32 with a scale beyond float's range
    computes in double, and gives the reference's answer."""
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((1, 1, 2, 4)) / np.sqrt(max(abs(scale), 1.0))).astype(np.float32)
    check(q, q, q, scale=scale, mask=None)


def test_scaled_products_overflowing_in_float64():
    """crash-65c782f1: float64, scale 5e307: the terms of (q * scale) . k overflowed while
    q . k cancels to 0; scale * (q . k) is 0, and the weights are uniform."""
    q = np.array([[2.0, 2.0]])
    k = np.array([[2.0, -2.0], [0.1, -0.1]])
    got = npattn.sdpa(q, k, k[:, :1], mask=None, scale=5e307)
    np.testing.assert_allclose(got, [[1.05]], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_row_whose_scores_are_all_minus_inf_is_zeros_despite_nan_values(dtype):
    """differential 20261130:36219 and :19679: a -inf in q makes every score of its row
    -inf, so the row sees no key and is zeros (SPEC: never NaN), although a value row
    holds NaN; the reference's 0 * NaN had made it NaN there."""
    q = np.array([[[[-np.inf, 0.5]], [[1.0, 0.5]]]], dtype=dtype)  # head 0 sees no key
    k = np.array([[[[1.0, 0.25], [2.0, -1.0], [0.5, 0.5]]]], dtype=dtype)
    v = np.array([[[[1.0, np.nan], [2.0, 3.0], [4.0, 5.0]]]], dtype=dtype)
    want = reference.sdpa(q, k, v, mask=None)
    np.testing.assert_array_equal(want[0, 0], 0)
    assert np.isnan(want[0, 1, 0, 1]) and np.isfinite(want[0, 1, 0, 0])  # head 1 sees the NaN
    np.testing.assert_array_equal(npattn.sdpa(q, k, v, mask=None), want.astype(dtype))


@pytest.mark.parametrize("sign", [1, -1])
def test_a_float64_mask_beyond_float32_range_with_float32_inputs(sign):
    """A float64 mask [1e40, 1e39] (or [-1e39, -1e40]) with float32 inputs: key 0 takes all
    the weight, as with float64 inputs; 0.2 saturated both to FLT_MAX, so they tied and
    the result was the mean of v0 and v1. The weights and the backward pass too (given
    the float64 lse: a float32 one cannot hold 1e40)."""
    q = np.zeros((1, 1, 1, 4), np.float32)
    k = np.zeros((1, 1, 2, 4), np.float32)
    v = np.array([[[[1.0, -1.0], [3.0, 5.0]]]], np.float32)
    mask = np.array([[1e40, 1e39]]) if sign > 0 else np.array([[-1e39, -1e40]])
    out, lse = npattn.sdpa(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_array_equal(out, v[:, :, :1])
    np.testing.assert_array_equal(npattn.attention_weights(q, k, mask=mask), [[[[1.0, 0.0]]]])
    dout = np.array([[[[0.5, 2.0]]]], np.float32)
    lse = npattn.sdpa(*(x.astype(np.float64) for x in (q, k, v)), mask=mask, return_lse=True)[1]
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, mask=mask)
    np.testing.assert_array_equal(grads.dv, [[[[0.5, 2.0], [0.0, 0.0]]]])
    np.testing.assert_array_equal(grads.dq, 0)
    np.testing.assert_array_equal(grads.dk, 0)


def test_backward_tolerance_at_logits_float32_cannot_hold():
    """fuzz 7:94658: float32 (bfloat16 in the case found), logits of about 1e7, one key row
    repeated 564 times. The exact weights are uniform; float32 scores of that size are off by
    tens of units, and lse by its own ulp, so the recomputed weights are off by factors of
    e**10 and more. The tolerance took a logit error u as a relative weight error u, true
    only to first order; the weight error is expm1(u), and the check refused the result."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((14, 1, 128)) * 1e3).astype(np.float32)
    k = np.repeat((rng.standard_normal((1, 1, 128)) * 1e3).astype(np.float32), 564, axis=1)
    v = np.repeat(rng.standard_normal((1, 1, 128)).astype(np.float32), 564, axis=1)
    dout = rng.standard_normal((14, 1, 128)).astype(np.float32)
    for table in runnable_kernels():
        with kernels(table):
            check_backward(q, k, v, dout, scale=-2.7, threads=1)


@pytest.mark.parametrize("L", [1, 3])
def test_many_equal_weights_round_within_the_bound(L):
    """fuzz 7:179918: 2405 keys of one value row, all logits 0 (q = k = 0) and a sink: the
    weights are equal, and equal terms round alike, so summing P @ v key after key grew
    its error with the keys (1.4x the bound, which grows with their square root). The
    streaming kernels now sum each tile of keys from zero and add it to O."""
    q = np.zeros((14, L, 128), np.float32)
    k = np.zeros((2, 2405, 128), np.float32)
    v = np.broadcast_to(np.linspace(-3.5, 3.5, 128, dtype=np.float32), (2, 2405, 128))
    for table in runnable_kernels():
        with kernels(table):
            for threads in (1, 2):
                check(q, k, v, mask=None, sinks=np.full(14, 0.625), threads=threads)


@pytest.mark.parametrize("sinks", [None, [0.5]])
def test_a_nan_value_under_a_minus_inf_score_is_nan_for_every_split(sinks):
    """fuzz 7:182209: a key whose score is -inf has weight 0, and 0 * its NaN value is NaN in
    the formula and in one pass over the keys. Split over threads, the part holding that key
    saw no other key and was left out of the merge, so 3 threads gave 0 where 1 gave NaN.
    A part that sees nothing now keeps its NaNs; a row that sees no key at all is still 0."""
    q = np.ones((1, 1, 1, 128), np.float32)
    k = np.random.default_rng(1).standard_normal((1, 1, 8192, 128)).astype(np.float32)
    k[..., :4096, 0] = -np.inf  # scores -inf: the first half of the keys weigh nothing
    v = np.ones((1, 1, 8192, 3), np.float32)
    v[..., 5, 1] = np.nan
    want = reference.sdpa(q, k, v, mask=None, sinks=sinks)
    assert np.isnan(want[..., 1]).all() and np.isfinite(want[..., ::2]).all()
    for table in runnable_kernels():
        with kernels(table):
            for threads in (1, 2, 3, 4):
                got = npattn.sdpa(q, k, v, mask=None, sinks=sinks, threads=threads)
                np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{table}, {threads} threads")
    k[..., 4096:, 0] = -np.inf  # no key has weight: zeros without a sink, 0 * NaN with one
    want = reference.sdpa(q, k, v, mask=None, sinks=sinks)
    for threads in (1, 2, 3, 4):
        np.testing.assert_array_equal(npattn.sdpa(q, k, v, mask=None, sinks=sinks, threads=threads), want)


def test_a_subnormal_half_result_correctly_rounded_passes():
    """fuzz 8:131308: a float16 result of 2.05e-5 lies among float16's subnormals, 2**-24
    apart, where rounding is off by up to half of that, not by eps/2 of the value; the
    tests' bound for half results allowed only the latter and refused npattn's correctly
    rounded result."""
    v = (np.array([1.0, 2.0, 4.0]) * 7.07e-6).astype(np.float16)[:, None]  # subnormals
    q = k = np.zeros((3, 2), np.float16)  # equal weights: the result is the mean of v
    got = check(q, k, v, mask=None)
    np.testing.assert_array_equal(got, np.float16(np.mean(v.astype(np.float64))))


def test_a_half_gradient_rounding_to_infinity_within_its_tolerance_holds():
    """fuzz 8:203297 and 8:44793: float16 gradients near 65504. A value within tolerance of
    the exact one may round to -inf (exact -65512, allowed 1.5e6), and where the tolerance
    is unbounded a finite value holds beside an exact one beyond the range; the tests'
    comparison refused both. An infinity still fails where no value within tolerance
    reaches the overflow threshold (65520)."""
    half = np.float16
    assert_within(np.array([-np.inf], half), np.array([-65512.0]), 0.0, 1.5e6, "dk")
    assert_within(np.array([-65504.0], half), np.array([-70000.0]), 0.0, np.inf, "dq")
    with pytest.raises(AssertionError, match="dk: 1 of 1 elements beyond tolerance"):
        assert_within(np.array([-np.inf], half), np.array([-65512.0]), 0.0, 4.0, "dk")
    with pytest.raises(AssertionError, match="dk: 1 of 1 elements beyond tolerance"):
        assert_within(np.array([np.inf], half), np.array([-65512.0]), 0.0, 1.5e6, "dk")


def test_a_bfloat16_gradient_flushed_below_float32_normal_under_fast():
    """fuzz 59:30936 (avx512bf16): key 1's logit lies about 1e3 below key 0's, so its
    weight and dS are tiny and its dk sums to -1.15e-38 at D index 8, below float32's
    smallest normal number, where the bfloat16 dot products of precision="fast" flush a
    sum to 0; the "fast" tolerance allowed 2.9e-39 and now allows that flush. On every
    table this CPU runs."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    q = np.array([[[-0.5390625, -1.1328125, -0.318359375, 0.42578125, -1.0703125, 0.255859375, 1.375,
                    -0.53515625, 0.369140625, 0.84765625]]]).astype(bf16)  # fmt: skip
    k = np.array([[[-796.0, 398.0, 1744.0, 1112.0, -1280.0, 1600.0, -406.0, 424.0, -620.0, 612.0],
                   [-1952.0, -70.5, 404.0, 181.0, -552.0, -2032.0, 114.0, 1888.0, 30.5, 732.0]]])  # fmt: skip
    k = k.astype(bf16)
    v = np.array([[[-0.001556396484375, 0.0009765625, 0.001861572265625, 0.000156402587890625],
                   [-0.00188446044921875, 0.00020503997802734375, -0.00090789794921875,
                    -0.000843048095703125]]]).astype(bf16)  # fmt: skip
    mask = np.array([[-1.25, 0.0]]).astype(bf16)
    dout = np.array([[[-0.4921875, 0.0002651214599609375, 1.0546875, -1.921875]]]).astype(bf16)
    for name in runnable_kernels():
        with kernels(name):
            check_backward(q, k, v, dout, mask=mask, precision="fast")

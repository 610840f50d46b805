"""SPEC section 8: npattn.testing.assert_attention_close passes correct outputs of
every dtype and library, and fails, naming the element, on an output one step
beyond the tolerance it states."""

import re

import numpy as np
import pytest

import npattn
from helpers import dtype_of, make_mask, qkv
from npattn import testing
from npattn.testing import assert_attention_close

DTYPES = ["float64", "float32", "float16", "bfloat16"]


def step(x, dtype, up):
    """The neighbour of x in dtype, toward +inf (up) or -inf."""
    if dtype.name != "bfloat16":
        return np.nextafter(np.asarray(x, dtype), np.asarray(np.inf if up else -np.inf, dtype))
    bits = np.asarray(x, dtype).astype(np.float32).view(np.uint32)  # bfloat16: the top half of a float32
    if bits & 0x7FFFFFFF == 0:
        bits = np.uint32(0x00010000 if up else 0x80010000)
    else:
        away = up != bool(bits >> 31)  # moving away from zero
        bits = bits + np.uint32(0x10000) if away else bits - np.uint32(0x10000)
    return np.asarray(bits, np.uint32).view(np.float32).astype(dtype)


def beyond(reference, atol, dtype, inside=False):
    """The value of dtype nearest to reference + atol: just past the tolerance, or with
    inside=True just within it."""
    x = np.asarray(reference + atol).astype(dtype)
    while float(x) - reference <= atol:
        x = step(x, dtype, up=True)
    if inside:
        while float(x) - reference > atol:
            x = step(x, dtype, up=False)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive"], ids=str)
def test_passes_npattn_outputs_of_every_dtype(rng, dtype, mask):
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8, dtype=dtype)
    m = make_mask(rng, mask, (4, 5, 9), dtype, empty_rows=False)
    assert_attention_close(npattn.sdpa(q, k, v, mask=m, sinks=np.ones(4)), q, k, v, mask=m, sinks=np.ones(4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [(0, 0, 0, 0), (1, 3, 4, 7), (1, 2, 2, 3)])
def test_fails_one_step_beyond_the_tolerance_naming_the_element(rng, dtype, where):
    """One element moved just past the stated atol: an AssertionError that names it (batch,
    head, row, column), counts 1 failing element, and states the tolerance; moved to just
    inside, it passes."""
    dtype = dtype_of(dtype)
    q, k, v = qkv(rng, (2,), 4, 2, 5, 9, 8, dtype=dtype)
    good = npattn.sdpa(q, k, v)
    want = npattn.reference.sdpa(*(x.astype(np.float64) for x in (q, k, v)))
    atol = testing.tolerance(q, k, v, dtype=dtype)
    bad = good.copy()
    bad[where] = beyond(want[where], atol, dtype)
    with pytest.raises(AssertionError) as info:
        assert_attention_close(bad, q, k, v)
    message = str(info.value)
    b, h, i, j = where
    assert f"worst at batch {b}, head {h}, row {i}, column {j}:" in message, message
    assert "at 1 of 320 elements" in message, message
    assert f"atol {atol:.3g} = {testing.ULPS[dtype.name]} * eps({dtype.name})" in message, message
    assert "the failing row sees at least one key" in message, message
    near = good.copy()
    near[where] = beyond(want[where], atol, dtype, inside=True)
    assert_attention_close(near, q, k, v)


def test_rows_that_see_no_key_are_named_with_mlx_s_difference(rng):
    """L > S under "causal": the first rows see no key. An output giving them MLX's mean
    of V fails, and the message says those rows see no key and what MLX does there."""
    q, k, v = qkv(rng, (1,), 2, 1, 6, 3, 4)
    out = npattn.sdpa(q, k, v)
    out[..., :3, :] = v.mean(axis=-2, keepdims=True)  # rows 0..2 see no key
    with pytest.raises(AssertionError) as info:
        assert_attention_close(out, q, k, v, peer="mlx")
    message = str(info.value)
    assert "6 of the 6 failing rows see no key" in message, message  # 3 rows of 2 heads
    assert "MLX's CPU path gives such rows the mean of V" in message, message


def test_nan_where_the_reference_is_finite_fails(rng):
    q, k, v = qkv(rng, (1,), 2, 1, 3, 5, 4)
    out = npattn.sdpa(q, k, v)
    out[0, 1, 2, 3] = np.nan
    with pytest.raises(AssertionError, match=r"worst at batch 0, head 1, row 2, column 3: actual nan"):
        assert_attention_close(out, q, k, v)


def test_given_rtol_atol_replace_the_derived_tolerance(rng):
    q, k, v = qkv(rng, (1,), 2, 1, 3, 5, 4)
    out = npattn.sdpa(q, k, v) + np.float32(1e-3)
    assert_attention_close(out, q, k, v, atol=2e-3)
    with pytest.raises(AssertionError, match=r"tolerance: atol 0.0005 \(given\), rtol 0"):
        assert_attention_close(out, q, k, v, atol=5e-4)


@pytest.mark.parametrize(
    "actual, error",
    [
        (np.zeros((1, 2, 3, 5)), "shape (1, 2, 3, 5), but attention over these inputs has shape (1, 2, 3, 4)"),
        (np.zeros((1, 2, 3, 4), dtype=int), "must be an array of floats"),
    ],
)
def test_wrong_shape_or_dtype_is_said(rng, actual, error):
    q, k, v = qkv(rng, (1,), 2, 1, 3, 5, 4)
    with pytest.raises(AssertionError, match=re.escape(error)):
        assert_attention_close(actual, q, k, v)


def test_options_are_those_of_sdpa(rng):
    """window, softcap, offsets, sinks and scale change the reference as they change sdpa."""
    q, k, v = qkv(rng, (1,), 2, 1, 6, 9, 4, dtype=np.float64)
    options = {"window": (2, 1), "softcap": 1.5, "q_offset": 4, "k_offset": 1, "sinks": [0.5, -1.0], "scale": 0.7}
    out = npattn.sdpa(q, k, v, **options)
    assert_attention_close(out, q, k, v, **options)
    with pytest.raises(AssertionError):
        assert_attention_close(out, q, k, v)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_arrays_in_and_out(rng, dtype):
    torch = pytest.importorskip("torch")
    t = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(x).to(t) for x in qkv(rng, (1,), 4, 2, 5, 9, 8))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_attention_close(out, q, k, v, mask=None, peer="torch")
    with pytest.raises(AssertionError, match="worst at batch 0, head"):
        assert_attention_close(out, q, k, v, mask="causal", peer="torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mlx_arrays_in_and_out(rng, dtype):
    mx = pytest.importorskip("mlx.core")
    t = getattr(mx, dtype)
    q, k, v = (mx.array(x).astype(t) for x in qkv(rng, (1,), 4, 2, 5, 9, 8))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=8**-0.5, mask="causal", stream=mx.cpu)
    assert_attention_close(out, q, k, v, mask="causal", peer="mlx")
    assert_attention_close(out, q, k, v, scale=mx.rsqrt(mx.array(8.0)), peer="mlx")

"""precision= (SPEC section 11): "highest" and "fast" on every function that computes attention.

"fast" results of half inputs lie within npattn.testing's "fast" tolerance
of the float64 reference; float32 and float64 inputs compute exactly as under
"highest" (the same bits); anything else names the argument.
"""

import numpy as np
import pytest

import npattn
from helpers import MASK_KINDS, dtype_of, make_mask, qkv
from npattn import testing

HALF = ["float16", "bfloat16"]


@pytest.mark.parametrize("name", HALF)
@pytest.mark.parametrize("mask", MASK_KINDS, ids=str)
@pytest.mark.parametrize("L", [1, 7])
def test_fast_half_is_within_the_fast_tolerance(rng, name, mask, L):
    dtype = dtype_of(name)
    q, k, v = qkv(rng, (2,), 6, 2, L, 37, 16, 8, dtype=dtype)
    m = make_mask(rng, mask, (2, 6, L, 37), np.float32)
    got = npattn.sdpa(q, k, v, mask=m, window=(20, 0), softcap=5.0, precision="fast")
    testing.assert_attention_close(got, q, k, v, mask=m, window=(20, 0), softcap=5.0, precision="fast")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_is_highest_for_float32_and_float64(rng, dtype):
    q, k, v = qkv(rng, (3,), 4, 2, 5, 300, 32, 16, dtype=dtype)
    for L in (1, 5):
        a = npattn.sdpa(q[..., :L, :], k, v, precision="fast", return_lse=True)
        b = npattn.sdpa(q[..., :L, :], k, v, precision="highest", return_lse=True)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(
        npattn.attention_weights(q, k, precision="fast"), npattn.attention_weights(q, k, precision="highest")
    )


def test_precision_reaches_every_entry_point(rng):
    """sdpa_backward, attention_weights, paged_attention and npattn.dask.sdpa take it too."""
    q, k, v = qkv(rng, (1,), 2, 1, 3, 8, 4, 4, dtype=np.float32)
    out, lse = npattn.sdpa(q, k, v, return_lse=True, precision="fast")
    grads = npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse, precision="fast")
    assert grads.dq.shape == q.shape
    table, lengths = np.array([[0]]), np.array([8])
    paged = npattn.paged_attention(q, k[0][None], v[0][None], table, lengths, precision="fast")
    np.testing.assert_allclose(paged, out, atol=1e-6)
    pytest.importorskip("dask")
    from npattn import dask

    np.testing.assert_array_equal(np.asarray(dask.sdpa(q, k, v, precision="fast")), out)
    with pytest.raises(ValueError, match="precision"):
        dask.sdpa(q, k, v, precision="medium")

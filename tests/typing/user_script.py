"""A user's script calling every public function of npattn, for ``mypy --strict``.

CI (``bash .ci/run typing``) type-checks it against the installed package: it
must pass ``mypy --strict`` as written, with no ``Any`` forced on the user. The
lines marked ``# type: ignore[...]`` are mistakes that must be type errors
(``--strict`` warns of an ignore that is not needed, so each one is checked).
It also runs: ``python tests/typing/user_script.py``. Not a test module
(pytest collects ``test_*.py`` only).
"""

from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import npattn
import npattn.dask
from npattn import reference, testing

Array = npt.NDArray[Any]


def main() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 4, 16), dtype=np.float32)  # (B, H_q, L, D)
    k = rng.standard_normal((1, 2, 6, 16), dtype=np.float32)  # (B, H_kv, S, D)
    v = rng.standard_normal((1, 2, 6, 8), dtype=np.float32)  # (B, H_kv, S, D_v)

    # sdpa: an array, or with return_lse=True the pair
    out = npattn.sdpa(q, k, v)
    assert_type(out, Array)
    print("sdpa", out.shape, out.dtype)
    out, lse = npattn.sdpa(q, k, v, scale=np.float32(0.25), mask=None, window=(2, 0), return_lse=True)
    assert_type(lse, Array)
    print("lse", lse.shape, isinstance(lse, npattn.Lse))
    flag: bool = bool(rng.integers(2))
    either = npattn.sdpa(q, k, v, return_lse=flag)  # a bool known only at run time
    assert_type(either, Array | tuple[Array, Array])
    npattn.sdpa(q, k, v, scale=np.array(0.25), mask="causal_top_left", sinks=np.zeros(8), softcap=30.0)
    npattn.sdpa(q, k, v, mask=npattn.causal_mask(4, 6, bool), q_offset=2, k_offset=0, threads=1)
    npattn.sdpa(q, k, v, mask=[[0.0] * 6] * 4, out=np.empty((1, 8, 4, 8), np.float32))

    # the backward pass, and its named gradients
    out, lse = npattn.sdpa(q, k, v, mask=None, return_lse=True)
    grads = npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse, mask=None)
    assert_type(grads, npattn.Grads)
    assert_type(grads.dq, Array)
    print("grads", grads.dq.shape, grads.dk.shape, grads.dv.shape, grads.dsinks)

    weights = npattn.attention_weights(q, k, 0.25, "causal")
    assert_type(weights, Array)
    print("weights", weights.sum(axis=-1).shape)

    # a paged cache: 3 pages of 4 rows, request 0 in pages 2 and 0, request 1 in page 1
    key_pages = rng.standard_normal((3, 2, 4, 16), dtype=np.float32)
    table = np.array([[2, 0], [1, -1]], np.int32)
    paged: np.ndarray = npattn.paged_attention(np.concatenate([q, q])[:, :, :1], key_pages, key_pages, table, [7, 3], 4)
    paged_out, paged_lse = npattn.paged_attention(
        np.concatenate([q, q])[:, :, :1], key_pages, key_pages, table, [7, 3], return_lse=True
    )
    print("paged", paged.shape, paged_out.shape, paged_lse.shape)

    a = npattn.sdpa(q, k[..., :3, :], v[..., :3, :], q_offset=0, return_lse=True)
    b = npattn.sdpa(q, k[..., 3:, :], v[..., 3:, :], q_offset=0, k_offset=3, return_lse=True)
    merged, merged_lse = npattn.merge([a[0], b[0]], [a[1], b[1]])
    assert_type(merged, Array)

    mask = npattn.causal_mask(4, 6, np.float32)
    assert_type(mask, Array)

    want = reference.sdpa(q, k, v)
    testing.assert_attention_close(out, q, k, v, mask=None)
    atol: float = testing.tolerance(q, k, v, mask="causal")
    print("reference", np.abs(npattn.sdpa(q, k, v) - want).max() <= atol)

    lazy = npattn.dask.sdpa(q, k, v)  # NumPy arrays are wrapped in one chunk each
    print("dask", np.asarray(lazy).shape)

    # an 8-bit cache read as stored: int8 with a scale per token, uint8 with zero points
    kq = npattn.quantize(k, "int8")
    assert_type(kq, npattn.Quantized)
    vq = npattn.quantize(v, "uint8", symmetric=False)
    coded = npattn.sdpa(q, kq.codes, vq.codes, k_scale=kq.scale, v_scale=vq.scale, v_zero=vq.zero)
    assert_type(coded, Array)
    coded, coded_lse = npattn.sdpa(q, kq.codes, v, k_scale=kq.scale, return_lse=True)
    npattn.attention_weights(q, kq.codes, k_scale=kq.scale)
    pq = npattn.quantize(key_pages, "int8")  # (fp8 codes need ml_dtypes, not installed here)
    npattn.paged_attention(np.concatenate([q, q])[:, :, :1], pq.codes, key_pages, table, [7, 3], k_scale=pq.scale)
    npattn.dask.sdpa(q, kq.codes, v, k_scale=kq.scale)
    print("codes", coded.shape, np.abs(npattn.dequantize(*kq) - k).max() < 0.1)


def mistakes(q: Array, k: Array, v: Array) -> None:
    """Calls a type checker refuses (never run: each raises)."""
    npattn.sdpa(q, k, v, mask="casual")  # type: ignore[arg-type]
    npattn.sdpa(q, k, v, scale="0.25")  # type: ignore[call-overload]
    npattn.sdpa(q, k, v).append(1)  # type: ignore[attr-defined]
    print(npattn.causal_mask(3, 7, bool).options)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()

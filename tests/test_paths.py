"""Every code path of the core agrees with the reference: each kernel table
(forced through a private hook), each tile regime (streamed decode tiles,
gemm tiles narrow to very wide), split-K with its log-sum-exp merge, the
float32 tiles recomputed in double when they meet an extreme, and the three
ways a call runs (inline on the calling thread, the caller alone when no
helper can start, the caller with helpers), which give bitwise-identical
results for the same `threads`."""

import numpy as np
import pytest

import npattn
from helpers import (
    KERNELS,
    check,
    check_paged,
    dtype_of,
    kernels,
    layout,
    make_mask,
    own_tolerance,
    paged_problem,
    pool_mode,
    qkv,
    randn,
    reference_call,
    runnable_kernels,
)
from npattn import _core


@pytest.fixture(params=runnable_kernels())
def variant(request):
    """Runs the test with one kernel table forced; skips what this CPU lacks."""
    with kernels(request.param) as name:
        yield name


# (H_q, H_kv, L, S, D, D_v): each row lands in another tile regime of forward.c
REGIMES = [
    pytest.param(8, 2, 300, 300, 64, 64, id="prefill-D64"),
    pytest.param(4, 1, 100, 700, 128, 128, id="chunked-D128"),
    pytest.param(3, 3, 37, 61, 8, 8, id="narrow-D8"),
    pytest.param(2, 1, 9, 140, 300, 200, id="wide-D300"),
    pytest.param(2, 2, 5, 70, 1024, 16, id="very-wide-D1024"),
    pytest.param(18, 6, 3, 7, 5, 5, id="course-streamed"),
    pytest.param(14, 2, 1, 333, 64, 64, id="decode-D64-streamed"),
    pytest.param(32, 8, 1, 150, 128, 128, id="decode-D128-streamed"),
    pytest.param(4, 4, 3, 90, 24, 40, id="stream-odd-widths"),
]


@pytest.mark.parametrize("H_q, H_kv, L, S, D, D_v", REGIMES)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "additive"])
def test_each_kernel_table_and_tile_regime_matches_reference(variant, rng, H_q, H_kv, L, S, D, D_v, mask):
    """sdpa == reference for every kernel table, tile regime and mask kind."""
    q, k, v = qkv(rng, (2,), H_q, H_kv, L, S, D, D_v)
    check(q, k, v, mask=make_mask(rng, mask, (H_q, L, S)))


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mask", ["causal", None, "bool"])
def test_split_k_decode_matches_reference(variant, rng, threads, sinks, mask):
    """Decode with one kv head and many keys splits the keys across threads;
    the merged result and lse equal the reference and repeat bitwise."""
    S = 5000
    q, k, v = qkv(rng, (1,), 4, 1, 1, S, 64, 48)
    kwargs = {"threads": threads, "return_lse": True}
    if sinks:
        kwargs["sinks"] = rng.standard_normal(4) * 3
    if mask == "bool":
        mask = rng.random((4, 1, S)) < 0.5
        mask[1] = False  # one head sees no key: zeros, or only its sink
    first, lse = check(q, k, v, mask=mask, **kwargs)
    again, lse_again = npattn.sdpa(q, k, v, mask=mask, **kwargs)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(lse, lse_again)


@pytest.mark.parametrize("L, S", [(32, 32), (33, 50), (17, 17)])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "additive"])
def test_small_prefill_on_many_threads_matches_reference(variant, rng, L, S, mask):
    """A prefill of few query blocks and two kv heads has fewer units than 16
    threads: its query blocks are cut to 8 rows so that more threads share it.
    The result equals the reference with lse, and repeats bitwise whoever runs it."""
    q, k, v = qkv(rng, (1,), 14, 2, L, S, 64, 64)
    m = make_mask(rng, mask, (14, L, S))
    check(q, k, v, mask=m, threads=16, return_lse=True)
    results = {}
    for mode in (0, 2):
        with pool_mode(mode):
            results[mode] = npattn.sdpa(q, k, v, mask=m, threads=16, return_lse=True)
    np.testing.assert_array_equal(results[2][0], results[0][0])
    np.testing.assert_array_equal(results[2][1], results[0][1])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kv_name", ["float32", "bfloat16"])
def test_decode_of_interleaved_kv_heads_matches_reference(variant, rng, threads, kv_name):
    """Decode over a cache whose kv heads interleave row by row (a (B, S, H_kv, D)
    array, passed transposed) reads each run of keys for every kv head in turn, one
    unit taking all of a request's kv heads (split-K on several threads): the
    reference for each head, with per-head masks, sinks and lse; an extreme value
    that sends the unit to double. On one thread, the same bits as the contiguous
    copy (on several, its keys split into other parts, merged in another order)."""
    B, H_q, H_kv, S, D = 2, 6, 3, 1100, 64
    kv_dtype = dtype_of(kv_name)
    q = randn(rng, (B, H_q, 1, D))
    k, v = (np.ascontiguousarray(randn(rng, (B, S, H_kv, D)).astype(kv_dtype)).transpose(0, 2, 1, 3) for _ in range(2))
    mask = rng.random((H_q, 1, S)) < 0.7
    mask[4] = False  # one head sees no key: only its sink
    kwargs = {"threads": threads, "return_lse": True, "sinks": rng.standard_normal(H_q), "mask": mask}
    got, lse = check(q, k, v, **kwargs)
    if threads == 1:
        contiguous = npattn.sdpa(q, np.ascontiguousarray(k), np.ascontiguousarray(v), **kwargs)
        np.testing.assert_array_equal(got, contiguous[0])
        np.testing.assert_array_equal(lse, contiguous[1])
    big = v.copy(order="K")  # interleaved as v is
    big[1, 2] = float(np.finfo(np.float32).max) if kv_name == "float32" else 3e38  # float32 sums overflow
    check(q, k, big, threads=threads)


def test_split_k_float64_matches_reference(check, rng):
    """The float64 merge is exact to float64 rounding."""
    q, k, v = qkv(rng, (1,), 2, 1, 2, 6000, 32, dtype=np.float64)
    check(q, k, v, threads=4, sinks=np.array([0.5, -1.0]), return_lse=True)


def test_float16_conversions_in_each_kernel_table(variant, rng):
    """float16 tiles convert the same way in every table (F16C, AVX-512, NEON or
    portable): the reference correctly rounded."""
    q, k, v = (randn(rng, s, np.float16) for s in [(1, 4, 33, 64), (1, 2, 50, 64), (1, 2, 50, 64)])
    check(q, k, v)


# ---- half-precision caches on the streaming path, read as stored ----

HALF_PAIRS = [  # (q, k and v) dtypes: each half cache under each q, and half q over float32
    pytest.param(q_name, kv_name, id=f"{q_name}-{kv_name}")
    for q_name in ("float32", "float16", "bfloat16")
    for kv_name in ("float16", "bfloat16", "float32")
    if (q_name, kv_name) != ("float32", "float32")
]
STREAM_SIZES = [  # (H_q, H_kv, L, S, D, D_v): at most 32 stacked rows, so streamed
    pytest.param(14, 2, 1, 333, 64, 64, id="qwen2-D64"),
    pytest.param(32, 8, 1, 150, 128, 128, id="qwen3-D128"),
    pytest.param(16, 1, 1, 140, 256, 256, id="mqa-D256"),  # 16 rows of the widest the pairs in lanes take
    pytest.param(17, 1, 1, 77, 130, 72, id="mqa17-D130"),  # 16 rows in lanes (avx2, neon), one left over
    pytest.param(8, 1, 4, 50, 40, 40, id="32rows-causal"),  # two blocks of 16 rows in lanes, each its own band
    pytest.param(4, 1, 2, 101, 5, 5, id="D5"),
    pytest.param(6, 2, 1, 70, 63, 63, id="D63"),
    pytest.param(5, 1, 3, 66, 24, 40, id="Dv-wider"),
    pytest.param(2, 2, 1, 97, 128, 9, id="Dv-narrower"),
]


@pytest.mark.parametrize("q_name, kv_name", HALF_PAIRS)
@pytest.mark.parametrize("H_q, H_kv, L, S, D, D_v", STREAM_SIZES)
def test_half_cache_streamed_matches_reference(variant, rng, H_q, H_kv, L, S, D, D_v, q_name, kv_name):
    """Every pair of q and K/V dtypes on the streaming (decode) path, odd widths and
    D_v != D, in every kernel table: the reference within the result dtype's bound,
    and the same bits as K and V given as their float32 values (the kernels convert
    exactly, in registers). The AVX-512 tables sum the scores of a bfloat16 K over
    wide groups in another order (keys in lanes; the C tests check those bits), so
    there only the reference holds."""
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    q, k, v = qkv(rng, (1,), H_q, H_kv, L, S, D, D_v, dtypes=(q_dtype, kv_dtype, kv_dtype))
    got = check(q, k, v, threads=1)
    if kv_name == "bfloat16" and variant in ("avx512", "avx512bf16", "amx"):
        return
    as_f32 = npattn.sdpa(q, k.astype(np.float32), v.astype(np.float32), threads=1)
    np.testing.assert_array_equal(got, as_f32.astype(got.dtype))


@pytest.mark.parametrize("kv_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None, "bool", "additive"])
def test_half_cache_streamed_every_mask_kind(variant, rng, mask, kv_name):
    """A float32 q over a half cache, decode and a few stacked query rows, every mask
    kind: the reference, in float32."""
    kv_dtype = dtype_of(kv_name)
    for L in (1, 3):
        q, k, v = qkv(rng, (2,), 6, 2, L, 130, 64, dtypes=(np.dtype(np.float32), kv_dtype, kv_dtype))
        assert check(q, k, v, mask=make_mask(rng, mask, (6, L, 130))).dtype == np.float32


@pytest.mark.parametrize("q_name, kv_name", [("float32", "float16"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_half_cache_streamed_sinks_window_softcap(variant, rng, q_name, kv_name):
    """Sinks, a sliding window, softcap and offsets with a half cache: the reference."""
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    q, k, v = qkv(rng, (1,), 8, 2, 2, 300, 64, dtypes=(q_dtype, kv_dtype, kv_dtype))
    sinks = rng.standard_normal(8) * 2
    check(q, k, v, sinks=sinks, return_lse=True)
    check(q, k, v, window=(40, 0), softcap=5.0)
    check(q, k, v, q_offset=250, k_offset=10, sinks=sinks, window=(100, 0))
    check(q, k, v, mask=None, softcap=2.0, sinks=sinks)


@pytest.mark.parametrize(
    "kind",
    [
        "padded_rows",
        "reversed_rows",
        "strided_last",
        "every_other_head",
        "byteswapped",
        "unaligned",
        "zero_stride_rows",
    ],
)
@pytest.mark.parametrize("kv_name", ["float16", "bfloat16"])
def test_half_cache_streamed_layouts(variant, rng, kv_name, kind):
    """Half caches in other memory layouts (rows read in place at their stride, or
    gathered when they cannot be), byte-swapped and unaligned ones included: the
    reference, and the same bits as the contiguous copy."""
    kv_dtype = dtype_of(kv_name)
    q = randn(rng, (1, 8, 1, 64))
    k, v = (layout(rng, (1, 2, 200, 64), kv_dtype, kind) for _ in range(2))
    got = check(q, k, v, threads=1)
    native = kv_dtype.newbyteorder("=")
    contiguous = npattn.sdpa(q, np.ascontiguousarray(k, native), np.ascontiguousarray(v, native), threads=1)
    np.testing.assert_array_equal(got, contiguous)


@pytest.mark.parametrize("kv_name", ["float16", "bfloat16"])
def test_half_cache_subnormal_and_extreme_values(variant, rng, kv_name):
    """Half caches at the ends of their range are read exactly: float16 subnormal
    values (6e-8 .. 6e-5, normal in float32) average to their float32 answer, not to 0;
    subnormal keys; the largest finite values, whose float32 sums overflow and are
    recomputed in double."""
    kv_dtype = dtype_of(kv_name)
    info = pytest.importorskip("ml_dtypes").finfo(kv_dtype) if kv_name == "bfloat16" else np.finfo(kv_dtype)
    tiny, big = float(info.smallest_subnormal), float(info.max)
    q, k, v = qkv(rng, (1,), 8, 2, 1, 200, 64, dtypes=(np.dtype(np.float32), kv_dtype, kv_dtype))
    # values and keys all subnormal: whole units of the smallest subnormal, each sign
    units = rng.integers(1, 2 ** int(info.nmant), size=v.shape) * rng.choice([-1, 1], size=v.shape)
    sub = (units * tiny).astype(kv_dtype)
    assert (np.abs(sub.astype(np.float64)) < float(info.smallest_normal)).all()
    got = check(q, k, sub)
    if kv_name == "float16":  # normal in float32: a flush to zero would be far off
        assert np.abs(got).max() > 0
    check(q, sub, v)
    # mixed with normal values; the largest finite values, and their negatives
    mixed = np.where(rng.random(v.shape) < 0.3, sub, v)
    check(q, mixed, mixed)
    extreme = np.where(rng.random(v.shape) < 0.5, big, -big).astype(kv_dtype)
    got = check(q, k, extreme)
    assert np.isfinite(got).all()
    check(q, extreme, v, scale=1.0 / big)


@pytest.mark.parametrize("precision", ["highest", "fast"])
@pytest.mark.parametrize(
    "H_q, H_kv, L, S, D, D_v", [(8, 2, 150, 150, 64, 64), (3, 1, 70, 130, 128, 40), (2, 2, 40, 90, 6, 70)]
)
def test_bfloat16_gemm_tiles_and_subnormal_values(variant, rng, precision, H_q, H_kv, L, S, D, D_v):
    """bfloat16 prefill tiles (bfloat16 dot products where the table has them) match
    the reference under each precision, and none is taken for a subnormal value, which
    those instructions read as 0: a subnormal query against large keys, subnormal keys
    against large queries, and subnormal values."""
    bf16 = dtype_of("bfloat16")
    info = pytest.importorskip("ml_dtypes").finfo(bf16)
    tiny = float(info.smallest_subnormal)
    q, k, v = qkv(rng, (1,), H_q, H_kv, L, S, D, D_v, dtype=bf16)
    first = check(q, k, v, precision=precision)
    np.testing.assert_array_equal(npattn.sdpa(q, k, v, precision=precision), first)

    def subnormal(x, share):
        units = rng.integers(1, 2 ** int(info.nmant), size=x.shape) * rng.choice([-1, 1], size=x.shape)
        return np.where(rng.random(x.shape) < share, (units * tiny).astype(bf16), x)

    def large(x):  # products with a subnormal of order 1
        return (x.astype(np.float32) * 2.0**125).astype(bf16)

    check(subnormal(q, 1.0), large(k), v, precision=precision)
    check(large(q), subnormal(k, 1.0), v, precision=precision)
    check(q, k, subnormal(v, 0.5), precision=precision)
    got = check(q, k, subnormal(v, 1.0), precision=precision)
    assert np.abs(got.astype(np.float32)).max() > 0  # read as 0, the result would be


@pytest.mark.parametrize("precision", ["highest", "fast"])
@pytest.mark.parametrize("H_q, H_kv, S, D_v", [(32, 8, 301, 128), (14, 2, 257, 64), (16, 1, 99, 40), (2, 2, 33, 130)])
def test_bfloat16_decode_and_subnormal_values(variant, rng, precision, H_q, H_kv, S, D_v):
    """bfloat16 decode, streamed (under "fast" its P @ V on the bfloat16 dot products
    where the table has them, pairs of keys): the reference on 1 to 3 threads (split-K:
    odd key counts in each part), the same bits again, in pages of 5 rows (pairs across
    pages); subnormal values, which those instructions read as 0, computed as such."""
    bf16 = dtype_of("bfloat16")
    info = pytest.importorskip("ml_dtypes").finfo(bf16)
    q, k, v = qkv(rng, (2,), H_q, H_kv, 1, S, 64, D_v, dtype=bf16)
    for threads in (1, 2, 3):
        first = check(q, k, v, precision=precision, threads=threads)
        np.testing.assert_array_equal(npattn.sdpa(q, k, v, precision=precision, threads=threads), first)
    units = rng.integers(1, 2 ** int(info.nmant), size=v.shape) * rng.choice([-1, 1], size=v.shape)
    sub = (units * float(info.smallest_subnormal)).astype(bf16)
    check(q, k, np.where(rng.random(v.shape) < 0.01, sub, v), precision=precision)
    got = check(q, k, sub, precision=precision)
    assert np.abs(got.astype(np.float32)).max() > 0  # read as 0, the result would be
    q, kp, vp, table, cl = paged_problem(rng, B=3, H_q=H_q, H_kv=H_kv, D=64, D_v=D_v, page_size=5, lengths=(S, 1, 6),
                                         dtype=bf16)  # fmt: skip
    check_paged(q, kp, vp, table, cl, precision=precision)


@pytest.mark.parametrize("precision", ["highest", "fast"])
@pytest.mark.parametrize("v_name", ["float16", "float32"])
@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive"])
@pytest.mark.parametrize(
    "H_q, H_kv, L, S, D, D_v", [(8, 2, 150, 150, 64, 64), (3, 1, 70, 130, 128, 40), (4, 2, 90, 90, 40, 24)]
)
def test_float16_gemm_tiles_and_extreme_values(variant, rng, precision, v_name, mask, H_q, H_kv, L, S, D, D_v):
    """float16 prefill tiles (on the amx table, each value split into two bfloat16
    values whose four dot products are QK^T) match the reference; a float32 v makes the
    result float32, whose tolerance a lost part of a product would exceed. The same
    bits on 1, 2 and 3 threads (the tiles' shared copies are made by whichever unit
    comes first); subnormal, largest and infinite values."""
    f16 = np.dtype(np.float16)
    q, k, v = qkv(rng, (1,), H_q, H_kv, L, S, D, D_v, dtypes=(f16, f16, dtype_of(v_name)))
    m = make_mask(rng, mask, (H_q, L, S))
    first = check(q, k, v, mask=m, precision=precision, threads=1)
    for threads in (2, 3):
        np.testing.assert_array_equal(npattn.sdpa(q, k, v, mask=m, precision=precision, threads=threads), first)
    info = np.finfo(f16)
    units = rng.integers(1, 2 ** int(info.nmant), size=k.shape) * rng.choice([-1, 1], size=k.shape)
    sub = (units * float(info.smallest_subnormal)).astype(f16)
    big = lambda x: (x * 2.0**12).astype(f16)  # noqa: E731
    check(big(q), sub, v, mask=m, precision=precision)
    check(q, np.where(rng.random(k.shape) < 0.3, sub, big(k)), v, mask=m, precision=precision)
    extreme = np.where(rng.random(k.shape) < 0.5, info.max, -info.max).astype(f16)
    check(q, extreme, v, mask=m, precision=precision, scale=1.0 / float(info.max))
    if mask in (None, "causal"):  # (a key an array mask hides: test_safety's)
        k_inf = k.copy()
        k_inf[..., 3, 0] = np.inf
        with np.errstate(invalid="ignore"):
            check(q, k_inf, v, mask=m, precision=precision)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("q_name, kv_name", [("float32", "float16"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_half_cache_streamed_repeats_bitwise(variant, rng, q_name, kv_name, threads):
    """Same inputs, same threads: the same bits, split-K decode included."""
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    q, k, v = qkv(rng, (1,), 4, 1, 1, 6000, 64, dtypes=(q_dtype, kv_dtype, kv_dtype))
    first, lse = check(q, k, v, threads=threads, return_lse=True)
    for _ in range(2):
        again, lse_again = npattn.sdpa(q, k, v, threads=threads, return_lse=True)
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(lse_again, lse)


def test_simd_reports_the_table_in_use():
    """The hook reports the table that runs; '' restores the best one; a table this CPU
    cannot run is refused."""
    names = runnable_kernels()
    best = _core.simd()
    assert best == names[0] and best in KERNELS and "portable" in names
    with kernels("portable"):
        assert _core.simd() == "portable"
    assert _core.simd() == best
    missing = [name for name in KERNELS if name not in names]
    for name in missing:
        with pytest.raises(ValueError):
            _core.debug_force_simd(name)


# ---- how a call runs: inline, caller alone, caller with helpers ----

RUN_SHAPES = {  # (batch, H_q, H_kv, L, S, D): small (inline) to split-K
    "course": ((2,), 18, 6, 3, 7, 5),
    "prefill": ((2,), 8, 2, 150, 150, 64),
    "decode": ((1,), 14, 2, 1, 3000, 64),
    "split-k": ((1,), 4, 1, 1, 9000, 64),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", list(RUN_SHAPES))
def test_inline_caller_and_pool_paths_are_bitwise_equal(rng, shape, threads, dtype):
    """For the same `threads`, the plan is the same whoever runs it: the calling thread
    alone because the work is small or no helper can start (pool mode 1), or with helpers
    (pool mode 2 makes them join any work): bitwise-identical results and lse."""
    batch, H_q, H_kv, L, S, D = RUN_SHAPES[shape]
    q, k, v = qkv(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    results = {}
    for mode in (0, 1, 2):
        with pool_mode(mode):
            results[mode] = npattn.sdpa(q, k, v, threads=threads, return_lse=True)
    for mode in (1, 2):
        np.testing.assert_array_equal(results[mode][0], results[0][0])
        np.testing.assert_array_equal(results[mode][1], results[0][1])
    check(q, k, v, threads=threads)


# ---- extremes: finite inputs with a representable answer give it ----


@pytest.mark.parametrize("table", runnable_kernels())
@pytest.mark.parametrize(
    "case",
    [
        "sink 3e38",
        "q 3e38 against k 1e-38",
        "values 1e38",
        "scores beyond float32",
        "scores beyond float32 once scaled",
        "mask beyond float32",
        "scale 1e-40",
        "scale 1e35",
        "scale 1e-300, float64",
        "scale 1e300, float64",
    ],
)
def test_extremes_are_exact_where_representable(table, case):
    """Finite float32 inputs whose exact result is representable give it, however
    extreme: tiles that overflow in float32 are recomputed in double. (Each of these gave
    NaN or inf in 0.1.0, or was refused.)"""
    rng = np.random.default_rng(9)
    dtype = np.float64 if "float64" in case else np.float32
    q, k, v = qkv(rng, (1,), 2, 1, 5, 7, 4, dtype=dtype)
    kwargs = {"mask": None}
    if case == "sink 3e38":
        kwargs["sinks"] = np.array([3e38, 0.0])  # head 0: every weight goes to the sink, so 0
    elif case == "q 3e38 against k 1e-38":
        q = np.full_like(q, 3e38)
        k = np.full_like(k, 1e-38) * np.arange(1, 8, dtype=dtype)[:, None]  # scores 3 * j / 2
    elif case == "values 1e38":
        v = np.full_like(v, 1e38)  # the unnormalised sum of 7 rows overflows float32
    elif case == "scores beyond float32":
        q, k = q * 1e20, k * 1e20  # q.k ~ 1e40, scale 1e-42: scores of order 1
        kwargs["scale"] = 1e-42
    elif case == "scores beyond float32 once scaled":
        q, k = q * 1e18, k * 1e18  # q.k ~ 1e36, a float32; times the scale, not
        kwargs["scale"] = 1e4
    elif case == "mask beyond float32":
        kwargs["mask"] = np.where(np.eye(5, 7, 2, dtype=bool), 0.0, -1e300)  # finite, beyond float32
    else:
        kwargs["scale"] = float(case.split()[1].rstrip(","))
        q = q / np.sqrt(abs(kwargs["scale"])) if abs(kwargs["scale"]) > 1 else q
    with kernels(table):
        got = npattn.sdpa(q, k, v, **kwargs)
    want = reference_call(q, k, v, **kwargs)
    assert np.isfinite(want).all()
    assert np.isfinite(got).all(), got
    if case == "sink 3e38":
        np.testing.assert_array_equal(got[0, 0], 0)
    if case == "scores beyond float32 once scaled":  # each row's weight all on its largest score
        np.testing.assert_array_equal(got, want)
    # as close as any float32 result: the tolerance of the logits that matter (the
    # mask's -1e300 only hides)
    bound = {key: val for key, val in kwargs.items() if key != "mask"}
    _, atol = own_tolerance(q, k, v, np.dtype(dtype), **bound)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)

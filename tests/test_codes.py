"""8-bit KV caches read as stored (SPEC section 14): npattn.sdpa, paged_attention and
attention_weights over int8, uint8, float8_e4m3fn and float8_e5m2 codes with their
scales and zero points equal the float64 reference on the float32 values the codes
stand for (helpers.split_codes: npattn.dequantize), within npattn's own tolerance.

Every format and scale grouping (per tensor, head, token, channel, group of 8 and
llama.cpp's q8_0 group of 32 with float16 scales) on every kernel table this CPU
runs: the decode stream, which converts codes in registers (or, for groups no vector
spans, a tile at a time), and the prefill's gemm tiles; K and V in different formats
and one side floating; every mask kind, window, sinks, softcap, positions, key
ranges, lse and merge; pages; strided stores; threads 1-3; the edge codes; and the
streamed results bit for bit those of the float32 values.
"""

import numpy as np
import pytest

import npattn
from helpers import (
    FORMATS,
    GROUPINGS,
    KERNELS,
    MASK_KINDS,
    check,
    check_paged,
    coded,
    compare_with_nan,
    dtype_of,
    f64,
    kernels,
    make_mask,
    own_tolerance,
    paged_problem,
    randn,
    random_codes,
    random_groups,
    reference_call,
    snapshot,
    split_codes,
    values,
)
from npattn import reference

pytest.importorskip("ml_dtypes")

TABLES = [name for name in KERNELS if not name.startswith("neon")]  # neon: the C tests under qemu
SCALE_DTYPES = {"int8": "float32", "uint8": "bfloat16", "float8_e4m3fn": "float32", "float8_e5m2": "float16"}


def qkv_codes(rng, k_fmt, v_fmt=None, grouping="token", H_q=8, H_kv=2, L=1, S=300, D=64, D_v=None, batch=(2,),
              q_dtype=np.float32, zero=None):  # fmt: skip
    """q of floats, and k and v of codes in their formats (None: floats) with a
    grouping's scales: (q, k, v, keywords)."""
    D_v = D if D_v is None else D_v
    q = randn(rng, (*batch, H_q, L, D), q_dtype)
    kwargs = {}
    ops = []
    for name, fmt, width in (("k", k_fmt, D), ("v", v_fmt, D_v)):
        shape = (*batch, H_kv, S, width)
        if fmt is None:
            ops.append(randn(rng, shape, np.float32))
            continue
        codes, groups = coded(rng, shape, fmt, grouping, SCALE_DTYPES[fmt], zero, name)
        ops.append(codes)
        kwargs.update(groups)
    return q, ops[0], ops[1], kwargs


@pytest.mark.parametrize("L", [1, 4])
def test_a_zero_point_near_the_codes_costs_no_accuracy(rng, L):
    """uint8 codes of 240 .. 255 with zero points about 248: the values are small
    while the codes' own sums, which a scale a row takes before the zero point's
    share, run large. Their difference stays within the float32 tolerance of the
    values (its terms are at most 255 / 7 times the values' largest)."""
    shape = (1, 2, 700, 64)
    k, v = (rng.integers(240, 256, size=shape).astype(np.uint8) for _ in range(2))
    zeros = {f"{x}_zero": rng.uniform(246, 250, size=(1, 2, 700, 1)).astype(np.float32) for x in "kv"}
    scales = {f"{x}_scale": rng.uniform(0.5, 2.0, size=(1, 2, 700, 1)).astype(np.float32) for x in "kv"}
    q = randn(rng, (1, 8, L, 64), np.float32) * 4
    check(q, k, v, threads=1, **zeros, **scales)


# ---- every format, grouping and table ----


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("L, S", [(1, 300), (3, 70), (40, 300)], ids=["decode", "short", "prefill"])
@pytest.mark.parametrize("table", TABLES)
def test_every_format_and_grouping_on_every_table(rng, table, L, S, fmt, grouping):
    """sdpa over codes == the reference over their values, for the decode stream (in
    registers; per channel and groups of 8 on the avx512 tables a tile at a time), a
    short prefill and gemm tiles; scales float32, float16 or bfloat16."""
    with kernels(table):
        q, k, v, kwargs = qkv_codes(rng, fmt, fmt, grouping, L=L, S=S)
        check(q, k, v, return_lse=True, **kwargs)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("grouping", ["channel", "group32"])
@pytest.mark.parametrize("fmt", ["int8", "uint8", "float8_e4m3fn", "float8_e5m2"])
def test_streamed_grouped_codes_give_the_bits_of_their_values(rng, fmt, grouping, table):
    """Codes in groups along a row (per channel, q8_0's 32) are made into the float32
    values they stand for in registers, then computed as float32 K and V are: the
    very bits of sdpa over npattn.dequantize's values (Qwen3-4B's 4 rows a kv head,
    and 16 rows: an MQA group, the rows in the lanes of the avx2 table)."""
    with kernels(table):
        for H_q in (32, 16):
            q, k, v, kwargs = qkv_codes(rng, fmt, fmt, grouping, H_q=H_q, H_kv=8 if H_q == 32 else 1, D=128, S=600)
            kv, vv, _ = split_codes(k, v, kwargs)
            got = npattn.sdpa(q, k, v, threads=1, **kwargs)
            np.testing.assert_array_equal(got, npattn.sdpa(q, kv, vv, threads=1))


FORMATS_AND_ZEROS = [("int8", False), ("int8", True), ("uint8", False), ("uint8", True), ("float8_e4m3fn", False),
                     ("float8_e5m2", False)]  # fmt: skip


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("grouping", ["tensor", "head", "token"])
@pytest.mark.parametrize("fmt, zero", FORMATS_AND_ZEROS)
def test_streamed_codes_of_a_scale_a_row(rng, fmt, grouping, table, zero):
    """With one scale (and zero point) a row the decode stream sums the codes' own
    values and scales each sum once, s (q . c - z sum(q)), and weighs each value row
    by p s: within npattn's float32 tolerance of the reference on the dequantized
    values."""
    with kernels(table):
        for H_q in (32, 16):
            q, k, v, kwargs = qkv_codes(rng, fmt, fmt, grouping, H_q=H_q, H_kv=8 if H_q == 32 else 1, D=128, S=600,
                                        zero=zero or None)  # fmt: skip
            check(q, k, v, threads=1, **kwargs)


@pytest.mark.parametrize(
    "k_fmt, v_fmt",
    [("int8", "uint8"), ("float8_e4m3fn", "int8"), ("uint8", "float8_e5m2"), ("int8", None), (None, "float8_e4m3fn")],
    ids=str,
)
@pytest.mark.parametrize("L", [1, 33])
def test_k_and_v_in_formats_of_their_own(rng, k_fmt, v_fmt, L):
    """K and V in different formats and groupings, or one side floating; D_v != D."""
    q, k, v, kwargs = qkv_codes(rng, k_fmt, v_fmt, "group32", L=L, S=200, D=64, D_v=96)
    check(q, k, v, **kwargs)


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("L", [1, 20])
def test_the_result_is_q_s_dtype(rng, q_dtype, L):
    """Codes take no part in the result's dtype: it is q's where k and v both hold
    codes (float16 and bfloat16 correctly rounded; float64 computed in double from the
    codes' float32 values), and promoted with a float v."""
    q, k, v, kwargs = qkv_codes(rng, "int8", "uint8", L=L, S=150, q_dtype=dtype_of(q_dtype))
    got = check(q, k, v, **kwargs)
    assert got.dtype == dtype_of(q_dtype)
    v32 = randn(rng, v.shape, np.float32)
    kwargs = {key: val for key, val in kwargs.items() if key.startswith("k")}
    assert check(q, k, v32, **kwargs).dtype == np.result_type(dtype_of(q_dtype), np.float32)


# ---- the options ----


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("L", [1, 5, 40])
def test_every_mask_kind(rng, L, mask):
    q, k, v, kwargs = qkv_codes(rng, "uint8", "int8", "token", L=L, S=120, zero=True)
    mask = make_mask(rng, mask, (2, 8, L, 120))
    check(q, k, v, mask=mask, return_lse=True, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {"window": (30, 0)},
        {"window": (5, 7), "mask": None},
        {"sinks": np.linspace(-2, 2, 8)},
        {"softcap": 5.0},
        {"q_offset": 50, "k_offset": 3},
        {"mask": "causal_top_left"},
        {"k_start": [10, 0], "k_lengths": [100, 37]},
        {"k_lengths": [0, 120], "sinks": np.ones(8)},
        {"q_offset": [3, 90]},
        {"scale": -0.7, "softcap": 2.0, "window": (None, 4)},
    ],
    ids=str,
)
@pytest.mark.parametrize("L", [1, 24])
def test_options(rng, L, options):
    """window, sinks, softcap, positions and per-request key ranges over codes."""
    q, k, v, kwargs = qkv_codes(rng, "float8_e4m3fn", "uint8", "group32", L=L, S=120)
    check(q, k, v, return_lse=True, **options, **kwargs)


def test_merge_of_parts_over_codes(rng):
    """The keys split in two calls over codes (k_offset), merged by npattn.merge, equal
    the whole call, within float32's rounding of the merge."""
    q, k, v, kwargs = qkv_codes(rng, "int8", "int8", "token", L=6, S=200)
    whole = npattn.sdpa(q, k, v, mask="causal_top_left", **kwargs)
    parts = []
    for lo, hi in ((0, 90), (90, 200)):
        part = {key: val[..., lo:hi, :] for key, val in kwargs.items()}
        parts.append(npattn.sdpa(q, k[..., lo:hi, :], v[..., lo:hi, :], q_offset=0, k_offset=lo, return_lse=True,
                                 **part))  # fmt: skip
    out, _ = npattn.merge([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)


def test_attention_weights_over_codes(rng):
    q, k, _, kwargs = qkv_codes(rng, "uint8", None, "head", L=7, S=50, zero=True)
    got = npattn.attention_weights(q, k, **kwargs)
    want = reference.attention_weights(f64(q), f64(values(k, kwargs["k_scale"], kwargs["k_zero"])))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("L, S", [(1, 5000), (64, 700)])
def test_threads_and_the_same_bits_run_to_run(rng, threads, L, S):
    """Split-K decode and prefill tiles over codes on 1-3 threads: right, and the same
    bits on a second call."""
    q, k, v, kwargs = qkv_codes(rng, "int8", "float8_e5m2", "token", L=L, S=S, batch=(1,))
    first = check(q, k, v, threads=threads, **kwargs)
    np.testing.assert_array_equal(first, npattn.sdpa(q, k, v, threads=threads, **kwargs))


# ---- strides and layouts ----


def bshd(x):
    """x (B, H, S, w) as a view of a (B, S, H, w) store, as models hold caches."""
    return np.ascontiguousarray(x.swapaxes(-3, -2)).swapaxes(-3, -2)


@pytest.mark.parametrize("L", [1, 30])
def test_a_b_s_h_d_store_as_a_transposed_view(rng, L):
    """Codes and per-token scales in (B, S, H, D) and (B, S, H, 1) stores, passed as
    transposed views: read through their strides, no copy."""
    q, k, v, kwargs = qkv_codes(rng, "int8", "uint8", "token", H_q=8, H_kv=4, L=L, S=300, zero=True)
    views = {key: bshd(val) for key, val in kwargs.items()}
    check(q, bshd(k), bshd(v), **views)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x[..., ::-1, :],  # rows reversed
        lambda x: np.repeat(x, 2, axis=-1)[..., ::2],  # every other column: converted a tile at a time
        lambda x: np.asfortranarray(x),
        lambda x: np.broadcast_to(x[..., :1, :], x.shape),  # one row, broadcast
    ],
    ids=["reversed_rows", "strided_columns", "fortran", "zero_stride_rows"],
)
@pytest.mark.parametrize("L", [1, 30])
def test_codes_of_any_strides(rng, L, make):
    q, k, v, kwargs = qkv_codes(rng, "uint8", "int8", "token", L=L, S=100, zero=True)
    scales = {key: make(np.broadcast_to(val, (*k.shape[:-1], val.shape[-1])).copy()) for key, val in kwargs.items()}
    check(q, make(k), make(v), **scales)


@pytest.mark.parametrize("L", [1, 20])
def test_scales_that_broadcast(rng, L):
    """Scales and zero points given in every broadcast form: a 0-d one, a (G,) row,
    per head (H_kv, 1, G), a zero point of one group against scales of four, the
    batch dim of size 1, and a bfloat16 scale with a float32 zero point."""
    q, k, v, _ = qkv_codes(rng, "uint8", "uint8", L=L, S=64)
    B, H_kv, S, D = k.shape
    for k_scale, k_zero in (
        (np.float32(0.01), np.float32(128)),
        (np.full((4,), 0.02, np.float32), np.float16(120)),
        (rng.uniform(0.005, 0.01, (H_kv, 1, 2)).astype(np.float32), None),
        (rng.uniform(0.005, 0.01, (1, H_kv, S, 4)).astype(dtype_of("bfloat16")),
         rng.uniform(100, 150, (B, 1, S, 1)).astype(np.float32)),
    ):  # fmt: skip
        kwargs = {"k_scale": k_scale, "v_scale": np.float16(0.01), "v_zero": np.float32(127.5)}
        if k_zero is not None:
            kwargs["k_zero"] = k_zero
        check(q, k, v, **kwargs)


def test_q8_0_scales_read_through_the_34_byte_blocks(rng):
    """llama.cpp's q8_0 cache (per 32 elements, a float16 scale then 32 int8 codes):
    the scales are read in place from the blocks (a strided view), the codes as one
    array; the same result as the two arrays npattn.quantize makes."""
    q = randn(rng, (1, 8, 1, 128))
    k, v = (randn(rng, (1, 2, 200, 128)) for _ in range(2))
    block = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
    raw = {}
    for name, x in (("k", k), ("v", v)):
        made = npattn.quantize(x, "int8", group=32, scale_dtype=np.float16)
        raw[name] = np.empty((1, 2, 200, 4), block)  # what llama.cpp's cache holds: 34 bytes a block
        raw[name]["d"], raw[name]["qs"] = made.scale, made.codes.reshape(1, 2, 200, 4, 32)
    kc, vc = (raw[n]["qs"].reshape(1, 2, 200, 128) for n in "kv")
    ks, vs = raw["k"]["d"], raw["v"]["d"]
    assert ks.strides[-1] == 34 and not ks.flags.c_contiguous  # read in place
    got = check(q, kc, vc, k_scale=ks, v_scale=vs)
    made = {n: npattn.quantize(x, "int8", group=32, scale_dtype=np.float16) for n, x in (("k", k), ("v", v))}
    want = npattn.sdpa(q, made["k"].codes, made["v"].codes, k_scale=made["k"].scale, v_scale=made["v"].scale)
    np.testing.assert_array_equal(got, want)


# ---- pages ----


@pytest.mark.parametrize("grouping", ["tensor", "token", "group32"])
@pytest.mark.parametrize("page_size", [1, 16, 33])
@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("table", ["avx2", "avx512bf16", "amx", "portable"])
def test_paged_codes(rng, table, L, page_size, grouping):
    """Pages of codes with their scales paged like them, through the block table: the
    decode stream a page's span at a time, and gemm tiles gathered from the pages."""
    with kernels(table):
        q, kp, vp, bt, cl = paged_problem(rng, B=4, H_q=8, H_kv=2, L=L, D=64, D_v=64, page_size=page_size,
                                          lengths=(0, 1, page_size + 1, 150))  # fmt: skip
        kc, kw = coded(rng, kp.shape, "int8", grouping, "float16", name="k")
        vc, vw = coded(rng, vp.shape, "uint8", grouping, "float32", zero=True, name="v")
        check_paged(q, kc, vc, bt, cl, return_lse=True, **kw, **vw)


def test_paged_codes_in_a_transposed_store(rng):
    """Pages stored (P, page_size, H_kv, D) with scales (P, page_size, H_kv, 1), passed
    as transposed views; one scale per tensor for V."""
    q, kp, vp, bt, cl = paged_problem(rng, B=3, H_q=8, H_kv=4, L=1, D=64, D_v=64, page_size=16, lengths=(40, 17, 64))
    kc, kw = coded(rng, kp.shape, "float8_e4m3fn", "token", name="k")
    vc, vw = coded(rng, vp.shape, "int8", "tensor", name="v")
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # noqa: E731
    check_paged(q, t(kc), t(vc), bt, cl, k_scale=t(kw["k_scale"]), **vw)


def test_paged_equals_dense_over_codes(rng):
    """A request's pages of codes, gathered, give sdpa over the same codes dense."""
    q, kp, vp, bt, cl = paged_problem(rng, B=2, H_q=8, H_kv=2, L=1, D=64, D_v=64, page_size=16, lengths=(100, 64))
    kc, kw = coded(rng, kp.shape, "uint8", "token", zero=True, name="k")
    got = npattn.paged_attention(q, kc, vp, bt, cl, **kw)
    for b in range(2):
        pages = bt[b, : -(-cl[b] // 16)]

        def gather(x, pages=pages, n=cl[b]):
            return np.concatenate(list(x[pages]), axis=1)[:, :n]

        want = npattn.sdpa(q[b], gather(kc), gather(vp), k_scale=gather(kw["k_scale"]), k_zero=gather(kw["k_zero"]))
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-6)


# ---- the edges ----


def test_edge_codes(rng):
    """-128 and 127, 0 and 255, e4m3's +-448, subnormal fp8 codes, e5m2's largest: each
    the value it stands for, so the result is the reference's."""
    ml = pytest.importorskip("ml_dtypes")
    q = randn(rng, (1, 4, 2, 8))
    edges = {
        "int8": np.array([-128, 127, 0, -1, 1, -128, 127, 64], np.int8),
        "uint8": np.array([0, 255, 128, 1, 254, 0, 255, 127], np.uint8),
        "float8_e4m3fn": np.array([448, -448, 2.0**-9, -(2.0**-7), 0.0, 240, -0.001953125, 1], ml.float8_e4m3fn),
        "float8_e5m2": np.array([57344, -57344, 2.0**-16, -(2.0**-15), 0.0, 1.5, 3, -7], ml.float8_e5m2),
    }
    for fmt, row in edges.items():
        k = np.tile(row, (1, 2, 6, 1))
        k[0, 1] = np.roll(k[0, 1], 3, axis=-1)
        scale = np.float32(1.0 / {"int8": 128, "uint8": 256, "float8_e4m3fn": 448, "float8_e5m2": 57344}[fmt])
        zero = {"k_zero": np.float32(127.5)} if fmt == "uint8" else {}
        for L in (1, 2):
            check(q[..., :L, :], k, k, k_scale=scale, v_scale=scale, mask=None, **zero,
                  **({"v_zero": np.float32(127.5)} if zero else {}))  # fmt: skip


@pytest.mark.parametrize("L", [1, 20])
def test_nan_and_infinite_codes_as_in_float_inputs(rng, L):
    """e4m3's NaN code (0x7f, 0xff) stands for NaN and e5m2's infinities for
    infinities, as those values in float K and V: NaN in the rows that see them,
    the reference's infinities."""
    ml = pytest.importorskip("ml_dtypes")
    q = randn(rng, (1, 4, L, 16))
    for fmt, special in (("float8_e4m3fn", np.uint8(0x7F)), ("float8_e4m3fn", np.uint8(0xFF)),
                         ("float8_e5m2", np.uint8(0x7C)), ("float8_e5m2", np.uint8(0xFC))):  # fmt: skip
        dtype = getattr(ml, fmt)
        k = random_codes(rng, (1, 2, 30, 16), fmt)
        v = random_codes(rng, (1, 2, 30, 16), fmt)
        k.view(np.uint8)[0, 0, 7, 3] = special
        v.view(np.uint8)[0, 1, 11, 5] = special
        assert k.dtype == dtype
        scale = np.float32(0.01)
        got = npattn.sdpa(q, k, v, k_scale=scale, v_scale=scale, mask=None)
        want = reference_call(q, k, v, k_scale=scale, v_scale=scale, mask=None)
        kv, vv, _ = split_codes(k, v, {"k_scale": scale, "v_scale": scale})
        clean = [np.where(np.isfinite(x), x, 0) for x in (kv, vv)]
        rtol, atol = own_tolerance(q, *clean, got.dtype, mask=None)
        compare_with_nan(got, want, atol, rtol)
        assert not np.isfinite(f64(want)).all()  # the special code reaches the result


@pytest.mark.parametrize("L", [1, 20])
def test_zero_and_huge_scales(rng, L):
    """A scale of 0 (every value 0: equal weights, zero values), and scales so large
    that the values pass float32's range (inf, as float inputs would hold; the
    reference's NaN and infinities where it has them)."""
    q = randn(rng, (1, 4, L, 16))
    k, v = (random_codes(rng, (1, 2, 25, 16), "int8") for _ in range(2))
    zeros = {"k_scale": np.zeros((1, 2, 25, 1), np.float32), "v_scale": np.zeros((2, 1, 1), np.float32)}
    got = check(q, k, v, **zeros)
    np.testing.assert_array_equal(got, 0)
    huge = {"k_scale": np.float32(1e-3), "v_scale": np.float32(3e38)}
    got = npattn.sdpa(q, k, v, **huge)
    compare_with_nan(got, reference_call(q, k, v, **huge), atol=0, rtol=1e-5)
    huge = {"k_scale": np.float32(3e37), "v_scale": np.float32(1e-2)}  # scores beyond float32: the double path
    got = npattn.sdpa(q, k, v, **huge)
    want = reference_call(q, k, v, **huge)
    compare_with_nan(got, want, atol=1e-6, rtol=1e-5)


def test_inputs_are_never_modified(rng):
    q, k, v, kwargs = qkv_codes(rng, "uint8", "float8_e4m3fn", "group32", L=3, S=90, zero=True)
    before = snapshot(q, k, v, *kwargs.values())
    npattn.sdpa(q, k, v, **kwargs)
    npattn.sdpa(q[..., :1, :], k, v, **kwargs)
    assert snapshot(q, k, v, *kwargs.values()) == before


def test_scales_of_every_dtype_equal_their_float32_values(rng):
    """float16 and bfloat16 scales and zero points are read as the float32 values they
    hold: the same bits as those values given in float32."""
    q, k, v, _ = qkv_codes(rng, "uint8", "uint8", L=1, S=100)
    for dtype in ("float16", "bfloat16"):
        s, z = random_groups(rng, k.shape, "uint8", "group32", dtype, zero=True)
        got = npattn.sdpa(q, k, v, k_scale=s, k_zero=z, v_scale=s, v_zero=z)
        want = npattn.sdpa(q, k, v, k_scale=s.astype(np.float32), k_zero=z.astype(np.float32),
                           v_scale=s.astype(np.float32), v_zero=z.astype(np.float32))  # fmt: skip
        np.testing.assert_array_equal(got, want)


def test_torch_and_lists_of_codes_are_read(rng):
    """Codes given as a torch int8 tensor, and scales as a torch float32 tensor."""
    torch = pytest.importorskip("torch")
    q, k, v, kwargs = qkv_codes(rng, "int8", "int8", L=2, S=40)
    want = npattn.sdpa(q, k, v, **kwargs)
    got = npattn.sdpa(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                      **{key: torch.from_numpy(val) for key, val in kwargs.items()})  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_testing_takes_the_scales(rng):
    """npattn.testing checks a result over codes against the values they stand for:
    assert_attention_close passes npattn's own result and fails one computed with
    a scale 5% off; tolerance is that of the dequantized values."""
    from npattn.testing import assert_attention_close, tolerance

    q, k, v, kwargs = qkv_codes(rng, "uint8", "int8", "token", L=3, S=80, zero=True)
    kv, vv, _ = split_codes(k, v, kwargs)
    got = npattn.sdpa(q, k, v, **kwargs)
    assert_attention_close(got, q, k, v, **kwargs)
    assert tolerance(q, k, v, **kwargs) == tolerance(q, kv, vv)
    off = npattn.sdpa(q, k, v, **dict(kwargs, v_scale=kwargs["v_scale"] * 1.05))
    with pytest.raises(AssertionError, match="differs from the float64 reference"):
        assert_attention_close(off, q, k, v, **kwargs)

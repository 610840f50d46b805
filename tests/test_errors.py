"""Every invalid input of SPEC sections 1 and 6 raises the right exception, naming the argument.

One table: (description, call, exception, argument named, extra substrings).
Each call breaks exactly one rule of an otherwise valid call:
q (1, 4, 3, 8), k (1, 2, 5, 8), v (1, 2, 5, 6), float32.

Then sizes beyond BLAS's 32-bit int or beyond memory (each its one
exception, never a crash), and allocation failures inside the core
(npattn._core.debug_fail_alloc_after), which become MemoryError.
"""

import contextlib
import re

import numpy as np
import pytest

import npattn
import npattn.testing
from helpers import assert_raises_naming, dtype_of, failing_allocations, kernels

Q_SHAPE, K_SHAPE, V_SHAPE = (1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 6)
OUT_SHAPE = (1, 4, 3, 6)


def arr(shape, dtype=np.float32):
    return np.ones(shape, dtype)


VALID = object()


def call(q=VALID, k=VALID, v=VALID, **kwargs):
    """A valid call with some operands or keywords replaced."""
    q = arr(Q_SHAPE) if q is VALID else q
    k = arr(K_SHAPE) if k is VALID else k
    v = arr(V_SHAPE) if v is VALID else v
    return lambda: npattn.sdpa(q, k, v, **kwargs)


def read_only(shape, dtype=np.float32):
    x = np.zeros(shape, dtype)
    x.setflags(write=False)
    return x


def unaligned(shape, dtype=np.float32):
    """A writeable array of `shape` whose data is one byte off alignment."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(bytearray(n + 1), np.uint8)[1:].view(dtype).reshape(shape)


def rank2_call(**kwargs):
    """A valid rank-2 call, (3, 8), (5, 8), (5, 6), with keywords replaced."""
    return lambda: npattn.sdpa(arr((3, 8)), arr((5, 8)), arr((5, 6)), **kwargs)


def out_is_k():
    """out passed as k itself (k given the result's shape)."""
    k = np.ones((1, 4, 3, 8), np.float32)
    return lambda: npattn.sdpa(arr((1, 4, 3, 8)), k, arr((1, 4, 3, 8)), out=k)


def out_overlapping_bool_mask():
    """out a float32 view of a bool mask's memory."""
    mask = np.ones(4 * 3 * 6 * 4, bool)
    out = mask.view(np.float32).reshape(OUT_SHAPE)
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), mask=mask[:60].reshape(4, 3, 5), out=out)


def bad_dtype_rows():
    """A TypeError naming the operand for every non-float dtype of q, k and v."""
    bad = {
        "int32": lambda s: np.ones(s, np.int32),
        "int64": lambda s: np.ones(s, np.int64),
        "bool": lambda s: np.ones(s, bool),
        "complex": lambda s: np.ones(s, np.complex64),
        "object": lambda s: np.ones(s, object),
        "str": lambda s: np.full(s, "1.0"),
        "uint8": lambda s: np.ones(s, np.uint8),
        "complex128": lambda s: np.ones(s, np.complex128),
        "datetime64": lambda s: np.ones(s, "M8[s]"),
        "bytes": lambda s: np.full(s, b"1"),
        "structured": lambda s: np.zeros(s, [("a", "f4")]),
    }
    shapes = {"q": Q_SHAPE, "k": K_SHAPE, "v": V_SHAPE}
    rows = []
    for name, shape in shapes.items():
        for kind, make in bad.items():
            rows.append((f"{name} {kind} array", call(**{name: make(shape)}), TypeError, name, ()))
        rows.append((f"{name} None", call(**{name: None}), TypeError, name, ()))
        rows.append((f"{name} a dict", call(**{name: {}}), TypeError, name, ()))
        rows.append((f"{name} a string", call(**{name: "1.0"}), TypeError, name, ()))
        rows.append((f"{name} longdouble", call(**{name: np.ones(shape, np.longdouble)}), TypeError, name, ()))
    return rows


def codes(shape, fmt="int8"):
    """Codes of `shape` in format `fmt` (fp8 through ml_dtypes)."""
    return np.ones(shape, dtype_of(fmt))


def scales(shape, value=1.0, dtype=np.float32):
    return np.full(shape, value, dtype_of(dtype) if isinstance(dtype, str) else dtype)


def later(**made):
    """A valid call with keywords replaced by what each function makes when the call
    runs (ml_dtypes' arrays: a row skips where it is missing, not the table)."""
    return lambda: call(**{name: make() for name, make in made.items()})()


def code_rows():
    """Codes without their scale, scales of floats, groups that divide no row width, zero
    points of symmetric formats, NaN or infinite scales, scales that do not broadcast, and
    scales of other dtypes: each for k and for v where it applies."""
    K_PER_TOKEN, V_PER_TOKEN = (1, 2, 5, 1), (1, 2, 5, 1)
    k8, v8 = codes(K_SHAPE), codes(V_SHAPE, "uint8")
    return [
        ("k int8 codes without k_scale", call(k=k8), TypeError, "k_scale", ("k holds int8 codes",)),
        ("v uint8 codes without v_scale", call(v=v8), TypeError, "v_scale", ("v holds uint8 codes",)),
        ("k e4m3 codes without k_scale", later(k=lambda: codes(K_SHAPE, "float8_e4m3fn")), TypeError, "k_scale", ()),
        ("v e5m2 codes without v_scale", later(v=lambda: codes(V_SHAPE, "float8_e5m2")), TypeError, "v_scale", ()),
        ("k_zero without k_scale", call(k=k8, k_zero=scales(K_PER_TOKEN)), TypeError, "k_scale", ()),
        (
            "k_scale's groups divide no D",
            call(k=k8, k_scale=scales((3,))),
            ValueError,
            "k_scale",
            ("3 groups", "row width D = 8", "k_scale (3,)", "k (1, 2, 5, 8)"),
        ),
        (
            "v_scale's groups divide no D_v",
            call(v=v8, v_scale=scales((1, 2, 5, 4))),
            ValueError,
            "v_scale",
            ("4 groups", "row width D_v = 6"),
        ),
        (
            "k_zero's groups divide no D",
            call(k=k8, k_scale=scales(()), k_zero=scales((3,))),
            ValueError,
            "k_zero",
            ("3 groups", "D = 8"),
        ),
        ("k_scale of float k", call(k_scale=scales(K_PER_TOKEN)), ValueError, "k_scale", ("k holds float32",)),
        ("v_scale of float v", call(v_scale=scales(())), ValueError, "v_scale", ("v holds float32",)),
        ("k_zero of float k", call(k_zero=scales(())), ValueError, "k_zero", ("for codes",)),
        (
            "k_zero of e4m3 codes",
            later(k=lambda: codes(K_SHAPE, "float8_e4m3fn"), k_scale=lambda: scales(()), k_zero=lambda: scales(())),
            ValueError,
            "k_zero",
            ("float8_e4m3fn codes are symmetric",),
        ),
        (
            "v_zero of e5m2 codes",
            later(v=lambda: codes(V_SHAPE, "float8_e5m2"), v_scale=lambda: scales(()), v_zero=lambda: scales(())),
            ValueError,
            "v_zero",
            ("symmetric",),
        ),
        ("k_scale NaN", call(k=k8, k_scale=scales(K_PER_TOKEN, np.nan)), ValueError, "k_scale", ("NaN or infinity",)),
        ("k_scale inf", call(k=k8, k_scale=scales((), np.inf, np.float16)), ValueError, "k_scale", ("infinity",)),
        (
            "v_scale -inf, bfloat16",
            later(v=lambda: v8, v_scale=lambda: scales(V_PER_TOKEN, -np.inf, "bfloat16")),
            ValueError,
            "v_scale",
            ("infinity",),
        ),
        (
            "k_zero NaN",
            call(k=k8, k_scale=scales(()), k_zero=scales((2, 1, 1), np.nan)),
            ValueError,
            "k_zero",
            ("NaN",),
        ),
        (
            "k_scale that does not broadcast",
            call(k=k8, k_scale=scales((1, 2, 7, 1))),
            ValueError,
            "k_scale",
            ("(1, 2, 7, 1)", "does not broadcast to (1, 2, 5, 1)"),
        ),
        ("k_scale of a larger rank", call(k=k8, k_scale=scales((1, 1, 2, 5, 1))), ValueError, "k_scale", ()),
        (
            "v_scale per kv head of q's heads",
            call(v=v8, v_scale=scales((4, 1, 1))),
            ValueError,
            "v_scale",
            ("(4, 1, 1)",),
        ),
        (
            "k_zero's groups neither 1 nor k_scale's",
            call(k=k8, k_scale=scales((2,)), k_zero=scales((4,))),
            ValueError,
            "k_zero",
            ("(4,)",),
        ),
        ("k_scale float64", call(k=k8, k_scale=np.ones(K_PER_TOKEN)), TypeError, "k_scale", ("float64",)),
        ("k_scale a Python float", call(k=k8, k_scale=0.5), TypeError, "k_scale", ("np.float32",)),
        ("k_scale int", call(k=k8, k_scale=np.ones(K_PER_TOKEN, np.int32)), TypeError, "k_scale", ("int32",)),
        ("v_zero uint8", call(v=v8, v_scale=scales(()), v_zero=np.uint8(128)), TypeError, "v_zero", ("uint8",)),
        ("k_scale a string", call(k=k8, k_scale="0.5"), TypeError, "k_scale", ()),
        ("k_scale complex", call(k=k8, k_scale=np.ones(1, np.complex64)), TypeError, "k_scale", ()),
        ("q int8", call(q=codes(Q_SHAPE)), TypeError, "q", ("int8",)),
    ]


def overlapping_out():
    """out aliasing q's memory (q given the result's shape, D = D_v)."""
    q = np.ones((1, 4, 3, 8), np.float32)
    return lambda: npattn.sdpa(q, arr(K_SHAPE), arr((1, 2, 5, 8)), out=q)


def out_overlapping_v():
    """out and v two views of one buffer that share 20 elements."""
    buf = np.zeros(200, np.float32)
    v = buf[:60].reshape(V_SHAPE)
    out = buf[40:112].reshape(OUT_SHAPE)
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), v, out=out)


def out_overlapping_mask():
    """out a view of a float mask's memory."""
    mask = np.zeros((1, 4, 3, 7), np.float32)
    out = mask[..., :6]
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), mask=mask[..., :5], out=out)


def out_overlapping_converted_mask():
    """A float64 mask (read as float32 values) whose bytes out's float32 view shares."""
    mask = np.zeros((3, 5))
    out = mask.view(np.float32)[:, :6].reshape(1, 1, 3, 6)
    q = arr((1, 1, 3, 8))
    return lambda: npattn.sdpa(q, arr((1, 1, 5, 8)), arr((1, 1, 5, 6)), mask=mask, out=out)


def out_overlapping_misaligned_mask():
    """A misaligned float32 mask (copied before the core reads it) inside out's bytes."""
    buf = np.zeros(200, np.uint8)
    mask = buf[1:61].view(np.float32).reshape(3, 5)
    out = buf[:96].view(np.float32)[:18].reshape(1, 1, 3, 6)
    return lambda: npattn.sdpa(arr((1, 1, 3, 8)), arr((1, 1, 5, 8)), arr((1, 1, 5, 6)), mask=mask, out=out)


def out_overlapping_sinks():
    """float64 sinks that are the first elements of out."""
    out = np.zeros((1, 4, 3, 6))
    sinks = out.reshape(-1)[:4]
    return lambda: npattn.sdpa(*(np.ones(s) for s in (Q_SHAPE, K_SHAPE, V_SHAPE)), sinks=sinks, out=out)


def out_overlapping_itself():
    """out a view with head stride 0: its 4 heads are the same memory."""
    base = np.zeros((1, 1, 3, 6), np.float32)
    out = np.lib.stride_tricks.as_strided(base, OUT_SHAPE, (72, 0, 24, 4))
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), out=out)


class OutOfMemory:
    """An array-like whose conversion runs out of memory."""

    def __array__(self, dtype=None, copy=None):
        raise MemoryError("no room for this array")


def torch_meta_q():
    torch = pytest.importorskip("torch")
    return npattn.sdpa(torch.ones(Q_SHAPE, device="meta"), arr(K_SHAPE), arr(V_SHAPE))


ROWS = [
    # ranks
    ("q 1-D", call(q=arr((8,))), ValueError, "q", ()),
    ("q 0-D", call(q=arr(())), ValueError, "q", ()),
    ("k 1-D", call(k=arr((8,))), ValueError, "k", ()),
    ("k 0-D", call(k=arr(())), ValueError, "k", ()),
    ("v 1-D", call(v=arr((6,))), ValueError, "v", ()),
    ("v 0-D", call(v=arr(())), ValueError, "v", ()),
    ("q a Python float", call(q=1.0), ValueError, "q", ()),
    ("k a flat list", call(k=[1.0, 2.0]), ValueError, "k", ()),
    # shapes that do not fit together
    ("D of k != D of q", call(k=arr((1, 2, 5, 7))), ValueError, "k", ("(1, 2, 5, 7)",)),
    ("D of q != D of k", call(q=arr((1, 4, 3, 9))), ValueError, "q", ("(1, 4, 3, 9)",)),
    ("D = 0", call(q=arr((1, 4, 3, 0)), k=arr((1, 2, 5, 0))), ValueError, "q", ()),
    ("S of v != S of k", call(v=arr((1, 2, 4, 6))), ValueError, "v", ("(1, 2, 4, 6)",)),
    ("H_kv of v != H_kv of k", call(v=arr((1, 1, 5, 6))), ValueError, "v", ("(1, 1, 5, 6)",)),
    ("H_kv = 0", call(q=arr((1, 0, 3, 8)), k=arr((1, 0, 5, 8)), v=arr((1, 0, 5, 6))), ValueError, "k", ()),
    ("H_q not a multiple of H_kv", call(q=arr((1, 5, 3, 8))), ValueError, "q", ("(1, 5, 3, 8)", "multiple")),
    ("H_q < H_kv", call(q=arr((1, 1, 3, 8))), ValueError, "q", ("(1, 1, 3, 8)",)),
    (
        "batch dims of q and k do not broadcast",
        call(q=arr((2, 4, 3, 8)), k=arr((3, 2, 5, 8)), v=arr((3, 2, 5, 6))),
        ValueError,
        "q",
        ("(2, 4, 3, 8)", "(3, 2, 5, 8)"),
    ),
    (
        "batch dims of v do not broadcast",
        call(q=arr((2, 4, 3, 8)), k=arr((2, 2, 5, 8)), v=arr((3, 2, 5, 6))),
        ValueError,
        "v",
        ("(3, 2, 5, 6)",),
    ),
    ("H_kv of v != H_kv of k (v more)", call(v=arr((1, 4, 5, 6))), ValueError, "v", ("(1, 4, 5, 6)",)),
    ("D of rank-2 k != D of q", call(q=arr((3, 8)), k=arr((5, 4)), v=arr((5, 6))), ValueError, "k", ("k (5, 4)",)),
    ("S of rank-2 v != S of k", call(q=arr((3, 8)), k=arr((5, 8)), v=arr((6, 6))), ValueError, "v", ("v (6, 6)",)),
    ("rank-2 q against 2 kv heads", call(q=arr((3, 8))), ValueError, "q", ("multiple",)),
    (
        "(B, L, H, D) arrays as (B, H, L, D)",
        call(q=arr((1, 3, 4, 8)), k=arr((1, 5, 2, 8)), v=arr((1, 5, 2, 6))),
        ValueError,
        "q",
        ("multiple", "if your arrays are (B, L, H, D), pass x.transpose(0, 2, 1, 3): no copy is made"),
    ),
    (
        "batch dims of k and v do not broadcast",
        call(k=arr((2, 2, 5, 8)), v=arr((3, 2, 5, 6))),
        ValueError,
        "v",
        ("(2, 2, 5, 8)", "(3, 2, 5, 6)"),
    ),
    (
        "leading batch dims do not broadcast",
        call(q=arr((2, 1, 4, 3, 8)), k=arr((3, 1, 2, 5, 8)), v=arr((3, 1, 2, 5, 6))),
        ValueError,
        "batch",
        ("(2, 1, 4, 3, 8)",),
    ),
    ("ragged list", call(q=[[1.0, 2.0], [3.0]]), ValueError, "q", ()),
    ("ragged k", call(k=[[[1.0, 2.0]], [[3.0]]]), ValueError, "k", ()),
    # dtypes of q, k, v
    *bad_dtype_rows(),
    # mask
    ("unknown mask string", call(mask="bogus"), ValueError, "mask", ("causal_top_left", "bogus")),
    ("mask string in other case", call(mask="Causal"), ValueError, "mask", ("causal_top_left",)),
    ("mask 'top_left' alone", call(mask="top_left"), ValueError, "mask", ("causal_top_left",)),
    ("bool mask of wrong shape", call(mask=np.ones((4, 3), bool)), ValueError, "mask", ("(4, 3)",)),
    ("float mask of wrong shape", call(mask=np.zeros((3, 6), np.float32)), ValueError, "mask", ("(3, 6)",)),
    (
        "mask that would grow the batch",
        call(mask=np.zeros((2, 4, 3, 5), np.float32)),
        ValueError,
        "mask",
        ("(2, 4, 3, 5)",),
    ),
    ("mask with extra dims", call(mask=np.zeros((1, 1, 4, 3, 5), np.float32)), ValueError, "mask", ()),
    ("int mask", call(mask=np.zeros((3, 5), np.int32)), TypeError, "mask", ("int32",)),
    ("uint8 mask", call(mask=np.ones((3, 5), np.uint8)), TypeError, "mask", ("uint8",)),
    ("complex mask", call(mask=np.zeros((3, 5), np.complex128)), TypeError, "mask", ("complex",)),
    ("object mask", call(mask=np.zeros((3, 5), object)), TypeError, "mask", ("object",)),
    ("float number as mask", call(mask=0.0), TypeError, "mask", ()),
    ("int number as mask", call(mask=1), TypeError, "mask", ()),
    ("numpy scalar as mask", call(mask=np.float32(0)), TypeError, "mask", ()),
    ("True as mask", call(mask=True), TypeError, "mask", ()),
    ("numpy bool as mask", call(mask=np.bool_(True)), TypeError, "mask", ()),
    ("complex number as mask", call(mask=1j), TypeError, "mask", ()),
    ("list of ints as mask", call(mask=[[1] * 5] * 3), TypeError, "mask", ("int",)),
    ("str array as mask", call(mask=np.full((3, 5), "a")), TypeError, "mask", ()),
    ("bytes as mask", call(mask=b"causal"), TypeError, "mask", ()),
    ("dict as mask", call(mask={}), TypeError, "mask", ()),
    ("datetime mask", call(mask=np.zeros((3, 5), "M8[s]")), TypeError, "mask", ()),
    ("empty string as mask", call(mask=""), ValueError, "mask", ("causal_top_left",)),
    ("mask with L and S swapped", call(mask=np.ones((5, 3), bool)), ValueError, "mask", ("(5, 3)",)),
    ("mask of S + 1 keys", call(mask=np.zeros((3, 6), np.float64)), ValueError, "mask", ("(3, 6)",)),
    ("mask with H_kv heads", call(mask=np.ones((2, 3, 5), bool)), ValueError, "mask", ("(2, 3, 5)",)),
    ("ragged list as mask", call(mask=[[0.0], [0.0, 1.0]]), ValueError, "mask", ()),
    # sinks
    ("sinks too short", call(sinks=np.zeros(3)), ValueError, "sinks", ("(3,)",)),
    ("sinks one per kv head", call(sinks=np.zeros(2)), ValueError, "sinks", ("(2,)",)),
    ("sinks 2-D", call(sinks=np.zeros((1, 4))), ValueError, "sinks", ("(1, 4)",)),
    ("sinks a scalar", call(sinks=0.0), ValueError, "sinks", ()),
    ("sinks complex", call(sinks=np.zeros(4, np.complex64)), TypeError, "sinks", ()),
    ("sinks str", call(sinks=np.array(["0"] * 4)), TypeError, "sinks", ()),
    ("sinks object", call(sinks=np.array([None] * 4)), TypeError, "sinks", ()),
    ("sinks bool", call(sinks=np.ones(4, bool)), TypeError, "sinks", ("bool",)),
    ("sinks a string", call(sinks="abcd"), TypeError, "sinks", ()),
    ("sinks too long", call(sinks=np.zeros(5)), ValueError, "sinks", ("(5,)",)),
    ("sinks empty", call(sinks=[]), ValueError, "sinks", ("(0,)",)),
    ("ragged list as sinks", call(sinks=[[0.0], [0.0, 1.0]]), ValueError, "sinks", ()),
    ("sinks one per head and batch", call(sinks=np.zeros((1, 4))), ValueError, "sinks", ("(1, 4)",)),
    # scale
    ("scale nan", call(scale=float("nan")), ValueError, "scale", ()),
    ("scale inf", call(scale=float("inf")), ValueError, "scale", ()),
    ("scale -inf", call(scale=-np.inf), ValueError, "scale", ()),
    ("scale numpy nan", call(scale=np.float32("nan")), ValueError, "scale", ()),
    ("scale a string", call(scale="a"), TypeError, "scale", ()),
    ("scale a list", call(scale=[1.0]), TypeError, "scale", ()),
    ("scale complex", call(scale=1j), TypeError, "scale", ()),
    ("scale numpy inf", call(scale=np.float64("inf")), ValueError, "scale", ()),
    ("scale 0-d array nan", call(scale=np.array(np.nan)), ValueError, "scale", ()),
    ("scale bool", call(scale=True), TypeError, "scale", ()),
    ("scale 1-D array", call(scale=np.ones(1)), TypeError, "scale", ()),
    ("scale complex numpy", call(scale=np.complex64(1)), TypeError, "scale", ()),
    ("scale bytes", call(scale=b"1"), TypeError, "scale", ()),
    ("scale an int beyond float range", call(scale=10**400), ValueError, "scale", ()),
    ("scale a 2-D array", call(scale=np.ones((1, 1))), TypeError, "scale", ()),
    # window
    ("window a number", call(window=3), TypeError, "window", ()),
    ("window of three", call(window=(1, 2, 3)), TypeError, "window", ()),
    ("window a string", call(window="ab"), TypeError, "window", ()),
    ("window negative left", call(window=(-1, 0)), ValueError, "window", ("-1",)),
    ("window negative right", call(window=(0, -2)), ValueError, "window", ("-2",)),
    ("window of floats", call(window=(1.5, 0)), TypeError, "window", ()),
    ("window of bools", call(window=(True, 0)), TypeError, "window", ()),
    ("window beyond int64", call(window=(2**63, 0)), ValueError, "window", ()),
    # softcap
    ("softcap 0", call(softcap=0.0), ValueError, "softcap", ()),
    ("softcap negative", call(softcap=-1.0), ValueError, "softcap", ()),
    ("softcap nan", call(softcap=float("nan")), ValueError, "softcap", ()),
    ("softcap inf", call(softcap=np.inf), ValueError, "softcap", ()),
    ("softcap a string", call(softcap="30"), TypeError, "softcap", ()),
    ("softcap True", call(softcap=True), TypeError, "softcap", ()),
    ("softcap a list", call(softcap=[30.0]), TypeError, "softcap", ()),
    ("softcap an int beyond float range", call(softcap=10**400), ValueError, "softcap", ("finite",)),
    ("softcap a negative int beyond float range", call(softcap=-(10**400)), ValueError, "softcap", ("finite",)),
    # positions
    ("q_offset with causal_top_left", call(q_offset=2, mask="causal_top_left"), ValueError, "q_offset", ()),
    ("q_offset a float", call(q_offset=1.0), TypeError, "q_offset", ()),
    ("q_offset beyond int64", call(q_offset=2**64), ValueError, "q_offset", ()),
    ("q_offset True", call(q_offset=True), TypeError, "q_offset", ()),
    ("k_offset None", call(k_offset=None), TypeError, "k_offset", ()),
    ("k_offset a string", call(k_offset="0"), TypeError, "k_offset", ()),
    ("k_offset below int64", call(k_offset=-(2**64)), ValueError, "k_offset", ()),
    # precision (SPEC section 11)
    ("precision unknown", call(precision="low"), ValueError, "precision", ('"highest" or "fast"', "'low'")),
    ("precision None", call(precision=None), ValueError, "precision", ("None",)),
    ("precision upper case", call(precision="FAST"), ValueError, "precision", ("'FAST'",)),
    # per-request key ranges and positions (B = (1,), S = 5)
    ("k_start beyond S", call(k_start=6), ValueError, "k_start", ("k_start[0] = 6 lies outside [0, S] = [0, 5]",)),
    ("k_start negative", call(k_start=[-1]), ValueError, "k_start", ("k_start[0] = -1",)),
    ("k_lengths negative", call(k_lengths=-2), ValueError, "k_lengths", ("k_lengths[0] = -2 must be at least 0",)),
    (
        "k_lengths past S",
        call(k_start=2, k_lengths=4),
        ValueError,
        "k_lengths",
        ("k_lengths[0] = 4 runs past S = 5 (k_start[0] = 2)",),
    ),
    ("k_lengths past S, rank 2", rank2_call(k_lengths=9), ValueError, "k_lengths", ("k_lengths = 9 runs past S = 5",)),
    ("k_lengths a float", call(k_lengths=3.0), TypeError, "k_lengths", ("dtype float64",)),
    ("k_start bools", call(k_start=np.array([True])), TypeError, "k_start", ("dtype bool",)),
    ("k_start a string", call(k_start="1"), TypeError, "k_start", ()),
    ("k_lengths not broadcastable", call(k_lengths=[1, 2]), ValueError, "k_lengths", ("B = (1,)", "(2,)")),
    (
        "k_start beyond int64",
        call(k_start=np.array([2**63], np.uint64)),
        ValueError,
        "k_start",
        (f"k_start[0] = {2**63} lies outside int64",),
    ),
    (
        "k_lengths beyond int64",
        call(k_lengths=np.array([2**64 - 1], np.uint64)),
        ValueError,
        "k_lengths",
        (f"k_lengths[0] = {2**64 - 1} lies outside int64",),
    ),
    (
        "q_offset array beyond int64",
        call(q_offset=np.array([2**63], np.uint64)),
        ValueError,
        "q_offset",
        (f"q_offset[0] = {2**63} lies outside int64",),
    ),
    # Python ints beyond int64, which NumPy holds as objects (issue 56, item 3)
    ("k_lengths a Python int beyond int64", call(k_lengths=2**64), ValueError, "k_lengths", (f"[0] = {2**64} lies",)),
    (
        "k_lengths a list with an int beyond int64",
        call(q=arr((2, 4, 3, 8)), k_lengths=[3, 2**64]),
        ValueError,
        "k_lengths",
        (f"k_lengths[1] = {2**64} lies outside int64",),
    ),
    (
        "k_lengths beyond int64 in the second batch dim",
        call(q=arr((2, 3, 4, 3, 8)), k_lengths=[[1, 2, 3], [1, 2**64, 3]]),
        ValueError,
        "k_lengths",
        (f"k_lengths[1, 1] = {2**64} lies outside int64",),
    ),
    ("k_start below int64", call(k_start=-(2**63) - 1), ValueError, "k_start", (f"k_start[0] = {-(2**63) - 1}",)),
    (
        "q_offset a list with an int beyond int64",
        call(q=arr((2, 4, 3, 8)), q_offset=[0, 2**70]),
        ValueError,
        "q_offset",
        (f"q_offset[1] = {2**70} lies outside int64",),
    ),
    ("k_lengths a list holding None", call(k_lengths=[None]), TypeError, "k_lengths", ("NoneType",)),
    (
        "q_offset's default beyond int64",
        call(k_offset=2**63 - 1, k_lengths=5),
        ValueError,
        "q_offset",
        ("q_offset's default, k_offset + k_lengths[0] - L, passes int64",),
    ),
    ("q_offset array not broadcastable", call(q_offset=[[1], [2]]), ValueError, "q_offset", ("B = (1,)",)),
    ("q_offset array of floats", call(q_offset=np.array([1.0])), TypeError, "q_offset", ("dtype float64",)),
    ("q_offset array with causal_top_left", call(q_offset=[1], mask="causal_top_left"), ValueError, "q_offset", ()),
    # return_lse
    ("return_lse a string", call(return_lse="yes"), TypeError, "return_lse", ()),
    ("return_lse an int", call(return_lse=1), TypeError, "return_lse", ()),
    ("return_lse None", call(return_lse=None), TypeError, "return_lse", ()),
    # threads
    ("threads 0", call(threads=0), ValueError, "threads", ("0",)),
    ("threads -1", call(threads=-1), ValueError, "threads", ("-1",)),
    ("threads a float", call(threads=1.5), TypeError, "threads", ()),
    ("threads a float with int value", call(threads=2.0), TypeError, "threads", ()),
    ("threads a string", call(threads="2"), TypeError, "threads", ()),
    ("threads -2**63", call(threads=-(2**63)), ValueError, "threads", ()),
    ("threads beyond any int", call(threads=2**70), ValueError, "threads", ()),
    ("threads a million", call(threads=10**6), ValueError, "threads", ("1000000",)),
    (
        "threads one beyond the core's cap",
        call(threads=npattn._core.MAX_THREADS + 1),
        ValueError,
        "threads",
        (f"from 1 to {npattn._core.MAX_THREADS}",),
    ),
    ("threads True", call(threads=True), TypeError, "threads", ()),
    ("threads numpy float", call(threads=np.float64(2)), TypeError, "threads", ()),
    ("threads numpy 0", call(threads=np.int32(0)), ValueError, "threads", ("0",)),
    ("threads a list", call(threads=[2]), TypeError, "threads", ()),
    ("threads nan", call(threads=float("nan")), TypeError, "threads", ()),
    # out
    (
        "out of wrong shape",
        call(out=np.empty((1, 4, 3, 5), np.float32)),
        ValueError,
        "out",
        ("(1, 4, 3, 5)",),
    ),
    ("out missing the rank-4 batch", call(out=np.empty((4, 3, 6), np.float32)), ValueError, "out", ()),
    ("out of wrong dtype", call(out=np.empty(OUT_SHAPE, np.float64)), ValueError, "out", ("float64",)),
    ("out read-only", call(out=read_only(OUT_SHAPE)), ValueError, "out", ()),
    ("out overlapping q", overlapping_out(), ValueError, "out", ()),
    ("out overlapping v", out_overlapping_v(), ValueError, "out", ()),
    ("out overlapping mask", out_overlapping_mask(), ValueError, "out", ()),
    ("out a list", call(out=[[0.0] * 6] * 3), TypeError, "out", ()),
    ("out a memoryview", call(out=memoryview(bytearray(288))), TypeError, "out", ()),
    ("out a scalar", call(out=np.float32(0)), TypeError, "out", ()),
    ("out byte-swapped", call(out=np.empty(OUT_SHAPE, ">f4")), ValueError, "out", ()),
    ("out unaligned", call(out=unaligned(OUT_SHAPE)), ValueError, "out", ()),
    ("out a broadcast view", call(out=np.broadcast_to(np.zeros(6, np.float32), OUT_SHAPE)), ValueError, "out", ()),
    ("out transposed shape", call(out=np.empty((1, 3, 4, 6), np.float32)), ValueError, "out", ("(1, 3, 4, 6)",)),
    ("out float16 for float32", call(out=np.empty(OUT_SHAPE, np.float16)), ValueError, "out", ("float16",)),
    ("out rank 2 for a rank-4 result", call(out=np.empty((3, 6), np.float32)), ValueError, "out", ("(3, 6)",)),
    ("out rank 4 for a rank-2 result", rank2_call(out=np.empty((1, 1, 3, 6), np.float32)), ValueError, "out", ()),
    ("out the very array k", out_is_k(), ValueError, "out", ()),
    ("out overlapping a bool mask", out_overlapping_bool_mask(), ValueError, "out", ()),
    ("out overlapping a float64 mask of float32 inputs", out_overlapping_converted_mask(), ValueError, "out", ()),
    ("out overlapping a misaligned mask", out_overlapping_misaligned_mask(), ValueError, "out", ()),
    ("out overlapping sinks", out_overlapping_sinks(), ValueError, "out", ()),
    ("out overlapping itself", out_overlapping_itself(), ValueError, "out", ("itself",)),
    # codes and their scales (SPEC section 14; issue 57, item 7)
    *code_rows(),
    # what converting an argument raises
    ("q whose __array__ runs out of memory", call(q=OutOfMemory()), MemoryError, "q", ()),
    ("q a torch tensor on the meta device", torch_meta_q, TypeError, "q", ("meta",)),
]


def _row_id(row):
    return row.id if hasattr(row, "id") else row[0]


@pytest.mark.parametrize("description, fn, exception, argument, substrings", ROWS, ids=[_row_id(r) for r in ROWS])
def test_invalid_input_raises_naming_the_argument(capfd, description, fn, exception, argument, substrings):
    """An invalid input raises `exception`; the message starts "sdpa: " and names the argument.

    Nothing is printed to stderr.
    """
    assert_raises_naming(capfd, fn, exception, argument, substrings)


def paged_codes(**kwargs):
    """paged_attention over int8 key pages (3 pages of 4 rows; request 0 in pages 0 and 1,
    request 1 in page 2), with keywords replaced."""
    q, pages = arr((2, 4, 1, 8)), codes((3, 2, 4, 8))
    return lambda: npattn.paged_attention(q, pages, arr((3, 2, 4, 6)), [[0, 1], [2, -1]], [5, 3], **kwargs)


def backward_of_codes(name):
    """sdpa_backward with k or v holding int8 codes."""
    q, k, v, out = arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), arr(OUT_SHAPE)
    k, v = (codes(K_SHAPE), v) if name == "k" else (k, codes(V_SHAPE))
    return lambda: npattn.sdpa_backward(out, q, k, v, out, arr(OUT_SHAPE[:-1]))


def dask_codes(**kwargs):
    """npattn.dask.sdpa over int8 k, with keywords replaced: refused when called."""
    pytest.importorskip("dask.array")  # npattn.dask says which extra is missing: an ImportError, no skip
    import npattn.dask

    return npattn.dask.sdpa(arr(Q_SHAPE), codes(K_SHAPE), arr(V_SHAPE), **kwargs)


def checks_of_codes(fn=None, **kwargs):
    """npattn.testing's checks of int8 k, with keywords replaced."""
    if fn is None:
        return npattn.testing.assert_attention_close(arr(Q_SHAPE[:-1] + V_SHAPE[-1:]), arr(Q_SHAPE), codes(K_SHAPE),
                                                     arr(V_SHAPE), **kwargs)  # fmt: skip
    return fn(arr(Q_SHAPE), codes(K_SHAPE), arr(V_SHAPE), k_scale=scales(()), **kwargs)


CODE_CALL_ROWS = [
    ("paged codes without k_scale", paged_codes(), TypeError, "k_scale", ("key_pages holds int8",), "paged_attention"),
    (
        "paged k_scale NaN in a live page",
        paged_codes(k_scale=np.concatenate([scales((2, 2, 4, 1)), scales((1, 2, 4, 1), np.nan)])),
        ValueError,
        "k_scale",
        ("NaN",),
        "paged_attention",
    ),
    (
        "paged k_scale that is not paged like the pages",
        paged_codes(k_scale=scales((2, 2, 4, 1))),
        ValueError,
        "k_scale",
        ("(2, 2, 4, 1)", "(3, 2, 4, 1)"),
        "paged_attention",
    ),
    (
        "paged k_scale of float v",
        paged_codes(k_scale=scales(()), v_scale=scales(())),
        ValueError,
        "v_scale",
        (),
        "paged_attention",
    ),
    (
        "attention_weights codes without k_scale",
        lambda: npattn.attention_weights(arr(Q_SHAPE), codes(K_SHAPE)),
        TypeError,
        "k_scale",
        (),
        "attention_weights",
    ),
    (
        "sdpa_backward of k codes",
        backward_of_codes("k"),
        TypeError,
        "k",
        ("no gradient through codes",),
        "sdpa_backward",
    ),
    ("sdpa_backward of v codes", backward_of_codes("v"), TypeError, "v", ("no gradient",), "sdpa_backward"),
    ("dask codes without k_scale", lambda: dask_codes(), TypeError, "k_scale", (), "sdpa"),
    (
        "assert_attention_close codes without k_scale",
        lambda: checks_of_codes(),
        TypeError,
        "k_scale",
        (),
        "assert_attention_close",
    ),
    (
        "tolerance v_scale of float v",
        lambda: checks_of_codes(npattn.testing.tolerance, v_scale=scales(())),
        ValueError,
        "v_scale",
        (),
        "tolerance",
    ),
    (
        "dask k_scale of groups dividing no D",
        lambda: dask_codes(k_scale=scales((3,))),
        ValueError,
        "k_scale",
        (),
        "sdpa",
    ),
]


@pytest.mark.parametrize(
    "description, fn, exception, argument, substrings, function", CODE_CALL_ROWS, ids=[r[0] for r in CODE_CALL_ROWS]
)
def test_codes_in_every_function_raise_naming_the_argument(capfd, description, fn, exception, argument, substrings,
                                                            function):  # fmt: skip
    """Codes and their scales in paged_attention, attention_weights, sdpa_backward and
    npattn.dask.sdpa: the error of sdpa's table, named by each function."""
    assert_raises_naming(capfd, fn, exception, argument, substrings, function=function)


def test_paged_scales_of_pages_no_request_reads_may_hold_anything():
    """A NaN scale in a page that no live entry names (a free page of the pool) is not
    read: the call computes what it computes with that page's scales finite."""
    k_scale = np.concatenate([scales((2, 2, 4, 1)), scales((1, 2, 4, 1), np.nan)])
    q, pages = arr((2, 4, 1, 8)), codes((3, 2, 4, 8))
    table = [[0, 1], [1, -1]]  # page 2 is free
    got = npattn.paged_attention(q, pages, arr((3, 2, 4, 6)), table, [5, 3], k_scale=k_scale)
    np.testing.assert_array_equal(got, npattn.paged_attention(q, pages, arr((3, 2, 4, 6)), table, [5, 3],
                                                              k_scale=np.ones_like(k_scale)))  # fmt: skip


TRANSPOSE_HINT = "if your arrays are (B, L, H, D), pass x.transpose(0, 2, 1, 3)"


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, hint",
    [
        ((1, 3, 4, 8), (1, 5, 2, 8), (1, 5, 2, 6), True),  # heads 3 and 5; read (B, L, H, D): 4 and 2
        ((1, 1, 8, 16), (1, 100, 2, 16), (1, 100, 2, 16), True),  # a decode step, L = 1, 8 heads over 2
        ((2, 6, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8), True),
        ((1, 3, 4, 8), (1, 5, 3, 8), (1, 5, 3, 6), False),  # 4 heads over 3: no reading fits
        ((1, 3, 4, 8), (1, 5, 2, 8), (1, 5, 1, 6), False),  # v's heads fit neither
        ((1, 3, 4, 8), (1, 5, 2, 7), (1, 5, 2, 6), False),  # D differs: no transposing helps
        ((3, 4, 8), (5, 2, 8), (5, 2, 6), False),  # rank 3: the hint speaks of rank 4
        ((2, 4, 3, 8), (3, 2, 5, 8), (3, 2, 5, 6), False),  # the batch dims: heads and rows fit
    ],
)
def test_transpose_hint_only_where_the_shapes_fit_transposed(q_shape, k_shape, v_shape, hint):
    """A shape error hints at x.transpose(0, 2, 1, 3) exactly when the rank-4 arrays
    break a rule of heads or rows read as (B, H, L, D) and keep them read as (B, L, H, D)."""
    with pytest.raises(ValueError) as info:
        npattn.sdpa(arr(q_shape), arr(k_shape), arr(v_shape))
    assert (TRANSPOSE_HINT in str(info.value)) == hint, str(info.value)


@pytest.mark.parametrize("mask", ["bogus", "Causal", "top_left", "causal "])
def test_unknown_mask_string_lists_the_accepted_ones(mask):
    """An unknown mask string is a ValueError whose message lists "causal" and "causal_top_left"."""
    with pytest.raises(ValueError, match=r"^sdpa: ") as info:
        call(mask=mask)()
    assert re.search(r"\bcausal\b", str(info.value)), info.value
    assert re.search(r"\bcausal_top_left\b", str(info.value)), info.value


@pytest.mark.parametrize(
    "description, fn",
    [
        ("unknown keyword", lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), bogus=1)),
        (
            "sinks passed positionally",
            lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), None, "causal", None),
        ),
        ("v missing", lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE))),
        (
            "is_causal (PyTorch's keyword)",
            lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), is_causal=True),
        ),
    ],
)
def test_bad_call_signature_is_type_error(description, fn):
    """Keywords sdpa does not take, or too few or too many positional arguments: TypeError."""
    with pytest.raises(TypeError):
        fn()


def test_accepted_edge_values():
    """Values at the edge of the rules are accepted, each giving the result of its plain
    equivalent: an int or 0-d scale, int sinks, NumPy ints for threads, window sides and
    offsets, a window of None sides, an int softcap, numpy.bool_ return_lse."""
    q, k, v = (np.random.default_rng(1).standard_normal(s).astype(np.float32) for s in (Q_SHAPE, K_SHAPE, V_SHAPE))
    for kwargs, plain in (
        ({"scale": None}, {}),
        ({"scale": 1}, {"scale": 1.0}),
        ({"scale": np.array(0.5)}, {"scale": 0.5}),
        ({"scale": np.float32(0.5)}, {"scale": 0.5}),
        ({"sinks": [0, 1, 2, 3]}, {"sinks": np.arange(4.0)}),
        ({"scale": np.int64(2)}, {"scale": 2.0}),
        ({"window": (np.int64(2), None)}, {"window": (2, None)}),
        ({"window": [None, None]}, {}),
        ({"softcap": 3}, {"softcap": 3.0}),
        ({"q_offset": np.int32(2), "k_offset": np.int64(0)}, {}),
        ({"return_lse": np.bool_(False)}, {}),
    ):
        np.testing.assert_array_equal(
            npattn.sdpa(q, k, v, threads=1, **kwargs), npattn.sdpa(q, k, v, threads=1, **plain)
        )


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "", "4097", " "])
def test_bad_npattn_num_threads_is_value_error_naming_it(monkeypatch, value):
    """threads=None with a bad NPATTN_NUM_THREADS: ValueError naming the variable, the
    range it must be in and its value as a quoted string."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", value)
    with pytest.raises(ValueError, match=r"^sdpa: NPATTN_NUM_THREADS must be an int from 1 to \d+, got ") as info:
        call()()
    assert str(info.value).endswith(f"got {value!r}"), info.value


def test_npattn_num_threads_is_read():
    """A good NPATTN_NUM_THREADS is what threads=None runs on: the same bits as that threads=."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 4, 64, 32), (1, 2, 300, 32), (1, 2, 300, 32)))
    for value, threads in (("1", 1), (" 2 ", 2)):
        with pytest.MonkeyPatch.context() as m:
            m.setenv("NPATTN_NUM_THREADS", value)
            np.testing.assert_array_equal(npattn.sdpa(q, k, v), npattn.sdpa(q, k, v, threads=threads))


# ---- out against every operand (issue 56, item 1) ----


def _shared(n_bytes):
    """A byte buffer and its float32 view as the result (1, 4, 3, 6), from byte 0."""
    buf = np.zeros(max(n_bytes, 4 * 72), np.uint8)
    return buf, buf[: 4 * 72].view(np.float32).reshape(OUT_SHAPE)


def _int_operand(buf, values):
    """int64 `values` in the first bytes of buf."""
    a = buf[: 8 * len(values)].view(np.int64)
    a[:] = values
    return a


def _out_sharing(operand):
    """(buf, call): a call whose out shares bytes with `operand`, taken from the same buffer."""
    buf, out = _shared(4 * 72)
    q, k, v = arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE)
    if operand == "sinks":  # the case: float32 sinks, read as float64 copies
        sinks = buf[:16].view(np.float32)
        sinks[:] = [0.5, -0.5, 1.0, 2.0]
        return buf, lambda: npattn.sdpa(q, k, v, sinks=sinks, out=out)
    if operand in ("k_start", "k_lengths", "q_offset"):
        ints = _int_operand(buf, {"k_start": [1], "k_lengths": [4], "q_offset": [2]}[operand])
        return buf, lambda: npattn.sdpa(q, k, v, **{operand: ints}, out=out)
    # paged_attention: 2 requests, 2 pages of 2 rows; out (2, 4, 1, 6) from byte 0
    out = buf[: 4 * 48].view(np.float32).reshape(2, 4, 1, 6)
    pages_q = arr((2, 4, 1, 8))
    kp, vp = arr((2, 2, 2, 8)), arr((2, 2, 2, 6))
    table, lens = np.array([[0, 1], [1, 0]]), np.array([3, 4])
    if operand == "block_table":
        table = _int_operand(buf, [0, 1, 1, 0]).reshape(2, 2)
    elif operand == "context_lens":
        lens = _int_operand(buf, [3, 4])
    else:  # value_pages
        vp = buf[: 4 * 48].view(np.float32).reshape(2, 2, 2, 6)
        vp[:] = 1.0
    return buf, lambda: npattn.paged_attention(pages_q, kp, vp, table, lens, out=out)


@pytest.mark.parametrize(
    "operand", ["sinks", "k_start", "k_lengths", "q_offset", "value_pages", "block_table", "context_lens"]
)
def test_out_sharing_memory_with_any_operand_is_refused(capfd, operand):
    """out sharing bytes with any operand, the per-request ints and the paged ones
    included: ValueError naming out and the operand, and the operand left untouched
    (0.3 wrote the result into float32 sinks, SPEC section 1)."""
    buf, fn = _out_sharing(operand)
    before = buf.copy()
    function = "paged_attention" if operand in ("value_pages", "block_table", "context_lens") else "sdpa"
    assert_raises_naming(capfd, fn, ValueError, "out", (f"sharing memory with {operand}",), function=function)
    np.testing.assert_array_equal(buf, before)


# ---- what an adversarial probe found (issue 19, items 9-12) ----


def backward_inputs(rng, dtype=np.float32):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in (Q_SHAPE, K_SHAPE, V_SHAPE))
    out, lse = npattn.sdpa(q, k, v, return_lse=True)
    return np.ones_like(out), q, k, v, out, lse


@pytest.mark.parametrize("lse_dtype", ["float16", "bfloat16"])
def test_backward_reads_a_half_precision_lse_as_float32(lse_dtype):
    """An lse in float16 or bfloat16 is read as float32: the gradients are those of the
    same (rounded) lse given in float32, bit for bit."""
    dout, q, k, v, out, lse = backward_inputs(np.random.default_rng(9))
    half = lse.astype(dtype_of(lse_dtype))
    got = npattn.sdpa_backward(dout, q, k, v, out, half)
    want = npattn.sdpa_backward(dout, q, k, v, out, half.astype(np.float32))
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_backward_float128_input_names_the_widest_dtype(capfd, name):
    """A float128 dout, out or lse: TypeError naming it and the widest dtype computed, as for q."""
    args = dict(zip(("dout", "q", "k", "v", "out", "lse"), backward_inputs(np.random.default_rng(2))))
    args[name] = args[name].astype(np.longdouble)
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("longdouble is float64 here")
    assert_raises_naming(
        capfd,
        lambda: npattn.sdpa_backward(**args),
        TypeError,
        name,
        ("the widest dtype computed is float64",),
        function="sdpa_backward",
    )


def test_q_offset_int64_min_has_one_answer_whatever_the_form():
    """q_offset=-2**63 (a valid int64) gives the same result for native arrays, a
    byte-swapped copy and nested lists: the one rule of positions, read once."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (Q_SHAPE, K_SHAPE, V_SHAPE))
    for form in (lambda x: x, lambda x: x.astype(x.dtype.newbyteorder()), lambda x: x.tolist()):
        native = [np.asarray(form(x)) for x in (q, v)]
        native = [x.astype(x.dtype.newbyteorder("=")) for x in native]
        want = npattn.sdpa(native[0], k, native[1], mask=None, threads=1)  # no band: the offset changes nothing
        got = npattn.sdpa(form(q), k, form(v), q_offset=-(2**63), mask=None, threads=1)
        np.testing.assert_array_equal(got, want)


# ---- sizes: beyond BLAS's 32-bit int, or too large to allocate ----
#
# Each gives a correct answer, a ValueError or a MemoryError; never a crash or
# a wrapped-around integer. Large operands are np.zeros (calloc: pages that are
# never touched cost no memory) or zero-stride broadcast views.

INT_MAX = 2**31 - 1


def _view(shape):
    return np.broadcast_to(np.ones((1,) * len(shape), np.float32), shape)


@pytest.mark.parametrize(
    "description, q_shape, k_shape, v_shape, error",
    [
        # the example: a (2**20, 2**12, 2**12, 1) result is 64 TiB
        ("64 TiB result", (2**20, 2**12, 2**12, 1), (1, 1, 1, 1), (1, 1, 1, 1), MemoryError),
        # batch dims whose product overflows int64, from one operand or from two
        ("q and k batches beyond int64", (2**40, 1, 1, 1, 1), (1, 2**40, 1, 1, 1), (1, 1, 1, 1), ValueError),
        (
            "q, k and v batches beyond int64",
            (2**30, 1, 1, 1, 1, 1),
            (1, 2**30, 1, 1, 1, 1),
            (1, 1, 2**30, 1, 1, 1),
            ValueError,
        ),
        ("H_q beyond memory", (1, 2**45, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), MemoryError),
        ("L beyond memory", (1, 1, 2**45, 1), (1, 1, 1, 1), (1, 1, 1, 1), MemoryError),
    ],
)
def test_result_too_large(capfd, description, q_shape, k_shape, v_shape, error):
    """A result that cannot be allocated is a MemoryError naming its shape; one with more
    elements than an array can index is a ValueError; never a crash."""
    q, k, v = _view(q_shape), _view(k_shape), _view(v_shape)
    with pytest.raises(error, match=r"^sdpa: .*the result, shape"):
        npattn.sdpa(q, k, v)
    assert capfd.readouterr().err == ""


def test_result_beyond_memory_and_swap_is_refused_before_allocating(capfd):
    """A 64 TiB result, more than any machine this runs on holds in memory and swap,
    is a MemoryError that says so, raised before anything is allocated: a kernel
    that overcommits would otherwise promise it and kill the process once written."""
    q, k, v = _view((1, 2**44, 1, 1)), _view((1, 1, 1, 1)), _view((1, 1, 1, 1))
    with pytest.raises(
        MemoryError, match=r"^sdpa: cannot allocate the result, shape .*more than this machine's memory"
    ):
        npattn.sdpa(q, k, v)
    assert capfd.readouterr().err == ""


def test_width_beyond_int_max_is_refused():
    """D = 2**31 (k's rows longer than a BLAS int): ValueError naming D, before any copy."""
    D = INT_MAX + 1
    q = np.broadcast_to(np.ones((1, 1, 1, 1), np.float16), (1, 1, 1, D))
    k = np.zeros((1, 1, 1, D), np.float16)  # 4 GiB of untouched pages
    v = np.full((1, 1, 1, 2), 3.0, np.float16)
    with pytest.raises(ValueError, match=r"^sdpa: D and D_v must be at most 2\*\*31 - 1"):
        npattn.sdpa(q, k, v)


def test_value_width_beyond_int_max_is_refused():
    """D_v = 2**31: ValueError naming D_v."""
    v = np.zeros((1, 1, 1, INT_MAX + 1), np.float16)
    with pytest.raises(ValueError, match=r"^sdpa: D and D_v must be at most 2\*\*31 - 1"):
        npattn.sdpa(np.ones((1, 1, 1, 2), np.float16), np.ones((1, 1, 1, 2), np.float16), v)


@pytest.mark.parametrize("threads", [1, 2])
def test_keys_beyond_int_max(threads):
    """S = 2**31 + 3 keys (more than a BLAS int) under a top-left causal mask: the one
    query sees key 0 only, so the answer is v[0], computed without reading the rest."""
    S = INT_MAX + 4
    k = np.zeros((1, 1, S, 1), np.float16)  # 4 GiB of untouched pages each
    v = np.zeros((1, 1, S, 2), np.float16)
    v[0, 0, 0] = 3.0
    out = npattn.sdpa(np.ones((1, 1, 1, 1), np.float16), k, v, mask="causal_top_left", threads=threads)
    np.testing.assert_array_equal(out, [[[[3.0, 3.0]]]])


# ---- allocation failure inside the core ----


def extreme_values(q, k, v):
    """Equal scores and values 1e38: the sum of the 7 weighted values, 7e38, overflows
    float32, so the tile is redone in double (the result, 1e38, is representable)."""
    return np.zeros_like(q), k, np.full_like(v, 1e38)


@pytest.mark.parametrize(
    "description, dtype, L, S, threads, n_alloc, alter, table",
    [
        ("float64 prefill, one thread", np.float64, 40, 50, 1, 1, None, None),  # scratch
        ("float64 prefill, two threads", np.float64, 200, 300, 2, 1, None, None),
        ("float64 decode with split-K", np.float64, 1, 40000, 2, 2, None, None),  # scratch, partials
        ("float32 prefill", np.float32, 200, 300, 2, 2, None, None),  # scratch, the exact path's table
        ("float32 decode with split-K", np.float32, 1, 40000, 2, 3, None, None),  # and the partials
        ("float32 redone in double", np.float32, 5, 7, 1, 3, extreme_values, None),  # and its scratch
        # scratch, the exact path's table; the key tiles the units share (K's and V's rows
        # as float, K's split rows) are optional: without them, the same bits
        ("float16 prefill", np.float16, 200, 300, 2, 2, None, "avx2"),
        ("float16 prefill on tiles", np.float16, 200, 300, 2, 2, None, "amx"),
    ],
)
def test_core_allocation_failure_is_memory_error(capfd, description, dtype, L, S, threads, n_alloc, alter, table):
    """Every allocation in the core, made to fail in turn, gives MemoryError; the next call
    works; with exactly enough allocations the call succeeds."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, L, 16)).astype(dtype)
    k = rng.standard_normal((1, 1, S, 16)).astype(dtype)
    v = rng.standard_normal((1, 1, S, 8)).astype(dtype)
    if alter:
        q, k, v = alter(q, k, v)
    with kernels(table) if table else contextlib.nullcontext():
        want = npattn.sdpa(q, k, v, threads=threads)
        for n in range(n_alloc):
            with failing_allocations(n), pytest.raises(MemoryError, match=r"^sdpa: could not allocate"):
                npattn.sdpa(q, k, v, threads=threads)
            np.testing.assert_array_equal(npattn.sdpa(q, k, v, threads=threads), want)
        with failing_allocations(n_alloc):  # exactly enough allocations
            np.testing.assert_array_equal(npattn.sdpa(q, k, v, threads=threads), want)
    assert capfd.readouterr().err == ""

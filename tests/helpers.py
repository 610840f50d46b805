"""What the tests, the fuzzer (fuzz/) and the benchmarks share: builders of
inputs and layouts, the comparison with the reference, the kernel-table hook,
the peers' shapes. The tolerance itself is npattn.testing's.

npattn's own float32 results are held to 4 ulps per unit of logit and of
max|v| (npattn.testing allows a peer 8); float64 to 64; float16 and bfloat16
results must be the reference correctly rounded, up to that float32 noise.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import numpy as np
import pytest

import npattn
from npattn import _core, reference, testing

OWN_ULPS = testing.OWN_ULPS
KERNELS = ["portable", "avx2", "avx512", "neon"]

# ---- inputs ----


def dtype_of(name):
    """The NumPy dtype called name; bfloat16 comes from ml_dtypes (the test skips without it)."""
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def randn(rng, shape, dtype=np.float32, scale=1.0):
    """Normal values of shape in dtype (drawn in float64, rounded once)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def qkv(rng, batch, H_q, H_kv, L, S, D, D_v=None, dtype=np.float32, dtypes=None):
    """Random q (*batch, H_q, L, D), k (*batch, H_kv, S, D), v (*batch, H_kv, S, D_v)."""
    D_v = D if D_v is None else D_v
    dtypes = dtypes or (dtype,) * 3
    shapes = ((*batch, H_q, L, D), (*batch, H_kv, S, D), (*batch, H_kv, S, D_v))
    return tuple(randn(rng, s, dt) for s, dt in zip(shapes, dtypes))


def f64(x):
    """x as float64 for the reference; None, strings and bool masks as they are."""
    if x is None or isinstance(x, str):
        return x
    x = np.asarray(x)
    return x if x.dtype == bool else x.astype(np.float64)


def make_mask(rng, kind, shape, dtype=np.float32, empty_rows=True):
    """A mask of `kind` ("bool", "additive", or a string or None, returned as is);
    array kinds get `shape`, ~70% visible, additive values exact in every float
    dtype. Without empty_rows every row sees its last key."""
    if kind not in ("bool", "additive"):
        return kind
    visible = rng.random(shape) < 0.7
    if not empty_rows:
        visible[..., -1] = True
    if kind == "bool":
        return visible
    bias = np.round(rng.standard_normal(shape) * 4) / 4
    return np.where(visible, bias, -np.inf).astype(dtype)


MASK_KINDS = ["causal", "causal_top_left", None, "bool", "additive"]


def unaligned(x):
    """A copy of x whose data starts one byte past an aligned address."""
    raw = np.empty(x.nbytes + 1, dtype=np.uint8)
    y = raw[1:].view(x.dtype).reshape(x.shape)
    y[...] = x
    return y


def read_only(x):
    y = np.array(x)
    y.setflags(write=False)
    return y


def layout(rng, shape, dtype, kind):
    """Random values of `shape` in a view with the memory layout `kind`."""
    lead, last = shape[:-1], shape[-1]
    if kind == "contiguous":
        return randn(rng, shape, dtype)
    if kind == "fortran":
        return np.asfortranarray(randn(rng, shape, dtype))
    if kind == "transposed" and len(shape) >= 3:  # a (*B, L, H, D) buffer seen as (*B, H, L, D)
        *batch, H, L, D = shape
        return randn(rng, (*batch, L, H, D), dtype).swapaxes(-3, -2)
    if kind == "reversed_rows":
        return randn(rng, shape, dtype)[..., ::-1, :]
    if kind == "reversed_last":
        return randn(rng, shape, dtype)[..., ::-1]
    if kind == "strided_last":  # every other element: last axis not contiguous
        return randn(rng, (*lead, 2 * last), dtype)[..., ::2]
    if kind == "padded_rows":  # row stride larger than the row
        return randn(rng, (*lead, last + 3), dtype)[..., :last]
    if kind == "every_other_head" and len(shape) >= 3:
        return randn(rng, (*shape[:-3], 2 * shape[-3], *shape[-2:]), dtype)[..., ::2, :, :]
    if kind == "zero_stride_rows":  # every row the same: stride 0 along L or S
        return np.broadcast_to(randn(rng, (*shape[:-2], 1, last), dtype), shape)
    if kind == "zero_stride_heads" and len(shape) >= 3:
        return np.broadcast_to(randn(rng, (*shape[:-3], 1, *shape[-2:]), dtype), shape)
    if kind == "byteswapped":
        return randn(rng, shape, dtype).astype(np.dtype(dtype).newbyteorder("S"))
    if kind == "unaligned":
        return unaligned(randn(rng, shape, dtype))
    if kind == "read_only":
        return read_only(randn(rng, shape, dtype))
    return randn(rng, shape, dtype)  # a layout the rank does not allow


LAYOUTS = [
    "fortran",
    "transposed",
    "reversed_rows",
    "reversed_last",
    "strided_last",
    "padded_rows",
    "every_other_head",
    "zero_stride_rows",
    "zero_stride_heads",
    "byteswapped",
    "unaligned",
    "read_only",
]

# ---- the comparison with the reference ----


def reference_call(q, k, v, **kwargs):
    """reference.sdpa on float64 copies, with npattn.sdpa's keyword arguments."""
    ref_kwargs = {key: f64(val) if key in ("mask", "sinks") else val for key, val in kwargs.items()}
    ref_kwargs.pop("out", None)
    ref_kwargs.pop("threads", None)
    with np.errstate(all="ignore"):
        return reference.sdpa(f64(q), f64(k), f64(v), **ref_kwargs)


def own_tolerance(q, k, v, dtype, **kwargs):
    """(rtol, atol) npattn itself is held to: 4 / 64 ulps for float32 / float64;
    correctly rounded (rtol eps/2, plus the float32 bound) for the half dtypes."""
    bound = {key: kwargs.get(key) for key in ("scale", "mask", "sinks", "softcap")}
    if dtype.name in OWN_ULPS:
        return 0.0, testing.tolerance(q, k, v, dtype=dtype, ulps=OWN_ULPS[dtype.name], **bound)
    f32 = testing.tolerance(q, k, v, dtype=np.float32, ulps=OWN_ULPS["float32"], **bound)
    return testing.EPS[dtype.name] / 2, f32


def check(q, k, v, **kwargs):
    """npattn.sdpa(q, k, v, **kwargs) == the reference on float64 copies, within
    own_tolerance; lse too when asked for. Returns npattn's result."""
    got = npattn.sdpa(q, k, v, **kwargs)
    want = reference_call(q, k, v, **kwargs)
    if kwargs.get("return_lse"):
        (got, got_lse), (want, want_lse) = got, want
    dtype = npattn._args.result_dtype(*(np.asarray(x).dtype for x in (q, k, v)))
    assert type(got) is np.ndarray
    assert got.dtype == dtype, (got.dtype, dtype)
    assert got.shape == want.shape
    rtol, atol = own_tolerance(q, k, v, dtype, **kwargs)
    np.testing.assert_allclose(f64(got), representable(want, dtype), rtol=rtol, atol=atol)
    if kwargs.get("return_lse"):
        assert got_lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
        assert got_lse.shape == want_lse.shape
        want_lse = representable(want_lse, got_lse.dtype)
        np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        # lse is a logit: off by the logit error the output tolerance allows per unit of
        # v, plus the rounding of the log-sum itself, a few ulps of |lse|
        logit_atol = atol / (float(np.abs(f64(v)).max(initial=0.0)) or 1.0)
        ulps = OWN_ULPS["float64" if dtype == np.float64 else "float32"]
        rtol = ulps * testing.EPS["float64" if dtype == np.float64 else "float32"]
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=rtol, atol=logit_atol)
        return got, got_lse
    return got


def representable(want, dtype):
    """The float64 reference with the values that round beyond dtype's range as
    infinities, as a result in dtype must hold them: from the largest finite value
    plus half its ulp on (below that, rounding gives the largest finite value)."""
    dtype = np.dtype(dtype).newbyteorder("=")  # ml_dtypes knows the native bfloat16 only
    info = pytest.importorskip("ml_dtypes").finfo(dtype) if dtype.name == "bfloat16" else np.finfo(dtype)
    big = float(info.max) * (1 + float(info.eps) / 4)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(want) >= big, np.copysign(np.inf, want), want)


def compare_with_nan(got, want, atol, rtol=0.0, infinite_inputs=False):
    """got == want within atol (and rtol) wherever want is finite; NaN exactly where
    want has NaN, and the same infinities. With infinities in the inputs, 0 * inf in
    the weighted sum is NaN or not as the rounding of a vanishing weight falls, so
    there the non-finite entries need only be non-finite in both."""
    got, want = f64(got), f64(want)
    if infinite_inputs:
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    else:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        both = ~np.isnan(want)
        np.testing.assert_array_equal(got[both & np.isinf(want)], want[both & np.isinf(want)])
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


def snapshot(*arrays):
    """A byte-exact copy of each array (NaN payloads and -0.0 included)."""
    return [(a.shape, a.strides, a.tobytes()) for a in arrays]


# ---- the backward pass against the reference ----


def _backward_magnitudes(q, k, v, dout, **kwargs):
    """What each gradient's rounding errors scale with, in float64: every product of
    the backward pass taken in absolute values, with the reference's weights W
    (npattn.reference.sdpa_backward's steps; e_ij a bound on |ds_ij|):

        e_ij  = W_ij (|g_i|.|v_j| + |g_i|.(W|v|)_i)    |dp_ij| + |D_i|
        dq_i ~ |scale| sum_j e_ij |k_j|    dk_j ~ |scale| sum_i e_ij |q_i|
        dv_j ~ sum_i W_ij |g_i|            dsink ~ sum_i p_sink,i |g_i|.(W|v|)_i

    dk and dv summed over the group and broadcast batch dims, as the gradients are."""
    keys = ("scale", "mask", "sinks", "window", "softcap", "q_offset", "k_offset")
    options = {key: f64(val) if key in ("mask", "sinks") else val for key, val in kwargs.items() if key in keys}
    shapes = np.shape(q), np.shape(k), np.shape(v)
    batch = np.shape(dout)[:-3]  # the whole batch, v's dims included

    def whole(x):  # x broadcast along the whole batch
        x = f64(x)
        return x if x.ndim == 2 else np.broadcast_to(x, (*batch, *x.shape[-3:]))

    with np.errstate(all="ignore"):
        W = reference.attention_weights(whole(q), whole(k), **options)
        lse = None
        if "sinks" in options:
            lse = reference.sdpa(whole(q), whole(k), np.zeros((*whole(k).shape[:-1], 1)), return_lse=True, **options)[1]
    q, k, v, g = (np.abs(f64(x)) for x in (q, k, v, dout))
    q, k, v, g, W = (x[None] if x.ndim == 2 else x for x in (q, k, v, g, W))
    H_q, H_kv = q.shape[-3], k.shape[-3]
    n_rep = H_q // max(H_kv, 1)
    k_all, v_all = (np.repeat(x, n_rep, axis=-3) for x in (k, v))
    g_dot_o = (g * (W @ v_all)).sum(axis=-1, keepdims=True)
    e = W * (g @ v_all.swapaxes(-1, -2) + g_dot_o)
    f = abs(q.shape[-1] ** -0.5 if kwargs.get("scale") is None else float(kwargs["scale"]))

    def grouped(full):  # (*B, H_q, S, w) -> (*B, H_kv, S, w), the group summed
        return full.reshape(*full.shape[:-3], H_kv, n_rep, *full.shape[-2:]).sum(axis=-3)

    dk = grouped(f * (e.swapaxes(-1, -2) @ q))
    dv = grouped(W.swapaxes(-1, -2) @ g)
    dsinks = np.zeros(H_q)
    if lse is not None and options["sinks"] is not None:  # the sink's weight exp(sink - lse)
        per_row = np.exp(np.asarray(f64(options["sinks"]))[:, None] - lse) * g_dot_o[..., 0]  # (*B, H_q, L)
        per_head = per_row.sum(axis=-1)
        dsinks = per_head.sum(axis=tuple(range(per_head.ndim - 1)))
    return {
        "dq": reference._unbroadcast(f * (e @ k_all), shapes[0]),
        "dk": reference._unbroadcast(dk, shapes[1]),
        "dv": reference._unbroadcast(dv, shapes[2]),
        "dsinks": dsinks,
    }


def backward_tolerance(q, k, v, dout, dtype, **kwargs):
    """{gradient: (rtol, atol)} for npattn.sdpa_backward against the float64 reference,
    atol an array of the gradient's shape; `dtype` the result's.

    A weight recomputed from the saved lse is off by u = ulps eps (1 + m + log(S+1) +
    sqrt(n)) relative, m the logit bound of npattn.testing.max_logit (log(S+1) bounds
    how far lse exceeds it), n the longest sum (rows, keys, widths); every product of
    the pass then adds ulps of its terms, so each gradient is off by u times its
    magnitude (_backward_magnitudes); the cap's slope is at most 1. A float16 or
    bfloat16 result adds half its ulp to the terms through D_i = dout_i . o_i (the saved
    output is rounded to it). A weight below the computed dtype's smallest normal
    number may be lost (underflow): that adds, per weight, the most one weight moves a
    gradient, times the number of weights summed. A gradient in a narrower dtype than
    the one computed in is correctly rounded to it: rtol eps/2, and half its smallest
    subnormal."""
    computed = "float64" if dtype == np.float64 else "float32"
    q64, k64, v64 = (f64(x) for x in (q, k, v))
    L, S, D, D_v = q64.shape[-2], k64.shape[-2], q64.shape[-1], v64.shape[-1]
    bound = {key: kwargs.get(key) for key in ("scale", "mask", "sinks", "softcap")}
    m = testing.max_logit(q64, k64, **bound)
    n = max(L * (q64.size // max(L * D, 1)), S, D, D_v)
    u = OWN_ULPS[computed] * testing.EPS[computed] * (1 + m + np.log1p(S) + np.sqrt(n))
    via_d = u + (testing.EPS[dtype.name] / 2 if dtype.name != computed else 0.0)
    subnormal = {"float64": 0.0, "float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}
    normal = float(np.finfo(computed).smallest_normal)
    rows = int(np.prod(np.shape(dout)[:-1]))  # every query row of the whole batch
    f = abs(D**-0.5 if kwargs.get("scale") is None else float(kwargs["scale"]))

    def largest(x):
        return float(np.abs(x).max(initial=0.0))

    g_size, v_size = float(np.abs(f64(dout)).sum(axis=-1).max(initial=0.0)), largest(v64)
    per_weight = {  # the most one weight moves each gradient, times the weights summed
        "dq": f * 2 * g_size * v_size * largest(k64) * S,
        "dk": f * 2 * g_size * v_size * largest(q64) * rows,
        "dv": largest(f64(dout)) * rows,
        "dsinks": g_size * v_size * rows,
    }
    per_d = {  # what D_i = dout_i . o_i moves each gradient by, per unit of |o_i|, summed
        "dq": f * g_size * largest(k64),
        "dk": f * g_size * largest(q64) * rows,
        "dv": 0.0,
        "dsinks": g_size * rows,
    }
    tolerances = {}
    mags = _backward_magnitudes(q, k, v, dout, **kwargs)
    for name, operand in (("dq", q), ("dk", k), ("dv", v), ("dsinks", None)):
        own = computed if operand is None else np.asarray(operand).dtype.name
        rtol = testing.EPS[own] / 2 if own != computed else 0.0
        floor = 2 * normal * per_weight[name]  # weights lost to underflow
        floor += subnormal[dtype.name] / 2 * per_d[name]  # an output underflowing in its dtype
        # a sum of subnormal terms rounds each: half an ulp per term summed (keys for dq,
        # rows for dk and dv), times the copies a broadcast operand's gradient adds up
        width = 1 if operand is None else max(np.shape(operand)[-1], 1)
        copies = 1 if operand is None else max(1.0, rows / max(np.size(operand) // width, 1))
        terms = {"dq": S, "dk": rows, "dv": rows, "dsinks": 0}[name]
        floor += subnormal[computed] / 2 * (terms + 1) * copies
        floor += subnormal[own] / 2  # the gradient's own rounding
        tolerances[name] = (rtol, (u if name == "dv" else via_d) * mags[name] + floor)
    return tolerances


def check_backward(q, k, v, dout, **kwargs):
    """npattn.sdpa_backward after npattn.sdpa(..., return_lse=True) == the float64
    reference's gradients within backward_tolerance: shapes and dtypes of the operands,
    dsinks float32 (float64 for float64 results) or None. Returns npattn's Grads."""
    bwd = {key: val for key, val in kwargs.items() if key not in ("return_lse", "out")}
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **bwd)
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, **bwd)
    ref = {key: f64(val) if key in ("mask", "sinks") else val for key, val in bwd.items()}
    ref.pop("threads", None)
    with np.errstate(all="ignore"):
        want = reference.sdpa_backward(f64(dout), f64(q), f64(k), f64(v), None, None, **ref)
    tolerances = backward_tolerance(q, k, v, dout, out.dtype, **kwargs)
    for name, got, operand, expected in zip(grads._fields, grads, (q, k, v), want):
        assert type(got) is np.ndarray, name
        assert got.shape == np.shape(operand) and got.dtype == np.asarray(operand).dtype, (name, got.shape, got.dtype)
        assert_within(got, representable(expected, got.dtype), *tolerances[name], name)
    if kwargs.get("sinks") is None:
        assert grads.dsinks is None
    else:
        assert grads.dsinks.dtype == (np.float64 if out.dtype == np.float64 else np.float32)
        assert_within(grads.dsinks, want[3], *tolerances["dsinks"], "dsinks")
    return grads


def assert_within(got, want, rtol, atol, name):
    """|got - want| <= atol + rtol |want| everywhere, atol a float or an array that
    broadcasts; the message names the worst element."""
    got, want = np.broadcast_arrays(f64(got), f64(want))
    with np.errstate(invalid="ignore"):
        excess = np.abs(got - want) - (atol + rtol * np.abs(want))
    bad = ~((excess <= 0) | (np.isinf(want) & (got == want)))
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf)), got.shape)
        limit = np.broadcast_to(atol + rtol * np.abs(want), got.shape)[worst]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.size} elements beyond tolerance; worst at {worst}: "
            f"{got[worst]!r} vs {want[worst]!r}, allowed {limit:.3g}"
        )


# ---- errors ----


def assert_raises_naming(capfd, fn, exception, argument, substrings=(), function="sdpa"):
    """fn() raises `exception` whose message starts "<function>: ", names `argument`
    as a word and holds each of `substrings`; nothing is printed to stderr."""
    with pytest.raises(exception) as info:
        fn()
    message = str(info.value)
    prefix = f"{function}: "
    assert message.startswith(prefix), message
    assert re.search(rf"\b{argument}\b", message[len(prefix) :]), message
    for text in substrings:
        assert text in message, message
    assert capfd.readouterr().err == ""


# ---- the core's hooks ----


def runnable_kernels():
    """The kernel tables this CPU runs (the first is the best)."""
    names = []
    for name in KERNELS:
        try:
            _core.debug_force_simd(name)
            names.append(name)
        except ValueError:
            pass
        finally:
            _core.debug_force_simd("")
    best = _core.simd()
    return [best] + [n for n in names if n != best]


@contextlib.contextmanager
def kernels(name):
    """Runs the block with the named kernel table (skips the test if this CPU lacks it)."""
    try:
        _core.debug_force_simd(name)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {name} kernels")
    try:
        yield name
    finally:
        _core.debug_force_simd("")


@contextlib.contextmanager
def pool_mode(mode):
    """Runs the block with the pool's test mode: 1 no helper starts, 2 helpers for any work."""
    _core.debug_pool_mode(mode)
    try:
        yield
    finally:
        _core.debug_pool_mode(0)


@contextlib.contextmanager
def failing_allocations(after):
    """Allocations in the core fail after `after` more, within the block."""
    _core.debug_fail_alloc_after(after)
    try:
        yield
    finally:
        _core.debug_fail_alloc_after(-1)


def run_script(script, timeout=180, env=None):
    """Runs a Python script in a fresh interpreter; returns its CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


# ---- the peers: shapes and masks compared over ----

PEER_SHAPES = {  # name: (batch, H_q, H_kv, L, S, D): the course's odd GQA sizes and three models' heads
    "course": ((2,), 18, 6, 3, 7, 5),
    "qwen2-0.5b-prefill": ((1,), 14, 2, 64, 64, 64),
    "qwen2-0.5b-chunked": ((1,), 14, 2, 16, 64, 64),
    "qwen2-0.5b-decode": ((2,), 14, 2, 1, 64, 64),
    "qwen3-4b-prefill": ((1,), 32, 8, 48, 48, 128),
    "qwen3-4b-chunked": ((1,), 32, 8, 8, 40, 128),
    "qwen3-4b-decode": ((1,), 32, 8, 1, 40, 128),
    "gpt2-prefill": ((1,), 12, 12, 64, 64, 64),
    "gpt2-chunked": ((1,), 12, 12, 16, 64, 64),
    "gpt2-decode": ((2,), 12, 12, 1, 64, 64),
}


def peer_visible(rng, H_q, L, S):
    """A random (H_q, L, S) visibility that keeps, in every row, the key the
    bottom-right diagonal reaches, so that no row is empty."""
    visible = rng.random((H_q, L, S)) < 0.6
    visible[:, np.arange(L), np.minimum(np.arange(L) + S - L, S - 1)] = True
    return visible


class ParityStats:
    """How many parity cases ran per dtype, and the largest |npattn - peer|,
    printed after the module."""

    def __init__(self, peer):
        self.peer = peer  # a callable giving the peer's name and version
        self.stats = {}

    def record(self, dtype_name, got, want):
        diff = float(np.abs(f64(got) - f64(want)).max(initial=0.0))
        count, worst = self.stats.get(dtype_name, (0, 0.0))
        self.stats[dtype_name] = (count + 1, max(worst, diff))

    def fixture(self):
        """A module-scoped autouse fixture that prints the figures after the module."""

        @pytest.fixture(scope="module", autouse=True)
        def parity_summary(pytestconfig):
            yield
            reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
            capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
            if reporter is not None and capture is not None and self.stats:
                parts = [f"{d}: {n} cases, max |npattn - peer| {w:.3g}" for d, (n, w) in self.stats.items()]
                with capture.global_and_fixture_disabled():
                    reporter.write_line(f"\nparity vs {self.peer()}: " + "; ".join(parts))

        return parity_summary


# ---- random problems: the property tests and the differential fuzzer ----


def _operand_batch(rng, batch):
    """A batch shape that broadcasts to `batch`: some dims 1, some leading dims dropped."""
    dims = [int(b) if rng.random() < 0.7 else 1 for b in batch]
    return tuple(dims[rng.integers(0, len(dims) + 1) :])


def _values(rng, shape, dtype, kind, specials):
    """Values of `shape` in `dtype`, laid out as `kind`, with NaN or infinities when asked."""
    a = layout(rng, shape, dtype, kind)
    scale = 10.0 ** rng.choice([0, 0, 0, -3, 3]) if dtype != np.float16 else 1.0
    if scale != 1.0 or specials:
        a = np.array(a, dtype=np.dtype(dtype).newbyteorder("="))  # writeable and native
        a *= a.dtype.type(scale)
        for _ in range(specials):
            if a.size:
                a.flat[rng.integers(0, a.size)] = rng.choice([np.nan, np.inf, -np.inf])
    return a


def random_problem(rng, dtypes=("float32", "float64", "float16", "bfloat16"), specials=False, large=False):
    """(q, k, v, kwargs) for one random problem of npattn.sdpa's whole contract:
    ranks 2 to 6 with broadcast batch dims, GQA groups, empty sizes, every layout
    of helpers.LAYOUTS, float dtypes (mixed now and then), every mask kind and
    broadcast shape, sinks, scale (extremes included), window, softcap,
    positions, return_lse and threads. `specials`: NaN and infinities in q, k, v,
    and every key visible. `large`: now and then model-sized decode and prefill."""
    names = [n for n in dtypes if n != "bfloat16" or _has_ml_dtypes()]
    dtype = np.dtype(dtype_of(rng.choice(names)))
    mixed = rng.random() < 0.15
    batch = tuple(int(b) for b in rng.integers(0, 4, size=rng.integers(0, 3)))
    H_kv = int(rng.integers(1, 4))
    H_q = H_kv * int(rng.integers(0, 4))
    L, S = int(rng.integers(0, 12)), int(rng.integers(0, 12))
    D, D_v = int(rng.integers(1, 12)), int(rng.integers(0, 9))
    if large and rng.random() < 0.2:
        H_kv, H_q = 2, 14
        L, S = (1, int(rng.integers(100, 3000))) if rng.random() < 0.5 else (int(rng.integers(30, 150)),) * 2
        D = D_v = int(rng.choice([64, 128]))
    shapes = {
        "q": (*_operand_batch(rng, batch), H_q, L, D),
        "k": (*_operand_batch(rng, batch), H_kv, S, D),
        "v": (*_operand_batch(rng, batch), H_kv, S, D_v),
    }
    if not batch and H_q == H_kv == 1 and rng.random() < 0.3:
        shapes = {name: shape[-2:] for name, shape in shapes.items()}  # the rank-2 form
    arrays = []
    for name in "qkv":
        dt = np.dtype(dtype_of(rng.choice(names))) if mixed else dtype
        kind = rng.choice(["contiguous", "contiguous", *LAYOUTS])
        arrays.append(_values(rng, shapes[name], dt, kind, int(rng.integers(1, 3)) if specials else 0))
    q, k, v = arrays

    kwargs = {}
    kind = None if specials else rng.choice(["causal", "causal_top_left", None, "bool", "additive", "default"])
    if kind in ("bool", "additive"):
        full = np.broadcast_shapes(shapes["q"][:-3], shapes["k"][:-3], shapes["v"][:-3]) + (H_q, L, S)
        shape = [n if rng.random() < 0.6 else 1 for n in full]
        shape = tuple(shape[rng.integers(0, len(shape)) :])  # an array, never a scalar
        mask_dtype = dtype_of(rng.choice(names + ["float64"]))
        kwargs["mask"] = make_mask(rng, kind, shape, mask_dtype)
        if rng.random() < 0.3 and len(shape) >= 2:
            kwargs["mask"] = kwargs["mask"].swapaxes(-1, -2).copy().swapaxes(-1, -2)  # Fortran-like strides
    elif kind != "default":
        kwargs["mask"] = kind
    if rng.random() < 0.3:
        kwargs["sinks"] = rng.uniform(-4, 4, H_q).astype(rng.choice([np.float32, np.float64]))
    r = rng.random()
    if r < 0.3:
        kwargs["scale"] = float(rng.uniform(-3, 3))
    elif r < 0.35:
        kwargs["scale"] = float(rng.choice([0.0, 1e-40, -1e-30, 1e30, 3e38, 1e-300]))
    if rng.random() < 0.3:
        left, right = (None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
        kwargs["window"] = (left, right)
    if rng.random() < 0.2:
        kwargs["softcap"] = float(rng.choice([0.5, 5.0, 30.0, 1e6]))
    if rng.random() < 0.3 and not (isinstance(kwargs.get("mask"), str) and kwargs["mask"] == "causal_top_left"):
        kwargs["q_offset"] = int(rng.integers(-20, 20)) if rng.random() < 0.9 else int(rng.choice([-(2**62), 2**62]))
    if rng.random() < 0.2:
        kwargs["k_offset"] = int(rng.integers(-20, 20))
    kwargs["return_lse"] = bool(rng.random() < 0.3)
    kwargs["threads"] = int(rng.integers(1, 5))
    return q, k, v, kwargs


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def assert_parity(got, want, q, k, v, mask=None, sinks=None, stats=None, dtype_name=None):
    """npattn's result `got` and a peer's `want` on the same inputs (any library):
    npattn == reference within own_tolerance, the peer == reference within
    npattn.testing.tolerance (a peer's float32 8 ulps, its half dtypes 2 ulps plus the
    float32 bound), hence npattn == peer within the sum. The course's small float32
    shapes use the issue's rtol 1e-5 / atol 1e-6 for both."""
    q, k, v = (npattn._interop.asarray(x) for x in (q, k, v))
    mask = mask if mask is None or isinstance(mask, str) else npattn._interop.asarray(mask)
    sinks = None if sinks is None else npattn._interop.asarray(sinks)
    got64, want64 = f64(got), f64(npattn._interop.asarray(want))
    ref = reference_call(q, k, v, mask=mask, sinks=sinks)
    dtype = np.dtype(got.dtype)
    if dtype == np.float32 and q.shape[-1] <= 8:
        (rtol_n, atol_n), (rtol_p, atol_p) = (1e-5, 1e-6), (1e-5, 1e-6)
    else:
        rtol_n, atol_n = own_tolerance(q, k, v, dtype, mask=mask, sinks=sinks)
        rtol_p, atol_p = 0.0, testing.tolerance(q, k, v, mask=f64(mask), sinks=sinks, dtype=dtype)
    np.testing.assert_allclose(got64, ref, rtol=rtol_n, atol=atol_n, err_msg="npattn vs reference")
    np.testing.assert_allclose(want64, ref, rtol=rtol_p, atol=atol_p, err_msg="peer vs reference")
    np.testing.assert_allclose(got64, want64, rtol=rtol_n + rtol_p, atol=atol_n + atol_p, err_msg="npattn vs peer")
    if stats is not None:
        stats.record(dtype_name or dtype.name, got64, want64)


def assert_gradient_parity(mine, peer, q, k, v, dout, mask=None, sinks=None):
    """Gradients (dq, dk, dv[, dsinks]) of npattn's adapter (`mine`) and of a peer
    (`peer`), any library, for sum(dout * sdpa(q, k, v, mask=mask, sinks=sinks)):
    npattn's against the float64 reference within backward_tolerance; the peer's
    within a peer's bound, twice that (a peer's float32 is allowed 8 ulps to
    npattn's 4) plus, for float16 and bfloat16, backward_tolerance's relative
    error u with 2 ulps of the half dtype in place of npattn's 4 of float32, times
    the gradient's magnitude (a peer rounds its scores, weights and products to
    the half dtype, as the forward's peer bound allows); the two within the sum."""
    q, k, v, dout = (npattn._interop.asarray(x) for x in (q, k, v, dout))
    mask = mask if mask is None or isinstance(mask, str) else npattn._interop.asarray(mask)
    sinks = None if sinks is None else npattn._interop.asarray(sinks)
    with np.errstate(all="ignore"):
        want = reference.sdpa_backward(f64(dout), f64(q), f64(k), f64(v), None, None, mask=f64(mask), sinks=f64(sinks))
    dtype = npattn._args.result_dtype(q.dtype, k.dtype, v.dtype)
    own = backward_tolerance(q, k, v, dout, dtype, mask=mask, sinks=sinks)
    magnitude = _backward_magnitudes(q, k, v, dout, mask=mask, sinks=sinks)
    L, S = q.shape[-2], k.shape[-2]
    n = max(L * (q.size // max(L * q.shape[-1], 1)), S, q.shape[-1], v.shape[-1])
    m = testing.max_logit(f64(q), f64(k), mask=f64(mask), sinks=f64(sinks))
    spread = 1 + m + np.log1p(S) + np.sqrt(n)  # backward_tolerance's factor on the ulps
    names = ("dq", "dk", "dv") + (("dsinks",) if sinks is not None else ())
    for name, got, theirs, expected in zip(names, mine, peer, want):
        got, theirs = npattn._interop.asarray(got), npattn._interop.asarray(theirs)
        assert got.shape == theirs.shape and got.dtype == theirs.dtype, (name, got.shape, theirs.shape)
        expected = representable(expected, got.dtype)
        rtol, atol = own[name]
        half = got.dtype.name in ("float16", "bfloat16")
        peer_atol = 2 * atol + (2 * testing.EPS[got.dtype.name] * spread * magnitude[name] if half else 0.0)
        assert_within(got, expected, rtol, atol, f"npattn {name} vs reference")
        assert_within(theirs, expected, rtol, peer_atol, f"peer {name} vs reference")
        assert_within(got, theirs, 2 * rtol, atol + peer_atol, f"npattn {name} vs peer")

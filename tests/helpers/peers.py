"""The peers (PyTorch, MLX): the shapes and masks compared over, the parity check, and
the figures reported after each module."""

import numpy as np
import pytest

import npattn
from npattn import reference, testing

from .compare import assert_within, backward_tolerance, own_tolerance, reference_call, representable
from .inputs import f64

PEER_PHASES = {  # id: (model, (batch, L, S) of prefill, chunked prefill and decode), sized for a fast test
    "qwen2-0.5b": ("Qwen2-0.5B", (((1,), 64, 64), ((1,), 16, 64), ((2,), 1, 64))),
    "qwen3-4b": ("Qwen3-4B", (((1,), 48, 48), ((1,), 8, 40), ((1,), 1, 40))),
    "gpt2": ("GPT-2", (((1,), 64, 64), ((1,), 16, 64), ((2,), 1, 64))),
}


def _peer_shape(model, batch, L, S):
    H_q, H_kv, D = testing.MODEL_HEADS[model]
    return (batch, H_q, H_kv, L, S, D)


# id: (batch, H_q, H_kv, L, S, D): the course's odd GQA sizes and three models' heads
# (npattn.testing.MODEL_HEADS) in prefill, chunked prefill and decode
PEER_SHAPES = {"course": _peer_shape("course", (2,), 3, 7)}
PEER_SHAPES.update(
    {
        f"{name}-{phase}": _peer_shape(model, *shape)
        for name, (model, shapes) in PEER_PHASES.items()
        for phase, shape in zip(("prefill", "chunked", "decode"), shapes)
    }
)


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

    def summary(self):
        """One line of the figures; conftest.py prints it after a module holding STATS."""
        parts = [f"{d}: {n} cases, max |npattn - peer| {w:.3g}" for d, (n, w) in self.stats.items()]
        return f"parity vs {self.peer()}: " + "; ".join(parts)

    def fixture(self):
        """A fixture that does nothing: the printing lives in conftest.py (a module's
        STATS is found there). Kept for the modules that still assign it."""

        @pytest.fixture(scope="module")
        def parity_summary():
            yield

        return parity_summary


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
    magnitude = testing._backward_magnitudes(q, k, v, dout, reference._Options(mask=f64(mask), sinks=f64(sinks)))
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

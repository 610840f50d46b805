"""The peers (PyTorch, MLX): the shapes and masks compared over, the parity check, and
the figures reported after each module."""

import numpy as np
import pytest

import npattn
from npattn import testing

from .compare import own_tolerance, reference_call
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

"""The core's test hooks: kernel tables, the pool's modes, failing allocations; and
scripts in a fresh interpreter."""

import contextlib
import signal
import subprocess
import sys
import time

import pytest

from npattn import _core

KERNELS = ["portable", "avx2", "avx512", "avx512bf16", "amx", "neon", "neonbf16"]


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


#: What a script in a fresh interpreter prepends to size a long call by measurement:
#: ``lasting(seconds, q, k, v, **kwargs)`` gives q, k and v with a leading batch of
#: zero-stride copies, as many as make ``npattn.sdpa(q, k, v, **kwargs)`` last about
#: `seconds` on this CPU, timed on one copy (the copies cost no memory; the result,
#: one slice of it per copy, does: keep ``D_v`` small). So a call outlasts a signal
#: sent into it on any CPU, however fast.
LASTING = r"""
def lasting(seconds, q, k, v, **kwargs):
    import math, time
    import numpy as np
    import npattn
    npattn.sdpa(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))  # the first call's setup, untimed
    t0 = time.monotonic()
    npattn.sdpa(q, k, v, **kwargs)
    n = max(1, math.ceil(seconds / max(time.monotonic() - t0, 1e-4)))
    return tuple(np.broadcast_to(x, (n, *x.shape)) for x in (q, k, v))
"""


def run_script(script, timeout=180, env=None):
    """Runs a Python script in a fresh interpreter; returns its CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def assert_sigint_stops(script, after, within=0.5):
    """Runs `script` in a fresh interpreter and sends it SIGINT `after` seconds past
    its "start" line; the script prints "interrupted" (or "finished") with
    time.monotonic(), then "second" and whether a later call computed right. The
    KeyboardInterrupt must come within `within` seconds, the second call must be
    right, and nothing may reach stderr. The script finds `AFTER` (the delay) and
    `lasting` (LASTING) defined, to size its call by measurement to outlast it."""
    script = f"AFTER = {after!r}\n{LASTING}\n{script}"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start = proc.stdout.readline().split()
        assert start and start[0] == "start", start + [proc.stderr.read()]
        time.sleep(after)
        sent = time.monotonic()  # CLOCK_MONOTONIC: the same clock in both processes
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert "finished" not in lines, "the long call ended before the signal: make it longer"
    assert "interrupted" in lines, (out, err)
    delay = float(lines["interrupted"]) - sent
    assert delay < within, f"KeyboardInterrupt came {delay:.3f} s after SIGINT"
    assert lines.get("second") == "True", (out, err)
    assert proc.returncode == 0
    assert err == ""

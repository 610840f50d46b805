"""Calling sdpa from the real world: Ctrl-C, many Python threads, the GIL.

- SIGINT stops a long call within half a second, and the process goes on working.
- Python threads calling at once get exactly what serial calls get.
- The GIL is released while computing.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import npattn
import numpy as np
import pytest

INTERRUPTED_CALL = r"""
import time
import numpy as np
import npattn
from npattn import reference

rng = np.random.default_rng(0)
# float32, Qwen3-4B heads, L = S = 4096, no mask, 2 threads: several seconds of work.
q = rng.standard_normal((2, 32, 4096, 128), dtype=np.float32)
k = rng.standard_normal((2, 8, 4096, 128), dtype=np.float32)
v = rng.standard_normal((2, 8, 4096, 128), dtype=np.float32)
print("start", time.monotonic(), flush=True)
try:
    npattn.sdpa(q, k, v, mask=None, threads=2)
    print("finished", time.monotonic(), flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)

# The same process still computes correctly afterwards.
q, k, v = (rng.standard_normal(s) for s in [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)])
ok = np.allclose(npattn.sdpa(q, k, v), reference.sdpa(q, k, v), rtol=0, atol=1e-12)
print("second", ok, flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT to a subprocess")
def test_sigint_stops_a_long_call_within_half_a_second():
    """SIGINT during a long call raises KeyboardInterrupt within 0.5 s; a second call then works."""
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_CALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        start = proc.stdout.readline().split()
        assert start and start[0] == "start", start + [proc.stderr.read()]
        time.sleep(1.0)  # well inside the call
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
    assert delay < 0.5, f"KeyboardInterrupt came {delay:.3f} s after SIGINT"
    assert lines.get("second") == "True", (out, err)
    assert proc.returncode == 0
    assert err == ""


def test_concurrent_python_threads_equal_serial_calls():
    """8 Python threads calling sdpa at once get results bitwise equal to serial calls."""
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(8):
        dtype = np.float32 if i % 2 else np.float64
        L, S = (1, 900) if i % 4 == 3 else (40 + 7 * i, 120 + 11 * i)  # decode and prefill mixed
        q = rng.standard_normal((2, 8, L, 32)).astype(dtype)
        k = rng.standard_normal((2, 2, S, 32)).astype(dtype)
        v = rng.standard_normal((2, 2, S, 24)).astype(dtype)
        kwargs = {"threads": 1 + i % 3, "mask": ["causal", None, "causal_top_left"][i % 3]}
        if i == 5:
            kwargs["sinks"] = np.linspace(-1, 1, 8)
        jobs.append((q, k, v, kwargs))
    serial = [npattn.sdpa(q, k, v, **kwargs) for q, k, v, kwargs in jobs]

    barrier = threading.Barrier(len(jobs))

    def run(job):
        q, k, v, kwargs = job
        barrier.wait()  # all 8 calls start together
        return npattn.sdpa(q, k, v, **kwargs)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for _ in range(3):
            results = list(pool.map(run, jobs, timeout=120))  # re-raises a thread's exception
            for got, want in zip(results, serial, strict=True):
                np.testing.assert_array_equal(got, want)


def test_gil_is_released_while_computing():
    """While one thread runs a ~1 s sdpa call, the main Python thread keeps running."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 32, 2048, 128), dtype=np.float32)
    k = rng.standard_normal((1, 8, 2048, 128), dtype=np.float32)
    v = rng.standard_normal((1, 8, 2048, 128), dtype=np.float32)
    done = threading.Event()
    timing = {}

    def work():
        t0 = time.monotonic()
        npattn.sdpa(q, k, v, mask=None, threads=1)
        timing["call"] = time.monotonic() - t0
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    longest_gap, last = 0.0, time.monotonic()
    while not done.is_set():
        now = time.monotonic()
        longest_gap, last = max(longest_gap, now - last), now
        time.sleep(0.001)
    worker.join()
    # Holding the GIL would freeze this loop for the whole call; the interpreter's
    # switch interval is 5 ms, so 0.2 s leaves room for a busy machine.
    assert timing["call"] > 0.4, "the call is too short to show anything"
    assert longest_gap < 0.2, f"main thread stalled {longest_gap:.3f} s during a {timing['call']:.2f} s call"

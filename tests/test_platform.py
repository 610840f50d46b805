"""SPEC section 9, what can be checked on this machine: threadpoolctl controls
npattn's pool whichever is imported first; the loader holds OpenBLAS to NEON
kernels only on an ARM CPU with SME and leaves OPENBLAS_CORETYPE as it found
it; the BLAS passed npattn's check."""

import os
import platform

import pytest

import npattn
from helpers import kernels, run_script, runnable_kernels
from npattn import _loader

THREADPOOL = """
import json
{first}
{second}
from threadpoolctl import threadpool_info, threadpool_limits
ours = [i for i in threadpool_info() if i["user_api"] == "npattn"]
with threadpool_limits(1):
    inside = npattn._core.get_num_threads()
with threadpool_limits(limits=1, user_api="blas"):
    blas_only = npattn._core.get_num_threads()
print(json.dumps({{"ours": ours, "inside": inside, "after": npattn._core.get_num_threads(), "blas_only": blas_only}}))
"""


@pytest.mark.parametrize("order", ["npattn first", "threadpoolctl first"])
def test_threadpoolctl_limits_npattn(order):
    """threadpool_info() lists npattn's pool (its version, its default thread count);
    threadpool_limits(1) caps it, and lifts the cap on leaving; a limit on the BLAS
    alone leaves it be."""
    pytest.importorskip("threadpoolctl")
    imports = ["import npattn", "import threadpoolctl"]
    first, second = imports if order == "npattn first" else imports[::-1]
    result = run_script(THREADPOOL.format(first=first, second=second))
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(result.stdout)
    assert len(seen["ours"]) == 1, seen
    assert seen["ours"][0]["version"] == npattn.__version__
    assert seen["ours"][0]["filepath"] == npattn._core.__file__
    default = npattn._core.get_num_threads()
    assert seen["ours"][0]["num_threads"] == default
    assert seen["inside"] == 1
    assert seen["after"] == default
    assert seen["blas_only"] == default


@pytest.mark.skipif(platform.machine().lower() in ("arm64", "aarch64"), reason="an ARM CPU may have SME")
def test_no_sme_off_arm():
    assert _loader.has_sme() is False


@pytest.mark.skipif("OPENBLAS_CORETYPE" in os.environ, reason="the variable is set here; it is left alone")
def test_loader_pins_the_core_only_while_loading(monkeypatch):
    """With SME (simulated), load_core sets OPENBLAS_CORETYPE while the extension
    loads and removes it after; the module returned is npattn's extension."""
    seen = []
    monkeypatch.setattr(_loader, "has_sme", lambda: True)
    real_import = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__

    def watching(name, *args, **kwargs):
        seen.append(os.environ.get("OPENBLAS_CORETYPE"))
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", watching)
    assert _loader.load_core() is npattn._core
    monkeypatch.undo()
    assert _loader.PINNED_CORE in seen
    assert "OPENBLAS_CORETYPE" not in os.environ


@pytest.mark.skipif("OPENBLAS_CORETYPE" not in os.environ, reason="needs OPENBLAS_CORETYPE set by the machine")
def test_loader_leaves_a_set_coretype_alone(monkeypatch):
    before = os.environ["OPENBLAS_CORETYPE"]
    monkeypatch.setattr(_loader, "has_sme", lambda: True)
    assert _loader.load_core() is npattn._core
    assert os.environ["OPENBLAS_CORETYPE"] == before


def test_the_blas_passed_npattn_s_check():
    """Importing npattn ran the check (an ImportError otherwise): a call computes."""
    import numpy as np

    q = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(npattn.sdpa(q, q, q), q)


@pytest.mark.parametrize("name", runnable_kernels())
def test_fma_peak_runs_on_every_kernel_table(name):
    """The benchmarks' FMA ceiling: a rate on each kernel table this CPU runs, and a
    named error for a bad duration."""
    with kernels(name):
        rate = npattn._core.fma_peak(0.02)
    assert 0.01 < rate < 1e5, rate
    with pytest.raises(ValueError, match="seconds"):
        npattn._core.fma_peak(0.0)


@pytest.mark.parametrize("name", runnable_kernels())
def test_bfloat16_ceilings_where_the_table_has_them(name):
    """The benchmarks' bfloat16 ceilings: vdpbf16ps's on the tables with
    bfloat16 dot products in registers, the AMX tiles' on amx alone, 0 elsewhere;
    each names its function on a bad duration."""
    with kernels(name):
        bf16, tile = npattn._core.bf16_peak(0.02), npattn._core.tile_peak(0.02)
    if name in ("avx512bf16", "amx"):
        assert 0.01 < bf16 < 1e6, bf16
    else:
        assert bf16 == 0.0
    if name == "amx":
        assert 0.01 < tile < 1e7, tile
    else:
        assert tile == 0.0
    for fn in ("bf16_peak", "tile_peak"):
        with pytest.raises(ValueError, match=f"{fn}: seconds"):
            getattr(npattn._core, fn)(61.0)

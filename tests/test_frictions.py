"""Small frictions a new user met, each closed: `import npattn.dask` without Dask names
the extra, and `import npattn.mlx` or `npattn.torch` without its peer names the
package (both run where the peer is not installed); `python -m npattn --help` is
plain text; its checks check the log-sum-exp (a wrong lse fails them); sdpa's
docstring says what becomes of a tensor that requires grad and how threads are
limited, publicly."""

import importlib
import sys

import numpy as np
import pytest

import npattn
from helpers import run_script
from npattn import __main__ as main_module


def test_npattn_dask_without_dask_names_the_extra(monkeypatch):
    """With dask not importable, `import npattn.dask` is an ImportError that says
    pip install "npattn[dask]" (0.2: a bare ModuleNotFoundError for dask)."""
    monkeypatch.delitem(sys.modules, "npattn.dask", raising=False)
    for name in [m for m in sys.modules if m == "dask" or m.startswith("dask.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "dask", None)  # what `import dask` finds: nothing
    try:
        importlib.import_module("npattn.dask")
    except ImportError as e:
        assert 'pip install "npattn[dask]"' in str(e), str(e)
    else:
        raise AssertionError("npattn.dask imported without dask")
    finally:
        sys.modules.pop("npattn.dask", None)  # the failed import leaves nothing behind


@pytest.mark.parametrize(
    "adapter, blocked, says",
    [
        ("mlx", ("mlx", "mlx.core"), "ModuleNotFoundError mlx npattn.mlx needs MLX (the package 'mlx')"),
        ("torch", ("torch",), "ModuleNotFoundError torch npattn.torch needs PyTorch (the package 'torch')"),
    ],
    ids=["mlx", "torch"],
)
def test_an_adapter_without_its_peer_names_it(adapter, blocked, says):
    """import npattn.mlx or npattn.torch where its peer cannot be imported: a
    ModuleNotFoundError (an ImportError) naming the package, as a missing optional
    extra's import is (the README's examples skip on it)."""
    script = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    script += f"try:\n    import npattn.{adapter}\nexcept ImportError as e:\n    print(type(e).__name__, e.name, e)\n"
    result = run_script(script)
    assert result.returncode == 0, result.stderr
    assert says in result.stdout


def test_main_help_is_plain_text(capsys):
    """`python -m npattn --help` shows no reStructuredText double backticks."""
    try:
        main_module.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    text = capsys.readouterr().out
    assert "python -m npattn: check this build" in text
    assert "``" not in text


def test_main_checks_fail_on_a_wrong_lse(monkeypatch, capsys):
    """The checks compare return_lse's lse with the reference's: an lse off by 1e-3 fails
    them, the result itself being right."""
    assert main_module.run_checks()
    capsys.readouterr()
    sdpa = npattn.sdpa

    def wrong_lse(*args, **kwargs):
        result = sdpa(*args, **kwargs)
        return (result[0], np.asarray(result[1]) + 1e-3) if kwargs.get("return_lse") else result

    monkeypatch.setattr(npattn, "sdpa", wrong_lse)
    assert not main_module.run_checks()
    failing = [line for line in capsys.readouterr().out.splitlines() if line.endswith("FAIL")]
    assert failing and all(line.lstrip().startswith("lse") for line in failing), failing


def test_best_ms_times_each_function_interleaved():
    """best_ms calls its functions in turn, round after round, and gives one time each."""
    calls = []
    times = main_module.best_ms([lambda: calls.append("a"), lambda: calls.append("b")], rounds=6)
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert calls == ["a", "b"] * 7  # a warm-up each, then 6 rounds of both


def test_sdpa_docstring_says_what_requires_grad_and_threads_become():
    """sdpa's docstring: a tensor that requires grad is read detached (npattn.torch gives
    autograd); threads are limited through threadpoolctl, not a private function."""
    doc = " ".join(npattn.sdpa.__doc__.split())
    assert "requires grad is read detached" in doc and "npattn.torch" in doc
    assert "threadpool_limits" in doc
    assert "_core" not in doc

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
from npattn import _interop


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


@pytest.mark.parametrize(
    "library, dtype_name, kind",
    [
        ("numpy", "float32", "float"),
        ("numpy", "bool", "bool"),
        ("mlx.core", "float32", "float"),
        ("mlx.core", "bfloat16", "float"),
        ("mlx.core", "bool_", "bool"),
        ("torch", "float16", "float"),
        ("torch", "bfloat16", "float"),
        ("torch", "bool", "bool"),
    ],
)
def test_causal_mask_comes_in_the_library_of_its_dtype(library, dtype_name, kind):
    """npattn.causal_mask(3, 7, mx.float32) is an mx.array of float32 (0.3: a NumPy
    array), a torch dtype gives a torch.Tensor; its values are the NumPy mask's."""
    lib = pytest.importorskip(library)
    dtype = getattr(lib, dtype_name)
    mask = npattn.causal_mask(3, 7, dtype)
    array_type = {"numpy": np.ndarray, "mlx.core": getattr(lib, "array", None), "torch": getattr(lib, "Tensor", None)}
    assert isinstance(mask, array_type[library]), type(mask)
    assert mask.dtype == (np.dtype(dtype) if library == "numpy" else dtype), mask.dtype
    assert tuple(mask.shape) == (3, 7)
    want = npattn.reference.causal_mask(3, 7, bool if kind == "bool" else np.float32)
    got = np.asarray(_interop.asarray(mask), dtype=want.dtype)
    np.testing.assert_array_equal(got, want)


def test_sdpa_backward_without_lse_points_to_return_lse():
    """sdpa_backward called without lse (or with None, or with sdpa's (out, lse) pair as
    out) is a TypeError that says lse comes from sdpa(..., return_lse=True) (0.3:
    Python's bare "missing 1 required positional argument: 'lse'")."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4), dtype=np.float32) for _ in range(3))
    out = npattn.sdpa(q, k, v)
    dout = np.ones_like(out)
    for call in (
        lambda: npattn.sdpa_backward(dout, q, k, v, out),
        lambda: npattn.sdpa_backward(dout, q, k, v, out, None),
    ):
        with pytest.raises(TypeError, match=r"^sdpa_backward: lse is missing: .*return_lse=True") as info:
            call()
        assert "pair" not in str(info.value)
    pair = npattn.sdpa(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match=r"return_lse=True.*out here is that pair.*\*result"):
        npattn.sdpa_backward(dout, q, k, v, pair)


@pytest.mark.parametrize("fn", ["sdpa", "paged_attention", "sdpa_backward", "attention_weights", "merge"])
def test_signatures_name_the_type_aliases(fn):
    """help() shows each signature with its aliases named (mask: MaskLike), never their
    expansion (0.3: sdpa's was about 900 characters of Sequence[Sequence[...]])."""
    import inspect
    import pydoc

    f = getattr(npattn, fn)
    signature = str(inspect.signature(f))
    for expanded in ("Sequence[Sequence[", "Literal[", "_SupportsArray", "Union["):
        assert expanded not in signature, signature
    if "mask" in signature:
        assert "mask: 'MaskLike'" in signature or "mask: 'PagedMask'" in signature, signature
    first = pydoc.render_doc(f, renderer=pydoc.plaintext).splitlines()[2]  # the signature line, as help() prints it
    assert len(first) < 640, (len(first), first)  # 0.4 adds the four scale and zero arguments

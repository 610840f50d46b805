"""The Python examples of the README and of the documentation's pages run, each
block on its own in a fresh namespace, as a reader would paste it. A block that
imports an optional extra not installed here is skipped. The pages of docs/ are
not in the sdist; where they are absent only the README's blocks run."""

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
EXTRAS = ("dask", "distributed", "mlx", "torch", "transformers")


def blocks(path):
    """(first line number, source) of each ```python block of a Markdown file."""
    text = path.read_text()
    return [
        (text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    ]


EXAMPLES = [
    pytest.param(path, line, source, id=f"{path.relative_to(ROOT)}:{line}")
    for path in PAGES
    if path.exists() and "notebooks" not in path.relative_to(ROOT).parts
    for line, source in blocks(path)
]


def test_the_readme_has_examples():
    assert len(blocks(README)) >= 2  # the quickstart, the check


@pytest.mark.parametrize(("path", "line", "source"), EXAMPLES)
def test_example_runs_alone(path, line, source):
    """Each block imports what it uses: none relies on an earlier one."""
    code = compile("\n" * (line - 1) + source, str(path), "exec")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, {"__name__": "__example__"})
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in EXTRAS:
            pytest.skip(f"needs {e.name}, an optional extra not installed here")
        raise


def test_the_test_extra_brings_every_dtype_npattn_promises():
    """The README's test command, pip install ".[test]" && pytest, tests bfloat16: the
    test extra lists ml_dtypes, which the bfloat16 tests need (0.3 left it out, and
    the command skipped 425 of them)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("the installed package's tests: no pyproject.toml beside them")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert "ml_dtypes" in (re.split(r"[\s<>=\[;]", name)[0] for name in extras["test"])
    assert 'pip install ".[test]" && pytest' in README.read_text().splitlines()

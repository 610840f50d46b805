"""The README's Python examples run, in order, in one namespace, as a reader
would paste them (a block whose imports are not installed is skipped)."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_examples():
    assert len(blocks()) >= 5


def test_readme_examples_run():
    namespace, ran = {}, 0
    for block in blocks():
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block, str(README), "exec"), namespace)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ("dask", "distributed", "mlx", "torch"):
                continue  # an optional extra, not installed here
            raise
        ran += 1
    assert ran >= 5
    if not ran == len(blocks()):
        pytest.skip(f"{len(blocks()) - ran} block(s) need an extra that is not installed")

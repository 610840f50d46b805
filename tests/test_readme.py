"""The README's Python examples run, in order, in one namespace, as a reader
would paste them (a block whose imports are not installed is skipped)."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_examples():
    assert len(blocks()) >= 5


def test_readme_examples_run():
    """Every block runs, except one that imports an optional extra not installed here."""
    namespace, ran, needs_extra = {}, 0, 0
    for block in blocks():
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block, str(README), "exec"), namespace)
        except ModuleNotFoundError as e:
            if not (e.name and e.name.split(".")[0] in ("dask", "distributed", "mlx", "torch")):
                raise
            needs_extra += 1
            continue
        ran += 1
    assert ran + needs_extra == len(blocks())
    assert ran >= 4  # the quickstart, the check, positions and merge, the training loop

"""The examples of the public docstrings run and print what they say (doctest), as
``help(npattn.sdpa)`` shows them to a user."""

import doctest
import importlib

import pytest

MODULES = [
    "npattn._api",
    "npattn._quant",
    "npattn.reference",
    "npattn.testing",
    "npattn.dask",
    "npattn.torch",
    "npattn.mlx",
    "npattn.transformers",
    "npattn.tinyllm",
]
OPTIONAL = {
    "npattn.dask": "dask",
    "npattn.torch": "torch",
    "npattn.mlx": "mlx",
    "npattn.transformers": "transformers",
    "npattn.tinyllm": "mlx",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"

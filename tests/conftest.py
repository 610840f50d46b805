"""Fixtures; everything else the tests share is in tests/helpers.py."""

import numpy as np
import pytest

import helpers


@pytest.fixture(scope="session")
def check():
    """The comparison with the reference: check(q, k, v, **kwargs) (helpers.check)."""
    return helpers.check


@pytest.fixture
def rng():
    """A fixed-seed generator, fresh for every test."""
    return np.random.default_rng(20241129)

"""Fixtures and pytest hooks; everything else the tests share is the package tests/helpers."""

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


@pytest.fixture(scope="module", autouse=True)
def parity_report(request, pytestconfig):
    """After a module that keeps a helpers.ParityStats as STATS (the peers' tests), prints
    how many cases ran per dtype and the largest |npattn - peer|."""
    yield
    stats = getattr(request.module, "STATS", None)
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if isinstance(stats, helpers.ParityStats) and stats.stats and reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n" + stats.summary())

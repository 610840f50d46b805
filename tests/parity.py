"""What test_vs_torch.py and test_vs_mlx.py share: the shapes and masks they
compare over, and the count of cases and largest difference they report."""

import pytest

SHAPES = {  # name: (batch, H_q, H_kv, L, S, D): the course's odd GQA sizes and three models' heads
    "course": ((2,), 18, 6, 3, 7, 5),
    "qwen2-0.5b-prefill": ((1,), 14, 2, 64, 64, 64),
    "qwen2-0.5b-chunked": ((1,), 14, 2, 16, 64, 64),
    "qwen2-0.5b-decode": ((2,), 14, 2, 1, 64, 64),
    "qwen3-4b-prefill": ((1,), 32, 8, 48, 48, 128),
    "qwen3-4b-chunked": ((1,), 32, 8, 8, 40, 128),
    "qwen3-4b-decode": ((1,), 32, 8, 1, 40, 128),
    "gpt2-prefill": ((1,), 12, 12, 64, 64, 64),
    "gpt2-chunked": ((1,), 12, 12, 16, 64, 64),
    "gpt2-decode": ((2,), 12, 12, 1, 64, 64),
}
MASKS = ["causal", "causal_top_left", None, "bool", "additive"]


class ParityStats:
    """How many parity cases ran per dtype, and the largest |npattn - peer|."""

    def __init__(self, peer):
        self.peer = peer  # a callable giving the peer's name and version, for the report
        self.stats = {}

    def record(self, dtype_name, diff):
        count, worst = self.stats.get(dtype_name, (0, 0.0))
        self.stats[dtype_name] = (count + 1, max(worst, diff))

    def fixture(self):
        """A module-scoped autouse fixture that prints the figures after the module."""

        @pytest.fixture(scope="module", autouse=True)
        def parity_summary(pytestconfig):
            yield
            reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
            capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
            if reporter is not None and capture is not None and self.stats:
                name = self.peer()
                parts = [f"{d}: {n} cases, max |npattn - peer| {w:.3g}" for d, (n, w) in self.stats.items()]
                with capture.global_and_fixture_disabled():
                    reporter.write_line(f"\nparity vs {name}: " + "; ".join(parts))

        return parity_summary

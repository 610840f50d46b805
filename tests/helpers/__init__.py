"""What the tests and the differential fuzzer (fuzz/) share: a test support package.

- ``inputs``: builders of q, k, v and masks, and views of every memory layout;
- ``compare``: the comparison with the float64 reference, forward and backward
  (within npattn.testing's tolerances, at npattn's own ulps), and of error messages;
- ``core``: the core's test hooks (kernel tables, pool modes, failing allocations)
  and scripts in a fresh interpreter;
- ``peers``: the shapes compared with PyTorch and MLX, and the parity check;
- ``problems``: random problems of npattn.sdpa's whole contract;
- ``paged``: paged caches for npattn.paged_attention, random ones, and their check;
- ``codes``: 8-bit codes of K and V with scales of every grouping, and the values
  they stand for, which the comparisons take.

The tests import it as ``helpers`` (pytest puts tests/ on the path), the fuzzer
as ``tests.helpers`` (``python -m fuzz.differential`` from the repository root);
every name is also here at the top, so ``from helpers import qkv`` works.
The tolerances themselves live in the package, npattn.testing, where users
find them too; the pytest hooks in tests/conftest.py.
"""

from .codes import FORMATS, GROUPINGS, coded, random_codes, random_groups, split_codes, values
from .compare import (
    BOUND_KEYS,
    OWN_ULPS,
    assert_raises_naming,
    assert_within,
    backward_tolerance,
    check,
    check_backward,
    compare_with_nan,
    own_tolerance,
    reference_call,
    representable,
    snapshot,
)
from .core import (
    KERNELS,
    LASTING,
    assert_sigint_stops,
    failing_allocations,
    kernels,
    pool_mode,
    run_script,
    runnable_kernels,
)
from .inputs import (
    HEAD_LAYOUTS,
    LAYOUTS,
    MASK_KINDS,
    dtype_of,
    f64,
    layout,
    layout_fits,
    make_mask,
    qkv,
    randn,
    read_only,
    unaligned,
)
from .paged import check_paged, paged_problem, random_paged_problem
from .peers import PEER_PHASES, PEER_SHAPES, ParityStats, assert_gradient_parity, assert_parity, peer_visible
from .problems import SPECIAL_SIZE, random_problem

__all__ = [
    "BOUND_KEYS",
    "FORMATS",
    "GROUPINGS",
    "HEAD_LAYOUTS",
    "KERNELS",
    "LASTING",
    "LAYOUTS",
    "MASK_KINDS",
    "OWN_ULPS",
    "PEER_PHASES",
    "PEER_SHAPES",
    "SPECIAL_SIZE",
    "ParityStats",
    "assert_gradient_parity",
    "assert_parity",
    "assert_sigint_stops",
    "assert_raises_naming",
    "assert_within",
    "backward_tolerance",
    "check",
    "check_backward",
    "check_paged",
    "coded",
    "compare_with_nan",
    "dtype_of",
    "f64",
    "failing_allocations",
    "kernels",
    "layout",
    "layout_fits",
    "make_mask",
    "own_tolerance",
    "paged_problem",
    "peer_visible",
    "pool_mode",
    "qkv",
    "randn",
    "random_paged_problem",
    "random_codes",
    "random_groups",
    "random_problem",
    "read_only",
    "reference_call",
    "representable",
    "run_script",
    "runnable_kernels",
    "snapshot",
    "split_codes",
    "unaligned",
    "values",
]

"""Type stub for npattn._core, the private C extension behind npattn.sdpa.

Call npattn.sdpa instead: it validates and converts the arguments; these
functions only re-check the layout they rely on.
"""

import numpy as np

# mask_kind values for sdpa(), mirroring enum npattn_mask_kind in csrc/attention.h
MASK_NONE: int
MASK_CAUSAL: int
MASK_CAUSAL_TOP_LEFT: int
MASK_BOOL: int
MASK_ADD: int

def sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    scale: float,
    mask_kind: int,
    mask: np.ndarray | None,
    sinks: np.ndarray | None,
    threads: int,
    bfloat16: bool,
) -> None:
    """Fill ``out`` with attention over prepared q, k, v (shapes already checked)."""

def blas_info() -> str:
    """Which OpenBLAS npattn runs on: its source and configuration string."""

def simd() -> str:
    """The float32 kernel variant in use: "avx512", "avx2" or "portable"."""

def debug_force_simd(name: str, /) -> None:
    """Test hook: run the named kernel variant; "" restores the best this CPU has."""

def debug_fail_alloc_after(n: int, /) -> None:
    """Test hook: allocations in the core fail after ``n`` more; -1 turns it off."""

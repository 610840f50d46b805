"""Type stub for npattn._core, the private C extension behind npattn's functions.

Call npattn.sdpa, npattn.attention_weights and npattn.sdpa_backward instead:
they validate and convert the arguments; these functions only re-check the
layout they rely on.
"""

from typing import Any

import numpy as np

#: The largest count one BLAS call takes (32-bit BLAS integers).
BLAS_INT_MAX: int
#: The most threads a call may ask for.
MAX_THREADS: int

def sdpa(
    q: Any,
    k: Any,
    v: Any,
    scale: Any,
    mask: Any,
    sinks: Any,
    window: Any,
    softcap: Any,
    q_offset: Any,
    k_offset: Any,
    return_lse: Any,
    out: Any,
    threads: Any,
    prepared: bool,
    /,
) -> Any:
    """npattn.sdpa's fast path: the result (and lse), or NotImplemented when the
    arguments need preparing; with ``prepared`` true, arguments already prepared."""

def attention_weights(
    q: np.ndarray,
    k: np.ndarray,
    scale: float,
    mask: str | np.ndarray | None,
    sinks: np.ndarray | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    q_offset: int | None,
    k_offset: int,
    weights: np.ndarray,
    threads: int,
    /,
) -> np.ndarray:
    """Fill the prepared array ``weights`` with the probabilities; returns it."""

def sdpa_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    scale: float,
    mask: str | np.ndarray | None,
    sinks: np.ndarray | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    q_offset: int | None,
    k_offset: int,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    dsinks: np.ndarray | None,
    threads: int,
    /,
) -> None:
    """Fill the prepared dq, dk, dv (the result's batch shape, computed dtype) and
    dsinks (float64, (n_batch, H_q)) with the gradients."""

def set_bfloat16(dtype: np.dtype, /) -> None:
    """Tell the core ml_dtypes.bfloat16's dtype."""

def blas_info() -> str:
    """Which OpenBLAS npattn runs on: its source and configuration string."""

def shutdown() -> None:
    """At exit (atexit): stop every call in flight; later calls raise SystemExit."""

def simd() -> str:
    """The kernel table in use: "avx512", "avx2", "neon" or "portable"."""

def get_num_threads() -> int:
    """The default thread count: the CPUs available, capped by set_num_threads."""

def set_num_threads(n: int, /) -> None:
    """Cap the default thread count at n (n < 1: no cap)."""

def debug_force_simd(name: str, /) -> None:
    """Test hook: run the named kernel table; "" restores the best this CPU has."""

def debug_fail_alloc_after(n: int, /) -> None:
    """Test hook: allocations in the core fail after ``n`` more; -1 turns it off."""

def debug_pool_mode(mode: int, /) -> None:
    """Test hook: 0 normal, 1 no helper thread starts, 2 helpers join any work."""

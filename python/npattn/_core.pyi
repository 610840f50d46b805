"""Type stub for npattn._core, the private C extension behind npattn's functions.

Call npattn.sdpa, npattn.attention_weights and npattn.sdpa_backward instead.
They hand every argument here by name, as given; the glue (csrc/module.c)
reads and checks each one, converting through the function registered with
``set_converter`` what it cannot read in place, and raises the error that
names the argument.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

#: The most threads a call may ask for, and the most it runs on.
MAX_THREADS: int

def sdpa(
    *,
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
    k_start: Any,
    k_lengths: Any,
    return_lse: Any,
    precision: Any,
    out: Any,
    threads: Any,
    k_scale: Any,
    k_zero: Any,
    v_scale: Any,
    v_zero: Any,
) -> Any:
    """npattn.sdpa: the result, or with return_lse (result, lse, used): used the
    options the core computed under, its defaults resolved (a dict of scale, window,
    softcap, k_offset, q_offset, k_start, k_lengths; the last three ints, or
    read-only int64 arrays of the batch shape where requests differ)."""

def paged_attention(
    *,
    q: Any,
    k: Any,
    v: Any,
    block_table: Any,
    context_lens: Any,
    page_size: Any,
    scale: Any,
    mask: Any,
    sinks: Any,
    window: Any,
    softcap: Any,
    q_offset: Any,
    return_lse: Any,
    precision: Any,
    out: Any,
    threads: Any,
    k_scale: Any,
    k_zero: Any,
    v_scale: Any,
    v_zero: Any,
) -> Any:
    """npattn.paged_attention: the result, or the pair (result, lse)."""

def attention_weights(
    *,
    q: Any,
    k: Any,
    scale: Any,
    mask: Any,
    sinks: Any,
    window: Any,
    softcap: Any,
    q_offset: Any,
    k_offset: Any,
    k_start: Any,
    k_lengths: Any,
    precision: Any,
    threads: Any,
    k_scale: Any,
    k_zero: Any,
) -> np.ndarray:
    """npattn.attention_weights: the probabilities."""

def sdpa_backward(
    *,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    scale: Any,
    mask: Any,
    sinks: Any,
    window: Any,
    softcap: Any,
    q_offset: Any,
    k_offset: Any,
    k_start: Any,
    k_lengths: Any,
    precision: Any,
    threads: Any,
    agree: Callable[[dict[str, Any]], object] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """agree, if not None, is called with the options used (as sdpa's) once every
    argument is read and the core's rules kept, before computing; it raises to refuse
    them. Returns (dq, dk, dv, dsinks) at the result's batch shape in the computed dtype, or in a
    half-precision operand's own where nothing is left to sum (dsinks float64,
    (n_batch, H_q), or None), and (q, k, v) as read, whose shapes and dtypes the
    gradients are summed and cast back to."""

def check_mask(fn: str, mask: Any, full: tuple[int, ...], /) -> Any:
    """The mask as sdpa reads it for a result of shape ``full = (*B, H_q, L, S)``."""

def check_scale(fn: str, scale: Any, D: int, /) -> float:
    """The scale as sdpa reads it (None: 1 / sqrt(D))."""

def result_dtype(*dtypes: Any) -> np.dtype | None:
    """The dtype of a result computed from arrays of these dtypes (float16,
    bfloat16, float32, float64); None if one is another dtype."""

def set_converter(fn: Any, /) -> None:
    """Register ``fn(fn_name, name, x)``: x as an array the core reads in place."""

def set_bfloat16(dtype: np.dtype, /) -> None:
    """Tell the core ml_dtypes.bfloat16's dtype."""

def set_float8(dtype: np.dtype, /) -> None:
    """Tell the core ml_dtypes.float8_e4m3fn's or float8_e5m2's dtype."""

def blas_info() -> str:
    """Which OpenBLAS npattn runs on: its source and configuration string."""

def shutdown() -> None:
    """At exit (atexit): stop every call in flight; later calls raise SystemExit."""

def simd() -> str:
    """The kernel table in use: "amx", "avx512bf16", "avx512", "avx2", "neonbf16", "neon" or "portable"."""

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

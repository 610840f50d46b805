/* hooks.h: what the glue (module.c), the tests and the benchmarks call in the
 * core besides its API: not part of attention.h, and not for other callers.
 * The core's files see it through internal.h. */
#ifndef NPATTN_HOOKS_H
#define NPATTN_HOOKS_H

#include <stdint.h>

#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the glue's ---- */

/* The most bytes this machine could ever hold at once: its physical memory
 * plus swap, where the system says (Linux); 0 where unknown. A result beyond
 * it can never be written, whatever the kernel's overcommit policy would let
 * an allocation promise, so the glue refuses it before allocating. */
uint64_t npattn_memory_limit(void);

/* dst[j] = src[j] rounded to nearest even in dtype (F32, F16 or BF16;
 * subnormals kept, overflow to infinity, NaN stays NaN) for j < n, by the
 * kernel table's SIMD, in blocks on at most n_threads threads (0: the
 * default): the glue's cast of float32 gradients to a half-precision
 * operand's dtype. Returns NPATTN_STATUS_OK, or BAD_THREADS. */
enum npattn_status npattn_narrow_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst,
                                     int32_t n_threads);

/* The float32 FMA peak of the calling thread's core in GFLOP/s, for the
 * kernel table in use: a loop of FMAs in registers only, timed for about
 * `seconds`. A ceiling the benchmarks read decode against; attention never
 * calls it. */
double npattn_fma_peak(double seconds);

/* The same for the bfloat16 dot products of the kernel table in use, 0
 * where it has none: vdpbf16ps in registers (bf16), and the AMX tiles'
 * tdpbf16ps on tiles that stay loaded (tile). The ceilings of the half
 * precision prefill. */
double npattn_bf16_peak(double seconds);
double npattn_tile_peak(double seconds);

/* ---- the tests' ---- */

/* Forces the named kernel table, for the tests ("" restores the best this
 * CPU runs); nonzero where this CPU cannot run it. */
int npattn_debug_force_simd(const char *name);

/* Test hooks, not for production use and not thread-safe with concurrent calls:
 * after n more successful allocations inside the core every allocation fails
 * (n < 0, the default, turns it off); the pool's mode: 0 normal, 1 no
 * helper thread ever starts, 2 helpers join whatever the size of the work;
 * and the time between two polls of the cancel callback (ns <= 0: 50 ms). */
void npattn_debug_fail_alloc_after(int64_t n);
void npattn_debug_pool_mode(int mode);
void npattn_debug_poll_interval(int64_t ns);

#ifdef __cplusplus
}
#endif

#endif /* NPATTN_HOOKS_H */

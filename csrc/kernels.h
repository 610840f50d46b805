/* kernels.h: the hot inner pieces of the core (kernels.c). */
#ifndef NPATTN_KERNELS_H
#define NPATTN_KERNELS_H

#include <stdint.h>

#include "attention.h"

/* One online-softmax step over a row of n scores in base-2 units (-inf =
 * hidden). On return s holds exp2(s - m_new), *m = m_new = max(*m, max s),
 * *l = *l * alpha + sum(s); returns alpha = exp2(m_old - m_new), the factor
 * by which the row's accumulator must be rescaled. While nothing has been
 * visible (*m stays -inf) s becomes zeros and alpha is 1. */
float npattn_softmax_step_f32(float *s, int64_t n, float *m, float *l);
double npattn_softmax_step_f64(double *s, int64_t n, double *m, double *l);

/* dst[j] = src[j * stride] as float, for j < n; src is F32, F16 or BF16. */
void npattn_row_to_f32(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, float *dst);

/* dst[j * stride] = src[j] rounded to nearest even in F32, F16 or BF16. */
void npattn_row_from_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst, int64_t stride);

/* The float32 SIMD variant in use: "avx512", "avx2" or "portable". */
const char *npattn_simd_name(void);

/* Test hook: use the named variant ("" or NULL: the best this CPU has).
 * Returns -1, changing nothing, when this CPU cannot run it. */
int npattn_simd_force(const char *name);

#endif /* NPATTN_KERNELS_H */

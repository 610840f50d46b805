/* kernels.h: the hot inner pieces of the core (kernels.c). */
#ifndef NPATTN_KERNELS_H
#define NPATTN_KERNELS_H

#include <stdint.h>

#include "attention.h"

/* One online-softmax step over a tile of scores stored transposed: st is
 * (nk, M) row-major, column r holds query row r's scores in base-2 units
 * (-inf = hidden). On return column r holds exp2(s - m_new[r]), m[r] =
 * m_new[r] = max(m[r], max of the column), l[r] = l[r] * alpha[r] + the
 * column's sum, and alpha[r] = exp2(m_old - m_new), the factor by which row
 * r of the accumulator must be rescaled. A column that has seen nothing yet
 * (m stays -inf) becomes zeros and leaves l at 0. */
void npattn_softmax_cols_f32(float *st, int64_t nk, int64_t M, float *m, float *l, float *alpha);
void npattn_softmax_cols_f64(double *st, int64_t nk, int64_t M, double *m, double *l, double *alpha);

/* Streaming kernels for decode-sized tiles (few stacked rows), which read
 * each key and value row once: scores st (nk, M) of q (M, D) row-major
 * against k's nk rows; and o (M, Dv) row-major += P @ v with P (M, nk) given
 * as st (nk, M). Fast only where npattn_stream_available() says so. */
int npattn_stream_available(void);
void npattn_scores_rows_f32(const float *q, int64_t M, int64_t D, const float *k, int64_t ldk, int64_t nk,
                            float *st);
void npattn_accumulate_rows_f32(const float *st, int64_t M, int64_t nk, const float *v, int64_t ldv, int64_t Dv,
                                float *o);

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

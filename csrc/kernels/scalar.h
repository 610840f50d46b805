/* kernels/scalar.h: what every table shares outside its vectors: elements
 * of each stored format as float (the scalar twin of the vector headers'
 * loads), float16 and bfloat16 conversions, the portable pieces that are the
 * SIMD tables' tails, the spans' row walk, prefetch distances, and the
 * constants of the exp2 and tanh polynomials (written once over the vector
 * layer in vec_math.h, and in portable.c for one lane). kernels.h includes
 * it after the table's contract. */
#ifndef NPATTN_KERNELS_SCALAR_H
#define NPATTN_KERNELS_SCALAR_H

#include <math.h>

#include "kernels.h"

/* The portable softmax step over columns r0 .. r1-1: the SIMD tables' tails. */
int npattn_softmax_f32_columns(float *st, const struct npattn_score_tile *t, int64_t r0, int64_t r1, float *m,
                               float *l, float *alpha);

/* finish_rows' factor for row i: 1 / l[i], 0 where l[i] is 0, 1 without l. */
static inline float npattn_finish_factor(const float *l, int64_t i) {
    return !l ? 1.0f : l[i] == 0.0f ? 0.0f : 1.0f / l[i];
}

/* finish_rows in portable C, row after row: the portable and NEON tables'
 * kernel; npattn_finish_columns does one row's columns e0 .. w - 1 (inv =
 * 1 / l, or 0), the SIMD kernels' tails. */
int npattn_finish_rows(const float *o, int64_t n, int64_t w, const float *l, enum npattn_dtype dt, void *dst,
                       int64_t ld);
int npattn_finish_columns(const float *x, int64_t e0, int64_t w, float inv, enum npattn_dtype dt, void *row);

/* add_f32 in portable C: the portable and NEON tables' (the compiler
 * vectorises it for the ISA it compiles for). */
void npattn_add_f32(float *o, const float *x, int64_t n);

/* accumulate's columns e0 .. Dv - 1 (the portable kernel's and the SIMD
 * kernels' column tails): the spans' terms summed from zero, then added to o. */
void npattn_accumulate_columns(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                               int64_t n_span, enum npattn_dtype vt, const struct npattn_dequant *dq, int64_t ldv,
                               int64_t Dv, int64_t e0, float *o);

/* ---- codes with one scale a row ---- */

/* Codes whose scale (and zero point) is one a row of width w (struct
 * npattn_dequant's group the row's width: a scale per tensor, head or
 * token) take the SIMD tables' streamed kernels as if they were floats of
 * the codes' own values, the scale applied once to each sum: the scores
 * s (q . c - z sum(q)), and P @ V as sum_j (p_j s_j) c_j less sum_j p_j s_j z_j
 * in each column. Their sums round as float32 sums of the dequantized values
 * do, within a few ulps (SPEC section 14 asks float32's tolerance), and a
 * loaded vector is used as converted, with no multiply. At most
 * NPATTN_SCALED_KEYS keys a call (accumulate's weights are copied, times the
 * scales, NPATTN_SCALED_ROWS rows at a time). */
enum { NPATTN_SCALED_ROWS = 16, NPATTN_SCALED_KEYS = 256 };

static inline int npattn_row_scaled(const struct npattn_dequant *dq, int64_t w) { return dq && dq->group == w; }

/* The keys of n_span spans. */
int64_t npattn_span_keys(const struct npattn_span *spans, int64_t n_span);

/* ---- conversions (convert.c) ---- */

/* Whether x[0 .. n-1] are all finite. */
int npattn_all_finite_f32(const float *x, int64_t n);

float npattn_f16_to_f32(uint16_t h);
uint16_t npattn_f32_to_f16(float f);  /* round to nearest even */
float npattn_bf16_to_f32(uint16_t b);
uint16_t npattn_f32_to_bf16(float f); /* round to nearest even */

/* dst[j] = src[j * stride] converted, for j < n; src of any dtype. */
void npattn_load_f32(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, float *dst);
void npattn_load_f64(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, double *dst);

/* dst[j] = the value code src[j * stride] (of type t, a code type) stands
 * for, as struct npattn_dequant says, for the row whose scales and zero
 * points are at scale and zero (j its element index; dq's strides between
 * rows unused); _f64: that float value, widened. */
void npattn_dequant_f32(const struct npattn_dequant *dq, enum npattn_dtype t, const void *src, int64_t stride, int64_t n,
                        const void *scale, const void *zero, float *dst);
void npattn_dequant_f64(const struct npattn_dequant *dq, enum npattn_dtype t, const void *src, int64_t stride, int64_t n,
                        const void *scale, const void *zero, double *dst);

/* dst[j * stride] = src[j] rounded to nearest even in dtype, for j < n. */
void npattn_store_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst, int64_t stride);
void npattn_store_f64(enum npattn_dtype dtype, const double *src, int64_t n, void *dst, int64_t stride);

/* Float rows as the bfloat16 operands of scores_bf16 and accumulate_bf16,
 * rounded to nearest even (exact for values that are bfloat16 already).
 * Each returns whether a value was subnormal, which the dot products would
 * read as 0: the caller then computes without them.
 * pairs_of_rows: rows 2p and 2p + 1 of x (n rows of w, ldx apart) as row p
 * of out (ldo apart, zeros past w), through the table's pair_f32.
 * pairs_across: the pairs along each row, x[r][c] and x[r][c + 1] for even
 * c, as out[c / 2 * ldo + r], zeros for n <= r < ldo, through the table's
 * bf16_f32.
 * bf16_rows: x[r][c] as out[r * ldo + c], zeros for w <= c < ldo, through
 * the table's bf16_f32. */
int npattn_pairs_of_rows(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo);
int npattn_pairs_across(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo);
int npattn_bf16_rows(const float *x, int64_t n, int64_t w, int64_t ldx, uint16_t *out, int64_t ldo);

/* float16 operands of scores_bf16, each value x split into bfloat16 values
 * hi + lo = x exactly (neither subnormal), so that the four products of a
 * q and a k value, summed, are their product: a row of K as 2w pairs
 * (K's rows of 4w values), split_f16_row: out[c] = out[w + c] = (hi, lo)
 * of h[c] for c < w; and Q's, split_across: out[c * ldo + r] = (hi, hi)
 * and out[(w + c) * ldo + r] = (lo, lo) of x[r][c] (n rows of w float16
 * values as float, ldx apart), zeros for n <= r < ldo. Under "fast", V's
 * for accumulate_tiles_bf16 likewise: a row of w float16 values h as two
 * rows of pairs, split_f16_twice: hi[c] = (hi, hi) and lo[c] = (lo, lo),
 * zeros for w <= c < ld (P's: the table's split_tiles). */
void npattn_split_f16_row(const uint16_t *h, int64_t w, uint32_t *out);
void npattn_split_across(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo);
void npattn_split_f16_twice(const uint16_t *h, int64_t w, uint32_t *hi, uint32_t *lo, int64_t ld);

/* Whether a tile's scores are only scaled, by a positive scale (no softcap,
 * bias or band cut): the max of the scores is then scale times the max of
 * the raw ones (rounding keeps order), and the softmax need not write the
 * scaled scores back before its second pass, which scales them again. */
static inline int npattn_tile_plain(const struct npattn_score_tile *t) {
    return t->softcap <= 0 && !t->bias && !t->lo && t->scale > 0;
}

/* Whether bfloat16 bits b are a subnormal value (which the bfloat16 dot
 * products read as 0). */
static inline int npattn_bf16_subnormal(uint16_t b) { return (b & 0x7f80) == 0 && (b & 0x7fff) != 0; }

/* An fp8 code as float, exactly: e4m3fn through float16 (its bits moved
 * into a float16's, times 2^8: bias 7 against 15), the codes 0x7f and
 * 0xff NaN; e5m2 is the top byte of a float16. */
static inline float npattn_e4m3_to_f32(uint8_t b) {
    if ((b & 0x7f) == 0x7f) return (float)NAN;
    return npattn_f16_to_f32((uint16_t)((b & 0x80) << 8 | (b & 0x7f) << 7)) * 256.0f;
}
static inline float npattn_e5m2_to_f32(uint8_t b) { return npattn_f16_to_f32((uint16_t)(b << 8)); }

/* Bytes per element of a row the streaming kernels read (F32, F16, BF16,
 * and the codes). */
static inline int64_t npattn_stream_size(enum npattn_dtype t) {
    return t == NPATTN_DTYPE_F32 ? 4 : npattn_is_code(t) ? 1 : 2;
}

/* Element i of a row of type t (F32, F16, BF16; a code, the code itself)
 * as float, exactly: the kernels' scalar tails. */
static inline float npattn_stream_elem(enum npattn_dtype t, const void *row, int64_t i) {
    if (t == NPATTN_DTYPE_F32) return ((const float *)row)[i];
    if (t == NPATTN_DTYPE_F16) return npattn_f16_to_f32(((const uint16_t *)row)[i]);
    if (t == NPATTN_DTYPE_BF16) return npattn_bf16_to_f32(((const uint16_t *)row)[i]);
    if (t == NPATTN_DTYPE_I8) return (float)((const int8_t *)row)[i];
    if (t == NPATTN_DTYPE_U8) return (float)((const uint8_t *)row)[i];
    if (t == NPATTN_DTYPE_F8E4M3) return npattn_e4m3_to_f32(((const uint8_t *)row)[i]);
    return npattn_e5m2_to_f32(((const uint8_t *)row)[i]);
}

/* Element e of a row of type t as float: a float's value, or the value
 * its code stands for (dq; the row's scales and zero points at scale and
 * zero). The kernels' scalar tails. */
static inline float npattn_value_elem(enum npattn_dtype t, const struct npattn_dequant *dq, const void *row, int64_t e,
                                      const void *scale, const void *zero) {
    float x = npattn_stream_elem(t, row, e);
    if (!dq) return x;
    const int64_t g = e / dq->group;
    if (dq->zero) x -= npattn_stream_elem(dq->zero_type, zero, g * dq->zero_col);
    return x * npattn_stream_elem(dq->scale_type, scale, g * dq->scale_col);
}

/* Element i of a row of type t, by address. */
static inline const void *npattn_stream_at(enum npattn_dtype t, const void *row, int64_t i) {
    return (const char *)row + i * npattn_stream_size(t);
}

/* Row i's scales (or zero points) of a span whose first row's are at `at`,
 * type t, row elements apart: NULL where there are none. */
static inline const void *npattn_span_groups(const void *at, enum npattn_dtype t, int64_t row, int64_t i) {
    return at ? npattn_stream_at(t, at, i * row) : NULL;
}

/* A dense span's rows ahead: this many rows further on, about 8 KiB, more
 * than a DRAM latency's worth of the stream, so that decode over a long
 * context runs near the memory's bandwidth (1.7x with it, measured on
 * Qwen3-4B heads at S = 32768). */
static inline int64_t npattn_prefetch_rows(int64_t row_bytes) {
    int64_t n = 8192 / (row_bytes > 0 ? row_bytes : 1);
    return n < 4 ? 4 : n;
}

/* How far ahead an accumulate prefetches its value rows when it passes
 * over each row `passes` times, each pass prefetching its own columns of
 * the rows ahead, `rows` a dense stream's distance: the more passes, the
 * sooner a row's part is needed after its prefetch. So the distance grows
 * with the passes, and from 4 passes it is a whole tile, whose rows then
 * come in while the passes over the tile before run. Measured, float32
 * decode, alternated runs: on a 2-core Xeon (avx512), MQA 16/1/128 at 65536
 * keys on one thread 8.8-9.1 -> 10.4 GB/s, 32/4/128 at 32768 keys on two
 * 23-25 -> 28-30 GB/s, Qwen3-4B's 4 rows (2 passes) level; on a Zen 4
 * (avx2, 22 passes), the MQA on one thread 8.7 -> 7.2-7.4 ms. */
static inline int64_t npattn_ahead_of_passes(int64_t passes, int64_t rows, int64_t tile) {
    return passes >= 4 ? tile : rows * passes;
}

/* The next n rows of the spans, from row *i of span *si on (both advanced
 * past them), as addresses: rows[a] and the row ahead of it, ahead[a];
 * ld_bytes from one row to the next. Returns how many there were (fewer
 * than n at the end). */
static inline int64_t npattn_span_rows(const struct npattn_span *spans, int64_t n_span, int64_t *si, int64_t *i,
                                       int64_t ld_bytes, int64_t n, const void **rows, const void **ahead) {
    int64_t a = 0;
    while (a < n && *si < n_span) {
        const struct npattn_span *s = spans + *si;
        const int64_t take = s->n - *i < n - a ? s->n - *i : n - a;
        for (int64_t b = 0; b < take; b++) {
            rows[a + b] = (const char *)s->rows + (*i + b) * ld_bytes;
            ahead[a + b] = (const char *)s->ahead + (*i + b) * ld_bytes;
        }
        a += take, *i += take;
        if (*i == s->n) ++*si, *i = 0;
    }
    return a;
}

/* exp2 on [-0.5, 0.5]: Cephes exp2f's polynomial, relative error < 2e-7.
 * exp(x) is computed as exp2(x * log2(e)); below 2^-126 it is taken as 0. */
#define NPATTN_EXP2_C6 1.535336188319500e-4f
#define NPATTN_EXP2_C5 1.339887440266574e-3f
#define NPATTN_EXP2_C4 9.618437357674640e-3f
#define NPATTN_EXP2_C3 5.550332471162809e-2f
#define NPATTN_EXP2_C2 2.402264791363012e-1f
#define NPATTN_EXP2_C1 6.931472028550421e-1f
#define NPATTN_EXP2_MIN -126.0f
#define NPATTN_LOG2E 1.44269504088896341f
/* The weights of the "fast" bfloat16 prefill's tiles (softmax_tiles_f32),
 * which are rounded to bfloat16 (2^-9) next: exp2 on [-0.5, 0.5] to 2.7e-6
 * relative, a near-minimax polynomial of degree 4, its argument one FMA. */
#define NPATTN_EXP2_FAST_C4 9.570101276040077e-3f
#define NPATTN_EXP2_FAST_C3 5.591785907745361e-2f
#define NPATTN_EXP2_FAST_C2 2.40247443318367e-1f
#define NPATTN_EXP2_FAST_C1 6.931217908859253e-1f
#define NPATTN_EXP2_FAST_C0 9.999992847442627e-1f

/* tanh(y) for |y| < 0.625: y + y^3 P(y^2), P a least-squares fit of degree
 * 4, within 1.4 half-ulps in float; beyond, (1 - e) / (1 + e) with
 * e = exp(-2|y|), within 2.3 ulps. */
#define NPATTN_TANH_SPLIT 0.625f
#define NPATTN_TANH_P0 -3.3333285213e-01f
#define NPATTN_TANH_P1 1.3331512469e-01f
#define NPATTN_TANH_P2 -5.3744640344e-02f
#define NPATTN_TANH_P3 2.0653063925e-02f
#define NPATTN_TANH_P4 -5.7188915338e-03f

#endif /* NPATTN_KERNELS_SCALAR_H */

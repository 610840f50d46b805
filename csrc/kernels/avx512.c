/* kernels/avx512.c: the avx512 and avx512bf16 tables (and the amx table's
 * float32 kernels, amx.c): the kernels written once over the vector layer
 * (vec_*.h), built on vec_avx512.h's 16 masked lanes, and what is this
 * ISA's own: a bfloat16 K's keys in the lanes, accumulate's register
 * blocks, and AVX512-BF16's vdpbf16ps pairs (q's pairs, the products of
 * gemm tiles, the streamed P @ V, the softmax whose weights go to tiles). */
#if defined(__x86_64__) || defined(__i386__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "avx512.h"
#include "kernels.h"
#include "vec_avx512.h"
#include "vec_math.h"
#include "vec_softmax.h"
#include "vec_stream.h"
#include "vec_rows.h"
#include "vec_gemm.h"

#define INLINE static inline __attribute__((always_inline))

/* kt (D, 16) = nkb <= 16 bfloat16 key rows (at rows[i]; D a multiple of
 * 32) with the keys in lanes, zeros past nkb: each row's pairs transposed,
 * then each pair split into its two floats; or, `pairs`, kt (D / 2, 16)
 * the pairs themselves (as 32-bit lanes), and the return whether a value
 * is subnormal (else 0). The rows `ahead` are prefetched. */
VEC_FN int bf16_keys_in_lanes(const void *const *rows, int nkb, int64_t D, const void *const *ahead, float *kt,
                              const int pairs) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
    __m512i least = BF16_NONE_SEEN;
    for (int64_t c = 0; c < D; c += 32) {
        __m512i x[16];
        for (int i = 0; i < 16; i++) {
            if (i < nkb) vprefetch((const uint16_t *)ahead[i] + c);
            x[i] = i < nkb ? _mm512_loadu_si512((const uint16_t *)rows[i] + c) : _mm512_setzero_si512();
            if (pairs) least = bf16_least(least, x[i]);
        }
        transpose16(x); /* x[p]: pair p of the chunk, one key per lane */
        for (int p = 0; p < 16; p++) {
            if (pairs) {
                _mm512_store_si512(kt + (c / 2 + p) * 16, x[p]);
                continue;
            }
            _mm512_store_si512(kt + (c + 2 * p) * 16, _mm512_slli_epi32(x[p], 16));
            _mm512_store_si512(kt + (c + 2 * p + 1) * 16, _mm512_and_si512(x[p], top));
        }
    }
    return pairs && bf16_any_subnormal(least);
}

/* st's nr <= 8 rows (ldst apart) at 16 keys, or 32 (two): nr rows of q (D
 * apart) against the keys of kt0 (lanes live0) and kt1 (live1), (D, 16)
 * each: one FMA per row, element and half, in element order. */
VEC_FN void rows_against_keys(const float *kt0, const float *kt1, const float *q, int nr, int two, int64_t D,
                              float *st, int64_t ldst, __mmask16 live0, __mmask16 live1) {
    __m512 acc[8][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 x = _mm512_load_ps(kt0 + 16 * d), y = two ? _mm512_load_ps(kt1 + 16 * d) : x;
        for (int r = 0; r < nr; r++) {
            const __m512 b = _mm512_set1_ps(q[r * D + d]);
            acc[r][0] = _mm512_fmadd_ps(x, b, acc[r][0]);
            if (two) acc[r][1] = _mm512_fmadd_ps(y, b, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(st + r * ldst, live0, acc[r][0]);
        if (two) _mm512_mask_storeu_ps(st + r * ldst + 16, live1, acc[r][1]);
    }
}

/* rows_against_keys for nr rows, with the second half (n1 > 0) or without,
 * each specialised: the case nr of a switch over the rows left. */
#define ROWS_AGAINST_KEYS(nr)                                                                                        \
    case nr:                                                                                                         \
        if (n1) rows_against_keys(kt, kt1, qr, nr, 1, D, s, ldst, live0, live1);                                     \
        else rows_against_keys(kt, kt1, qr, nr, 0, D, s, ldst, live0, live1);                                        \
        break;

/* The scores of n <= 32 bfloat16 keys (rows, their rows ahead `ahead`)
 * against the M rows of q, into st's columns from 0, with the keys in
 * lanes, no reduction tree; the rows of q against them 8 at a time. */
static VEC_TARGET void bf16_block_in_lanes(const void *const *rows, const void *const *ahead, int64_t n, const float *q,
                                           int64_t M, int64_t D, float *st, int64_t ldst) {
    float kt[2 * NPATTN_LANES_MAX_D * 16] __attribute__((aligned(64)));
    float *const kt1 = kt + D * 16;
    const int n0 = (int)(n < 16 ? n : 16), n1 = (int)(n - n0);
    bf16_keys_in_lanes(rows, n0, D, ahead, kt, 0);
    if (n1) bf16_keys_in_lanes(rows + 16, n1, D, ahead + 16, kt1, 0);
    const __mmask16 live0 = lanes(n0, 0), live1 = lanes(n1, 0);
    for (int64_t r = 0; r < M; r += 8) {
        float *s = st + r * ldst;
        const float *qr = q + r * D;
        switch (M - r < 8 ? M - r : 8) {
            ROWS_AGAINST_KEYS(8)
            ROWS_AGAINST_KEYS(7)
            ROWS_AGAINST_KEYS(6)
            ROWS_AGAINST_KEYS(5)
            ROWS_AGAINST_KEYS(4)
            ROWS_AGAINST_KEYS(3)
            ROWS_AGAINST_KEYS(2)
            ROWS_AGAINST_KEYS(1)
        }
    }
}
#undef ROWS_AGAINST_KEYS

/* scores_of for a bfloat16 K against the rows npattn_bf16_keys_in_lanes
 * admits: 32 keys at a time (16 at the end), across the spans. */
VEC_FN void bf16_scores_in_lanes(const float *q, int64_t M, int64_t D, const struct npattn_span *spans,
                                 int64_t n_span, int64_t ldk, float *st, int64_t ldst) {
    int64_t si = 0, i = 0; /* the next key: row i of span si */
    for (int64_t j = 0;; j += 32) {
        const void *rows[32], *ahead[32];
        const int64_t n = npattn_span_rows(spans, n_span, &si, &i, 2 * ldk, 32, rows, ahead);
        if (n == 0) break;
        bf16_block_in_lanes(rows, ahead, n, q, M, D, st + j, ldst);
    }
}

/* A bfloat16 K against the rows npattn_bf16_keys_in_lanes admits: all of
 * them with the keys in the lanes; else none (vec_stream.h's reduction
 * trees take them). */
VEC_FN int64_t isa_scores_own(enum npattn_dtype kt, const struct npattn_dequant *dq, const float *q, int64_t M,
                              int64_t D, const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,
                              int64_t ldst) {
    (void)dq;
    if (kt != NPATTN_DTYPE_BF16 || !npattn_bf16_keys_in_lanes(M, D)) return 0;
    bf16_scores_in_lanes(q, M, D, spans, n_span, ldk, st, ldst);
    return M;
}

/* The most rows of one block of accumulate_of, whose accumulators (rows x
 * chunks of 16 columns) are at most 16 registers. */
#define ACC_ROWS 8

/* vec_accumulate_block for nr rows, specialised: the case nr of a switch;
 * the first block (b == 0) prefetches every row ahead. */
#define ACCUMULATE_BLOCK(nr, nc)                                                                                     \
    case nr:                                                                                                         \
        if (b == 0) vec_accumulate_block(vt, zero, dq, s, ldst, nr, nc, spans, n_span, ldv, Dv, e0, o + r * Dv, 1, 0); \
        else vec_accumulate_block(vt, zero, dq, s, ldst, nr, nc, spans, n_span, ldv, Dv, e0, o + r * Dv, 0, 0);        \
        break;

/* Up to 4 rows in one block of 64 columns at a time; more in blocks of at
 * most ACC_ROWS, as even as they go, of 32 columns at a time (7 rows: 1.47x
 * blocks of 4 and 3 of 64 columns, one Xeon core), so that each value row
 * is loaded the fewest times. The first block of each pass over the
 * columns prefetches its columns of the rows ahead. */
VEC_FN int64_t isa_accumulate_of(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq,
                                 const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                 int64_t n_span, int64_t ldv, int64_t Dv, float *o) {
    if (M <= 4) { /* one block (b, r: its number and first row, for the macro) */
        for (int64_t e0 = 0, r = 0, b = 0; e0 < Dv; e0 += 64) {
            const float *s = st;
            switch (M) {
                ACCUMULATE_BLOCK(4, 4)
                ACCUMULATE_BLOCK(3, 4)
                ACCUMULATE_BLOCK(2, 4)
                ACCUMULATE_BLOCK(1, 4)
            }
        }
        return Dv;
    }
    const int64_t n_block = (M + ACC_ROWS - 1) / ACC_ROWS;
    for (int64_t e0 = 0; e0 < Dv; e0 += 32)
        for (int64_t b = 0, r = 0; b < n_block; b++) {
            const int64_t r1 = M * (b + 1) / n_block;
            const float *s = st + r * ldst;
            switch (r1 - r) {
                ACCUMULATE_BLOCK(8, 2)
                ACCUMULATE_BLOCK(7, 2)
                ACCUMULATE_BLOCK(6, 2)
                ACCUMULATE_BLOCK(5, 2)
                ACCUMULATE_BLOCK(4, 2)
                ACCUMULATE_BLOCK(3, 2)
            }
            r = r1;
        }
    return Dv;
}
#undef ACCUMULATE_BLOCK


/* accumulate_of passes over each value row once per block of rows and
 * columns (npattn_ahead_of_passes). */
static int64_t accumulate_ahead_avx512(int64_t M, int64_t Dv, int64_t rows, int64_t tile) {
    const int64_t passes = M <= 4 ? (Dv + 63) / 64 : (M + ACC_ROWS - 1) / ACC_ROWS * ((Dv + 31) / 32);
    return npattn_ahead_of_passes(passes, rows, tile);
}

/* ---- bfloat16 dot products (AVX512-BF16: vdpbf16ps) ----
 * vdpbf16ps adds to each float lane the two products of a pair of bfloat16
 * lanes, one rounding each as an FMA's: products of bfloat16 values are exact
 * in float, so the sums are those of float arithmetic. It treats subnormal
 * inputs as zero and flushes subnormal results: the callers give it no
 * subnormal input (pair_bf16 and pair_f32 report them), and a flushed
 * product is below 2^-126, which no score or output can tell (scale and
 * softcap are normal floats; the weights are at most 1). */
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The 32-bit pairs (x[i], y[i]) of 16 of the 32 words of x and y: i < 16
 * (lo) or i >= 16 (hi). */
AVX512BF16 INLINE __m512i pairs_lo(__m512i x, __m512i y) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                         36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(x, idx, y);
}
AVX512BF16 INLINE __m512i pairs_hi(__m512i x, __m512i y) {
    const __m512i idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                         53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    return _mm512_permutex2var_epi16(x, idx, y);
}

/* The 32-bit lanes of 16 pairs from c on, of n. */
AVX512BF16 INLINE __mmask16 pair_lanes(int64_t n, int64_t c) {
    const int64_t left = n - c;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* The 16-bit lanes of 32 values from c on, of n. */
AVX512BF16 INLINE __mmask32 lanes32(int64_t n, int64_t c) {
    const int64_t left = n - c;
    return left >= 32 ? (__mmask32)0xFFFFFFFF : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1);
}

AVX512BF16 static int pair_bf16_avx512(const uint16_t *a, const uint16_t *b, int64_t n, uint32_t *out) {
    const __m512i exp = _mm512_set1_epi16(0x7f80), mag = _mm512_set1_epi16(0x7fff);
    __mmask32 sub = 0;
    for (int64_t c = 0; c < n; c += 32) {
        const __mmask32 m = lanes32(n, c);
        const __m512i x = _mm512_maskz_loadu_epi16(m, a + c), y = b ? _mm512_maskz_loadu_epi16(m, b + c) : _mm512_setzero_si512();
        sub |= _mm512_testn_epi16_mask(x, exp) & _mm512_test_epi16_mask(x, mag);
        sub |= _mm512_testn_epi16_mask(y, exp) & _mm512_test_epi16_mask(y, mag);
        if (out) {
            _mm512_mask_storeu_epi32(out + c, pair_lanes(n, c), pairs_lo(x, y));
            _mm512_mask_storeu_epi32(out + c + 16, pair_lanes(n, c + 16), pairs_hi(x, y));
        }
    }
    return sub != 0;
}

/* Whether a lane of the 16 floats of x is subnormal. */
AVX512BF16 INLINE __mmask16 subnormal_f32(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    return _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)), bits,
                                       _mm512_set1_epi32(0x7fffffff));
}

/* The pairs (x[c], y[c]), each rounded by vcvtne2ps2bf16 (nearest even, a
 * subnormal read as 0). */
AVX512BF16 INLINE __m512i paired(__m512 x, __m512 y) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                         20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(y, x)); /* x's 16 values, then y's: paired */
}

/* Rounded by paired (a subnormal lane's result is not used, the caller
 * being told). */
AVX512BF16 static int pair_f32_avx512(const float *a, const float *b, int64_t n, uint32_t *out) {
    __mmask16 sub = 0;
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = lanes(n, c / 16);
        const __m512 x = _mm512_maskz_loadu_ps(m, a + c), y = b ? _mm512_maskz_loadu_ps(m, b + c) : _mm512_setzero_ps();
        sub |= subnormal_f32(x) | subnormal_f32(y);
        _mm512_mask_storeu_epi32(out + c, m, paired(x, y));
    }
    return sub != 0;
}

/* softmax_f32 whose probabilities go to A tiles' rows of bfloat16 pairs
 * (kernels.h's softmax_tiles_f32), rounded by paired: 32 keys of 16
 * columns at a time, paired, then transposed so that each column's pairs
 * lie together. */
AVX512BF16 static int softmax_tiles_avx512(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha,
                                           uint32_t *pa, int64_t ldpa) {
    const int64_t nk = t->nk, M = t->M, ld = t->ld, n16 = (nk + 31) / 32 * 16;
    const __m512 zero = _mm512_setzero_ps();
    const int plain = npattn_tile_plain(t);
    /* exp(x - shift) as exp2 of one FMA, x (plain: x * scale) times log2(e) less shift's multiple */
    const __m512 to2 = _mm512_set1_ps((float)((plain ? (double)t->scale : 1.0) * 1.4426950408889634));
    for (int64_t r = 0; r < M; r += 16) {
        const __mmask16 live = lanes(M - r, 0);
        __m512 mx, shift, a, sum = zero;
        if (vec_columns_max(st, t, m, r, live, &mx, &shift, &a)) return 1;
        const __m512 from = _mm512_mul_ps(shift, _mm512_set1_ps(-NPATTN_LOG2E));
        for (int64_t p0 = 0; p0 < n16; p0 += 16) {
            __m512i x[16];
            __m512 p[2];
            const int whole = 2 * (p0 + 16) <= nk; /* 32 keys: no check per key */
            for (int i = 0; i < 16; i++) {
                for (int h = 0; h < 2; h++) { /* keys j and j + 1; zeros past nk, and in the lanes past M */
                    const int64_t j = 2 * (p0 + i) + h;
                    p[h] = whole || j < nk
                               ? _mm512_maskz_mov_ps(live, vexp2_nonpos(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, st + j * ld + r),
                                                                                       to2, from), 1))
                               : zero;
                    sum = _mm512_add_ps(sum, p[h]);
                }
                x[i] = paired(p[0], p[1]);
            }
            transpose16(x);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(pa + (r + i) * ldpa + p0, x[i]);
        }
        vec_columns_done(m, l, alpha, r, live, mx, a, sum);
    }
    return 0;
}

/* Rounded by vcvtneps2bf16, as pair_f32. */
AVX512BF16 static int bf16_f32_avx512(const float *x, int64_t n, uint16_t *out) {
    __mmask16 sub = 0;
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = lanes(n, c / 16);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
        sub |= subnormal_f32(v);
        _mm256_mask_storeu_epi16(out + c, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
    return sub != 0;
}

/* ---- streamed scores of a bfloat16 K against rows of q that are bfloat16
 * values, by their pairs' dot products (kernels.h's q_tiles and scores) ---- */

/* qb[r * D / 2 + p] = pair p of q's row r, for M <= 16 rows of D values
 * that npattn_bf16_keys_in_lanes admits; returns 0, qb unspecified, for
 * other sizes, or unless every value is a bfloat16 value (its low 16 bits
 * zero) and none is subnormal. The table's q_tiles. */
AVX512BF16 static int q_pairs_avx512(const float *q, int64_t M, int64_t D, uint32_t *qb) {
    if (M > 16 || !npattn_bf16_keys_in_lanes(M, D)) return 0;
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < D; c += 32) {
            const __m512 a = _mm512_loadu_ps(q + r * D + c), b = _mm512_loadu_ps(q + r * D + c + 16);
            if (_mm512_test_epi32_mask(_mm512_castps_si512(a), low) | _mm512_test_epi32_mask(_mm512_castps_si512(b), low) |
                subnormal_f32(a) | subnormal_f32(b))
                return 0;
            _mm512_storeu_si512(qb + r * D / 2 + c / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a)); /* the 32 values in order */
        }
    return 1;
}

/* st's nr <= 8 rows (ldst apart) at 16 keys, or 32 (two): the pairs of nr
 * rows of q (qr, np apart) against the keys' pairs kp0 (lanes live0) and
 * kp1 (live1), (np, 16) each: one dot product per row, pair and half. */
AVX512BF16 INLINE void rows_against_pairs(const uint32_t *kp0, const uint32_t *kp1, const uint32_t *qr, int nr, int two,
                                          int64_t np, float *st, int64_t ldst, __mmask16 live0, __mmask16 live1) {
    __m512 acc[8][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const __m512bh x = (__m512bh)_mm512_load_si512(kp0 + 16 * p);
        const __m512bh y = two ? (__m512bh)_mm512_load_si512(kp1 + 16 * p) : x;
        for (int r = 0; r < nr; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int32_t)qr[r * np + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b);
            if (two) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], y, b);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(st + r * ldst, live0, acc[r][0]);
        if (two) _mm512_mask_storeu_ps(st + r * ldst + 16, live1, acc[r][1]);
    }
}

#define ROWS_AGAINST_PAIRS(nr)                                                                                       \
    case nr:                                                                                                         \
        if (n1) rows_against_pairs(kp, kp1, qr, nr, 1, D / 2, s, ldst, live0, live1);                                \
        else rows_against_pairs(kp, kp1, qr, nr, 0, D / 2, s, ldst, live0, live1);                                   \
        break;

/* The scores of a bfloat16 K against q's rows as pairs qb (q_pairs_avx512):
 * 32 keys at a time (16 at the end), across the spans, with the keys'
 * pairs in lanes, against 8 rows at a time. A block of keys holding a
 * subnormal value goes to the floats' kernel, bf16_block_in_lanes. */
AVX512BF16 static void pairs_scores(const float *q, const uint32_t *qb, int64_t M, int64_t D,
                                    const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,
                                    int64_t ldst) {
    uint32_t kp[NPATTN_LANES_MAX_D * 16] __attribute__((aligned(64)));
    uint32_t *const kp1 = kp + D / 2 * 16;
    int64_t si = 0, i = 0; /* the next key: row i of span si */
    for (int64_t j = 0;; j += 32) {
        const void *rows[32], *ahead[32];
        const int64_t n = npattn_span_rows(spans, n_span, &si, &i, 2 * ldk, 32, rows, ahead);
        if (n == 0) break;
        const int n0 = (int)(n < 16 ? n : 16), n1 = (int)(n - n0);
        int sub = bf16_keys_in_lanes(rows, n0, D, ahead, (float *)kp, 1);
        if (n1) sub |= bf16_keys_in_lanes(rows + 16, n1, D, ahead + 16, (float *)kp1, 1);
        if (sub) {
            bf16_block_in_lanes(rows, ahead, n, q, M, D, st + j, ldst);
            continue;
        }
        const __mmask16 live0 = lanes(n0, 0), live1 = lanes(n1, 0);
        for (int64_t r = 0; r < M; r += 8) {
            float *s = st + r * ldst + j;
            const uint32_t *qr = qb + r * D / 2;
            switch (M - r < 8 ? M - r : 8) {
                ROWS_AGAINST_PAIRS(8)
                ROWS_AGAINST_PAIRS(7)
                ROWS_AGAINST_PAIRS(6)
                ROWS_AGAINST_PAIRS(5)
                ROWS_AGAINST_PAIRS(4)
                ROWS_AGAINST_PAIRS(3)
                ROWS_AGAINST_PAIRS(2)
                ROWS_AGAINST_PAIRS(1)
            }
        }
    }
}
#undef ROWS_AGAINST_PAIRS

/* scores: with q's pairs (qb) and a bfloat16 K, their dot products; else
 * the floats' kernels. */
AVX512BF16 static void scores_avx512bf16(const float *q, int64_t M, int64_t D, enum npattn_dtype kt,
                                         const struct npattn_dequant *dq, const struct npattn_span *spans,
                                         int64_t n_span, int64_t ldk, const uint32_t *qb, float *st, int64_t ldst) {
    if (kt == NPATTN_DTYPE_BF16 && qb) pairs_scores(q, qb, M, D, spans, n_span, ldk, st, ldst);
    else vec_scores(q, M, D, kt, dq, spans, n_span, ldk, NULL, st, ldst);
}

/* The pair (k[2p], k[2p + 1]) in every lane. */
AVX512BF16 INLINE __m512bh pair_at(const uint16_t *k, int64_t p) {
    int32_t w;
    memcpy(&w, k + 2 * p, sizeof w);
    return (__m512bh)_mm512_set1_epi32(w);
}

/* st rows j0 .. j0 + NJ, 16 * NV columns from r0 (live lanes m of the last),
 * of K Q^T: NJ * NV accumulators, one broadcast pair of each key row against
 * NV vectors of query pairs per step. */
#define SCORES_BF16_BLOCK(NJ, NV)                                                                                   \
    AVX512BF16 static void scores_bf16_##NJ##x##NV(const uint32_t *qp, int64_t ldq, int64_t np, const uint16_t *k, \
                                                  int64_t ldk, float *st, int64_t ldst, __mmask16 m) {            \
        __m512 acc[NJ][NV];                                                                                         \
        for (int j = 0; j < NJ; j++)                                                                                \
            for (int v = 0; v < NV; v++) acc[j][v] = _mm512_setzero_ps();                                           \
        for (int64_t p = 0; p < np; p++) {                                                                          \
            __m512bh q[NV];                                                                                         \
            for (int v = 0; v < NV; v++) q[v] = (__m512bh)_mm512_loadu_si512(qp + p * ldq + 16 * v);               \
            for (int j = 0; j < NJ; j++) {                                                                          \
                const __m512bh kj = pair_at(k + j * ldk, p);                                                        \
                for (int v = 0; v < NV; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], q[v], kj);                     \
            }                                                                                                       \
        }                                                                                                           \
        for (int j = 0; j < NJ; j++)                                                                                \
            for (int v = 0; v < NV; v++)                                                                            \
                _mm512_mask_storeu_ps(st + j * ldst + 16 * v, v == NV - 1 ? m : (__mmask16)0xFFFF, acc[j][v]);      \
    }
SCORES_BF16_BLOCK(6, 4) SCORES_BF16_BLOCK(1, 4)   /* 64 columns: 6 keys at a time, then 1 */
SCORES_BF16_BLOCK(12, 2) SCORES_BF16_BLOCK(1, 2)  /* 32 columns: 12 keys, then 1 */
SCORES_BF16_BLOCK(12, 1) SCORES_BF16_BLOCK(1, 1)  /* 16 */

AVX512BF16 static void scores_bf16_avx512(const uint32_t *qp, int64_t ldq, int64_t M, int64_t np, const uint16_t *k,
                                          int64_t ldk, int64_t nk, float *st, int64_t ldst) {
    for (int64_t r = 0; r < M; r += 64) {
        const int64_t nv = ((M - r < 64 ? M - r : 64) + 15) / 16;
        const __mmask16 m = lanes(M - r, nv - 1);
        const uint32_t *q = qp + r;
        float *s = st + r;
        int64_t j = 0;
        if (nv == 4) {
            for (; j + 6 <= nk; j += 6) scores_bf16_6x4(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m);
            for (; j < nk; j++) scores_bf16_1x4(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m);
        } else if (nv == 3 || nv == 2) { /* three vectors: two, then one */
            const __mmask16 m2 = nv == 2 ? m : (__mmask16)0xFFFF;
            for (; j + 12 <= nk; j += 12) scores_bf16_12x2(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m2);
            for (; j < nk; j++) scores_bf16_1x2(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m2);
            if (nv == 3) {
                for (j = 0; j + 12 <= nk; j += 12)
                    scores_bf16_12x1(q + 32, ldq, np, k + j * ldk, ldk, s + 32 + j * ldst, ldst, m);
                for (; j < nk; j++) scores_bf16_1x1(q + 32, ldq, np, k + j * ldk, ldk, s + 32 + j * ldst, ldst, m);
            }
        } else {
            for (; j + 12 <= nk; j += 12) scores_bf16_12x1(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m);
            for (; j < nk; j++) scores_bf16_1x1(q, ldq, np, k + j * ldk, ldk, s + j * ldst, ldst, m);
        }
    }
}

/* o rows r0 .. r0 + NR, 16 * NV columns (live lanes m of the last) += P @ V:
 * one broadcast pair of weights per row against NV vectors of value pairs
 * per step, o in registers. */
#define ACCUMULATE_BF16_BLOCK(NR, NV)                                                                                \
    AVX512BF16 static void accumulate_bf16_##NR##x##NV(const uint32_t *pp, int64_t ldp, int64_t np,                  \
                                                      const uint32_t *vp, int64_t ldv, float *o, int64_t ldo,        \
                                                      __mmask16 m) {                                                 \
        __m512 acc[NR][NV];                                                                                          \
        for (int r = 0; r < NR; r++)                                                                                 \
            for (int v = 0; v < NV; v++)                                                                             \
                acc[r][v] = _mm512_maskz_loadu_ps(v == NV - 1 ? m : (__mmask16)0xFFFF, o + r * ldo + 16 * v);        \
        for (int64_t p = 0; p < np; p++) {                                                                           \
            __m512bh x[NV];                                                                                          \
            for (int v = 0; v < NV; v++) x[v] = (__m512bh)_mm512_loadu_si512(vp + p * ldv + 16 * v);                 \
            for (int r = 0; r < NR; r++) {                                                                           \
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)pp[p * ldp + r]);                            \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, x[v]);                       \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < NR; r++)                                                                                 \
            for (int v = 0; v < NV; v++)                                                                             \
                _mm512_mask_storeu_ps(o + r * ldo + 16 * v, v == NV - 1 ? m : (__mmask16)0xFFFF, acc[r][v]);         \
    }
ACCUMULATE_BF16_BLOCK(6, 4) ACCUMULATE_BF16_BLOCK(1, 4)   /* 64 columns: 6 rows at a time, then 1 */
ACCUMULATE_BF16_BLOCK(12, 2) ACCUMULATE_BF16_BLOCK(1, 2)  /* 32 columns: 12 rows, then 1 */
ACCUMULATE_BF16_BLOCK(12, 1) ACCUMULATE_BF16_BLOCK(1, 1)  /* 16 */

AVX512BF16 static void accumulate_bf16_avx512(const uint32_t *pp, int64_t ldp, int64_t M, int64_t np,
                                              const uint32_t *vp, int64_t ldv, int64_t Dv, float *o) {
    for (int64_t e = 0; e < Dv; e += 64) {
        const int64_t nv = ((Dv - e < 64 ? Dv - e : 64) + 15) / 16;
        const __mmask16 m = lanes(Dv - e, nv - 1);
        const uint32_t *x = vp + e;
        float *oe = o + e;
        int64_t r = 0;
        if (nv == 4) {
            for (; r + 6 <= M; r += 6) accumulate_bf16_6x4(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m);
            for (; r < M; r++) accumulate_bf16_1x4(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m);
        } else if (nv == 3 || nv == 2) {
            const __mmask16 m2 = nv == 2 ? m : (__mmask16)0xFFFF;
            for (; r + 12 <= M; r += 12) accumulate_bf16_12x2(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m2);
            for (; r < M; r++) accumulate_bf16_1x2(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m2);
            if (nv == 3) {
                for (r = 0; r + 12 <= M; r += 12)
                    accumulate_bf16_12x1(pp + r, ldp, np, x + 32, ldv, oe + 32 + r * Dv, Dv, m);
                for (; r < M; r++) accumulate_bf16_1x1(pp + r, ldp, np, x + 32, ldv, oe + 32 + r * Dv, Dv, m);
            }
        } else {
            for (; r + 12 <= M; r += 12) accumulate_bf16_12x1(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m);
            for (; r < M; r++) accumulate_bf16_1x1(pp + r, ldp, np, x, ldv, oe + r * Dv, Dv, m);
        }
    }
}

/* ---- the streamed P @ V of a bfloat16 V by the dot products (kernels.h's
 * accumulate_pairs) ---- */

#define PAIRS_KEYS 256 /* keys whose rows' addresses accumulate_pairs takes from the spans at a time */

/* The 32 columns (`left` of them live) at `to` from pairs_block's sums of a
 * chunk, lo and hi, whose 128-bit lanes hold columns 0-3, 8-11, 16-19, 24-27
 * and the 4 after each: in column order, written (first) or added. */
AVX512BF16 INLINE void pairs_put(__m512 lo, __m512 hi, float *to, int64_t left, int first) {
    const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, 0x44), t1 = _mm512_shuffle_f32x4(lo, hi, 0xEE); /* lo 0 1 hi 0 1; 2 3 */
    __m512 c0 = _mm512_shuffle_f32x4(t0, t0, 0xD8), c1 = _mm512_shuffle_f32x4(t1, t1, 0xD8);
    const __mmask16 m0 = lanes(left, 0), m1 = lanes(left, 1);
    if (!first) {
        c0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, to), c0);
        c1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, to + 16), c1);
    }
    _mm512_mask_storeu_ps(to, m0, c0);
    _mm512_mask_storeu_ps(to + 16, m1, c1);
}

/* o's nr rows at the 16 * nv columns from e (nv 2 or 4: one or two chunks
 * of 32 values of each row of V) = P @ V over the n keys whose rows (and
 * rows ahead) are given, the sums in registers (pairs_put), written to o
 * (first) or added. Where pf, the pass prefetches its chunks of the rows
 * ahead. *least gathers V's values for the subnormal check (bf16_least). */
AVX512BF16 INLINE void pairs_block(const int nr, const int nv, const uint32_t *pw, int64_t ldw, const void *const *rows,
                                   const void *const *ahead, int64_t n, int64_t p0, int64_t Dv, int64_t e, float *o,
                                   int first, __m512i *least, const int pf) {
    __m512 acc[8][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    __mmask32 live[2];
    for (int h = 0; h < nv / 2; h++) live[h] = lanes32(Dv, e + 32 * h);
    __m512i seen = *least;
    for (int64_t a = 0; a < n; a += 2) {
        /* keys a and a + 1: each 32 values of both rows loaded (the second
         * zeros past an odd count), interleaved by unpacklo/hi into pairs
         * (columns 0-3, 8-11, 16-19, 24-27 of the 32, then the others),
         * then one broadcast pair of weights per row against them */
        const int two = a + 1 < n;
        const uint16_t *x0 = (const uint16_t *)rows[a] + e, *x1 = (const uint16_t *)rows[a + two] + e;
        if (pf)
            for (int64_t b = 0; b < 32 * nv; b += 64) {
                _mm_prefetch((const char *)((const uint16_t *)ahead[a] + e) + b, _MM_HINT_T1);
                _mm_prefetch((const char *)((const uint16_t *)ahead[a + two] + e) + b, _MM_HINT_T1);
            }
        __m512bh y[4];
        for (int h = 0; h < nv / 2; h++) {
            const __m512i r0 = _mm512_maskz_loadu_epi16(live[h], x0 + 32 * h);
            const __m512i r1 = _mm512_maskz_loadu_epi16(two ? live[h] : 0, x1 + 32 * h);
            seen = bf16_least(bf16_least(seen, r0), r1);
            y[2 * h] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            y[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
        for (int r = 0; r < nr; r++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int32_t)pw[r * ldw + p0 + a / 2]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, y[v]);
        }
    }
    *least = seen;
    /* (these loops not unrolled before the sums get their registers, GCC
     * kept acc in memory, stored at every step) */
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 2
        for (int v = 1; v < nv; v += 2)
            pairs_put(acc[r][v - 1], acc[r][v], o + r * Dv + e + 16 * (v - 1), Dv - e - 16 * (v - 1), first);
}

/* pairs_block for nr rows, specialised: the case nr of a switch; the first
 * block of rows (r == 0) prefetches. */
#define PAIRS_BLOCK(nr, nv)                                                                                          \
    case nr:                                                                                                         \
        if (r == 0) pairs_block(nr, nv, pw + r * ldw, ldw, rows, ahead, n, p0, Dv, e, o + r * Dv, first, &least, 1);   \
        else pairs_block(nr, nv, pw + r * ldw, ldw, rows, ahead, n, p0, Dv, e, o + r * Dv, first, &least, 0);          \
        break;

/* PAIRS_KEYS keys at a time, their rows' addresses taken once for every
 * block: up to 4 rows in one block of 64 columns at a time; more in blocks
 * of 8 rows of 32 columns: 16 sums in registers. */
AVX512BF16 static int accumulate_pairs_avx512(const uint16_t *pb, int64_t ldp, int64_t M,
                                              const struct npattn_span *spans, int64_t n_span, int64_t ldv,
                                              int64_t Dv, float *o) {
    const uint32_t *pw = (const uint32_t *)pb;
    const int64_t ldw = ldp / 2;
    __m512i least = BF16_NONE_SEEN;
    int64_t si = 0, i = 0;
    for (int64_t p0 = 0, first = 1;; p0 += PAIRS_KEYS / 2, first = 0) {
        const void *rows[PAIRS_KEYS], *ahead[PAIRS_KEYS];
        const int64_t n = npattn_span_rows(spans, n_span, &si, &i, 2 * ldv, PAIRS_KEYS, rows, ahead);
        if (n == 0) {
            if (first) memset(o, 0, (size_t)(M * Dv) * sizeof *o); /* no keys */
            break;
        }
        if (M <= 4)
            for (int64_t e = 0, r = 0; e < Dv; e += 64) switch (M) {
                    PAIRS_BLOCK(4, 4) PAIRS_BLOCK(3, 4) PAIRS_BLOCK(2, 4) PAIRS_BLOCK(1, 4)
                default: break;
                }
        else
            for (int64_t e = 0; e < Dv; e += 32)
                for (int64_t r = 0; r < M; r += 8) switch (M - r < 8 ? M - r : 8) {
                        PAIRS_BLOCK(8, 2) PAIRS_BLOCK(7, 2) PAIRS_BLOCK(6, 2) PAIRS_BLOCK(5, 2)
                        PAIRS_BLOCK(4, 2) PAIRS_BLOCK(3, 2) PAIRS_BLOCK(2, 2) PAIRS_BLOCK(1, 2)
                    default: break;
                    }
    }
    return bf16_any_subnormal(least);
}
#undef PAIRS_BLOCK

/* kernels.h's bf16_loop: VEC_FMA_CHAINS chains of vdpbf16ps, 64 flops
 * each (16 lanes, two products a lane). */
AVX512BF16 static double bf16_loop_avx512(int64_t n, float *sink) {
    __m512 acc[VEC_FMA_CHAINS];
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3F803F80), y = (__m512bh)_mm512_set1_epi32(0x33D633D6); /* 1, 1e-7 */
    for (int i = 0; i < VEC_FMA_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < VEC_FMA_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    __m512 s = acc[0];
    for (int i = 1; i < VEC_FMA_CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    *sink = _mm512_reduce_add_ps(s);
    return 64.0 * VEC_FMA_CHAINS * (double)n;
}

/* The float32 kernels but scores, and the bfloat16 pairs, shared by the
 * AVX-512 tables. */
#define AVX512_F32_KERNELS                                                                                           \
    VEC_TABLE_KERNELS, .accumulate_ahead = accumulate_ahead_avx512, .transpose_f32 = npattn_transpose_f32_avx2,       \
    .finish_rows = vec_finish_rows
#define AVX512_BF16_PAIRS                                                                                            \
    .pair_f32 = pair_f32_avx512, .bf16_f32 = bf16_f32_avx512, .pair_bf16 = pair_bf16_avx512,                           \
    .bf16_loop = bf16_loop_avx512

const struct npattn_kernels npattn_kernels_avx512bf16 = {
    .name = "avx512bf16",
    AVX512_F32_KERNELS,
    .scores = scores_avx512bf16,
    .q_tiles = q_pairs_avx512,
    .bf16_d_step = 2,
    AVX512_BF16_PAIRS,
    .scores_bf16 = scores_bf16_avx512,
    .accumulate_bf16 = accumulate_bf16_avx512,
    .accumulate_pairs = accumulate_pairs_avx512,
};

#if NPATTN_HAVE_AMX
const struct npattn_kernels npattn_kernels_amx = {
    .name = "amx",
    AVX512_F32_KERNELS,
    .scores = npattn_amx_scores,
    .q_tiles = npattn_amx_q_tiles,
    .bf16_d_step = 32,
    .bf16_tile = 256,
    .bf16_tile_width = NPATTN_AMX_MAX_D,
    AVX512_BF16_PAIRS,
    .scores_bf16 = npattn_amx_scores_bf16, .accumulate_bf16 = npattn_amx_accumulate_bf16, /* the tiles */
    .softmax_tiles_f32 = softmax_tiles_avx512, .accumulate_tiles_bf16 = npattn_amx_accumulate_tiles_bf16,
    .split_tiles = npattn_amx_split_tiles, .exact_tiles = npattn_amx_exact_tiles,
    .k_tiles = npattn_amx_k_tiles, .prefill_tiles_bf16 = npattn_amx_prefill_tiles_bf16,
    .tile_loop = npattn_amx_tile_loop,
};
#endif

const struct npattn_kernels npattn_kernels_avx512 = {
    .name = "avx512",
    AVX512_F32_KERNELS,
    .scores = vec_scores,
};
#endif

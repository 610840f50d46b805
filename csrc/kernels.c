/* kernels.c: the online-softmax step over a tile of scores, and float16 /
 * bfloat16 conversions: the only place where SIMD and CPU dispatch live.
 *
 * Scores arrive transposed, one column per query row, in base-2 units (the
 * driver folds scale * log2(e) into q), so the exponential is exp2. One call
 * turns each column into probabilities relative to the column's new running
 * max and updates that max and the running sum: online softmax,
 * FlashAttention-2 (arXiv:2307.08691), Algorithm 1.
 *
 * float32 has three variants of the same arithmetic, chosen at run time:
 * AVX-512F, AVX2+FMA, and portable C. float64 is portable C on libm's exp2.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define NPATTN_X86 1
#include <immintrin.h>
#endif

/* exp2 on [-0.5, 0.5]: Cephes exp2f's polynomial, relative error < 2e-7. */
#define EXP2_C6 1.535336188319500e-4f
#define EXP2_C5 1.339887440266574e-3f
#define EXP2_C4 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C2 2.402264791363012e-1f
#define EXP2_C1 6.931472028550421e-1f
/* Below 2^-126 (the smallest normal float) the weight is taken as 0. */
#define EXP2_MIN -126.0f

/* ---- portable C ---- */

/* 2^x for x <= 0, not NaN: 2^n (exponent bits) times the polynomial at x - n. */
static inline float exp2_nonpos(float x) {
    float xc = x < EXP2_MIN ? EXP2_MIN : x;
    float n = (xc + 12582912.0f) - 12582912.0f; /* round to nearest, 1.5 * 2^23 */
    float f = xc - n;
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float pow2n;
    memcpy(&pow2n, &bits, sizeof pow2n);
    return x < EXP2_MIN ? 0.0f : p * pow2n;
}

/* The exact path, for columns r0..r1 that hold NaN or +inf (and for all of
 * float64): libm's exp2, which propagates them as the formula does. Written
 * once for float and double. */
#define DEFINE_COLS_EXACT(NAME, REAL, EXP2)                                                                  \
    static void NAME(REAL *st, int64_t nk, int64_t M, int64_t r0, int64_t r1, REAL *m, REAL *l, REAL *alpha) { \
        for (int64_t r = r0; r < r1; r++) {                                                                   \
            REAL mx = m[r];                                                                                   \
            int nan = mx != mx;                                                                               \
            for (int64_t j = 0; j < nk; j++) {                                                                \
                REAL x = st[j * M + r];                                                                       \
                nan |= x != x;                                                                                \
                mx = x > mx ? x : mx;                                                                         \
            }                                                                                                 \
            if (nan) mx = (REAL)NAN;                                                                          \
            if (mx == -(REAL)INFINITY) { /* nothing visible yet: contribute nothing */                        \
                for (int64_t j = 0; j < nk; j++) st[j * M + r] = 0;                                           \
                alpha[r] = 1;                                                                                 \
                continue;                                                                                     \
            }                                                                                                 \
            REAL a = EXP2(m[r] - mx), sum = 0;                                                                \
            for (int64_t j = 0; j < nk; j++) {                                                                \
                REAL p = EXP2(st[j * M + r] - mx);                                                            \
                st[j * M + r] = p;                                                                            \
                sum += p;                                                                                     \
            }                                                                                                 \
            l[r] = l[r] * a + sum;                                                                            \
            m[r] = mx;                                                                                        \
            alpha[r] = a;                                                                                     \
        }                                                                                                     \
    }

DEFINE_COLS_EXACT(cols_exact, float, exp2f)
DEFINE_COLS_EXACT(cols_exact_f64, double, exp2)

/* Columns r0..r1, sweeping rows: alpha holds the column max until the end. */
static void cols_portable_range(float *st, int64_t nk, int64_t M, int64_t r0, int64_t r1, float *m, float *l,
                                float *alpha) {
    /* NaN or +inf in the scores or the running max (a sink) takes the exact path */
    int bad = 0;
    for (int64_t r = r0; r < r1; r++) {
        alpha[r] = m[r];
        bad |= (m[r] != m[r]) | (m[r] == INFINITY);
    }
    for (int64_t j = 0; j < nk; j++) {
        const float *row = st + j * M;
        for (int64_t r = r0; r < r1; r++) {
            float x = row[r];
            bad |= (x != x) | (x == INFINITY);
            alpha[r] = x > alpha[r] ? x : alpha[r];
        }
    }
    if (bad) {
        cols_exact(st, nk, M, r0, r1, m, l, alpha);
        return;
    }
    /* a column that saw nothing keeps max -inf; exponentiate it against 0, giving zeros */
    for (int64_t r = r0; r < r1; r++) {
        float mx = alpha[r], shift = mx == -INFINITY ? 0.0f : mx;
        float a = exp2_nonpos(m[r] - shift);
        l[r] *= a;
        m[r] = mx;
        alpha[r] = a;
    }
    for (int64_t j = 0; j < nk; j++) {
        float *row = st + j * M;
        for (int64_t r = r0; r < r1; r++) {
            float shift = m[r] == -INFINITY ? 0.0f : m[r];
            float p = exp2_nonpos(row[r] - shift);
            row[r] = p;
            l[r] += p;
        }
    }
}

static void cols_portable(float *st, int64_t nk, int64_t M, float *m, float *l, float *alpha) {
    cols_portable_range(st, nk, M, 0, M, m, l, alpha);
}

/* ---- AVX2 + FMA: 8 columns at a time ---- */

#ifdef NPATTN_X86
__attribute__((target("avx2,fma"))) static inline __m256 exp2_avx2(__m256 x) {
    const __m256 vmin = _mm256_set1_ps(EXP2_MIN);
    __m256 keep = _mm256_cmp_ps(x, vmin, _CMP_GE_OQ);
    x = _mm256_max_ps(x, vmin);
    __m256 nf = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, nf);
    __m256 p = _mm256_set1_ps(EXP2_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

__attribute__((target("avx2,fma"))) static void cols_avx2(float *st, int64_t nk, int64_t M, float *m, float *l,
                                                        float *alpha) {
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) {
        __m256 vm = _mm256_loadu_ps(m + r), mx = vm;
        __m256 bad = _mm256_or_ps(_mm256_cmp_ps(vm, vm, _CMP_UNORD_Q), _mm256_cmp_ps(vm, inf, _CMP_EQ_OQ));
        for (int64_t j = 0; j < nk; j++) {
            __m256 x = _mm256_loadu_ps(st + j * M + r);
            mx = _mm256_max_ps(mx, x);
            bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), _mm256_cmp_ps(x, inf, _CMP_EQ_OQ)));
        }
        if (_mm256_movemask_ps(bad)) {
            cols_exact(st, nk, M, r, r + 8, m, l, alpha);
            continue;
        }
        __m256 shift = _mm256_blendv_ps(mx, zero, _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ));
        __m256 a = exp2_avx2(_mm256_sub_ps(vm, shift)), sum = zero;
        for (int64_t j = 0; j < nk; j++) {
            __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(st + j * M + r), shift));
            _mm256_storeu_ps(st + j * M + r, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
        _mm256_storeu_ps(m + r, mx);
        _mm256_storeu_ps(alpha + r, a);
    }
    if (r < M) cols_portable_range(st, nk, M, r, M, m, l, alpha);
}

/* ---- AVX-512F: 16 columns at a time, masked tails ---- */

__attribute__((target("avx512f"))) static inline __m512 exp2_avx512(__m512 x) {
    const __m512 vmin = _mm512_set1_ps(EXP2_MIN);
    __mmask16 keep = _mm512_cmp_ps_mask(x, vmin, _CMP_GE_OQ);
    x = _mm512_max_ps(x, vmin);
    __m512 nf = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, nf);
    __m512 p = _mm512_set1_ps(EXP2_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, nf); /* p * 2^n, 0 below 2^-126 */
}

__attribute__((target("avx512f"))) static void cols_avx512(float *st, int64_t nk, int64_t M, float *m, float *l,
                                                          float *alpha) {
    const __m512 inf = _mm512_set1_ps(INFINITY), ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    for (int64_t r = 0; r < M; r += 16) {
        __mmask16 live = M - r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (M - r)) - 1);
        __m512 vm = _mm512_maskz_loadu_ps(live, m + r), mx = vm;
        __mmask16 bad = _mm512_cmp_ps_mask(vm, vm, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(vm, inf, _CMP_EQ_OQ);
        for (int64_t j = 0; j < nk; j++) {
            __m512 x = _mm512_maskz_loadu_ps(live, st + j * M + r);
            mx = _mm512_max_ps(mx, x);
            bad |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x, inf, _CMP_EQ_OQ);
        }
        if (bad) {
            cols_exact(st, nk, M, r, M - r >= 16 ? r + 16 : M, m, l, alpha);
            continue;
        }
        __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx, zero);
        __m512 a = exp2_avx512(_mm512_sub_ps(vm, shift)), sum = zero;
        for (int64_t j = 0; j < nk; j++) {
            __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, st + j * M + r), shift));
            _mm512_mask_storeu_ps(st + j * M + r, live, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_mask_storeu_ps(l + r, live, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, l + r), a, sum));
        _mm512_mask_storeu_ps(m + r, live, mx);
        _mm512_mask_storeu_ps(alpha + r, live, a);
    }
}
#endif

/* ---- streaming kernels for decode: each key and value row read once ---- */

#ifdef NPATTN_X86
/* Lanes of chunk c (16 floats) of a row of width n. */
__attribute__((target("avx512f"))) static inline __mmask16 lanes(int64_t n, int64_t c) {
    int64_t left = n - 16 * c;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* The 16 sums of v[0..15], lane i = sum of v[i]: a transpose-and-add tree
 * (15 adds, 30 shuffles) instead of 16 horizontal reductions. */
__attribute__((target("avx512f"))) static inline __m512 sum16(const __m512 v[16]) {
    __m512 b[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *w = v + 4 * g;
        /* within each 128-bit lane: partial sums of w0, w1 (then w2, w3) interleaved */
        __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        /* each 128-bit lane now holds one partial sum of w0, w1, w2, w3 */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
        b[g] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* add the four 128-bit lanes, group g ending in lane g */
    __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

/* st (nk, M) = scores of the M rows of q (M, D) against nk rows of k:
 * 4 keys by 4 query rows at a time, 16 products per loaded pair of vectors. */
__attribute__((target("avx512f"))) static void scores_avx512(const float *q, int64_t M, int64_t D, const float *k,
                                                            int64_t ldk, int64_t nk, float *st) {
    int64_t j = 0;
    for (; j + 4 <= nk && M >= 4; j += 4) {
        const float *kr = k + j * ldk;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            __m512 acc[16]; /* acc[4 * key + row] */
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t c = 0; 16 * c < D; c++) {
                __mmask16 m = lanes(D, c);
                __m512 kv[4], qv[4];
                for (int a = 0; a < 4; a++) kv[a] = _mm512_maskz_loadu_ps(m, kr + a * ldk + 16 * c);
                for (int b = 0; b < 4; b++) qv[b] = _mm512_maskz_loadu_ps(m, q + (r + b) * D + 16 * c);
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < 4; b++) acc[4 * a + b] = _mm512_fmadd_ps(kv[a], qv[b], acc[4 * a + b]);
            }
            __m512 sums = sum16(acc); /* lanes 4a..4a+3: key j + a, rows r..r+3 */
            _mm_storeu_ps(st + (j + 0) * M + r, _mm512_extractf32x4_ps(sums, 0));
            _mm_storeu_ps(st + (j + 1) * M + r, _mm512_extractf32x4_ps(sums, 1));
            _mm_storeu_ps(st + (j + 2) * M + r, _mm512_extractf32x4_ps(sums, 2));
            _mm_storeu_ps(st + (j + 3) * M + r, _mm512_extractf32x4_ps(sums, 3));
        }
        for (; r < M; r++)
            for (int a = 0; a < 4; a++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; 16 * c < D; c++) {
                    __mmask16 m = lanes(D, c);
                    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, kr + a * ldk + 16 * c),
                                          _mm512_maskz_loadu_ps(m, q + r * D + 16 * c), acc);
                }
                st[(j + a) * M + r] = _mm512_reduce_add_ps(acc);
            }
    }
    for (; j < nk; j++)
        for (int64_t r = 0; r < M; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; 16 * c < D; c++) {
                __mmask16 m = lanes(D, c);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, k + j * ldk + 16 * c),
                                      _mm512_maskz_loadu_ps(m, q + r * D + 16 * c), acc);
            }
            st[j * M + r] = _mm512_reduce_add_ps(acc);
        }
}

/* o (M, Dv) += P (M, nk) @ v (nk, Dv), P given as st (nk, M): 4 rows by 64
 * columns of o in registers while the value rows stream past. */
__attribute__((target("avx512f"))) static void accumulate_avx512(const float *st, int64_t M, int64_t nk,
                                                                const float *v, int64_t ldv, int64_t Dv, float *o) {
    for (int64_t e0 = 0; e0 < Dv; e0 += 64) {
        const int64_t w = Dv - e0;
        __mmask16 m[4];
        for (int c = 0; c < 4; c++) m[c] = lanes(w, c);
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            __m512 acc[16]; /* acc[4 * row + chunk] */
            for (int a = 0; a < 4; a++)
                for (int c = 0; c < 4; c++) acc[4 * a + c] = _mm512_maskz_loadu_ps(m[c], o + (r + a) * Dv + e0 + 16 * c);
            for (int64_t j = 0; j < nk; j++) {
                const float *vr = v + j * ldv + e0;
                __m512 vv[4];
                for (int c = 0; c < 4; c++) vv[c] = _mm512_maskz_loadu_ps(m[c], vr + 16 * c);
                for (int a = 0; a < 4; a++) {
                    __m512 pa = _mm512_set1_ps(st[j * M + r + a]);
                    for (int c = 0; c < 4; c++) acc[4 * a + c] = _mm512_fmadd_ps(pa, vv[c], acc[4 * a + c]);
                }
            }
            for (int a = 0; a < 4; a++)
                for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(o + (r + a) * Dv + e0 + 16 * c, m[c], acc[4 * a + c]);
        }
        for (; r < M; r++) {
            __m512 acc[4];
            for (int c = 0; c < 4; c++) acc[c] = _mm512_maskz_loadu_ps(m[c], o + r * Dv + e0 + 16 * c);
            for (int64_t j = 0; j < nk; j++) {
                __m512 pa = _mm512_set1_ps(st[j * M + r]);
                for (int c = 0; c < 4; c++)
                    acc[c] = _mm512_fmadd_ps(pa, _mm512_maskz_loadu_ps(m[c], v + j * ldv + e0 + 16 * c), acc[c]);
            }
            for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(o + r * Dv + e0 + 16 * c, m[c], acc[c]);
        }
    }
}
#endif

/* ---- dispatch ---- */

struct simd {
    void (*cols)(float *, int64_t, int64_t, float *, float *, float *);
    const char *name;
};

static const struct simd simd_portable = {cols_portable, "portable"};
#ifdef NPATTN_X86
static const struct simd simd_avx2 = {cols_avx2, "avx2"};
static const struct simd simd_avx512 = {cols_avx512, "avx512"};
#endif

static const struct simd *_Atomic simd_chosen;

static const struct simd *simd_best(void) {
#ifdef NPATTN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &simd_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &simd_avx2;
#endif
    return &simd_portable;
}

static const struct simd *simd(void) {
    const struct simd *s = simd_chosen;
    if (!s) simd_chosen = s = simd_best();
    return s;
}

const char *npattn_simd_name(void) { return simd()->name; }

int npattn_simd_force(const char *name) {
    const struct simd *best = simd_best(), *want = NULL;
    if (!name || !*name) want = best;
    else if (!strcmp(name, "portable")) want = &simd_portable;
#ifdef NPATTN_X86
    else if (!strcmp(name, "avx2") && (best == &simd_avx2 || best == &simd_avx512)) want = &simd_avx2;
    else if (!strcmp(name, "avx512") && best == &simd_avx512) want = &simd_avx512;
#endif
    if (!want) return -1;
    simd_chosen = want;
    return 0;
}

/* ---- the streaming kernels, dispatched ---- */

int npattn_stream_available(void) {
#ifdef NPATTN_X86
    return simd() == &simd_avx512;
#else
    return 0;
#endif
}

void npattn_scores_rows_f32(const float *q, int64_t M, int64_t D, const float *k, int64_t ldk, int64_t nk,
                            float *st) {
#ifdef NPATTN_X86
    if (simd() == &simd_avx512) {
        scores_avx512(q, M, D, k, ldk, nk, st);
        return;
    }
#endif
    for (int64_t j = 0; j < nk; j++)
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * k[j * ldk + d];
            st[j * M + r] = acc;
        }
}

void npattn_accumulate_rows_f32(const float *st, int64_t M, int64_t nk, const float *v, int64_t ldv, int64_t Dv,
                                float *o) {
#ifdef NPATTN_X86
    if (simd() == &simd_avx512) {
        accumulate_avx512(st, M, nk, v, ldv, Dv, o);
        return;
    }
#endif
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < nk; j++)
            for (int64_t e = 0; e < Dv; e++) o[r * Dv + e] += st[j * M + r] * v[j * ldv + e];
}

/* ---- float16 and bfloat16 rows, to and from float32 ---- */

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal: man * 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> float16, round to nearest even; overflow to inf; NaN stays NaN. */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u;      /* NaN */
    if (ax >= 0x477FF000u) return sign | 0x7C00u;     /* rounds to >= 65520: inf */
    if (ax >= 0x38800000u) {                          /* normal in float16 */
        uint32_t r = ax + 0x0FFFu + ((ax >> 13) & 1u); /* round to nearest even at bit 13 */
        return sign | (uint16_t)((r - 0x38000000u) >> 13);
    }
    if (ax < 0x33000000u) return sign;                /* below half the smallest subnormal */
    /* subnormal: the value in units of 2^-24, rounded to nearest even */
    uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e;                          /* 14 .. 24 */
    uint32_t half = 1u << (shift - 1), rest = m & ((1u << shift) - 1), q = m >> shift;
    if (rest > half || (rest == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

static float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even; NaN stays NaN. */
static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

#ifdef NPATTN_X86
__attribute__((target("avx2,f16c"))) static void f16_row_f16c(const uint16_t *src, int64_t n, float *dst) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
    for (; j < n; j++) dst[j] = f16_to_f32(src[j]);
}
#endif

void npattn_row_to_f32(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, float *dst) {
    if (dtype == NPATTN_DTYPE_F32) {
        const float *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = s[j * stride];
    } else if (dtype == NPATTN_DTYPE_BF16) {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = bf16_to_f32(s[j * stride]);
    } else {
        const uint16_t *s = src;
#ifdef NPATTN_X86
        if (stride == 1 && simd() != &simd_portable && __builtin_cpu_supports("f16c")) {
            f16_row_f16c(s, n, dst);
            return;
        }
#endif
        for (int64_t j = 0; j < n; j++) dst[j] = f16_to_f32(s[j * stride]);
    }
}

void npattn_row_from_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst, int64_t stride) {
    if (dtype == NPATTN_DTYPE_F32) {
        float *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = src[j];
    } else if (dtype == NPATTN_DTYPE_BF16) {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = f32_to_bf16(src[j]);
    } else {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = f32_to_f16(src[j]);
    }
}

/* ---- the step ---- */

void npattn_softmax_cols_f32(float *st, int64_t nk, int64_t M, float *m, float *l, float *alpha) {
    simd()->cols(st, nk, M, m, l, alpha);
}

void npattn_softmax_cols_f64(double *st, int64_t nk, int64_t M, double *m, double *l, double *alpha) {
    cols_exact_f64(st, nk, M, 0, M, m, l, alpha);
}

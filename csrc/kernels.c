/* kernels.c: the online-softmax step over one row of a score tile, the only
 * place where SIMD and CPU dispatch live.
 *
 * Scores arrive in base-2 units (the driver folds scale * log2(e) into q), so
 * the exponential is exp2. One call turns a row of scores into probabilities
 * relative to the new running max and updates that max and the running sum:
 * online softmax, FlashAttention-2 (arXiv:2307.08691), Algorithm 1.
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

/* max(m, max s), or NaN if s holds a NaN */
static float row_max_portable(const float *s, int64_t n, float m) {
    int any_nan = 0;
    for (int64_t j = 0; j < n; j++) {
        m = s[j] > m ? s[j] : m;
        any_nan |= s[j] != s[j];
    }
    return any_nan ? NAN : m;
}

/* s = exp2(s - mx) in place; returns the sum. mx is finite. */
static float exp2_sum_portable(float *s, int64_t n, float mx) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = exp2_nonpos(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* ---- AVX2 + FMA: 8 lanes ---- */

#ifdef NPATTN_X86
__attribute__((target("avx2,fma"))) static float row_max_avx2(const float *s, int64_t n, float m) {
    __m256 vmax = _mm256_set1_ps(m);
    __m256 vnan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        vmax = _mm256_max_ps(vmax, x);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    int any_nan = _mm256_movemask_ps(vnan) != 0;
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; j++) {
        m = s[j] > m ? s[j] : m;
        any_nan |= s[j] != s[j];
    }
    return any_nan ? NAN : m;
}

__attribute__((target("avx2,fma"))) static float exp2_sum_avx2(float *s, int64_t n, float mx) {
    const __m256 vmx = _mm256_set1_ps(mx), vmin = _mm256_set1_ps(EXP2_MIN);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), vmx);
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
        p = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
        _mm256_storeu_ps(s + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, vsum);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (; j < n; j++) {
        s[j] = exp2_nonpos(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* ---- AVX-512F: 16 lanes, masked tails ---- */

__attribute__((target("avx512f"))) static float row_max_avx512(const float *s, int64_t n, float m) {
    __m512 vmax = _mm512_set1_ps(m);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_mask_loadu_ps(vmax, live, s + j);
        vmax = _mm512_max_ps(vmax, x);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    return nan ? NAN : _mm512_reduce_max_ps(vmax);
}

__attribute__((target("avx512f"))) static float exp2_sum_avx512(float *s, int64_t n, float mx) {
    const __m512 vmx = _mm512_set1_ps(mx), vmin = _mm512_set1_ps(EXP2_MIN);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), vmx);
        __mmask16 keep = _mm512_mask_cmp_ps_mask(live, x, vmin, _CMP_GE_OQ);
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
        p = _mm512_maskz_scalef_ps(keep, p, nf); /* p * 2^n */
        _mm512_mask_storeu_ps(s + j, live, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    return _mm512_reduce_add_ps(vsum);
}
#endif

/* ---- dispatch ---- */

struct simd {
    float (*row_max)(const float *, int64_t, float);
    float (*exp2_sum)(float *, int64_t, float);
    const char *name;
};

static const struct simd simd_portable = {row_max_portable, exp2_sum_portable, "portable"};
#ifdef NPATTN_X86
static const struct simd simd_avx2 = {row_max_avx2, exp2_sum_avx2, "avx2"};
static const struct simd simd_avx512 = {row_max_avx512, exp2_sum_avx512, "avx512"};
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

float npattn_softmax_step_f32(float *s, int64_t n, float *m, float *l) {
    const struct simd *v = simd();
    /* the new running max; NaN anywhere makes the row NaN, as the formula does */
    float mx = v->row_max(s, n, *m);
    if (mx == -INFINITY) {
        /* nothing visible yet: contribute nothing, keep the state */
        memset(s, 0, (size_t)n * sizeof *s);
        return 1.0f;
    }
    if (mx != mx || mx == INFINITY) {
        /* NaN or +inf: the exact libm path, which propagates them as the formula does */
        float alpha = exp2f(*m - mx), sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = exp2f(s[j] - mx);
            sum += s[j];
        }
        *l = *l * alpha + sum;
        *m = mx;
        return alpha;
    }
    /* rescale what came before, then exponentiate and sum this tile */
    float alpha = exp2_nonpos(*m - mx);
    *l = *l * alpha + v->exp2_sum(s, n, mx);
    *m = mx;
    return alpha;
}

double npattn_softmax_step_f64(double *s, int64_t n, double *m, double *l) {
    double mx = *m;
    int any_nan = 0;
    for (int64_t j = 0; j < n; j++) {
        mx = s[j] > mx ? s[j] : mx;
        any_nan |= s[j] != s[j];
    }
    if (any_nan) mx = NAN;
    if (mx == -INFINITY) {
        memset(s, 0, (size_t)n * sizeof *s);
        return 1.0;
    }
    double alpha = exp2(*m - mx), sum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        s[j] = exp2(s[j] - mx);
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

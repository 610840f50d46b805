/* kernels/convert.c: float16 and bfloat16 to and from float, rows of any
 * dtype loaded as float or double and stored back, rounded to nearest even,
 * and float rows as the bfloat16 pairs of the dot products. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels.h"

float npattn_f16_to_f32(uint16_t h) {
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

/* float -> float16, round to nearest even; overflow to inf; NaN stays NaN. */
uint16_t npattn_f32_to_f16(float f) {
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

float npattn_bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> bfloat16, round to nearest even; NaN stays NaN. */
uint16_t npattn_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

int npattn_pairs_of_rows(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo) {
    int sub = 0;
    for (int64_t p = 0; 2 * p < n; p++) {
        sub |= npattn_kernels()->pair_f32(x + 2 * p * ldx, 2 * p + 1 < n ? x + (2 * p + 1) * ldx : NULL, w,
                                          out + p * ldo);
        memset(out + p * ldo + w, 0, (size_t)(ldo - w) * sizeof *out);
    }
    return sub;
}

int npattn_bf16_rows(const float *x, int64_t n, int64_t w, int64_t ldx, uint16_t *out, int64_t ldo) {
    int sub = 0;
    for (int64_t r = 0; r < n; r++) {
        sub |= npattn_kernels()->bf16_f32(x + r * ldx, w, out + r * ldo);
        memset(out + r * ldo + w, 0, (size_t)(ldo - w) * sizeof *out);
    }
    return sub;
}

int npattn_pairs_across(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo) {
    /* 16 rows at a time, so that each pair's 16 lanes are one run of out */
    uint16_t half[16][128 + 2];
    int sub = 0;
    for (int64_t r0 = 0; r0 < n; r0 += 16) {
        const int64_t nr = n - r0 < 16 ? n - r0 : 16;
        for (int64_t c0 = 0; c0 < w; c0 += 128) {
            const int64_t nc = w - c0 < 128 ? w - c0 : 128;
            for (int64_t i = 0; i < nr; i++) {
                sub |= npattn_kernels()->bf16_f32(x + (r0 + i) * ldx + c0, nc, half[i]);
                half[i][nc] = 0;
            }
            for (int64_t c = 0; c < nc; c += 2) {
                uint32_t *to = out + (c0 + c) / 2 * ldo + r0;
                for (int64_t i = 0; i < nr; i++) to[i] = half[i][c] | (uint32_t)half[i][c + 1] << 16;
            }
        }
    }
    for (int64_t p = 0; p < (w + 1) / 2; p++) memset(out + p * ldo + n, 0, (size_t)(ldo - n) * sizeof *out);
    return sub;
}

/* A float x as the pair hi | lo << 16 of bfloat16 values: hi is x cut to
 * bfloat16's 8 significant bits, lo x - hi (exact in float) rounded to
 * nearest even, so hi + lo is x within 2^-15 of it. For a float16 value lo
 * holds the 3 bits left exactly, and neither part is subnormal, a float16
 * value's bits lying above 2^-24. An infinity or NaN gives lo NaN. */
static uint32_t split_pair(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t hi_bits = bits & 0xFFFF0000u;
    float hi;
    memcpy(&hi, &hi_bits, sizeof hi);
    return hi_bits >> 16 | (uint32_t)npattn_f32_to_bf16(x - hi) << 16;
}

void npattn_split_f16_row(const uint16_t *h, int64_t w, uint32_t *out) {
    float x[128];
    for (int64_t c0 = 0; c0 < w; c0 += 128) {
        const int64_t nc = w - c0 < 128 ? w - c0 : 128;
        npattn_kernels()->f16_to_f32(h + c0, nc, x);
        for (int64_t c = 0; c < nc; c++) out[c0 + c] = out[w + c0 + c] = split_pair(x[c]);
    }
}

void npattn_split_across(const float *x, int64_t n, int64_t w, int64_t ldx, uint32_t *out, int64_t ldo) {
    for (int64_t c = 0; c < w; c++) {
        uint32_t *hi = out + c * ldo, *lo = out + (w + c) * ldo;
        for (int64_t r = 0; r < n; r++) {
            const uint32_t s = split_pair(x[r * ldx + c]);
            hi[r] = (s & 0xFFFFu) * 0x10001u;
            lo[r] = (s >> 16) * 0x10001u;
        }
        memset(hi + n, 0, (size_t)(ldo - n) * sizeof *out);
        memset(lo + n, 0, (size_t)(ldo - n) * sizeof *out);
    }
}

void npattn_split_f16_twice(const uint16_t *h, int64_t w, uint32_t *hi, uint32_t *lo, int64_t ld) {
    float x[128];
    for (int64_t c0 = 0; c0 < w; c0 += 128) {
        const int64_t nc = w - c0 < 128 ? w - c0 : 128;
        npattn_kernels()->f16_to_f32(h + c0, nc, x);
        for (int64_t c = 0; c < nc; c++) {
            const uint32_t s = split_pair(x[c]);
            hi[c0 + c] = (s & 0xFFFFu) * 0x10001u;
            lo[c0 + c] = (s >> 16) * 0x10001u;
        }
    }
    memset(hi + w, 0, (size_t)(ld - w) * sizeof *hi);
    memset(lo + w, 0, (size_t)(ld - w) * sizeof *lo);
}

int npattn_finish_columns(const float *x, int64_t e0, int64_t w, float inv, enum npattn_dtype dt, void *row) {
    int bad = 0;
    for (int64_t e = e0; e < w; e++) {
        bad |= x[e] - x[e] != 0.0f;
        const float y = inv == 0.0f ? 0.0f : x[e] * inv;
        if (dt == NPATTN_DTYPE_F32) ((float *)row)[e] = y;
        else ((uint16_t *)row)[e] = dt == NPATTN_DTYPE_F16 ? npattn_f32_to_f16(y) : npattn_f32_to_bf16(y);
    }
    return bad;
}

int npattn_finish_rows(const float *o, int64_t n, int64_t w, const float *l, enum npattn_dtype dt, void *dst,
                       int64_t ld) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= npattn_finish_columns(o + i * w, 0, w, npattn_finish_factor(l, i), dt,
                                     (char *)dst + i * ld * npattn_stream_size(dt));
    return bad;
}

void npattn_add_f32(float *o, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] += x[i];
}

int npattn_all_finite_f32(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (u & 0x7FFFFFFFu) >= 0x7F800000u;
    }
    return !bad;
}

/* A double as float, finite values beyond float's range kept finite: a mask
 * of -1e300 still hides nothing, and a finite score stays finite. */
static float narrow(double x) {
    if (x > 3.4028234663852886e38) return x == (double)INFINITY ? (float)x : 3.4028234663852886e38f;
    if (x < -3.4028234663852886e38) return x == -(double)INFINITY ? (float)x : -3.4028234663852886e38f;
    return (float)x;
}

void npattn_load_f32(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, float *dst) {
    switch (dtype) {
    case NPATTN_DTYPE_F32: {
        const float *s = src;
        if (stride == 1) memcpy(dst, s, (size_t)n * sizeof *dst);
        else for (int64_t j = 0; j < n; j++) dst[j] = s[j * stride];
        return;
    }
    case NPATTN_DTYPE_F64: {
        const double *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = narrow(s[j * stride]);
        return;
    }
    case NPATTN_DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = npattn_bf16_to_f32(s[j * stride]);
        return;
    }
    case NPATTN_DTYPE_F16: {
        const uint16_t *s = src;
        if (stride == 1) npattn_kernels()->f16_to_f32(s, n, dst);
        else for (int64_t j = 0; j < n; j++) dst[j] = npattn_f16_to_f32(s[j * stride]);
        return;
    }
    default: return; /* codes: npattn_dequant_f32 */
    }
}

/* Elements j0 .. j0 + n - 1 of a row of codes as the floats they stand for,
 * into dst[0 .. n - 1]: a group at a time, its scale and zero point read once. */
static void dequant_part(const struct npattn_dequant *dq, enum npattn_dtype t, const void *src, int64_t stride,
                         int64_t j0, int64_t n, const void *scale, const void *zero, float *dst) {
    for (int64_t j = j0; j < j0 + n;) {
        const int64_t g = j / dq->group, end = (g + 1) * dq->group < j0 + n ? (g + 1) * dq->group : j0 + n;
        const float s = npattn_stream_elem(dq->scale_type, scale, g * dq->scale_col);
        const float z = dq->zero ? npattn_stream_elem(dq->zero_type, zero, g * dq->zero_col) : 0.0f;
        for (; j < end; j++) {
            const float c = npattn_stream_elem(t, (const uint8_t *)src + j * stride, 0);
            dst[j - j0] = (dq->zero ? c - z : c) * s;
        }
    }
}

void npattn_dequant_f32(const struct npattn_dequant *dq, enum npattn_dtype t, const void *src, int64_t stride, int64_t n,
                        const void *scale, const void *zero, float *dst) {
    dequant_part(dq, t, src, stride, 0, n, scale, zero, dst);
}

void npattn_dequant_f64(const struct npattn_dequant *dq, enum npattn_dtype t, const void *src, int64_t stride, int64_t n,
                        const void *scale, const void *zero, double *dst) {
    float part[256];
    for (int64_t j = 0; j < n; j += 256) {
        const int64_t m = n - j < 256 ? n - j : 256;
        dequant_part(dq, t, src, stride, j, m, scale, zero, part);
        for (int64_t i = 0; i < m; i++) dst[j + i] = part[i];
    }
}

void npattn_load_f64(enum npattn_dtype dtype, const void *src, int64_t stride, int64_t n, double *dst) {
    switch (dtype) {
    case NPATTN_DTYPE_F64: {
        const double *s = src;
        if (stride == 1) memcpy(dst, s, (size_t)n * sizeof *dst);
        else for (int64_t j = 0; j < n; j++) dst[j] = s[j * stride];
        return;
    }
    case NPATTN_DTYPE_F32: {
        const float *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = s[j * stride];
        return;
    }
    case NPATTN_DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = npattn_bf16_to_f32(s[j * stride]);
        return;
    }
    case NPATTN_DTYPE_F16: {
        const uint16_t *s = src;
        for (int64_t j = 0; j < n; j++) dst[j] = npattn_f16_to_f32(s[j * stride]);
        return;
    }
    default: return; /* codes: npattn_dequant_f64 */
    }
}

void npattn_store_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst, int64_t stride) {
    if (stride == 1 && (dtype == NPATTN_DTYPE_F16 || dtype == NPATTN_DTYPE_BF16)) { /* the table's SIMD */
        npattn_kernels()->finish_rows(src, 1, n, NULL, dtype, dst, n);
        return;
    }
    switch (dtype) {
    case NPATTN_DTYPE_F32: {
        float *d = dst;
        if (stride == 1) memcpy(d, src, (size_t)n * sizeof *d);
        else for (int64_t j = 0; j < n; j++) d[j * stride] = src[j];
        return;
    }
    case NPATTN_DTYPE_F64: {
        double *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = src[j];
        return;
    }
    case NPATTN_DTYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = npattn_f32_to_bf16(src[j]);
        return;
    }
    case NPATTN_DTYPE_F16: {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = npattn_f32_to_f16(src[j]);
        return;
    }
    default: return; /* results are never codes */
    }
}

/* Through float for the narrow dtypes: a double already rounded to float
 * rounds the same way again except at exact ties, a few in 2^29. */
void npattn_store_f64(enum npattn_dtype dtype, const double *src, int64_t n, void *dst, int64_t stride) {
    switch (dtype) {
    case NPATTN_DTYPE_F64: {
        double *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = src[j];
        return;
    }
    case NPATTN_DTYPE_F32: {
        float *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = (float)src[j];
        return;
    }
    case NPATTN_DTYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = npattn_f32_to_bf16((float)src[j]);
        return;
    }
    case NPATTN_DTYPE_F16: {
        uint16_t *d = dst;
        for (int64_t j = 0; j < n; j++) d[j * stride] = npattn_f32_to_f16((float)src[j]);
        return;
    }
    default: return; /* results are never codes */
    }
}

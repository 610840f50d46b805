/* kernels/portable.c: the kernels in plain C, for any CPU; the column tails
 * of the SIMD tables; and the double-precision softmax, which is the path of
 * float64 problems and of float tiles that met an extreme. */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* exp(x) for x <= 0, not NaN: 2^n (exponent bits) times the polynomial at
 * the rest, as the SIMD tables compute it. */
static inline float exp_nonpos(float x) {
    float y = x * NPATTN_LOG2E;
    if (!(y >= NPATTN_EXP2_MIN)) return 0.0f;
    float n = (y + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float f = y - n;
    float p = NPATTN_EXP2_C6;
    p = p * f + NPATTN_EXP2_C5;
    p = p * f + NPATTN_EXP2_C4;
    p = p * f + NPATTN_EXP2_C3;
    p = p * f + NPATTN_EXP2_C2;
    p = p * f + NPATTN_EXP2_C1;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float pow2n;
    memcpy(&pow2n, &bits, sizeof pow2n);
    return p * pow2n;
}

/* tanh as the SIMD tables compute it (see kernels.h). */
static inline float tanh_approx(float y) {
    float a = fabsf(y);
    if (a < NPATTN_TANH_SPLIT) {
        float u = y * y;
        float p = NPATTN_TANH_P4;
        p = p * u + NPATTN_TANH_P3;
        p = p * u + NPATTN_TANH_P2;
        p = p * u + NPATTN_TANH_P1;
        p = p * u + NPATTN_TANH_P0;
        return y + y * u * p;
    }
    float e = exp_nonpos(-2.0f * a);
    float t = (1.0f - e) / (1.0f + e);
    return y < 0 ? -t : t;
}

int npattn_softmax_f32_columns(float *st, const struct npattn_score_tile *t, int64_t r0, int64_t r1, float *m,
                               float *l, float *alpha) {
    const int64_t nk = t->nk, ld = t->ld;
    const float scale = t->scale, cap = t->softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    /* Pass 1: the final scores, written back, and each column's max (kept in
     * alpha for now). nf sums x - x, which stays 0 unless a score that is not
     * hidden is NaN or infinite. */
    float nf = 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        alpha[r] = m[r];
        if (m[r] != -INFINITY) nf += m[r] - m[r]; /* a NaN or +inf sink */
    }
    for (int64_t j = 0; j < nk; j++) {
        float *row = st + j * ld;
        const float *brow = t->bias ? t->bias + j * ld : NULL;
        for (int64_t r = r0; r < r1; r++) {
            float x = row[r] * scale;
            float check = x - x;
            int hidden = t->lo && (j < t->lo[r] || j > t->hi[r]);
            if (cap > 0) x = cap * tanh_approx(x * inv_cap);
            if (brow) {
                float b = brow[r];
                if (b == -INFINITY) {
                    hidden = 1;
                } else {
                    x += b;
                    check += x - x;
                }
            }
            if (hidden) x = -INFINITY;
            else nf += check;
            row[r] = x;
            alpha[r] = x > alpha[r] ? x : alpha[r];
        }
    }
    if (nf != 0.0f) return 1;
    /* Pass 2: rescale factors, then probabilities against the new max; a
     * column that saw nothing keeps max -inf and is taken against 0, giving
     * zeros. */
    for (int64_t r = r0; r < r1; r++) {
        float mx = alpha[r], shift = mx == -INFINITY ? 0.0f : mx;
        float a = exp_nonpos(m[r] - shift);
        l[r] *= a;
        m[r] = mx;
        alpha[r] = a;
    }
    for (int64_t j = 0; j < nk; j++) {
        float *row = st + j * ld;
        for (int64_t r = r0; r < r1; r++) {
            float shift = m[r] == -INFINITY ? 0.0f : m[r];
            float p = exp_nonpos(row[r] - shift);
            row[r] = p;
            l[r] += p;
        }
    }
    return 0;
}

static int softmax_portable(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha) {
    return npattn_softmax_f32_columns(st, t, 0, t->M, m, l, alpha);
}

static int softmax_rows_portable(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha) {
    const float scale = t->scale, cap = t->softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    for (int64_t r = 0; r < t->M; r++) {
        float *row = st + r * t->ld;
        const float *brow = t->bias ? t->bias + r * t->ld : NULL;
        /* pass 1: final scores, written back, and the row's max; nf as in the columns */
        float mx = m[r], nf = m[r] != -INFINITY ? m[r] - m[r] : 0.0f;
        for (int64_t j = 0; j < t->nk; j++) {
            float x = row[j] * scale;
            float check = x - x;
            int hidden = t->lo && (j < t->lo[r] || j > t->hi[r]);
            if (cap > 0) x = cap * tanh_approx(x * inv_cap);
            if (brow) {
                if (brow[j] == -INFINITY) {
                    hidden = 1;
                } else {
                    x += brow[j];
                    check += x - x;
                }
            }
            if (hidden) x = -INFINITY;
            else nf += check;
            row[j] = x;
            mx = x > mx ? x : mx;
        }
        if (nf != 0.0f) return 1;
        /* pass 2: probabilities against the new max (0 for a row that saw nothing) */
        float shift = mx == -INFINITY ? 0.0f : mx, a = exp_nonpos(m[r] - shift), sum = 0.0f;
        for (int64_t j = 0; j < t->nk; j++) {
            float p = exp_nonpos(row[j] - shift);
            row[j] = p;
            sum += p;
        }
        l[r] = l[r] * a + sum;
        m[r] = mx;
        alpha[r] = a;
    }
    return 0;
}

int64_t npattn_span_keys(const struct npattn_span *spans, int64_t n_span) {
    int64_t n = 0;
    for (int64_t i = 0; i < n_span; i++) n += spans[i].n;
    return n;
}

static void scores_portable(const float *q, int64_t M, int64_t D, enum npattn_dtype kt, const struct npattn_dequant *dq,
                            const struct npattn_span *spans, int64_t n_span, int64_t ldk, const uint32_t *qb, float *st,
                            int64_t ldst) {
    (void)qb; /* no prefetch, no tiles */
    for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < spans[i].n; j++) {
                const void *kr = npattn_stream_at(kt, spans[i].rows, j * ldk);
                const void *ks = dq ? npattn_span_groups(spans[i].scale, dq->scale_type, dq->scale_row, j) : NULL;
                const void *kz = dq ? npattn_span_groups(spans[i].zero, dq->zero_type, dq->zero_row, j) : NULL;
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += q[r * D + d] * npattn_value_elem(kt, dq, kr, d, ks, kz);
                st[r * ldst + j0 + j] = acc;
            }
}

void npattn_accumulate_columns(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                               int64_t n_span, enum npattn_dtype vt, const struct npattn_dequant *dq, int64_t ldv,
                               int64_t Dv, int64_t e0, float *o) {
    enum { CHUNK = 32 };
    for (int64_t r = 0; r < M; r++)
        for (int64_t c0 = e0; c0 < Dv; c0 += CHUNK) {
            const int64_t n = Dv - c0 < CHUNK ? Dv - c0 : CHUNK;
            float acc[CHUNK] = {0};
            for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n)
                for (int64_t j = 0; j < spans[i].n; j++) {
                    float p = st[r * ldst + j0 + j];
                    const void *vr = npattn_stream_at(vt, spans[i].rows, j * ldv);
                    const void *vs = dq ? npattn_span_groups(spans[i].scale, dq->scale_type, dq->scale_row, j) : NULL;
                    const void *vz = dq ? npattn_span_groups(spans[i].zero, dq->zero_type, dq->zero_row, j) : NULL;
                    for (int64_t e = 0; e < n; e++) acc[e] += p * npattn_value_elem(vt, dq, vr, c0 + e, vs, vz);
                }
            for (int64_t e = 0; e < n; e++) o[r * Dv + c0 + e] += acc[e];
        }
}

static void accumulate_portable(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                int64_t n_span, enum npattn_dtype vt, const struct npattn_dequant *dq, int64_t ldv,
                                int64_t Dv, float *o) {
    npattn_accumulate_columns(st, ldst, M, spans, n_span, vt, dq, ldv, Dv, 0, o);
}

static void f16_to_f32_portable(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t j = 0; j < n; j++) dst[j] = npattn_f16_to_f32(src[j]);
}

/* 8 scalar chains (the compiler may vectorise them). */
static double fma_loop_portable(int64_t n, float *sink) {
    float acc[8];
    for (int i = 0; i < 8; i++) acc[i] = (float)i;
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < 8; i++) acc[i] = acc[i] * 0.999999f + 1e-7f;
    float s = 0;
    for (int i = 0; i < 8; i++) s += acc[i];
    *sink = s;
    return 2.0 * 8 * (double)n;
}

const struct npattn_kernels npattn_kernels_portable = {
    .name = "portable",
    .softmax_f32 = softmax_portable,
    .softmax_rows_f32 = softmax_rows_portable,
    .scores = scores_portable,
    .accumulate = accumulate_portable,
    .code_step = 1,
    .f16_to_f32 = f16_to_f32_portable,
    .finish_rows = npattn_finish_rows,
    .add_f32 = npattn_add_f32,
    .fma_loop = fma_loop_portable,
};

/* ---- double precision: libm's exp and tanh, NaN and infinities as the formula says ---- */

void npattn_softmax_f64(double *st, const struct npattn_score_tile_f64 *t, double *m, double *l, double *alpha) {
    const int64_t nk = t->nk, ld = t->ld;
    for (int64_t r = 0; r < t->M; r++) {
        double mx = m[r];
        int nan = mx != mx;
        for (int64_t j = 0; j < nk; j++) {
            double *x = st + j * ld + r;
            double s = *x * t->scale;
            if (t->softcap > 0) s = t->softcap * tanh(s / t->softcap);
            if (t->bias) s = t->bias[j * ld + r] == -INFINITY ? -INFINITY : s + t->bias[j * ld + r];
            if (t->lo && (j < t->lo[r] || j > t->hi[r])) s = -INFINITY;
            *x = s;
            nan |= s != s;
            mx = s > mx ? s : mx;
        }
        if (nan) mx = NAN;
        if (mx == -INFINITY) { /* nothing visible yet: contribute nothing */
            for (int64_t j = 0; j < nk; j++) st[j * ld + r] = 0.0;
            alpha[r] = 1.0;
            continue;
        }
        double a = exp(m[r] - mx), sum = 0.0;
        for (int64_t j = 0; j < nk; j++) {
            double p = exp(st[j * ld + r] - mx);
            st[j * ld + r] = p;
            sum += p;
        }
        l[r] = l[r] * a + sum;
        m[r] = mx;
        alpha[r] = a;
    }
}

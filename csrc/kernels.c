/* kernels.c: the online-softmax step over one row of a score tile.
 *
 * Scores arrive in base-2 units (the driver folds scale * log2(e) into q), so
 * the exponential is exp2. One call turns a row of scores into probabilities
 * relative to the new running max and updates that max and the running sum:
 * online softmax, FlashAttention-2 (arXiv:2307.08691), Algorithm 1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* 2^x for x <= 0 that is not NaN: 0 below 2^-126, else a Cephes-style
 * polynomial on the fraction in [-0.5, 0.5] (relative error < 2e-7) scaled by
 * 2^n through the exponent bits. Written so that compilers vectorise it. */
static inline float exp2_nonpos_f32(float x) {
    float xc = x < -126.0f ? -126.0f : x;
    float n = (xc + 12582912.0f) - 12582912.0f;  /* round to nearest, 1.5 * 2^23 */
    float f = xc - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -126.0f ? 0.0f : p * scale;
}

float npattn_softmax_step_f32(float *s, int64_t n, float *m, float *l) {
    /* the new running max; NaN anywhere makes the row NaN, as the formula does */
    float mx = *m;
    int any_nan = 0;
    for (int64_t j = 0; j < n; j++) {
        mx = s[j] > mx ? s[j] : mx;
        any_nan |= s[j] != s[j];
    }
    if (any_nan) mx = NAN;
    if (mx == -INFINITY) {
        /* nothing visible yet: contribute nothing, keep the state */
        memset(s, 0, (size_t)n * sizeof *s);
        return 1.0f;
    }
    if (any_nan || mx == INFINITY) {
        /* the slow, exact path for rows that hold NaN or +inf */
        float alpha = exp2f(*m - mx);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = exp2f(s[j] - mx);
            sum += s[j];
        }
        *l = *l * alpha + sum;
        *m = mx;
        return alpha;
    }
    /* rescale what came before, then exponentiate and sum this tile */
    float alpha = exp2_nonpos_f32(*m - mx);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        float p = exp2_nonpos_f32(s[j] - mx);
        s[j] = p;
        sum += p;
    }
    *l = *l * alpha + sum;
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
    double alpha = exp2(*m - mx);
    double sum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        s[j] = exp2(s[j] - mx);
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

/* test_attention.c: the core alone, no Python, against a naive loop.
 *
 *   cc -fsanitize=address,undefined -g -Icsrc csrc/test_attention.c \
 *      csrc/attention.c csrc/pool.c csrc/kernels.c -lopenblas -lpthread -lm
 *
 * Prints one line per failure and a final "N passed, N failed" line; exits
 * nonzero on any failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kernels.h"

static int n_pass, n_fail;

static void expect(int ok, const char *what) {
    if (ok) {
        n_pass++;
    } else {
        n_fail++;
        printf("FAIL: %s\n", what);
    }
}

static uint64_t rng = 88172645463325252ull;
static double uniform(void) { /* xorshift64, in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

/* The formula, one row at a time, in long double; contiguous (B, H, N, W). */
static void naive(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t D, int64_t Dv,
                  const double *q, const double *k, const double *v, double scale,
                  enum npattn_mask_kind kind, const uint8_t *bmask, const double *sinks, double *out) {
    long double *w = malloc(sizeof *w * (size_t)(S > 0 ? S : 1));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t i = 0; i < L; i++) {
                int64_t g = h / (Hq / Hkv);
                const double *qi = q + ((b * Hq + h) * L + i) * D;
                long double mx = sinks ? sinks[h] : -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    int vis = 1;
                    if (kind == NPATTN_MASK_CAUSAL) vis = j <= i + (S - L);
                    if (kind == NPATTN_MASK_CAUSAL_TOP_LEFT) vis = j <= i;
                    if (kind == NPATTN_MASK_BOOL) vis = bmask[(h * L + i) * S + j];
                    long double s = 0;
                    for (int64_t d = 0; d < D; d++) s += (long double)qi[d] * k[((b * Hkv + g) * S + j) * D + d];
                    w[j] = vis ? s * scale : -INFINITY;
                    if (w[j] > mx) mx = w[j];
                }
                long double den = sinks ? expl(sinks[h] - mx) : 0;
                for (int64_t j = 0; j < S; j++) {
                    w[j] = w[j] == -INFINITY ? 0 : expl(w[j] - mx);
                    den += w[j];
                }
                double *o = out + ((b * Hq + h) * L + i) * Dv;
                for (int64_t e = 0; e < Dv; e++) {
                    long double acc = 0;
                    for (int64_t j = 0; j < S; j++) acc += w[j] * v[((b * Hkv + g) * S + j) * Dv + e];
                    o[e] = den > 0 ? (double)(acc / den) : 0.0;
                }
            }
    free(w);
}

struct case_ {
    int64_t B, Hq, Hkv, L, S, D, Dv;
    enum npattn_mask_kind kind;
    int with_sinks;
    int threads;
};

static void fill_problem(struct npattn_problem *p, const struct case_ *c, enum npattn_dtype dt,
                         const void *q, const void *k, const void *v, void *out, const uint8_t *bmask,
                         const double *sinks, const int64_t *bshape, const int64_t bstr[5][1]) {
    memset(p, 0, sizeof *p);
    p->dtype = dt;
    p->n_batch_dim = 1;
    p->batch_shape = bshape;
    p->n_head_q = c->Hq;
    p->n_head_kv = c->Hkv;
    p->n_query = c->L;
    p->n_key = c->S;
    p->n_embd_k = c->D;
    p->n_embd_v = c->Dv;
    p->q = q;
    p->q_batch_stride = bstr[0];
    p->q_head_stride = c->L * c->D;
    p->q_row_stride = c->D;
    p->q_col_stride = 1;
    p->k = k;
    p->k_batch_stride = bstr[1];
    p->k_head_stride = c->S * c->D;
    p->k_row_stride = c->D;
    p->v = v;
    p->v_batch_stride = bstr[2];
    p->v_head_stride = c->S * c->Dv;
    p->v_row_stride = c->Dv;
    p->out = out;
    p->out_batch_stride = bstr[3];
    p->out_head_stride = c->L * c->Dv;
    p->out_row_stride = c->Dv;
    p->out_col_stride = 1;
    p->scale = 1.0 / sqrt((double)c->D);
    p->mask_kind = c->kind;
    p->mask = bmask;
    p->mask_batch_stride = bstr[4]; /* the bool mask is shared by the batch: stride 0 */
    p->mask_head_stride = c->L * c->S;
    p->mask_row_stride = c->S;
    p->mask_col_stride = 1;
    p->sinks = sinks;
    p->n_threads = c->threads;
}

static void run_case(const struct case_ *c) {
    int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv;
    int64_t nm = c->Hq * c->L * c->S;
    double *q = malloc(8 * (size_t)(nq + 1)), *k = malloc(8 * (size_t)(nk + 1));
    double *v = malloc(8 * (size_t)(nv + 1)), *want = malloc(8 * (size_t)(no + 1));
    double *got = malloc(8 * (size_t)(no + 1)), sinks[64];
    float *qf = malloc(4 * (size_t)(nq + 1)), *kf = malloc(4 * (size_t)(nk + 1));
    float *vf = malloc(4 * (size_t)(nv + 1)), *gotf = malloc(4 * (size_t)(no + 1));
    uint8_t *bmask = malloc((size_t)nm + 1);
    for (int64_t i = 0; i < nq; i++) qf[i] = (float)(q[i] = uniform() * 2);
    for (int64_t i = 0; i < nk; i++) kf[i] = (float)(k[i] = uniform() * 2);
    for (int64_t i = 0; i < nv; i++) vf[i] = (float)(v[i] = uniform());
    for (int64_t i = 0; i < nm; i++) bmask[i] = uniform() > -0.3;  /* about 35% hidden */
    for (int i = 0; i < 64; i++) sinks[i] = uniform() * 3;
    const double *sk = c->with_sinks ? sinks : NULL;
    naive(c->B, c->Hq, c->Hkv, c->L, c->S, c->D, c->Dv, q, k, v, 1.0 / sqrt((double)c->D), c->kind, bmask, sk,
          want);

    int64_t bshape[1] = {c->B};
    int64_t bstr[5][1] = {{c->Hq * c->L * c->D}, {c->Hkv * c->S * c->D}, {c->Hkv * c->S * c->Dv},
                          {c->Hq * c->L * c->Dv}, {0}};
    struct npattn_problem p;
    char what[256];
    snprintf(what, sizeof what, "B=%lld Hq=%lld Hkv=%lld L=%lld S=%lld D=%lld Dv=%lld mask=%d sinks=%d threads=%d",
             (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->L, (long long)c->S,
             (long long)c->D, (long long)c->Dv, (int)c->kind, c->with_sinks, c->threads);

    /* float64: the long double loop and dgemm agree to rounding */
    fill_problem(&p, c, NPATTN_DTYPE_F64, q, k, v, got, bmask, sk, bshape, bstr);
    enum npattn_status st = npattn_sdpa(&p);
    double err = 0;
    for (int64_t i = 0; i < no; i++) err = fmax(err, fabs(got[i] - want[i]));
    expect(st == NPATTN_STATUS_OK && err < 1e-12, what);

    /* float32: inputs are exact in float, so error is float rounding only */
    fill_problem(&p, c, NPATTN_DTYPE_F32, qf, kf, vf, gotf, bmask, sk, bshape, bstr);
    st = npattn_sdpa(&p);
    err = 0;
    for (int64_t i = 0; i < no; i++) err = fmax(err, fabs(gotf[i] - want[i]));
    expect(st == NPATTN_STATUS_OK && err < 2e-5, what);

    /* float16 and bfloat16: the naive loop on the rounded inputs; the result
     * is rounded once more (2^-11 and 2^-8 relative), |out| <= max|v| <= 1 */
    static const enum npattn_dtype halves[2] = {NPATTN_DTYPE_F16, NPATTN_DTYPE_BF16};
    static const double half_tol[2] = {1.5e-3, 1.2e-2};
    uint16_t *qh = malloc(2 * (size_t)(nq + 1)), *kh = malloc(2 * (size_t)(nk + 1));
    uint16_t *vh = malloc(2 * (size_t)(nv + 1)), *oh = malloc(2 * (size_t)(no + 1));
    float *tmp = malloc(4 * (size_t)(nq + nk + nv + no + 1));
    for (int t = 0; t < 2; t++) {
        npattn_row_from_f32(halves[t], qf, nq, qh, 1);
        npattn_row_from_f32(halves[t], kf, nk, kh, 1);
        npattn_row_from_f32(halves[t], vf, nv, vh, 1);
        npattn_row_to_f32(halves[t], qh, 1, nq, tmp);
        for (int64_t i = 0; i < nq; i++) q[i] = tmp[i];
        npattn_row_to_f32(halves[t], kh, 1, nk, tmp);
        for (int64_t i = 0; i < nk; i++) k[i] = tmp[i];
        npattn_row_to_f32(halves[t], vh, 1, nv, tmp);
        for (int64_t i = 0; i < nv; i++) v[i] = tmp[i];
        naive(c->B, c->Hq, c->Hkv, c->L, c->S, c->D, c->Dv, q, k, v, 1.0 / sqrt((double)c->D), c->kind, bmask,
              sk, want);
        fill_problem(&p, c, halves[t], qh, kh, vh, oh, bmask, sk, bshape, bstr);
        st = npattn_sdpa(&p);
        npattn_row_to_f32(halves[t], oh, 1, no, tmp);
        err = 0;
        for (int64_t i = 0; i < no; i++) err = fmax(err, fabs(tmp[i] - want[i]));
        expect(st == NPATTN_STATUS_OK && err < half_tol[t], what);
    }
    free(qh), free(kh), free(vh), free(oh), free(tmp);

    /* allocation failure is a status, not a crash (sanitizers watch for leaks) */
    npattn_debug_fail_alloc_after(0);
    st = npattn_sdpa(&p);
    npattn_debug_fail_alloc_after(-1);
    int empty = c->B * c->Hq * c->L * c->Dv == 0;
    expect(empty ? st == NPATTN_STATUS_OK : st == NPATTN_STATUS_NO_MEMORY, "allocation failure");

    free(q), free(k), free(v), free(want), free(got), free(qf), free(kf), free(vf), free(gotf), free(bmask);
}

static int cancel_now(void *arg) {
    (*(int *)arg)++;
    return 1;
}

static void test_cancel(void) {
    /* a call long enough to be polled stops with CANCELLED */
    struct case_ c = {1, 8, 2, 1024, 1024, 64, 64, NPATTN_MASK_NONE, 0, 2};
    size_t nq = 8 * 1024 * 64, nk = 2 * 1024 * 64;
    float *q = calloc(nq, 4), *k = calloc(nk, 4), *v = calloc(nk, 4), *o = calloc(nq, 4);
    int64_t bshape[1] = {1}, bstr[5][1] = {{0}, {0}, {0}, {0}, {0}};
    struct npattn_problem p;
    fill_problem(&p, &c, NPATTN_DTYPE_F32, q, k, v, o, NULL, NULL, bshape, bstr);
    int polls = 0;
    p.cancel = cancel_now;
    p.cancel_arg = &polls;
    enum npattn_status st = npattn_sdpa(&p);
    /* the call may finish before the first poll on a fast machine */
    expect(st == NPATTN_STATUS_CANCELLED || (st == NPATTN_STATUS_OK && polls == 0), "cancel");
    free(q), free(k), free(v), free(o);
}

static void test_conversions(void) {
    /* float16 and bfloat16 rounding, checked against values worked out by hand */
    const float in[] = {1.0f, -2.5f, 65504.0f, 65520.0f, 1e-8f, 5.9604645e-8f, 2.9802322e-8f, 1.00048828125f,
                        1.000732421875f, 3.0f};
    const uint16_t f16[] = {0x3C00, 0xC100, 0x7BFF, 0x7C00, 0x0000, 0x0001, 0x0000, 0x3C00, 0x3C01, 0x4200};
    const uint16_t bf16[] = {0x3F80, 0xC020, 0x4780, 0x4780, 0x322C, 0x3380, 0x3300, 0x3F80, 0x3F80, 0x4040};
    uint16_t got[10];
    npattn_row_from_f32(NPATTN_DTYPE_F16, in, 10, got, 1);
    expect(memcmp(got, f16, sizeof got) == 0, "float32 -> float16 rounding");
    npattn_row_from_f32(NPATTN_DTYPE_BF16, in, 10, got, 1);
    expect(memcmp(got, bf16, sizeof got) == 0, "float32 -> bfloat16 rounding");
    float back[10];
    npattn_row_to_f32(NPATTN_DTYPE_F16, f16, 1, 10, back);
    expect(back[1] == -2.5f && back[2] == 65504.0f && isinf(back[3]) && back[5] == 5.9604645e-8f, "float16 -> float32");
}

static void test_invalid(void) {
    struct case_ c = {1, 5, 2, 3, 5, 8, 8, NPATTN_MASK_NONE, 0, 1};
    float buf[1024] = {0};
    int64_t bshape[1] = {1}, bstr[5][1] = {{0}, {0}, {0}, {0}, {0}};
    struct npattn_problem p;
    fill_problem(&p, &c, NPATTN_DTYPE_F32, buf, buf, buf, buf, NULL, NULL, bshape, bstr);
    expect(npattn_sdpa(&p) == NPATTN_STATUS_INVALID, "heads not a multiple");
    c.Hq = 4;
    fill_problem(&p, &c, NPATTN_DTYPE_F32, buf, buf, buf, buf, NULL, NULL, bshape, bstr);
    p.k_row_stride = 4; /* shorter than a row */
    expect(npattn_sdpa(&p) == NPATTN_STATUS_INVALID, "k row stride below D");
    fill_problem(&p, &c, NPATTN_DTYPE_F32, buf, buf, buf, buf, NULL, NULL, bshape, bstr);
    p.n_embd_k = (int64_t)1 << 40;
    expect(npattn_sdpa(&p) == NPATTN_STATUS_TOO_LARGE, "D beyond INT_MAX");
    fill_problem(&p, &c, NPATTN_DTYPE_F32, buf, buf, buf, buf, NULL, NULL, bshape, bstr);
    p.scale = NAN;
    expect(npattn_sdpa(&p) == NPATTN_STATUS_INVALID, "NaN scale");
    expect(npattn_sdpa(NULL) == NPATTN_STATUS_INVALID, "NULL problem");
    expect(strlen(npattn_status_string((enum npattn_status)99)) > 0, "status string");
}

int main(void) {
    static const struct case_ cases[] = {
        {2, 18, 6, 3, 7, 5, 5, NPATTN_MASK_CAUSAL, 0, 1},
        {2, 18, 6, 3, 7, 5, 5, NPATTN_MASK_CAUSAL_TOP_LEFT, 0, 2},
        {2, 18, 6, 7, 3, 5, 4, NPATTN_MASK_CAUSAL, 0, 3},
        {1, 4, 1, 1, 300, 16, 9, NPATTN_MASK_CAUSAL, 1, 2},
        {1, 4, 2, 70, 300, 16, 16, NPATTN_MASK_BOOL, 1, 2},
        {3, 6, 3, 130, 130, 8, 8, NPATTN_MASK_CAUSAL, 0, 8},
        {1, 3, 3, 5, 260, 4, 6, NPATTN_MASK_NONE, 0, 2},
        {1, 2, 1, 4, 0, 4, 4, NPATTN_MASK_NONE, 1, 1},
        {1, 2, 1, 4, 0, 4, 4, NPATTN_MASK_CAUSAL, 0, 1},
        {0, 2, 1, 4, 5, 4, 4, NPATTN_MASK_NONE, 0, 1},
        {1, 2, 1, 4, 5, 4, 0, NPATTN_MASK_NONE, 0, 1},
        {1, 600, 1, 2, 40, 4, 4, NPATTN_MASK_CAUSAL, 0, 2},
        /* few units, many keys: split-K, merged by log-sum-exp */
        {1, 4, 1, 1, 2500, 16, 8, NPATTN_MASK_CAUSAL, 1, 2},
        {1, 4, 1, 2, 4100, 8, 8, NPATTN_MASK_BOOL, 0, 3},
        {1, 2, 2, 1, 2100, 8, 8, NPATTN_MASK_NONE, 1, 5},
        /* wide rows: fewer keys per tile */
        {1, 2, 1, 9, 40, 300, 200, NPATTN_MASK_CAUSAL, 0, 2},
    };
    /* every case under every kernel variant this CPU can run */
    static const char *variants[] = {"portable", "avx2", "avx512"};
    for (int w = 0; w < 3; w++) {
        if (npattn_simd_force(variants[w]) != 0) {
            printf("skipped: the %s kernels (this CPU cannot run them)\n", variants[w]);
            continue;
        }
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
    }
    npattn_simd_force("");
    test_cancel();
    test_conversions();
    test_invalid();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}

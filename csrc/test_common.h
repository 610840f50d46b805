/* test_common.h: what the core's test programs share: the pass/fail count,
 * a seeded generator, the naive forward loop in long double, contiguous
 * tensors and problems, random masks, a case's name, conversions to and from
 * double. */
#ifndef NPATTN_TEST_COMMON_H
#define NPATTN_TEST_COMMON_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "hooks.h"
#include "kernels/kernels.h"

static int n_pass, n_fail;

static inline void expect(int ok, const char *what) {
    if (ok) {
        n_pass++;
    } else {
        n_fail++;
        printf("FAIL: %s\n", what);
    }
}

/* A status as expected, both named by their sentences where not. */
static inline void expect_status(enum npattn_status got, enum npattn_status want, const char *what) {
    if (got != want) printf("  %s: got \"%s\", want \"%s\"\n", what, npattn_status_string(got), npattn_status_string(want));
    expect(got == want, what);
}

/* A verdict as expected: the rule and the operand(s) it names. */
static inline void expect_verdict(const struct npattn_verdict *got, enum npattn_status status, enum npattn_operand operand,
                                  enum npattn_operand other, const char *what) {
    expect_status(got->status, status, what);
    if (got->operand != operand || got->other != other)
        printf("  %s: names \"%s\" and \"%s\", want \"%s\" and \"%s\"\n", what, npattn_operand_name(got->operand),
               npattn_operand_name(got->other), npattn_operand_name(operand), npattn_operand_name(other));
    expect(got->operand == operand && got->other == other, what);
}

static uint64_t rng = 88172645463325252ull;
static inline double uniform(void) { /* xorshift64, in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

enum mask { MASK_NONE, MASK_BOOL, MASK_ADD };

struct case_ {
    int64_t B, Hq, Hkv, L, S, D, Dv;
    int causal;
    int64_t wl, wr;      /* window, NPATTN_UNBOUNDED for none */
    int64_t q_offset;    /* INT64_MIN: bottom-right (S - L) */
    int64_t k_offset;
    enum mask mask;
    double softcap;
    int sinks;
    int threads;
};

/* A case's random masks, nm = Hq * L * S entries of each: the bool one hides
 * about 35% of the keys, the additive one is in [-2, 2) where the bool one
 * shows a key and -inf elsewhere; and 64 sinks in [-3, 3). */
static inline void random_masks(int64_t nm, uint8_t *bmask, double *amask, double *sinks) {
    for (int64_t i = 0; i < nm; i++) {
        bmask[i] = uniform() > -0.3;
        amask[i] = bmask[i] ? uniform() * 2 : -INFINITY;
    }
    for (int i = 0; i < 64; i++) sinks[i] = uniform() * 3;
}

/* A case as a failure names it: pass ("" or "backward "), the kernel table, its sizes and options. */
static inline void describe_case(char *what, size_t size, const char *pass, const char *table, const struct case_ *c) {
    snprintf(what, size,
             "%s%s B=%lld Hq=%lld Hkv=%lld L=%lld S=%lld D=%lld Dv=%lld causal=%d window=(%lld,%lld) "
             "offsets=(%lld,%lld) mask=%d softcap=%g sinks=%d threads=%d",
             pass, table, (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->L, (long long)c->S,
             (long long)c->D, (long long)c->Dv, c->causal, (long long)c->wl, (long long)c->wr, (long long)c->q_offset,
             (long long)c->k_offset, (int)c->mask, c->softcap, c->sinks, c->threads);
}

/* The formula, one row at a time, in long double; contiguous (B, H, N, W) arrays;
 * also lse (B, H, L) and the weights (B, H, L, S). */
static inline void naive(const struct case_ *c, const double *q, const double *k, const double *v, const uint8_t *bmask,
                  const double *amask, const double *sinks, double *out, double *lse, double *weights) {
    const int64_t L = c->L, S = c->S, D = c->D, Dv = c->Dv;
    const int64_t qo = c->q_offset == INT64_MIN ? S - L : c->q_offset;
    long double *w = malloc(sizeof *w * (size_t)(S > 0 ? S : 1));
    int *vis = malloc(sizeof *vis * (size_t)(S > 0 ? S : 1));
    const long double scale = 1.0L / sqrtl((long double)D);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < L; i++) {
                int64_t g = h / (c->Hq / c->Hkv);
                const double *qi = q + ((b * c->Hq + h) * L + i) * D;
                long double mx = sinks ? sinks[h] : -INFINITY;
                for (int64_t j = 0; j < S; j++) {
                    /* q_pos - k_pos exactly, in 128-bit integers (long double
                     * holds 53 bits under valgrind) */
                    const __int128 ahead = ((__int128)qo + i) - ((__int128)c->k_offset + j);
                    vis[j] = 1;
                    if (c->causal) vis[j] &= ahead >= 0;
                    if (c->wl != NPATTN_UNBOUNDED) vis[j] &= ahead <= c->wl;
                    if (c->wr != NPATTN_UNBOUNDED) vis[j] &= -ahead <= c->wr;
                    if (c->mask == MASK_BOOL) vis[j] &= bmask[(h * L + i) * S + j] != 0;
                    if (c->mask == MASK_ADD) vis[j] &= amask[(h * L + i) * S + j] != -INFINITY;
                    long double s = 0;
                    for (int64_t d = 0; d < D; d++) s += (long double)qi[d] * k[((b * c->Hkv + g) * S + j) * D + d];
                    s *= scale;
                    if (c->softcap > 0) s = c->softcap * tanhl(s / c->softcap);
                    if (c->mask == MASK_ADD && vis[j]) s += amask[(h * L + i) * S + j];
                    w[j] = vis[j] ? s : -INFINITY;
                    if (w[j] > mx) mx = w[j];
                }
                long double den = sinks ? expl(sinks[h] - mx) : 0;
                for (int64_t j = 0; j < S; j++) {
                    w[j] = vis[j] ? expl(w[j] - mx) : 0;
                    den += w[j];
                }
                int64_t row = (b * c->Hq + h) * L + i;
                lse[row] = den > 0 ? (double)(mx + logl(den)) : -INFINITY;
                for (int64_t j = 0; j < S; j++) weights[row * S + j] = den > 0 ? (double)(w[j] / den) : 0.0;
                for (int64_t e = 0; e < Dv; e++) {
                    long double acc = 0;
                    for (int64_t j = 0; j < S; j++) acc += w[j] * v[((b * c->Hkv + g) * S + j) * Dv + e];
                    out[row * Dv + e] = den > 0 ? (double)(acc / den) : 0.0;
                }
            }
    free(w);
    free(vis);
}

/* A contiguous (B, H, N, W) tensor of dtype; batch stride points at bstr. */
static inline struct npattn_tensor tensor(void *data, enum npattn_dtype dt, int64_t *bstr, int64_t B, int64_t H, int64_t N,
                                   int64_t W) {
    struct npattn_tensor t = {data, dt, bstr, N * W, W, 1};
    bstr[0] = B > 1 ? H * N * W : 0;
    return t;
}

struct buffers {
    int64_t bs[7];
    void *q, *k, *v, *out, *lse, *weights, *mask;
};

static inline void fill_problem(struct npattn_problem *p, const struct case_ *c, enum npattn_dtype dt, struct buffers *x,
                         const double *sinks, int64_t *bshape) {
    memset(p, 0, sizeof *p);
    bshape[0] = c->B;
    p->n_batch_dim = 1;
    p->batch_shape = bshape;
    p->n_head_q = c->Hq;
    p->n_head_kv = c->Hkv;
    p->n_query = c->L;
    p->n_key = c->S;
    p->n_embd_k = c->D;
    p->n_embd_v = c->Dv;
    p->q = tensor(x->q, dt, &x->bs[0], c->B, c->Hq, c->L, c->D);
    p->k = tensor(x->k, dt, &x->bs[1], c->B, c->Hkv, c->S, c->D);
    p->v = tensor(x->v, dt, &x->bs[2], c->B, c->Hkv, c->S, c->Dv);
    p->out = tensor(x->out, dt, &x->bs[3], c->B, c->Hq, c->L, c->Dv);
    enum npattn_dtype wide = dt == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    p->lse = tensor(x->lse, wide, &x->bs[4], c->B, c->Hq, c->L, 1);
    p->weights = tensor(x->weights, dt, &x->bs[5], c->B, c->Hq, c->L, c->S);
    p->scale = 1.0 / sqrt((double)c->D);
    p->softcap = c->softcap;
    p->causal = c->causal;
    p->q_offset = c->q_offset == INT64_MIN ? c->S - c->L : c->q_offset;
    p->k_offset = c->k_offset;
    p->window_left = c->wl;
    p->window_right = c->wr;
    p->mask_kind = c->mask == MASK_BOOL ? NPATTN_MASK_BOOL : c->mask == MASK_ADD ? NPATTN_MASK_ADD : NPATTN_MASK_NONE;
    p->mask = tensor(x->mask, NPATTN_DTYPE_F64, &x->bs[6], c->B, c->Hq, c->L, c->S);
    x->bs[6] = 0; /* the mask is shared by the batch */
    p->sinks = sinks;
    p->n_threads = c->threads;
}

static inline double max_err(const double *want, const double *got, int64_t n, int lse) {
    double err = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lse && isinf(want[i])) {
            if (want[i] != got[i]) err = INFINITY;
            continue;
        }
        double e = fabs(got[i] - want[i]);
        err = e > err || e != e ? e : err;
    }
    return err;
}

/* dst[i] = src[i] of dtype dt as double. */
static inline void to_double(enum npattn_dtype dt, const void *src, int64_t n, double *dst) {
    float *tmp = malloc(sizeof *tmp * (size_t)(n + 1));
    if (dt == NPATTN_DTYPE_F64) memcpy(dst, src, sizeof *dst * (size_t)n);
    else npattn_load_f32(dt, src, 1, n, tmp);
    if (dt != NPATTN_DTYPE_F64)
        for (int64_t i = 0; i < n; i++) dst[i] = tmp[i];
    free(tmp);
}

/* src of doubles stored as dtype dt, and rounded back: the values the core sees. */
static inline void from_double(enum npattn_dtype dt, double *src, int64_t n, void *dst) {
    if (dt == NPATTN_DTYPE_F64) {
        memcpy(dst, src, sizeof *src * (size_t)n);
        return;
    }
    float *tmp = calloc((size_t)(n + 1), sizeof *tmp);
    for (int64_t i = 0; i < n; i++) tmp[i] = (float)src[i];
    npattn_store_f32(dt, tmp, n, dst, 1);
    free(tmp);
    to_double(dt, dst, n, src);
}

/* The dtypes each case is computed in, and their names. */
#define N_DTYPES 4
static const enum npattn_dtype test_dtypes[N_DTYPES] = {NPATTN_DTYPE_F64, NPATTN_DTYPE_F32, NPATTN_DTYPE_F16,
                                                        NPATTN_DTYPE_BF16};
static const char *const dtype_names[N_DTYPES] = {"float64", "float32", "float16", "bfloat16"};

/* The kernel tables a test program runs each case under: those this CPU runs,
 * or of them only those that NPATTN_TEST_TABLES names (comma-separated), so
 * that a slow emulated CPU runs only the tables no other run covered. */
#define N_KERNEL_TABLES 7
static const char *const kernel_tables[N_KERNEL_TABLES] = {
    "portable", "avx2", "avx512", "avx512bf16", "amx", "neon", "neonbf16"};

/* The tables NPATTN_TEST_TABLES names, as bits of kernel_tables (unset or
 * empty: all); a name that is no table ends the program, since it would
 * leave every table out. */
static inline unsigned tables_wanted(void) {
    const char *only = getenv("NPATTN_TEST_TABLES");
    if (!only || !*only) return ~0u;
    unsigned bits = 0;
    for (const char *at = only; at; at = strchr(at, ','), at = at ? at + 1 : NULL) {
        const size_t len = strcspn(at, ",");
        int t = 0;
        while (t < N_KERNEL_TABLES && !(strlen(kernel_tables[t]) == len && strncmp(at, kernel_tables[t], len) == 0)) t++;
        if (t == N_KERNEL_TABLES) {
            printf("NPATTN_TEST_TABLES=%s: no kernel table named %.*s\n", only, (int)len, at);
            exit(2);
        }
        bits |= 1u << t;
    }
    return bits;
}

/* run(case, table) for every case under every kernel table this CPU runs. */
static inline void for_each_table(const struct case_ *cases, size_t n, void (*run)(const struct case_ *, const char *)) {
    const unsigned wanted = tables_wanted();
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (!(wanted & 1u << t)) {
            printf("left out: the %s kernels (NPATTN_TEST_TABLES)\n", kernel_tables[t]);
            continue;
        }
        if (npattn_kernels_force(kernel_tables[t]) != 0) {
            printf("skipped: the %s kernels (this CPU cannot run them)\n", kernel_tables[t]);
            continue;
        }
        for (size_t i = 0; i < n; i++) run(&cases[i], kernel_tables[t]);
    }
    npattn_kernels_force("");
}

#endif

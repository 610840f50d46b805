/* test_backward.c: the backward pass of the core alone, no Python, against
 * the chain rule in long double (from the naive forward loop's weights):
 * every mask, windows and positions, softcap, sinks, GQA groups, rows with
 * no key, split key blocks, float64, float32, float16 and bfloat16 (the
 * halves under "fast" too), under every kernel table this CPU runs;
 * gradients written over garbage, the same
 * bits for the same threads, allocation failure at each allocation,
 * cancellation, and problems that break a rule.
 *
 *   make -C csrc test            (see csrc/Makefile; SAN=1 for the sanitizers)
 *
 * Prints one line per failure and a final "N passed, N failed" line; exits
 * nonzero on any failure.
 */
#include "test_common.h"

/* The gradients of sum(g * out), contiguous, from the forward's weights and lse:
 * dp_ij = g_i.v_j, D_i = sum_j p_ij dp_ij, ds_ij = p_ij (dp_ij - D_i) (times the
 * cap's slope), dq_i = scale sum_j ds_ij k_j, dk_j = scale sum_i ds_ij q_i,
 * dv_j = sum_i p_ij g_i, dsink = -sum_i exp(sink - lse_i) D_i. */
static void naive_backward(const struct case_ *c, const double *q, const double *k, const double *v, const double *g,
                           const double *weights, const double *lse, const double *sinks, double *dq, double *dk,
                           double *dv, double *dsinks) {
    const int64_t L = c->L, S = c->S, D = c->D, Dv = c->Dv, n_rep = c->Hq / c->Hkv;
    const long double scale = 1.0L / sqrtl((long double)D);
    long double *acc_k = calloc((size_t)(c->B * c->Hkv * S * D + 1), sizeof *acc_k);
    long double *acc_v = calloc((size_t)(c->B * c->Hkv * S * Dv + 1), sizeof *acc_v);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->Hq; h++) {
            const int64_t kv = b * c->Hkv + h / n_rep;
            long double dsink = 0;
            for (int64_t i = 0; i < L; i++) {
                const int64_t row = (b * c->Hq + h) * L + i;
                const double *qi = q + row * D, *gi = g + row * Dv, *w = weights + row * S;
                long double Di = 0;
                for (int64_t j = 0; j < S; j++) {
                    long double dp = 0;
                    for (int64_t e = 0; e < Dv; e++) dp += (long double)gi[e] * v[(kv * S + j) * Dv + e];
                    Di += w[j] * dp;
                }
                if (sinks && isfinite(lse[row])) dsink -= expl(sinks[h] - lse[row]) * Di;
                for (int64_t d = 0; d < D; d++) dq[row * D + d] = 0;
                for (int64_t j = 0; j < S; j++) {
                    if (w[j] == 0) continue;
                    const double *kj = k + (kv * S + j) * D;
                    long double dp = 0, s = 0;
                    for (int64_t e = 0; e < Dv; e++) dp += (long double)gi[e] * v[(kv * S + j) * Dv + e];
                    long double ds = w[j] * (dp - Di);
                    if (c->softcap > 0) {
                        for (int64_t d = 0; d < D; d++) s += (long double)qi[d] * kj[d];
                        long double t = tanhl(s * scale / c->softcap);
                        ds *= 1 - t * t;
                    }
                    for (int64_t d = 0; d < D; d++) {
                        dq[row * D + d] += (double)(scale * ds * kj[d]);
                        acc_k[(kv * S + j) * D + d] += scale * ds * qi[d];
                    }
                    for (int64_t e = 0; e < Dv; e++) acc_v[(kv * S + j) * Dv + e] += w[j] * (long double)gi[e];
                }
            }
            if (sinks) dsinks[b * c->Hq + h] = (double)dsink;
        }
    for (int64_t i = 0; i < c->B * c->Hkv * S * D; i++) dk[i] = (double)acc_k[i];
    for (int64_t i = 0; i < c->B * c->Hkv * S * Dv; i++) dv[i] = (double)acc_v[i];
    free(acc_k);
    free(acc_v);
}

struct grads {
    int64_t bs[4];
    void *dout, *dq, *dk, *dv;
    double *dsinks;
};

/* The backward problem over a filled forward problem; gradients in `wide`. */
static void fill_backward(struct npattn_backward_problem *bp, const struct npattn_problem *p, const struct case_ *c,
                          enum npattn_dtype dt, struct grads *gr) {
    enum npattn_dtype wide = dt == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    memset(bp, 0, sizeof *bp);
    bp->fwd = *p;
    bp->fwd.weights.data = NULL;
    bp->dout = tensor(gr->dout, dt, &gr->bs[0], c->B, c->Hq, c->L, c->Dv);
    bp->dq = tensor(gr->dq, wide, &gr->bs[1], c->B, c->Hq, c->L, c->D);
    bp->dk = tensor(gr->dk, wide, &gr->bs[2], c->B, c->Hkv, c->S, c->D);
    bp->dv = tensor(gr->dv, wide, &gr->bs[3], c->B, c->Hkv, c->S, c->Dv);
    bp->dsinks = gr->dsinks;
}

/* |got - want| <= tol (1 + |want|) everywhere; n may be 0. */
static int close_to(const double *want, const double *got, int64_t n, double tol) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= tol * (1 + fabs(want[i])))) return 0;
    return 1;
}

static void run_case(const struct case_ *c, const char *table) {
    const int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    const int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv;
    const int64_t nl = c->B * c->Hq * c->L, nw = nl * c->S, nm = c->Hq * c->L * c->S, ns = c->B * c->Hq;
    const int64_t most = nq > nk ? (nq > nv ? nq : nv) : (nk > nv ? nk : nv);
    double *q = malloc(8 * (size_t)(nq + 1)), *k = malloc(8 * (size_t)(nk + 1)), *v = malloc(8 * (size_t)(nv + 1));
    double *g = malloc(8 * (size_t)(no + 1)), *out = malloc(8 * (size_t)(no + 1)), *lse = malloc(8 * (size_t)(nl + 1));
    double *w = malloc(8 * (size_t)(nw + 1)), *amask = malloc(8 * (size_t)(nm + 1)), sinks[64];
    double *want[3] = {malloc(8 * (size_t)(nq + 1)), malloc(8 * (size_t)(nk + 1)), malloc(8 * (size_t)(nv + 1))};
    double *got = malloc(8 * (size_t)(most + 1)), want_s[64], got_s[64], again_s[64];
    uint8_t *bmask = malloc((size_t)nm + 1);
    struct buffers x;
    struct grads gr, gr2;
    x.q = malloc(8 * (size_t)(nq + 1)), x.k = malloc(8 * (size_t)(nk + 1)), x.v = malloc(8 * (size_t)(nv + 1));
    x.out = malloc(8 * (size_t)(no + 1)), x.lse = malloc(8 * (size_t)(nl + 1)), x.weights = NULL;
    x.mask = c->mask == MASK_BOOL ? (void *)bmask : (void *)amask;
    gr.dout = malloc(8 * (size_t)(no + 1)), gr.dsinks = got_s;
    gr.dq = malloc(8 * (size_t)(nq + 1)), gr.dk = malloc(8 * (size_t)(nk + 1)), gr.dv = malloc(8 * (size_t)(nv + 1));
    gr2 = gr;
    gr2.dq = malloc(8 * (size_t)(nq + 1)), gr2.dk = malloc(8 * (size_t)(nk + 1)), gr2.dv = malloc(8 * (size_t)(nv + 1));
    gr2.dsinks = again_s;
    random_masks(nm, bmask, amask, sinks);
    const double *sk = c->sinks ? sinks : NULL;
    char what[320];
    describe_case(what, sizeof what, "backward ", table, c);

    /* The gradients are sums of up to S (or group * L) terms of size <= 2 |g||v||k|
     * <= 4 D: float64 to 1e-11 relative; float32 (and the halves, computed in float32
     * from inputs rounded to them) to 2e-4 relative, D_i read from an output rounded to
     * float16 (2^-11) or bfloat16 (2^-8) adding that much more; "fast", which rounds
     * P and dS to the half type before their products (half an ulp of each term),
     * as much again. The worst case of every table here uses 10-16% of it. */
    static const double tol[N_DTYPES] = {1e-11, 2e-4, 2e-3, 2e-2};
    const int64_t sizes[3] = {nq, nk, nv};
    static const char *grad_names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < N_DTYPES; t++) {
        enum npattn_dtype wide = t == 0 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
        for (int64_t i = 0; i < nq; i++) q[i] = uniform() * 2;
        for (int64_t i = 0; i < nk; i++) k[i] = uniform() * 2;
        for (int64_t i = 0; i < nv; i++) v[i] = uniform();
        for (int64_t i = 0; i < no; i++) g[i] = uniform();
        from_double(test_dtypes[t], q, nq, x.q);
        from_double(test_dtypes[t], k, nk, x.k);
        from_double(test_dtypes[t], v, nv, x.v);
        from_double(test_dtypes[t], g, no, gr.dout);
        naive(c, q, k, v, bmask, amask, sk, out, lse, w);
        naive_backward(c, q, k, v, g, w, lse, sk, want[0], want[1], want[2], want_s);

        /* the half types under "fast" too (SPEC section 11) */
        const int half = test_dtypes[t] == NPATTN_DTYPE_F16 || test_dtypes[t] == NPATTN_DTYPE_BF16;
        for (int fast = 0; fast < 1 + half; fast++) {
            const char *how = fast ? " fast" : "";
            struct npattn_problem p;
            struct npattn_backward_problem bp, bp2;
            int64_t bshape[1];
            fill_problem(&p, c, test_dtypes[t], &x, sk, bshape);
            p.precision = fast ? NPATTN_PRECISION_FAST : NPATTN_PRECISION_HIGHEST;
            enum npattn_status st = npattn_sdpa(&p);
            /* written over garbage: nothing is accumulated into what was there */
            memset(gr.dq, 0xff, 8 * (size_t)(nq + 1)), memset(gr.dk, 0xff, 8 * (size_t)(nk + 1));
            memset(gr.dv, 0xff, 8 * (size_t)(nv + 1)), memset(got_s, 0xff, sizeof got_s);
            fill_backward(&bp, &p, c, test_dtypes[t], &gr);
            if (st == NPATTN_STATUS_OK) st = npattn_sdpa_backward(&bp);
            char msg[420];
            snprintf(msg, sizeof msg, "%s %s%s: status", what, dtype_names[t], how);
            expect(st == NPATTN_STATUS_OK, msg);
            void *const dst[3] = {gr.dq, gr.dk, gr.dv};
            for (int i = 0; i < 3; i++) {
                to_double(wide, dst[i], sizes[i], got);
                snprintf(msg, sizeof msg, "%s %s%s: %s", what, dtype_names[t], how, grad_names[i]);
                expect(close_to(want[i], got, sizes[i], tol[t]), msg);
            }
            if (sk) {
                snprintf(msg, sizeof msg, "%s %s%s: dsinks", what, dtype_names[t], how);
                expect(close_to(want_s, got_s, ns, tol[t] * (double)(c->L + 1)), msg);
            }
            /* the same threads: the same bits */
            fill_backward(&bp2, &p, c, test_dtypes[t], &gr2);
            st = npattn_sdpa_backward(&bp2);
            snprintf(msg, sizeof msg, "%s %s%s: bitwise again", what, dtype_names[t], how);
            const size_t wsz = wide == NPATTN_DTYPE_F64 ? 8 : 4;
            expect(st == NPATTN_STATUS_OK && !memcmp(gr.dq, gr2.dq, wsz * (size_t)nq) &&
                       !memcmp(gr.dk, gr2.dk, wsz * (size_t)nk) && !memcmp(gr.dv, gr2.dv, wsz * (size_t)nv) &&
                       (!sk || !memcmp(got_s, again_s, sizeof(double) * (size_t)ns)),
                   msg);
        }
    }
    free(q), free(k), free(v), free(g), free(out), free(lse), free(w), free(amask), free(bmask), free(got);
    for (int i = 0; i < 3; i++) free(want[i]);
    free(x.q), free(x.k), free(x.v), free(x.out), free(x.lse);
    free(gr.dout), free(gr.dq), free(gr.dk), free(gr.dv), free(gr2.dq), free(gr2.dk), free(gr2.dv);
}

/* One problem of case c with zero q and k (equal weights), v = value, the
 * backward ready to run: with `forward`, over the forward's out and lse, else
 * over zeros; buffers freed by free_setup. */
struct setup {
    struct buffers x;
    struct grads gr;
    struct npattn_problem p;
    struct npattn_backward_problem bp;
    int64_t bshape[1];
    double sinks[8];
};

static void make_setup(struct setup *s, const struct case_ *c, enum npattn_dtype dt, double value, int forward) {
    const int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    const int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv;
    memset(s, 0, sizeof *s);
    s->x.q = calloc((size_t)nq + 1, 8), s->x.k = calloc((size_t)nk + 1, 8), s->x.v = malloc(8 * (size_t)(nv + 1));
    s->x.out = calloc((size_t)no + 1, 8), s->x.lse = calloc((size_t)(c->B * c->Hq * c->L + 1), 8);
    s->gr.dout = malloc(8 * (size_t)(no + 1));
    for (int64_t i = 0; i < nv; i++) {
        if (dt == NPATTN_DTYPE_F64) ((double *)s->x.v)[i] = value;
        else ((float *)s->x.v)[i] = (float)value;
    }
    for (int64_t i = 0; i < no; i++) {
        if (dt == NPATTN_DTYPE_F64) ((double *)s->gr.dout)[i] = 1.0;
        else ((float *)s->gr.dout)[i] = 1.0f;
    }
    s->gr.dq = calloc((size_t)nq + 1, 8), s->gr.dk = calloc((size_t)nk + 1, 8), s->gr.dv = calloc((size_t)nv + 1, 8);
    s->gr.dsinks = calloc((size_t)(c->B * c->Hq + 1), sizeof(double));
    fill_problem(&s->p, c, dt, &s->x, c->sinks ? s->sinks : NULL, s->bshape);
    if (forward) npattn_sdpa(&s->p);
    fill_backward(&s->bp, &s->p, c, dt, &s->gr);
}

static void free_setup(struct setup *s) {
    free(s->x.q), free(s->x.k), free(s->x.v), free(s->x.out), free(s->x.lse);
    free(s->gr.dout), free(s->gr.dq), free(s->gr.dk), free(s->gr.dv), free(s->gr.dsinks);
}

/* Allocation failure at each allocation in turn is NO_MEMORY; with exactly enough
 * the call succeeds; the sanitizers watch for leaks. */
static void test_allocation_failure(const struct case_ *c, enum npattn_dtype dt) {
    struct setup s;
    make_setup(&s, c, dt, 0.5, 1);
    int n = 0;
    char msg[160];
    for (;; n++) {
        npattn_debug_fail_alloc_after(n);
        enum npattn_status st = npattn_sdpa_backward(&s.bp);
        npattn_debug_fail_alloc_after(-1);
        if (st == NPATTN_STATUS_OK) break;
        snprintf(msg, sizeof msg, "backward allocation %d of dtype %d fails: NO_MEMORY", n, (int)dt);
        expect(st == NPATTN_STATUS_NO_MEMORY, msg);
        if (n > 10) break;
    }
    snprintf(msg, sizeof msg, "backward dtype %d threads %d: succeeds after %d failing allocations", (int)dt,
             c->threads, n);
    expect(n >= 1 && n <= 4, msg);
    free_setup(&s);
}

static int cancel_now(void *arg) {
    ++*(int *)arg;
    return 1;
}

static void test_cancel(void) {
    const int64_t U = NPATTN_UNBOUNDED;
    struct case_ c = {1, 8, 2, 2048, 2048, 64, 64, 0, U, U, INT64_MIN, 0, MASK_NONE, 0, 0, 2};
    struct setup s;
    make_setup(&s, &c, NPATTN_DTYPE_F32, 0.5, 0);
    int polls = 0;
    s.bp.fwd.cancel = cancel_now;
    s.bp.fwd.cancel_arg = &polls;
    enum npattn_status st = npattn_sdpa_backward(&s.bp);
    expect(st == NPATTN_STATUS_CANCELLED && polls == 1, "backward cancel: one poll stops the call");
    free_setup(&s);
}

/* Problems that break a rule: INVALID, nothing written. */
static void test_invalid(void) {
    const int64_t U = NPATTN_UNBOUNDED;
    struct case_ c = {1, 4, 2, 3, 5, 8, 6, 1, U, U, INT64_MIN, 0, MASK_NONE, 0, 1, 1};
    struct setup s;
    make_setup(&s, &c, NPATTN_DTYPE_F32, 0.5, 1);
    struct npattn_backward_problem saved = s.bp;
    const enum npattn_operand NONE = NPATTN_OPERAND_NONE;
    const struct {
        const char *what;
        enum npattn_status status;
        enum npattn_operand operand, other;
    } rows[] = {
        {"no dq", NPATTN_STATUS_NO_DATA, NPATTN_OPERAND_DQ, NONE},
        {"no dout", NPATTN_STATUS_NO_DATA, NPATTN_OPERAND_DOUT, NONE},
        {"no lse", NPATTN_STATUS_NO_DATA, NPATTN_OPERAND_LSE, NONE},
        {"dq of float16", NPATTN_STATUS_NOT_WIDE, NPATTN_OPERAND_DQ, NONE},
        {"no dsinks with sinks", NPATTN_STATUS_NO_DATA, NPATTN_OPERAND_DSINKS, NONE},
        {"dk overlapping q", NPATTN_STATUS_OVERLAPS, NPATTN_OPERAND_DK, NPATTN_OPERAND_Q},
        {"dv overlapping dk", NPATTN_STATUS_OVERLAPS, NPATTN_OPERAND_DK, NPATTN_OPERAND_DV},
        {"lse of float16", NPATTN_STATUS_NOT_WIDE, NPATTN_OPERAND_LSE, NONE},
        {"dq overlapping itself", NPATTN_STATUS_OVERLAPS_ITSELF, NPATTN_OPERAND_DQ, NONE},
        {"dout of an unknown dtype", NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_DOUT, NONE},
    };
    for (int i = 0; i < (int)(sizeof rows / sizeof rows[0]); i++) {
        s.bp = saved;
        switch (i) {
        case 0: s.bp.dq.data = NULL; break;
        case 1: s.bp.dout.data = NULL; break;
        case 2: s.bp.fwd.lse.data = NULL; break;
        case 3: s.bp.dq.dtype = NPATTN_DTYPE_F16; break;
        case 4: s.bp.dsinks = NULL; break;
        case 5: s.bp.dk.data = s.bp.fwd.q.data; break;
        case 6: s.bp.dv.data = s.bp.dk.data; break;
        case 7: s.bp.fwd.lse.dtype = NPATTN_DTYPE_F16; break;
        case 8: s.bp.dq.row_stride = 0; break;
        case 9: s.bp.dout.dtype = (enum npattn_dtype)9; break;
        }
        char msg[120];
        snprintf(msg, sizeof msg, "backward invalid: %s", rows[i].what);
        expect_status(npattn_sdpa_backward(&s.bp), rows[i].status, msg);
        struct npattn_verdict why;
        npattn_check_backward(&s.bp, &why);
        expect_verdict(&why, rows[i].status, rows[i].operand, rows[i].other, msg);
    }
    s.bp = saved;
    expect_status(npattn_sdpa_backward(&s.bp), NPATTN_STATUS_OK, "backward invalid: the valid problem is OK");
    expect_status(npattn_sdpa_backward(NULL), NPATTN_STATUS_NO_PROBLEM, "backward: NULL problem");
    free_setup(&s);
}

/* Operands broadcast along the batch (batch stride 0), and their gradients of
 * one entry with batch stride 0: the core sums the batch into them, == the
 * long-double gradients of every entry summed. `bcast` has bit 0 for q, 1 for
 * k, 2 for v. */
static void test_broadcast(const struct case_ *c, int bcast, enum npattn_dtype dt) {
    const int64_t B = c->B, nq = B * c->Hq * c->L * c->D, nk = B * c->Hkv * c->S * c->D;
    const int64_t nv = B * c->Hkv * c->S * c->Dv, no = B * c->Hq * c->L * c->Dv, nl = B * c->Hq * c->L;
    const int64_t nm = c->Hq * c->L * c->S, sizes[3] = {nq, nk, nv};
    const int t = dt == NPATTN_DTYPE_F64 ? 0 : 1;
    const enum npattn_dtype wide = t == 0 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    double *in[3] = {malloc(8 * (size_t)nq), malloc(8 * (size_t)nk), malloc(8 * (size_t)nv)};
    double *want[3] = {malloc(8 * (size_t)nq), malloc(8 * (size_t)nk), malloc(8 * (size_t)nv)};
    double *g = malloc(8 * (size_t)no), *out = malloc(8 * (size_t)no), *lse = malloc(8 * (size_t)nl);
    double *w = malloc(8 * (size_t)(nl * c->S)), *amask = malloc(8 * (size_t)nm);
    double *got = malloc(8 * (size_t)(nq > nk ? (nq > nv ? nq : nv) : (nk > nv ? nk : nv)));
    double sinks[64], want_s[64], got_s[64];
    uint8_t *bmask = malloc((size_t)nm);
    for (int64_t i = 0; i < nm; i++) {
        bmask[i] = uniform() > -0.3;
        amask[i] = bmask[i] ? uniform() * 2 : -INFINITY;
    }
    for (int i = 0; i < 64; i++) sinks[i] = uniform() * 3;
    for (int o = 0; o < 3; o++) { /* a broadcast operand: every entry the first */
        for (int64_t i = 0; i < sizes[o]; i++) in[o][i] = uniform() * (o == 2 ? 1 : 2);
        if (bcast >> o & 1)
            for (int64_t i = sizes[o] / B; i < sizes[o]; i++) in[o][i] = in[o][i % (sizes[o] / B)];
    }
    for (int64_t i = 0; i < no; i++) g[i] = uniform();
    const double *sk = c->sinks ? sinks : NULL;
    naive(c, in[0], in[1], in[2], bmask, amask, sk, out, lse, w);
    naive_backward(c, in[0], in[1], in[2], g, w, lse, sk, want[0], want[1], want[2], want_s);
    for (int o = 0; o < 3; o++) /* a broadcast operand's gradient: the batch summed, in order */
        if (bcast >> o & 1)
            for (int64_t i = sizes[o] / B; i < sizes[o]; i++) want[o][i % (sizes[o] / B)] += want[o][i];

    struct buffers x;
    struct grads gr;
    void *grads[3];
    x.q = malloc(8 * (size_t)nq), x.k = malloc(8 * (size_t)nk), x.v = malloc(8 * (size_t)nv);
    x.out = malloc(8 * (size_t)no), x.lse = malloc(8 * (size_t)nl), x.weights = NULL;
    x.mask = c->mask == MASK_BOOL ? (void *)bmask : (void *)amask;
    gr.dout = malloc(8 * (size_t)no), gr.dsinks = got_s;
    for (int o = 0; o < 3; o++) grads[o] = malloc(8 * (size_t)sizes[o]);
    gr.dq = grads[0], gr.dk = grads[1], gr.dv = grads[2];
    from_double(dt, in[0], nq, x.q), from_double(dt, in[1], nk, x.k), from_double(dt, in[2], nv, x.v);
    from_double(dt, g, no, gr.dout);
    struct npattn_problem p;
    struct npattn_backward_problem bp;
    int64_t bshape[1];
    fill_problem(&p, c, dt, &x, sk, bshape);
    for (int o = 0; o < 3; o++)
        if (bcast >> o & 1) x.bs[o] = 0; /* read entry 0 for every entry */
    enum npattn_status st = npattn_sdpa(&p);
    for (int o = 0; o < 3; o++) memset(grads[o], 0xff, 8 * (size_t)sizes[o]); /* garbage to write over */
    fill_backward(&bp, &p, c, dt, &gr);
    for (int o = 0; o < 3; o++)
        if (bcast >> o & 1) gr.bs[1 + o] = 0; /* one entry: summed over the batch */
    if (st == NPATTN_STATUS_OK) st = npattn_sdpa_backward(&bp);
    char msg[200];
    static const char *grad_names[3] = {"dq", "dk", "dv"};
    static const double tol[2] = {1e-11, 2e-4};
    snprintf(msg, sizeof msg, "backward broadcast %d B=%lld mask=%d sinks=%d threads=%d %s: status", bcast,
             (long long)B, (int)c->mask, c->sinks, c->threads, dtype_names[t]);
    expect(st == NPATTN_STATUS_OK, msg);
    for (int o = 0; o < 3; o++) {
        const int64_t n = bcast >> o & 1 ? sizes[o] / B : sizes[o];
        to_double(wide, grads[o], n, got);
        snprintf(msg, sizeof msg, "backward broadcast %d B=%lld mask=%d sinks=%d threads=%d %s: %s", bcast,
                 (long long)B, (int)c->mask, c->sinks, c->threads, dtype_names[t], grad_names[o]);
        expect(close_to(want[o], got, n, tol[t] * (double)B), msg);
    }
    if (sk) {
        snprintf(msg, sizeof msg, "backward broadcast %d B=%lld threads=%d %s: dsinks", bcast, (long long)B,
                 c->threads, dtype_names[t]);
        expect(close_to(want_s, got_s, B * c->Hq, tol[t] * (double)(c->L + 1)), msg);
    }
    for (int o = 0; o < 3; o++) free(in[o]), free(want[o]), free(grads[o]);
    free(g), free(out), free(lse), free(w), free(amask), free(got), free(bmask);
    free(x.q), free(x.k), free(x.v), free(x.out), free(x.lse), free(gr.dout);
}

int main(void) {
    const int64_t U = NPATTN_UNBOUNDED, BR = INT64_MIN;
    if (!npattn_blas_ok()) { /* test_attention checks the refusal */
        printf("skipped: the BLAS (core %s) fails npattn's check on this CPU\n", npattn_blas_core());
        return 0;
    }
    static const struct case_ cases[] = {
        /* B Hq Hkv L S D Dv causal wl wr q_offset k_offset mask softcap sinks threads */
        {2, 6, 2, 3, 7, 5, 4, 1, U, U, BR, 0, MASK_NONE, 0, 0, 1},     /* the course's sizes, causal */
        {2, 6, 2, 3, 7, 5, 4, 1, U, U, 0, 0, MASK_NONE, 0, 1, 2},      /* top-left, sinks */
        {1, 4, 2, 7, 3, 5, 4, 1, U, U, BR, 0, MASK_NONE, 0, 1, 1},     /* L > S: rows with no key */
        {1, 4, 2, 40, 90, 16, 12, 0, U, U, BR, 0, MASK_ADD, 3.0, 1, 2}, /* additive mask, softcap */
        {1, 4, 1, 70, 300, 16, 16, 0, U, U, BR, 0, MASK_BOOL, 0, 0, 3},
        {1, 4, 2, 100, 100, 16, 16, 1, 9, 0, BR, 0, MASK_NONE, 0, 0, 2}, /* a window */
        {2, 4, 4, 20, 50, 8, 8, 1, U, U, 40, 35, MASK_NONE, 0.5, 0, 2},  /* offsets, a tight cap */
        {1, 2, 1, 4, 0, 4, 4, 0, U, U, BR, 0, MASK_NONE, 0, 1, 1},       /* S = 0 with sinks */
        {0, 2, 1, 4, 5, 4, 4, 0, U, U, BR, 0, MASK_NONE, 0, 0, 1},       /* B = 0 */
        {2, 0, 1, 4, 5, 4, 3, 0, U, U, BR, 0, MASK_NONE, 0, 0, 1},       /* H_q = 0: dK, dV zeros */
        {1, 2, 1, 3, 6, 4, 0, 1, U, U, BR, 0, MASK_NONE, 0, 1, 1},       /* D_v = 0 */
        {1, 300, 2, 2, 40, 4, 4, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2},    /* groups beyond a tile's rows */
        /* one unit, many key blocks: split across threads, dQ summed from parts */
        {1, 2, 1, 3, 3000, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 1, 2},
        {1, 2, 1, 40, 1500, 8, 8, 0, 200, 30, BR, 0, MASK_BOOL, 0, 0, 3},
        /* rows as wide as the AMX tiles' (the bfloat16 products' paths, "fast" too) */
        {1, 4, 2, 70, 90, 64, 64, 1, U, U, BR, 0, MASK_NONE, 0, 1, 2},
        /* wide rows: fewer keys per block */
        {1, 2, 1, 9, 40, 300, 200, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2},
        /* q_offset - k_offset past +-2^63, a window side bringing the band back within the keys */
        {1, 2, 1, 6, 9, 8, 8, 0, INT64_MAX, 0, (INT64_C(1) << 62) + 3, -(INT64_C(1) << 62) - 2, MASK_NONE, 0, 0, 1},
        {1, 2, 1, 6, 9, 8, 8, 1, INT64_MAX, U, (INT64_C(1) << 62) + 3, -(INT64_C(1) << 62) - 2, MASK_BOOL, 0, 1, 1},
        {1, 2, 1, 6, 9, 8, 8, 0, U, INT64_MAX, -(INT64_C(1) << 62) - 1, INT64_C(1) << 62, MASK_NONE, 0, 0, 1},
    };
    for_each_table(cases, sizeof cases / sizeof cases[0], run_case);
    static const struct case_ small = {1, 2, 1, 40, 50, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 1, 1};
    static const struct case_ split = {1, 2, 1, 1, 3000, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2};
    test_allocation_failure(&small, NPATTN_DTYPE_F64);
    test_allocation_failure(&small, NPATTN_DTYPE_F32);
    test_allocation_failure(&split, NPATTN_DTYPE_F64);
    test_allocation_failure(&split, NPATTN_DTYPE_F32);
    test_cancel();
    test_invalid();
    static const struct case_ broadcasts[] = {
        /* B Hq Hkv L S D Dv causal wl wr q_offset k_offset mask softcap sinks threads */
        {4, 6, 2, 5, 9, 4, 3, 1, U, U, BR, 0, MASK_NONE, 0, 1, 1},
        {4, 6, 2, 5, 9, 4, 3, 0, U, U, BR, 0, MASK_BOOL, 0, 0, 3},
        {3, 4, 2, 30, 400, 8, 8, 0, 200, 30, BR, 0, MASK_ADD, 2.0, 1, 2}, /* key blocks of several chunks */
        {5, 2, 1, 1, 600, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 0, 4},     /* decode: one unit, no split */
    };
    for (size_t i = 0; i < sizeof broadcasts / sizeof broadcasts[0]; i++)
        for (int bcast = 1; bcast < 8; bcast++) {
            test_broadcast(&broadcasts[i], bcast, NPATTN_DTYPE_F64);
            test_broadcast(&broadcasts[i], bcast, NPATTN_DTYPE_F32);
        }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}

/* test_attention.c: the forward pass of the core alone, no Python, against a
 * naive loop in long double: every mask, the band of positions and windows,
 * softcap, sinks, lse and weights, in float64, float32, float16 and
 * bfloat16, under every kernel table this CPU runs; allocation failure at
 * each allocation, cancellation, the pool's three ways of running and calls
 * into it from several threads at once, extremes recomputed in double, the
 * conversions, and problems that break a rule.
 *
 *   make -C csrc test            (see csrc/Makefile; SAN=1 for the sanitizers)
 *
 * Prints one line per failure and a final "N passed, N failed" line; exits
 * nonzero on any failure.
 */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <pthread.h>
#include <stdatomic.h>

#include "internal.h"
#include "test_common.h"

static void run_case(const struct case_ *c, const char *table) {
    const int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    const int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv;
    const int64_t nl = c->B * c->Hq * c->L, nw = nl * c->S, nm = c->Hq * c->L * c->S;
    double *q = malloc(8 * (size_t)(nq + 1)), *k = malloc(8 * (size_t)(nk + 1)), *v = malloc(8 * (size_t)(nv + 1));
    double *want = malloc(8 * (size_t)(no + 1)), *want_lse = malloc(8 * (size_t)(nl + 1));
    double *want_w = malloc(8 * (size_t)(nw + 1)), *got = malloc(8 * (size_t)(no + nw + 1));
    double *amask = malloc(8 * (size_t)(nm + 1)), sinks[64];
    uint8_t *bmask = malloc((size_t)nm + 1);
    struct buffers x;
    x.q = malloc(8 * (size_t)(nq + 1)), x.k = malloc(8 * (size_t)(nk + 1)), x.v = malloc(8 * (size_t)(nv + 1));
    x.out = malloc(8 * (size_t)(no + 1)), x.lse = malloc(8 * (size_t)(nl + 1)), x.weights = malloc(8 * (size_t)(nw + 1));
    x.mask = c->mask == MASK_BOOL ? (void *)bmask : (void *)amask;
    random_masks(nm, bmask, amask, sinks);
    const double *sk = c->sinks ? sinks : NULL;
    char what[320];
    describe_case(what, sizeof what, "", table, c);

    /* float64 is the naive loop to double rounding; float32, float16 and
     * bfloat16 see the inputs rounded to them, compute in float, and round
     * the result once more (2^-11 and 2^-8 relative, |out| <= max|v| <= 1) */
    static const double tol[N_DTYPES] = {1e-12, 2e-5, 1.5e-3, 1.2e-2};
    for (int t = 0; t < N_DTYPES; t++) {
        for (int64_t i = 0; i < nq; i++) q[i] = uniform() * 2;
        for (int64_t i = 0; i < nk; i++) k[i] = uniform() * 2;
        for (int64_t i = 0; i < nv; i++) v[i] = uniform();
        from_double(test_dtypes[t], q, nq, x.q);
        from_double(test_dtypes[t], k, nk, x.k);
        from_double(test_dtypes[t], v, nv, x.v);
        naive(c, q, k, v, bmask, amask, sk, want, want_lse, want_w);
        struct npattn_problem p;
        int64_t bshape[1];
        fill_problem(&p, c, test_dtypes[t], &x, sk, bshape);
        enum npattn_status st = npattn_sdpa(&p);
        to_double(test_dtypes[t], x.out, no, got);
        char msg[400];
        snprintf(msg, sizeof msg, "%s %s: out", what, dtype_names[t]);
        expect(st == NPATTN_STATUS_OK && max_err(want, got, no, 0) < tol[t], msg);
        to_double(test_dtypes[t] == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32, x.lse, nl, got);
        snprintf(msg, sizeof msg, "%s %s: lse", what, dtype_names[t]);
        expect(max_err(want_lse, got, nl, 1) < (t == 0 ? 1e-12 : 2e-5 * 16), msg);
        if (t < 2) { /* the weights, with no output at all */
            p.n_embd_v = 0;
            p.lse.data = NULL;
            st = npattn_sdpa(&p);
            to_double(test_dtypes[t], x.weights, nw, got);
            snprintf(msg, sizeof msg, "%s %s: weights", what, dtype_names[t]);
            expect(st == NPATTN_STATUS_OK && max_err(want_w, got, nw, 0) < tol[t], msg);
        }
    }
    free(q), free(k), free(v), free(want), free(want_lse), free(want_w), free(got), free(amask), free(bmask);
    free(x.q), free(x.k), free(x.v), free(x.out), free(x.lse), free(x.weights);
}

/* Allocation failure at each allocation in turn is NO_MEMORY, then the call
 * succeeds with exactly enough; the sanitizers watch for leaks. */
static void test_allocation_failure(const struct case_ *c, enum npattn_dtype dt, double value) {
    const int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    const int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv;
    struct buffers x;
    memset(&x, 0, sizeof x);
    x.q = calloc((size_t)nq + 1, 8), x.k = calloc((size_t)nk + 1, 8), x.v = malloc(8 * (size_t)(nv + 1));
    x.out = malloc(8 * (size_t)(no + 1)), x.lse = malloc(8 * (size_t)(c->B * c->Hq * c->L + 1));
    for (int64_t i = 0; i < nv; i++) {
        if (dt == NPATTN_DTYPE_F64) ((double *)x.v)[i] = value;
        else ((float *)x.v)[i] = (float)value;
    }
    struct npattn_problem p;
    int64_t bshape[1];
    fill_problem(&p, c, dt, &x, NULL, bshape);
    p.weights.data = NULL;
    int n = 0;
    enum npattn_status st = NPATTN_STATUS_NO_MEMORY;
    for (; n < 10 && st == NPATTN_STATUS_NO_MEMORY; n++) {
        npattn_debug_fail_alloc_after(n);
        st = npattn_sdpa(&p);
        npattn_debug_fail_alloc_after(-1);
    }
    char msg[200];
    snprintf(msg, sizeof msg, "allocation failure S=%lld dt=%d value=%g: NO_MEMORY until the %dth, then OK",
             (long long)c->S, (int)dt, value, n);
    expect(st == NPATTN_STATUS_OK && n >= 2, msg);
    double first = dt == NPATTN_DTYPE_F64 ? ((double *)x.out)[0] : ((float *)x.out)[0];
    expect(first == (dt == NPATTN_DTYPE_F64 ? value : (double)(float)value), "allocation failure: then the right answer");
    free(x.q), free(x.k), free(x.v), free(x.out), free(x.lse);
}

static int cancel_now(void *arg) {
    (*(int *)arg)++;
    return 1;
}

static void test_cancel(void) {
    /* a call long enough to be polled (several seconds) stops with CANCELLED */
    struct case_ c = {1, 8, 2, 4096, 4096, 64, 64, 0, NPATTN_UNBOUNDED, NPATTN_UNBOUNDED, INT64_MIN, 0, MASK_NONE, 0, 0, 2};
    struct buffers x;
    x.q = calloc(8 * 4096 * 64, 4), x.k = calloc(2 * 4096 * 64, 4), x.v = calloc(2 * 4096 * 64, 4);
    x.out = calloc(8 * 4096 * 64, 4), x.lse = x.weights = x.mask = NULL;
    struct npattn_problem p;
    int64_t bshape[1];
    fill_problem(&p, &c, NPATTN_DTYPE_F32, &x, NULL, bshape);
    int polls = 0;
    p.cancel = cancel_now;
    p.cancel_arg = &polls;
    enum npattn_status st = npattn_sdpa(&p);
    expect(st == NPATTN_STATUS_CANCELLED && polls == 1, "cancel: one poll stops the call");
    free(x.q), free(x.k), free(x.v), free(x.out);
}

/* The weights of long rows (4 rows of 2**25 keys, float16) that see one
 * key each: the cancel flag (first polled here 1 ms into a call) is polled
 * while the rows are zeroed, so a call cancelled then leaves the last row
 * untouched; the rows used to be zeroed whole before the first poll. */
static void test_cancel_zeroing_weights(void) {
    const int64_t L = 4, S = (int64_t)1 << 25;
    const uint16_t nan16 = 0x7e00, one16 = 0x3c00;
    struct case_ c = {1, 1, 1, L, S, 4, 0, 0, 0, 0, INT64_MIN, 0, MASK_NONE, 0, 0, 1};
    struct buffers x;
    memset(&x, 0, sizeof x);
    x.q = calloc((size_t)L * 4, 2), x.k = calloc((size_t)S * 4, 2), x.weights = malloc((size_t)(L * S) * 2);
    uint16_t *w = x.weights;
    for (int64_t j = 0; j < L * S; j++) w[j] = nan16;
    struct npattn_problem p;
    int64_t bshape[1];
    fill_problem(&p, &c, NPATTN_DTYPE_F16, &x, NULL, bshape);
    int polls = 0;
    p.cancel = cancel_now;
    p.cancel_arg = &polls;
    npattn_debug_poll_interval(1000000); /* 1 ms: well within the zeroing of 2^27 elements */
    expect_status(npattn_sdpa(&p), NPATTN_STATUS_CANCELLED, "cancel while zeroing the weights: CANCELLED");
    npattn_debug_poll_interval(0);
    expect(polls == 1 && w[L * S - 1] == nan16, "cancel while zeroing the weights: the last row is left as it was");
    p.cancel = NULL;
    expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "the weights of long rows: OK");
    /* row i sits at position S - L + i and sees that key only */
    int one_key = 1;
    for (int64_t i = 0; i < L; i++)
        one_key &= w[i * S + S - L + i] == one16 && w[i * S] == 0 && w[i * S + S - L + i - 1] == 0;
    expect(one_key, "the weights of long rows: one key each");
    free(x.q), free(x.k), free(x.weights);
}

static void test_pool_modes(void) {
    /* the same plan whoever runs it: caller alone (1), helpers for any work (2) */
    struct case_ c = {2, 8, 2, 150, 300, 32, 32, 1, 40, NPATTN_UNBOUNDED, INT64_MIN, 0, MASK_NONE, 0, 1, 2};
    const int64_t nq = 2 * 8 * 150 * 32, nk = 2 * 2 * 300 * 32;
    struct buffers x;
    x.q = malloc(4 * nq), x.k = malloc(4 * nk), x.v = malloc(4 * nk), x.lse = x.weights = x.mask = NULL;
    for (int64_t i = 0; i < nq; i++) ((float *)x.q)[i] = (float)uniform();
    for (int64_t i = 0; i < nk; i++) ((float *)x.k)[i] = (float)uniform(), ((float *)x.v)[i] = (float)uniform();
    float *outs[3];
    double sinks[8] = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8};
    for (int mode = 0; mode < 3; mode++) {
        x.out = outs[mode] = malloc(4 * nq);
        struct npattn_problem p;
        int64_t bshape[1];
        fill_problem(&p, &c, NPATTN_DTYPE_F32, &x, sinks, bshape);
        npattn_debug_pool_mode(mode);
        expect(npattn_sdpa(&p) == NPATTN_STATUS_OK, "pool mode: OK");
        npattn_debug_pool_mode(0);
    }
    expect(!memcmp(outs[0], outs[1], 4 * nq) && !memcmp(outs[0], outs[2], 4 * nq), "pool modes: bitwise equal");
    for (int mode = 0; mode < 3; mode++) free(outs[mode]);
    free(x.q), free(x.k), free(x.v);
}

/* The pool under calls from several threads at once, of every size: each
 * task runs exactly once, no two threads hold one slot at a time, and no
 * slot reaches the call's thread count. */
#define TALLY_TASKS 64
#define TALLY_THREADS 16
struct pool_tally {
    atomic_int runs[TALLY_TASKS], in_slot[TALLY_THREADS], clash;
    int32_t n_threads;
};

static void tally_task(void *arg, int64_t task, int32_t slot) {
    struct pool_tally *a = arg;
    if (slot < 0 || slot >= a->n_threads || atomic_fetch_add(&a->in_slot[slot], 1) != 0) {
        atomic_store(&a->clash, 1);
        return;
    }
    for (volatile int i = 0; i < (int)(task % 7) * 3000; i++) {} /* tasks of unequal lengths */
    atomic_fetch_add(&a->runs[task], 1);
    atomic_fetch_sub(&a->in_slot[slot], 1);
}

struct pool_caller {
    uint32_t seed;
    int wrong; /* calls that went wrong */
};

static void *pool_caller(void *arg) {
    struct pool_caller *c = arg;
    for (int call = 0; call < 200; call++) {
        c->seed = c->seed * 1103515245u + 12345u;
        const int64_t n_task = 1 + (c->seed >> 8) % TALLY_TASKS;
        const int32_t n_threads = 1 + (int32_t)((c->seed >> 20) % TALLY_THREADS);
        struct pool_tally a = {{0}, {0}, 0, n_threads};
        struct npattn_run run;
        npattn_run_init(&run, NULL, NULL);
        int wrong = npattn_pool_run(tally_task, &a, n_task, n_threads, &run) != NPATTN_STATUS_OK || atomic_load(&a.clash);
        for (int64_t t = 0; t < n_task; t++) wrong |= atomic_load(&a.runs[t]) != 1;
        c->wrong += wrong;
    }
    return NULL;
}

static void test_pool_concurrent(void) {
    enum { N = 3 };
    pthread_t t[N];
    struct pool_caller c[N];
    int started[N], ok = 1;
    for (int i = 0; i < N; i++) {
        c[i] = (struct pool_caller){(uint32_t)i + 1, 0};
        started[i] = pthread_create(&t[i], NULL, pool_caller, &c[i]) == 0;
    }
    for (int i = 0; i < N; i++) {
        if (started[i]) pthread_join(t[i], NULL);
        ok &= started[i] && !c[i].wrong;
    }
    expect(ok, "pool: calls from 3 threads at once, every task run once, each slot held by one thread at a time "
               "and below the call's threads");
}

static void test_extremes(void) {
    /* finite float32 inputs whose exact result is representable give it:
     * a sink of 3e38 takes all the weight (0); five values of 1e38, whose
     * sum overflows float, average to 1e38 */
    float q[2 * 4] = {0}, k[5 * 4] = {0}, v[5 * 2], out[2 * 2 * 2];
    for (int i = 0; i < 10; i++) v[i] = 1e38f;
    double sinks[2] = {3e38, -INFINITY};
    int64_t bshape[1] = {1}, bs[7] = {0};
    struct npattn_problem p;
    memset(&p, 0, sizeof p);
    p.n_batch_dim = 1, p.batch_shape = bshape, p.n_head_q = 2, p.n_head_kv = 1, p.n_query = 1, p.n_key = 5;
    p.n_embd_k = 4, p.n_embd_v = 2, p.scale = 1.0, p.n_threads = 1;
    p.q = (struct npattn_tensor){q, NPATTN_DTYPE_F32, bs, 4, 4, 1};
    p.k = (struct npattn_tensor){k, NPATTN_DTYPE_F32, bs, 20, 4, 1};
    p.v = (struct npattn_tensor){v, NPATTN_DTYPE_F32, bs, 10, 2, 1};
    p.out = (struct npattn_tensor){out, NPATTN_DTYPE_F32, bs, 2, 2, 1};
    p.sinks = sinks;
    p.window_left = p.window_right = NPATTN_UNBOUNDED;
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        expect(npattn_sdpa(&p) == NPATTN_STATUS_OK, "extremes: OK");
        expect(out[0] == 0 && out[1] == 0, "extremes: a sink of 3e38 leaves 0");
        expect(out[2] == 1e38f && out[3] == 1e38f, "extremes: values of 1e38 average to 1e38");
    }
    npattn_kernels_force("");
}

static void test_conversions(void) {
    /* float16 and bfloat16 rounding, checked against values worked out by hand */
    const float in[] = {1.0f, -2.5f, 65504.0f, 65520.0f, 1e-8f, 5.9604645e-8f, 2.9802322e-8f, 1.00048828125f,
                        1.000732421875f, 3.0f};
    const uint16_t f16[] = {0x3C00, 0xC100, 0x7BFF, 0x7C00, 0x0000, 0x0001, 0x0000, 0x3C00, 0x3C01, 0x4200};
    const uint16_t bf16[] = {0x3F80, 0xC020, 0x4780, 0x4780, 0x322C, 0x3380, 0x3300, 0x3F80, 0x3F80, 0x4040};
    uint16_t got[10];
    npattn_store_f32(NPATTN_DTYPE_F16, in, 10, got, 1);
    expect(memcmp(got, f16, sizeof got) == 0, "float32 -> float16 rounding");
    npattn_store_f32(NPATTN_DTYPE_BF16, in, 10, got, 1);
    expect(memcmp(got, bf16, sizeof got) == 0, "float32 -> bfloat16 rounding");
    float back[10];
    npattn_load_f32(NPATTN_DTYPE_F16, f16, 1, 10, back);
    expect(back[1] == -2.5f && back[2] == 65504.0f && isinf(back[3]) && back[5] == 5.9604645e-8f, "float16 -> float32");
    /* NaN stays NaN (quiet), one stride or another */
    const float odd[] = {NAN, -NAN, INFINITY, -0.0f};
    uint16_t two[8] = {0};
    npattn_store_f32(NPATTN_DTYPE_BF16, odd, 4, two, 2);
    expect((two[0] & 0x7FC0) == 0x7FC0 && (two[2] & 0x7FC0) == 0x7FC0 && two[4] == 0x7F80 && two[6] == 0x8000 &&
               two[1] == 0,
           "float32 -> bfloat16: NaN, infinity, -0 at stride 2");
    double wide[3] = {1e300, -1e300, -INFINITY};
    npattn_load_f32(NPATTN_DTYPE_F64, wide, 1, 3, back);
    expect(back[0] == 3.4028234663852886e38f && back[1] == -3.4028234663852886e38f && back[2] == -INFINITY,
           "float64 -> float32 keeps finite values finite");
}

/* pairs_across against its definition: out[c / 2 * ldo + r] holds x[r][c]
 * and x[r][c + 1] as bfloat16 (0 past an odd width), zeros in lanes n .. ldo,
 * for row counts around 16 and widths around the 128 of a chunk. */
static void test_pairs_across(void) {
    static float x[37 * 131];
    static uint32_t out[66 * 48];
    for (int i = 0; i < 37 * 131; i++) x[i] = (float)((i * 7919) % 1000 - 500) / 64.0f;
    const int sizes[][2] = {{1, 2}, {16, 128}, {17, 131}, {37, 130}, {15, 1}};
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0 || !npattn_kernels()->bf16_f32) continue;
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            const int n = sizes[k][0], w = sizes[k][1], ldo = 48;
            memset(out, 0xAB, sizeof out);
            expect(npattn_pairs_across(x, n, w, 131, out, ldo) == 0, "pairs_across: no subnormal");
            int bad = 0;
            for (int p = 0; p < (w + 1) / 2; p++)
                for (int r = 0; r < ldo; r++) {
                    uint32_t want = 0;
                    if (r < n) {
                        want = npattn_f32_to_bf16(x[r * 131 + 2 * p]);
                        if (2 * p + 1 < w) want |= (uint32_t)npattn_f32_to_bf16(x[r * 131 + 2 * p + 1]) << 16;
                    }
                    bad += out[p * ldo + r] != want;
                }
            expect(bad == 0, "pairs_across: each pair in its lane, zeros past the rows");
        }
    }
    npattn_kernels_force("");
}

/* Every table's transpose_f32 (where it has one) moves each element to its
 * place: rows and widths around the blocks' 4 and 8. */
static void test_transpose(void) {
    enum { MAX_M = 70, MAX_W = 130 };
    static const int64_t sizes[] = {1, 3, 4, 5, 7, 8, 9, 12, 16, 17, 64, 70, 128, 130};
    static float rows[MAX_M * MAX_W], got[MAX_W * MAX_M];
    char msg[120];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0 || !npattn_kernels()->transpose_f32) continue;
        for (size_t mi = 0; mi < sizeof sizes / sizeof *sizes && sizes[mi] <= MAX_M; mi++)
            for (size_t wi = 0; wi < sizeof sizes / sizeof *sizes; wi++) {
                const int64_t M = sizes[mi], w = sizes[wi];
                for (int64_t i = 0; i < M * w; i++) rows[i] = (float)i;
                for (int64_t i = 0; i < M * w; i++) got[i] = -1.0f;
                npattn_kernels()->transpose_f32(rows, w, M, w, got, M);
                int ok = 1;
                for (int64_t r = 0; r < M; r++)
                    for (int64_t d = 0; d < w; d++) ok &= got[d * M + r] == rows[r * w + d];
                snprintf(msg, sizeof msg, "%s: transpose_f32 of %lld x %lld", kernel_tables[t], (long long)M, (long long)w);
                expect(ok, msg);
            }
    }
    npattn_kernels_force("");
}

/* Every table's gemm_f32 (where it has one) against the product in double:
 * rows around its blocks of 4 and 6, columns around its vectors and
 * column blocks (avx2's last 25-32 in two), k past its blocks of b's packed rows, a as stored and
 * transposed, leading dimensions past the widths, alpha and beta. Within
 * (k + 3) units of float's rounding of the terms' magnitudes (one rounding
 * a term and the scaling's two); c untouched past n, and not read where
 * beta is 0 (NaN there). */
static void test_gemm(void) {
    enum { MAX_M = 40, MAX_N = 131, MAX_K = 300, PAD = 3 };
    static const int64_t ms[] = {1, 5, 6, 7, 13, 40}, ns[] = {1, 7, 8, 9, 16, 17, 32, 48, 56, 63, 64, 65, 128, 131},
                         ks[] = {0, 1, 3, 127, 128, 129, 300};
    static float a[(MAX_M + PAD) * (MAX_K + PAD)], b[MAX_K * (MAX_N + PAD)], c[MAX_M * (MAX_N + PAD)], c0[MAX_M * (MAX_N + PAD)];
    char msg[160];
    for (int64_t i = 0; i < (MAX_M + PAD) * (MAX_K + PAD); i++) a[i] = (float)uniform();
    for (int64_t i = 0; i < MAX_K * (MAX_N + PAD); i++) b[i] = (float)uniform();
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0 || !npattn_kernels()->gemm_f32) continue;
        for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
                for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++)
                    for (int form = 0; form < 4; form++) {
                        const int64_t m = ms[mi], n = ns[ni], k = ks[ki], ldb = n + PAD, ldc = n + PAD;
                        const int trans = form & 1;
                        const float alpha = form & 2 ? 0.5f : 1.0f, beta = form == 1 || form == 2 ? 1.0f : 0.0f;
                        /* a (m, k) stored with rows lda apart, or its transpose (k, m) */
                        const int64_t lda = (trans ? m : k) + PAD, a_rs = trans ? 1 : lda, a_ps = trans ? lda : 1;
                        for (int64_t i = 0; i < m * ldc; i++) c0[i] = i % ldc < n ? (float)uniform() : 7.0f;
                        for (int64_t i = 0; i < m * ldc; i++) c[i] = beta == 0.0f && i % ldc < n ? NAN : c0[i];
                        npattn_kernels()->gemm_f32(m, n, k, alpha, a, a_rs, a_ps, b, ldb, beta, c, ldc);
                        int ok = 1;
                        for (int64_t i = 0; i < m; i++) {
                            for (int64_t j = 0; j < n; j++) {
                                double want = 0, mag = 0;
                                for (int64_t p = 0; p < k; p++) {
                                    const double x = (double)a[i * a_rs + p * a_ps] * (double)b[p * ldb + j];
                                    want += x, mag += fabs(x);
                                }
                                const double cw = beta == 0.0f ? 0.0 : (double)c0[i * ldc + j];
                                const double tol = (double)(k + 3) * 0x1p-24 * (alpha * mag + fabs(cw)) + 0x1p-140;
                                ok &= fabs((double)c[i * ldc + j] - (alpha * want + beta * cw)) <= tol;
                            }
                            for (int64_t j = n; j < ldc; j++) ok &= c[i * ldc + j] == 7.0f;
                        }
                        snprintf(msg, sizeof msg, "%s: gemm_f32 %s m=%lld n=%lld k=%lld alpha=%g beta=%g",
                                 kernel_tables[t], trans ? "a^T" : "a", (long long)m, (long long)n, (long long)k,
                                 (double)alpha, (double)beta);
                        expect(ok, msg);
                    }
    }
    npattn_kernels_force("");
}

/* Every table's finish_rows against the scalar rounding of x * (1 / l):
 * float32, float16 and bfloat16 rows of widths around the vectors' 8 and
 * 16, a row with l = 0 (zeros), results that round to subnormals or to
 * float16's infinity, the gap between rows untouched, no l (narrowed only),
 * and the report of a NaN or infinite value. */
static void test_finish_rows(void) {
    enum { N = 4, MAX_W = 70, LD = MAX_W + 3 };
    static const int64_t widths[] = {1, 7, 8, 9, 15, 16, 17, 64, 70};
    static const enum npattn_dtype types[] = {NPATTN_DTYPE_F32, NPATTN_DTYPE_F16, NPATTN_DTYPE_BF16};
    static const char *const names[] = {"float32", "float16", "bfloat16"};
    static const float seeds[] = {1.0f, -2.5f, 3e-39f, 5e-6f, 7e4f, 1.00390625f, -1.01171875f, 0x1p-140f, 0.3f};
    const float l[N] = {1.0f, 0.0f, 3.0f, 0.5f};
    float o[N * MAX_W];
    uint32_t got[N * LD];
    char msg[160];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        const struct npattn_kernels *kt = npattn_kernels();
        for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++)
            for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
                const int64_t w = widths[wi];
                const enum npattn_dtype dt = types[ti];
                for (int64_t i = 0; i < N * w; i++) o[i] = seeds[(i * 5 + wi) % 9] * (i % 3 ? 1.0f : -1.0f);
                memset(got, 0xA5, sizeof got);
                int ok = kt->finish_rows(o, N, w, l, dt, got, LD) == 0;
                for (int64_t i = 0; i < N; i++) {
                    const float inv = l[i] == 0.0f ? 0.0f : 1.0f / l[i];
                    for (int64_t e = 0; e < LD; e++) {
                        const float y = inv == 0.0f || e >= w ? 0.0f : o[i * w + e] * inv;
                        if (dt == NPATTN_DTYPE_F32) {
                            float g;
                            memcpy(&g, (float *)got + i * LD + e, sizeof g);
                            ok &= e < w ? memcmp(&g, &y, sizeof g) == 0 : ((uint32_t *)got)[i * LD + e] == 0xA5A5A5A5u;
                        } else {
                            const uint16_t g = ((uint16_t *)got)[i * LD + e];
                            ok &= e < w ? g == (dt == NPATTN_DTYPE_F16 ? npattn_f32_to_f16(y) : npattn_f32_to_bf16(y))
                                        : g == 0xA5A5;
                        }
                    }
                }
                /* l NULL: narrowed only, every row */
                ok &= kt->finish_rows(o, N, w, NULL, dt, got, LD) == 0;
                for (int64_t i = 0; i < N * LD; i++) {
                    const int64_t e = i % LD;
                    if (e >= w) continue;
                    const float y = o[i / LD * w + e];
                    if (dt == NPATTN_DTYPE_F32) ok &= memcmp((float *)got + i, &y, sizeof y) == 0;
                    else
                        ok &= ((uint16_t *)got)[i] == (dt == NPATTN_DTYPE_F16 ? npattn_f32_to_f16(y) : npattn_f32_to_bf16(y));
                }
                o[(N - 1) * w + w / 2] = (w % 2) ? INFINITY : NAN;
                ok &= kt->finish_rows(o, N, w, l, dt, got, LD) != 0;
                snprintf(msg, sizeof msg, "%s finish_rows %s w=%lld", kernel_tables[t], names[ti],
                         (long long)w);
                expect(ok, msg);
            }
    }
    npattn_kernels_force("");
}

/* Every table's add_f32, o += x, over lengths around its vectors, the
 * element past n untouched. */
static void test_add_f32(void) {
    float o[70], x[70];
    char msg[80];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        int ok = 1;
        for (int64_t n = 0; n < 69; n += n < 20 ? 1 : 16) {
            for (int i = 0; i < 70; i++) o[i] = (float)i * 0.5f, x[i] = (float)(i * i) - 3.0f;
            npattn_kernels()->add_f32(o, x, n);
            for (int i = 0; i < 70; i++) ok &= o[i] == (float)i * 0.5f + (i < n ? (float)(i * i) - 3.0f : 0.0f);
        }
        snprintf(msg, sizeof msg, "%s add_f32", kernel_tables[t]);
        expect(ok, msg);
    }
    npattn_kernels_force("");
}

/* npattn_narrow_f32 over blocks and threads: every element rounded as the
 * scalar conversion does, across the blocks' edges, and bad threads refused. */
static void test_narrow(void) {
    const int64_t n = ((int64_t)1 << 19) + 37;
    float *x = malloc((size_t)n * sizeof *x);
    uint16_t *got = malloc((size_t)n * sizeof *got);
    if (!x || !got) {
        expect(0, "narrow: memory");
        free(x), free(got);
        return;
    }
    for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 7919) % 100003 - 50000) * 0x1p-20f * (i % 5 ? 1.0f : 0x1p-120f);
    for (int dt = NPATTN_DTYPE_F16; dt <= NPATTN_DTYPE_BF16; dt++)
        for (int32_t threads = 1; threads <= 3; threads += 2) {
            memset(got, 0xA5, (size_t)n * sizeof *got);
            int ok = npattn_narrow_f32((enum npattn_dtype)dt, x, n, got, threads) == NPATTN_STATUS_OK;
            for (int64_t i = 0; i < n; i++)
                ok &= got[i] == (dt == NPATTN_DTYPE_F16 ? npattn_f32_to_f16(x[i]) : npattn_f32_to_bf16(x[i]));
            expect(ok, dt == NPATTN_DTYPE_F16 ? "narrow to float16 over blocks and threads"
                                              : "narrow to bfloat16 over blocks and threads");
        }
    expect(npattn_narrow_f32(NPATTN_DTYPE_BF16, x, n, got, -1) == NPATTN_STATUS_BAD_THREADS &&
               npattn_narrow_f32(NPATTN_DTYPE_BF16, x, 0, got, 2) == NPATTN_STATUS_OK,
           "narrow: bad threads refused, nothing to do done");
    free(x), free(got);
}

/* expect(ok) for the streaming kernel `kernel` of table `table` on half
 * type types[ty], M rows of width D (named width) and nk keys: `what`. */
static void expect_stream(int ok, const char *table, const char *kernel, int ty, int64_t M, const char *width,
                          int64_t D, int64_t nk, const char *what) {
    char msg[200];
    snprintf(msg, sizeof msg, "%s stream %s %s M=%lld %s=%lld nk=%lld: %s", table, kernel, dtype_names[ty + 1],
             (long long)M, width, (long long)D, (long long)nk, what);
    expect(ok, msg);
}

/* The keys of kh (nk rows, ld apart, of es bytes each element) as spans of
 * the lengths in `cut` (cycled), their rows copied into kp in reverse order
 * of the spans, so that no run follows another; each run's rows ahead are the
 * next run's (the last's, its own). Returns how many spans. */
static int64_t scattered_spans(const uint16_t *kh, int64_t nk, int64_t ld, int64_t es, uint16_t *kp,
                              struct npattn_span *spans) {
    static const int64_t cut[] = {1, 3, 16, 2, 5, 32, 4};
    int64_t n = 0;
    for (int64_t j = 0; j < nk; n++) {
        const int64_t len = cut[n % 7] < nk - j ? cut[n % 7] : nk - j;
        spans[n] = (struct npattn_span){NULL, NULL, len, NULL, NULL};
        j += len;
    }
    int64_t at = 0; /* in kp, in elements: the last run first */
    for (int64_t i = n - 1, j = nk; i >= 0; i--) {
        j -= spans[i].n;
        memcpy(kp + at * es / 2, kh + j * ld * es / 2, (size_t)(spans[i].n * ld * es));
        spans[i].rows = kp + at * es / 2;
        at += spans[i].n * ld;
    }
    for (int64_t i = 0; i < n; i++) spans[i].ahead = spans[i + (i + 1 < n)].rows;
    return n;
}

/* The streaming kernels read float16 and bfloat16 rows as stored: the same
 * bits as the float32 copies of those rows, and the double-precision sums
 * within float32's rounding (n + 8 roundings of 2^-24 of the sum of |terms|
 * for n terms), subnormal elements included, every width's tail, every
 * table; and the same bits again with the keys in scattered spans (pages). */
static void test_stream_kernels(void) {
    enum { MAX_M = 33, MAX_N = 67, MAX_D = 130 };
    static const enum npattn_dtype types[3] = {NPATTN_DTYPE_F32, NPATTN_DTYPE_F16, NPATTN_DTYPE_BF16};
    static const int64_t widths[] = {1, 5, 8, 15, 16, 24, 63, 64, 128, 130};
    static const int64_t rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 33}, keys[] = {1, 2, 3, 4, 20, 35, 64, 67};
    static float q[MAX_M * MAX_D], kf[MAX_N * (MAX_D + 3)], st[MAX_M * MAX_N], o[MAX_M * MAX_D], of[MAX_M * MAX_D];
    static float sf[MAX_M * MAX_N], o0[MAX_M * MAX_D], sp[MAX_M * MAX_N], op[MAX_M * MAX_D];
    static uint16_t kh[MAX_N * (MAX_D + 3)], kp[MAX_N * (MAX_D + 3)];
    static struct npattn_span spans[MAX_N];
    static uint32_t qb[MAX_D / 2 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        const struct npattn_kernels *kt = npattn_kernels();
        /* kind 0: any q, K with subnormal values; 1: q of bfloat16 values; 2: that and K without subnormals */
        for (int ty = 1; ty < 3; ty++)
            for (int kind = 0; kind < (ty == 2 ? 3 : 1); kind++)
                for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++)
                    for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri += 1 + (wi % 2))
                        for (size_t ni = 0; ni < sizeof keys / sizeof *keys; ni++) {
                            const int64_t D = widths[wi], M = rows[ri], nk = keys[ni], ld = D + 3; /* padded rows */
                            for (int64_t i = 0; i < M * D; i++) {
                                q[i] = (float)(uniform() * 2);
                                if (kind > 0) q[i] = npattn_bf16_to_f32(npattn_f32_to_bf16(q[i]));
                            }
                            for (int64_t i = 0; i < nk * ld; i++) {
                                /* one element in eight subnormal in the half type (kind 2: none) */
                                double x = uniform() * (i % 8 == 3 && kind < 2 ? (ty == 1 ? 6e-5 : 1e-38) : 2.0);
                                float f = (float)x;
                                npattn_store_f32(types[ty], &f, 1, kh + i, 1);
                                npattn_load_f32(types[ty], kh + i, 1, 1, kf + i);
                            }
                            /* scores: as stored against the float32 copy, and against double; q's
                             * pairs or tiles where the table takes them (the rows of keys in lanes) */
                            const int takes = kt->q_tiles && M <= 16 && npattn_bf16_keys_in_lanes(M, D) &&
                                              (strcmp(kt->name, "amx") || npattn_amx_stream_rows(M, D));
                            const int qb_ok = kt->q_tiles && kt->q_tiles(q, M, D, qb);
                            expect_stream(qb_ok == (takes && kind > 0), kernel_tables[t], "q_tiles", ty, M, "D", D, nk,
                                          "taken for bfloat16 values only, and the rows in lanes");
                            const struct npattn_span as_stored = {kh, kh, nk, NULL, NULL}, as_f32 = {kf, kf, nk, NULL, NULL};
                            kt->scores(q, M, D, types[ty], NULL, &as_stored, 1, ld, qb_ok ? qb : NULL, st, MAX_N);
                            kt->scores(q, M, D, NPATTN_DTYPE_F32, NULL, &as_f32, 1, ld, qb_ok ? qb : NULL, sf, MAX_N);
                            const int64_t n_span = scattered_spans(kh, nk, ld, 2, kp, spans);
                            kt->scores(q, M, D, types[ty], NULL, spans, n_span, ld, qb_ok ? qb : NULL, sp, MAX_N);
                            int paged = 1;
                            for (int64_t r = 0; r < M; r++) paged &= !memcmp(sp + r * MAX_N, st + r * MAX_N, 4 * (size_t)nk);
                            expect_stream(paged, kernel_tables[t], "scores", ty, M, "D", D, nk, "bits in scattered spans");
                            /* the AVX-512 tables' bfloat16 keys in lanes, and the avx2 and neon
                             * tables' rows in lanes: each score an FMA per element, in order */
                            const int in_lanes = types[ty] == NPATTN_DTYPE_BF16 && npattn_bf16_keys_in_lanes(M, D) &&
                                                 (!strncmp(kt->name, "avx512", 6) || !strcmp(kt->name, "amx"));
                            const int rows_in_lanes = !strcmp(kt->name, "avx2") || !strncmp(kt->name, "neon", 4);
                            const int64_t lane_rows = rows_in_lanes ? npattn_rows_in_lanes(M, D) : 0;
                            /* q's pairs or tiles against K without subnormals: the sums in another
                             * order, so only their bound (with a subnormal: the FMAs, in order) */
                            const int tiles = kind == 2 && qb_ok;
                            int same = 1, close = 1;
                            for (int64_t r = 0; r < M; r++)
                                for (int64_t j = 0; j < nk; j++) {
                                    double want = 0, size = 0;
                                    float chain = 0;
                                    for (int64_t d = 0; d < D; d++) {
                                        want += (double)q[r * D + d] * kf[j * ld + d];
                                        size += fabs((double)q[r * D + d] * kf[j * ld + d]);
                                        chain = fmaf(kf[j * ld + d], q[r * D + d], chain);
                                    }
                                    const float *bits = in_lanes || r < lane_rows ? &chain : &sf[r * MAX_N + j];
                                    same &= tiles || memcmp(&st[r * MAX_N + j], bits, sizeof(float)) == 0;
                                    close &= fabs(st[r * MAX_N + j] - want) <= size * (double)(D + 8) * 0x1p-24;
                                }
                            expect_stream(same, kernel_tables[t], "scores", ty, M, "D", D, nk,
                                          "bits of float32 rows (in lanes: of the FMAs in order)");
                            expect_stream(close, kernel_tables[t], "scores", ty, M, "D", D, nk, "the sums");
                            /* accumulate: P (M, nk) in st against the rows as values, width D */
                            for (int64_t i = 0; i < M * MAX_N; i++) st[i] = (float)fabs(uniform());
                            for (int64_t i = 0; i < M * D; i++) o[i] = of[i] = o0[i] = (float)uniform();
                            memcpy(op, o, sizeof(float) * (size_t)(M * D));
                            kt->accumulate(st, MAX_N, M, &as_stored, 1, types[ty], NULL, ld, D, o);
                            kt->accumulate(st, MAX_N, M, &as_f32, 1, NPATTN_DTYPE_F32, NULL, ld, D, of);
                            kt->accumulate(st, MAX_N, M, spans, n_span, types[ty], NULL, ld, D, op);
                            same = memcmp(o, of, sizeof(float) * (size_t)(M * D)) == 0;
                            expect_stream(!memcmp(o, op, sizeof(float) * (size_t)(M * D)), kernel_tables[t],
                                          "accumulate", ty, M, "Dv", D, nk, "bits in scattered spans");
                            close = 1;
                            for (int64_t r = 0; r < M; r++)
                                for (int64_t e = 0; e < D; e++) {
                                    double want = o0[r * D + e], size = fabs(want);
                                    for (int64_t j = 0; j < nk; j++) {
                                        want += (double)st[r * MAX_N + j] * kf[j * ld + e];
                                        size += fabs((double)st[r * MAX_N + j] * kf[j * ld + e]);
                                    }
                                    close &= fabs(o[r * D + e] - want) <= size * (double)(nk + 1) * 0x1p-24;
                                }
                            expect_stream(same, kernel_tables[t], "accumulate", ty, M, "Dv", D, nk, "float32 bits");
                            expect_stream(close, kernel_tables[t], "accumulate", ty, M, "Dv", D, nk, "the sums");
                            /* accumulate_pairs (bfloat16 V): P's rows as bfloat16 against the rows in
                             * scattered spans, pairs of keys across them; a subnormal value found, or the
                             * sums of the rounded weights' products (exact: one rounding each) */
                            if (kt->accumulate_pairs && types[ty] == NPATTN_DTYPE_BF16) {
                                enum { LDP = MAX_N + 1 };
                                static uint16_t pb[MAX_M * LDP];
                                npattn_bf16_rows(st, M, nk, MAX_N, pb, LDP);
                                int subnormal = 0;
                                for (int64_t j = 0; j < nk; j++)
                                    for (int64_t e = 0; e < D; e++) subnormal |= npattn_bf16_subnormal(kh[j * ld + e]);
                                const int found = kt->accumulate_pairs(pb, LDP, M, spans, n_span, ld, D, op);
                                expect_stream(found == subnormal, kernel_tables[t], "accumulate_pairs", ty, M, "Dv", D,
                                              nk, "a subnormal value found exactly where there is one");
                                close = 1;
                                for (int64_t r = 0; r < M && !found; r++)
                                    for (int64_t e = 0; e < D; e++) {
                                        double want = 0, size = 0;
                                        for (int64_t j = 0; j < nk; j++) {
                                            const double w = npattn_bf16_to_f32(pb[r * LDP + j]);
                                            want += w * kf[j * ld + e];
                                            size += fabs(w * kf[j * ld + e]);
                                        }
                                        close &= fabs(op[r * D + e] - want) <= size * (double)(nk + 1) * 0x1p-24;
                                    }
                                expect_stream(close, kernel_tables[t], "accumulate_pairs", ty, M, "Dv", D, nk,
                                              "the sums of the weights as bfloat16");
                            }
                        }
    }
    npattn_kernels_force("");
}

/* Case c with q in qt and K and V in kvt, the result in float32, under
 * every table: the naive loop on the values as stored, the output within
 * tol and the lse within float32's bound; what names the run. */
static void half_case(const struct case_ *c, enum npattn_dtype qt, enum npattn_dtype kvt,
                      enum npattn_precision precision, double tol, const char *what) {
    const int64_t nq = c->B * c->Hq * c->L * c->D, nk = c->B * c->Hkv * c->S * c->D;
    const int64_t nv = c->B * c->Hkv * c->S * c->Dv, no = c->B * c->Hq * c->L * c->Dv, nl = c->B * c->Hq * c->L;
    double *q = malloc(8 * (size_t)nq), *k = malloc(8 * (size_t)nk), *v = malloc(8 * (size_t)nv);
    double *want = malloc(8 * (size_t)no), *want_lse = malloc(8 * (size_t)nl), *got = malloc(8 * (size_t)no);
    double *want_w = malloc(8 * (size_t)(nl * c->S)), sinks[8];
    struct buffers x = {{0}, malloc(4 * (size_t)nq), malloc(2 * (size_t)nk), malloc(2 * (size_t)nv),
                        malloc(4 * (size_t)no), malloc(4 * (size_t)nl), NULL, NULL};
    for (int i = 0; i < 8; i++) sinks[i] = uniform() * 3;
    for (int64_t i = 0; i < nq; i++) q[i] = uniform() * 2;
    for (int64_t i = 0; i < nk; i++) k[i] = uniform() * 2;
    for (int64_t i = 0; i < nv; i++) v[i] = uniform();
    from_double(qt, q, nq, x.q);
    from_double(kvt, k, nk, x.k);
    from_double(kvt, v, nv, x.v);
    naive(c, q, k, v, NULL, NULL, c->sinks ? sinks : NULL, want, want_lse, want_w);
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        struct npattn_problem p;
        int64_t bshape[1];
        fill_problem(&p, c, NPATTN_DTYPE_F32, &x, c->sinks ? sinks : NULL, bshape);
        p.q = tensor(x.q, qt, &x.bs[0], c->B, c->Hq, c->L, c->D);
        p.k.dtype = p.v.dtype = kvt;
        p.weights.data = NULL;
        p.precision = precision;
        enum npattn_status st = npattn_sdpa(&p);
        to_double(NPATTN_DTYPE_F32, x.out, no, got);
        char msg[200];
        snprintf(msg, sizeof msg, "%s %s: out", kernel_tables[t], what);
        expect(st == NPATTN_STATUS_OK && max_err(want, got, no, 0) < tol, msg);
        to_double(NPATTN_DTYPE_F32, x.lse, nl, got);
        snprintf(msg, sizeof msg, "%s %s: lse", kernel_tables[t], what);
        expect(max_err(want_lse, got, nl, 1) < 2e-5 * 16, msg);
    }
    npattn_kernels_force("");
    free(q), free(k), free(v), free(want), free(want_lse), free(got), free(want_w);
    free(x.q), free(x.k), free(x.v), free(x.out), free(x.lse);
}

/* A float32 q over float16 and bfloat16 K and V, decode (streamed) and
 * split-K: the naive loop on the values as stored, to float32's bound. */
static void test_half_cache(void) {
    const int64_t U = NPATTN_UNBOUNDED, BR = INT64_MIN;
    static const struct case_ cases[] = {
        {1, 8, 2, 1, 300, 64, 40, 1, U, U, BR, 0, MASK_NONE, 0, 1, 1},
        {2, 6, 3, 2, 77, 63, 63, 1, 20, 0, BR, 0, MASK_NONE, 2.0, 0, 2},
        {1, 4, 1, 1, 9000, 128, 128, 1, U, U, BR, 0, MASK_NONE, 0, 1, 3}, /* split-K */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int ty = 2; ty < N_DTYPES; ty++) {
            char what[100];
            snprintf(what, sizeof what, "float32 q over a %s cache, case %zu", dtype_names[ty], ci);
            half_case(&cases[ci], NPATTN_DTYPE_F32, test_dtypes[ty], NPATTN_PRECISION_HIGHEST, 2e-5, what);
        }
}

static void test_invalid(void) {
    struct case_ c = {1, 4, 2, 3, 5, 8, 8, 0, NPATTN_UNBOUNDED, NPATTN_UNBOUNDED, INT64_MIN, 0, MASK_NONE, 0, 0, 1};
    float buf[4096];
    memset(buf, 0, sizeof buf);
    struct buffers x = {{0}, buf, buf + 1024, buf + 2048, buf + 3072, NULL, NULL, NULL};
    struct npattn_problem p;
    int64_t bshape[1];
    struct npattn_verdict why;
    const enum npattn_operand NONE = NPATTN_OPERAND_NONE, Q = NPATTN_OPERAND_Q, K = NPATTN_OPERAND_K,
                              V = NPATTN_OPERAND_V, OUT = NPATTN_OPERAND_OUT, SINKS = NPATTN_OPERAND_SINKS;
    /* each change breaks one rule: npattn_sdpa returns its status, npattn_check names the operand */
#define INVALID(what, change, status, operand, other)                          \
    do {                                                                       \
        fill_problem(&p, &c, NPATTN_DTYPE_F32, &x, NULL, bshape);              \
        p.lse.data = p.weights.data = NULL;                                    \
        change;                                                                \
        expect_status(npattn_sdpa(&p), (status), "invalid: " what);            \
        npattn_check(&p, &why);                                                \
        expect_verdict(&why, (status), (operand), (other), "verdict: " what);  \
    } while (0)
    INVALID("a valid problem is OK", (void)0, NPATTN_STATUS_OK, NONE, NONE);
    INVALID("heads not a multiple", p.n_head_q = 5, NPATTN_STATUS_HEADS_NOT_MULTIPLE, Q, K);
    INVALID("negative query heads", p.n_head_q = -2, NPATTN_STATUS_HEADS_NOT_MULTIPLE, Q, K);
    INVALID("no kv head", p.n_head_kv = 0, NPATTN_STATUS_NO_KV_HEAD, K, NONE);
    INVALID("D = 0", p.n_embd_k = 0, NPATTN_STATUS_NO_WIDTH, Q, K);
    INVALID("negative L", p.n_query = -1, NPATTN_STATUS_NEGATIVE_SIZE, NONE, NONE);
    INVALID("D beyond INT_MAX", p.n_embd_k = (int64_t)1 << 40, NPATTN_STATUS_TOO_LARGE, Q, NONE);
    INVALID("D_v beyond INT_MAX", p.n_embd_v = (int64_t)1 << 40, NPATTN_STATUS_TOO_LARGE, V, NONE);
    INVALID("NaN scale", p.scale = NAN, NPATTN_STATUS_BAD_SCALE, NONE, NONE);
    INVALID("infinite scale", p.scale = INFINITY, NPATTN_STATUS_BAD_SCALE, NONE, NONE);
    INVALID("negative softcap", p.softcap = -1, NPATTN_STATUS_BAD_SOFTCAP, NONE, NONE);
    INVALID("NaN softcap", p.softcap = NAN, NPATTN_STATUS_BAD_SOFTCAP, NONE, NONE);
    INVALID("infinite softcap", p.softcap = INFINITY, NPATTN_STATUS_BAD_SOFTCAP, NONE, NONE);
    INVALID("window below -1", p.window_left = -2, NPATTN_STATUS_BAD_WINDOW, NONE, NONE);
    INVALID("negative threads", p.n_threads = -1, NPATTN_STATUS_BAD_THREADS, NONE, NONE);
    INVALID("threads beyond the cap", p.n_threads = NPATTN_MAX_THREADS + 1, NPATTN_STATUS_BAD_THREADS, NONE, NONE);
    INVALID("threads at the cap", p.n_threads = NPATTN_MAX_THREADS, NPATTN_STATUS_OK, NONE, NONE);
    /* the default thread count: NPATTN_NUM_THREADS where set */
    const char *const env_values[] = {"abc", "0", "-3", "1.5", "", "257", " "};
    for (size_t e = 0; e < sizeof env_values / sizeof env_values[0]; e++) {
        setenv("NPATTN_NUM_THREADS", env_values[e], 1);
        INVALID("a bad NPATTN_NUM_THREADS", p.n_threads = 0, NPATTN_STATUS_BAD_THREADS_ENV, NONE, NONE);
        INVALID("a bad NPATTN_NUM_THREADS, threads given", p.n_threads = 2, NPATTN_STATUS_OK, NONE, NONE);
    }
    setenv("NPATTN_NUM_THREADS", " 2 ", 1);
    INVALID("NPATTN_NUM_THREADS 2", p.n_threads = 0, NPATTN_STATUS_OK, NONE, NONE);
    expect(npattn_env_threads() == 2, "NPATTN_NUM_THREADS is read, spaces around it allowed");
    unsetenv("NPATTN_NUM_THREADS");
    expect(npattn_env_threads() == 0, "NPATTN_NUM_THREADS unset");
    INVALID("unknown mask kind", p.mask_kind = (enum npattn_mask_kind)7, NPATTN_STATUS_BAD_MASK_KIND,
            NPATTN_OPERAND_MASK, NONE);
    INVALID("unknown dtype", p.q.dtype = (enum npattn_dtype)9, NPATTN_STATUS_BAD_DTYPE, Q, NONE);
    INVALID("unknown dtype of v", p.v.dtype = (enum npattn_dtype)9, NPATTN_STATUS_BAD_DTYPE, V, NONE);
    INVALID("lse of float16", (p.lse.data = buf + 3500, p.lse.dtype = NPATTN_DTYPE_F16), NPATTN_STATUS_NOT_WIDE,
            NPATTN_OPERAND_LSE, NONE);
    INVALID("no q data", p.q.data = NULL, NPATTN_STATUS_NO_DATA, Q, NONE);
    INVALID("no batch strides", p.k.batch_stride = NULL, NPATTN_STATUS_NO_STRIDES, K, NONE);
    INVALID("negative batch size", bshape[0] = -1, NPATTN_STATUS_BAD_BATCH, NONE, NONE);
    INVALID("no batch shape", p.batch_shape = NULL, NPATTN_STATUS_BAD_BATCH, NONE, NONE);
    INVALID("out overlapping q", p.out.data = buf + 10, NPATTN_STATUS_OVERLAPS, OUT, Q);
    INVALID("out overlapping v", p.out.data = buf + 2048 + 60, NPATTN_STATUS_OVERLAPS, OUT, V);
    INVALID("out overlapping itself", p.out.head_stride = 0, NPATTN_STATUS_OVERLAPS_ITSELF, OUT, NONE);
    INVALID("out overlapping sinks", (p.sinks = (const double *)(buf + 3072), p.out.data = buf + 3072),
            NPATTN_STATUS_OVERLAPS, OUT, SINKS);
    INVALID("strides that overflow", p.k.row_stride = INT64_MAX / 2, NPATTN_STATUS_OUT_OF_RANGE, K, NONE);
    INVALID("empty (L = 0) is OK with no data", (p.n_query = 0, p.q.data = NULL), NPATTN_STATUS_OK, NONE, NONE);
    const int64_t start_past[1] = {6}, start_ok[1] = {2}, length_past[1] = {4}, length_negative[1] = {-1};
    INVALID("k_start past S", p.k_start = start_past, NPATTN_STATUS_BAD_K_START, NONE, NONE);
    INVALID("k_length past S", (p.k_start = start_ok, p.k_length = length_past), NPATTN_STATUS_BAD_K_LENGTH, NONE, NONE);
    INVALID("negative k_length", p.k_length = length_negative, NPATTN_STATUS_BAD_K_LENGTH, NONE, NONE);
    expect(why.entry == 0, "verdict: the request is named");
    const int64_t length_all[1] = {5};
    INVALID("the default q_offset past int64", (p.q_bottom_right = 1, p.k_offset = INT64_MAX, p.k_length = length_all),
            NPATTN_STATUS_BAD_Q_OFFSET, NONE, NONE);
    expect(why.entry == 0, "verdict: the request is named");
    INVALID("the default q_offset without key ranges: S - L, whatever k_offset",
            (p.q_bottom_right = 1, p.k_offset = INT64_MAX), NPATTN_STATUS_OK, NONE, NONE);
    INVALID("precision unknown", p.precision = (enum npattn_precision)7, NPATTN_STATUS_BAD_PRECISION, NONE, NONE);
    INVALID("precision fast is OK", p.precision = NPATTN_PRECISION_FAST, NPATTN_STATUS_OK, NONE, NONE);
    INVALID("a key range within S is OK", (p.k_start = start_ok, p.k_length = start_ok), NPATTN_STATUS_OK, NONE, NONE);
    /* paged: the one page of 5 rows holds the 5 keys */
    const int64_t table_ok[1] = {0}, table_past[1] = {1}, no_key[1] = {0};
    struct npattn_pages pages = {table_ok, 1, 1, 5, 0, 0, 0};
    INVALID("pages: one page of every key is OK", p.pages = &pages, NPATTN_STATUS_OK, NONE, NONE);
    INVALID("pages: S not max_pages * page_size", (p.pages = &pages, p.n_key = 4), NPATTN_STATUS_BAD_PAGES, NONE, NONE);
    INVALID("pages: with k_start", (p.pages = &pages, p.k_start = start_ok), NPATTN_STATUS_BAD_PAGES, NONE, NONE);
    INVALID("pages: no block table", (pages.block_table = NULL, p.pages = &pages), NPATTN_STATUS_BAD_PAGES, NONE, NONE);
    pages.block_table = table_ok;
    INVALID("pages: a negative table stride", (pages.table_stride = -1, p.pages = &pages), NPATTN_STATUS_BAD_PAGES, NONE,
            NONE);
    pages.table_stride = 0;
    pages.page_size = 0; /* the pages' rule before the key ranges, which a page size of 0 leaves no room */
    INVALID("pages: page_size 0", (p.pages = &pages, p.n_key = 0, p.k_length = length_past), NPATTN_STATUS_BAD_PAGES,
            NONE, NONE);
    pages.page_size = 5;
    pages.block_table = table_past;
    INVALID("pages: a live entry past n_page", p.pages = &pages, NPATTN_STATUS_BAD_PAGE, NONE, NONE);
    expect(why.entry == 0, "verdict: the bad entry is named");
    INVALID("pages: entries past the live pages are never read", (p.pages = &pages, p.k_length = no_key),
            NPATTN_STATUS_OK, NONE, NONE);
    pages.block_table = table_ok;
    {
        struct npattn_backward_problem bp;
        memset(&bp, 0, sizeof bp);
        fill_problem(&bp.fwd, &c, NPATTN_DTYPE_F32, &x, NULL, bshape);
        bp.fwd.pages = &pages;
        expect(npattn_check_backward(&bp, NULL) == NPATTN_STATUS_BAD_PAGES, "pages: no backward pass");
    }
#undef INVALID
    expect_status(npattn_sdpa(NULL), NPATTN_STATUS_NO_PROBLEM, "NULL problem");
    expect(npattn_check(NULL, NULL) == NPATTN_STATUS_NO_PROBLEM, "NULL problem, no verdict asked");
    /* every status has a sentence of its own, every operand a name */
    for (int s = 0; s < NPATTN_STATUS_COUNT; s++) {
        const char *sentence = npattn_status_string((enum npattn_status)s);
        int distinct = strcmp(sentence, "unknown status") != 0;
        for (int t = 0; t < s; t++) distinct &= strcmp(sentence, npattn_status_string((enum npattn_status)t)) != 0;
        expect(distinct, "each status has its own sentence");
    }
    expect(strcmp(npattn_status_string((enum npattn_status)99), "unknown status") == 0, "status string");
    for (int o = 1; o < NPATTN_OPERAND_COUNT; o++)
        expect(strlen(npattn_operand_name((enum npattn_operand)o)) > 0, "each operand has a name");
    expect(strcmp(npattn_operand_name(NPATTN_OPERAND_DSINKS), "dsinks") == 0, "operand name");
}

/* Per-request key ranges: request b of a batch equals the problem of its
 * own slice of keys, k_start[b] .. k_start[b] + k_length[b], positions
 * counting from the slice's first row; rows outside hold NaN, never read. */
static void test_key_ranges(void) {
    enum { B = 3, HQ = 4, HKV = 2, L = 3, S = 40, D = 8 };
    const int64_t start[B] = {0, 13, 40}, length[B] = {40, 9, 0};
    static double q[B * HQ * L * D], k[B * HKV * S * D], v[B * HKV * S * D], out[B * HQ * L * D];
    static double sk[HKV * S * D], sv[HKV * S * D], sout[HQ * L * D];
    for (int64_t i = 0; i < B * HQ * L * D; i++) q[i] = uniform();
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < HKV * S * D; i++) {
            const int64_t j = i / D % S, inside = j >= start[b] && j < start[b] + length[b];
            k[b * HKV * S * D + i] = inside ? uniform() : NAN;
            v[b * HKV * S * D + i] = inside ? uniform() : NAN;
        }
    for (int causal = 0; causal < 2; causal++) {
        const struct case_ c = {B, HQ, HKV, L, S, D, D, causal, 5, NPATTN_UNBOUNDED, INT64_MIN, 0, MASK_NONE, 0, 0, 2};
        struct buffers x = {{0}, q, k, v, out, NULL, NULL, NULL};
        struct npattn_problem p;
        int64_t bshape[1];
        fill_problem(&p, &c, NPATTN_DTYPE_F64, &x, NULL, bshape);
        p.lse.data = p.weights.data = NULL;
        p.k_start = start, p.k_length = length;
        int64_t q_offsets[B];
        for (int64_t b = 0; b < B; b++) q_offsets[b] = length[b] - L; /* each request's bottom-right corner */
        p.q_offsets = q_offsets;
        expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "key ranges: the batch");
        /* q_bottom_right: the same corners, resolved by the core */
        static double out2[B * HQ * L * D];
        p.out.data = out2, p.q_offsets = NULL, p.q_offset = 12345, p.q_bottom_right = 1;
        expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "key ranges: the default corners");
        expect(max_err(out2, out, B * HQ * L * D, 0) == 0, "key ranges: q_bottom_right is each request's corner");
        for (int64_t b = 0; b < B; b++) {
            int64_t qo, k0, n;
            npattn_request_positions(&p, b, &qo, &k0, &n);
            expect(qo == q_offsets[b] && k0 == start[b] && n == length[b], "key ranges: a request's positions");
        }
        const int64_t bad[B] = {0, 13, 41};
        struct npattn_verdict why;
        p.k_start = bad;
        expect(npattn_check(&p, &why) == NPATTN_STATUS_BAD_K_START && why.entry == 2,
               "key ranges: the verdict names the request");
        p.k_start = start, p.out.data = out;
        for (int64_t b = 0; b < B; b++) {
            const struct case_ one = {1, HQ, HKV, L, length[b], D, D, causal, 5, NPATTN_UNBOUNDED, INT64_MIN, 0,
                                      MASK_NONE, 0, 0, 1};
            for (int64_t h = 0; h < HKV; h++)
                for (int64_t j = 0; j < length[b] * D; j++) {
                    sk[h * length[b] * D + j] = k[((b * HKV + h) * S + start[b]) * D + j];
                    sv[h * length[b] * D + j] = v[((b * HKV + h) * S + start[b]) * D + j];
                }
            struct buffers y = {{0}, q + b * HQ * L * D, sk, sv, sout, NULL, NULL, NULL};
            struct npattn_problem r;
            int64_t rshape[1];
            fill_problem(&r, &one, NPATTN_DTYPE_F64, &y, NULL, rshape);
            r.lse.data = r.weights.data = NULL;
            expect_status(npattn_sdpa(&r), NPATTN_STATUS_OK, "key ranges: one request alone");
            expect(max_err(sout, out + b * HQ * L * D, HQ * L * D, 0) < 1e-12, "key ranges: a request equals its slice");
        }
    }
}

/* Paged K/V: pages scattered at random (a fixed permutation), request b's
 * key j in row j % PS of page table[b][j / PS]; equal to the dense problem on
 * the gathered keys (k_length, bottom-right q_offsets), decode (streamed, L =
 * 1) and gemm tiles (L = 5), on every kernel table, pages whose rows are not
 * contiguous (a stride of 2 D) too. Run under valgrind, it checks the table
 * walk reads nothing outside the live pages. */
static void test_pages(void) {
    enum { B = 3, HQ = 4, HKV = 2, D = 8, PS = 3, MAXP = 6, NP = 14, S = MAXP * PS, LMAX = 5 };
    const int64_t length[B] = {7, 0, 18};
    int64_t table[B * MAXP], q_offsets[B], zero[1] = {0}, bshape[1] = {B};
    for (int64_t i = 0; i < B * MAXP; i++) table[i] = -1;
    for (int64_t b = 0, next = 0; b < B; b++)
        for (int64_t i = 0; i < (length[b] + PS - 1) / PS; i++) table[b * MAXP + i] = (next++ * 5 + 3) % NP; /* scattered */
    static float q[B * HQ * LMAX * D], kp[NP * HKV * PS * 2 * D], vp[NP * HKV * PS * 2 * D];
    static float k[B * HKV * S * D], v[B * HKV * S * D], want[B * HQ * LMAX * D], got[B * HQ * LMAX * D];
    static float got_live[B * HQ * LMAX * D];
    enum { MAXP_LIVE = (18 + PS - 1) / PS }; /* the longest request's live pages */
    int64_t live_table[B * MAXP_LIVE];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < MAXP_LIVE; i++) live_table[b * MAXP_LIVE + i] = table[b * MAXP + i];
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)uniform();
    for (size_t i = 0; i < sizeof kp / sizeof kp[0]; i++) kp[i] = (float)uniform(), vp[i] = (float)uniform();
    for (int stride = 1; stride <= 2; stride++) { /* rows D (contiguous) or 2 D apart */
        memset(k, 0, sizeof k), memset(v, 0, sizeof v);
        const int64_t row = stride * D, head = PS * row, page = HKV * head;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < HKV; h++)
                for (int64_t j = 0; j < length[b]; j++)
                    for (int64_t e = 0; e < D; e++) {
                        const int64_t at = table[b * MAXP + j / PS] * page + h * head + (j % PS) * row + e;
                        k[((b * HKV + h) * S + j) * D + e] = kp[at];
                        v[((b * HKV + h) * S + j) * D + e] = vp[at];
                    }
        const struct npattn_pages pages = {table, MAXP, NP, PS, page, page, 0};
        for (int64_t L = 1; L <= LMAX; L += LMAX - 1)
            for (int t = 0; t < N_KERNEL_TABLES; t++) {
                if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
                for (int64_t b = 0; b < B; b++) q_offsets[b] = length[b] - L;
                const struct case_ c = {B, HQ, HKV, L, S, D, D, 1, NPATTN_UNBOUNDED, NPATTN_UNBOUNDED, INT64_MIN, 0,
                                        MASK_NONE, 0, 0, 2};
                struct buffers x = {{0}, q, k, v, want, NULL, NULL, NULL};
                struct npattn_problem p;
                fill_problem(&p, &c, NPATTN_DTYPE_F32, &x, NULL, bshape);
                p.lse.data = p.weights.data = NULL;
                p.k_length = length, p.q_offsets = q_offsets;
                expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "pages: the dense problem");
                p.out.data = got;
                p.pages = &pages;
                p.k.data = kp, p.v.data = vp;
                p.k.batch_stride = p.v.batch_stride = zero;
                p.k.head_stride = p.v.head_stride = head;
                p.k.row_stride = p.v.row_stride = row;
                expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "pages: the paged problem");
                double err = 0;
                for (int64_t i = 0; i < B * HQ * L * D; i++) err = fmax(err, fabs((double)got[i] - (double)want[i]));
                expect(err < 1e-6, "pages: equal to the dense problem on the gathered keys");
                /* the live entries alone, each request's row MAXP_LIVE apart: the same bits */
                struct npattn_pages live = pages;
                live.block_table = live_table, live.table_stride = MAXP_LIVE;
                p.pages = &live, p.out.data = got_live;
                expect_status(npattn_sdpa(&p), NPATTN_STATUS_OK, "pages: a table of the live entries");
                expect(memcmp(got, got_live, sizeof(float) * (size_t)(B * HQ * L * D)) == 0,
                       "pages: a table of the live entries gives the same bits");
            }
        npattn_kernels_force("");
    }
}

/* A BLAS that fails its check: every call refused, nothing computed. */
static int refused_everywhere(void) {
    const int64_t U = NPATTN_UNBOUNDED;
    struct case_ c = {1, 2, 1, 3, 5, 4, 4, 1, U, U, INT64_MIN, 0, MASK_NONE, 0, 0, 1};
    struct buffers x;
    memset(&x, 0, sizeof x);
    float q[24] = {0}, k[20] = {0}, v[20] = {0}, out[24] = {0};
    x.q = q, x.k = k, x.v = v, x.out = out;
    struct npattn_problem p;
    int64_t bshape[1];
    fill_problem(&p, &c, NPATTN_DTYPE_F32, &x, NULL, bshape);
    printf("the BLAS (core %s) fails npattn's check on this CPU\n", npattn_blas_core());
    expect(npattn_sdpa(&p) == NPATTN_STATUS_BLAS_WRONG, "a BLAS that fails its check: the call is refused");
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}

/* The bfloat16 dot-product kernels of the tables that have them, against
 * double sums of the same bfloat16 values: pairs and rows (rounding and
 * the subnormal check), scores of K's rows in place, and P @ V; odd counts of
 * rows, keys and columns. And the AMX table only with the OS's permission. */
static void test_bf16_kernels(void) {
    enum { MAX_M = 70, MAX_N = 113, MAX_D = 128, LD = MAX_D + 6 };
    static const int64_t rows[] = {1, 5, 16, 17, 33, 64, 70}, keys[] = {1, 7, 16, 31, 32, 33, 112};
    static const int64_t widths[] = {2, 6, 32, 64, 96, 128}, vwidths[] = {1, 16, 40, 64, 128};
    static uint16_t qh[MAX_M * MAX_D], kh[MAX_N * LD];
    static uint32_t qp[MAX_D / 2 * 80], pp[(MAX_N + 1) / 2 * 80], vp[(MAX_N + 1) / 2 * MAX_D];
    static float st[MAX_N * (MAX_M + 1)], o[MAX_M * MAX_D], o0[MAX_M * MAX_D], pf[MAX_N * MAX_M];
    static uint32_t pa[80 * ((MAX_N + 31) / 32 * 16 + 16)];
    char msg[200];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        const struct npattn_kernels *kt = npattn_kernels();
        if (!kt->scores_bf16) continue;
        /* pairs: round to nearest even, NaN kept, subnormals reported */
        const float a[4] = {1.00390625f, 1.01171875f, -3e38f, NAN}, b[4] = {0x1p-130f, 2.0f, 1.0f, -0.0f};
        uint32_t out[4];
        int sub = kt->pair_f32(a, b, 4, out);
        int ok = sub == 1;
        for (int i = 0; i < 4; i++) {
            const uint16_t lo = (uint16_t)out[i], hi = (uint16_t)(out[i] >> 16);
            ok &= (i == 0 || hi == npattn_f32_to_bf16(b[i])) && /* b[0] subnormal: its pair unspecified */
                  (i == 3 ? isnan(npattn_bf16_to_f32(lo)) : lo == npattn_f32_to_bf16(a[i]));
        }
        ok &= kt->pair_f32(a, NULL, 3, out) == 0 && out[1] >> 16 == 0;
        const float x[17] = {1.00390625f, 1.01171875f, -3e38f, NAN, -0.0f, [16] = 0x1p-130f};
        uint16_t row[17];
        ok &= kt->bf16_f32(x, 16, row) == 0 && kt->bf16_f32(x, 17, row) == 1 && isnan(npattn_bf16_to_f32(row[3]));
        for (int i = 0; i < 16; i++) ok &= i == 3 || row[i] == npattn_f32_to_bf16(x[i]);
        const uint16_t h[3] = {0x0001, 0x3f80, 0x8080}, g[3] = {0x0080, 0x7f80, 0x8000}; /* 0x0001 alone subnormal */
        ok &= kt->pair_bf16(h + 1, g, 2, NULL) == 0 && kt->pair_bf16(g, h, 3, out) == 1 && out[2] == (0x8000u | 0x8080u << 16);
        snprintf(msg, sizeof msg, "%s bfloat16 pairs: rounding, NaN and the subnormal check", kernel_tables[t]);
        expect(ok, msg);
        for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++)
            for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++)
                for (size_t ni = 0; ni < sizeof keys / sizeof *keys; ni++) {
                    const int64_t D = widths[wi], M = rows[ri], nk = keys[ni], np = D / 2, ldq = (M + 15) / 16 * 16;
                    if (D % kt->bf16_d_step != 0) continue;
                    for (int64_t i = 0; i < M * D; i++) qh[i] = npattn_f32_to_bf16((float)(uniform() * 2));
                    for (int64_t i = 0; i < nk * LD; i++) kh[i] = npattn_f32_to_bf16((float)(uniform() * 2));
                    /* Q's pairs: column r of Q^T's rows 2p, 2p + 1 */
                    for (int64_t p = 0; p < np; p++)
                        for (int64_t r = 0; r < ldq; r++)
                            qp[p * ldq + r] = r < M ? qh[r * D + 2 * p] | (uint32_t)qh[r * D + 2 * p + 1] << 16 : 0;
                    for (int64_t i = 0; i < MAX_N * (MAX_M + 1); i++) st[i] = -1;
                    kt->scores_bf16(qp, ldq, M, np, kh, LD, nk, st, M + 1); /* rows M + 1 apart: the gap untouched */
                    int close = 1, kept = 1;
                    for (int64_t j = 0; j < nk; j++) {
                        for (int64_t r = 0; r < M; r++) {
                            double want = 0, size = 0;
                            for (int64_t d = 0; d < D; d++) {
                                const double x = (double)npattn_bf16_to_f32(qh[r * D + d]) * npattn_bf16_to_f32(kh[j * LD + d]);
                                want += x, size += fabs(x);
                            }
                            close &= fabs(st[j * (M + 1) + r] - want) <= size * (double)(D + 2) * 0x1p-24;
                        }
                        kept &= st[j * (M + 1) + M] == -1;
                    }
                    snprintf(msg, sizeof msg, "%s scores_bf16 M=%lld D=%lld nk=%lld", kernel_tables[t], (long long)M,
                             (long long)D, (long long)nk);
                    expect(close && kept, msg);
                    if (wi % 2 == 0) continue; /* P @ V for half the widths of K */
                    const int64_t Dv = vwidths[(ri + ni) % (sizeof vwidths / sizeof *vwidths)], ldv = (Dv + 15) / 16 * 16;
                    const int64_t npv = (nk + 1) / 2;
                    for (int64_t j = 0; j < nk; j++)
                        for (int64_t r = 0; r < M; r++) pf[j * M + r] = npattn_bf16_to_f32(npattn_f32_to_bf16((float)fabs(uniform())));
                    for (int64_t p = 0; p < npv; p++) {
                        for (int64_t r = 0; r < ldq; r++)
                            pp[p * ldq + r] = r >= M ? 0 : npattn_f32_to_bf16(pf[2 * p * M + r]) |
                                              (2 * p + 1 < nk ? (uint32_t)npattn_f32_to_bf16(pf[(2 * p + 1) * M + r]) << 16 : 0);
                        for (int64_t e = 0; e < ldv; e++)
                            vp[p * ldv + e] = e >= Dv ? 0 : kh[2 * p * LD + e] | (2 * p + 1 < nk ? (uint32_t)kh[(2 * p + 1) * LD + e] << 16 : 0);
                    }
                    /* the weights as pairs by keys, then (where the table has them) as A tiles' rows */
                    const int64_t ldpa = (nk + 31) / 32 * 16 + 16; /* a row's pairs and a gap */
                    for (int64_t r = 0; r < (M + 15) / 16 * 16; r++)
                        for (int64_t p = 0; p < ldpa; p++)
                            pa[r * ldpa + p] = r >= M || 2 * p >= nk ? 0 : pp[p * ldq + r];
                    for (int tiles = 0; tiles < 1 + !!kt->accumulate_tiles_bf16; tiles++) {
                        for (int64_t i = 0; i < M * Dv; i++) o[i] = o0[i] = (float)uniform();
                        if (tiles) kt->accumulate_tiles_bf16(pa, ldpa, M, npv, vp, ldv, Dv, o);
                        else kt->accumulate_bf16(pp, ldq, M, npv, vp, ldv, Dv, o);
                        close = 1;
                        for (int64_t r = 0; r < M; r++)
                            for (int64_t e = 0; e < Dv; e++) {
                                double want = o0[r * Dv + e], size = fabs(want);
                                for (int64_t j = 0; j < nk; j++) {
                                    const double x = (double)pf[j * M + r] * npattn_bf16_to_f32(kh[j * LD + e]);
                                    want += x, size += fabs(x);
                                }
                                close &= fabs(o[r * Dv + e] - want) <= size * (double)(nk + 2) * 0x1p-24;
                            }
                        snprintf(msg, sizeof msg, "%s accumulate_%sbf16 M=%lld nk=%lld Dv=%lld", kernel_tables[t],
                                 tiles ? "tiles_" : "", (long long)M, (long long)nk, (long long)Dv);
                        expect(close, msg);
                    }
                    if (!kt->softmax_tiles_f32) continue;
                    /* softmax_tiles_f32 against softmax_f32 on the same scores (raw: K's rows against Q's, in
                     * [0, 8)), plain or with a band, softcap and bias: the same max and factor; the sum within
                     * 2^-17 of its terms, and P's pairs within half a bfloat16 ulp (2^-8) and 2^-17 of P, as the fast
                     * exp (2.7e-6) and its one-FMA argument allow; zeros past nk and M, the row's gap untouched */
                    for (int kind = 0; kind < 2; kind++) {
                        static float s1[MAX_N * MAX_M], s2[MAX_N * MAX_M], bias[MAX_N * MAX_M];
                        float m1[MAX_M], l1[MAX_M], a1[MAX_M], m2[MAX_M], l2[MAX_M], a2[MAX_M], l0[MAX_M];
                        int32_t lo[MAX_M], hi[MAX_M];
                        for (int64_t i = 0; i < nk * M; i++) {
                            s1[i] = s2[i] = (float)(uniform() * 8);
                            bias[i] = i % 7 == 3 ? -INFINITY : (float)uniform();
                        }
                        for (int64_t r = 0; r < M; r++) {
                            m1[r] = m2[r] = r % 3 == 0 ? -INFINITY : (float)(uniform() * 4);
                            l0[r] = l1[r] = l2[r] = (float)uniform();
                            lo[r] = (int32_t)(r % 5), hi[r] = (int32_t)(nk - 1 - r % 3);
                        }
                        struct npattn_score_tile tile = {.nk = nk, .M = M, .ld = M, .scale = 0.75f};
                        if (kind) tile.softcap = 5.0f, tile.bias = bias, tile.lo = lo, tile.hi = hi;
                        for (int64_t i = 0; i < (M + 15) / 16 * 16 * ldpa; i++) pa[i] = 0xdeadbeef;
                        const int r1 = kt->softmax_f32(s1, &tile, m1, l1, a1);
                        const int r2 = kt->softmax_tiles_f32(s2, &tile, m2, l2, a2, pa, ldpa);
                        int same = r1 == 0 && r2 == 0, paired = 1;
                        for (int64_t r = 0; r < M; r++) { /* the sum's terms: the old sum rescaled, and P */
                            double terms = fabs((double)l0[r] * a1[r]);
                            for (int64_t j = 0; j < nk; j++) terms += s1[j * M + r];
                            same &= memcmp(&m1[r], &m2[r], 4) == 0 && memcmp(&a1[r], &a2[r], 4) == 0 &&
                                    fabs((double)l2[r] - l1[r]) <= 0x1p-17 * terms;
                        }
                        for (int64_t r = 0; r < (M + 15) / 16 * 16; r++)
                            for (int64_t p = 0; p < ldpa; p++) {
                                const uint32_t got = pa[r * ldpa + p];
                                if (p >= (nk + 31) / 32 * 16) { /* the gap */
                                    paired &= got == 0xdeadbeef;
                                    continue;
                                }
                                for (int h = 0; h < 2; h++) {
                                    const int64_t j = 2 * p + h;
                                    const double want = r < M && j < nk ? s1[j * M + r] : 0.0;
                                    const double half = npattn_bf16_to_f32((uint16_t)(got >> (16 * h)));
                                    paired &= fabs(half - want) <= (0x1p-8 + 0x1p-17) * want + 0x1p-120;
                                }
                            }
                        snprintf(msg, sizeof msg, "%s softmax_tiles_f32 %s M=%lld nk=%lld", kernel_tables[t],
                                 kind ? "band, softcap, bias" : "plain", (long long)M, (long long)nk);
                        expect(same && paired, msg);
                    }
                }
    }
    npattn_kernels_force("");
    /* without the OS's permission for the tile state, no amx table */
    npattn_kernels_deny_amx(1);
    expect(npattn_kernels_force("amx") == -1 && strcmp(npattn_kernels()->name, "amx") != 0,
           "the amx table is refused without the OS's permission");
    npattn_kernels_deny_amx(0);
}

/* The pipelined step (prefill_tiles_bf16, where a table has it) against
 * the same step in its stages (scores_bf16, softmax_tiles_f32, O's rows
 * rescaled, accumulate_tiles_bf16): the same products in the same order,
 * so O, m and alpha bit for bit and l within its terms' roundings (its sum
 * in another order), on plain tiles and with a band, softcap and bias (-inf
 * in places, by rows for the step, by columns for the stages); with a band
 * alone, which the step takes as a plain row's range of keys (the exp's
 * argument one FMA of the raw score, not two roundings), P within a
 * rounding of bfloat16 and O within those; rows and keys that leave blocks
 * and pairs cut short. A NaN, +inf or -inf score (huge values whose
 * products overflow) returns 1. */
static void test_step_tiles(void) {
    enum { MAX_M = 70, MAX_N = 256, MAX_D = 128, MAX_M16 = 80 };
    static const int64_t rows[] = {1, 16, 17, 32, 33, 70}, keys[] = {1, 31, 33, 100, 256};
    static const int64_t widths[] = {32, 64, 128}, vwidths[] = {16, 48, 128};
#define ALIGNED __attribute__((aligned(64))) /* as the core's buffers are */
    static ALIGNED uint16_t qa[MAX_M16 * MAX_D], kh[MAX_N * MAX_D];
    static const uint16_t *krows[MAX_N];
    static ALIGNED uint32_t qp[MAX_D / 2 * MAX_M16], vp[MAX_N / 2 * MAX_D], kb[MAX_N * MAX_D / 2],
        pa[MAX_M16 * (MAX_N / 2 + 16)];
    static ALIGNED float st[MAX_N * MAX_M], o1[MAX_M16 * MAX_D], o2[MAX_M16 * MAX_D], bias_c[MAX_N * MAX_M],
        bias_r[MAX_M * MAX_N];
#undef ALIGNED
    static char scratch[200000] __attribute__((aligned(64)));
    char msg[200];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        const struct npattn_kernels *kt = npattn_kernels();
        if (!kt->prefill_tiles_bf16) continue;
        int bad = 0, cases = 0;
        for (size_t ci = 0; ci < 40; ci++) {
            const int64_t M = rows[ci % 6], nk = keys[(ci / 2) % 5], D = widths[ci % 3], Dv = vwidths[(ci / 3) % 3];
            const int64_t ldq = (M + 15) / 16 * 16, np = (nk + 1) / 2, ldpa = (nk + 31) / 32 * 16;
            const int kind = (int)(ci / 5) % 3; /* plain; band, softcap and bias; band */
            for (int64_t i = 0; i < ldq * D; i++) qa[i] = i < M * D ? npattn_f32_to_bf16((float)(uniform() * 2)) : 0;
            for (int64_t i = 0; i < nk * D; i++) kh[i] = npattn_f32_to_bf16((float)(uniform() * 2));
            for (int64_t j = 0; j < nk; j++) krows[j] = kh + j * D;
            for (int64_t pi = 0; pi < D / 2; pi++)
                for (int64_t r = 0; r < ldq; r++) qp[pi * ldq + r] = qa[r * D + 2 * pi] | (uint32_t)qa[r * D + 2 * pi + 1] << 16;
            for (int64_t pi = 0; pi < np; pi++) /* V: K's first Dv values */
                for (int64_t e = 0; e < Dv; e++)
                    vp[pi * Dv + e] = kh[2 * pi * D + e % D] | (2 * pi + 1 < nk ? (uint32_t)kh[(2 * pi + 1) * D + e % D] << 16 : 0);
            float m1[MAX_M], l1[MAX_M], a1[MAX_M], m2[MAX_M], l2[MAX_M], a2[MAX_M], l0[MAX_M];
            int32_t lo[MAX_M], hi[MAX_M];
            for (int64_t r = 0; r < M; r++) {
                m1[r] = m2[r] = r % 3 == 0 ? -INFINITY : (float)(uniform() * 4);
                l0[r] = l1[r] = l2[r] = (float)fabs(uniform());
                lo[r] = (int32_t)(r % 5), hi[r] = (int32_t)(nk - 1 - r % 3);
                for (int64_t j = 0; j < nk; j++)
                    bias_c[j * M + r] = bias_r[r * nk + j] = (r + j) % 7 == 3 ? -INFINITY : (float)uniform();
            }
            for (int64_t i = 0; i < ldq * Dv; i++) o1[i] = o2[i] = i < M * Dv ? (float)uniform() : 0.0f;
            struct npattn_score_tile tc = {.nk = nk, .M = M, .ld = M, .scale = 0.3f}, tr = tc;
            tr.ld = nk;
            if (kind) tc.lo = tr.lo = lo, tc.hi = tr.hi = hi;
            if (kind == 1) tc.softcap = tr.softcap = 5.0f, tc.bias = bias_c, tr.bias = bias_r;
            /* the stages */
            kt->scores_bf16(qp, ldq, M, D / 2, kh, D, nk, st, M);
            int r1 = kt->softmax_tiles_f32(st, &tc, m1, l1, a1, pa, ldpa);
            for (int64_t r = 0; r < M; r++)
                for (int64_t e = 0; e < Dv && a1[r] != 1.0f; e++) o1[r * Dv + e] *= a1[r];
            kt->accumulate_tiles_bf16(pa, ldpa, M, np, vp, Dv, Dv, o1);
            /* the step */
            kt->k_tiles(krows, nk, D, kb);
            int r2 = kt->prefill_tiles_bf16(qa, D, kb, vp, Dv, Dv, &tr, m2, l2, a2, o2, scratch);
            int ok = r1 == 0 && r2 == 0;
            if (kind < 2) ok &= memcmp(o1, o2, (size_t)(M * Dv) * 4) == 0;
            for (int64_t r = 0; r < M; r++) {
                double terms = fabs((double)l0[r] * a1[r]) + 2 * nk; /* the old sum rescaled, and P (at most 1 each) */
                ok &= memcmp(&m1[r], &m2[r], 4) == 0 && memcmp(&a1[r], &a2[r], 4) == 0 &&
                      fabs((double)l2[r] - l1[r]) <= (kind < 2 ? 0x1p-22 : 0x1p-18) * terms;
                for (int64_t e = 0; e < Dv && kind == 2; e++) { /* each weight within a rounding: O within 2^-7 of its terms */
                    double size = fabs(o1[r * Dv + e]);
                    for (int64_t j = 0; j < nk; j++) {
                        const uint32_t w = pa[r * ldpa + j / 2], x = vp[j / 2 * Dv + e];
                        size += npattn_bf16_to_f32((uint16_t)(w >> 16 * (j % 2))) * fabs(npattn_bf16_to_f32((uint16_t)(x >> 16 * (j % 2))));
                    }
                    ok &= fabs((double)o2[r * Dv + e] - o1[r * Dv + e]) <= 0x1p-7 * size;
                }
            }
            if (!ok) printf("  M=%lld nk=%lld D=%lld Dv=%lld %s\n", (long long)M, (long long)nk, (long long)D, (long long)Dv,
                            kind == 1 ? "band, softcap, bias" : kind == 2 ? "band" : "plain");
            bad += !ok, cases++;
        }
        snprintf(msg, sizeof msg, "%s prefill_tiles_bf16 against its stages, %d cases", kernel_tables[t], cases);
        expect(bad == 0, msg);
        /* extremes: a NaN value, an infinite one, products past float's range of either sign */
        for (int x = 0; x < 4; x++) {
            const int64_t M = 20, nk = 40, D = 32, Dv = 16;
            for (int64_t i = 0; i < 32 * D; i++) qa[i] = i < M * D ? npattn_f32_to_bf16((float)uniform()) : 0;
            for (int64_t i = 0; i < nk * D; i++) kh[i] = npattn_f32_to_bf16((float)uniform());
            for (int64_t j = 0; j < nk; j++) krows[j] = kh + j * D;
            for (int64_t i = 0; i < nk / 2 * Dv; i++) vp[i] = 0x3f803f80;
            /* value 0 of each row of q and k 0 but row 9's (2^64) and key 11's (+-2^64): their product overflows,
             * the other scores moderate (a score of 2^64 would make the fast exp's argument overflow too) */
            for (int64_t r = 0; r < M; r++) qa[r * D] = r == 9 ? 0x5f80 : 0, qa[r * D + 2] &= 0x7fff;
            for (int64_t j = 0; j < nk; j++) kh[j * D] = j != 11 ? 0 : x == 2 ? 0x5f80 : 0xdf80;
            if (x == 0) qa[5 * D + 3] = 0x7fc0; /* NaN */
            if (x == 1) kh[7 * D + 2] = 0xff80; /* -inf, against values 2 of q, not negative: -inf scores only */
            if (x < 2) kh[11 * D] = 0;
            float m[32], l[32], a[32];
            for (int64_t r = 0; r < M; r++) m[r] = -INFINITY, l[r] = 0;
            const struct npattn_score_tile tile = {.nk = nk, .M = M, .ld = nk, .scale = 0.5f};
            kt->k_tiles(krows, nk, D, kb);
            snprintf(msg, sizeof msg, "%s prefill_tiles_bf16 returns 1 on a %s score", kernel_tables[t],
                     x == 0 ? "NaN" : x == 1 ? "-inf" : x == 2 ? "+inf (overflow)" : "-inf (overflow)");
            expect(kt->prefill_tiles_bf16(qa, D, kb, vp, Dv, Dv, &tile, m, l, a, o2, scratch) == 1, msg);
        }
    }
    npattn_kernels_force("");
}

/* A bfloat16 prefill through the forward pass, every table: q, k and v in
 * bfloat16, so that the tables with bfloat16 dot products run QK^T on them
 * (and, under "fast", P @ V with the weights rounded to bfloat16); the
 * result in float32 against the double formula of the same inputs: within
 * float32's sums under "highest", the weights' rounding (2^-9) under "fast". */
/* Prefill tiles of half q, K and V: bfloat16's dot products, and float16's
 * split into two bfloat16 values each (D 64 and 40; 38 is no multiple of
 * the tiles' step and takes the float32 gemms); bfloat16 "fast" with D 64
 * takes the amx table's pipelined step, causal and with a window. */
static void test_half_prefill(void) {
    const int64_t U = NPATTN_UNBOUNDED, BR = INT64_MIN;
    static const struct case_ cases[] = {
        {1, 4, 2, 70, 70, 64, 64, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2},
        {2, 3, 1, 33, 90, 38, 20, 0, 17, 3, BR, 0, MASK_NONE, 0, 1, 1},
        {1, 8, 2, 90, 100, 40, 24, 1, U, U, BR, 0, MASK_NONE, 2.0, 0, 3},
        {1, 4, 2, 70, 100, 64, 32, 1, 9, 0, BR, 0, MASK_NONE, 0, 0, 2}, /* a window: rows whose band starts past 0 */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
        for (int t = 0; t < 2; t++)
            for (int fast = 0; fast < 2; fast++) {
                const enum npattn_dtype dt = t ? NPATTN_DTYPE_F16 : NPATTN_DTYPE_BF16;
                char what[100];
                snprintf(what, sizeof what, "%s prefill, case %zu, %s", t ? "float16" : "bfloat16", ci,
                         fast ? "fast" : "highest");
                half_case(&cases[ci], dt, dt, fast ? NPATTN_PRECISION_FAST : NPATTN_PRECISION_HIGHEST,
                          !fast ? 2e-5 : t ? 2e-5 + 0x1p-15 : 4e-3, what); /* float16 "fast": P within 2^-15 */
            }
}

/* float16 values split into bfloat16 pairs: hi + lo is the value exactly,
 * neither part subnormal; K's rows twice over, Q's his then los across. */
static void test_split(void) {
    static uint16_t h[150];
    static uint32_t row[300], across[2 * 20 * 16];
    static float x[150];
    for (int i = 0; i < 150; i++) h[i] = (uint16_t)((i * 40503u) & 0xFFFF);
    h[0] = 0x0001, h[1] = 0x8001, h[2] = 0x7BFF, h[3] = 0x03FF, h[4] = 0x0000, h[5] = 0x8000;
    for (int i = 0; i < 150; i++)
        if ((h[i] & 0x7C00) == 0x7C00) h[i] &= 0xBFFF; /* no infinity or NaN */
    int bad = 0;
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0) continue;
        npattn_split_f16_row(h, 150, row);
        for (int c = 0; c < 150; c++) {
            const uint16_t hi = (uint16_t)row[c], lo = (uint16_t)(row[c] >> 16);
            x[c] = npattn_f16_to_f32(h[c]);
            bad += npattn_bf16_to_f32(hi) + npattn_bf16_to_f32(lo) != x[c] || row[150 + c] != row[c] ||
                   npattn_bf16_subnormal(hi) || npattn_bf16_subnormal(lo);
        }
    }
    npattn_kernels_force("");
    expect(bad == 0, "split_f16_row: hi + lo exact, no part subnormal, the row twice");
    memset(across, 0xAB, sizeof across);
    npattn_split_across(x, 7, 20, 21, across, 16); /* 7 rows of 20, 21 apart */
    for (int c = 0; c < 20; c++)
        for (int r = 0; r < 16; r++) {
            const uint32_t hi = across[c * 16 + r], lo = across[(20 + c) * 16 + r];
            if (r >= 7) {
                bad += hi != 0 || lo != 0;
                continue;
            }
            bad += (hi & 0xFFFF) != hi >> 16 || (lo & 0xFFFF) != lo >> 16 ||
                   npattn_bf16_to_f32((uint16_t)hi) + npattn_bf16_to_f32((uint16_t)lo) != x[r * 21 + c];
        }
    expect(bad == 0, "split_across: (hi, hi) then (lo, lo) in each row's lane, zeros past the rows");
    /* split_f16_twice: two rows of pairs, zeros past the row */
    static uint32_t hi2[160], lo2[160];
    memset(hi2, 0xAB, sizeof hi2), memset(lo2, 0xAB, sizeof lo2);
    npattn_split_f16_twice(h, 150, hi2, lo2, 160);
    for (int c = 0; c < 160; c++)
        bad += c >= 150 ? hi2[c] != 0 || lo2[c] != 0
                        : (hi2[c] & 0xFFFF) != hi2[c] >> 16 || (lo2[c] & 0xFFFF) != lo2[c] >> 16 ||
                              npattn_bf16_to_f32((uint16_t)hi2[c]) + npattn_bf16_to_f32((uint16_t)lo2[c]) != x[c];
    expect(bad == 0, "split_f16_twice: (hi, hi) and (lo, lo), exact, zeros past the row");
    /* split_tiles, where a table has it: weights of every size as pairs
     * (hi, lo) twice, hi + lo within 2^-15 of it, zeros past the rows and keys
     * (to a multiple of 16 pairs) */
    static float st[37 * 40];
    static uint32_t pa[48 * 80];
    for (int i = 0; i < 37 * 40; i++) st[i] = (float)ldexp(uniform() + 1.0, -(i % 140));
    const int shapes[][2] = {{37, 33}, {16, 16}, {1, 40}, {33, 1}}; /* (keys, rows) */
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0 || !npattn_kernels()->split_tiles) continue;
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            const int nk = shapes[k][0], M = shapes[k][1], rows = (M + 15) / 16 * 16, ldpa = 80;
            memset(pa, 0xAB, sizeof pa);
            npattn_kernels()->split_tiles(st, nk, M, 40, pa, ldpa, rows);
            for (int r = 0; r < rows; r++)
                for (int p = 0; p < (2 * nk + 15) / 16 * 16; p++) {
                    const uint32_t got = pa[r * ldpa + p];
                    if (r >= M || p >= 2 * nk) {
                        bad += got != 0;
                        continue;
                    }
                    const float w = st[p / 2 * 40 + r];
                    const float hi = npattn_bf16_to_f32((uint16_t)got), lo = npattn_bf16_to_f32((uint16_t)(got >> 16));
                    uint32_t bits;
                    memcpy(&bits, &w, sizeof bits);
                    bad += hi != npattn_bf16_to_f32((uint16_t)(bits >> 16)) ||
                           (w >= 0x1p-100f && fabs((double)hi + lo - w) > 0x1p-15 * w) || got != pa[r * ldpa + (p ^ 1)];
                }
        }
    }
    npattn_kernels_force("");
    expect(bad == 0, "split_tiles: (hi, lo) twice per weight, within 2^-15, zeros past the rows and keys");
    /* exact_tiles, where a table has it: three parts of bfloat16 values
     * summing to each weight exactly (weights from 2^-100 on), keys paired */
    static uint32_t pa3[3 * 48 * 32];
    for (int t = 0; t < N_KERNEL_TABLES; t++) {
        if (npattn_kernels_force(kernel_tables[t]) != 0 || !npattn_kernels()->exact_tiles) continue;
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            const int nk = shapes[k][0], M = shapes[k][1], rows = (M + 15) / 16 * 16, ldpa = 32;
            const int n16 = (nk + 31) / 32 * 16;
            memset(pa3, 0xAB, sizeof pa3);
            npattn_kernels()->exact_tiles(st, nk, M, 40, pa3, ldpa, rows);
            for (int r = 0; r < rows; r++)
                for (int p = 0; p < n16; p++)
                    for (int h = 0; h < 2; h++) {
                        const int j = 2 * p + h;
                        double sum = 0;
                        int nonzero = 0;
                        for (int part = 0; part < 3; part++) {
                            const uint16_t b = (uint16_t)(pa3[(part * rows + r) * ldpa + p] >> (16 * h));
                            sum += npattn_bf16_to_f32(b);
                            nonzero |= b != 0;
                        }
                        if (r >= M || j >= nk) bad += nonzero;
                        else bad += st[j * 40 + r] >= 0x1p-100f && sum != st[j * 40 + r];
                    }
        }
    }
    npattn_kernels_force("");
    expect(bad == 0, "exact_tiles: three parts summing to each weight, keys paired, zeros past the rows and keys");
}

int main(void) {
    const int64_t U = NPATTN_UNBOUNDED, BR = INT64_MIN;
    if (!npattn_blas_ok()) return refused_everywhere();
    static const struct case_ cases[] = {
        /* B Hq Hkv L S D Dv causal wl wr q_offset k_offset mask softcap sinks threads */
        {2, 18, 6, 3, 7, 5, 5, 1, U, U, BR, 0, MASK_NONE, 0, 0, 1},    /* the course, causal */
        {2, 18, 6, 3, 7, 5, 5, 1, U, U, 0, 0, MASK_NONE, 0, 0, 2},     /* top-left */
        {2, 18, 6, 7, 3, 5, 4, 1, U, U, BR, 0, MASK_NONE, 0, 0, 3},    /* L > S: rows with no key */
        {1, 4, 1, 1, 300, 16, 9, 1, U, U, BR, 0, MASK_NONE, 0, 1, 2},  /* decode, streamed */
        {1, 4, 2, 70, 300, 16, 16, 0, U, U, BR, 0, MASK_BOOL, 0, 1, 2},
        {1, 4, 2, 40, 90, 16, 12, 0, U, U, BR, 0, MASK_ADD, 3.0, 0, 2},
        {3, 6, 3, 130, 130, 8, 8, 1, U, U, BR, 0, MASK_NONE, 0, 0, 8},
        {1, 3, 3, 5, 260, 4, 6, 0, U, U, BR, 0, MASK_NONE, 0, 0, 2},
        {1, 2, 1, 4, 0, 4, 4, 0, U, U, BR, 0, MASK_NONE, 0, 1, 1},     /* S = 0 with sinks */
        {0, 2, 1, 4, 5, 4, 4, 0, U, U, BR, 0, MASK_NONE, 0, 0, 1},     /* B = 0 */
        {1, 600, 1, 2, 40, 4, 4, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2},
        /* windows and positions */
        {1, 4, 2, 100, 100, 16, 16, 1, 9, 0, BR, 0, MASK_NONE, 0, 0, 2},
        {1, 4, 2, 33, 200, 8, 8, 0, 5, 5, BR, 0, MASK_BOOL, 0, 1, 3},
        {2, 4, 4, 20, 50, 8, 8, 1, U, U, 40, 35, MASK_NONE, 0.5, 0, 2},
        {1, 2, 1, 10, 30, 8, 8, 1, U, U, -4, 0, MASK_ADD, 0, 1, 1},
        {1, 2, 1, 1, 5000, 8, 8, 1, 511, 0, BR, 0, MASK_NONE, 0, 0, 2}, /* decode with a window */
        {1, 2, 1, 6, 9, 8, 8, 0, 0, U, INT64_MAX - 3, INT64_MIN + 7, MASK_NONE, 0, 0, 1}, /* saturation */
        /* few units, many keys: split-K, merged by log-sum-exp */
        {1, 4, 1, 1, 40000, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 1, 2},
        {1, 4, 1, 2, 12000, 8, 8, 0, U, U, BR, 0, MASK_BOOL, 0, 0, 3},
        /* wide rows: fewer keys per tile */
        {1, 2, 1, 9, 40, 300, 200, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2},
        /* q_offset - k_offset past +-2^63, a window side bringing the band back within the keys */
        {1, 2, 1, 6, 9, 8, 8, 0, INT64_MAX, 0, (INT64_C(1) << 62) + 3, -(INT64_C(1) << 62) - 2, MASK_NONE, 0, 0, 1},
        {1, 2, 1, 6, 9, 8, 8, 1, INT64_MAX, U, (INT64_C(1) << 62) + 3, -(INT64_C(1) << 62) - 2, MASK_BOOL, 0, 1, 1},
        {1, 2, 1, 6, 9, 8, 8, 0, U, INT64_MAX, -(INT64_C(1) << 62) - 1, INT64_C(1) << 62, MASK_NONE, 0, 0, 1},
    };
    for_each_table(cases, sizeof cases / sizeof cases[0], run_case);
    test_pages();
    static const struct case_ small = {1, 2, 1, 40, 50, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 0, 1};
    static const struct case_ split = {1, 2, 1, 1, 60000, 16, 8, 1, U, U, BR, 0, MASK_NONE, 0, 0, 2};
    test_allocation_failure(&small, NPATTN_DTYPE_F64, 0.5);
    test_allocation_failure(&small, NPATTN_DTYPE_F32, 0.5);
    test_allocation_failure(&small, NPATTN_DTYPE_F32, 1e38); /* redone in double: one more */
    test_allocation_failure(&split, NPATTN_DTYPE_F32, 0.5);
    test_cancel();
    test_cancel_zeroing_weights();
    test_pool_modes();
    test_pool_concurrent();
    test_extremes();
    test_transpose();
    test_gemm();
    test_finish_rows();
    test_narrow();
    test_add_f32();
    test_stream_kernels();
    test_half_cache();
    test_bf16_kernels();
    test_step_tiles();
    test_half_prefill();
    test_split();
    test_conversions();
    test_pairs_across();
    test_invalid();
    test_key_ranges();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}

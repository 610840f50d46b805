/* core.c: checked allocation, the BLAS (checked once), batch offsets, the
 * tiles' bfloat16 pairs, and what the glue reports. What the planners share
 * is in plan.c, the rules of attention.h in rules.c. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

#include "band.h"
#include "blas.h"
#include "internal.h"
#include "kernels/kernels.h"

/* ---- allocation, with a failure hook for the tests ---- */

static _Atomic int64_t fail_alloc_after = -1;

void npattn_debug_fail_alloc_after(int64_t n) { atomic_store(&fail_alloc_after, n); }

/* Whether the test hook makes this allocation fail. */
static int fail_now(void) {
    int64_t left = atomic_load(&fail_alloc_after);
    if (left < 0) return 0;
    if (left == 0) return 1;
    atomic_store(&fail_alloc_after, left - 1);
    return 0;
}

static void *aligned(size_t n_bytes) {
    if (n_bytes == 0) n_bytes = 64;
    if (n_bytes > SIZE_MAX - 63) return NULL;
    return aligned_alloc(64, (n_bytes + 63) / 64 * 64);
}

void *npattn_alloc(size_t n_bytes) { return fail_now() ? NULL : aligned(n_bytes); }

void npattn_free(void *p) { free(p); }

/* The block npattn_free_kept keeps: the largest given back, of at most
 * NPATTN_KEPT_MAX bytes; `busy` guards it (whoever finds it busy allocates
 * or frees as usual rather than wait). */
static struct {
    atomic_flag busy;
    void *p;
    size_t size;
} kept = {ATOMIC_FLAG_INIT, NULL, 0};

void *npattn_alloc_kept(size_t *n_bytes) {
    if (fail_now()) return NULL;
    void *p = NULL;
    if (!atomic_flag_test_and_set_explicit(&kept.busy, memory_order_acquire)) {
        if (kept.p && kept.size >= *n_bytes) p = kept.p, *n_bytes = kept.size, kept.p = NULL, kept.size = 0;
        atomic_flag_clear_explicit(&kept.busy, memory_order_release);
    }
    return p ? p : aligned(*n_bytes);
}

void npattn_free_kept(void *p, size_t n_bytes) {
    if (p && n_bytes <= NPATTN_KEPT_MAX && !atomic_flag_test_and_set_explicit(&kept.busy, memory_order_acquire)) {
        if (n_bytes > kept.size) { /* keep the larger */
            void *old = kept.p;
            kept.p = p, kept.size = n_bytes;
            p = old;
        }
        atomic_flag_clear_explicit(&kept.busy, memory_order_release);
    }
    free(p);
}

uint64_t npattn_memory_limit(void) {
#if defined(__linux__)
    struct sysinfo si;
    if (sysinfo(&si) != 0 || si.mem_unit == 0) return 0;
    return ((uint64_t)si.totalram + (uint64_t)si.totalswap) * si.mem_unit;
#else
    return 0; /* macOS grows its swap on demand: no fixed bound */
#endif
}

/* ---- the BLAS, single-threaded inside npattn's pool, checked once ---- */

/* C = op(A) op(B), row-major, against a plain loop; the inputs are multiples
 * of 1/8 at most 1, so every product and sum is exact and the comparison is
 * equality. */
static int gemm_right(int ta, int tb, int M, int N, int K, int f64) {
    float a[16 * 16], b[16 * 300], c[16 * 300];
    double ad[16 * 16], bd[16 * 300], cd[16 * 300];
    for (int i = 0; i < M * K; i++) a[i] = (float)(ad[i] = ((i * 37 % 17) - 8) / 8.0);
    for (int i = 0; i < K * N; i++) b[i] = (float)(bd[i] = ((i * 29 % 13) - 6) / 8.0);
    const int lda = ta ? M : K, ldb = tb ? K : N;
    const enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    if (f64) npattn_cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, 1.0, ad, lda, bd, ldb, 0.0, cd, N);
    else npattn_cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, 1.0f, a, lda, b, ldb, 0.0f, c, N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += ad[ta ? k * M + i : i * K + k] * bd[tb ? j * K + k : k * N + j];
            if ((f64 ? cd[i * N + j] : (double)c[i * N + j]) != s) return 0;
        }
    return 1;
}

static int blas_right;

static void blas_setup(void) {
    npattn_blas_set_num_threads(1);
    /* shapes that OpenBLAS 0.3.34's SME kernels (core armv9sme) compute wrong
     * unless the streaming vector length is 512 bits, as on Apple M4 */
    blas_right = gemm_right(0, 1, 7, 54, 5, 0) && gemm_right(0, 0, 1, 300, 16, 0) &&
                 gemm_right(1, 0, 16, 32, 8, 0) && gemm_right(0, 1, 7, 54, 5, 1) && gemm_right(1, 0, 16, 32, 8, 1);
}

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
void npattn_blas_init(void) { pthread_once(&blas_once, blas_setup); }

int npattn_blas_ok(void) {
    npattn_blas_init();
    return blas_right;
}

const char *npattn_blas_core(void) { return npattn_blas_get_corename(); }

size_t npattn_dtype_size(enum npattn_dtype dtype) {
    return dtype == NPATTN_DTYPE_F64 ? 8 : dtype == NPATTN_DTYPE_F32 ? 4 : npattn_is_code(dtype) ? 1 : 2;
}

int64_t npattn_n_batch(const struct npattn_problem *p) {
    int64_t n = 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) n *= p->batch_shape[d];
    return n;
}

int64_t npattn_batch_offset(const struct npattn_problem *p, const struct npattn_tensor *t, int64_t b) {
    int64_t off = 0;
    for (int32_t d = p->n_batch_dim - 1; d >= 0; d--) {
        int64_t n = p->batch_shape[d];
        off += (b % n) * t->batch_stride[d];
        b /= n;
    }
    return off;
}

/* ---- what the glue reports: the kernels and the BLAS ---- */

const char *npattn_simd(void) { return npattn_kernels()->name; }

int npattn_debug_force_simd(const char *name) { return npattn_kernels_force(name); }

/* ---- the bfloat16 pairs of K's and V's rows, and of Q's and dO's, for the tiles ---- */

int npattn_pairs_of_kv(const struct npattn_kv *kv, int64_t j0, int64_t nk, int64_t w, uint32_t *out, int64_t ldo) {
    int sub = 0;
    for (int64_t j = 0, run; j < nk; j += 2) {
        const uint16_t *a = (const uint16_t *)npattn_kv_row(kv, j0 + j, &run);
        const uint16_t *b = j + 1 < nk ? (const uint16_t *)npattn_kv_row(kv, j0 + j + 1, &run) : NULL;
        sub |= npattn_kernels()->pair_bf16(a, b, w, out ? out + j / 2 * ldo : NULL);
        if (out) memset(out + j / 2 * ldo + w, 0, (size_t)(ldo - w) * sizeof *out);
    }
    return !sub;
}

int npattn_word_pairs(const struct npattn_tensor *t, int64_t off, int64_t h0, int64_t i0, int64_t nq, int64_t M,
                      int64_t w, uint32_t *out, int64_t ldo) {
    const struct npattn_kernels *kn = npattn_kernels();
    const int64_t ld = t->row_stride;
    if (t->dtype != NPATTN_DTYPE_BF16 || t->col_stride != 1 || ld % 2 != 0 || w % 2 != 0 || nq < NPATTN_TRANSPOSE_ROWS ||
        !kn->transpose_f32 || !kn->pair_bf16)
        return 0;
    for (int64_t r0 = 0; r0 < M; r0 += nq) {
        const uint16_t *rows = (const uint16_t *)npattn_elem(t, 2, off, h0 + r0 / nq, i0);
        if ((uintptr_t)rows % 4 != 0) return 0;
        for (int64_t i = 0; i < nq; i++)
            if (kn->pair_bf16(rows + i * ld, NULL, w, NULL)) return 0;
        kn->transpose_f32((const float *)rows, ld / 2, nq, w / 2, (float *)out + r0, ldo);
    }
    for (int64_t c = 0; c < w / 2; c++) memset(out + c * ldo + M, 0, (size_t)(ldo - M) * sizeof *out);
    return 1;
}

/* npattn_narrow_f32's blocks: 2^18 elements, 1.5 MiB read and written. */
#define NARROW_BLOCK ((int64_t)1 << 18)
struct narrow_job {
    enum npattn_dtype dtype;
    const float *src;
    char *dst;
    int64_t n;
};

static void narrow_block(void *arg, int64_t task, int32_t slot) {
    (void)slot;
    const struct narrow_job *j = arg;
    const int64_t at = task * NARROW_BLOCK, n = j->n - at < NARROW_BLOCK ? j->n - at : NARROW_BLOCK;
    npattn_store_f32(j->dtype, j->src + at, n, j->dst + at * (int64_t)npattn_dtype_size(j->dtype), 1);
}

enum npattn_status npattn_narrow_f32(enum npattn_dtype dtype, const float *src, int64_t n, void *dst,
                                     int32_t n_threads) {
    if (n_threads < 0 || n_threads > NPATTN_MAX_THREADS) return NPATTN_STATUS_BAD_THREADS;
    if (n <= 0) return NPATTN_STATUS_OK;
    struct narrow_job j = {dtype, src, dst, n};
    struct npattn_run run;
    npattn_run_init(&run, NULL, NULL);
    const int64_t n_task = (n + NARROW_BLOCK - 1) / NARROW_BLOCK;
    const int32_t threads = npattn_pool_threads(n_threads);
    return npattn_pool_run(narrow_block, &j, n_task, n_task < threads ? (int32_t)n_task : threads, &run);
}

static volatile float peak_sink;

/* GFLOP/s of one of the table's register-only loops (fma_loop and its
 * kin): the rounds doubled until one run takes a tenth of `seconds`, then
 * the best of a few runs. */
static double loop_peak(double (*loop)(int64_t n, float *sink), double seconds) {
    float sink = 0;
    int64_t n = 1 << 12;
    for (;;) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        double flops = loop(n, &sink);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        if (dt > seconds / 10 || n > ((int64_t)1 << 40)) {
            double best = flops / dt;
            for (int i = 0; i < 5; i++) {
                clock_gettime(CLOCK_MONOTONIC, &t0);
                flops = loop(n, &sink);
                clock_gettime(CLOCK_MONOTONIC, &t1);
                dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
                if (flops / dt > best) best = flops / dt;
            }
            peak_sink = sink; /* the loop's result is used */
            return best / 1e9;
        }
        n *= 2;
    }
}

double npattn_fma_peak(double seconds) { return loop_peak(npattn_kernels()->fma_loop, seconds); }

double npattn_bf16_peak(double seconds) {
    const struct npattn_kernels *k = npattn_kernels();
    return k->bf16_loop ? loop_peak(k->bf16_loop, seconds) : 0.0;
}

double npattn_tile_peak(double seconds) {
    const struct npattn_kernels *k = npattn_kernels();
    return k->tile_loop ? loop_peak(k->tile_loop, seconds) : 0.0;
}

const char *npattn_blas_config(void) { return npattn_blas_get_config(); }

const char *npattn_blas_library(void) {
#ifdef NPATTN_BLAS_SCIPY
    return "scipy-openblas32 (bundled)";
#else
    return "system OpenBLAS";
#endif
}

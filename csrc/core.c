/* core.c: what the forward and backward drivers share: checked allocation,
 * statuses, and the rules of attention.h, checked once for every caller. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "band.h"
#include "blas.h"
#include "internal.h"

/* ---- allocation, with a failure hook for the tests ---- */

static _Atomic int64_t fail_alloc_after = -1;

void npattn_debug_fail_alloc_after(int64_t n) { atomic_store(&fail_alloc_after, n); }

void *npattn_alloc(size_t n_bytes) {
    int64_t left = atomic_load(&fail_alloc_after);
    if (left >= 0) {
        if (left == 0) return NULL;
        atomic_store(&fail_alloc_after, left - 1);
    }
    if (n_bytes == 0) n_bytes = 64;
    if (n_bytes > SIZE_MAX - 63) return NULL;
    return aligned_alloc(64, (n_bytes + 63) / 64 * 64);
}

void npattn_free(void *p) { free(p); }

const char *npattn_status_string(enum npattn_status status) {
    switch (status) {
    case NPATTN_STATUS_OK: return "success";
    case NPATTN_STATUS_NO_MEMORY: return "could not allocate scratch memory";
    case NPATTN_STATUS_CANCELLED: return "the call was cancelled";
    case NPATTN_STATUS_INVALID: return "the problem breaks a rule of attention.h";
    case NPATTN_STATUS_TOO_LARGE: return "D or D_v exceeds what one BLAS call can take (INT_MAX)";
    case NPATTN_STATUS_BLAS_WRONG: return "the BLAS library computes wrong matrix products on this CPU";
    }
    return "unknown status";
}

enum npattn_status npattn_slots_alloc(struct npattn_slots *s, int32_t n, size_t size, size_t exact_size) {
    memset(s, 0, sizeof *s);
    s->n = n, s->size = (size + 63) / 64 * 64, s->exact_size = exact_size;
    if (n > 0 && s->size > SIZE_MAX / (size_t)n) return NPATTN_STATUS_NO_MEMORY;
    s->scratch = npattn_alloc(s->size * (size_t)n);
    if (s->scratch && exact_size) {
        s->exact = npattn_alloc((size_t)n * sizeof *s->exact);
        if (s->exact) memset(s->exact, 0, (size_t)n * sizeof *s->exact);
    }
    if (!s->scratch || (exact_size && !s->exact)) {
        npattn_slots_free(s);
        return NPATTN_STATUS_NO_MEMORY;
    }
    return NPATTN_STATUS_OK;
}

void npattn_slots_free(struct npattn_slots *s) {
    if (s->exact)
        for (int32_t i = 0; i < s->n; i++) npattn_free(s->exact[i]);
    npattn_free(s->exact);
    npattn_free(s->scratch);
    memset(s, 0, sizeof *s);
}

void npattn_run_exact(void *plan, int64_t task, int32_t slot, struct npattn_slots *s, npattn_tile_fn in_f32,
                      npattn_tile_fn in_f64, struct npattn_run *run) {
    if (!s->exact) {
        in_f64(plan, task, slot, npattn_slot(s, slot));
        return;
    }
    if (!in_f32(plan, task, slot, npattn_slot(s, slot))) return;
    if (!s->exact[slot] && !(s->exact[slot] = npattn_alloc(s->exact_size))) {
        npattn_run_fail(run, NPATTN_STATUS_NO_MEMORY);
        return;
    }
    in_f64(plan, task, slot, s->exact[slot]);
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
    return dtype == NPATTN_DTYPE_F64 ? 8 : dtype == NPATTN_DTYPE_F32 ? 4 : 2;
}

static int float_normal(double x) { return x == 0 || (fabs(x) >= FLT_MIN && fabs(x) <= FLT_MAX); }

int npattn_computes_f64(const struct npattn_problem *p, enum npattn_dtype result) {
    return result == NPATTN_DTYPE_F64 || !float_normal(p->scale) ||
           (p->softcap > 0 && (!float_normal(p->softcap) || !float_normal(1.0 / p->softcap)));
}

int npattn_blas_direct(const struct npattn_tensor *t, enum npattn_dtype dtype, int64_t rows, int64_t width,
                       int64_t *ld) {
    if (t->dtype != dtype || (width > 1 && t->col_stride != 1)) return 0;
    *ld = rows > 1 ? t->row_stride : (width > 1 ? width : 1);
    return *ld >= width && *ld >= 1 && *ld <= INT_MAX;
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

/* ---- the rules ---- */

/* The byte range [lo, hi] a tensor's elements span; 0 if it overflows int64. */
struct extent {
    int64_t lo, hi;
    int empty;
};

static int span(int64_t n, int64_t stride, struct extent *e) {
    int64_t reach;
    if (n <= 1) return 1;
    if (__builtin_mul_overflow(n - 1, stride, &reach)) return 0;
    return !__builtin_add_overflow(reach > 0 ? e->hi : e->lo, reach, reach > 0 ? &e->hi : &e->lo);
}

/* The extent of t over the batch shape and (heads, rows, cols) = dims, with
 * elements of `size` bytes. */
static int extent_of(const struct npattn_problem *p, const struct npattn_tensor *t, const int64_t dims[3],
                     int64_t size, struct extent *e) {
    e->lo = e->hi = 0;
    e->empty = 0;
    for (int32_t d = 0; d < p->n_batch_dim; d++) e->empty |= p->batch_shape[d] == 0;
    for (int i = 0; i < 3; i++) e->empty |= dims[i] == 0;
    if (e->empty) return 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++)
        if (!span(p->batch_shape[d], t->batch_stride[d], e)) return 0;
    const int64_t strides[3] = {t->head_stride, t->row_stride, t->col_stride};
    for (int i = 0; i < 3; i++)
        if (!span(dims[i], strides[i], e)) return 0;
    if (__builtin_mul_overflow(e->lo, size, &e->lo) || __builtin_mul_overflow(e->hi, size, &e->hi) ||
        __builtin_add_overflow(e->hi, size - 1, &e->hi))
        return 0;
    return 1;
}

/* Whether two tensors' byte ranges meet. */
static int meet(const void *a, const struct extent *ea, const void *b, const struct extent *eb) {
    if (ea->empty || eb->empty) return 0;
    intptr_t a0 = (intptr_t)a + (intptr_t)ea->lo, a1 = (intptr_t)a + (intptr_t)ea->hi;
    intptr_t b0 = (intptr_t)b + (intptr_t)eb->lo, b1 = (intptr_t)b + (intptr_t)eb->hi;
    return a0 <= b1 && b0 <= a1;
}

/* Whether distinct indices of t can reach the same element: with the axes
 * sorted by stride, each must step past everything the smaller ones span. */
static int overlaps_itself(const struct npattn_problem *p, const struct npattn_tensor *t, const int64_t dims[3]) {
    int64_t n[3 + 64], s[3 + 64];
    int k = 0;
    if (p->n_batch_dim > 64) return 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) {
        if (p->batch_shape[d] == 0) return 0;
        if (p->batch_shape[d] > 1) n[k] = p->batch_shape[d], s[k++] = llabs(t->batch_stride[d]);
    }
    const int64_t strides[3] = {t->head_stride, t->row_stride, t->col_stride};
    for (int i = 0; i < 3; i++) {
        if (dims[i] == 0) return 0;
        if (dims[i] > 1) n[k] = dims[i], s[k++] = llabs(strides[i]);
    }
    for (int i = 1; i < k; i++) /* insertion sort by stride */
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            int64_t tn = n[j], ts = s[j];
            n[j] = n[j - 1], s[j] = s[j - 1], n[j - 1] = tn, s[j - 1] = ts;
        }
    int64_t reach = 0; /* the farthest element the smaller axes reach */
    for (int i = 0; i < k; i++) {
        if (s[i] <= reach) return 1;
        reach += s[i] * (n[i] - 1);
    }
    return 0;
}

static int dtype_ok(enum npattn_dtype t) { return t >= NPATTN_DTYPE_F32 && t <= NPATTN_DTYPE_BF16; }

/* One operand of a problem, as the checks see it. */
struct operand {
    const struct npattn_tensor *t; /* NULL: the sinks (a plain array of n_head_q doubles) */
    const void *data;
    int given;                     /* read or written in this problem */
    int output;
    int64_t dims[3];               /* heads, rows, cols */
    int64_t size;                  /* bytes per element */
    struct extent e;
};

/* The rules every operand table keeps: batch strides, extents that fit int64,
 * data where something is read or written, and outputs that overlap neither
 * themselves, another output, nor an input. */
static enum npattn_status check_operands(const struct npattn_problem *p, struct operand *ops, int n, int empty) {
    for (int i = 0; i < n; i++) {
        struct operand *o = &ops[i];
        if (!o->given) continue;
        if (!o->t) {
            o->e.lo = 0, o->e.hi = o->size * o->dims[0] - 1, o->e.empty = o->dims[0] == 0;
            continue;
        }
        if (p->n_batch_dim > 0 && !o->t->batch_stride) return NPATTN_STATUS_INVALID;
        if (!extent_of(p, o->t, o->dims, o->size, &o->e)) return NPATTN_STATUS_INVALID;
    }
    if (empty) return NPATTN_STATUS_OK; /* nothing is read or written */
    for (int i = 0; i < n; i++)
        if (ops[i].given && !ops[i].e.empty && !ops[i].data) return NPATTN_STATUS_INVALID;
    if (p->n_embd_k > INT_MAX || p->n_embd_v > INT_MAX) return NPATTN_STATUS_TOO_LARGE;
    for (int i = 0; i < n; i++) {
        const struct operand *o = &ops[i];
        if (!o->given || !o->output) continue;
        if (o->t && overlaps_itself(p, o->t, o->dims)) return NPATTN_STATUS_INVALID;
        for (int j = 0; j < n; j++)
            if (j != i && ops[j].given && meet(o->data, &o->e, ops[j].data, &ops[j].e)) return NPATTN_STATUS_INVALID;
    }
    return NPATTN_STATUS_OK;
}

/* The scalar rules of a problem, and its operand table (8 entries). */
static enum npattn_status problem_operands(const struct npattn_problem *p, struct operand *ops, int *empty) {
    if (!p || p->n_batch_dim < 0 || (p->n_batch_dim > 0 && !p->batch_shape)) return NPATTN_STATUS_INVALID;
    int64_t n_batch = 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) {
        if (p->batch_shape[d] < 0) return NPATTN_STATUS_INVALID;
        if (__builtin_mul_overflow(n_batch, p->batch_shape[d], &n_batch)) return NPATTN_STATUS_INVALID;
    }
    if (p->n_head_q < 0 || p->n_head_kv < 1 || p->n_head_q % p->n_head_kv != 0) return NPATTN_STATUS_INVALID;
    if (p->n_query < 0 || p->n_key < 0 || p->n_embd_k < 1 || p->n_embd_v < 0) return NPATTN_STATUS_INVALID;
    if (!isfinite(p->scale) || !(p->softcap >= 0) || !isfinite(p->softcap)) return NPATTN_STATUS_INVALID;
    if (p->window_left < NPATTN_UNBOUNDED || p->window_right < NPATTN_UNBOUNDED) return NPATTN_STATUS_INVALID;
    if (p->mask_kind < NPATTN_MASK_NONE || p->mask_kind > NPATTN_MASK_ADD || p->n_threads < 0)
        return NPATTN_STATUS_INVALID;
    const int has_mask = p->mask_kind != NPATTN_MASK_NONE, has_out = p->n_embd_v > 0;
    const int has_lse = p->lse.data != NULL, has_w = p->weights.data != NULL;
    if (!dtype_ok(p->q.dtype) || !dtype_ok(p->k.dtype) || (has_out && (!dtype_ok(p->v.dtype) || !dtype_ok(p->out.dtype))) ||
        (p->mask_kind == NPATTN_MASK_ADD && !dtype_ok(p->mask.dtype)) || (has_w && !dtype_ok(p->weights.dtype)))
        return NPATTN_STATUS_INVALID;
    if (has_lse && p->lse.dtype != NPATTN_DTYPE_F32 && p->lse.dtype != NPATTN_DTYPE_F64) return NPATTN_STATUS_INVALID;
    const int64_t H_q = p->n_head_q, H_kv = p->n_head_kv, L = p->n_query, S = p->n_key, D = p->n_embd_k,
                  Dv = p->n_embd_v;
#define SIZE(t) ((int64_t)npattn_dtype_size((t).dtype))
    struct operand table[8] = {
        {&p->q, p->q.data, 1, 0, {H_q, L, D}, SIZE(p->q), {0, 0, 0}},
        {&p->k, p->k.data, 1, 0, {H_kv, S, D}, SIZE(p->k), {0, 0, 0}},
        {&p->v, p->v.data, has_out, 0, {H_kv, S, Dv}, SIZE(p->v), {0, 0, 0}},
        {&p->mask, p->mask.data, has_mask, 0, {H_q, L, S}, npattn_mask_size(p), {0, 0, 0}},
        {NULL, p->sinks, p->sinks != NULL, 0, {H_q, 1, 1}, (int64_t)sizeof(double), {0, 0, 0}},
        {&p->out, p->out.data, has_out, 1, {H_q, L, Dv}, SIZE(p->out), {0, 0, 0}},
        {&p->lse, p->lse.data, has_lse, 1, {H_q, L, 1}, SIZE(p->lse), {0, 0, 0}},
        {&p->weights, p->weights.data, has_w, 1, {H_q, L, S}, SIZE(p->weights), {0, 0, 0}},
    };
#undef SIZE
    memcpy(ops, table, sizeof table);
    *empty = n_batch == 0 || H_q == 0 || L == 0;
    return NPATTN_STATUS_OK;
}

enum npattn_status npattn_check(const struct npattn_problem *p) {
    struct operand ops[8];
    int empty;
    enum npattn_status status = problem_operands(p, ops, &empty);
    return status != NPATTN_STATUS_OK ? status : check_operands(p, ops, 8, empty);
}

enum npattn_status npattn_check_backward(const struct npattn_backward_problem *bp) {
    const struct npattn_problem *p = &bp->fwd;
    struct operand ops[13];
    int empty;
    enum npattn_status status = problem_operands(p, ops, &empty);
    if (status != NPATTN_STATUS_OK) return status;
    /* forward's results are inputs here, the weights are unused */
    ops[5].output = ops[6].output = 0;
    ops[7].given = 0;
    ops[5].given = ops[6].given = 1;
    if (!p->lse.data || (p->lse.dtype != NPATTN_DTYPE_F32 && p->lse.dtype != NPATTN_DTYPE_F64) ||
        !dtype_ok(p->out.dtype) || !dtype_ok(p->v.dtype) || !dtype_ok(bp->dout.dtype))
        return NPATTN_STATUS_INVALID;
    const enum npattn_dtype gd[3] = {bp->dq.dtype, bp->dk.dtype, bp->dv.dtype};
    for (int i = 0; i < 3; i++)
        if (gd[i] != NPATTN_DTYPE_F32 && gd[i] != NPATTN_DTYPE_F64) return NPATTN_STATUS_INVALID;
    const int64_t H_q = p->n_head_q, H_kv = p->n_head_kv, L = p->n_query, S = p->n_key, D = p->n_embd_k,
                  Dv = p->n_embd_v;
    int64_t n_batch = npattn_n_batch(p);
    const struct operand more[5] = {
        {&bp->dout, bp->dout.data, 1, 0, {H_q, L, Dv}, (int64_t)npattn_dtype_size(bp->dout.dtype), {0, 0, 0}},
        {&bp->dq, bp->dq.data, 1, 1, {H_q, L, D}, (int64_t)npattn_dtype_size(bp->dq.dtype), {0, 0, 0}},
        {&bp->dk, bp->dk.data, 1, 1, {H_kv, S, D}, (int64_t)npattn_dtype_size(bp->dk.dtype), {0, 0, 0}},
        {&bp->dv, bp->dv.data, 1, 1, {H_kv, S, Dv}, (int64_t)npattn_dtype_size(bp->dv.dtype), {0, 0, 0}},
        {NULL, bp->dsinks, p->sinks != NULL, 1, {n_batch * H_q, 1, 1}, (int64_t)sizeof(double), {0, 0, 0}},
    };
    memcpy(ops + 8, more, sizeof more);
    /* an empty batch or no query head: nothing is read or written */
    return check_operands(p, ops, 13, n_batch == 0 || H_q == 0);
}

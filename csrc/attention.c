/* attention.c: the driver. Checks a problem, cuts it into tiles, sizes the
 * scratch, and runs the tiles on the pool (pool.c). The tile itself is in
 * tile_impl.h, written once for float and double. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "blas.h"
#include "internal.h"
#include "kernels.h"

/* Tile sizes. OpenBLAS multiplies small matrices without packing them, much
 * faster, while rows * keys * width <= 1e6 (its small-matrix threshold), so
 * a tile of stacked query rows against a tile of keys aims just below it. */
#define TILE_FLOPS_BUDGET 1000000 /* rows * keys * max(D, D_v) per gemm */
#define TILE_ROW_ELEMS 8192       /* stacked query rows (heads x positions) times width */
#define TILE_ROWS_MIN 16
#define TILE_ROWS_MAX 128
#define TILE_QUERY_MAX 64         /* query positions per tile */
#define TILE_KEYS_MIN 16
#define TILE_KEYS_MAX 512
#define TILE_ELEMS (1 << 22)      /* cap on rows * width of one scratch matrix */
#define SPLIT_MIN_KEYS 1024       /* split-K only gives each part at least this many keys */
#define STREAM_ROWS 16            /* at most this many stacked rows stream */
#define STREAM_KEYS 64            /* keys per streamed tile: scores stay in L1 */

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

/* ---- statuses ---- */

const char *npattn_status_string(enum npattn_status status) {
    switch (status) {
    case NPATTN_STATUS_OK: return "success";
    case NPATTN_STATUS_NO_MEMORY: return "could not allocate scratch memory";
    case NPATTN_STATUS_CANCELLED: return "the call was cancelled";
    case NPATTN_STATUS_INVALID: return "the problem breaks a rule of attention.h";
    case NPATTN_STATUS_TOO_LARGE: return "a size exceeds what one BLAS call can take (INT_MAX)";
    case NPATTN_STATUS_NO_THREADS: return "could not start a worker thread";
    }
    return "unknown status";
}

/* ---- the plan shared by all tiles of one call ---- */

struct plan {
    const struct npattn_problem *p;
    int64_t n_batch;      /* product of the batch shape */
    int64_t group;        /* H_q / H_kv query heads per kv head */
    int64_t bq, n_qblock; /* query rows per tile, and blocks of them */
    int64_t bh, n_hblock; /* heads of a group per tile, and blocks of them */
    int64_t bk;           /* keys per tile */
    int64_t n_split;      /* tasks per unit, each over a share of the keys (split-K) */
    void *partials;       /* with split-K: (m, l, O) per task, merged afterwards */
    int stream;           /* decode-sized float tiles: streaming kernels instead of gemm */
    int64_t max_m;        /* bh * bq, the most stacked rows */
    int64_t ldk, ldv;     /* BLAS leading dimensions of k and v */
    size_t elem_size;     /* bytes per stored element of q, k, v, out */
    int causal;
    int64_t causal_offset; /* query i sees key j iff j <= i + causal_offset */
    char *scratch;
    size_t scratch_per_slot;
    atomic_int *cancel_seen; /* set once the call is cancelled */
};

struct offsets {
    int64_t q, k, v, out, mask;
};

/* Element offsets of flat batch index b in each operand. */
static void batch_offsets(const struct npattn_problem *p, int64_t b, struct offsets *o) {
    memset(o, 0, sizeof *o);
    for (int32_t d = p->n_batch_dim - 1; d >= 0; d--) {
        int64_t n = p->batch_shape[d];
        int64_t i = b % n;
        b /= n;
        o->q += i * p->q_batch_stride[d];
        o->k += i * p->k_batch_stride[d];
        o->v += i * p->v_batch_stride[d];
        o->out += i * p->out_batch_stride[d];
        if (p->mask_kind == NPATTN_MASK_BOOL || p->mask_kind == NPATTN_MASK_ADD)
            o->mask += i * p->mask_batch_stride[d];
    }
}

#define REAL float
#define REAL_MAX FLT_MAX
#define SFX f32
#define GEMM npattn_cblas_sgemm
#define SOFTMAX_COLS npattn_softmax_cols_f32
#define TILE_CONVERTS 1
#include "tile_impl.h"
#undef TILE_CONVERTS
#undef REAL
#undef REAL_MAX
#undef SFX
#undef GEMM
#undef SOFTMAX_COLS

#define REAL double
#define REAL_MAX DBL_MAX
#define SFX f64
#define GEMM npattn_cblas_dgemm
#define SOFTMAX_COLS npattn_softmax_cols_f64
#define TILE_CONVERTS 0
#include "tile_impl.h"
#undef TILE_CONVERTS
#undef REAL
#undef REAL_MAX
#undef SFX
#undef GEMM
#undef SOFTMAX_COLS

/* ---- the entry point ---- */

static void blas_single_threaded(void) { npattn_blas_set_num_threads(1); }
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

struct cancel_relay {
    int (*cancel)(void *);
    void *cancel_arg;
    atomic_int seen;
};

/* Polled by the waiting caller; also tells running tiles to stop early. */
static int relay_cancel(void *arg) {
    struct cancel_relay *c = arg;
    if (!c->cancel(c->cancel_arg)) return 0;
    atomic_store(&c->seen, 1);
    return 1;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Cheap re-checks of what the caller promised; the wrapper validated first. */
static enum npattn_status check(const struct npattn_problem *p) {
    if (p->dtype < NPATTN_DTYPE_F32 || p->dtype > NPATTN_DTYPE_BF16) return NPATTN_STATUS_INVALID;
    if (p->n_batch_dim < 0 || (p->n_batch_dim > 0 && !p->batch_shape)) return NPATTN_STATUS_INVALID;
    for (int32_t d = 0; d < p->n_batch_dim; d++)
        if (p->batch_shape[d] < 0) return NPATTN_STATUS_INVALID;
    if (p->n_head_q < 0 || p->n_head_kv < 1 || p->n_head_q % p->n_head_kv != 0) return NPATTN_STATUS_INVALID;
    if (p->n_query < 0 || p->n_key < 0 || p->n_embd_k < 1 || p->n_embd_v < 0) return NPATTN_STATUS_INVALID;
    if (p->n_threads < 1 || !isfinite(p->scale)) return NPATTN_STATUS_INVALID;
    if (p->mask_kind < NPATTN_MASK_NONE || p->mask_kind > NPATTN_MASK_ADD) return NPATTN_STATUS_INVALID;
    if (p->n_embd_k > INT_MAX || p->n_embd_v > INT_MAX) return NPATTN_STATUS_TOO_LARGE;
    return NPATTN_STATUS_OK;
}

enum npattn_status npattn_sdpa(const struct npattn_problem *p) {
    if (!p) return NPATTN_STATUS_INVALID;
    enum npattn_status status = check(p);
    if (status != NPATTN_STATUS_OK) return status;

    struct plan pl;
    memset(&pl, 0, sizeof pl);
    pl.p = p;
    pl.n_batch = 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) {
        int64_t n = p->batch_shape[d];
        if (n != 0 && pl.n_batch > INT64_MAX / n) return NPATTN_STATUS_TOO_LARGE;
        pl.n_batch *= n;
    }
    if (pl.n_batch == 0 || p->n_head_q == 0 || p->n_query == 0 || p->n_embd_v == 0)
        return NPATTN_STATUS_OK;  /* an empty result */

    int needs_mask = p->mask_kind == NPATTN_MASK_BOOL || p->mask_kind == NPATTN_MASK_ADD;
    if (!p->q || !p->k || !p->v || !p->out || (needs_mask && !p->mask)) return NPATTN_STATUS_INVALID;
    if (p->n_batch_dim > 0 && (!p->q_batch_stride || !p->k_batch_stride || !p->v_batch_stride ||
                               !p->out_batch_stride || (needs_mask && !p->mask_batch_stride)))
        return NPATTN_STATUS_INVALID;

    /* BLAS reads k and v rows in place: a positive leading dimension that fits an int. */
    pl.ldk = p->n_key > 1 ? p->k_row_stride : p->n_embd_k;
    pl.ldv = p->n_key > 1 ? p->v_row_stride : max64(p->n_embd_v, 1);
    if (pl.ldk < p->n_embd_k || pl.ldv < p->n_embd_v) return NPATTN_STATUS_INVALID;
    if (pl.ldk > INT_MAX || pl.ldv > INT_MAX) return NPATTN_STATUS_TOO_LARGE;

    pl.group = p->n_head_q / p->n_head_kv;
    pl.causal = p->mask_kind == NPATTN_MASK_CAUSAL || p->mask_kind == NPATTN_MASK_CAUSAL_TOP_LEFT;
    pl.causal_offset = p->mask_kind == NPATTN_MASK_CAUSAL ? p->n_key - p->n_query : 0;

    /* Tile: stack a whole group's heads when it fits, query rows to fill the
     * rest; keys to fill the small-gemm budget; smaller for very wide rows so
     * that scratch stays bounded. */
    int64_t width = max64(p->n_embd_k, p->n_embd_v);
    int64_t rows = min64(TILE_ROWS_MAX, max64(TILE_ROWS_MIN, TILE_ROW_ELEMS / width));
    rows = max64(1, min64(rows, TILE_ELEMS / max64(width, TILE_KEYS_MAX)));
    pl.bh = min64(pl.group, rows);
    pl.bq = max64(1, rows / pl.bh);
    /* stacked rows a multiple of 16 (whole SIMD vectors) where that is possible */
    int64_t unit = 16;
    for (int64_t h = pl.bh; h % 2 == 0 && unit > 1; h /= 2) unit /= 2;
    if (pl.bq >= unit) pl.bq = pl.bq / unit * unit;
    /* at most 64 query positions per tile: the diagonal tiles of a causal
     * mask waste about bq / L of the work */
    pl.bq = min64(p->n_query, min64(pl.bq, TILE_QUERY_MAX));
    pl.n_hblock = (pl.group + pl.bh - 1) / pl.bh;
    pl.n_qblock = (p->n_query + pl.bq - 1) / pl.bq;
    pl.max_m = pl.bh * pl.bq;
    pl.bk = TILE_FLOPS_BUDGET / (pl.max_m * width) / 16 * 16;
    pl.bk = min64(TILE_KEYS_MAX, max64(TILE_KEYS_MIN, pl.bk));

    int64_t n_unit = pl.n_batch;
    if (n_unit > INT64_MAX / p->n_head_kv / pl.n_hblock / pl.n_qblock) return NPATTN_STATUS_TOO_LARGE;
    n_unit *= p->n_head_kv * pl.n_hblock * pl.n_qblock;

    /* A few stacked rows (decode) make gemms that are all overhead: stream
     * each key and value row once through the SIMD kernels instead. */
    pl.stream = p->dtype != NPATTN_DTYPE_F64 && pl.max_m <= STREAM_ROWS && npattn_stream_available();
    if (pl.stream) pl.bk = STREAM_KEYS;

    /* Split-K when there are fewer units than threads (decode with few heads):
     * each part of a unit's keys is a task, merged by log-sum-exp. */
    pl.n_split = 1;
    if (n_unit < p->n_threads && p->n_key >= 2 * SPLIT_MIN_KEYS) {
        int64_t want = (2 * (int64_t)p->n_threads + n_unit - 1) / n_unit;
        pl.n_split = max64(1, min64(want, p->n_key / SPLIT_MIN_KEYS));
    }
    int64_t n_task = n_unit * pl.n_split;

    int f64 = p->dtype == NPATTN_DTYPE_F64;
    pl.elem_size = f64 ? 8 : p->dtype == NPATTN_DTYPE_F32 ? 4 : 2;
    size_t real = f64 ? sizeof(double) : sizeof(float);
    /* Q^T, scores^T, O^T, m, l, alpha, a row; converted K and V tiles */
    int64_t per_slot_elems = pl.max_m * (p->n_embd_k + pl.bk + p->n_embd_v + 3) + width;
    if (pl.elem_size == 2) per_slot_elems += pl.bk * (p->n_embd_k + p->n_embd_v);
    size_t per_slot = (size_t)per_slot_elems * real;
    pl.scratch_per_slot = (per_slot + 63) / 64 * 64;
    int32_t n_slot = (int32_t)min64(min64(p->n_threads, NPATTN_POOL_MAX_THREADS), n_task);
    if ((size_t)n_slot > SIZE_MAX / pl.scratch_per_slot) return NPATTN_STATUS_NO_MEMORY;
    pl.scratch = npattn_alloc(pl.scratch_per_slot * (size_t)n_slot);
    if (!pl.scratch) return NPATTN_STATUS_NO_MEMORY;
    if (pl.n_split > 1) {
        /* n_task < 2 * n_threads + n_unit here: small */
        pl.partials = npattn_alloc((size_t)(n_task * pl.max_m * (p->n_embd_v + 2)) * real);
        if (!pl.partials) {
            npattn_free(pl.scratch);
            return NPATTN_STATUS_NO_MEMORY;
        }
    }

    pthread_once(&blas_once, blas_single_threaded);

    struct cancel_relay relay = {p->cancel, p->cancel_arg, 0};
    pl.cancel_seen = p->cancel ? &relay.seen : NULL;
    npattn_task_fn fn = f64 ? run_tile_f64 : run_tile_f32;
    status = npattn_pool_run(fn, &pl, n_task, n_slot, p->cancel ? relay_cancel : NULL, &relay);
    if (status == NPATTN_STATUS_OK && pl.n_split > 1) {
        fn = f64 ? merge_f64 : merge_f32;
        status = npattn_pool_run(fn, &pl, n_unit, (int32_t)min64(n_slot, n_unit), p->cancel ? relay_cancel : NULL,
                                 &relay);
    }

    npattn_free(pl.partials);
    npattn_free(pl.scratch);
    return status;
}

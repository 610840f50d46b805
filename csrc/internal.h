/* internal.h: what the core's files share and nobody else sees. */
#ifndef NPATTN_INTERNAL_H
#define NPATTN_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "hooks.h"

struct npattn_dequant; /* kernels/kernels.h */

/* ---- core.c: checked allocation (with the test hook), batch offsets, the BLAS ---- */
/* (rules.c checks the rules of attention.h: npattn_check, npattn_check_backward) */

void *npattn_alloc(size_t n_bytes); /* 64-byte aligned, NULL on failure */
void npattn_free(void *p);
/* The same for a large block a call uses and gives back (the key tiles a
 * prefill's units share), of at most NPATTN_KEPT_MAX bytes: *n_bytes asked
 * for, then the block's size (the kept block may be larger), which
 * npattn_free_kept(p, that size) takes back. It keeps the largest such block
 * for the next call, so that its pages need not be faulted in and zeroed
 * again (glibc maps a block of 32 MiB or more afresh each time: on 16
 * threads that was a quarter to a third of a float16 prefill). */
#define NPATTN_KEPT_MAX ((size_t)256 << 20)
void *npattn_alloc_kept(size_t *n_bytes);
void npattn_free_kept(void *p, size_t n_bytes);

/* Product of the batch shape (checked by npattn_check not to overflow). */
int64_t npattn_n_batch(const struct npattn_problem *p);

/* Element offset of flat batch index b in an operand. */
int64_t npattn_batch_offset(const struct npattn_problem *p, const struct npattn_tensor *t, int64_t b);

/* Bytes per element. */
size_t npattn_dtype_size(enum npattn_dtype dtype);

/* Makes OpenBLAS single-threaded, once: the pool does the threading. */
void npattn_blas_init(void);

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- plan.c: what the forward and backward planners share ---- */

/* Helpers join a call only from `wake` flops of work on: below it their
 * wake-up and the tasks' handover cost more than sharing saves (a few µs,
 * as much as such a call's whole work). Past it, one thread per grain of
 * flops. Tiles (prefill, backward) and split decodes, whose parts are
 * merged, take NPATTN_WAKE and NPATTN_GRAIN; a decode's units, a task each
 * with nothing to merge, are cheaper to hand over. */
#define NPATTN_WAKE 8.0e5
#define NPATTN_GRAIN 4.0e5
#define NPATTN_WAKE_STREAM 5.0e5
#define NPATTN_GRAIN_STREAM 1.0e5

/* The threads a driver plans its split for, and the threads that run it
 * (more only in pool mode 2). */
struct npattn_threads {
    int32_t plan, run;
};

/* The threads `flops` of work repays: from `wake` on, `want` (at least 2),
 * at most n_threads resolved (0: the default). The same work and n_threads
 * always give the same plan, whatever threads actually start. */
struct npattn_threads npattn_plan_threads(double flops, double wake, double want, int32_t n_threads);

/* Whether the problem computes in double: float64 results, and a scale or cap
 * that float cannot hold as a normal number. */
int npattn_computes_f64(const struct npattn_problem *p, enum npattn_dtype result);

/* Whether BLAS can read t's rows (rows of `width`) in place, computing in
 * `dtype`; sets *ld, their leading dimension. */
int npattn_blas_direct(const struct npattn_tensor *t, enum npattn_dtype dtype, int64_t rows, int64_t width,
                       int64_t *ld);

/* Hands out `bytes` (rounded up to 64) of a scratch layout at *at. */
static inline size_t npattn_take(size_t *at, size_t bytes) {
    size_t off = *at;
    *at += (bytes + 63) / 64 * 64;
    return off;
}

struct npattn_run; /* pool.c's, below */

/* A driver's per-slot scratch: n slots of `size` bytes (a multiple of 64),
 * and for a float problem a table of per-slot double scratch of exact_size
 * bytes, made when first needed. */
struct npattn_slots {
    char *scratch;
    size_t size;
    char **exact;      /* NULL for a double problem */
    size_t exact_size;
    int32_t n;
};
/* NO_MEMORY (nothing held) or OK; exact_size 0: a double problem. */
enum npattn_status npattn_slots_alloc(struct npattn_slots *s, int32_t n, size_t size, size_t exact_size);
void npattn_slots_free(struct npattn_slots *s);
static inline char *npattn_slot(const struct npattn_slots *s, int32_t slot) { return s->scratch + (size_t)slot * s->size; }

/* One task of a driver, computed in double for a double problem; else in
 * float, and when the float task met an extreme (it returns 1), again from a
 * clean start in double, in the slot's double scratch. */
typedef int (*npattn_tile_fn)(void *plan, int64_t task, int32_t slot, char *scratch);
void npattn_run_exact(void *plan, int64_t task, int32_t slot, struct npattn_slots *s, npattn_tile_fn in_f32,
                      npattn_tile_fn in_f64, struct npattn_run *run);

/* ---- core.c: what the forward and backward tiles share ---- */

/* Element [b, h, i, 0] of t, b given by its offset, elements of `size` bytes. */
static inline char *npattn_elem(const struct npattn_tensor *t, int64_t size, int64_t off, int64_t h, int64_t i) {
    return (char *)t->data + (off + h * t->head_stride + i * t->row_stride) * size;
}

/* Where the scales (or zero points) of codes lie, row by row as their
 * rows do (struct npattn_kv): row j's at base + j * row_bytes, or through
 * the pages, page_bytes apart; head_bytes from one kv head's to the next's. */
struct npattn_kv_groups {
    const char *base;      /* dense: row 0's; paged: the head's row 0 in page 0; NULL: none */
    int64_t row_bytes, page_bytes, head_bytes;
};

/* The key (or value) rows of one kv head of one request: dense, row j at
 * base + j * row_bytes; paged, through the request's row of the block table
 * (table NULL when dense). Codes: dq says how they stand for values, and
 * scale and zero where each row's groups are. */
struct npattn_kv {
    const char *base;      /* dense: row 0; paged: row 0 of the head in page 0 */
    int64_t row_bytes;
    const int64_t *table;  /* the request's max_pages entries, or NULL */
    int64_t page_size, page_bytes;
    const struct npattn_dequant *dq;     /* NULL: float rows */
    struct npattn_kv_groups scale, zero;
};

/* Request b's row of a paged problem's block table. */
static inline const int64_t *npattn_table_row(const struct npattn_pages *pg, int64_t b) {
    return pg->block_table + b * (pg->table_stride ? pg->table_stride : pg->max_pages);
}

/* Row j's address, and in *run how many rows from j on lie row_bytes apart
 * (to the end of its page; INT64_MAX when dense). */
static inline const char *npattn_kv_row(const struct npattn_kv *kv, int64_t j, int64_t *run) {
    if (!kv->table) {
        *run = INT64_MAX;
        return kv->base + j * kv->row_bytes;
    }
    const int64_t page = j / kv->page_size, r = j % kv->page_size;
    *run = kv->page_size - r;
    return kv->base + kv->table[page] * kv->page_bytes + r * kv->row_bytes;
}

/* Row j's scales (or zero points, g) of kv's codes, as npattn_kv_row
 * walks row j; NULL where g has none. */
static inline const char *npattn_kv_groups_row(const struct npattn_kv *kv, const struct npattn_kv_groups *g, int64_t j) {
    if (!g->base) return NULL;
    if (!kv->table) return g->base + j * g->row_bytes;
    return g->base + kv->table[j / kv->page_size] * g->page_bytes + j % kv->page_size * g->row_bytes;
}

/* bfloat16 rows j0 + 2p and j0 + 2p + 1 of kv (w wide; the second zeros
 * past nk) as row p of out (ldo apart, zeros past w), the pairs of the dot
 * products along the keys; with out NULL, only the check. Returns 0 when a
 * value is subnormal. */
int npattn_pairs_of_kv(const struct npattn_kv *kv, int64_t j0, int64_t nk, int64_t w, uint32_t *out, int64_t ldo);

/* The pairs along the rows of t's stacked rows r = 0 .. M-1 (head h0 + r /
 * nq, row i0 + r % nq, w values each), as the dot products take Q^T and
 * dO^T: out[c * ldo + r] = values 2c and 2c + 1 of row r, zeros for M <= r
 * < ldo. A bfloat16 t's 32-bit words transposed as stored, a head's rows at
 * a time; returns 0 (out unspecified) unless t is bfloat16 with rows of
 * whole words, a head has a block of the transpose's rows, and no value
 * is subnormal: the caller then pairs the rows as rounded floats. Loading,
 * rounding and pairing them was 7% of a bfloat16 prefill. */
int npattn_word_pairs(const struct npattn_tensor *t, int64_t off, int64_t h0, int64_t i0, int64_t nq, int64_t M,
                      int64_t w, uint32_t *out, int64_t ldo);

/* Bytes per element of the mask (a bool mask's are uint8). */
static inline int64_t npattn_mask_size(const struct npattn_problem *p) {
    return p->mask_kind == NPATTN_MASK_BOOL ? 1 : (int64_t)npattn_dtype_size(p->mask.dtype);
}

/* ---- pool.c: the calling thread and helper threads run the tasks of a job ---- */

/* The most threads one job runs on: the most a problem may ask for. */
#define NPATTN_POOL_MAX_THREADS NPATTN_MAX_THREADS

/* One call's shared state, polled by its tiles. */
struct npattn_run {
    atomic_int stop;       /* set on cancel, failure or exit: no new tile starts */
    atomic_int status;     /* the first failure, or NPATTN_STATUS_OK */
    int (*cancel)(void *); /* polled by the calling thread only */
    void *cancel_arg;
    int64_t next_poll_ns;  /* when the calling thread next polls cancel */
};

void npattn_run_init(struct npattn_run *run, int (*cancel)(void *), void *cancel_arg);

/* Whether a tile should give up now. Slot 0, the calling thread, also polls
 * the cancel callback about every 50 ms. */
int npattn_run_stopped(struct npattn_run *run, int32_t slot);

/* Records a failure (the first one wins) and stops the run. */
void npattn_run_fail(struct npattn_run *run, enum npattn_status status);

/* Split-K's count of each unit's tasks not yet done: n_unit counts of n_split. */
static inline void npattn_parts_init(_Atomic int64_t *left, int64_t n_unit, int64_t n_split) {
    for (int64_t i = 0; i < n_unit; i++) atomic_init(&left[i], n_split);
}

/* Counts one of a unit's tasks done: whether it was the unit's last and the
 * run goes on, so that this task finishes the unit (merges its parts). */
static inline int npattn_part_done(_Atomic int64_t *left, struct npattn_run *run) {
    return atomic_fetch_sub(left, 1) == 1 && !atomic_load_explicit(&run->stop, memory_order_relaxed);
}

/* Runs task `task` on the participant `slot` (0 .. n_threads-1, 0 being the
 * calling thread); a slot is held by one thread at a time, so it can index
 * per-thread scratch. */
typedef void (*npattn_task_fn)(void *arg, int64_t task, int32_t slot);

/* Runs tasks 0 .. n_task-1, each once, handed out in index order (so put the
 * longest first), on the calling thread and at most n_threads - 1 helpers,
 * and returns the run's status. With n_threads <= 1 no helper is involved.
 * If no helper can start, the calling thread runs every task. */
enum npattn_status npattn_pool_run(npattn_task_fn fn, void *arg, int64_t n_task, int32_t n_threads,
                                   struct npattn_run *run);

/* n_threads of a problem resolved: 0 becomes NPATTN_NUM_THREADS where it is
 * set and valid, else the default thread count. */
int32_t npattn_pool_threads(int32_t n_threads);

/* NPATTN_NUM_THREADS: its value (1 .. NPATTN_MAX_THREADS), 0 where it is not
 * set, -1 where it is set to anything else (rules.c refuses that). Read on
 * each call, as the environment may change between calls. */
int32_t npattn_env_threads(void);

/* The test hook's mode (npattn_debug_pool_mode). */
int npattn_pool_mode(void);

#endif /* NPATTN_INTERNAL_H */

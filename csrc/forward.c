/* forward.c: the forward driver. npattn_sdpa (at the end) checks a problem
 * and plans it in named stages: the tiles (gemm or stream), the paths of
 * the two products (enum qk_path, enum pv_path), the work and the threads
 * it repays, the split, and the memory; then it runs the tasks (tile_fwd.h,
 * written once for float and double) on the calling thread and the pool. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "band.h"
#include "blas.h"
#include "internal.h"
#include "kernels/kernels.h"

/* Tile sizes. OpenBLAS multiplies small matrices without packing them, much
 * faster, while rows * keys * width <= 1e6 (its small-matrix threshold), so
 * a tile of stacked query rows against a tile of keys aims just below it.
 * The SIMD tables' own float products (gemm_f32) ran best at the same
 * budget (0.5e6 and 2e6 measured 0-8% slower on AVX2 and AVX-512). */
#define TILE_FLOPS_BUDGET 1000000 /* rows * keys * max(D, D_v) per gemm */
#define TILE_ROW_ELEMS 8192       /* stacked query rows (heads x positions) times width */
#define TILE_ROWS_MIN 16
#define TILE_ROWS_MAX 128
#define TILE_QUERY_MAX 64         /* query positions per tile: diagonal tiles waste about bq / L */
#define QBLOCK_MIN 8              /* the fewest query positions a tile is cut to, for more threads */
#define TILE_KEYS_MIN 16
#define TILE_KEYS_MAX 512
#define TILE_ELEMS (1 << 22)      /* cap on rows * width of one scratch matrix */
#define STREAM_ROWS 32            /* at most this many stacked rows stream (decode, small prefills) */
#define STREAM_SCORES 4096        /* a streamed tile's scores (rows x keys): 16 KiB, in L1 */
#define STREAM_KEYS 256           /* keys per streamed tile: its scores stay in L1; a softmax row per 256 keys, not 64 */
#define SPLIT_MIN_KEYS 256        /* split-K gives each part at least this many keys */
#define MERGE_PARTS 8             /* split-K over several kv heads per unit: at most this many parts */
#define HEAD_RUN_BYTES 32768      /* a kv head's rows read at about the memory's streaming rate when this many lie together */
#define ROUND_KEYS 64             /* keys per round of a paged unit's kv heads (kv_rounds): rounds of 32, 64, 128 and 256
                                     keys (the tile) ran Qwen3-4B heads over pages of 16 rows at 0.95, 0.99, 0.97 and
                                     0.79 of the dense call (float32, 8 requests, 2 threads) */

/* How a tile's scores, QK^T, are computed: the path plan_products picks
 * for the call. A task takes a plainer one where its operands need it
 * (a subnormal value, which a bfloat16 pair would read as 0), and the
 * double copy of a task always takes QK_PATH_GEMM. */
enum qk_path {
    QK_PATH_GEMM,           /* a gemm in the computed type, K's rows in place or converted */
    QK_PATH_STREAM,         /* decode-sized float tiles: the table's streaming scores, K's rows as stored */
    QK_PATH_STREAM_Q_TILES, /* the same against a bfloat16 K in place, q's rows as the table's tiles (q_tiles) */
    QK_PATH_BF16,           /* bfloat16 q and k: the table's bfloat16 dot products (scores_bf16), K's rows in place */
    QK_PATH_SPLIT_F16,      /* float16 q and k: each value split in two bfloat16 ones, the four dot products */
};

/* How P @ V is computed: the same for the weights and V. */
enum pv_path {
    PV_PATH_GEMM,        /* a gemm in the computed type */
    PV_PATH_STREAM,      /* the table's streaming accumulate, V's rows as stored */
    PV_PATH_STREAM_BF16, /* "fast", bfloat16 v, streamed: P's rows as bfloat16, the table's accumulate_pairs */
    PV_PATH_BF16,        /* "fast", bfloat16 v: P's and V's pairs, the table's accumulate_bf16 */
    PV_PATH_BF16_TILES,  /* the same, P's pairs made as A tiles by the table's softmax (softmax_tiles_f32) */
    PV_PATH_SPLIT_F16,   /* "fast", float16 v after QK_PATH_SPLIT_F16: P and V split in two (split_tiles) */
    PV_PATH_EXACT_BF16,  /* "highest", bfloat16 v: each weight as three bfloat16 parts (exact_tiles) */
    PV_PATH_BF16_STEP,   /* "fast", bfloat16 q, k, v: the whole step in the table's prefill_tiles_bf16 (QK^T by rows
                            against K's pairs as B tiles, the softmax, P @ V), software-pipelined */
};

/* Whether scores stream (by rows, in L1) rather than fill a gemm's tile. */
static inline int qk_streams(enum qk_path qk) { return qk == QK_PATH_STREAM || qk == QK_PATH_STREAM_Q_TILES; }

/* Whether P @ V takes the pairs of V's tiles (bfloat16 dot products on tiles). */
static inline int pv_tiles(enum pv_path pv) {
    return pv == PV_PATH_BF16 || pv == PV_PATH_BF16_TILES || pv == PV_PATH_SPLIT_F16 || pv == PV_PATH_EXACT_BF16 ||
           pv == PV_PATH_BF16_STEP;
}

/* Byte offsets of one slot's scratch regions. */
struct layout {
    size_t qt, qrows, st, ot, m, l, alpha, row, kt, vt, bias, lo, hi, qp, pp, vp, spans, size;
};

/* The call's copies of the key tiles of each request's kv heads: n tiles of
 * `bytes`, then a state per tile: 0 not made, 1 being made, 2 ready. */
struct shared_tiles {
    char *data;
    _Atomic signed char *state;
    size_t bytes;
};

struct fwd_plan {
    const struct npattn_problem *p;
    struct npattn_band band;
    struct npattn_run run;
    int f64;                      /* computed in double */
    int64_t n_batch;              /* the batch's entries */
    int64_t group;                /* H_q / H_kv query heads per kv head */
    int64_t bq, n_qblock;         /* query rows per unit, and blocks of them */
    int64_t bh, n_hblock;         /* heads of a group per unit, and blocks of them */
    int64_t bg, n_gblock;         /* kv heads per unit (decode of interleaved heads: several), and blocks of them */
    int64_t bk;                   /* keys per tile */
    int64_t max_m;                /* bg * bh * bq: the most stacked rows */
    int64_t n_unit, n_split;      /* units, and tasks per unit (split-K) */
    enum qk_path qk;              /* the call's QK^T */
    enum pv_path pv;              /* and P @ V */
    int k_direct, v_direct;       /* BLAS, or the streaming kernels, read K / V in place */
    int64_t ldq2, ldv2;           /* pairs: of Q^T and P (rows ldq2 apart), and of V (ldv2) */
    int64_t ldpa;                 /* P's pairs as A tiles (softmax_tiles_f32, split_tiles, exact_tiles), per row */
    _Atomic signed char *k_normal, *v_normal; /* bfloat16 pairs, per request and kv head: 0 not yet known, 1 no
                                                 subnormal value, -1 some */
    /* a kv head's keys met by several units: per key tile, made once
     * (shared_tile) in one block of at most NPATTN_KEPT_MAX bytes (else
     * none): V's pairs for pv_tiles (its split rows for PV_PATH_SPLIT_F16),
     * K's split rows for QK_PATH_SPLIT_F16, K's and V's rows as float where
     * the float gemms cannot read them in place, K's pairs as B tiles for
     * PV_PATH_BF16_STEP */
    struct shared_tiles v_tiles, k_split, k_rows, v_rows, k_tiles;
    char *shared;                 /* their block (npattn_alloc_kept), shared_bytes long; NULL: none */
    size_t shared_bytes;
    int64_t n_ktile;              /* then: key tiles per request and kv head */
    int64_t ldk, ldv;             /* K's and V's leading dimensions where read in place */
    int64_t k_page_bytes, v_page_bytes; /* paged: bytes from one page to the next */
    struct npattn_dequant k_dq, v_dq; /* codes: how K's and V's stand for values (dequant_of) */
    int64_t out_size;             /* bytes per element of out */
    struct layout lay, lay64;     /* a slot's scratch in the computed type, and in double */
    struct npattn_slots slots;    /* lay.size bytes each; lay64.size in double when a float task needs it */
    double *partials;             /* split-K: (lse, O / l) per task */
    _Atomic int64_t *parts_left;  /* split-K: per unit, its tasks not yet done (after the partials) */
    struct request_rank *rank;    /* requests of their own lengths: longest first (units in that order); else NULL */
};

/* A request and the keys its rows see, summed over its query blocks. */
struct request_rank {
    int64_t keys, b;
};

/* More keys first; of equal keys, the lower request. */
static int by_keys(const void *x, const void *y) {
    const struct request_rank *a = x, *b = y;
    if (a->keys != b->keys) return a->keys > b->keys ? -1 : 1;
    return (a->b > b->b) - (a->b < b->b);
}

/* Where a unit's rows are. */
struct unit {
    int64_t b, g, ng, i0, nq, h0, nh, M; /* request, first kv head and kv heads, first row and rows, first query
                                           head and heads, stacked rows (those of each kv head in turn) */
    struct npattn_band band;      /* its request's band */
    int64_t k0, k1;               /* the request's range of keys */
    int64_t j0, j1;               /* keys the band and the request's range let some row see */
    const int64_t *table;         /* paged: the request's row of the block table; else NULL */
    int64_t off_q, off_k, off_v, off_out, off_mask, off_lse, off_weights; /* batch offsets, in elements */
    int64_t off_ks, off_kz, off_vs, off_vz; /* and of codes' scales and zero points */
};


/* Keys [*j0, *j1) that some row of [i0, i1) may see: the band's, within [k0, k1). */
static void unit_keys(const struct npattn_band *band, int64_t i0, int64_t i1, int64_t k0, int64_t k1, int64_t S,
                      int64_t *j0, int64_t *j1) {
    npattn_band_keys(band, i0, i1, S, j0, j1);
    *j0 = max64(*j0, k0), *j1 = min64(*j1, k1);
    if (*j0 >= *j1) *j0 = *j1 = 0;
}

/* Query blocks of bq positions: their count, the stacked rows, the units. */
static void query_blocks(struct fwd_plan *pl, int64_t bq) {
    pl->bq = bq;
    pl->n_qblock = (pl->p->n_query + bq - 1) / bq;
    pl->max_m = pl->bh * bq;
    pl->n_unit = pl->n_batch * pl->n_gblock * pl->n_hblock * pl->n_qblock;
}

/* The visible (query row, key) pairs of one kv head's group member over the
 * call's units, with each unit's keys summed, the most one unit sees, and
 * the requests ranked by their keys, longest first (pl->rank, if any). */
static double count_work(struct fwd_plan *pl, int64_t n_request, double *unit_keys_sum, int64_t *most_keys) {
    const struct npattn_problem *p = pl->p;
    double pairs = 0;
    *unit_keys_sum = 0, *most_keys = 0;
    for (int64_t b = 0; b < n_request; b++) {
        int64_t k0, k1;
        const struct npattn_band band = npattn_band_request(p, &pl->band, b, &k0, &k1);
        if (pl->rank) pl->rank[b] = (struct request_rank){0, b};
        for (int64_t qb = 0; qb < pl->n_qblock; qb++) {
            int64_t i0 = qb * pl->bq, nq = min64(pl->bq, p->n_query - i0), j0, j1;
            unit_keys(&band, i0, i0 + nq, k0, k1, p->n_key, &j0, &j1);
            pairs += (double)nq * (double)(j1 - j0);
            *unit_keys_sum += (double)(j1 - j0);
            *most_keys = max64(*most_keys, j1 - j0);
            if (pl->rank) pl->rank[b].keys += j1 - j0;
        }
    }
    if (pl->rank) qsort(pl->rank, (size_t)n_request, sizeof *pl->rank, by_keys);
    return pairs;
}

static void locate(const struct fwd_plan *pl, int64_t unit, struct unit *u) {
    const struct npattn_problem *p = pl->p;
    /* Units of one kv head run back to back, so its K and V stay in cache;
     * within it, largest first: the last query blocks see the most keys
     * under a causal mask. Requests of their own lengths run longest first,
     * so that the threads finish together. */
    int64_t qb = pl->n_qblock - 1 - unit % pl->n_qblock, rest = unit / pl->n_qblock;
    int64_t hb = rest % pl->n_hblock;
    rest /= pl->n_hblock;
    const int64_t b = u->b = pl->rank ? pl->rank[rest / pl->n_gblock].b : rest / pl->n_gblock;
    u->g = rest % pl->n_gblock * pl->bg;
    u->ng = min64(pl->bg, p->n_head_kv - u->g);
    u->i0 = qb * pl->bq;
    u->nq = min64(pl->bq, p->n_query - u->i0);
    u->h0 = u->g * pl->group + hb * pl->bh;
    /* several kv heads: each with its whole group (bh is the group) */
    u->nh = u->ng * min64(pl->bh, pl->group - hb * pl->bh);
    u->M = u->nh * u->nq;
    u->band = npattn_band_request(p, &pl->band, b, &u->k0, &u->k1);
    unit_keys(&u->band, u->i0, u->i0 + u->nq, u->k0, u->k1, p->n_key, &u->j0, &u->j1);
    u->off_q = npattn_batch_offset(p, &p->q, b);
    /* paged K/V have no batch dims: the block table says where rows are */
    u->table = p->pages ? npattn_table_row(p->pages, b) : NULL;
    u->off_k = p->pages ? 0 : npattn_batch_offset(p, &p->k, b);
    u->off_v = p->n_embd_v > 0 && !p->pages ? npattn_batch_offset(p, &p->v, b) : 0;
    u->off_ks = u->off_kz = u->off_vs = u->off_vz = 0;
    if (!p->pages && npattn_is_code(p->k.dtype)) {
        u->off_ks = npattn_batch_offset(p, &p->k_codes.scale, b);
        if (p->k_codes.zero.data) u->off_kz = npattn_batch_offset(p, &p->k_codes.zero, b);
    }
    if (!p->pages && p->n_embd_v > 0 && npattn_is_code(p->v.dtype)) {
        u->off_vs = npattn_batch_offset(p, &p->v_codes.scale, b);
        if (p->v_codes.zero.data) u->off_vz = npattn_batch_offset(p, &p->v_codes.zero, b);
    }
    u->off_out = p->n_embd_v > 0 ? npattn_batch_offset(p, &p->out, b) : 0;
    u->off_mask = p->mask_kind != NPATTN_MASK_NONE ? npattn_batch_offset(p, &p->mask, b) : 0;
    u->off_lse = p->lse.data ? npattn_batch_offset(p, &p->lse, b) : 0;
    u->off_weights = p->weights.data ? npattn_batch_offset(p, &p->weights, b) : 0;
}

/* The weight of stacked row r of u for key j. */
static inline char *weight_ptr(const struct npattn_problem *p, const struct unit *u, int64_t r, int64_t j) {
    int64_t size = (int64_t)npattn_dtype_size(p->weights.dtype);
    return npattn_elem(&p->weights, size, u->off_weights, u->h0 + r / u->nq, u->i0 + r % u->nq) +
           j * p->weights.col_stride * size;
}

static inline void store_lse(const struct npattn_problem *p, int64_t off, int64_t h, int64_t i, double lse) {
    char *at = npattn_elem(&p->lse, (int64_t)npattn_dtype_size(p->lse.dtype), off, h, i);
    if (p->lse.dtype == NPATTN_DTYPE_F64) *(double *)at = lse;
    else *(float *)at = (float)lse;
}

/* Where the scales (or zero points, t) of kv head g's rows are, batch
 * offset off; paged, page_stride elements from one page to the next. */
static struct npattn_kv_groups kv_groups(const struct npattn_tensor *t, int64_t off, int64_t g, int64_t page_stride) {
    const int64_t es = (int64_t)npattn_dtype_size(t->dtype);
    struct npattn_kv_groups kg = {npattn_elem(t, es, off, g, 0), t->row_stride * es, page_stride * es,
                                  t->head_stride * es};
    return kg;
}

/* The rows of k or v (t) that unit u reads, of its first kv head (none
 * unless `reads`), with their scales and zero points where they are codes. */
static struct npattn_kv kv_of(const struct fwd_plan *pl, const struct unit *u, const struct npattn_tensor *t, int reads,
                              int64_t page_bytes) {
    const struct npattn_problem *p = pl->p;
    const int is_k = t == &p->k;
    const int64_t es = (int64_t)npattn_dtype_size(t->dtype), off = is_k ? u->off_k : u->off_v;
    struct npattn_kv kv = {.base = reads ? npattn_elem(t, es, off, u->g, 0) : NULL, .row_bytes = t->row_stride * es,
                           .page_size = 1};
    if (reads && u->table) kv.table = u->table, kv.page_size = p->pages->page_size, kv.page_bytes = page_bytes;
    if (reads && npattn_is_code(t->dtype)) {
        const struct npattn_codes *c = is_k ? &p->k_codes : &p->v_codes;
        kv.dq = is_k ? &pl->k_dq : &pl->v_dq;
        kv.scale = kv_groups(&c->scale, is_k ? u->off_ks : u->off_vs, u->g, c->scale_page_stride);
        if (c->zero.data) kv.zero = kv_groups(&c->zero, is_k ? u->off_kz : u->off_vz, u->g, c->zero_page_stride);
    }
    return kv;
}

/* kv's rows of the kv head gi after its own, head_bytes from one to the
 * next (and their scales and zero points, theirs). */
static inline struct npattn_kv kv_head(struct npattn_kv kv, int64_t gi, int64_t head_bytes) {
    kv.base += gi * head_bytes;
    if (kv.scale.base) kv.scale.base += gi * kv.scale.head_bytes;
    if (kv.zero.base) kv.zero.base += gi * kv.zero.head_bytes;
    return kv;
}

/* Row r of page `page` of kv head gi's scales (or zero points) g, NULL
 * where there are none (dense: page 0, r the row). */
static inline const void *groups_at(const struct npattn_kv_groups *g, int64_t page, int64_t r, int64_t gi) {
    return g->base ? g->base + page * g->page_bytes + r * g->row_bytes + gi * g->head_bytes : NULL;
}

/* The spans of kv head gi's rows for keys j0 .. j0 + nk - 1 (of a unit's ng
 * kv heads: kv holds the first head's rows, head_bytes from one head's to
 * the next's), a page each (dense: one), for the streaming kernels; returns
 * how many. The rows ahead of each span, those the unit reads next: the
 * next head's same rows; after the last head, the first head's rows `dist`
 * keys on (paged: whole pages on, so that a span's rows ahead lie in one
 * page; the span's own rows where those keys are past j1, the unit's end).
 * The pages are walked, not looked up key by key (a division each). */
static int64_t kv_spans(const struct npattn_kv *kv, int64_t head_bytes, int64_t gi, int64_t ng, int64_t j0, int64_t nk,
                        int64_t j1, int64_t dist, struct npattn_span *spans) {
    const int last = gi + 1 == ng;
    if (!kv->table) {
        const char *rows = kv->base + j0 * kv->row_bytes + gi * head_bytes;
        spans[0] = (struct npattn_span){rows, last ? kv->base + (j0 + dist) * kv->row_bytes : rows + head_bytes, nk,
                                        groups_at(&kv->scale, 0, j0, gi), groups_at(&kv->zero, 0, j0, gi)};
        return 1;
    }
    const int64_t ps = kv->page_size, on = (dist + ps - 1) / ps; /* pages on */
    int64_t n = 0, page = j0 / ps, r = j0 % ps;
    for (int64_t j = j0; j < j0 + nk; j += spans[n++].n, page++, r = 0) {
        const char *rows = kv->base + kv->table[page] * kv->page_bytes + r * kv->row_bytes + gi * head_bytes;
        const char *ahead = !last                ? rows + head_bytes
                            : j + on * ps < j1 ? kv->base + kv->table[page + on] * kv->page_bytes + r * kv->row_bytes
                                                 : rows;
        spans[n] = (struct npattn_span){rows, ahead, min64(ps - r, j0 + nk - j), groups_at(&kv->scale, kv->table[page], r, gi),
                                        groups_at(&kv->zero, kv->table[page], r, gi)};
    }
    return n;
}

/* How a streamed unit reads K or V (kv) for its ng kv heads: in rounds of
 * *keys keys, each round a head after another, and each head's spans
 * prefetching their rows *dist keys on (kv_spans). With one kv head, a
 * round is the tile and dist a dense stream's distance (npattn_prefetch_rows;
 * where q's dot products take K, `tiles`, a block of 64 rows further: the
 * amx tiles wait longer for their rows, and the avx512bf16 table's pairs in
 * lanes take the same distance, not timed without it; V's rows as far as
 * the table's accumulate wants them for the head's v_rows stacked rows,
 * where it passes over each row several times: accumulate_ahead). With
 * several, whose rows lie together only a few KiB at a time: paged,
 * ROUND_KEYS keys of whole pages (a page at least), so that the unit reads
 * each page's rows of every head close together, yet in calls long enough
 * to repay the kernels' setup; dense, the tile; and dist a round, the next
 * round's first head. */
static void kv_rounds(const struct fwd_plan *pl, const struct npattn_kv *kv, int64_t ng, int tiles, int64_t v_rows,
                      int64_t *keys, int64_t *dist) {
    *keys = pl->bk;
    if (ng > 1 && kv->table) *keys = min64(pl->bk, max64(1, ROUND_KEYS / kv->page_size) * kv->page_size);
    *dist = ng > 1 ? *keys : npattn_prefetch_rows(kv->row_bytes) + (tiles ? 64 : 0);
    const struct npattn_kernels *kn = npattn_kernels();
    if (ng == 1 && v_rows > 0 && kn->accumulate_ahead) *dist = kn->accumulate_ahead(v_rows, pl->p->n_embd_v, *dist, pl->bk);
}

/* Bytes of t's rows of one kv head that lie together, rows of `width`
 * elements: a page's where one row follows another (page_size rows; 0:
 * dense, no end), else one row. */
static int64_t head_run_bytes(const struct npattn_tensor *t, int64_t page_size, int64_t width) {
    if (t->row_stride == width && !page_size) return INT64_MAX;
    return (t->row_stride == width ? page_size : 1) * width * (int64_t)npattn_dtype_size(t->dtype);
}

/* Whether the rows of K or V that a request's kv head may read (its range,
 * w wide) hold no subnormal value, found once per call in *state by the
 * first unit that asks (any other asking meanwhile finds the same). */
static int rows_normal(_Atomic signed char *state, const struct npattn_kv *kv, const struct unit *u, int64_t w) {
    signed char known = atomic_load_explicit(state, memory_order_relaxed);
    if (!known) {
        known = npattn_pairs_of_kv(kv, u->k0, u->k1 - u->k0, w, NULL, 0) ? 1 : -1;
        atomic_store_explicit(state, known, memory_order_relaxed);
    }
    return known == 1;
}

/* The bytes of n tiles of `bytes` (> 0) and their states, a multiple of 64;
 * SIZE_MAX past NPATTN_KEPT_MAX. */
static size_t shared_size(size_t n, size_t bytes) {
    return n > NPATTN_KEPT_MAX / (bytes + 1) ? SIZE_MAX : (n * bytes + n + 63) / 64 * 64;
}

/* t's n tiles of `bytes` and their states, at *at in the call's block,
 * which then moves past them. */
static void shared_place(struct shared_tiles *t, size_t n, size_t bytes, char **at) {
    const size_t size = shared_size(n, bytes);
    t->bytes = bytes;
    t->data = *at;
    t->state = (_Atomic signed char *)(*at + n * bytes);
    memset((void *)t->state, 0, n);
    *at += size;
}

/* The call's copy of unit u's key tile at j0 in t, where t has copies and
 * the tile lies on its request's grid of bk keys; else NULL. *make: the
 * caller is the first to reach it and makes it now, then calls
 * tile_made. A tile another unit is making is NULL too: the caller makes
 * its own rather than wait. */
static char *shared_tile(const struct fwd_plan *pl, const struct shared_tiles *t, const struct unit *u, int64_t j0,
                         int *make) {
    *make = 0;
    if (!t->data || (j0 - u->k0) % pl->bk != 0) return NULL;
    const int64_t tile = (u->b * pl->p->n_head_kv + u->g) * pl->n_ktile + (j0 - u->k0) / pl->bk;
    _Atomic signed char *state = t->state + tile;
    signed char none = 0;
    if (atomic_load_explicit(state, memory_order_acquire) == 2) return t->data + (size_t)tile * t->bytes;
    if (!atomic_compare_exchange_strong_explicit(state, &none, 1, memory_order_relaxed, memory_order_relaxed))
        return NULL;
    *make = 1;
    return t->data + (size_t)tile * t->bytes;
}

static void tile_made(const struct shared_tiles *t, const char *copy) {
    atomic_store_explicit(t->state + (copy - t->data) / (ptrdiff_t)t->bytes, 2, memory_order_release);
}

/* What a key tile is made into: K's or V's rows as float (w apart); float16
 * K's rows split (npattn_split_f16_row, 2w pairs apart); float16 V's rows
 * split as pv_split takes them (npattn_split_f16_twice: key j's rows 2j and
 * 2j + 1, ldv2 apart); bfloat16 V's pairs along the keys
 * (npattn_pairs_of_kv, ldv2 apart); bfloat16 K's pairs as B tiles (the
 * table's k_tiles). */
enum tile_form { FLOAT_ROWS, SPLIT_K, SPLIT_V, V_PAIRS, K_TILES };

/* tile.h's, for float (kv's rows as float, codes as their values). */
static const void *kv_rows_f32(const struct npattn_tensor *t, const struct npattn_kv *kv, int64_t j0, int64_t nk,
                               int64_t width, int direct, int64_t ld_direct, float *buf, int64_t *ld, int *in_place);

/* out = rows j0 .. j0 + n - 1 of kv (tensor t, w wide) in `form`. */
static void make_tile(const struct fwd_plan *pl, enum tile_form form, const struct npattn_tensor *t,
                      const struct npattn_kv *kv, int64_t w, int64_t j0, int64_t n, void *out) {
    if (form == V_PAIRS) {
        npattn_pairs_of_kv(kv, j0, n, w, out, pl->ldv2);
        return;
    }
    if (form == FLOAT_ROWS) {
        int64_t ld;
        int in_place;
        kv_rows_f32(t, kv, j0, n, w, 0, 0, out, &ld, &in_place);
        return;
    }
    if (form == K_TILES) {
        const uint16_t *rows[NPATTN_STEP_KEYS];
        for (int64_t j = 0, run; j < n; j += run) {
            const char *at = npattn_kv_row(kv, j0 + j, &run);
            run = min64(run, n - j);
            for (int64_t i = 0; i < run; i++) rows[j + i] = (const uint16_t *)(at + i * kv->row_bytes);
        }
        npattn_kernels()->k_tiles(rows, n, w, out);
        return;
    }
    for (int64_t j = 0, run; j < n; j += run) {
        const char *at = npattn_kv_row(kv, j0 + j, &run);
        run = min64(run, n - j);
        for (int64_t i = 0, r = j; i < run; i++, r++) {
            const void *row = at + i * kv->row_bytes;
            if (form == SPLIT_K) npattn_split_f16_row(row, w, (uint32_t *)out + r * 2 * w);
            else npattn_split_f16_twice(row, w, (uint32_t *)out + 2 * r * pl->ldv2,
                                        (uint32_t *)out + (2 * r + 1) * pl->ldv2, pl->ldv2);
        }
    }
}

/* The key tile [j0, j0 + nk) of unit u's kv head (kv, rows of tensor t, w
 * wide) in `form`: the call's copy of the whole tile in `copies`, made by the
 * first unit that reaches it, where there is one and the caller may read
 * the whole tile's form (`whole_ok`); else made into own, or NULL where own
 * is NULL. Either way the same values. Every query block of a causal half
 * prefill reads the tiles below it: made once, not once per block (Qwen3-4B
 * heads, L = S = 2048, bfloat16 "fast": V's pairs were 3-4% of the call on
 * one and on two threads). */
static const void *tile_of(struct fwd_plan *pl, const struct shared_tiles *copies, enum tile_form form,
                           const struct npattn_tensor *t, const struct unit *u, const struct npattn_kv *kv, int64_t w,
                           int64_t j0, int64_t nk, int whole_ok, void *own) {
    int make = 0;
    char *copy = whole_ok ? shared_tile(pl, copies, u, j0, &make) : NULL;
    if (copy && make) {
        make_tile(pl, form, t, kv, w, j0, min64(pl->bk, u->k1 - j0), copy);
        tile_made(copies, copy);
    }
    if (copy) return copy;
    if (own) make_tile(pl, form, t, kv, w, j0, nk, own);
    return own;
}

#define TASK "tile_fwd.h"
#include "reals.h"

/* The regions of one slot's scratch, elements of `real` bytes, for tasks
 * that take the paths qk and pv (the double copy: the gemms). */
static struct layout layout_of(const struct fwd_plan *pl, size_t real, enum qk_path qk, enum pv_path pv, int k_direct,
                               int v_direct) {
    const struct npattn_problem *p = pl->p;
    const size_t D = (size_t)p->n_embd_k, Dv = (size_t)p->n_embd_v, M = (size_t)pl->max_m, bk = (size_t)pl->bk;
    const size_t ldq2 = (size_t)pl->ldq2, ldv2 = (size_t)pl->ldv2, ldpa = (size_t)pl->ldpa;
    const int stream = qk_streams(qk);
    struct layout s;
    size_t at = 0;
    s.qt = npattn_take(&at, M * D * real);   /* Q^T (D, M) for the gemm, Q's rows when streaming */
    s.qrows = npattn_take(&at, stream ? 0 : M * D * real); /* Q's rows, before the transpose */
    /* scores^T (bk, M); the pipelined step's scratch */
    const size_t step = pv == PV_PATH_BF16_STEP ? npattn_step_bytes((int64_t)ldv2) : 0;
    s.st = npattn_take(&at, bk * M * real > step ? bk * M * real : step);
    s.ot = npattn_take(&at, (pv == PV_PATH_BF16_STEP ? (M + 15) / 16 * 16 : M) * Dv * real); /* O's rows (M, D_v) */
    s.m = npattn_take(&at, M * real);        /* running max */
    s.l = npattn_take(&at, M * real);        /* running sum */
    s.alpha = npattn_take(&at, M * real);    /* rescale factors */
    s.row = npattn_take(&at, (size_t)max64(max64(p->n_embd_k, p->n_embd_v), pl->bk) * real); /* one row, converted */
    /* a K or V tile, converted (or gathered from pages for a gemm); split K: its rows split, 4 D bfloat16 values */
    s.kt = npattn_take(&at, qk == QK_PATH_SPLIT_F16    ? bk * D * 8
                            : pv == PV_PATH_BF16_STEP ? (bk + 31) / 32 * 32 * D * 4 /* K's B tiles, or its rows */
                            : k_direct && !p->pages   ? 0
                                                      : bk * D * real);
    s.vt = npattn_take(&at, v_direct && !p->pages ? 0 : bk * Dv * real);
    s.bias = npattn_take(&at, p->mask_kind != NPATTN_MASK_NONE ? bk * M * real : 0); /* the mask's tile */
    s.lo = npattn_take(&at, M * sizeof(int32_t)); /* the band's cut, per row */
    s.hi = npattn_take(&at, M * sizeof(int32_t));
    /* the pairs of Q^T (streamed: q's tiles, per kv head of the unit) */
    s.qp = npattn_take(&at, qk == QK_PATH_SPLIT_F16        ? 2 * D * ldq2 * 4
                            : qk == QK_PATH_BF16           ? D / 2 * ldq2 * 4
                            : qk == QK_PATH_STREAM_Q_TILES ? (size_t)pl->bg * D / 2 * 16 * 4
                                                           : 0);
    /* P's pairs: by keys (pairs of rows), or as A tiles (rows of pairs: three parts of each weight where
     * exact); streamed, P's rows as bfloat16, and in vp the product before it is added */
    s.pp = npattn_take(&at, pv == PV_PATH_EXACT_BF16                              ? 3 * ldq2 * ldpa * 4
                            : pv == PV_PATH_BF16_TILES || pv == PV_PATH_SPLIT_F16 ? ldq2 * ldpa * 4
                            : pv == PV_PATH_STREAM_BF16                           ? M * bk * 2
                            : pv == PV_PATH_BF16                                  ? (bk + 1) / 2 * ldq2 * 4
                                                                                  : 0);
    s.vp = npattn_take(&at, pv == PV_PATH_SPLIT_F16     ? 2 * bk * ldv2 * 4
                            : pv == PV_PATH_STREAM_BF16 ? M * Dv * 4
                            : pv_tiles(pv)              ? (bk + 1) / 2 * ldv2 * 4
                                                        : 0);
    /* the streaming kernels' spans of a key tile: a page each, at most bk + 1 */
    s.spans = npattn_take(&at, stream ? (bk + 1) * sizeof(struct npattn_span) : 0);
    s.size = at;
    return s;
}

/* Merges the n_split partials of one unit: lse = logaddexp of the parts,
 * out = sum of exp(lse_s - lse) * O_s, in split order. */
static void merge_task(struct fwd_plan *pl, int64_t unit, int32_t slot) {
    const struct npattn_problem *p = pl->p;
    const int64_t Dv = p->n_embd_v, stride = pl->max_m * (Dv + 1);
    struct unit u;
    locate(pl, unit, &u);
    double *orow = (double *)npattn_slot(&pl->slots, slot);
    const double *first = pl->partials + (size_t)(unit * pl->n_split) * (size_t)stride;
    for (int64_t r = 0; r < u.M; r++) {
        double mx = -INFINITY; /* NaN in any part makes the row NaN */
        int nan = 0;
        for (int64_t s = 0; s < pl->n_split; s++) {
            double ls = first[s * stride + r];
            nan |= ls != ls;
            mx = ls > mx ? ls : mx;
        }
        if (nan) mx = NAN;
        double sum = 0;
        for (int64_t s = 0; s < pl->n_split; s++) {
            double ls = first[s * stride + r];
            if (ls != -INFINITY) sum += exp(ls - mx);
        }
        double lse = mx == -INFINITY ? -INFINITY : mx + log(sum);
        memset(orow, 0, (size_t)Dv * sizeof *orow);
        for (int64_t s = 0; s < pl->n_split && lse != -INFINITY; s++) {
            const double *part = first + s * stride;
            /* a part that saw nothing adds only its NaNs (0 * a NaN value), as
             * one pass over all the keys would */
            const double w = part[r] == -INFINITY ? 0.0 : exp(part[r] - lse);
            for (int64_t e = 0; e < Dv; e++) orow[e] += w * part[pl->max_m + r * Dv + e];
        }
        const int64_t h = u.h0 + r / u.nq, i = u.i0 + r % u.nq;
        if (Dv > 0) npattn_store_f64(p->out.dtype, orow, Dv, npattn_elem(&p->out, pl->out_size, u.off_out, h, i), p->out.col_stride);
        if (p->lse.data) store_lse(p, u.off_lse, h, i, lse);
    }
}

/* A task; under split-K the unit's last task to finish merges its parts
 * (in split order, whichever thread it is), so that one round of the pool
 * does the whole call. */
static void run_task(void *arg, int64_t task, int32_t slot) {
    struct fwd_plan *pl = arg;
    npattn_run_exact(pl, task, slot, &pl->slots, tile_fwd_f32, tile_fwd_f64, &pl->run);
    if (pl->n_split > 1 && npattn_part_done(&pl->parts_left[task / pl->n_split], &pl->run))
        merge_task(pl, task / pl->n_split, slot);
}

/* ---- the planner: tiles, products, split, shared tiles, allocation ---- */

/* How t's codes (c, rows `width` wide) stand for values, as the kernels
 * read them (struct npattn_dequant); nothing for floats. */
static void dequant_of(const struct npattn_tensor *t, const struct npattn_codes *c, int64_t width,
                       struct npattn_dequant *dq) {
    if (!npattn_is_code(t->dtype)) return;
    dq->scale_type = c->scale.dtype;
    dq->zero_type = c->zero.data ? c->zero.dtype : c->scale.dtype;
    dq->group = width > 0 ? width / c->n_group : 1;
    dq->scale_row = c->scale.row_stride, dq->scale_col = c->scale.col_stride;
    dq->zero_row = c->zero.row_stride, dq->zero_col = c->zero.col_stride;
    dq->zero = c->zero.data != NULL;
}

/* Whether the streaming kernels take t's rows (`width` wide) as stored:
 * floats; codes whose groups are a row or a multiple of the table's
 * code_step (others are converted a tile at a time). */
static int streams_as_stored(const struct npattn_tensor *t, const struct npattn_codes *c, int64_t width) {
    return !npattn_is_code(t->dtype) || c->n_group == 1 || width / c->n_group % npattn_kernels()->code_step == 0;
}

/* Tiles: stack a whole group's heads when it fits, query rows to fill the
 * rest; keys to fill the small-gemm budget; smaller for very wide rows so
 * that scratch stays bounded. A few stacked rows (decode) make gemms that
 * are all overhead: those stream each key and value row once through the
 * SIMD kernels instead. Then which of K and V are read in place. */
static void plan_tiles(struct fwd_plan *pl, const struct npattn_problem *p) {
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v;
    memset(pl, 0, sizeof *pl);
    pl->p = p;
    pl->band = npattn_band_of(p);
    pl->n_batch = npattn_n_batch(p);
    enum npattn_dtype result = Dv > 0 ? p->out.dtype : p->weights.data ? p->weights.dtype : p->lse.dtype;
    pl->f64 = npattn_computes_f64(p, result);
    pl->out_size = Dv > 0 ? (int64_t)npattn_dtype_size(p->out.dtype) : 0;
    pl->group = p->n_head_q / p->n_head_kv;
    const int64_t width = max64(D, Dv);
    int64_t rows = min64(TILE_ROWS_MAX, max64(TILE_ROWS_MIN, TILE_ROW_ELEMS / width));
    rows = max64(1, min64(rows, TILE_ELEMS / max64(width, TILE_KEYS_MAX)));
    pl->bh = min64(pl->group, rows);
    pl->bq = max64(1, rows / pl->bh);
    /* stacked rows a multiple of 16 (whole SIMD vectors) where that is possible */
    int64_t unit = 16;
    for (int64_t h = pl->bh; h % 2 == 0 && unit > 1; h /= 2) unit /= 2;
    if (pl->bq >= unit) pl->bq = pl->bq / unit * unit;
    pl->bq = min64(p->n_query, min64(pl->bq, TILE_QUERY_MAX));
    pl->n_hblock = (pl->group + pl->bh - 1) / pl->bh;
    pl->bg = 1, pl->n_gblock = p->n_head_kv;
    query_blocks(pl, pl->bq);
    pl->bk = min64(TILE_KEYS_MAX, max64(TILE_KEYS_MIN, TILE_FLOPS_BUDGET / (pl->max_m * width) / 16 * 16));
    const int stream = !pl->f64 && pl->max_m <= STREAM_ROWS;
    pl->qk = stream ? QK_PATH_STREAM : QK_PATH_GEMM;
    pl->pv = stream ? PV_PATH_STREAM : PV_PATH_GEMM;
    if (stream) pl->bk = max64(32, min64(STREAM_KEYS, STREAM_SCORES / pl->max_m / 16 * 16));
    /* gemms read K and V in place in the computed type; the streaming
     * kernels read float, float16, bfloat16 rows and codes in place as stored */
    enum npattn_dtype computed = pl->f64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    enum npattn_dtype k_in = stream && p->k.dtype != NPATTN_DTYPE_F64 ? p->k.dtype : computed;
    enum npattn_dtype v_in = stream && p->v.dtype != NPATTN_DTYPE_F64 ? p->v.dtype : computed;
    const int64_t run_rows = p->pages ? p->pages->page_size : p->n_key; /* rows that lie row_stride apart */
    pl->k_direct = npattn_blas_direct(&p->k, k_in, run_rows, D, &pl->ldk) && streams_as_stored(&p->k, &p->k_codes, D);
    pl->v_direct = Dv > 0 && npattn_blas_direct(&p->v, v_in, run_rows, Dv, &pl->ldv) &&
                   streams_as_stored(&p->v, &p->v_codes, Dv);
    dequant_of(&p->k, &p->k_codes, D, &pl->k_dq);
    if (Dv > 0) dequant_of(&p->v, &p->v_codes, Dv, &pl->v_dq);
    if (p->pages) {
        pl->k_page_bytes = p->pages->k_page_stride * (int64_t)npattn_dtype_size(p->k.dtype);
        pl->v_page_bytes = p->pages->v_page_stride * (int64_t)npattn_dtype_size(p->v.dtype);
    }
}

/* QK^T of float tiles. bfloat16 q and k: their products are exact in float,
 * so QK^T may be the table's bfloat16 dot products (K's rows read in
 * place). float16 q and k on tiles: each value the sum of two bfloat16
 * ones, so the four dot products of the parts are QK^T, each product exact
 * (K's rows split per tile): a quarter of the tiles' speed, and still
 * several times the float32 FMAs'. Streamed, a bfloat16 K read in place
 * takes q's rows as the table's tiles. */
static enum qk_path qk_path_of(const struct fwd_plan *pl) {
    const struct npattn_problem *p = pl->p;
    const struct npattn_kernels *kn = npattn_kernels();
    const int64_t D = p->n_embd_k;
    if (pl->qk == QK_PATH_STREAM)
        return kn->q_tiles && p->k.dtype == NPATTN_DTYPE_BF16 && pl->k_direct ? QK_PATH_STREAM_Q_TILES : QK_PATH_STREAM;
    if (pl->f64 || !kn->scores_bf16 || p->k.col_stride != 1) return QK_PATH_GEMM;
    if (kn->bf16_tile && p->q.dtype == NPATTN_DTYPE_F16 && p->k.dtype == NPATTN_DTYPE_F16 && D > 0 &&
        4 * D <= kn->bf16_tile_width && 4 * D % kn->bf16_d_step == 0)
        return QK_PATH_SPLIT_F16;
    if (p->q.dtype == NPATTN_DTYPE_BF16 && p->k.dtype == NPATTN_DTYPE_BF16 && D % kn->bf16_d_step == 0)
        return QK_PATH_BF16;
    return QK_PATH_GEMM;
}

/* P @ V of float tiles, given QK^T's path. Under "fast", bfloat16 v with
 * bfloat16 q and k: the weights rounded to bfloat16 (streamed: the table's
 * accumulate_pairs, V's rows read in place); float16 v after split QK^T:
 * P split in two (within 2^-15 of it, where "fast" allows rounding it to
 * float16, 2^-11), V exactly. Under "highest", bfloat16 v on tiles: each
 * weight the sum of three bfloat16 values (exactly, unless a part is below
 * 2^-126), their products with V's values exact. */
static enum pv_path pv_path_of(const struct fwd_plan *pl, enum qk_path qk) {
    const struct npattn_problem *p = pl->p;
    const struct npattn_kernels *kn = npattn_kernels();
    const enum npattn_dtype b16 = NPATTN_DTYPE_BF16;
    const int fast = p->precision == NPATTN_PRECISION_FAST, v_ok = p->v.col_stride == 1 && p->n_embd_v > 0;
    const int bf16 = p->q.dtype == b16 && p->k.dtype == b16 && p->v.dtype == b16 && v_ok;
    if (pl->f64) return PV_PATH_GEMM;
    if (qk_streams(qk))
        return bf16 && fast && kn->accumulate_pairs && pl->v_direct ? PV_PATH_STREAM_BF16 : PV_PATH_STREAM;
    if (qk == QK_PATH_SPLIT_F16)
        return fast && kn->split_tiles && p->v.dtype == NPATTN_DTYPE_F16 && v_ok ? PV_PATH_SPLIT_F16 : PV_PATH_GEMM;
    if (bf16 && fast && kn->prefill_tiles_bf16 && p->n_embd_k % 32 == 0 && p->n_embd_v % 16 == 0 && !p->weights.data)
        return PV_PATH_BF16_STEP;
    if (bf16 && fast && kn->accumulate_bf16) return kn->softmax_tiles_f32 ? PV_PATH_BF16_TILES : PV_PATH_BF16;
    if (bf16 && p->precision == NPATTN_PRECISION_HIGHEST && kn->exact_tiles) return PV_PATH_EXACT_BF16;
    return PV_PATH_GEMM;
}

/* The products' paths, and the tile sizes that suit the table's dot
 * products (split: half the keys, each two pairs); with P @ V a float32
 * gemm, its keys within the small-gemm budget. */
static void plan_products(struct fwd_plan *pl) {
    const struct npattn_problem *p = pl->p;
    const struct npattn_kernels *kn = npattn_kernels();
    pl->qk = qk_path_of(pl);
    pl->pv = pv_path_of(pl, pl->qk);
    const int dots = pl->qk == QK_PATH_BF16 || pl->qk == QK_PATH_SPLIT_F16, v_tiles = pv_tiles(pl->pv);
    if ((dots || v_tiles) && kn->bf16_tile) {
        if (v_tiles)
            query_blocks(pl, min64(p->n_query, max64(pl->bq, min64(TILE_QUERY_MAX, kn->bf16_tile / pl->bh / 16 * 16))));
        const int64_t budget = v_tiles ? kn->bf16_tile / (pl->pv == PV_PATH_SPLIT_F16 ? 2 : 1)
                                       : TILE_FLOPS_BUDGET / (pl->max_m * max64(p->n_embd_v, 1));
        pl->bk = max64(32, min64(kn->bf16_tile, budget) / 32 * 32);
    }
    pl->ldq2 = (pl->max_m + 15) / 16 * 16, pl->ldv2 = (p->n_embd_v + 15) / 16 * 16;
    pl->ldpa = pl->pv == PV_PATH_SPLIT_F16 ? (2 * pl->bk + 15) / 16 * 16 : (pl->bk + 31) / 32 * 16;
}

/* The call's work as split plans it. */
struct fwd_work {
    int64_t n_request;        /* requests of their own lengths, or 1 where all are alike */
    double pairs;             /* visible (query row, key) pairs of one kv head's group member */
    double unit_keys_sum;     /* each unit's keys, summed */
    int64_t most_keys;        /* the most one unit sees */
    struct npattn_threads threads;
};

/* The work, and the threads it repays (npattn_plan_threads). The same
 * problem and n_threads always give the same plan, whatever threads
 * actually start. Streamed: a thread per NPATTN_GRAIN_STREAM flops while
 * the units feed them; past the units, one per NPATTN_GRAIN, as for tiles. */
static enum npattn_status plan_work(struct fwd_plan *pl, struct fwd_work *w) {
    const struct npattn_problem *p = pl->p;
    /* every request alike, unless each has its own range or offset */
    w->n_request = p->k_start || p->k_length || p->q_offsets ? pl->n_batch : 1;
    if (w->n_request > 1) {
        pl->rank = npattn_alloc((size_t)w->n_request * sizeof *pl->rank);
        if (!pl->rank) return NPATTN_STATUS_NO_MEMORY;
    }
    w->pairs = count_work(pl, w->n_request, &w->unit_keys_sum, &w->most_keys);
    const double flops = w->pairs * 2.0 * (double)(p->n_embd_k + p->n_embd_v + (p->weights.data ? p->n_embd_k : 0)) *
                         (double)pl->group * (double)(pl->n_batch / w->n_request) * (double)p->n_head_kv;
    const int stream = qk_streams(pl->qk);
    const double want = stream ? fmax(fmin((double)pl->n_unit, flops / NPATTN_GRAIN_STREAM), flops / NPATTN_GRAIN)
                               : flops / NPATTN_GRAIN;
    w->threads = npattn_plan_threads(flops, stream ? NPATTN_WAKE_STREAM : NPATTN_WAKE, want, p->n_threads);
    return NPATTN_STATUS_OK;
}

/* A small prefill of fewer units than threads (few kv heads), or whose
 * heaviest unit is over a thread's share by half (the last query block of a
 * causal one): query blocks of fewer rows, so that more threads share it,
 * and evenly. Qwen2-0.5B L = S = 32 on 16 threads: 4 blocks of 16 rows, the
 * last 37% of the work, or 8 of 8 rows, none over 22%. Gemm tiles only. */
static void cut_query_blocks(struct fwd_plan *pl, struct fwd_work *w) {
    const int32_t threads = w->threads.plan;
    if (pl->qk != QK_PATH_GEMM || pl->pv != PV_PATH_GEMM || threads <= 1 || pl->bq <= QBLOCK_MIN) return;
    const double share = w->pairs * (double)(pl->n_unit / (w->n_request * pl->n_qblock)) / threads;
    const double heaviest = (double)pl->bq * (double)w->most_keys;
    int64_t bq = pl->bq;
    if (pl->n_unit < threads) bq /= (threads + pl->n_unit - 1) / pl->n_unit;
    if (heaviest > 1.5 * share) bq = min64(bq, (int64_t)((double)pl->bq * share / heaviest));
    bq = max64(QBLOCK_MIN, (bq + QBLOCK_MIN - 1) / QBLOCK_MIN * QBLOCK_MIN);
    if (bq < pl->bq) {
        query_blocks(pl, bq);
        count_work(pl, w->n_request, &w->unit_keys_sum, &w->most_keys);
    }
}

/* A thread's fair share of all units' keys. */
static double fair_keys(const struct fwd_plan *pl, const struct fwd_work *w) {
    return w->unit_keys_sum * (double)(pl->n_unit / (w->n_request * pl->n_qblock)) / (double)w->threads.plan;
}

/* Split-K (never with the weights): where there are fewer units than
 * threads (decode with few heads), each part of a unit's keys is a task,
 * merged by log-sum-exp; where requests have unequal lengths, every unit
 * splits so that the longest one's parts are no longer than a thread's
 * fair share of all units' keys, at most 64 tasks per thread in all, so
 * that the partials stay small. */
static void split_keys(struct fwd_plan *pl, const struct fwd_work *w) {
    const int64_t threads = w->threads.plan;
    pl->n_split = 1;
    if (pl->p->weights.data) return;
    if (pl->n_unit < threads) {
        int64_t want = (2 * threads + pl->n_unit - 1) / pl->n_unit;
        pl->n_split = max64(1, min64(want, w->most_keys / SPLIT_MIN_KEYS));
    }
    if (w->n_request > 1 && threads > 1 && w->unit_keys_sum > 0) {
        const double fair = fair_keys(pl, w);
        if ((double)w->most_keys > 1.5 * fair) {
            int64_t want = min64((int64_t)ceil((double)w->most_keys / fair), 64 * threads / pl->n_unit);
            pl->n_split = max64(pl->n_split, max64(1, min64(want, w->most_keys / SPLIT_MIN_KEYS)));
        }
    }
}

/* Decode where a kv head's rows lie together only a few KiB at a time (a
 * small page's, or one row where the heads interleave, as in a (B, S,
 * H_kv, D) cache), which memory serves well below its streaming rate: a
 * unit takes all kv heads of its request and reads its keys a round at a
 * time (kv_rounds: whole pages, or a tile), each round's rows of every
 * head in turn. On several threads each unit's keys split bg times more,
 * so that the tasks are as many as with a unit per kv head; but not where
 * the units alone share out evenly, four a thread or more and none longer
 * than a thread's share (a batch of requests on a few threads: Qwen2-0.5B,
 * 8 requests, 2 threads, 0.84 -> 1.0 of the dense call without the
 * merges). bg is smaller where the keys are too few, and where the unit
 * would have more than MERGE_PARTS parts: the last of them merges bg times
 * the rows of bg times the parts on its own. */
static void group_kv_heads(struct fwd_plan *pl, const struct fwd_work *w) {
    const struct npattn_problem *p = pl->p;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, threads = w->threads.plan;
    const int64_t page_size = p->pages ? p->pages->page_size : 0;
    if (!qk_streams(pl->qk) || !pl->k_direct || !(pl->v_direct || Dv == 0) || p->weights.data || pl->n_hblock != 1)
        return;
    if (min64(head_run_bytes(&p->k, page_size, D), Dv > 0 ? head_run_bytes(&p->v, page_size, Dv) : INT64_MAX) >=
        HEAD_RUN_BYTES)
        return;
    const double fair = fair_keys(pl, w); /* before the units change */
    int64_t bg = p->n_head_kv;
    if (threads > 1) bg = max64(1, min64(bg, min64(w->most_keys / SPLIT_MIN_KEYS, MERGE_PARTS) / pl->n_split));
    pl->bg = bg, pl->n_gblock = (p->n_head_kv + bg - 1) / bg;
    pl->max_m *= bg;
    pl->n_unit = pl->n_batch * pl->n_gblock * pl->n_hblock * pl->n_qblock;
    const int even = pl->n_unit * pl->n_split >= 4 * threads &&
                     (double)w->most_keys / (double)pl->n_split * (double)bg <= fair;
    if (threads > 1 && !even) pl->n_split *= bg;
}

/* The key tiles shared by the units of a kv head where there are several:
 * V's pairs, K's split rows, K's and V's rows as float. None past the
 * block kept between calls: a larger one would be mapped and its pages
 * faulted in afresh on every call, which costs more than the copies save
 * (a chunk of 128 queries against 32768 keys: twice the time); none either
 * where the block cannot be had. */
static void plan_shared_tiles(struct fwd_plan *pl) {
    const struct npattn_problem *p = pl->p;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v;
    const int v_pairs = pv_tiles(pl->pv), k_split = pl->qk == QK_PATH_SPLIT_F16, k_tiles = pl->pv == PV_PATH_BF16_STEP;
    const int k_rows = !pl->f64 && pl->qk == QK_PATH_GEMM && !pl->k_direct && D > 0;
    const int v_rows = !pl->f64 && pl->pv == PV_PATH_GEMM && !pl->v_direct && Dv > 0;
    if (!(v_pairs || k_split || k_rows || v_rows || k_tiles) || pl->n_qblock * pl->n_hblock <= 1) return;
    pl->n_ktile = (p->n_key + pl->bk - 1) / pl->bk;
    const size_t n = (size_t)(pl->n_batch * p->n_head_kv) * (size_t)pl->n_ktile;
    const size_t v_pair_rows = pl->pv == PV_PATH_SPLIT_F16 ? 2 * (size_t)pl->bk : (size_t)(pl->bk + 1) / 2;
    const size_t bytes[5] = {v_pair_rows * (size_t)pl->ldv2 * 4, (size_t)(pl->bk * D) * 8, (size_t)(pl->bk * D) * 4,
                             (size_t)(pl->bk * Dv) * 4, (size_t)((pl->bk + 31) / 32 * 32 * D) * 2};
    struct shared_tiles *const tiles[5] = {&pl->v_tiles, &pl->k_split, &pl->k_rows, &pl->v_rows, &pl->k_tiles};
    const int used[5] = {v_pairs, k_split, k_rows, v_rows, k_tiles};
    size_t total = 0;
    for (int i = 0; i < 5; i++) {
        const size_t size = used[i] ? shared_size(n, bytes[i]) : 0;
        total = size > NPATTN_KEPT_MAX || total + size > NPATTN_KEPT_MAX ? NPATTN_KEPT_MAX + 1 : total + size;
    }
    if (total > NPATTN_KEPT_MAX) return;
    pl->shared_bytes = total;
    pl->shared = npattn_alloc_kept(&pl->shared_bytes);
    char *at = pl->shared;
    for (int i = 0; i < 5 && at; i++)
        if (used[i]) shared_place(tiles[i], n, bytes[i], &at);
}

/* The call's memory: each slot's scratch (its merge rows too), the
 * subnormal states of the bfloat16 pairs' requests (split float16 values
 * are never subnormal; streamed, the kernel finds V's as it reads them),
 * the shared key tiles, and split-K's partials (n_task < 64 * threads +
 * n_unit: small) with the units' counts of tasks left after them. */
static enum npattn_status plan_memory(struct fwd_plan *pl, int64_t n_task, int32_t n_slot) {
    const struct npattn_problem *p = pl->p;
    const int64_t Dv = p->n_embd_v;
    pl->lay = layout_of(pl, pl->f64 ? sizeof(double) : sizeof(float), pl->qk, pl->pv, pl->k_direct, pl->v_direct);
    pl->lay64 = pl->f64 ? pl->lay : layout_of(pl, sizeof(double), QK_PATH_GEMM, PV_PATH_GEMM, 0, 0);
    size_t slot_bytes = max64((int64_t)pl->lay.size, (int64_t)(max64(Dv, 1) * sizeof(double)));
    enum npattn_status status = npattn_slots_alloc(&pl->slots, n_slot, slot_bytes, pl->f64 ? 0 : pl->lay64.size);
    if (status != NPATTN_STATUS_OK) return status;
    const int pairs_of_kv = pl->qk == QK_PATH_BF16 || pl->pv == PV_PATH_BF16 || pl->pv == PV_PATH_BF16_TILES ||
                            pl->pv == PV_PATH_EXACT_BF16; /* K's or V's rows as bfloat16 pairs: checked per request */
    if (pairs_of_kv) {
        const size_t n = (size_t)(pl->n_batch * p->n_head_kv);
        pl->k_normal = npattn_alloc(2 * n);
        if (!pl->k_normal) return NPATTN_STATUS_NO_MEMORY;
        memset((void *)pl->k_normal, 0, 2 * n);
        pl->v_normal = pl->k_normal + n;
    }
    plan_shared_tiles(pl);
    if (pl->n_split > 1) {
        const size_t n_part = (size_t)n_task * (size_t)(pl->max_m * (Dv + 1));
        pl->partials = npattn_alloc(n_part * sizeof(double) + (size_t)pl->n_unit * sizeof *pl->parts_left);
        if (!pl->partials) return NPATTN_STATUS_NO_MEMORY;
        pl->parts_left = (_Atomic int64_t *)(pl->partials + n_part);
        npattn_parts_init(pl->parts_left, pl->n_unit, pl->n_split);
    }
    return NPATTN_STATUS_OK;
}

static void plan_free(struct fwd_plan *pl) {
    npattn_free(pl->rank);
    npattn_free(pl->partials);
    npattn_free((void *)pl->k_normal);
    npattn_free_kept(pl->shared, pl->shared_bytes);
    npattn_slots_free(&pl->slots);
}

/* Plans the call in stages (tiles, products, work and threads, split,
 * memory) and runs its tasks on the pool. */
enum npattn_status npattn_sdpa(const struct npattn_problem *p) {
    enum npattn_status status = npattn_check(p, NULL);
    if (status != NPATTN_STATUS_OK) return status;
    if (!npattn_blas_ok()) return NPATTN_STATUS_BLAS_WRONG;
    if (npattn_n_batch(p) == 0 || p->n_head_q == 0 || p->n_query == 0) return NPATTN_STATUS_OK;
    if (p->n_embd_v == 0 && !p->lse.data && !p->weights.data) return NPATTN_STATUS_OK; /* nothing to write */

    struct fwd_plan pl;
    struct fwd_work work;
    plan_tiles(&pl, p);
    plan_products(&pl);
    status = plan_work(&pl, &work);
    if (status == NPATTN_STATUS_OK) {
        cut_query_blocks(&pl, &work);
        split_keys(&pl, &work);
        group_kv_heads(&pl, &work);
        const int64_t n_task = pl.n_unit * pl.n_split;
        const int32_t n_slot = (int32_t)min64(work.threads.run, n_task);
        status = plan_memory(&pl, n_task, n_slot);
        if (status == NPATTN_STATUS_OK) {
            npattn_blas_init();
            npattn_run_init(&pl.run, p->cancel, p->cancel_arg);
            status = npattn_pool_run(run_task, &pl, n_task, n_slot, &pl.run);
        }
    }
    plan_free(&pl);
    return status;
}

/* backward.c: the backward driver. npattn_sdpa_backward (at the end) checks
 * a backward problem and plans it in named stages (tiles, the products'
 * path, keys and units, split, memory), then runs one task per kv head of
 * each slice of the batch that the gradients keep (tile_bwd.h, written once
 * for float and double): a batch dim along which a gradient has stride 0 is
 * summed, the task visiting its entries in order. A head's key blocks are
 * split across tasks when there are fewer heads than threads and nothing is
 * summed. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "attention.h"
#include "band.h"
#include "blas.h"
#include "internal.h"
#include "kernels/kernels.h"

#define BWD_ROWS 128              /* stacked query rows (heads x positions) per tile */
#define BWD_FLOPS_BUDGET 1000000  /* keys * rows * width per gemm: OpenBLAS's small-matrix path */
#define BWD_KEYS_MIN 16
#define BWD_KEYS_MAX 256
#define BWD_KEYS_BF16 96          /* keys per block with no OpenBLAS product: measured best of 48-128 on Zen 4 */
_Static_assert(BWD_KEYS_BF16 % 2 == 0, "a block of K's pairs starts on a pair");
#define BWD_CHUNK_BYTES (2 << 20) /* a chunk's K, V (converted) and dK, dV */

/* How a backward tile computes its products (plan_products). A chunk of
 * keys, or a query tile, takes the gemms where its operands need them (a
 * subnormal value, which a bfloat16 pair would read as 0, or values that
 * are not all finite); the double copy of a task always does. */
enum bwd_path {
    BWD_PATH_GEMM,      /* gemms in the computed type */
    BWD_PATH_BF16,      /* bfloat16 q, k, v and dout: S^T and dP^T as the table's bfloat16 dot products (exact) */
    BWD_PATH_BF16_FAST, /* and under "fast" the three products with P and dS too, those rounded to bfloat16 */
};

struct bwd_layout {
    size_t qrows, dorows, orows, qt, dot, st, dpt, dcap, bias, kt, vt, dk, dv, dq, lse, m, l, alpha, dvec, row, lo, hi;
    size_t qp, dop, qm, dom, pbf, dsbf, dsk, kp, prod; /* bfloat16 operands (float tasks only) */
    size_t size;
};

struct bwd_plan {
    const struct npattn_backward_problem *bp;
    struct npattn_band band;
    struct npattn_run run;
    int f64;                   /* computed in double */
    int64_t group;             /* H_q / H_kv */
    int64_t bh, n_hblock;      /* heads of a group per tile, and blocks of them */
    int64_t bq;                /* query rows per tile */
    int64_t bk, n_kblock;      /* keys per block, and blocks */
    int64_t chunk;             /* key blocks whose dK, dV a task keeps in scratch at once */
    int64_t n_unit, n_split;   /* (kept batch slice, kv head) units, and tasks per unit */
    int64_t n_rep;             /* batch entries per unit: the product of the summed dims */
    int k_direct, v_direct;
    int64_t ldk, ldv;
    enum bwd_path path;        /* the call's products */
    /* the pairs' rows are ldm2, ldd2 and ldv2 apart (16-lane multiples of M,
     * D and Dv); P^T's and dS^T's bfloat16 rows m16 (M padded to the
     * table's bf16_d_step) */
    int64_t ldm2, ldd2, ldv2, m16;
    struct bwd_layout lay, lay64;
    struct npattn_slots slots; /* lay.size bytes each; lay64.size in double when a float task needs it */
    double *dq_parts;          /* split-K: each task's dQ, (group, L, D) */
    _Atomic int64_t *parts_left; /* split-K: per unit, its tasks not yet done (after the dQ parts) */
};


/* Whether batch dim d is summed: a gradient written (dq, dk, dv) has stride 0
 * along it, and it has more than one entry. */
static int bwd_summed(const struct npattn_backward_problem *bp, int32_t d) {
    const struct npattn_problem *p = &bp->fwd;
    if (p->batch_shape[d] < 2) return 0;
    return (p->n_query > 0 && p->n_embd_k > 0 && bp->dq.batch_stride[d] == 0) ||
           (p->n_key > 0 && bp->dk.batch_stride[d] == 0) ||
           (p->n_key > 0 && p->n_embd_v > 0 && bp->dv.batch_stride[d] == 0);
}

/* The flat batch index of repeat `rep` (row-major over the summed dims) of
 * the kept slice `kept` (row-major over the others). */
static int64_t bwd_batch(const struct bwd_plan *pl, int64_t kept, int64_t rep) {
    const struct npattn_problem *p = &pl->bp->fwd;
    int64_t b = 0, mult = 1;
    for (int32_t d = p->n_batch_dim - 1; d >= 0; d--) {
        const int64_t n = p->batch_shape[d];
        int64_t *from = bwd_summed(pl->bp, d) ? &rep : &kept;
        b += *from % n * mult;
        *from /= n;
        mult *= n;
    }
    return b;
}

/* Whether repeat `rep` is the first of its unit to reach its slice of t: its
 * index is 0 along every summed dim where t has stride 0. */
static int bwd_first_visit(const struct bwd_plan *pl, const struct npattn_tensor *t, int64_t rep) {
    const struct npattn_problem *p = &pl->bp->fwd;
    for (int32_t d = p->n_batch_dim - 1; d >= 0 && rep > 0; d--) {
        if (!bwd_summed(pl->bp, d)) continue;
        const int64_t n = p->batch_shape[d];
        if (rep % n != 0 && t->batch_stride[d] == 0) return 0;
        rep /= n;
    }
    return 1;
}

/* Whether rows of x (n rows of w, ld apart) hold a subnormal value. */
static int rows_subnormal(const float *x, int64_t n, int64_t w, int64_t ld) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t e = 0; e < w; e++)
            if (x[r * ld + e] != 0 && fabsf(x[r * ld + e]) < FLT_MIN) return 1;
    return 0;
}

/* o (nk, w) += X^T (nk, m16) @ Y (m16, w): X^T as nk bfloat16 rows, Y as its
 * pairs along the rows (yp, ldy apart), through the table's scores_bf16
 * (whose terms land in prod first). dV's and dK's products under "fast". */
static void add_product(const struct npattn_kernels *kn, const uint32_t *yp, int64_t ldy, int64_t w, int64_t m16,
                        const uint16_t *xt, int64_t nk, float *prod, float *o) {
    kn->scores_bf16(yp, ldy, w, m16 / 2, xt, m16, nk, prod, w);
    kn->add_f32(o, prod, nk * w);
}

#define TASK "tile_bwd.h"
#include "reals.h"

/* The regions of one slot's scratch, elements of `real` bytes, for tasks
 * that take `path` (the double copy: the gemms). */
static struct bwd_layout layout_of(const struct bwd_plan *pl, size_t real, enum bwd_path path, int k_direct,
                                   int v_direct) {
    const struct npattn_problem *p = &pl->bp->fwd;
    const size_t D = (size_t)p->n_embd_k, Dv = (size_t)p->n_embd_v, M = (size_t)(pl->bh * pl->bq);
    const size_t bk = (size_t)pl->bk, nc = (size_t)(pl->chunk * pl->bk);
    struct bwd_layout s;
    size_t at = 0;
    s.qrows = npattn_take(&at, M * D * real);     /* Q (M, D) */
    s.dorows = npattn_take(&at, M * Dv * real);   /* dO (M, Dv) */
    s.orows = npattn_take(&at, M * Dv * real);    /* O (M, Dv) */
    s.qt = npattn_take(&at, M * D * real);        /* Q^T (D, M) */
    s.dot = npattn_take(&at, M * Dv * real);      /* dO^T (Dv, M) */
    s.st = npattn_take(&at, bk * M * real);       /* S^T, then P^T (bk, M) */
    s.dpt = npattn_take(&at, bk * M * real);      /* dP^T, then dS^T (bk, M) */
    s.dcap = npattn_take(&at, p->softcap > 0 ? bk * M * real : 0); /* the cap's derivative */
    s.bias = npattn_take(&at, p->mask_kind != NPATTN_MASK_NONE ? bk * M * real : 0);
    s.kt = npattn_take(&at, k_direct ? 0 : nc * D * real);  /* a chunk of K, converted */
    s.vt = npattn_take(&at, v_direct ? 0 : nc * Dv * real); /* a chunk of V, converted */
    s.dk = npattn_take(&at, nc * D * real);       /* dK of the chunk */
    s.dv = npattn_take(&at, nc * Dv * real);      /* dV of the chunk */
    s.dq = npattn_take(&at, M * D * real);        /* dQ of a tile */
    s.lse = npattn_take(&at, M * real);
    s.m = npattn_take(&at, M * real);             /* lse, as the running max */
    s.l = npattn_take(&at, M * real);
    s.alpha = npattn_take(&at, M * real);
    s.dvec = npattn_take(&at, M * real);          /* rowsum(dO * O) */
    s.row = npattn_take(&at, (size_t)max64(max64((int64_t)D, (int64_t)Dv), (int64_t)bk) * real);
    s.lo = npattn_take(&at, M * sizeof(int32_t));
    s.hi = npattn_take(&at, M * sizeof(int32_t));
    const int pairs = path != BWD_PATH_GEMM, fast = path == BWD_PATH_BF16_FAST;
    const size_t u32 = sizeof(uint32_t), m16 = (size_t)pl->m16, bk2 = (bk + 1) / 2;
    const size_t ldm2 = (size_t)pl->ldm2, ldd2 = (size_t)pl->ldd2, ldv2 = (size_t)pl->ldv2;
    s.qp = npattn_take(&at, pairs ? (D + 1) / 2 * ldm2 * u32 : 0);   /* Q's pairs along D, for S^T */
    s.dop = npattn_take(&at, pairs ? (Dv + 1) / 2 * ldm2 * u32 : 0); /* dO's along Dv, for dP^T */
    s.qm = npattn_take(&at, fast ? m16 / 2 * ldd2 * u32 : 0);        /* Q's along the rows, for dK */
    s.dom = npattn_take(&at, fast ? m16 / 2 * ldv2 * u32 : 0);       /* dO's along the rows, for dV */
    s.pbf = npattn_take(&at, fast ? bk * m16 * 2 : 0);               /* P^T in bfloat16, for dV */
    s.dsbf = npattn_take(&at, fast ? bk * m16 * 2 : 0);              /* dS^T in bfloat16, for dK */
    s.dsk = npattn_take(&at, fast ? bk2 * ldm2 * u32 : 0);           /* dS's pairs along the keys, for dQ */
    s.kp = npattn_take(&at, fast ? (nc + 1) / 2 * ldd2 * u32 : 0);   /* a chunk of K's along the keys, for dQ */
    s.prod = npattn_take(&at, fast ? bk * (D > Dv ? D : Dv) * real : 0); /* a block's dK or dV terms */
    s.size = at;
    return s;
}

/* Split-K (nothing summed, so a unit is one batch entry's kv head): dQ of the
 * unit's rows is the sum of its tasks' partials, in split order. */
static void reduce_task(struct bwd_plan *pl, int64_t unit, int32_t slot) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int64_t D = p->n_embd_k, L = p->n_query, b = unit / p->n_head_kv, g = unit % p->n_head_kv;
    const int64_t off = npattn_batch_offset(p, &bp->dq, b), es = (int64_t)npattn_dtype_size(bp->dq.dtype);
    const size_t stride = (size_t)(pl->group * L * D);
    double *row = (double *)npattn_slot(&pl->slots, slot);
    for (int64_t h = 0; h < pl->group; h++)
        for (int64_t i = 0; i < L; i++) {
            memset(row, 0, (size_t)D * sizeof *row);
            for (int64_t s = 0; s < pl->n_split; s++) {
                const double *part = pl->dq_parts + (size_t)(unit * pl->n_split + s) * stride + (size_t)((h * L + i) * D);
                for (int64_t d = 0; d < D; d++) row[d] += part[d];
            }
            npattn_store_f64(bp->dq.dtype, row, D, npattn_elem(&bp->dq, es, off, g * pl->group + h, i), bp->dq.col_stride);
        }
}

/* A task; under split-K the unit's last task to finish sums its dQ parts
 * (in split order, whichever thread it is), as the forward pass merges. */
static void run_task(void *arg, int64_t task, int32_t slot) {
    struct bwd_plan *pl = arg;
    npattn_run_exact(pl, task, slot, &pl->slots, tile_bwd_f32, tile_bwd_f64, &pl->run);
    if (pl->n_split > 1 && npattn_part_done(&pl->parts_left[task / pl->n_split], &pl->run))
        reduce_task(pl, task / pl->n_split, slot);
}

/* ---- the planner: tiles, products, split, allocation ---- */

/* No query sees a key (no query head): dK and dV are zeros. */
static void zero_kv_grads(const struct npattn_backward_problem *bp) {
    const struct npattn_problem *p = &bp->fwd;
    const double zero[1] = {0};
    const struct npattn_tensor *grads[2] = {&bp->dk, &bp->dv};
    const int64_t n_batch = npattn_n_batch(p);
    for (int t = 0; t < 2; t++) {
        const int64_t es = (int64_t)npattn_dtype_size(grads[t]->dtype), w = t ? p->n_embd_v : p->n_embd_k;
        for (int64_t b = 0; b < n_batch; b++)
            for (int64_t h = 0; h < p->n_head_kv; h++)
                for (int64_t j = 0; j < p->n_key; j++)
                    for (int64_t e = 0; e < w; e++)
                        npattn_store_f64(grads[t]->dtype, zero, 1,
                                         npattn_elem(grads[t], es, npattn_batch_offset(p, grads[t], b), h, j) +
                                             e * grads[t]->col_stride * es,
                                         1);
    }
}

/* Tiles: the group's heads stacked with query rows, as in the forward pass. */
static void plan_tiles(struct bwd_plan *pl, const struct npattn_backward_problem *bp) {
    const struct npattn_problem *p = &bp->fwd;
    memset(pl, 0, sizeof *pl);
    pl->bp = bp;
    pl->band = npattn_band_of(p);
    pl->f64 = npattn_computes_f64(p, bp->dq.dtype);
    pl->group = p->n_head_q / p->n_head_kv;
    pl->bh = min64(pl->group, BWD_ROWS);
    pl->n_hblock = (pl->group + pl->bh - 1) / pl->bh;
    pl->bq = max64(1, min64(max64(p->n_query, 1), BWD_ROWS / pl->bh));
}

/* The products' path, and the pairs' leading dimensions. */
static void plan_products(struct bwd_plan *pl) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const struct npattn_kernels *kn = npattn_kernels();
    const enum npattn_dtype b16 = NPATTN_DTYPE_BF16;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, M = pl->bh * pl->bq;
    const int bf16 = !pl->f64 && kn->scores_bf16 && p->q.dtype == b16 && p->k.dtype == b16 && p->v.dtype == b16 &&
                     bp->dout.dtype == b16 && p->k.col_stride == 1 && p->v.col_stride == 1 && D > 0 && Dv > 0 &&
                     D % kn->bf16_d_step == 0 && Dv % kn->bf16_d_step == 0;
    pl->path = !bf16 ? BWD_PATH_GEMM
               : kn->accumulate_bf16 && p->precision == NPATTN_PRECISION_FAST ? BWD_PATH_BF16_FAST
                                                                              : BWD_PATH_BF16;
    const int64_t step = max64(2, kn->bf16_d_step);
    pl->ldm2 = (M + 15) / 16 * 16, pl->ldd2 = (D + 15) / 16 * 16, pl->ldv2 = (Dv + 15) / 16 * 16;
    pl->m16 = (M + step - 1) / step * step;
}

/* Key blocks sized for OpenBLAS's small-matrix path (or, with no OpenBLAS
 * product, as the bfloat16 products ran best), chunks of them, the units
 * (a kv head of a batch slice that the gradients keep, its repeats those
 * of the summed dims), and which of K and V BLAS reads in place. */
static void plan_keys(struct bwd_plan *pl) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, S = p->n_key, width = max64(D, max64(Dv, 1));
    pl->bk = pl->path == BWD_PATH_BF16_FAST ? BWD_KEYS_BF16 : BWD_FLOPS_BUDGET / (pl->bh * pl->bq * width) / 16 * 16;
    pl->bk = min64(BWD_KEYS_MAX, max64(BWD_KEYS_MIN, pl->bk));
    pl->n_kblock = (S + pl->bk - 1) / pl->bk;
    pl->chunk = max64(1, BWD_CHUNK_BYTES / (pl->bk * 2 * width * (pl->f64 ? 8 : 4)));
    pl->n_rep = 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++)
        if (bwd_summed(bp, d)) pl->n_rep *= p->batch_shape[d];
    pl->n_unit = npattn_n_batch(p) / pl->n_rep * p->n_head_kv;
    enum npattn_dtype computed = pl->f64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    pl->k_direct = npattn_blas_direct(&p->k, computed, S, D, &pl->ldk);
    pl->v_direct = Dv > 0 && npattn_blas_direct(&p->v, computed, S, Dv, &pl->ldv);
}

/* Threads planned as the forward pass plans them; a unit's key blocks split
 * when there are fewer units than threads (each split then keeps its dQ
 * apart), unless the unit sums repeats, whose dQ would need a partial per
 * repeat. */
static struct npattn_threads plan_split(struct bwd_plan *pl) {
    const struct npattn_problem *p = &pl->bp->fwd;
    const int64_t L = p->n_query, S = p->n_key, width = max64(p->n_embd_k, max64(p->n_embd_v, 1));
    double pairs = 0;
    for (int64_t kb = 0; kb < pl->n_kblock; kb++) {
        int64_t j0 = kb * pl->bk, ia, ib;
        npattn_band_rows(&pl->band, j0, min64(S, j0 + pl->bk), L, &ia, &ib);
        pairs += (double)(ib - ia) * (double)min64(pl->bk, S - j0);
    }
    double flops = 10.0 * pairs * (double)width * (double)pl->group * (double)(pl->n_unit * pl->n_rep);
    const struct npattn_threads threads = npattn_plan_threads(flops, NPATTN_WAKE, flops / NPATTN_GRAIN, p->n_threads);
    pl->n_split = 1;
    if (pl->n_unit < threads.plan && pl->n_kblock > 1 && pl->n_rep == 1)
        pl->n_split = min64(pl->n_kblock, (2 * (int64_t)threads.plan + pl->n_unit - 1) / pl->n_unit);
    return threads;
}

/* The call's memory: each slot's scratch (its reduce rows too), and
 * split-K's dQ parts (n_task < 2 threads + n_unit: a few copies of one head
 * group's dQ) with the units' counts of tasks left after them (n_unit <=
 * n_task). */
static enum npattn_status plan_memory(struct bwd_plan *pl, int64_t n_task, int32_t n_slot) {
    const struct npattn_problem *p = &pl->bp->fwd;
    const int64_t D = p->n_embd_k;
    pl->lay = layout_of(pl, pl->f64 ? sizeof(double) : sizeof(float), pl->path, pl->k_direct, pl->v_direct);
    pl->lay64 = pl->f64 ? pl->lay : layout_of(pl, sizeof(double), BWD_PATH_GEMM, 0, 0);
    size_t slot_bytes = (size_t)max64((int64_t)pl->lay.size, (int64_t)((size_t)D * sizeof(double)));
    enum npattn_status status = npattn_slots_alloc(&pl->slots, n_slot, slot_bytes, pl->f64 ? 0 : pl->lay64.size);
    if (status != NPATTN_STATUS_OK || pl->n_split == 1) return status;
    size_t each = (size_t)(pl->group * p->n_query * D);
    if (each + 1 > SIZE_MAX / sizeof(double) / (size_t)n_task) return NPATTN_STATUS_NO_MEMORY;
    pl->dq_parts = npattn_alloc((each * (size_t)n_task + (size_t)pl->n_unit) * sizeof(double));
    if (!pl->dq_parts) return NPATTN_STATUS_NO_MEMORY;
    pl->parts_left = (_Atomic int64_t *)(pl->dq_parts + each * (size_t)n_task);
    npattn_parts_init(pl->parts_left, pl->n_unit, pl->n_split);
    return NPATTN_STATUS_OK;
}

/* Plans the call in stages (tiles, products, keys and units, split,
 * memory) and runs its tasks on the pool. */
enum npattn_status npattn_sdpa_backward(const struct npattn_backward_problem *bp) {
    enum npattn_status status = npattn_check_backward(bp, NULL);
    if (status != NPATTN_STATUS_OK) return status;
    if (!npattn_blas_ok()) return NPATTN_STATUS_BLAS_WRONG;
    const struct npattn_problem *p = &bp->fwd;
    if (npattn_n_batch(p) == 0) return NPATTN_STATUS_OK;
    if (p->n_head_q == 0) {
        zero_kv_grads(bp);
        return NPATTN_STATUS_OK;
    }
    struct bwd_plan pl;
    plan_tiles(&pl, bp);
    plan_products(&pl);
    plan_keys(&pl);
    const struct npattn_threads threads = plan_split(&pl);
    const int64_t n_task = pl.n_unit * pl.n_split;
    const int32_t n_slot = (int32_t)min64(threads.run, n_task);
    status = plan_memory(&pl, n_task, n_slot);
    if (status == NPATTN_STATUS_OK) {
        npattn_blas_init();
        npattn_run_init(&pl.run, p->cancel, p->cancel_arg);
        status = npattn_pool_run(run_task, &pl, n_task, n_slot, &pl.run);
    }
    npattn_free(pl.dq_parts);
    npattn_slots_free(&pl.slots);
    return status;
}

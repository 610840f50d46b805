/* tile_bwd.h: one task of the backward pass, written once for both computed
 * types; backward.c includes it twice through reals.h, REAL = float and
 * REAL = double, the double copy also being the exact path of a float task
 * that met an extreme.
 *
 * FlashAttention-2's backward (arXiv:2307.08691, Algorithm 2): a task owns
 * one kv head g of one slice of the batch that the gradients keep, visiting
 * in order every batch entry the summed dims (a gradient's batch stride 0)
 * map onto it, or, split-K, a share of one entry's key blocks. Per entry,
 * it takes its keys a chunk at a time, keeping the chunk's dK and dV in
 * scratch, and visits the query rows the band lets see the chunk, the
 * group's heads stacked as in the forward pass; each query tile is read once
 * per chunk, and for each key block j of the chunk:
 *
 *     S^T  = K_j Q_i^T                       the scores again
 *     P^T  = exp(S^T - lse_i)                from the forward pass's lse
 *     dV_j += P^T dO_i
 *     dP^T = V_j dO_i^T
 *     dS^T = P^T * (dP^T - D_i) * cap',  D_i = rowsum(dO_i * O_i)
 *     dK_j += scale dS^T Q_i
 *     dQ_i += scale dS K_j
 *
 * cap' = 1 - tanh(s / softcap)^2 with a softcap, 1 without. dQ rows are
 * owned by the task too (a query head reads only its group's kv head), so
 * nothing is added by two threads: the same `threads` gives bitwise-identical
 * gradients. A summed gradient's slice is stored by the task's first entry
 * that reaches it and added to by the later ones. A split-K task adds its dQ
 * into a private partial, summed in split order afterwards.
 */

/* Adds the tile (M, w) into the stacked rows of t (or of a partial laid out
 * (group, L, w) when part is given), converting when t's dtype is not REAL's. */
static void CAT(add_rows_, SFX)(const struct npattn_tensor *t, int64_t off, int64_t h0, int64_t hg0, int64_t i0,
                                int64_t nq, int64_t M, int64_t w, int64_t L, const REAL *tile, double *part,
                                REAL *row) {
    const int f64 = sizeof(REAL) == sizeof(double);
    const int64_t es = (int64_t)npattn_dtype_size(t->dtype);
    for (int64_t r = 0; r < M; r++) {
        const REAL *src = tile + r * w;
        if (part) {
            double *dst = part + ((h0 - hg0 + r / nq) * L + i0 + r % nq) * w;
            for (int64_t e = 0; e < w; e++) dst[e] += (double)src[e];
            continue;
        }
        char *at = npattn_elem(t, es, off, h0 + r / nq, i0 + r % nq);
        if (t->dtype == (f64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32)) {
            REAL *dst = (REAL *)at;
#if !IS_F64
            if (t->col_stride == 1) { /* (a strided loop the compiler leaves scalar) */
                npattn_kernels()->add_f32(dst, src, w);
                continue;
            }
#endif
            for (int64_t e = 0; e < w; e++) dst[e * t->col_stride] += src[e];
        } else {
            LOAD(t->dtype, at, t->col_stride, w, row);
            for (int64_t e = 0; e < w; e++) row[e] += src[e];
            STORE(t->dtype, row, w, at, t->col_stride);
        }
    }
}

/* Writes a finished row of w elements into t at `at`: stored when `first`, else
 * added to what an earlier repeat stored there; converting when t's dtype is
 * not REAL's. */
static void CAT(put_row_, SFX)(const struct npattn_tensor *t, char *at, const REAL *src, int64_t w, int first,
                               REAL *row) {
    if (first) {
        STORE(t->dtype, src, w, at, t->col_stride);
        return;
    }
    LOAD(t->dtype, at, t->col_stride, w, row);
    for (int64_t e = 0; e < w; e++) row[e] += src[e];
    STORE(t->dtype, row, w, at, t->col_stride);
}

/* One batch entry of a task: where its operands are, its scratch, and the
 * chunk of keys, the query tile and the key block at hand. */
struct CAT(bwd_task_, SFX) {
    int64_t b, rep, g, hg0, split;   /* batch entry, the task's repeat, kv head and its first query head, split */
    int32_t slot;
    double *part;                    /* split-K: the task's dQ partial; else NULL */
    struct npattn_band band;         /* the request's band */
    int64_t k0, k1;                  /* the keys the request reads */
    int64_t kb_begin, kb_end;        /* the task's key blocks */
    int k_direct, v_direct;          /* BLAS reads K / V in place */
    int dk_first, dv_first;          /* the repeat that stores dK's (dV's) slice rather than adds to it */
    REAL scale, cap, ds_scale, alpha; /* dS's factor, and its products' (one of the two is 1) */
    REAL *qrows, *dorows, *orows, *qt, *dot, *st, *dpt, *dcap, *bias, *kt, *vt, *dk, *dv, *dq;
    REAL *lse, *mt, *lt, *at, *dvec, *row;
    int32_t *lo, *hi;
    uint32_t *qp, *dop, *qm, *dom, *dsk, *kp; /* float: Q's and dO's pairs along D (Dv) and along the rows, dS's
                                                 along the keys, K's chunk's along the keys */
    uint16_t *pbf, *dsbf;            /* float: P^T and dS^T as bfloat16 */
    float *prod;                     /* float: a block's dK or dV terms */
    int64_t off_q, off_o, off_do, off_dq, off_dk, off_dv, off_lse, off_mask; /* batch offsets, in elements */
    struct npattn_kv kk, vv;         /* K's and V's rows of the entry's kv head */
    /* the chunk: key blocks kc .. kc_end, keys c0 .. c1, K's and V's rows (ldk, ldv apart) */
    int64_t kc, kc_end, c0, c1, nc, ldk, ldv;
    const REAL *kchunk, *vchunk;
    int kv_finite, chunk16;          /* its rows all finite (double); its rows for the dot products (float) */
    /* the query tile: heads h0 .. h0 + nh - 1, rows i0 .. i0 + nq - 1, M stacked */
    int64_t h0, nh, i0, nq, M;
    int careful;                     /* operands not all finite: the products leave hidden pairs out */
    int tile16, fast16;              /* S^T and dP^T as dot products; and the three others ("fast") */
    REAL ds_by;                      /* dS's factor */
    SCORE_TILE tile;
};

/* The entry's band and key blocks, its scratch, where its operands are, and
 * whether it stores or adds the summed gradients' slices. A float tile
 * scales dS before its products with Q and K when |scale| > 1: products of
 * tiny dS and tiny q or k taken first would underflow where the scaled ones
 * are normal (an overflow instead is redone in double). */
static void CAT(entry_begin_, SFX)(struct bwd_plan *pl, int64_t b, int64_t rep, int64_t g, int64_t split, double *part,
                                   int32_t slot, char *scratch, struct CAT(bwd_task_, SFX) *s) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int f64 = sizeof(REAL) == sizeof(double);
    const struct bwd_layout *lay = f64 ? &pl->lay64 : &pl->lay;
    s->b = b, s->rep = rep, s->g = g, s->hg0 = g * pl->group, s->split = split, s->part = part, s->slot = slot;
    s->band = npattn_band_request(p, &pl->band, b, &s->k0, &s->k1);
    const int64_t n_kblock = (s->k1 - s->k0 + pl->bk - 1) / pl->bk;
    s->kb_begin = n_kblock * split / pl->n_split, s->kb_end = n_kblock * (split + 1) / pl->n_split;
    s->k_direct = f64 == pl->f64 && pl->k_direct, s->v_direct = f64 == pl->f64 && pl->v_direct;
    s->scale = (REAL)p->scale, s->cap = (REAL)p->softcap;
    const int scale_first = !f64 && fabs(p->scale) > 1;
    s->ds_scale = scale_first ? s->scale : (REAL)1, s->alpha = scale_first ? (REAL)1 : s->scale;
#define AT(type, region) ((type *)(scratch + lay->region))
    s->qrows = AT(REAL, qrows), s->dorows = AT(REAL, dorows), s->orows = AT(REAL, orows), s->qt = AT(REAL, qt);
    s->dot = AT(REAL, dot), s->st = AT(REAL, st), s->dpt = AT(REAL, dpt), s->dcap = AT(REAL, dcap);
    s->bias = AT(REAL, bias), s->kt = AT(REAL, kt), s->vt = AT(REAL, vt), s->dk = AT(REAL, dk), s->dv = AT(REAL, dv);
    s->dq = AT(REAL, dq), s->lse = AT(REAL, lse), s->mt = AT(REAL, m), s->lt = AT(REAL, l), s->at = AT(REAL, alpha);
    s->dvec = AT(REAL, dvec), s->row = AT(REAL, row), s->lo = AT(int32_t, lo), s->hi = AT(int32_t, hi);
    s->qp = AT(uint32_t, qp), s->dop = AT(uint32_t, dop), s->qm = AT(uint32_t, qm), s->dom = AT(uint32_t, dom);
    s->dsk = AT(uint32_t, dsk), s->kp = AT(uint32_t, kp), s->pbf = AT(uint16_t, pbf), s->dsbf = AT(uint16_t, dsbf);
    s->prod = AT(float, prod);
#undef AT
    s->off_q = npattn_batch_offset(p, &p->q, b), s->off_o = npattn_batch_offset(p, &p->out, b);
    s->off_do = npattn_batch_offset(p, &bp->dout, b), s->off_dq = npattn_batch_offset(p, &bp->dq, b);
    s->off_dk = npattn_batch_offset(p, &bp->dk, b), s->off_dv = npattn_batch_offset(p, &bp->dv, b);
    s->off_lse = npattn_batch_offset(p, &p->lse, b);
    s->off_mask = p->mask_kind != NPATTN_MASK_NONE ? npattn_batch_offset(p, &p->mask, b) : 0;
    s->dk_first = bwd_first_visit(pl, &bp->dk, rep), s->dv_first = bwd_first_visit(pl, &bp->dv, rep);
    const int64_t ks = (int64_t)npattn_dtype_size(p->k.dtype), vs = (int64_t)npattn_dtype_size(p->v.dtype);
    const int64_t off_k = npattn_batch_offset(p, &p->k, b), off_v = npattn_batch_offset(p, &p->v, b);
    const struct npattn_kv kk = {.base = p->n_key > 0 ? npattn_elem(&p->k, ks, off_k, g, 0) : NULL,
                                 .row_bytes = p->k.row_stride * ks};
    const struct npattn_kv vv = {.base = p->n_key > 0 && p->n_embd_v > 0 ? npattn_elem(&p->v, vs, off_v, g, 0) : NULL,
                                 .row_bytes = p->v.row_stride * vs};
    s->kk = kk, s->vv = vv;
    SCORE_TILE tile = {.scale = s->scale, .softcap = s->cap};
    s->tile = tile;
}

/* Keys the request never reads: zero gradients, stored by the first repeat
 * to reach the slice (a later one adds nothing there). */
static void CAT(zero_unread_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s) {
    const struct npattn_backward_problem *bp = pl->bp;
    const int64_t D = bp->fwd.n_embd_k, Dv = bp->fwd.n_embd_v, S = bp->fwd.n_key, k0 = s->k0, k1 = s->k1;
    if (s->split != 0 || !(k0 > 0 || k1 < S) || !(s->dk_first || s->dv_first)) return;
    const int64_t dks = (int64_t)npattn_dtype_size(bp->dk.dtype), dvs = (int64_t)npattn_dtype_size(bp->dv.dtype);
    memset(s->row, 0, (size_t)max64(D, Dv) * sizeof *s->row);
    for (int64_t j = k0 > 0 ? 0 : k1; j < S; j = j + 1 == k0 ? k1 : j + 1) {
        if (s->dk_first)
            STORE(bp->dk.dtype, s->row, D, npattn_elem(&bp->dk, dks, s->off_dk, s->g, j), bp->dk.col_stride);
        if (Dv > 0 && s->dv_first)
            STORE(bp->dv.dtype, s->row, Dv, npattn_elem(&bp->dv, dvs, s->off_dv, s->g, j), bp->dv.col_stride);
    }
}

/* A chunk of key blocks, kc on: keys c0 .. c1, read (converted if need be)
 * once, and its dK and dV zeroed. A double chunk whose rows are not all
 * finite leaves hidden pairs out of its products. A float chunk takes K's
 * and V's bfloat16 rows in place for the dot products, unless they hold a
 * subnormal value (read as 0 there); and K's pairs along the keys for dQ,
 * from its own rows, once a chunk (a block's start is even: bk is) rather
 * than once a block and query tile. */
static void CAT(chunk_begin_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t kc) {
    const struct npattn_problem *p = &pl->bp->fwd;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v;
    int in_place;
    s->kc = kc, s->kc_end = kc + pl->chunk < s->kb_end ? kc + pl->chunk : s->kb_end;
    s->c0 = s->k0 + kc * pl->bk, s->c1 = min64(s->k0 + s->kc_end * pl->bk, s->k1), s->nc = s->c1 - s->c0;
    const int64_t c0 = s->c0, nc = s->nc;
    s->ldv = 1;
    s->kchunk = CAT(kv_rows_, SFX)(&p->k, &s->kk, c0, nc, D, s->k_direct, pl->ldk, s->kt, &s->ldk, &in_place);
    s->vchunk =
        Dv > 0 ? CAT(kv_rows_, SFX)(&p->v, &s->vv, c0, nc, Dv, s->v_direct, pl->ldv, s->vt, &s->ldv, &in_place) : s->vt;
    s->kv_finite = !IS_F64 || (CAT(rows_finite_, SFX)(s->kchunk, nc, D, s->ldk) &&
                               (Dv == 0 || CAT(rows_finite_, SFX)(s->vchunk, nc, Dv, s->ldv)));
    s->chunk16 = 0;
#if !IS_F64
    s->chunk16 = pl->path != BWD_PATH_GEMM && !rows_subnormal(s->kchunk, nc, D, s->ldk) &&
                 !rows_subnormal(s->vchunk, nc, Dv, s->ldv);
    if (s->chunk16 && pl->path == BWD_PATH_BF16_FAST) npattn_pairs_of_kv(&s->kk, c0, nc, D, s->kp, pl->ldd2);
#endif
    memset(s->dk, 0, (size_t)(nc * D) * sizeof(REAL));
    memset(s->dv, 0, (size_t)(nc * Dv) * sizeof(REAL));
}

/* The query tile's rows: Q, dO and O stacked, D_i = rowsum(dO_i * O_i), and
 * the lse, at which the running max starts. A double tile whose operands
 * are not all finite is careful. */
static void CAT(query_rows_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t h0, int64_t nh,
                                  int64_t i0) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, L = p->n_query, ls = (int64_t)npattn_dtype_size(p->lse.dtype);
    const int64_t nq = L - i0 < pl->bq ? L - i0 : pl->bq, M = nh * nq;
    s->h0 = h0, s->nh = nh, s->i0 = i0, s->nq = nq, s->M = M;
    CAT(stacked_rows_, SFX)(&p->q, s->off_q, h0, i0, nq, M, D, s->qrows);
    CAT(stacked_rows_, SFX)(&bp->dout, s->off_do, h0, i0, nq, M, Dv, s->dorows);
    CAT(stacked_rows_, SFX)(&p->out, s->off_o, h0, i0, nq, M, Dv, s->orows);
    for (int64_t r = 0; r < M; r++) {
        REAL sum = 0;
        for (int64_t e = 0; e < Dv; e++) sum += s->dorows[r * Dv + e] * s->orows[r * Dv + e];
        s->dvec[r] = sum;
        LOAD(p->lse.dtype, npattn_elem(&p->lse, ls, s->off_lse, h0 + r / nq, i0 + r % nq), 1, 1, s->lse + r);
    }
    s->careful = !s->kv_finite || (IS_F64 && !(CAT(rows_finite_, SFX)(s->qrows, M, D, D) &&
                                               CAT(rows_finite_, SFX)(s->dorows, M, Dv, Dv) &&
                                               CAT(rows_finite_, SFX)(s->orows, M, Dv, Dv) &&
                                               CAT(rows_finite_, SFX)(s->lse, M, 1, 1)));
}

/* The query tile's operands for its products: a float tile of a chunk
 * for the dot products takes Q's and dO's pairs (exact: their values are
 * bfloat16), and under "fast" their pairs along the rows too, zeros to m16,
 * dS then scaled whole before its pairs (one of ds_scale and alpha is 1, so
 * this rounds as scaling by one and then the other did). Else Q^T and dO^T
 * for the gemms, which then read K and V in place as plain NoTrans
 * products, a form OpenBLAS's small-matrix kernels take (K Q^T as a Trans
 * one was packed: 42% of a backward's time). */
static void CAT(query_operands_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s) {
    const struct npattn_backward_problem *bp = pl->bp;
    const int64_t D = bp->fwd.n_embd_k, Dv = bp->fwd.n_embd_v, M = s->M;
    s->tile16 = s->fast16 = 0;
    s->ds_by = s->ds_scale;
#if !IS_F64
    const int64_t h0 = s->h0, i0 = s->i0, nq = s->nq, ldm2 = pl->ldm2, ldd2 = pl->ldd2, ldv2 = pl->ldv2, m16 = pl->m16;
    s->tile16 = s->chunk16 && !s->careful &&
                (npattn_word_pairs(&bp->fwd.q, s->off_q, h0, i0, nq, M, D, s->qp, ldm2) ||
                 !npattn_pairs_across(s->qrows, M, D, D, s->qp, ldm2)) &&
                (npattn_word_pairs(&bp->dout, s->off_do, h0, i0, nq, M, Dv, s->dop, ldm2) ||
                 !npattn_pairs_across(s->dorows, M, Dv, Dv, s->dop, ldm2));
    if (s->tile16 && pl->path == BWD_PATH_BF16_FAST) {
        s->fast16 = 1;
        s->ds_by = s->ds_scale * s->alpha;
        npattn_pairs_of_rows(s->qrows, M, D, D, s->qm, ldd2);
        npattn_pairs_of_rows(s->dorows, M, Dv, Dv, s->dom, ldv2);
        const int64_t from = (M + 1) / 2;
        memset(s->qm + from * ldd2, 0, (size_t)((m16 / 2 - from) * ldd2) * sizeof *s->qm);
        memset(s->dom + from * ldv2, 0, (size_t)((m16 / 2 - from) * ldv2) * sizeof *s->dom);
    }
#endif
    if (!s->tile16) {
        CAT(transpose_, SFX)(s->qrows, D, M, D, s->qt, M);
        CAT(transpose_, SFX)(s->dorows, Dv, M, Dv, s->dot, M);
    }
}

/* P^T of key block [j0, j0 + nk): S^T (nk, M) = K_j (nk, D) @ Q^T (D, M),
 * the cap's derivative cap' = 1 - tanh(s / cap)^2 from the raw scores, the
 * mask and the band, then exp(S^T - lse): the forward step with the max
 * preset to lse. In a careful double tile a NaN lse makes its whole column
 * NaN: the row's hidden keys stay 0. Returns 1 when the task goes to double. */
static int CAT(block_probs_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = &pl->bp->fwd;
    const int64_t D = p->n_embd_k, M = s->M;
    REAL *st = s->st;
#if !IS_F64
    int64_t run;
    if (s->tile16)
        npattn_kernels()->scores_bf16(s->qp, pl->ldm2, M, D / 2, (const uint16_t *)npattn_kv_row(&s->kk, j0, &run),
                                      s->kk.row_bytes / 2, nk, st, M);
    else
#endif
        GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)D, (REAL)1,
             s->kchunk + (j0 - s->c0) * s->ldk, (int)s->ldk, s->qt, (int)M, (REAL)0, st, (int)M);
    if (s->cap > 0)
        for (int64_t x = 0; x < nk * M; x++) {
            REAL t = (REAL)tanh((double)(st[x] * s->scale / s->cap));
            s->dcap[x] = 1 - t * t;
        }
    s->tile.nk = nk, s->tile.M = M, s->tile.ld = M, s->tile.bias = NULL;
    if (p->mask_kind != NPATTN_MASK_NONE) {
        if (CAT(mask_tile_, SFX)(p, s->off_mask, s->h0, s->i0, s->nq, M, j0, nk, s->bias, M, 1, s->row)) return 1;
        s->tile.bias = s->bias;
    }
    int clipped = npattn_band_clip(&s->band, s->i0, s->nq, M, j0, nk, s->lo, s->hi);
    s->tile.lo = clipped ? s->lo : NULL, s->tile.hi = clipped ? s->hi : NULL;
    for (int64_t r = 0; r < M; r++) s->mt[r] = s->lse[r], s->lt[r] = 0;
#if IS_F64
    npattn_softmax_f64(st, &s->tile, s->mt, s->lt, s->at);
    if (s->careful)
        for (int64_t j = 0; j < nk; j++)
            for (int64_t r = 0; r < M; r++)
                if (CAT(hidden_, SFX)(&s->tile, j, r)) st[j * M + r] = 0;
    return 0;
#else
    return npattn_kernels()->softmax_f32(st, &s->tile, s->mt, s->lt, s->at) != 0;
#endif
}

/* dV_j (nk, Dv) += P^T (nk, M) @ dO (M, Dv), and dP^T (nk, M) = V_j (nk, Dv)
 * @ dO^T (Dv, M), each as the tile's path takes it. */
static void CAT(block_dv_dp_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const int64_t Dv = pl->bp->fwd.n_embd_v, M = s->M;
    if (Dv == 0) {
        memset(s->dpt, 0, (size_t)(nk * M) * sizeof(REAL));
        return;
    }
    REAL *dvj = s->dv + (j0 - s->c0) * Dv;
#if !IS_F64
    const struct npattn_kernels *kn = npattn_kernels();
#endif
    if (s->careful)
        CAT(seen_product_, SFX)(&s->tile, s->st, 0, s->dorows, Dv, Dv, (REAL)1, dvj, Dv);
#if !IS_F64
    else if (s->fast16 && !npattn_bf16_rows(s->st, nk, M, M, s->pbf, pl->m16))
        add_product(kn, s->dom, pl->ldv2, Dv, pl->m16, s->pbf, nk, s->prod, dvj);
#endif
    else
        GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)Dv, (int)M, (REAL)1, s->st, (int)M, s->dorows,
             (int)Dv, (REAL)1, dvj, (int)Dv);
#if !IS_F64
    int64_t run;
    if (s->tile16)
        kn->scores_bf16(s->dop, pl->ldm2, M, Dv / 2, (const uint16_t *)npattn_kv_row(&s->vv, j0, &run),
                        s->vv.row_bytes / 2, nk, s->dpt, M);
    else
#endif
        GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)Dv, (REAL)1,
             s->vchunk + (j0 - s->c0) * s->ldv, (int)s->ldv, s->dot, (int)M, (REAL)0, s->dpt, (int)M);
}

/* dS^T = P^T * (dP^T - D) * cap', in place of dP^T, times the scale here
 * (ds_by) or in the products. D_i = dO_i . O_i against dO_i . v_j cancels
 * where P_ij is near 1 (a near one-hot row), and what is left is their
 * rounding, which the scale then magnifies; there dP_ij - D_i is taken as
 * dO_i . (v_j - O_i), exactly 0 for a one-hot row. A row may hold a weight
 * >= 1/2 only if the tile's weights sum to 1/2 or more (l, against the max
 * preset to lse) or a score passed lse. A careful tile's hidden keys get a
 * dS of 0, not 0 * a NaN dP or D. */
static void CAT(block_ds_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const int64_t Dv = pl->bp->fwd.n_embd_v, M = s->M;
    const REAL *st = s->st, *dvec = s->dvec, *dcap = s->dcap, cap = s->cap, ds_by = s->ds_by;
    REAL *dpt = s->dpt;
    for (int64_t j = 0; j < nk; j++) {
        REAL *ds = dpt + j * M;
        const REAL *pj = st + j * M, *cj = dcap + j * M;
        if (cap > 0)
            for (int64_t r = 0; r < M; r++) ds[r] = pj[r] * (ds[r] - dvec[r]) * cj[r] * ds_by;
        else
            for (int64_t r = 0; r < M; r++) ds[r] = pj[r] * (ds[r] - dvec[r]) * ds_by;
        if (s->careful)
            for (int64_t r = 0; r < M; r++)
                if (CAT(hidden_, SFX)(&s->tile, j, r)) ds[r] = 0;
    }
    const REAL *vtile = s->vchunk + (j0 - s->c0) * s->ldv;
    for (int64_t r = 0; r < M; r++) {
        if (!(s->lt[r] >= (REAL)0.5 || s->mt[r] != s->lse[r])) continue;
        for (int64_t j = 0; j < nk; j++) {
            const REAL pjr = st[j * M + r];
            if (!(pjr >= (REAL)0.5)) continue;
            const REAL *vj = vtile + j * s->ldv;
            double gap = 0;
            for (int64_t e = 0; e < Dv; e++)
                gap += (double)s->dorows[r * Dv + e] * ((double)vj[e] - (double)s->orows[r * Dv + e]);
            dpt[j * M + r] = pjr * (REAL)gap * (cap > 0 ? dcap[j * M + r] : (REAL)1) * ds_by;
        }
    }
}

/* dK_j (nk, D) += dS^T (nk, M) @ Q (M, D), and dQ (M, D) += dS (M, nk) @ K_j
 * (nk, D) over the chunk's blocks (the first block's writes dQ). Careful:
 * the products of the pairs the tile shows. "fast": dS scaled (ds_by), then
 * its pairs both ways, dK's along the rows and dQ's along the keys. */
static void CAT(block_dk_dq_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t j0, int64_t nk,
                                   int first) {
    const int64_t D = pl->bp->fwd.n_embd_k, M = s->M;
    const REAL *ktile = s->kchunk + (j0 - s->c0) * s->ldk;
    REAL *dkj = s->dk + (j0 - s->c0) * D, *dpt = s->dpt;
    if (s->careful) {
        if (first) memset(s->dq, 0, (size_t)(M * D) * sizeof(REAL));
        CAT(seen_product_, SFX)(&s->tile, dpt, 0, s->qrows, D, D, s->alpha, dkj, D);
        CAT(seen_product_, SFX)(&s->tile, dpt, 1, ktile, s->ldk, D, s->alpha, s->dq, D);
        return;
    }
    REAL ds_alpha = s->alpha;
#if !IS_F64
    if (s->fast16) {
        ds_alpha = 1;
        if (!npattn_bf16_rows(dpt, nk, M, M, s->dsbf, pl->m16) &&
            !npattn_pairs_of_rows(dpt, nk, M, M, s->dsk, pl->ldm2)) {
            const struct npattn_kernels *kn = npattn_kernels();
            if (first) memset(s->dq, 0, (size_t)(M * D) * sizeof(REAL));
            add_product(kn, s->qm, pl->ldd2, D, pl->m16, s->dsbf, nk, s->prod, dkj);
            kn->accumulate_bf16(s->dsk, pl->ldm2, M, (nk + 1) / 2, s->kp + (j0 - s->c0) / 2 * pl->ldd2, pl->ldd2, D,
                                s->dq);
            return;
        }
    }
#endif
    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)D, (int)M, ds_alpha, dpt, (int)M, s->qrows, (int)D,
         (REAL)1, dkj, (int)D);
    GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)M, (int)D, (int)nk, ds_alpha, dpt, (int)M, ktile, (int)s->ldk,
         (REAL)(first ? 0 : 1), s->dq, (int)D);
}

/* One key block kb of the chunk against the query tile, unless no row of
 * the tile sees it; *first: no block has written dQ yet. Returns 1 when the
 * task goes to double. */
static int CAT(key_block_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t kb, int *first) {
    const int64_t j0 = s->k0 + kb * pl->bk, nk = min64(s->k1 - j0, pl->bk);
    int64_t ja, jb;
    npattn_band_rows(&s->band, j0, j0 + nk, pl->bp->fwd.n_query, &ja, &jb);
    if (jb <= s->i0 || ja >= s->i0 + s->nq) return 0;
    if (CAT(block_probs_, SFX)(pl, s, j0, nk)) return 1;
    CAT(block_dv_dp_, SFX)(pl, s, j0, nk);
    CAT(block_ds_, SFX)(pl, s, j0, nk);
    CAT(block_dk_dq_, SFX)(pl, s, j0, nk, *first);
    *first = 0;
    return 0;
}

/* One query tile (heads h0 .. h0 + nh - 1, rows from i0) against the
 * chunk's key blocks, its dQ then added into dq (or the partial). Returns 1
 * when the task goes to double. */
static int CAT(query_tile_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s, int64_t h0, int64_t nh,
                                 int64_t i0) {
    const struct npattn_backward_problem *bp = pl->bp;
    CAT(query_rows_, SFX)(pl, s, h0, nh, i0);
    CAT(query_operands_, SFX)(pl, s);
    int first = 1;
    for (int64_t kb = s->kc; kb < s->kc_end; kb++)
        if (CAT(key_block_, SFX)(pl, s, kb, &first)) return 1;
    if (first) return 0; /* no block of the chunk seen by this tile */
    const int64_t D = bp->fwd.n_embd_k;
#if !IS_F64
    if (!npattn_all_finite_f32(s->dq, s->M * D)) return 1;
#endif
    CAT(add_rows_, SFX)(&bp->dq, s->off_dq, h0, s->hg0, i0, s->nq, s->M, D, bp->fwd.n_query, s->dq, s->part, s->row);
    return 0;
}

/* The entry's share of the chunk's dK and dV is complete (no other task has
 * its keys): stored by the first repeat to reach the slice, added by the
 * later ones. Returns 1 when a float accumulator overflowed. */
static int CAT(chunk_end_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s) {
    const struct npattn_backward_problem *bp = pl->bp;
    const int64_t D = bp->fwd.n_embd_k, Dv = bp->fwd.n_embd_v, nc = s->nc;
#if !IS_F64
    if (!npattn_all_finite_f32(s->dk, nc * D) || !npattn_all_finite_f32(s->dv, nc * Dv)) return 1;
#endif
    const int64_t dks = (int64_t)npattn_dtype_size(bp->dk.dtype), dvs = (int64_t)npattn_dtype_size(bp->dv.dtype);
    for (int64_t j = 0; j < nc; j++) {
        CAT(put_row_, SFX)(&bp->dk, npattn_elem(&bp->dk, dks, s->off_dk, s->g, s->c0 + j), s->dk + j * D, D,
                           s->dk_first, s->row);
        if (Dv > 0)
            CAT(put_row_, SFX)(&bp->dv, npattn_elem(&bp->dv, dvs, s->off_dv, s->g, s->c0 + j), s->dv + j * Dv, Dv,
                               s->dv_first, s->row);
    }
    return 0;
}

/* The sinks' gradient: d sum(dO * O) / d sink_h = -sum_i exp(sink_h - lse_i) D_i. */
static void CAT(sinks_grad_, SFX)(struct bwd_plan *pl, struct CAT(bwd_task_, SFX) *s) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int64_t Dv = p->n_embd_v;
    if (!p->sinks || s->split != 0) return;
    for (int64_t h = s->hg0; h < s->hg0 + pl->group; h++) {
        double sum = 0;
        for (int64_t i = 0; i < p->n_query; i++) {
            CAT(stacked_rows_, SFX)(&bp->dout, s->off_do, h, i, 1, 1, Dv, s->dorows);
            CAT(stacked_rows_, SFX)(&p->out, s->off_o, h, i, 1, 1, Dv, s->orows);
            double di = 0, lse;
            for (int64_t e = 0; e < Dv; e++) di += (double)s->dorows[e] * (double)s->orows[e];
            REAL l1;
            LOAD(p->lse.dtype, npattn_elem(&p->lse, (int64_t)npattn_dtype_size(p->lse.dtype), s->off_lse, h, i), 1, 1,
                 &l1);
            lse = (double)l1;
            if (di != 0) sum += exp(p->sinks[h] - lse) * di;
        }
        bp->dsinks[s->b * p->n_head_q + h] = -sum;
    }
}

/* Adds one batch entry b (the task's repeat `rep`) of kv head g into the
 * gradients: its dQ rows into dq (or the partial), its dK and dV into dk and
 * dv, stored where rep is the first to reach their slice, else added; a
 * chunk of keys at a time, against the query tiles the band lets see it.
 * Returns 1 when a float task must be redone in double. */
static int CAT(bwd_entry_, SFX)(struct bwd_plan *pl, int64_t b, int64_t rep, int64_t g, int64_t split, double *part,
                               int32_t slot, char *scratch) {
    const int64_t L = pl->bp->fwd.n_query;
    struct CAT(bwd_task_, SFX) s;
    CAT(entry_begin_, SFX)(pl, b, rep, g, split, part, slot, scratch, &s);
    CAT(zero_unread_, SFX)(pl, &s);
    for (int64_t kc = s.kb_begin; kc < s.kb_end; kc += pl->chunk) {
        CAT(chunk_begin_, SFX)(pl, &s, kc);
        int64_t ia, ib; /* the query rows that may see a key of this chunk */
        npattn_band_rows(&s.band, s.c0, s.c1, L, &ia, &ib);
        for (int64_t hb = 0; hb < pl->n_hblock && ia < ib; hb++) {
            const int64_t h0 = s.hg0 + hb * pl->bh, nh = min64(pl->group - hb * pl->bh, pl->bh);
            for (int64_t i0 = ia / pl->bq * pl->bq; i0 < ib; i0 += pl->bq) {
                if (npattn_run_stopped(&pl->run, slot)) return 0;
                if (CAT(query_tile_, SFX)(pl, &s, h0, nh, i0)) return 1;
            }
        }
        if (CAT(chunk_end_, SFX)(pl, &s)) return 1;
    }
    CAT(sinks_grad_, SFX)(pl, &s);
    return 0;
}

/* One task: kv head g of one unit (a slice of the batch dims the gradients keep),
 * every batch entry that the summed dims map onto it in order, or a split-K
 * share of its key blocks. Returns 1 when a float task must be redone in double. */
static int CAT(tile_bwd_, SFX)(void *plan, int64_t task, int32_t slot, char *scratch) {
    struct bwd_plan *pl = plan;
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int64_t D = p->n_embd_k, L = p->n_query;
    const int64_t unit = task / pl->n_split, split = task % pl->n_split;
    const int64_t kept = unit / p->n_head_kv, g = unit % p->n_head_kv, hg0 = g * pl->group;
    double *part = pl->dq_parts ? pl->dq_parts + (size_t)task * (size_t)(pl->group * L * D) : NULL;
    /* start clean: this task's dQ rows (or partial), every repeat's, written by += below */
    if (part) {
        memset(part, 0, (size_t)(pl->group * L * D) * sizeof *part);
    } else {
        REAL *row = (REAL *)(scratch + (sizeof(REAL) == sizeof(double) ? pl->lay64 : pl->lay).row);
        memset(row, 0, (size_t)D * sizeof *row);
        const int64_t es = (int64_t)npattn_dtype_size(bp->dq.dtype);
        for (int64_t rep = 0; rep < pl->n_rep; rep++) {
            const int64_t off_dq = npattn_batch_offset(p, &bp->dq, bwd_batch(pl, kept, rep));
            for (int64_t h = hg0; h < hg0 + pl->group; h++)
                for (int64_t i = 0; i < L; i++)
                    STORE(bp->dq.dtype, row, D, npattn_elem(&bp->dq, es, off_dq, h, i), bp->dq.col_stride);
        }
    }
    for (int64_t rep = 0; rep < pl->n_rep && !npattn_run_stopped(&pl->run, slot); rep++)
        if (CAT(bwd_entry_, SFX)(pl, bwd_batch(pl, kept, rep), rep, g, split, part, slot, scratch)) return 1;
    return 0;
}

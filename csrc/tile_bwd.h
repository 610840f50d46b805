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

/* Adds one batch entry b (the task's repeat `rep`) of kv head g into the
 * gradients: its dQ rows into dq (or the partial), its dK and dV into dk and
 * dv, stored where rep is the first to reach their slice, else added.
 * Returns 1 when a float task must be redone in double. */
static int CAT(bwd_entry_, SFX)(struct bwd_plan *pl, int64_t b, int64_t rep, int64_t g, int64_t split, double *part,
                               int32_t slot, char *scratch) {
    const struct npattn_backward_problem *bp = pl->bp;
    const struct npattn_problem *p = &bp->fwd;
    const int f64 = sizeof(REAL) == sizeof(double);
    const struct bwd_layout *lay = f64 ? &pl->lay64 : &pl->lay;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, L = p->n_query, S = p->n_key, hg0 = g * pl->group;
    int64_t k0, k1; /* the keys this request reads, and its band */
    const struct npattn_band band = npattn_band_request(p, &pl->band, b, &k0, &k1);
    const int64_t n_kblock = (k1 - k0 + pl->bk - 1) / pl->bk;
    const int k_direct = f64 == pl->f64 && pl->k_direct, v_direct = f64 == pl->f64 && pl->v_direct;
    const REAL scale = (REAL)p->scale, cap = (REAL)p->softcap;
    /* A float tile scales dS before its products with Q and K when |scale| > 1:
     * products of tiny dS and tiny q or k taken first would underflow where the
     * scaled ones are normal (an overflow instead is redone in double). */
    const int scale_first = !f64 && fabs(p->scale) > 1;
    const REAL ds_scale = scale_first ? scale : (REAL)1, alpha = scale_first ? (REAL)1 : scale;
#define AT(region) ((REAL *)(scratch + lay->region))
    REAL *qrows = AT(qrows), *dorows = AT(dorows), *orows = AT(orows), *st = AT(st), *dpt = AT(dpt);
    REAL *qt = AT(qt), *dot = AT(dot);
    REAL *dcap = AT(dcap), *bias = AT(bias), *kt = AT(kt), *vt = AT(vt), *dk = AT(dk), *dv = AT(dv), *dq = AT(dq);
    REAL *lse = AT(lse), *mt = AT(m), *lt = AT(l), *at = AT(alpha), *dvec = AT(dvec), *row = AT(row);
    int32_t *lo = (int32_t *)(scratch + lay->lo), *hi = (int32_t *)(scratch + lay->hi);
#if !IS_F64
#define PAIRS(region) ((uint32_t *)(scratch + lay->region))
    uint32_t *qp = PAIRS(qp), *dop = PAIRS(dop), *qm = PAIRS(qm), *dom = PAIRS(dom), *dsk = PAIRS(dsk), *kp = PAIRS(kp);
    uint16_t *pbf = (uint16_t *)(scratch + lay->pbf), *dsbf = (uint16_t *)(scratch + lay->dsbf);
    float *prod = (float *)(scratch + lay->prod);
    const struct npattn_kernels *kn = npattn_kernels();
    const int64_t ldm2 = pl->ldm2, ldd2 = pl->ldd2, ldv2 = pl->ldv2, m16 = pl->m16;
#undef PAIRS
#endif
#undef AT
    const int64_t off_q = npattn_batch_offset(p, &p->q, b), off_k = npattn_batch_offset(p, &p->k, b);
    const int64_t off_v = npattn_batch_offset(p, &p->v, b), off_o = npattn_batch_offset(p, &p->out, b);
    const int64_t off_do = npattn_batch_offset(p, &bp->dout, b), off_dq = npattn_batch_offset(p, &bp->dq, b);
    const int64_t off_dk = npattn_batch_offset(p, &bp->dk, b), off_dv = npattn_batch_offset(p, &bp->dv, b);
    const int64_t off_lse = npattn_batch_offset(p, &p->lse, b), ls = (int64_t)npattn_dtype_size(p->lse.dtype);
    const int64_t off_mask = p->mask_kind != NPATTN_MASK_NONE ? npattn_batch_offset(p, &p->mask, b) : 0;
    const int dk_first = bwd_first_visit(pl, &bp->dk, rep), dv_first = bwd_first_visit(pl, &bp->dv, rep);

    const int64_t ks = (int64_t)npattn_dtype_size(p->k.dtype), vs = (int64_t)npattn_dtype_size(p->v.dtype);
    const struct npattn_kv kk = {S > 0 ? npattn_elem(&p->k, ks, off_k, g, 0) : NULL, p->k.row_stride * ks, NULL, 0, 0};
    const struct npattn_kv vv = {S > 0 && Dv > 0 ? npattn_elem(&p->v, vs, off_v, g, 0) : NULL, p->v.row_stride * vs, NULL,
                                 0, 0};
    int in_place;
    const int64_t kb_begin = n_kblock * split / pl->n_split, kb_end = n_kblock * (split + 1) / pl->n_split;
    const int64_t dks = (int64_t)npattn_dtype_size(bp->dk.dtype), dvs = (int64_t)npattn_dtype_size(bp->dv.dtype);
    /* keys the request never reads: zero gradients, stored by the first repeat to
     * reach the slice (a later one adds nothing there) */
    if (split == 0 && (k0 > 0 || k1 < S) && (dk_first || dv_first)) {
        memset(row, 0, (size_t)max64(D, Dv) * sizeof *row);
        for (int64_t j = k0 > 0 ? 0 : k1; j < S; j = j + 1 == k0 ? k1 : j + 1) {
            if (dk_first) STORE(bp->dk.dtype, row, D, npattn_elem(&bp->dk, dks, off_dk, g, j), bp->dk.col_stride);
            if (Dv > 0 && dv_first)
                STORE(bp->dv.dtype, row, Dv, npattn_elem(&bp->dv, dvs, off_dv, g, j), bp->dv.col_stride);
        }
    }
    SCORE_TILE tile = {.scale = scale, .softcap = cap};
    for (int64_t kc = kb_begin; kc < kb_end; kc += pl->chunk) {
        /* a chunk of key blocks: keys c0 .. c1, read (converted if need be) once */
        const int64_t kc_end = kc + pl->chunk < kb_end ? kc + pl->chunk : kb_end;
        const int64_t c0 = k0 + kc * pl->bk, c1 = min64(k0 + kc_end * pl->bk, k1), nc = c1 - c0;
        int64_t ldk, ldv = 1;
        const REAL *kchunk = CAT(kv_rows_, SFX)(&p->k, &kk, c0, nc, D, k_direct, pl->ldk, kt, &ldk, &in_place);
        const REAL *vchunk =
            Dv > 0 ? CAT(kv_rows_, SFX)(&p->v, &vv, c0, nc, Dv, v_direct, pl->ldv, vt, &ldv, &in_place) : vt;
        /* a double tile whose rows are not all finite leaves hidden pairs out of its products */
        const int kv_finite = !f64 || (CAT(rows_finite_, SFX)(kchunk, nc, D, ldk) &&
                                       (Dv == 0 || CAT(rows_finite_, SFX)(vchunk, nc, Dv, ldv)));
#if !IS_F64
        /* K's and V's bfloat16 rows, read in place by the dot products; a chunk
         * holding a subnormal value (read as 0 there) computes without them */
        const int chunk16 = pl->path != BWD_PATH_GEMM && !rows_subnormal(kchunk, nc, D, ldk) && !rows_subnormal(vchunk, nc, Dv, ldv);
        const int64_t ldk16 = kk.row_bytes / 2, ldv16 = vv.row_bytes / 2;
        /* K's pairs along the keys for dQ, from its own rows, once a chunk (a
         * block's start is even: bk is) rather than once a block and query tile */
        if (chunk16 && pl->path == BWD_PATH_BF16_FAST) npattn_pairs_of_kv(&kk, c0, nc, D, kp, ldd2);
#endif
        memset(dk, 0, (size_t)(nc * D) * sizeof(REAL));
        memset(dv, 0, (size_t)(nc * Dv) * sizeof(REAL));
        int64_t ia, ib; /* the query rows that may see a key of this chunk */
        npattn_band_rows(&band, c0, c1, L, &ia, &ib);
        for (int64_t hb = 0; hb < pl->n_hblock && ia < ib; hb++) {
            const int64_t h0 = hg0 + hb * pl->bh, nh = pl->group - hb * pl->bh < pl->bh ? pl->group - hb * pl->bh : pl->bh;
            for (int64_t i0 = ia / pl->bq * pl->bq; i0 < ib; i0 += pl->bq) {
                if (npattn_run_stopped(&pl->run, slot)) return 0;
                const int64_t nq = L - i0 < pl->bq ? L - i0 : pl->bq, M = nh * nq;
                CAT(stacked_rows_, SFX)(&p->q, off_q, h0, i0, nq, M, D, qrows);
                CAT(stacked_rows_, SFX)(&bp->dout, off_do, h0, i0, nq, M, Dv, dorows);
                CAT(stacked_rows_, SFX)(&p->out, off_o, h0, i0, nq, M, Dv, orows);
                for (int64_t r = 0; r < M; r++) { /* D_i = rowsum(dO_i * O_i); the running max starts at lse */
                    REAL sum = 0;
                    for (int64_t e = 0; e < Dv; e++) sum += dorows[r * Dv + e] * orows[r * Dv + e];
                    dvec[r] = sum;
                    LOAD(p->lse.dtype, npattn_elem(&p->lse, ls, off_lse, h0 + r / nq, i0 + r % nq), 1, 1, lse + r);
                }
                const int careful = !kv_finite || (f64 && !(CAT(rows_finite_, SFX)(qrows, M, D, D) &&
                                                            CAT(rows_finite_, SFX)(dorows, M, Dv, Dv) &&
                                                            CAT(rows_finite_, SFX)(orows, M, Dv, Dv) &&
                                                            CAT(rows_finite_, SFX)(lse, M, 1, 1)));
                int tile16 = 0;
                REAL ds_by = ds_scale; /* dS's factor */
#if !IS_F64
                int fast16 = 0;
                tile16 = chunk16 && !careful;
                if (tile16) /* Q's and dO's values are bfloat16: their pairs are exact */
                    tile16 = (npattn_word_pairs(&p->q, off_q, h0, i0, nq, M, D, qp, ldm2) ||
                              !npattn_pairs_across(qrows, M, D, D, qp, ldm2)) &&
                             (npattn_word_pairs(&bp->dout, off_do, h0, i0, nq, M, Dv, dop, ldm2) ||
                              !npattn_pairs_across(dorows, M, Dv, Dv, dop, ldm2));
                if (tile16 && pl->path == BWD_PATH_BF16_FAST) { /* and their pairs along the rows, zeros to m16 */
                    fast16 = 1;
                    /* dS scaled whole before its pairs: one of ds_scale and alpha is 1,
                     * so this rounds as scaling by one and then the other did */
                    ds_by = ds_scale * alpha;
                    npattn_pairs_of_rows(qrows, M, D, D, qm, ldd2);
                    npattn_pairs_of_rows(dorows, M, Dv, Dv, dom, ldv2);
                    const int64_t from = (M + 1) / 2;
                    memset(qm + from * ldd2, 0, (size_t)((m16 / 2 - from) * ldd2) * sizeof *qm);
                    memset(dom + from * ldv2, 0, (size_t)((m16 / 2 - from) * ldv2) * sizeof *dom);
                }
#endif
                /* Q^T and dO^T for the gemms below, which then read K and V in place
                 * as plain NoTrans products, a form OpenBLAS's small-matrix kernels
                 * take (K Q^T as a Trans one was packed: 42% of a backward's time) */
                if (!tile16) {
                    CAT(transpose_, SFX)(qrows, D, M, D, qt, M);
                    CAT(transpose_, SFX)(dorows, Dv, M, Dv, dot, M);
                }
                int first = 1;
                for (int64_t kb = kc; kb < kc_end; kb++) {
                    const int64_t j0 = k0 + kb * pl->bk, nk = min64(k1 - j0, pl->bk);
                    int64_t ja, jb; /* skip a block no row of the tile sees */
                    npattn_band_rows(&band, j0, j0 + nk, L, &ja, &jb);
                    if (jb <= i0 || ja >= i0 + nq) continue;
                    const REAL *ktile = kchunk + (j0 - c0) * ldk, *vtile = vchunk + (j0 - c0) * ldv;
                    REAL *dkj = dk + (j0 - c0) * D, *dvj = dv + (j0 - c0) * Dv;
                    /* S^T (nk, M) = K_j (nk, D) @ Q^T (D, M) */
#if !IS_F64
                    int64_t run; /* K's and V's rows from j0 (dense: all of them) */
                    if (tile16)
                        kn->scores_bf16(qp, ldm2, M, D / 2, (const uint16_t *)npattn_kv_row(&kk, j0, &run), ldk16, nk,
                                        st, M);
                    else
#endif
                        GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)D, (REAL)1, ktile,
                             (int)ldk, qt, (int)M, (REAL)0, st, (int)M);
                    if (cap > 0) /* cap' = 1 - tanh(s / cap)^2, from the raw scores */
                        for (int64_t x = 0; x < nk * M; x++) {
                            REAL t = (REAL)tanh((double)(st[x] * scale / cap));
                            dcap[x] = 1 - t * t;
                        }
                    tile.nk = nk, tile.M = M, tile.ld = M, tile.bias = NULL;
                    if (p->mask_kind != NPATTN_MASK_NONE) {
                        if (CAT(mask_tile_, SFX)(p, off_mask, h0, i0, nq, M, j0, nk, bias, M, 1, row)) return 1;
                        tile.bias = bias;
                    }
                    int clipped = npattn_band_clip(&band, i0, nq, M, j0, nk, lo, hi);
                    tile.lo = clipped ? lo : NULL, tile.hi = clipped ? hi : NULL;
                    /* P^T = exp(S^T - lse): the forward step with the max preset to lse */
                    for (int64_t r = 0; r < M; r++) mt[r] = lse[r], lt[r] = 0;
#if IS_F64
                    npattn_softmax_f64(st, &tile, mt, lt, at);
                    if (careful) /* a NaN lse makes its whole column NaN: the row's hidden keys stay 0 */
                        for (int64_t j = 0; j < nk; j++)
                            for (int64_t r = 0; r < M; r++)
                                if (CAT(hidden_, SFX)(&tile, j, r)) st[j * M + r] = 0;
#else
                    if (npattn_kernels()->softmax_f32(st, &tile, mt, lt, at)) return 1;
#endif
                    if (Dv > 0) {
                        /* dV_j (nk, Dv) += P^T (nk, M) @ dO (M, Dv) */
                        if (careful)
                            CAT(seen_product_, SFX)(&tile, st, 0, dorows, Dv, Dv, (REAL)1, dvj, Dv);
#if !IS_F64
                        else if (fast16 && !npattn_bf16_rows(st, nk, M, M, pbf, m16))
                            add_product(kn, dom, ldv2, Dv, m16, pbf, nk, prod, dvj);
#endif
                        else
                            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)Dv, (int)M, (REAL)1, st,
                                 (int)M, dorows, (int)Dv, (REAL)1, dvj, (int)Dv);
                        /* dP^T (nk, M) = V_j (nk, Dv) @ dO^T (Dv, M) */
#if !IS_F64
                        if (tile16)
                            kn->scores_bf16(dop, ldm2, M, Dv / 2, (const uint16_t *)npattn_kv_row(&vv, j0, &run), ldv16,
                                            nk, dpt, M);
                        else
#endif
                            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)Dv, (REAL)1, vtile,
                                 (int)ldv, dot, (int)M, (REAL)0, dpt, (int)M);
                    } else {
                        memset(dpt, 0, (size_t)(nk * M) * sizeof(REAL));
                    }
                    /* dS^T = P^T * (dP^T - D) * cap', in place of dP^T, times the scale
                     * here or in the products below. D_i = dO_i . O_i against dO_i . v_j
                     * cancels where P_ij is near 1 (a near one-hot row), and what is left
                     * is their rounding, which the scale then magnifies; there dP_ij - D_i
                     * is taken as dO_i . (v_j - O_i), exactly 0 for a one-hot row. */
                    for (int64_t j = 0; j < nk; j++) {
                        REAL *ds = dpt + j * M;
                        const REAL *pj = st + j * M, *cj = dcap + j * M;
                        if (cap > 0)
                            for (int64_t r = 0; r < M; r++) ds[r] = pj[r] * (ds[r] - dvec[r]) * cj[r] * ds_by;
                        else
                            for (int64_t r = 0; r < M; r++) ds[r] = pj[r] * (ds[r] - dvec[r]) * ds_by;
                        if (careful) /* a hidden key's dS is 0, not 0 * a NaN dP or D */
                            for (int64_t r = 0; r < M; r++)
                                if (CAT(hidden_, SFX)(&tile, j, r)) ds[r] = 0;
                    }
                    /* a row may hold a weight >= 1/2 here only if the tile's weights sum to
                     * 1/2 or more (l, against the max preset to lse) or a score passed lse */
                    for (int64_t r = 0; r < M; r++) {
                        if (!(lt[r] >= (REAL)0.5 || mt[r] != lse[r])) continue;
                        for (int64_t j = 0; j < nk; j++) {
                            const REAL pjr = st[j * M + r];
                            if (!(pjr >= (REAL)0.5)) continue;
                            const REAL *vj = vtile + j * ldv;
                            double gap = 0;
                            for (int64_t e = 0; e < Dv; e++)
                                gap += (double)dorows[r * Dv + e] * ((double)vj[e] - (double)orows[r * Dv + e]);
                            dpt[j * M + r] = pjr * (REAL)gap * (cap > 0 ? dcap[j * M + r] : (REAL)1) * ds_by;
                        }
                    }
                    if (careful) {
                        if (first) memset(dq, 0, (size_t)(M * D) * sizeof(REAL));
                        CAT(seen_product_, SFX)(&tile, dpt, 0, qrows, D, D, alpha, dkj, D);
                        CAT(seen_product_, SFX)(&tile, dpt, 1, ktile, ldk, D, alpha, dq, D);
                        first = 0;
                        continue;
                    }
                    REAL ds_alpha = alpha;
#if !IS_F64
                    if (fast16) { /* dS scaled (ds_by), then its pairs both ways: dK's along the rows, dQ's along the keys */
                        ds_alpha = 1;
                        if (!npattn_bf16_rows(dpt, nk, M, M, dsbf, m16) &&
                            !npattn_pairs_of_rows(dpt, nk, M, M, dsk, ldm2)) {
                            if (first) memset(dq, 0, (size_t)(M * D) * sizeof(REAL));
                            add_product(kn, qm, ldd2, D, m16, dsbf, nk, prod, dkj);
                            kn->accumulate_bf16(dsk, ldm2, M, (nk + 1) / 2, kp + (j0 - c0) / 2 * ldd2, ldd2, D, dq);
                            first = 0;
                            continue;
                        }
                    }
#endif
                    /* dK_j (nk, D) += dS^T (nk, M) @ Q (M, D) */
                    GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)D, (int)M, ds_alpha, dpt, (int)M,
                         qrows, (int)D, (REAL)1, dkj, (int)D);
                    /* dQ (M, D) += dS (M, nk) @ K_j (nk, D), over the chunk's blocks */
                    GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)M, (int)D, (int)nk, ds_alpha, dpt, (int)M, ktile,
                         (int)ldk, (REAL)(first ? 0 : 1), dq, (int)D);
                    first = 0;
                }
                if (first) continue; /* no block of the chunk seen by this tile */
#if !IS_F64
                if (!npattn_all_finite_f32(dq, M * D)) return 1;
#endif
                CAT(add_rows_, SFX)(&bp->dq, off_dq, h0, hg0, i0, nq, M, D, L, dq, part, row);
            }
        }
#if !IS_F64
        if (!npattn_all_finite_f32(dk, nc * D) || !npattn_all_finite_f32(dv, nc * Dv)) return 1;
#endif
        /* this entry's share of the chunk's dK and dV is complete: no other task has its
         * keys; stored by the first repeat to reach the slice, added by the later ones */
        for (int64_t j = 0; j < nc; j++) {
            CAT(put_row_, SFX)(&bp->dk, npattn_elem(&bp->dk, dks, off_dk, g, c0 + j), dk + j * D, D, dk_first, row);
            if (Dv > 0)
                CAT(put_row_, SFX)(&bp->dv, npattn_elem(&bp->dv, dvs, off_dv, g, c0 + j), dv + j * Dv, Dv, dv_first, row);
        }
    }
    /* the sinks' gradient: d sum(dO * O) / d sink_h = -sum_i exp(sink_h - lse_i) D_i */
    if (p->sinks && split == 0)
        for (int64_t h = hg0; h < hg0 + pl->group; h++) {
            double sum = 0;
            for (int64_t i = 0; i < L; i++) {
                CAT(stacked_rows_, SFX)(&bp->dout, off_do, h, i, 1, 1, Dv, dorows);
                CAT(stacked_rows_, SFX)(&p->out, off_o, h, i, 1, 1, Dv, orows);
                double di = 0, lse;
                for (int64_t e = 0; e < Dv; e++) di += (double)dorows[e] * (double)orows[e];
                REAL l1;
                LOAD(p->lse.dtype, npattn_elem(&p->lse, (int64_t)npattn_dtype_size(p->lse.dtype), off_lse, h, i), 1, 1, &l1);
                lse = (double)l1;
                if (di != 0) sum += exp(p->sinks[h] - lse) * di;
            }
            bp->dsinks[b * p->n_head_q + h] = -sum;
        }
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

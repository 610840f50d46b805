/* tile_fwd.h: one task of the forward pass, written once for both computed
 * types. forward.c includes it twice, through reals.h: REAL = float (SFX f32, GEMM sgemm) and
 * REAL = double (SFX f64, GEMM dgemm). The double copy is also the exact path
 * of a float task that met an extreme.
 *
 * A unit (batch b, kv head g, a block of g's query heads, a block of query
 * rows) stacks those rows of those heads into one tile of M rows, so that
 * each K and V tile serves every head of the group, and runs online softmax
 * between the two products (FlashAttention-2, arXiv:2307.08691). Scores are
 * kept transposed, (keys, M): the first product reads K in place as a plain
 * NoTrans gemm and the softmax runs down columns, one SIMD lane per query
 * row. Only the keys the band lets the unit's rows see are visited. A unit's
 * keys may be split into n_split tasks (split-K), each leaving a partial
 * (lse, normalised O) that merge() combines.
 */
/* Returns 1 when a float task must be recomputed in double. */
static int CAT(tile_fwd_, SFX)(void *plan, int64_t task, int32_t slot, char *scratch) {
    struct fwd_plan *pl = plan;
    const struct npattn_problem *p = pl->p;
    const int f64 = sizeof(REAL) == sizeof(double);
    const struct layout *lay = f64 ? &pl->lay64 : &pl->lay;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, split = task % pl->n_split;
    struct unit u;
    locate(pl, task / pl->n_split, &u);
    const int64_t M = u.M, nq = u.nq, i0 = u.i0, h0 = u.h0;
    /* streaming kernels or gemms; the f64 copy always gemms */
    const int stream = !f64 && pl->stream;
    const int k_direct = f64 == pl->f64 && pl->k_direct, v_direct = f64 == pl->f64 && pl->v_direct;

    REAL *qt = (REAL *)(scratch + lay->qt), *st = (REAL *)(scratch + lay->st), *ot = (REAL *)(scratch + lay->ot);
    REAL *mt = (REAL *)(scratch + lay->m), *lt = (REAL *)(scratch + lay->l), *at = (REAL *)(scratch + lay->alpha);
    REAL *row = (REAL *)(scratch + lay->row), *kt = (REAL *)(scratch + lay->kt), *vt = (REAL *)(scratch + lay->vt);
    REAL *bias = (REAL *)(scratch + lay->bias);
    int32_t *lo = (int32_t *)(scratch + lay->lo), *hi = (int32_t *)(scratch + lay->hi);

    /* Q's rows (M, D) for the streaming kernels; Q^T (D, M) for the gemm,
     * which then reads K in place as a plain NoTrans product (a form
     * OpenBLAS's small-matrix kernels take) */
    CAT(stacked_rows_, SFX)(&p->q, u.off_q, h0, i0, nq, M, D, stream ? qt : (REAL *)(scratch + lay->qrows),
                            stream ? NULL : qt);
    /* The running max starts at the head's sink, whose weight exp(0) is 1;
     * with split-K only the first split carries it. */
    for (int64_t r = 0; r < M; r++) {
        double sink = p->sinks && split == 0 ? p->sinks[h0 + r / nq] : -INFINITY;
        mt[r] = (REAL)sink;
        lt[r] = sink == -INFINITY ? (REAL)0 : (REAL)1;
    }
    memset(ot, 0, (size_t)(M * Dv) * sizeof(REAL)); /* O's rows (M, D_v) */

    /* this split's share of the key tiles the band lets the rows see */
    const int64_t n_ktile = (u.j1 - u.j0 + pl->bk - 1) / pl->bk;
    const int64_t t_begin = n_ktile * split / pl->n_split, t_end = n_ktile * (split + 1) / pl->n_split;
    const int64_t ks = (int64_t)npattn_dtype_size(p->k.dtype), vs = (int64_t)npattn_dtype_size(p->v.dtype);
    const char *kbase = n_ktile > 0 ? npattn_elem(&p->k, ks, u.off_k, u.g, 0) : NULL;
    const char *vbase = n_ktile > 0 && Dv > 0 ? npattn_elem(&p->v, vs, u.off_v, u.g, 0) : NULL;

    /* scores (j, r) sit at st[j * sj + r * sr]: transposed (keys, M) for the
     * gemms, by rows (M, bk) for the streaming kernels; the bias likewise */
    const int64_t sld = stream ? pl->bk : M, sj = stream ? 1 : M, sr = stream ? pl->bk : 1;
    SCORE_TILE tile = {.M = M, .ld = sld, .scale = (REAL)p->scale, .softcap = (REAL)p->softcap};
    for (int pass = 0; pass < (p->weights.data ? 2 : 1); pass++) {
        if (pass == 1) {
            /* the weights: every tile again, against the row's final lse, so
             * that exp(x - max(lse, x)) is the probability exp(x - lse) */
            for (int64_t r = 0; r < M; r++) {
                mt[r] = lt[r] == (REAL)0 ? (REAL)-INFINITY : mt[r] + (REAL)log((double)lt[r]);
                lt[r] = 0;
                REAL zero = 0;
                for (int64_t j = 0; j < p->n_key; j++) /* keys the band hides stay 0 */
                    STORE(p->weights.dtype, &zero, 1, weight_ptr(p, &u, r, j), 1);
            }
        }
        for (int64_t t = t_begin; t < t_end; t++) {
            if (npattn_run_stopped(&pl->run, slot)) return 0;
            const int64_t j0 = u.j0 + t * pl->bk, nk = u.j1 - j0 < pl->bk ? u.j1 - j0 : pl->bk;

            /* K and V tiles: in place where BLAS, or the streaming kernels in
             * K's and V's own type, can read them; else converted here */
            int64_t ldk, ldv = 1;
            const void *ktile = CAT(kv_rows_, SFX)(&p->k, kbase, j0, nk, D, k_direct, pl->ldk, kt, &ldk), *vtile = vt;
            if (pass == 0 && Dv > 0) vtile = CAT(kv_rows_, SFX)(&p->v, vbase, j0, nk, Dv, v_direct, pl->ldv, vt, &ldv);
            const enum npattn_dtype ktype = k_direct ? p->k.dtype : NPATTN_DTYPE_F32;
            const enum npattn_dtype vtype = v_direct ? p->v.dtype : NPATTN_DTYPE_F32;

            /* scores^T (nk, M) = K_tile (nk, D) @ Q^T (D, M) */
            if (stream)
                npattn_kernels()->scores((const float *)qt, M, D, ktype, ktile, ldk, nk, (float *)st, sld);
            else
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)D, (REAL)1, ktile, (int)ldk, qt,
                     (int)M, (REAL)0, st, (int)M);

            /* the mask array, as a bias tile; the band, where it cuts this tile */
            tile.nk = nk;
            tile.bias = NULL;
            if (p->mask_kind != NPATTN_MASK_NONE) {
                if (CAT(mask_tile_, SFX)(p, u.off_mask, h0, i0, nq, M, j0, nk, bias, sj, sr, row)) return 1;
                tile.bias = bias;
            }
            int clipped = npattn_band_clip(&pl->band, i0, nq, M, j0, nk, lo, hi);
            tile.lo = clipped ? lo : NULL;
            tile.hi = clipped ? hi : NULL;

            /* online softmax down each column: probabilities in place, max and sum updated */
#if IS_F64
            npattn_softmax_f64(st, &tile, mt, lt, at);
#else
            if ((stream ? npattn_kernels()->softmax_rows_f32 : npattn_kernels()->softmax_f32)(st, &tile, mt, lt, at))
                return 1;
#endif
            if (pass == 1) { /* the weights of this tile */
                for (int64_t r = 0; r < M; r++) {
                    for (int64_t j = 0; j < nk; j++) row[j] = st[j * sj + r * sr];
                    STORE(p->weights.dtype, row, nk, weight_ptr(p, &u, r, j0), p->weights.col_stride);
                }
                continue;
            }
            int rescale = 0;
            for (int64_t r = 0; r < M; r++) rescale |= at[r] != (REAL)1;
            if (rescale)
                for (int64_t r = 0; r < M; r++)
                    for (int64_t e = 0; e < Dv; e++) ot[r * Dv + e] *= at[r];

            /* O (M, D_v) += P (M, nk) @ V_tile (nk, D_v), P stored as st */
            if (stream)
                npattn_kernels()->accumulate((const float *)st, sld, M, nk, vtype, vtile, ldv, Dv, (float *)ot);
            else if (Dv > 0)
                GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)M, (int)Dv, (int)nk, (REAL)1, st, (int)M, vtile,
                     (int)ldv, (REAL)1, ot, (int)Dv);
        }
        if (pass == 1) break;
#if !IS_F64
        /* an accumulator that overflowed is recomputed in double */
        if (!npattn_all_finite_f32(ot, M * Dv)) return 1;
#endif
        if (pl->n_split == 1) {
            for (int64_t r = 0; r < M; r++) {
                /* a row that saw no key: zeros, not NaN (even where 0 * a NaN value was added) */
                const REAL inv = lt[r] == (REAL)0 ? (REAL)0 : (REAL)1 / lt[r];
                for (int64_t e = 0; e < Dv; e++) row[e] = inv == (REAL)0 ? (REAL)0 : ot[r * Dv + e] * inv;
                const int64_t h = h0 + r / nq, i = i0 + r % nq;
                if (Dv > 0) STORE(p->out.dtype, row, Dv, npattn_elem(&p->out, pl->out_size, u.off_out, h, i), p->out.col_stride);
                if (p->lse.data) store_lse(p, u.off_lse, h, i, lt[r] == (REAL)0 ? -INFINITY : (double)mt[r] + log((double)lt[r]));
            }
        } else {
            /* split-K: leave (lse, O / l) for the merge, in double */
            double *part = pl->partials + (size_t)task * (size_t)(pl->max_m * (Dv + 1));
            for (int64_t r = 0; r < M; r++) {
                const REAL inv = lt[r] == (REAL)0 ? (REAL)0 : (REAL)1 / lt[r];
                part[r] = lt[r] == (REAL)0 ? -INFINITY : (double)mt[r] + log((double)lt[r]);
                for (int64_t e = 0; e < Dv; e++)
                    part[pl->max_m + r * Dv + e] = inv == (REAL)0 ? 0.0 : (double)(ot[r * Dv + e] * inv);
            }
        }
    }
    return 0;
}


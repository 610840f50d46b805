/* tile_impl.h: one tile of attention, written once for both element types.
 * attention.c includes it twice, with REAL = float and REAL = double; SFX
 * names the copy, GEMM is sgemm or dgemm, SOFTMAX_COLS the kernel, and
 * TILE_CONVERTS is 1 where float16/bfloat16 storage is computed in REAL.
 *
 * A unit of work is (batch b, kv head g, block of heads of g's group, block
 * of query rows). It stacks those query rows of the group's heads into one
 * tile of M rows, so that each K and V tile serves every head of the group,
 * and runs online softmax between the two products (FlashAttention-2,
 * arXiv:2307.08691). The scores are kept transposed, (keys, M): the first
 * product then reads K in place as a plain NoTrans gemm, and the softmax runs
 * down columns, one SIMD lane per query row.
 *
 * A unit's keys may be split into n_split tasks (split-K, for decode with few
 * heads); each writes a partial (max, sum, unnormalised O) that a merge task
 * combines by log-sum-exp, in a fixed order.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#define LOG2E 1.4426950408889634

/* The unit a task belongs to, where its rows and heads are, and its keys. */
struct CAT(unit_, SFX) {
    const char *q, *k, *v;
    char *out;
    struct offsets off;
    int64_t i0, nq, h0, nh, M; /* first row, rows per head, first head, heads, stacked rows */
    int64_t j_end;             /* keys past the causal limit of the last row are never read */
};

static void CAT(locate_, SFX)(const struct plan *pl, int64_t unit, struct CAT(unit_, SFX) *u) {
    const struct npattn_problem *p = pl->p;
    /* Units of one kv head run back to back, so its K and V stay in cache;
     * within it, largest first: the last query blocks see the most keys
     * under a causal mask. */
    int64_t qb = pl->n_qblock - 1 - unit % pl->n_qblock;
    int64_t rest = unit / pl->n_qblock;
    int64_t hb = rest % pl->n_hblock;
    rest /= pl->n_hblock;
    int64_t g = rest % p->n_head_kv;
    int64_t b = rest / p->n_head_kv;

    batch_offsets(p, b, &u->off);
    const int64_t es = (int64_t)pl->elem_size; /* bytes per stored element */
    u->q = (const char *)p->q + u->off.q * es;
    u->k = (const char *)p->k + (u->off.k + g * p->k_head_stride) * es;
    u->v = (const char *)p->v + (u->off.v + g * p->v_head_stride) * es;
    u->out = (char *)p->out + u->off.out * es;
    u->i0 = qb * pl->bq;
    u->nq = p->n_query - u->i0 < pl->bq ? p->n_query - u->i0 : pl->bq;
    u->h0 = g * pl->group + hb * pl->bh;
    u->nh = pl->group - hb * pl->bh < pl->bh ? pl->group - hb * pl->bh : pl->bh;
    u->M = u->nh * u->nq;
    u->j_end = p->n_key;
    if (pl->causal) {
        int64_t last = u->i0 + u->nq - 1 + pl->causal_offset + 1;
        if (last < u->j_end) u->j_end = last < 0 ? 0 : last;
    }
}

/* Writes row r of a finished O (divided by its sum l) to out; orow is scratch. */
static void CAT(store_row_, SFX)(const struct plan *pl, const struct CAT(unit_, SFX) *u, int64_t r, REAL *orow,
                                 REAL l) {
    const struct npattn_problem *p = pl->p;
    const int64_t Dv = p->n_embd_v, es = (int64_t)pl->elem_size;
    char *dst = u->out + ((u->h0 + r / u->nq) * p->out_head_stride + (u->i0 + r % u->nq) * p->out_row_stride) * es;
    /* a row that saw no key (l = 0) is zeros, not NaN */
    REAL inv = l == (REAL)0 ? (REAL)0 : (REAL)1 / l;
    for (int64_t e = 0; e < Dv; e++) orow[e] *= inv;
#if TILE_CONVERTS
    if (p->dtype != NPATTN_DTYPE_F32) {
        npattn_row_from_f32(p->dtype, orow, Dv, dst, p->out_col_stride);
        return;
    }
#endif
    for (int64_t e = 0; e < Dv; e++) ((REAL *)dst)[e * p->out_col_stride] = orow[e];
}

static void CAT(run_tile_, SFX)(void *arg, int64_t task, int32_t slot) {
    const struct plan *pl = arg;
    const struct npattn_problem *p = pl->p;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v, es = (int64_t)pl->elem_size;
    const int64_t split = task % pl->n_split;
    struct CAT(unit_, SFX) u;
    CAT(locate_, SFX)(pl, task / pl->n_split, &u);
    const int64_t M = u.M, nq = u.nq, i0 = u.i0, h0 = u.h0;

    /* scratch of this slot: Q^T (D, M), scores^T (bk, M), O^T (D_v, M), m, l,
     * alpha, a row, and for float16/bfloat16 the K and V tiles in float */
    REAL *qt = (REAL *)(pl->scratch + (size_t)slot * pl->scratch_per_slot);
    REAL *st = qt + pl->max_m * D;
    REAL *ot = st + pl->max_m * pl->bk;
    REAL *mt = ot + pl->max_m * Dv;
    REAL *lt = mt + pl->max_m;
    REAL *at = lt + pl->max_m;
    REAL *row = at + pl->max_m;
    REAL *kt = row + (D > Dv ? D : Dv);
    REAL *vt = kt + pl->bk * D;

    /* O (r, e) sits at r * ors + e * oes: O^T for the gemms, rows for streaming */
    const int stream = TILE_CONVERTS && pl->stream;
    const int64_t ors = stream ? Dv : 1, oes = stream ? 1 : M;
    /* Q^T (Q's rows when streaming) with scale * log2(e) folded in, so that
     * scores are base-2 logits. */
    const REAL qscale = (REAL)(p->scale * LOG2E);
    const int64_t qrs = stream ? D : 1, qds = stream ? 1 : M;
    for (int64_t r = 0; r < M; r++) {
        const char *qrow = u.q + ((h0 + r / nq) * p->q_head_stride + (i0 + r % nq) * p->q_row_stride) * es;
#if TILE_CONVERTS
        if (p->dtype != NPATTN_DTYPE_F32) {
            npattn_row_to_f32(p->dtype, qrow, p->q_col_stride, D, row);
            for (int64_t d = 0; d < D; d++) qt[r * qrs + d * qds] = row[d] * qscale;
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) qt[r * qrs + d * qds] = ((const REAL *)qrow)[d * p->q_col_stride] * qscale;
    }
    /* The running max starts at the head's sink, whose exp2 weight is 1;
     * with split-K only the first split carries the sink. */
    for (int64_t r = 0; r < M; r++) {
        int sink = p->sinks && split == 0;
        mt[r] = sink ? (REAL)(p->sinks[h0 + r / nq] * LOG2E) : (REAL)-INFINITY;
        lt[r] = sink ? (REAL)1 : (REAL)0;
    }
    memset(ot, 0, (size_t)(M * Dv) * sizeof(REAL));

    /* this split's share of the key tiles */
    const int64_t n_ktile = (u.j_end + pl->bk - 1) / pl->bk;
    const int64_t t_begin = n_ktile * split / pl->n_split, t_end = n_ktile * (split + 1) / pl->n_split;
    const int ldk = (int)pl->ldk, ldv = (int)pl->ldv;

    for (int64_t t = t_begin; t < t_end; t++) {
        if (pl->cancel_seen && atomic_load_explicit(pl->cancel_seen, memory_order_relaxed)) return;
        const int64_t j0 = t * pl->bk;
        const int64_t nk = u.j_end - j0 < pl->bk ? u.j_end - j0 : pl->bk;
        const REAL *ktile = (const REAL *)(u.k + j0 * pl->ldk * es);
        const REAL *vtile = (const REAL *)(u.v + j0 * pl->ldv * es);
        int ldkt = ldk, ldvt = ldv;
#if TILE_CONVERTS
        if (p->dtype != NPATTN_DTYPE_F32) {
            /* float16/bfloat16: this tile's rows in float, never all of K or V */
            for (int64_t j = 0; j < nk; j++) {
                npattn_row_to_f32(p->dtype, u.k + (j0 + j) * pl->ldk * es, 1, D, kt + j * D);
                npattn_row_to_f32(p->dtype, u.v + (j0 + j) * pl->ldv * es, 1, Dv, vt + j * Dv);
            }
            ktile = kt, vtile = vt, ldkt = (int)D, ldvt = (int)(Dv > 0 ? Dv : 1);
        }
#else
        (void)kt, (void)vt;
#endif

        /* scores^T (nk, M) = K_tile (nk, D) @ Q^T (D, M) */
#if TILE_CONVERTS
        if (stream)
            npattn_scores_rows_f32(qt, M, D, ktile, ldkt, nk, st);
        else
#endif
            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)M, (int)D, (REAL)1, ktile, ldkt, qt,
                 (int)M, (REAL)0, st, (int)M);

        if (pl->causal) {
            /* key j0 + j is hidden from rows i < j0 + j - offset: clip the diagonal tile exactly */
            for (int64_t j = 0; j < nk; j++) {
                int64_t hidden = j0 + j - pl->causal_offset - i0;
                if (hidden <= 0) continue;
                if (hidden > nq) hidden = nq;
                REAL *srow = st + j * M;
                for (int64_t hh = 0; hh < u.nh; hh++)
                    for (int64_t i = 0; i < hidden; i++) srow[hh * nq + i] = (REAL)-INFINITY;
            }
        } else if (p->mask_kind == NPATTN_MASK_BOOL || p->mask_kind == NPATTN_MASK_ADD) {
            const int64_t mcs = p->mask_col_stride;
            for (int64_t r = 0; r < M; r++) {
                int64_t at_r = u.off.mask + (h0 + r / nq) * p->mask_head_stride +
                               (i0 + r % nq) * p->mask_row_stride + j0 * mcs;
                if (p->mask_kind == NPATTN_MASK_BOOL) {
                    const uint8_t *mrow = (const uint8_t *)p->mask + at_r;
                    for (int64_t j = 0; j < nk; j++)
                        if (!mrow[j * mcs]) st[j * M + r] = (REAL)-INFINITY;
                } else {
                    /* the mask is in natural-log units: bring it to base 2, keeping a finite
                     * value finite (a mask of the dtype's lowest value hides nothing) */
                    const REAL *mrow = (const REAL *)p->mask + at_r;
                    for (int64_t j = 0; j < nk; j++) {
                        REAL x = mrow[j * mcs], x2 = x * (REAL)LOG2E;
                        if (x2 < -REAL_MAX && x != -(REAL)INFINITY) x2 = -REAL_MAX;
                        if (x2 > REAL_MAX && x != (REAL)INFINITY) x2 = REAL_MAX;
                        /* -inf hides the key whatever its score, NaN included */
                        st[j * M + r] = x == -(REAL)INFINITY ? x : st[j * M + r] + x2;
                    }
                }
            }
        }

        /* online softmax down each column: probabilities in place, max and sum updated */
        SOFTMAX_COLS(st, nk, M, mt, lt, at);
        int rescale = 0;
        for (int64_t r = 0; r < M; r++) rescale |= at[r] != (REAL)1;
        if (rescale && stream)
            for (int64_t r = 0; r < M; r++)
                for (int64_t e = 0; e < Dv; e++) ot[r * Dv + e] *= at[r];
        else if (rescale)
            for (int64_t e = 0; e < Dv; e++)
                for (int64_t r = 0; r < M; r++) ot[e * M + r] *= at[r];

        /* O^T (D_v, M) += V_tile^T (D_v, nk) @ P^T (nk, M) */
#if TILE_CONVERTS
        if (stream)
            npattn_accumulate_rows_f32(st, M, nk, vtile, ldvt, Dv, ot);
        else
#endif
            if (Dv > 0)
            GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)Dv, (int)M, (int)nk, (REAL)1, vtile, ldvt, st, (int)M,
                 (REAL)1, ot, (int)M);
    }

    if (pl->n_split == 1) {
        for (int64_t r = 0; r < M; r++) {
            for (int64_t e = 0; e < Dv; e++) row[e] = ot[r * ors + e * oes];
            CAT(store_row_, SFX)(pl, &u, r, row, lt[r]);
        }
        return;
    }
    /* split-K: leave (m, l, O) for the merge, O laid out as above */
    REAL *part = (REAL *)pl->partials + (size_t)task * (size_t)(pl->max_m * (Dv + 2));
    memcpy(part, mt, (size_t)M * sizeof(REAL));
    memcpy(part + pl->max_m, lt, (size_t)M * sizeof(REAL));
    memcpy(part + 2 * pl->max_m, ot, (size_t)(M * Dv) * sizeof(REAL));
}

/* Merges the n_split partials of one unit by log-sum-exp, in split order. */
static void CAT(merge_, SFX)(void *arg, int64_t unit, int32_t slot) {
    const struct plan *pl = arg;
    const int64_t Dv = pl->p->n_embd_v, stride = pl->max_m * (Dv + 2);
    struct CAT(unit_, SFX) u;
    CAT(locate_, SFX)(pl, unit, &u);
    REAL *orow = (REAL *)(pl->scratch + (size_t)slot * pl->scratch_per_slot);
    const REAL *first = (const REAL *)pl->partials + (size_t)(unit * pl->n_split) * (size_t)stride;
    for (int64_t r = 0; r < u.M; r++) {
        /* the overall max; NaN in any part makes the row NaN */
        REAL m = (REAL)-INFINITY;
        int nan = 0;
        for (int64_t s = 0; s < pl->n_split; s++) {
            REAL ms = first[s * stride + r];
            nan |= ms != ms;
            m = ms > m ? ms : m;
        }
        if (nan) m = (REAL)NAN;
        REAL l = 0;
        memset(orow, 0, (size_t)Dv * sizeof(REAL));
        for (int64_t s = 0; s < pl->n_split; s++) {
            const REAL *part = first + s * stride;
            REAL ms = part[r];
            if (ms == (REAL)-INFINITY) continue; /* this part saw nothing */
            REAL w = (REAL)exp2((double)(ms - m));
            l += w * part[pl->max_m + r];
            const REAL *os = part + 2 * pl->max_m; /* O laid out as in run_tile */
            if (pl->stream)
                for (int64_t e = 0; e < Dv; e++) orow[e] += w * os[r * Dv + e];
            else
                for (int64_t e = 0; e < Dv; e++) orow[e] += w * os[e * u.M + r];
        }
        CAT(store_row_, SFX)(pl, &u, r, orow, l);
    }
}

#undef LOG2E
#undef CAT
#undef CAT_

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
 * (lse, normalised O) that merge() combines. The attention weights, where
 * asked for, are a second walk over the same key tiles (weights_ below).
 * A decode unit over kv heads whose rows interleave (forward.c) takes ng kv
 * heads g .. g + ng - 1, each with its whole group, rows stacked head after
 * head (mg of each): the two products run per kv head, all else per row.
 */
/* A task's paths, its scratch, and where its unit's rows are. */
struct CAT(fwd_task_, SFX) {
    struct unit u;
    int64_t task, split;           /* the task, and its part of the unit's keys (split-K) */
    int64_t n_ktile;               /* the unit's key tiles, of which the task takes [t_begin, t_end) */
    int64_t t_begin, t_end;
    int32_t slot;
    enum qk_path qk;               /* the task's QK^T: the plan's, or a plainer one its operands need */
    enum pv_path pv;               /* and its P @ V */
    int stream;                    /* scores by rows for the streaming kernels (qk_streams) */
    int k_direct, v_direct;        /* BLAS, or the streaming kernels, read K / V in place */
    uint32_t *qp, *pp, *vp;        /* the pairs of Q^T (or Q's tiles), P and V (float tasks) */
    REAL *qt, *qrows, *st, *ot, *mt, *lt, *at, *row, *kt, *vt, *bias;
    int32_t *lo, *hi;
    struct npattn_kv kk, vv;       /* K's and V's rows of the unit's (first) kv head */
    int64_t mg, k_head, v_head;    /* stacked rows per kv head; bytes from one kv head's K (V) rows to the next's */
    struct npattn_span *spans;     /* streamed: a key tile's spans of one kv head's rows */
    int64_t k_keys, k_dist, v_keys, v_dist; /* streamed: how the unit reads K and V (kv_rounds) */
    int64_t sld, sj, sr;           /* scores (j, r) at st[j * sj + r * sr], rows sld apart */
    SCORE_TILE tile;
};

/* The task's unit and share of its key tiles, the plan's paths (the double
 * copy's: the gemms), the scratch, and where K's and V's rows are. Scores
 * (j, r): transposed (keys, M) for the gemms, by rows (M, bk) for the
 * streaming kernels; the bias likewise. */
static void CAT(task_begin_, SFX)(const struct fwd_plan *pl, int64_t task, int32_t slot, char *scratch,
                                  struct CAT(fwd_task_, SFX) *s) {
    const struct npattn_problem *p = pl->p;
    const int f64 = sizeof(REAL) == sizeof(double);
    const struct layout *lay = f64 ? &pl->lay64 : &pl->lay;
    const struct unit *u = &s->u;
    s->task = task, s->split = task % pl->n_split, s->slot = slot;
    locate(pl, task / pl->n_split, &s->u);
    s->qk = f64 ? QK_PATH_GEMM : pl->qk;
    s->pv = f64 ? PV_PATH_GEMM : pl->pv;
    s->stream = qk_streams(s->qk);
    s->k_direct = f64 == pl->f64 && pl->k_direct;
    s->v_direct = f64 == pl->f64 && pl->v_direct;
#define AT(type, region) ((type *)(scratch + lay->region))
    s->qt = AT(REAL, qt), s->st = AT(REAL, st), s->ot = AT(REAL, ot), s->mt = AT(REAL, m), s->lt = AT(REAL, l);
    s->at = AT(REAL, alpha), s->row = AT(REAL, row), s->kt = AT(REAL, kt), s->vt = AT(REAL, vt);
    s->bias = AT(REAL, bias), s->lo = AT(int32_t, lo), s->hi = AT(int32_t, hi);
    s->qp = AT(uint32_t, qp), s->pp = AT(uint32_t, pp), s->vp = AT(uint32_t, vp);
    s->spans = AT(struct npattn_span, spans);
    s->qrows = s->stream ? s->qt : AT(REAL, qrows); /* streamed, Q's rows are what the kernels take */
#undef AT
    /* this split's share of the key tiles the band lets the rows see */
    s->n_ktile = (u->j1 - u->j0 + pl->bk - 1) / pl->bk;
    s->t_begin = s->n_ktile * s->split / pl->n_split, s->t_end = s->n_ktile * (s->split + 1) / pl->n_split;
    s->kk = kv_of(pl, u, &p->k, s->n_ktile > 0, pl->k_page_bytes);
    s->vv = kv_of(pl, u, &p->v, s->n_ktile > 0 && p->n_embd_v > 0, pl->v_page_bytes);
    s->mg = u->M / u->ng;
    s->k_head = p->k.head_stride * (int64_t)npattn_dtype_size(p->k.dtype);
    s->v_head = p->v.head_stride * (int64_t)npattn_dtype_size(p->v.dtype);
    s->sld = s->stream ? pl->bk : u->M, s->sj = s->stream ? 1 : u->M, s->sr = s->stream ? pl->bk : 1;
    SCORE_TILE tile = {.M = u->M, .ld = s->sld, .scale = (REAL)p->scale, .softcap = (REAL)p->softcap};
    s->tile = tile;
}

#if !IS_F64
/* Q's stacked rows as bfloat16 words for PV_PATH_BF16_STEP: qa (rows of D,
 * zeros from M to a multiple of 16), the bfloat16 q's words as stored.
 * Returns 0 where a value is subnormal (a tile would read it as 0). */
static int CAT(step_rows_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k, M = u->M, cs = p->q.col_stride;
    uint16_t *qa = (uint16_t *)s->qp;
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = (const uint16_t *)npattn_elem(&p->q, 2, u->off_q, u->h0 + r / u->nq, u->i0 + r % u->nq);
        for (int64_t d = 0; d < D; d++) qa[r * D + d] = row[d * cs];
        if (npattn_kernels()->pair_bf16(qa + r * D, NULL, D, NULL)) return 0;
    }
    memset(qa + M * D, 0, (size_t)(((M + 15) / 16 * 16 - M) * D) * sizeof *qa);
    return 1;
}

/* A float task's paths: the plan's, or the gemms' where the unit sees no
 * key, or where a value is subnormal (a bfloat16 pair would read it as 0:
 * K's and V's rows of the request, found once per call; Q's, as its pairs
 * are made). Q's pairs for the bfloat16 dot products: split float16 values
 * (never subnormal), else its bfloat16 words in place or through floats. */
static void CAT(task_paths_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k, M = u->M, state = u->b * p->n_head_kv + u->g; /* the kv head's states */
    if ((s->qk == QK_PATH_BF16 || s->qk == QK_PATH_SPLIT_F16) && s->n_ktile == 0) s->qk = QK_PATH_GEMM;
    if (s->qk == QK_PATH_BF16 && !rows_normal(&pl->k_normal[state], &s->kk, u, D)) s->qk = QK_PATH_GEMM;
    if (s->pv == PV_PATH_BF16_STEP &&
        (s->qk != QK_PATH_BF16 || !rows_normal(&pl->v_normal[state], &s->vv, u, p->n_embd_v)))
        s->pv = PV_PATH_GEMM;
    if (s->pv == PV_PATH_BF16_STEP) {
        if (!CAT(step_rows_, SFX)(pl, s)) s->qk = QK_PATH_GEMM, s->pv = PV_PATH_GEMM;
    } else if (s->qk == QK_PATH_SPLIT_F16) {
        CAT(stacked_rows_, SFX)(&p->q, u->off_q, u->h0, u->i0, u->nq, M, D, s->qrows);
        npattn_split_across(s->qrows, M, D, D, s->qp, pl->ldq2);
    } else if (s->qk == QK_PATH_BF16 &&
               !npattn_word_pairs(&p->q, u->off_q, u->h0, u->i0, u->nq, M, D, s->qp, pl->ldq2)) {
        CAT(stacked_rows_, SFX)(&p->q, u->off_q, u->h0, u->i0, u->nq, M, D, s->qrows);
        if (npattn_pairs_across(s->qrows, M, D, D, s->qp, pl->ldq2)) s->qk = QK_PATH_GEMM;
    }
    if (s->n_ktile == 0) s->pv = s->stream ? PV_PATH_STREAM : PV_PATH_GEMM;
    else if (s->pv == PV_PATH_STREAM_BF16 && u->ng > 1) s->pv = PV_PATH_STREAM; /* (subnormal V: found as read) */
    else if ((s->pv == PV_PATH_BF16 || s->pv == PV_PATH_BF16_TILES || s->pv == PV_PATH_EXACT_BF16) &&
             !rows_normal(&pl->v_normal[state], &s->vv, u, p->n_embd_v))
        s->pv = PV_PATH_GEMM;
    if (s->pv == PV_PATH_BF16_STEP) /* the step's scores, and the mask's tile, by rows */
        s->sld = s->tile.ld = pl->bk, s->sj = 1, s->sr = pl->bk;
}
#endif

/* Q as the task's QK^T takes it (its pairs: task_paths_): its rows (M, D)
 * for the streaming kernels (and q's tiles where the table makes them);
 * Q^T (D, M) for the gemm, which then reads K in place as a plain NoTrans
 * product (a form OpenBLAS's small-matrix kernels take). Then how a
 * streamed unit reads K and V; the running max, which starts at the head's
 * sink, whose weight exp(0) is 1 (with split-K only the first split carries
 * it); and O's rows (M, D_v): zeros, unless the first tile's gemms write them. */
static void CAT(task_start_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k, M = u->M, nq = u->nq;
    if (s->stream) CAT(stacked_rows_, SFX)(&p->q, u->off_q, u->h0, u->i0, nq, M, D, s->qrows);
    else if (s->qk == QK_PATH_GEMM)
        CAT(stacked_transposed_, SFX)(&p->q, u->off_q, u->h0, u->i0, nq, M, D, s->qrows, s->qt);
#if !IS_F64
    for (int64_t gi = 0; gi < u->ng && s->qk == QK_PATH_STREAM_Q_TILES; gi++)
        if (!npattn_kernels()->q_tiles((const float *)s->qrows + gi * s->mg * D, s->mg, D, s->qp + gi * D / 2 * 16))
            s->qk = QK_PATH_STREAM;
#endif
    if (s->stream) {
        kv_rounds(pl, &s->kk, u->ng, s->qk == QK_PATH_STREAM_Q_TILES, 0, &s->k_keys, &s->k_dist);
        kv_rounds(pl, &s->vv, u->ng, 0, s->mg, &s->v_keys, &s->v_dist);
    }
    for (int64_t r = 0; r < M; r++) {
        double sink = p->sinks && s->split == 0 ? p->sinks[u->h0 + r / nq] : -INFINITY;
        s->mt[r] = (REAL)sink;
        s->lt[r] = sink == -INFINITY ? (REAL)0 : (REAL)1;
    }
    const int o_by_gemm = s->pv == PV_PATH_GEMM && s->t_end > s->t_begin;
    const int64_t o_rows = s->pv == PV_PATH_BF16_STEP ? (M + 15) / 16 * 16 : M; /* the step's tiles: whole ones */
    if (!o_by_gemm) memset(s->ot, 0, (size_t)(o_rows * p->n_embd_v) * sizeof(REAL));
}

#if !IS_F64
/* Scores^T (nk, M) of key tile [j0, j0 + nk) as bfloat16 dot products:
 * float16 rows split, or bfloat16 rows in place, page by page. */
static void CAT(scores_dots_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const int64_t D = p->n_embd_k, M = s->u.M;
    if (s->qk == QK_PATH_SPLIT_F16) {
        const uint32_t *kp = tile_of(pl, &pl->k_split, SPLIT_K, &p->k, &s->u, &s->kk, D, j0, nk, 1, s->kt);
        npattn_kernels()->scores_bf16(s->qp, pl->ldq2, M, 2 * D, (const uint16_t *)kp, 4 * D, nk, s->st, M);
        return;
    }
    for (int64_t j = 0, run; j < nk; j += run) {
        const uint16_t *at = (const uint16_t *)npattn_kv_row(&s->kk, j0 + j, &run);
        run = min64(run, nk - j);
        npattn_kernels()->scores_bf16(s->qp, pl->ldq2, M, D / 2, at, p->k.row_stride, run, s->st + j * M, M);
    }
}
#endif

/* Streamed scores (M, nk) of K's rows in place, as stored: the tile's spans
 * (a page each), a round of keys at a time, kv head after kv head. */
static void CAT(scores_spans_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k;
    for (int64_t c = 0; c < nk; c += s->k_keys)
        for (int64_t gi = 0; gi < u->ng; gi++) {
            const int64_t n_span =
                kv_spans(&s->kk, s->k_head, gi, u->ng, j0 + c, min64(s->k_keys, nk - c), u->j1, s->k_dist, s->spans);
            const uint32_t *qb = s->qk == QK_PATH_STREAM_Q_TILES ? s->qp + gi * D / 2 * 16 : NULL;
            npattn_kernels()->scores((const float *)s->qt + gi * s->mg * D, s->mg, D, p->k.dtype, s->kk.dq, s->spans, n_span,
                                     pl->ldk, qb, (float *)s->st + gi * s->mg * s->sld + c, s->sld);
        }
}

/* Rows j0 .. j0 + nk of the unit's kv head gi of t (K or V: its rows kv,
 * head_bytes from one kv head's to the next's, w wide) as REAL: the call's
 * float copy of the tile (gemm tiles of one kv head), else in place where
 * BLAS or the streaming kernels read them (direct), else converted into
 * buf; *ld their leading dimension. */
static const void *CAT(head_rows_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s,
                                        const struct npattn_tensor *t, const struct npattn_kv *kv, int64_t head_bytes,
                                        int64_t gi, int64_t w, int direct, int64_t j0, int64_t nk, REAL *buf,
                                        int64_t *ld) {
    const struct npattn_kv head = kv_head(*kv, gi, head_bytes);
    const int is_k = t == &pl->p->k;
    int in_place;
#if !IS_F64
    const void *copy = !s->stream && s->u.ng == 1 ? tile_of(pl, is_k ? &pl->k_rows : &pl->v_rows, FLOAT_ROWS, t, &s->u,
                                                            kv, w, j0, nk, 1, NULL)
                                                  : NULL;
    if (copy) {
        *ld = w;
        return copy;
    }
#else
    (void)s;
#endif
    return CAT(kv_rows_, SFX)(t, &head, j0, nk, w, direct, is_k ? pl->ldk : pl->ldv, buf, ld, &in_place);
}

/* Scores of K's rows as REAL (head_rows_), each kv head's tile in turn, by
 * a gemm, or streamed (converted: nothing to prefetch). */
static void CAT(scores_rows_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k, M = u->M;
    for (int64_t gi = 0; gi < u->ng; gi++) {
        int64_t ldk;
        const void *ktile =
            CAT(head_rows_, SFX)(pl, s, &p->k, &s->kk, s->k_head, gi, D, s->k_direct, j0, nk, s->kt, &ldk);
        if (s->stream) {
            const struct npattn_span span = {ktile, ktile, nk, NULL, NULL};
            npattn_kernels()->scores((const float *)s->qt + gi * s->mg * D, s->mg, D, NPATTN_DTYPE_F32, NULL, &span, 1, ldk,
                                     NULL, (float *)s->st + gi * s->mg * s->sld, s->sld);
        } else
            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nk, (int)s->mg, (int)D, (REAL)1, (const REAL *)ktile,
                 (int)ldk, s->qt + gi * s->mg, (int)M, (REAL)0, s->st + gi * s->mg, (int)M);
    }
}

/* The mask's tile as a bias and the band where it cuts the tile [j0, j0 +
 * nk). Returns 1 where the mask holds values float cannot hold: the task
 * goes to double. */
static int CAT(band_and_bias_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    s->tile.nk = nk;
    s->tile.bias = NULL;
    if (p->mask_kind != NPATTN_MASK_NONE) {
        if (CAT(mask_tile_, SFX)(p, u->off_mask, u->h0, u->i0, u->nq, u->M, j0, nk, s->bias, s->sj, s->sr, s->row))
            return 1;
        s->tile.bias = s->bias;
    }
    int clipped = npattn_band_clip(&u->band, u->i0, u->nq, u->M, j0, nk, s->lo, s->hi);
    s->tile.lo = clipped ? s->lo : NULL;
    s->tile.hi = clipped ? s->hi : NULL;
    return 0;
}

/* One key tile [j0, j0 + nk) of the unit's rows: its scores on the task's
 * path (K in place where BLAS, or the streaming kernels in K's own type,
 * can read it), the mask and the band, then one step of online softmax
 * down each column: st holds the probabilities exp(x - m), m, l and alpha
 * are updated (p_tiles: P's pairs made as the tiles take them, into pp).
 * Returns 1 when a float tile met an extreme. */
static inline int CAT(softmax_step_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0,
                                          int64_t nk, int p_tiles) {
#if !IS_F64
    if (s->qk == QK_PATH_SPLIT_F16 || s->qk == QK_PATH_BF16) CAT(scores_dots_, SFX)(pl, s, j0, nk);
    else
#endif
    if (s->stream && s->k_direct) CAT(scores_spans_, SFX)(pl, s, j0, nk);
    else CAT(scores_rows_, SFX)(pl, s, j0, nk);
    if (CAT(band_and_bias_, SFX)(pl, s, j0, nk)) return 1;
#if IS_F64
    (void)p_tiles;
    npattn_softmax_f64(s->st, &s->tile, s->mt, s->lt, s->at);
    return 0;
#else
    const struct npattn_kernels *kn = npattn_kernels();
    if (p_tiles) return kn->softmax_tiles_f32(s->st, &s->tile, s->mt, s->lt, s->at, s->pp, pl->ldpa);
    return (s->stream ? kn->softmax_rows_f32 : kn->softmax_f32)(s->st, &s->tile, s->mt, s->lt, s->at);
#endif
}

#if !IS_F64
/* O += P @ V_tile as bfloat16 dot products, on the task's path: streamed,
 * P's rows as bfloat16 against V's rows in place; float16, P and V split;
 * "highest", P's three parts against V's pairs; else P's pairs, made by the
 * softmax as A tiles or here by rows. V's pairs are the call's copy where
 * its last pair is the copy's (nk even, or the whole tile). A subnormal
 * weight, below 2^-126, may read as 0. Returns 0 when the streamed V holds
 * a subnormal value: the tile is then added by the FMAs. */
static int CAT(pv_dots_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct npattn_kernels *kn = npattn_kernels();
    const struct unit *u = &s->u;
    const int64_t M = u->M, Dv = p->n_embd_v, np = (nk + 1) / 2;
    float *ot = s->ot;
    if (s->pv == PV_PATH_STREAM_BF16) {
        npattn_bf16_rows(s->st, M, nk, s->sld, (uint16_t *)s->pp, pl->bk);
        const int64_t n_span = kv_spans(&s->vv, s->v_head, 0, 1, j0, nk, u->j1, s->v_dist, s->spans);
        if (kn->accumulate_pairs((const uint16_t *)s->pp, pl->bk, M, s->spans, n_span, pl->ldv, Dv, (float *)s->vp))
            return 0;
        kn->add_f32(ot, (const float *)s->vp, M * Dv);
        return 1;
    }
    if (s->pv == PV_PATH_SPLIT_F16) {
        const uint32_t *vp = tile_of(pl, &pl->v_tiles, SPLIT_V, &p->v, u, &s->vv, Dv, j0, nk, 1, s->vp);
        kn->split_tiles(s->st, nk, M, M, s->pp, pl->ldpa, (M + 15) / 16 * 16);
        kn->accumulate_tiles_bf16(s->pp, pl->ldpa, M, 2 * nk, vp, pl->ldv2, Dv, ot);
        return 1;
    }
    const int whole_ok = nk % 2 == 0 || nk == min64(pl->bk, u->k1 - j0);
    const uint32_t *vp = tile_of(pl, &pl->v_tiles, V_PAIRS, &p->v, u, &s->vv, Dv, j0, nk, whole_ok, s->vp);
    if (s->pv == PV_PATH_EXACT_BF16) {
        const int64_t rows = (M + 15) / 16 * 16; /* each part's A tiles */
        kn->exact_tiles(s->st, nk, M, M, s->pp, pl->ldpa, rows);
        for (int64_t k = 0; k < 3; k++)
            kn->accumulate_tiles_bf16(s->pp + k * rows * pl->ldpa, pl->ldpa, M, np, vp, pl->ldv2, Dv, ot);
    } else if (s->pv == PV_PATH_BF16_TILES) {
        kn->accumulate_tiles_bf16(s->pp, pl->ldpa, M, np, vp, pl->ldv2, Dv, ot);
    } else {
        npattn_pairs_of_rows(s->st, nk, M, M, s->pp, pl->ldq2);
        kn->accumulate_bf16(s->pp, pl->ldq2, M, np, vp, pl->ldv2, Dv, ot);
    }
    return 1;
}
#endif

#if !IS_F64
/* The whole step of key tile [j0, j0 + nk) on PV_PATH_BF16_STEP: K's pairs
 * as B tiles and V's pairs (the call's copies where it has them), the mask
 * and the band by rows, then the table's pipelined step, which rescales
 * O's rows and adds P @ V. Returns 1 when the tile met an extreme. */
static int CAT(step_tiles_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t D = p->n_embd_k, Dv = p->n_embd_v;
    const uint32_t *kb = tile_of(pl, &pl->k_tiles, K_TILES, &p->k, u, &s->kk, D, j0, nk, 1, s->kt);
    const int whole_ok = nk % 2 == 0 || nk == min64(pl->bk, u->k1 - j0); /* as pv_dots_ */
    const uint32_t *vp = tile_of(pl, &pl->v_tiles, V_PAIRS, &p->v, u, &s->vv, Dv, j0, nk, whole_ok, s->vp);
    if (CAT(band_and_bias_, SFX)(pl, s, j0, nk)) return 1;
    return npattn_kernels()->prefill_tiles_bf16((const uint16_t *)s->qp, D, kb, vp, pl->ldv2, Dv, &s->tile, s->mt,
                                                s->lt, s->at, s->ot, s->st);
}
#endif

/* Streamed O += P @ V of V's rows in place, as stored: the tile's spans (a
 * page each), a round of keys at a time, kv head after kv head. */
static void CAT(pv_spans_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t Dv = p->n_embd_v;
    for (int64_t c = 0; c < nk; c += s->v_keys)
        for (int64_t gi = 0; gi < u->ng; gi++) {
            const int64_t n_span =
                kv_spans(&s->vv, s->v_head, gi, u->ng, j0 + c, min64(s->v_keys, nk - c), u->j1, s->v_dist, s->spans);
            npattn_kernels()->accumulate((const float *)s->st + gi * s->mg * s->sld + c, s->sld, s->mg, s->spans,
                                         n_span, p->v.dtype, s->vv.dq, pl->ldv, Dv, (float *)s->ot + gi * s->mg * Dv);
        }
}

/* O += P @ V of V's rows as REAL (head_rows_), each kv head's in turn, by
 * a gemm (which writes O at the task's first tile), or streamed (converted:
 * nothing to prefetch). */
static void CAT(pv_rows_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk,
                               int first) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t Dv = p->n_embd_v, M = u->M;
    for (int64_t gi = 0; gi < u->ng; gi++) {
        int64_t ldv;
        const void *vtile =
            CAT(head_rows_, SFX)(pl, s, &p->v, &s->vv, s->v_head, gi, Dv, s->v_direct, j0, nk, s->vt, &ldv);
        if (s->stream) {
            const struct npattn_span span = {vtile, vtile, nk, NULL, NULL};
            npattn_kernels()->accumulate((const float *)s->st + gi * s->mg * s->sld, s->sld, s->mg, &span, 1,
                                         NPATTN_DTYPE_F32, NULL, ldv, Dv, (float *)s->ot + gi * s->mg * Dv);
        } else
            GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)s->mg, (int)Dv, (int)nk, (REAL)1, s->st + gi * s->mg,
                 (int)M, (const REAL *)vtile, (int)ldv, (REAL)!first, s->ot + gi * s->mg * Dv, (int)Dv);
    }
}

/* O (M, D_v) += P (M, nk) @ V_tile (nk, D_v), P stored as st, on the task's
 * path; V in place where BLAS, or the streaming kernels in V's own type,
 * can read it, else converted. */
static void CAT(pv_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s, int64_t j0, int64_t nk, int first) {
#if !IS_F64
    if (s->pv != PV_PATH_GEMM && s->pv != PV_PATH_STREAM && CAT(pv_dots_, SFX)(pl, s, j0, nk)) return;
#endif
    if (s->stream && s->v_direct) CAT(pv_spans_, SFX)(pl, s, j0, nk);
    else CAT(pv_rows_, SFX)(pl, s, j0, nk, first);
}

/* The task's rows of out, O / l, and their lse (a row that saw no key:
 * zeros, not NaN, even where 0 * a NaN value was added). Float: a head's
 * rows at a time, straight into out where its rows' elements lie together,
 * else in place, then stored row by row. Returns 1 when a float
 * accumulator overflowed (found as the rows are stored: one pass over O):
 * the task is recomputed in double, which stores its rows again. */
static int CAT(store_rows_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t Dv = p->n_embd_v, M = u->M, nq = u->nq, i0 = u->i0, h0 = u->h0;
    REAL *ot = s->ot, *lt = s->lt;
    int overflowed = 0;
#if IS_F64
    for (int64_t r = 0; r < M && Dv > 0; r++) {
        const REAL inv = lt[r] == (REAL)0 ? (REAL)0 : (REAL)1 / lt[r];
        for (int64_t e = 0; e < Dv; e++) s->row[e] = inv == (REAL)0 ? (REAL)0 : ot[r * Dv + e] * inv;
        STORE(p->out.dtype, s->row, Dv, npattn_elem(&p->out, pl->out_size, u->off_out, h0 + r / nq, i0 + r % nq),
              p->out.col_stride);
    }
#else
    const int direct = p->out.col_stride == 1 && p->out.dtype != NPATTN_DTYPE_F64;
    for (int64_t r0 = 0; r0 < M && Dv > 0; r0 += nq) {
        char *to = npattn_elem(&p->out, pl->out_size, u->off_out, h0 + r0 / nq, i0);
        overflowed |= npattn_kernels()->finish_rows(ot + r0 * Dv, nq, Dv, lt + r0,
                                                    direct ? p->out.dtype : NPATTN_DTYPE_F32,
                                                    direct ? (void *)to : ot + r0 * Dv,
                                                    direct ? p->out.row_stride : Dv);
        for (int64_t r = r0; r < r0 + nq && !direct; r++)
            STORE(p->out.dtype, ot + r * Dv, Dv, to + (r - r0) * p->out.row_stride * pl->out_size, p->out.col_stride);
    }
#endif
    for (int64_t r = 0; r < M && p->lse.data; r++)
        store_lse(p, u->off_lse, h0 + r / nq, i0 + r % nq,
                  lt[r] == (REAL)0 ? -INFINITY : (double)s->mt[r] + log((double)lt[r]));
    return overflowed;
}

/* Split-K: the task's part, (lse, O / l), for the merge, in double; a part
 * that saw no key leaves O itself, 0 or the NaN of 0 * a NaN value, which
 * the merge keeps where another part or the sink gives the row weight.
 * Returns 1 when a float accumulator overflowed. */
static int CAT(store_part_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s) {
    const int64_t Dv = pl->p->n_embd_v, M = s->u.M;
    const REAL *ot = s->ot, *mt = s->mt, *lt = s->lt;
    double *part = pl->partials + (size_t)s->task * (size_t)(pl->max_m * (Dv + 1));
    int overflowed = 0;
    for (int64_t r = 0; r < M; r++) {
        const REAL inv = lt[r] == (REAL)0 ? (REAL)1 : (REAL)1 / lt[r];
        part[r] = lt[r] == (REAL)0 ? -INFINITY : (double)mt[r] + log((double)lt[r]);
        for (int64_t e = 0; e < Dv; e++) {
            const REAL x = ot[r * Dv + e];
            overflowed |= x - x != (REAL)0;
            part[pl->max_m + r * Dv + e] = (double)(x * inv);
        }
    }
    return overflowed;
}

/* Keys zeroed between two polls of the cancel flag: a row of the weights
 * may hold millions. */
#ifndef ZERO_KEYS_PER_POLL
#define ZERO_KEYS_PER_POLL 65536
#endif

/* The attention weights of a task's rows, once m and l hold each row's
 * final max and sum: every key tile again, against the row's lse, so that
 * exp(x - max(lse, x)) is the probability exp(x - lse); keys the band hides
 * are zeros. Returns 1 when a float tile met an extreme. Out of line: sdpa
 * never runs it. */
__attribute__((noinline)) static int CAT(weights_, SFX)(struct fwd_plan *pl, struct CAT(fwd_task_, SFX) *s,
                                                        int64_t t_begin, int64_t t_end) {
    const struct npattn_problem *p = pl->p;
    const struct unit *u = &s->u;
    const int64_t M = u->M;
    for (int64_t r = 0; r < M; r++) {
        s->mt[r] = s->lt[r] == (REAL)0 ? (REAL)-INFINITY : s->mt[r] + (REAL)log((double)s->lt[r]);
        s->lt[r] = 0;
    }
    const int64_t chunk = pl->bk; /* the row scratch holds at least bk elements */
    memset(s->row, 0, (size_t)chunk * sizeof(REAL));
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < p->n_key; j += chunk) {
            if (j % ZERO_KEYS_PER_POLL < chunk && npattn_run_stopped(&pl->run, s->slot)) return 0;
            STORE(p->weights.dtype, s->row, min64(chunk, p->n_key - j), weight_ptr(p, u, r, j), p->weights.col_stride);
        }
    for (int64_t t = t_begin; t < t_end; t++) {
        if (npattn_run_stopped(&pl->run, s->slot)) return 0;
        const int64_t j0 = u->j0 + t * pl->bk, nk = min64(u->j1 - j0, pl->bk);
        if (CAT(softmax_step_, SFX)(pl, s, j0, nk, 0)) return 1;
        for (int64_t r = 0; r < M; r++) {
            for (int64_t j = 0; j < nk; j++) s->row[j] = s->st[j * s->sj + r * s->sr];
            STORE(p->weights.dtype, s->row, nk, weight_ptr(p, u, r, j0), p->weights.col_stride);
        }
    }
    return 0;
}

/* One task: its paths and Q, then per key tile the probabilities (max and
 * sum updated), O's rows rescaled where their max grew (O is zeros at the
 * first tile), and P @ V added; then its rows, or its part under split-K,
 * and the weights (never split-K). Returns 1 when a float task must be
 * recomputed in double. */
static int CAT(tile_fwd_, SFX)(void *plan, int64_t task, int32_t slot, char *scratch) {
    struct fwd_plan *pl = plan;
    const struct npattn_problem *p = pl->p;
    const int64_t Dv = p->n_embd_v;
    struct CAT(fwd_task_, SFX) s;
    CAT(task_begin_, SFX)(pl, task, slot, scratch, &s);
#if !IS_F64
    CAT(task_paths_, SFX)(pl, &s);
#endif
    CAT(task_start_, SFX)(pl, &s);
    const int p_tiles = s.pv == PV_PATH_BF16_TILES;
    const int64_t M = s.u.M;
    for (int64_t t = s.t_begin; t < s.t_end; t++) {
        if (npattn_run_stopped(&pl->run, slot)) return 0;
        const int64_t j0 = s.u.j0 + t * pl->bk, nk = min64(s.u.j1 - j0, pl->bk);
#if !IS_F64
        if (s.pv == PV_PATH_BF16_STEP) {
            if (CAT(step_tiles_, SFX)(pl, &s, j0, nk)) return 1;
            continue;
        }
#endif
        if (CAT(softmax_step_, SFX)(pl, &s, j0, nk, p_tiles)) return 1;
        if (t > s.t_begin)
            for (int64_t r = 0; r < M; r++)
                if (s.at[r] != (REAL)1)
                    for (int64_t e = 0; e < Dv; e++) s.ot[r * Dv + e] *= s.at[r];
        if (Dv > 0) CAT(pv_, SFX)(pl, &s, j0, nk, t == s.t_begin);
    }
    const int overflowed = pl->n_split == 1 ? CAT(store_rows_, SFX)(pl, &s) : CAT(store_part_, SFX)(pl, &s);
    if (!IS_F64 && overflowed) return 1;
    return p->weights.data ? CAT(weights_, SFX)(pl, &s, s.t_begin, s.t_end) : 0;
}

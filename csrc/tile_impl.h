/* tile_impl.h: one tile of attention, written once for both element types.
 * attention.c includes it twice, with REAL = float and REAL = double; SFX
 * names the copy, GEMM is sgemm or dgemm, SOFTMAX_STEP the kernel, and
 * TILE_CONVERTS is 1 where float16/bfloat16 storage is computed in REAL.
 *
 * A task is (batch b, kv head g, block of heads of g's group, block of query
 * rows). It stacks the group's query rows into one (M, D) tile so that one
 * gemm against each K tile serves every head of the group, then runs online
 * softmax between the two products (FlashAttention-2, arXiv:2307.08691).
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static void CAT(run_tile_, SFX)(void *arg, int64_t task, int32_t slot) {
    const struct plan *pl = arg;
    const struct npattn_problem *p = pl->p;
    const int64_t L = p->n_query, S = p->n_key, D = p->n_embd_k, Dv = p->n_embd_v;

    /* Largest-first: the last query blocks see the most keys under a causal mask. */
    int64_t per_qblock = pl->n_batch * p->n_head_kv * pl->n_hblock;
    int64_t qb = pl->n_qblock - 1 - task / per_qblock;
    int64_t rest = task % per_qblock;
    int64_t hb = rest % pl->n_hblock;
    rest /= pl->n_hblock;
    int64_t g = rest % p->n_head_kv;
    int64_t b = rest / p->n_head_kv;

    struct offsets off;
    batch_offsets(p, b, &off);
    const size_t es = pl->elem_size; /* bytes per stored element of q, k, v, out */
    const char *q = (const char *)p->q + (off.q * (int64_t)es);
    const char *k = (const char *)p->k + (off.k + g * p->k_head_stride) * (int64_t)es;
    const char *v = (const char *)p->v + (off.v + g * p->v_head_stride) * (int64_t)es;
    char *out = (char *)p->out + off.out * (int64_t)es;

    const int64_t i0 = qb * pl->bq;
    const int64_t nq = L - i0 < pl->bq ? L - i0 : pl->bq;  /* query rows per head */
    const int64_t h0 = g * pl->group + hb * pl->bh;         /* first query head */
    const int64_t rest_h = pl->group - hb * pl->bh;
    const int64_t nh = rest_h < pl->bh ? rest_h : pl->bh;   /* heads in this tile */
    const int64_t M = nh * nq;                              /* stacked rows */

    /* scratch of this slot: Q tile (M, D), scores (M, bk), O (M, D_v), m, l,
     * and for float16/bfloat16 the K and V tiles converted to float */
    REAL *qt = (REAL *)(pl->scratch + (size_t)slot * pl->scratch_per_slot);
    REAL *st = qt + pl->max_m * D;
    REAL *ot = st + pl->max_m * pl->bk;
    REAL *mt = ot + pl->max_m * Dv;
    REAL *lt = mt + pl->max_m;
    REAL *kt = lt + pl->max_m;
    REAL *vt = kt + pl->bk * D;

    /* Load Q with scale * log2(e) folded in, so that scores are base-2 logits. */
    const REAL qscale = (REAL)(p->scale * 1.4426950408889634);
    for (int64_t r = 0; r < M; r++) {
        const char *qrow = q + ((h0 + r / nq) * p->q_head_stride + (i0 + r % nq) * p->q_row_stride) * (int64_t)es;
        REAL *qd = qt + r * D;
#if TILE_CONVERTS
        if (p->dtype != NPATTN_DTYPE_F32) {
            npattn_row_to_f32(p->dtype, qrow, p->q_col_stride, D, qd);
            for (int64_t d = 0; d < D; d++) qd[d] *= qscale;
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) qd[d] = ((const REAL *)qrow)[d * p->q_col_stride] * qscale;
    }
    /* The running max starts at the head's sink, whose exp2 weight is 1. */
    for (int64_t r = 0; r < M; r++) {
        mt[r] = p->sinks ? (REAL)(p->sinks[h0 + r / nq] * 1.4426950408889634) : (REAL)-INFINITY;
        lt[r] = p->sinks ? (REAL)1 : (REAL)0;
    }
    memset(ot, 0, (size_t)(M * Dv) * sizeof(REAL));

    /* Keys past the last row's causal limit are never computed. */
    int64_t j_end = S;
    if (pl->causal) {
        int64_t last = i0 + nq - 1 + pl->causal_offset + 1;
        if (last < j_end) j_end = last;
    }
    const int ldk = (int)pl->ldk, ldv = (int)pl->ldv;

    for (int64_t j0 = 0; j0 < j_end; j0 += pl->bk) {
        if (pl->cancel_seen && atomic_load_explicit(pl->cancel_seen, memory_order_relaxed)) return;
        const int64_t nk = j_end - j0 < pl->bk ? j_end - j0 : pl->bk;

        const REAL *ktile = (const REAL *)(k + j0 * pl->ldk * (int64_t)es);
        const REAL *vtile = (const REAL *)(v + j0 * pl->ldv * (int64_t)es);
        int ldkt = ldk, ldvt = ldv;
#if TILE_CONVERTS
        if (p->dtype != NPATTN_DTYPE_F32) {
            /* float16/bfloat16: this tile's rows in float, never all of K or V */
            for (int64_t j = 0; j < nk; j++) {
                npattn_row_to_f32(p->dtype, k + (j0 + j) * pl->ldk * (int64_t)es, 1, D, kt + j * D);
                npattn_row_to_f32(p->dtype, v + (j0 + j) * pl->ldv * (int64_t)es, 1, Dv, vt + j * Dv);
            }
            ktile = kt, vtile = vt, ldkt = (int)D, ldvt = (int)(Dv > 0 ? Dv : 1);
        }
#else
        (void)kt, (void)vt;
#endif

        /* scores = Qs @ K_tile^T */
        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)nk, (int)D, (REAL)1, qt, (int)D,
             ktile, ldkt, (REAL)0, st, (int)nk);

        for (int64_t r = 0; r < M; r++) {
            REAL *srow = st + r * nk;
            const int64_t h = h0 + r / nq, i = i0 + r % nq;
            if (pl->causal) {
                /* hide keys j > i + offset: clip the diagonal tile exactly */
                int64_t vis = i + pl->causal_offset + 1 - j0;
                for (int64_t j = vis < 0 ? 0 : vis; j < nk; j++) srow[j] = (REAL)-INFINITY;
            } else if (p->mask_kind == NPATTN_MASK_BOOL) {
                const uint8_t *mrow = (const uint8_t *)p->mask + off.mask + h * p->mask_head_stride +
                                      i * p->mask_row_stride + j0 * p->mask_col_stride;
                for (int64_t j = 0; j < nk; j++)
                    if (!mrow[j * p->mask_col_stride]) srow[j] = (REAL)-INFINITY;
            } else if (p->mask_kind == NPATTN_MASK_ADD) {
                const REAL *mrow = (const REAL *)p->mask + off.mask + h * p->mask_head_stride +
                                   i * p->mask_row_stride + j0 * p->mask_col_stride;
                /* the mask is in natural-log units: bring it to base 2 */
                for (int64_t j = 0; j < nk; j++)
                    srow[j] += mrow[j * p->mask_col_stride] * (REAL)1.4426950408889634;
            }
            /* online softmax: probabilities in place, running max and sum updated */
            REAL alpha = SOFTMAX_STEP(srow, nk, &mt[r], &lt[r]);
            if (alpha != (REAL)1) {
                REAL *orow = ot + r * Dv;
                for (int64_t e = 0; e < Dv; e++) orow[e] *= alpha;
            }
        }

        /* O += P @ V_tile */
        if (Dv > 0)
            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)Dv, (int)nk, (REAL)1, st, (int)nk,
                 vtile, ldvt, (REAL)1, ot, (int)Dv);
    }

    /* out = O / l; a row that saw no key (l = 0) is zeros, not NaN */
    for (int64_t r = 0; r < M; r++) {
        char *orow = out + ((h0 + r / nq) * p->out_head_stride + (i0 + r % nq) * p->out_row_stride) * (int64_t)es;
        REAL inv = lt[r] == (REAL)0 ? (REAL)0 : (REAL)1 / lt[r];
        REAL *od = ot + r * Dv;
        for (int64_t e = 0; e < Dv; e++) od[e] *= inv;
#if TILE_CONVERTS
        if (p->dtype != NPATTN_DTYPE_F32) {
            npattn_row_from_f32(p->dtype, od, Dv, orow, p->out_col_stride);
            continue;
        }
#endif
        for (int64_t e = 0; e < Dv; e++) ((REAL *)orow)[e * p->out_col_stride] = od[e];
    }
}

#undef CAT
#undef CAT_

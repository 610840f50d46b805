/* tile.h: what the forward and backward tiles share, written once for both
 * computed types: included with REAL (float or double) and SFX (f32 or f64)
 * defined, before tile_fwd.h or tile_bwd.h. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define LOAD CAT(npattn_load_, SFX)
#define STORE CAT(npattn_store_, SFX)
#define DEQUANT CAT(npattn_dequant_, SFX)

/* Rows j0 .. j0+nk of an operand (k or v of one head, rows at kv): the rows
 * in place, in t's own dtype, when they are read directly (direct, leading
 * dimension ld_direct: by BLAS as REAL, or by the streaming kernels) and lie
 * in one page, else converted or gathered into buf as REAL (leading dimension
 * width; codes as the values they stand for); *in_place says which. */
static const void *CAT(kv_rows_, SFX)(const struct npattn_tensor *t, const struct npattn_kv *kv, int64_t j0,
                                      int64_t nk, int64_t width, int direct, int64_t ld_direct, REAL *buf, int64_t *ld,
                                      int *in_place) {
    int64_t run;
    *in_place = 0;
    *ld = width > 0 ? width : 1;
    if (nk <= 0) return buf;
    const char *first = npattn_kv_row(kv, j0, &run);
    *in_place = direct && run >= nk;
    if (*in_place) {
        *ld = ld_direct;
        return first;
    }
    for (int64_t j = 0; j < nk; j += run) {
        const char *at = npattn_kv_row(kv, j0 + j, &run);
        run = min64(run, nk - j);
        for (int64_t i = 0; i < run; i++) {
            const char *row = at + i * kv->row_bytes;
            if (kv->dq) /* codes: the values they stand for */
                DEQUANT(kv->dq, t->dtype, row, t->col_stride, width, npattn_kv_groups_row(kv, &kv->scale, j0 + j + i),
                        npattn_kv_groups_row(kv, &kv->zero, j0 + j + i), buf + (j + i) * width);
            else
                LOAD(t->dtype, row, t->col_stride, width, buf + (j + i) * width);
        }
    }
    return buf;
}

/* rowsT (w, M) = the transpose of rows (M, w), rowsT[d * ldt + r] =
 * rows[r * ldr + d]: 8 x 8 blocks, whose fixed bounds the compiler unrolls
 * (a quarter to a half of the time of blocks with bounds checked inside),
 * then the rows and columns left over. The double tasks' and the portable
 * table's; the SIMD tables' transpose_f32 keeps its blocks in registers. */
static void CAT(transposed_, SFX)(const REAL *rows, int64_t ldr, int64_t M, int64_t w, REAL *rowsT, int64_t ldt) {
    int64_t r0 = 0;
    for (; r0 + 8 <= M; r0 += 8) {
        int64_t d0 = 0;
        for (; d0 + 8 <= w; d0 += 8)
            for (int d = 0; d < 8; d++)
                for (int r = 0; r < 8; r++) rowsT[(d0 + d) * ldt + r0 + r] = rows[(r0 + r) * ldr + d0 + d];
        for (int64_t d = d0; d < w; d++)
            for (int r = 0; r < 8; r++) rowsT[d * ldt + r0 + r] = rows[(r0 + r) * ldr + d];
    }
    for (int64_t r = r0; r < M; r++)
        for (int64_t d = 0; d < w; d++) rowsT[d * ldt + r] = rows[r * ldr + d];
}

/* The transpose above through the table's transpose_f32 for float, where
 * it has one. */
static void CAT(transpose_, SFX)(const REAL *rows, int64_t ldr, int64_t M, int64_t w, REAL *rowsT, int64_t ldt) {
#if !IS_F64
    if (npattn_kernels()->transpose_f32) {
        npattn_kernels()->transpose_f32(rows, ldr, M, w, rowsT, ldt);
        return;
    }
#endif
    CAT(transposed_, SFX)(rows, ldr, M, w, rowsT, ldt);
}

/* Stacked rows r = 0 .. M-1 (head h0 + r / nq, query i0 + r % nq) of an
 * operand of width w at batch offset off, as REAL: rows (M, w). */
static void CAT(stacked_rows_, SFX)(const struct npattn_tensor *t, int64_t off, int64_t h0, int64_t i0, int64_t nq,
                                    int64_t M, int64_t w, REAL *rows) {
    const int64_t es = (int64_t)npattn_dtype_size(t->dtype);
    for (int64_t r = 0; r < M; r++) LOAD(t->dtype, npattn_elem(t, es, off, h0 + r / nq, i0 + r % nq), t->col_stride, w, rows + r * w);
}

/* Their transpose, rowsT (w, M): read in place, a head's nq rows at a time,
 * where the operand holds REAL with its elements adjacent and a head has a
 * whole block of the transposes' rows; else through rows (M, w). The
 * copy that this saves was 8% of a small prefill (Qwen2-0.5B L = S = 32). */
static inline void CAT(stacked_transposed_, SFX)(const struct npattn_tensor *t, int64_t off, int64_t h0, int64_t i0,
                                                 int64_t nq, int64_t M, int64_t w, REAL *rows, REAL *rowsT) {
    if (t->dtype != (IS_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32) || t->col_stride != 1 || nq < NPATTN_TRANSPOSE_ROWS) {
        CAT(stacked_rows_, SFX)(t, off, h0, i0, nq, M, w, rows);
        CAT(transpose_, SFX)(rows, w, M, w, rowsT, M);
        return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += nq)
        CAT(transpose_, SFX)((const REAL *)npattn_elem(t, sizeof(REAL), off, h0 + r0 / nq, i0), t->row_stride, nq, w,
                             rowsT + r0, M);
}

/* The mask's tile for the stacked rows and keys j0 .. j0+nk as a bias: 0 or
 * -inf for a bool mask, the values for an additive one, at bias[j * sj + r * sr].
 * Returns 1 when REAL cannot hold a value (a float64 mask beyond float's
 * range, in a float tile): the task is then redone in double. */
static int CAT(mask_tile_, SFX)(const struct npattn_problem *p, int64_t off, int64_t h0, int64_t i0, int64_t nq,
                                int64_t M, int64_t j0, int64_t nk, REAL *bias, int64_t sj, int64_t sr, REAL *row) {
    const int64_t ms = npattn_mask_size(p), mcs = p->mask.col_stride;
    for (int64_t r = 0; r < M; r++) {
        const char *mrow = npattn_elem(&p->mask, ms, off, h0 + r / nq, i0 + r % nq) + j0 * mcs * ms;
        if (p->mask_kind == NPATTN_MASK_BOOL) {
            for (int64_t j = 0; j < nk; j++) bias[j * sj + r * sr] = ((const uint8_t *)mrow)[j * mcs] ? (REAL)0 : (REAL)-INFINITY;
        } else {
#if !IS_F64
            if (p->mask.dtype == NPATTN_DTYPE_F64)
                for (int64_t j = 0; j < nk; j++) {
                    const double x = ((const double *)mrow)[j * mcs];
                    if (fabs(x) > FLT_MAX && fabs(x) != INFINITY) return 1;
                }
#endif
            LOAD(p->mask.dtype, mrow, mcs, nk, row);
            for (int64_t j = 0; j < nk; j++) bias[j * sj + r * sr] = row[j];
        }
    }
    return 0;
}

/* Whether score (j, r) of a tile is hidden, by the band or the mask. */
static inline int CAT(hidden_, SFX)(const SCORE_TILE *t, int64_t j, int64_t r) {
    return (t->lo && (j < t->lo[r] || j > t->hi[r])) || (t->bias && t->bias[j * t->ld + r] == -INFINITY);
}

/* Whether rows x (n, w), leading dimension ld, are all finite. */
static inline int CAT(rows_finite_, SFX)(const REAL *x, int64_t n, int64_t w, int64_t ld) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < w; e++) bad |= !isfinite(x[i * ld + e]);
    return !bad;
}

/* out += alpha * the product of a tile c (nk, M), as scores are laid out,
 * with rows b, leaving out the pairs (j, r) the tile hides: a hidden key
 * adds nothing, not 0 * a NaN or infinite row. by_key 0: out (nk, w) row j
 * += sum over r of c[j, r] b[r]; by_key 1: out (M, w) row r += sum over j of
 * c[j, r] b[j]. What a gemm computes, for tiles whose rows are not all finite. */
static inline void CAT(seen_product_, SFX)(const SCORE_TILE *t, const REAL *c, int by_key, const REAL *b,
                                           int64_t ldb, int64_t w, REAL alpha, REAL *out, int64_t ldo) {
    for (int64_t j = 0; j < t->nk; j++)
        for (int64_t r = 0; r < t->M; r++) {
            if (CAT(hidden_, SFX)(t, j, r)) continue;
            const REAL a = alpha * c[j * t->ld + r], *brow = b + (by_key ? j : r) * ldb;
            REAL *orow = out + (by_key ? r : j) * ldo;
            for (int64_t e = 0; e < w; e++) orow[e] += a * brow[e];
        }
}

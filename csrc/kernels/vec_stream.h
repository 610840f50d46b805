/* kernels/vec_stream.h: the decode stream written once over the vector
 * layer: the streamed scores (kernels.h's scores, by reduction trees) and
 * P @ V (accumulate), each key and value row read once in its own format
 * (the layer's vload_as). An ISA file includes its vec_*.h and vec_math.h,
 * then this, and defines the two pieces that are its own (declared here):
 *   isa_scores_own(kt, q, M, D, spans, n_span, ldk, st, ldst): the scores of
 *     the first rows of q it takes in a layout of its own (rows or keys in
 *     the lanes), returning how many (0: none);
 *   isa_accumulate_of(vt, st, ldst, M, spans, n_span, ldv, Dv, o): o's rows
 *     cut into register blocks of vec_accumulate_block, returning the first
 *     column it left to the portable code (Dv: none).
 * It puts vec_scores and vec_accumulate in its table. */
#ifndef NPATTN_KERNELS_VEC_STREAM_H
#define NPATTN_KERNELS_VEC_STREAM_H

VEC_FN int64_t isa_scores_own(enum npattn_dtype kt, const float *q, int64_t M, int64_t D,
                              const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st, int64_t ldst);
VEC_FN int64_t isa_accumulate_of(enum npattn_dtype vt, const float *st, int64_t ldst, int64_t M,
                                 const struct npattn_span *spans, int64_t n_span, int64_t ldv, int64_t Dv, float *o);

/* The lanes of a row of q (floats) or of K or V (type t) from column d of
 * n (or those of live): a masked vector where the layer has cheap masks,
 * else a whole one (its kernels leave the last columns to scalar code). */
#if VEC_MASKED_TAILS
VEC_FN vf vec_q_at(const float *p, int64_t n) { return vload_part(p, n); }
VEC_FN vf vec_row_at(enum npattn_dtype t, const void *p, int64_t n) { return vload_as_part(t, p, n); }
VEC_FN vf vec_row_m(enum npattn_dtype t, const void *p, vm live) { return vload_as_m(t, p, live); }
#else
VEC_FN vf vec_q_at(const float *p, int64_t n) { return (void)n, vload(p); }
VEC_FN vf vec_row_at(enum npattn_dtype t, const void *p, int64_t n) { return (void)n, vload_as(t, p); }
VEC_FN vf vec_row_m(enum npattn_dtype t, const void *p, vm live) { return (void)live, vload_as(t, p); }
#endif

/* ---- scores: st (M, ldst) = the rows of q (M, D) against the spans' keys ---- */

/* The scores of nkb keys against 16 rows of q held in the lanes (the ISA
 * files' rows in lanes), acc[16 / VEC_LANES * key + g] holding rows
 * VEC_LANES g onwards, into st's 16 rows (ldst apart), through a buffer:
 * a block of fewer keys than the transposes' stores take. */
VEC_FN void vec_store_lanes_scores(const vf *acc, int nkb, float *st, int64_t ldst) {
    enum { G = 16 / VEC_LANES };
    float out[16 * 8];
    for (int i = 0; i < G * nkb; i++) vstore(out + VEC_LANES * i, acc[i]);
    for (int r = 0; r < 16; r++)
        for (int a = 0; a < nkb; a++) st[r * ldst + a] = out[VEC_LANES * (G * a + r / VEC_LANES) + r % VEC_LANES];
}

/* Scores of nr <= VEC_SCORE_ROWS rows of q (at qr) against nkb <=
 * VEC_SCORE_KEYS keys (rows of type kt at kr, ldk apart), into st (nr,
 * ldst): a small GEMM's microkernel, each key vector converted once and
 * used nr times, then one reduction per score (the layer's vsums, or
 * vstore_sums where the last columns were a masked vector) and the columns
 * past the last whole vector one by one. pf: where the rows to
 * prefetch for these keys start, or NULL. */
VEC_FN void vec_scores_block(enum npattn_dtype kt, const float *qr, const int nr, int64_t D, const void *kr,
                             int64_t ldk, const int nkb, float *st, int64_t ldst, const void *pf) {
    enum { K = VEC_SCORE_KEYS };
    vf acc[VEC_SUMS]; /* acc[K * row + key] */
    for (int i = 0; i < VEC_SUMS; i++) acc[i] = vzero();
    const int64_t es = npattn_stream_size(kt), whole = VEC_MASKED_TAILS ? D : D / VEC_LANES * VEC_LANES;
    int64_t d = 0;
    for (; d < whole; d += VEC_LANES) {
        if (pf && (d * es) % 64 == 0) /* the rows ahead, one prefetch per cache line */
            for (int a = 0; a < nkb; a++) vprefetch(npattn_stream_at(kt, pf, a * ldk + d));
        vf kv[VEC_SCORE_KEYS];
        for (int a = 0; a < nkb; a++) kv[a] = vec_row_at(kt, npattn_stream_at(kt, kr, a * ldk + d), D - d);
        for (int b = 0; b < nr; b++) { /* one query vector at a time: avx2's 16 registers hold no more */
            const vf qv = vec_q_at(qr + b * D + d, D - d);
            for (int a = 0; a < nkb; a++) acc[K * b + a] = vfma(kv[a], qv, acc[K * b + a]);
        }
    }
#if VEC_MASKED_TAILS
    vstore_sums(acc, nr, nkb, st, ldst);
#else
    float out[VEC_SUMS];
    vsums(acc, nr * K, out);
    if (d < D) /* the columns past the last whole vector */
        for (int b = 0; b < nr; b++)
            for (int a = 0; a < nkb; a++)
                for (int64_t e = d; e < D; e++) out[K * b + a] += qr[b * D + e] * npattn_stream_elem(kt, kr, a * ldk + e);
    for (int b = 0; b < nr; b++)
        for (int a = 0; a < nkb; a++) st[b * ldst + a] = out[K * b + a];
#endif
}

/* nkb keys (at kr) against every row of q, VEC_SCORE_ROWS rows at a time,
 * the rows left a block of their own count; the first block prefetches. */
VEC_FN void vec_scores_keys(enum npattn_dtype kt, const float *q, int64_t M, int64_t D, const void *kr, int64_t ldk,
                            const int nkb, float *st, int64_t ldst, const void *pf) {
    enum { R = VEC_SCORE_ROWS };
    int64_t r = 0;
    for (; r + R <= M; r += R) vec_scores_block(kt, q + r * D, R, D, kr, ldk, nkb, st + r * ldst, ldst, r == 0 ? pf : NULL);
    const void *pr = r == 0 ? pf : NULL;
    switch (M - r) {
    case 3: if (3 < R) vec_scores_block(kt, q + r * D, 3, D, kr, ldk, nkb, st + r * ldst, ldst, pr); break;
    case 2: if (2 < R) vec_scores_block(kt, q + r * D, 2, D, kr, ldk, nkb, st + r * ldst, ldst, pr); break;
    case 1: vec_scores_block(kt, q + r * D, 1, D, kr, ldk, nkb, st + r * ldst, ldst, pr); break;
    default: break;
    }
}

/* The spans' keys against every row of q, VEC_SCORE_KEYS keys at a time
 * (those prefetch their rows ahead), a span's last keys a block of their
 * own count. */
VEC_FN void vec_scores_of(enum npattn_dtype kt, const float *q, int64_t M, int64_t D, const struct npattn_span *spans,
                          int64_t n_span, int64_t ldk, float *st, int64_t ldst) {
    enum { K = VEC_SCORE_KEYS };
    for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n) {
        const void *k = spans[i].rows;
        const int64_t nk = spans[i].n;
        float *sj = st + j0;
        int64_t j = 0;
        for (; j + K <= nk; j += K)
            vec_scores_keys(kt, q, M, D, npattn_stream_at(kt, k, j * ldk), ldk, K, sj + j, ldst,
                            npattn_stream_at(kt, spans[i].ahead, j * ldk));
        const void *kr = npattn_stream_at(kt, k, j * ldk);
        switch (nk - j) {
        case 3: if (3 < K) vec_scores_keys(kt, q, M, D, kr, ldk, 3, sj + j, ldst, NULL); break;
        case 2: vec_scores_keys(kt, q, M, D, kr, ldk, 2, sj + j, ldst, NULL); break;
        case 1: vec_scores_keys(kt, q, M, D, kr, ldk, 1, sj + j, ldst, NULL); break;
        default: break;
        }
    }
}

/* The rows the ISA's own layout leaves, D = 64 as a constant so that the
 * loops over it unroll (1.08-1.27x in cache on avx2, 0.98-1.28x on avx512;
 * D = 128 so unrolled ran faster alone but no faster in a decode). */
VEC_FN void vec_scores_typed(enum npattn_dtype kt, const float *q, int64_t M, int64_t D,
                             const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st, int64_t ldst) {
    const int64_t own = isa_scores_own(kt, q, M, D, spans, n_span, ldk, st, ldst);
    if (own == M) return;
    q += own * D, st += own * ldst, M -= own;
    if (D == 64) vec_scores_of(kt, q, M, 64, spans, n_span, ldk, st, ldst);
    else vec_scores_of(kt, q, M, D, spans, n_span, ldk, st, ldst);
}

/* kernels.h's scores, without tiles (qb ignored): one copy of the loops per
 * key type, its conversion inlined. */
static VEC_TARGET void vec_scores(const float *q, int64_t M, int64_t D, enum npattn_dtype kt,
                                  const struct npattn_span *spans, int64_t n_span, int64_t ldk, const uint32_t *qb,
                                  float *st, int64_t ldst) {
    (void)qb;
    switch (kt) {
    case NPATTN_DTYPE_F16: vec_scores_typed(NPATTN_DTYPE_F16, q, M, D, spans, n_span, ldk, st, ldst); break;
    case NPATTN_DTYPE_BF16: vec_scores_typed(NPATTN_DTYPE_BF16, q, M, D, spans, n_span, ldk, st, ldst); break;
    default: vec_scores_typed(NPATTN_DTYPE_F32, q, M, D, spans, n_span, ldk, st, ldst); break;
    }
}

/* ---- accumulate: o (M, Dv) += P @ V, P given as st (M, ldst) ---- */

/* o (nr rows, nc vectors of columns from e0) += P @ v, o in registers
 * (nr * nc accumulators, from zero) while the value rows (type vt) of the
 * spans stream past, each row's vectors loaded and converted once for all
 * nr rows, a broadcast weight each. The block prefetches its columns of
 * every pf_every-th row ahead from row pf_first on (pf_every 0: none; 1, a
 * constant: every row, with no branch in the loop, which would spill o). */
VEC_FN void vec_accumulate_block(enum npattn_dtype vt, const float *st, int64_t ldst, const int nr, const int nc,
                                 const struct npattn_span *spans, int64_t n_span, int64_t ldv, int64_t Dv, int64_t e0,
                                 float *o, const int pf_every, int pf_first) {
    const int64_t es = npattn_stream_size(vt);
    vm m[VEC_ACC_CHUNKS];
    for (int c = 0; c < nc; c++) m[c] = VEC_MASKED_TAILS ? vlanes(Dv - e0 - VEC_LANES * c) : vall();
    vf acc[VEC_ACC_REGS]; /* acc[nc * row + chunk] */
    for (int i = 0; i < nr * nc; i++) acc[i] = vzero();
    int to_pf = pf_first; /* rows until the next prefetch */
    for (int64_t ri = 0, j = 0; ri < n_span; ri++) {
        const char *v = (const char *)spans[ri].rows + e0 * es, *pf = (const char *)spans[ri].ahead + e0 * es;
        for (int64_t i = 0; i < spans[ri].n; i++, j++) {
            if (pf_every == 1 || (pf_every && to_pf-- == 0)) { /* the block's columns, into L2 */
                for (int64_t b = 0; b < VEC_LANES * nc * es; b += 64) vprefetch(pf + i * ldv * es + b);
                to_pf = pf_every - 1;
            }
            vf vv[VEC_ACC_CHUNKS];
            for (int c = 0; c < nc; c++) vv[c] = vec_row_m(vt, v + (i * ldv + VEC_LANES * c) * es, m[c]);
            for (int a = 0; a < nr; a++) {
                const vf pa = vbroadcast(st + a * ldst + j);
                for (int c = 0; c < nc; c++) acc[nc * a + c] = vfma(pa, vv[c], acc[nc * a + c]);
            }
        }
    }
    for (int a = 0; a < nr; a++)
        for (int c = 0; c < nc; c++) {
            float *oc = o + a * Dv + e0 + VEC_LANES * c;
            vstore_m(oc, m[c], vadd(vload_m(oc, m[c]), acc[nc * a + c]));
        }
}

/* kernels.h's accumulate: one copy of the ISA's blocks per value type, its
 * conversion inlined; the columns they leave by the portable code. */
static VEC_TARGET void vec_accumulate(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                      int64_t n_span, enum npattn_dtype vt, int64_t ldv, int64_t Dv, float *o) {
    int64_t done;
    switch (vt) {
    case NPATTN_DTYPE_F16: done = isa_accumulate_of(NPATTN_DTYPE_F16, st, ldst, M, spans, n_span, ldv, Dv, o); break;
    case NPATTN_DTYPE_BF16: done = isa_accumulate_of(NPATTN_DTYPE_BF16, st, ldst, M, spans, n_span, ldv, Dv, o); break;
    default: done = isa_accumulate_of(NPATTN_DTYPE_F32, st, ldst, M, spans, n_span, ldv, Dv, o); break;
    }
    if (done < Dv) npattn_accumulate_columns(st, ldst, M, spans, n_span, vt, ldv, Dv, done, o);
}

#endif

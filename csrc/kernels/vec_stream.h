/* kernels/vec_stream.h: the decode stream written once over the vector
 * layer: the streamed scores (kernels.h's scores, by reduction trees) and
 * P @ V (accumulate), each key and value row read once in its own format
 * (the layer's vload_as), codes made into the values they stand for in
 * registers (vec_code_at: the scale and zero point of the row's group,
 * broadcast). An ISA file includes its vec_*.h and vec_math.h, then this,
 * and defines the two pieces that are its own (declared here):
 *   isa_scores_own(kt, dq, q, M, D, spans, n_span, ldk, st, ldst): the
 *     scores of the first rows of q it takes in a layout of its own (rows
 *     or keys in the lanes), returning how many (0: none);
 *   isa_accumulate_of(vt, zero, dq, st, ldst, M, spans, n_span, ldv, Dv,
 *     o): o's rows cut into register blocks of vec_accumulate_block,
 *     returning the first column it left to the portable code (Dv: none).
 * It puts vec_scores and vec_accumulate in its table, and VEC_LANES as its
 * code_step; it may define VEC_ACC_D64 as 1 first, for a copy of
 * accumulate with Dv = 64 as a constant. */
#ifndef NPATTN_KERNELS_VEC_STREAM_H
#define NPATTN_KERNELS_VEC_STREAM_H

#ifndef VEC_ACC_D64
#define VEC_ACC_D64 0
#endif

VEC_FN int64_t isa_scores_own(enum npattn_dtype kt, const struct npattn_dequant *dq, const float *q, int64_t M,
                              int64_t D, const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,
                              int64_t ldst);
VEC_FN int64_t isa_accumulate_of(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq,
                                 const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                 int64_t n_span, int64_t ldv, int64_t Dv, float *o);

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

/* ---- codes: the values they stand for, in registers ---- */

/* The scale (or zero point) of group g of row a of the rows whose first
 * row's scales are at p (type t, row and col elements apart), as float. */
VEC_FN float vec_group_of(enum npattn_dtype t, const void *p, int64_t row, int64_t col, int64_t a, int64_t g) {
    return npattn_stream_elem(t, p, a * row + g * col);
}

/* The lanes of a row of codes (type t) from column d of n, as the values
 * they stand for: (code - *z) * *s, or code * *s without zero points (a
 * constant), each in float as npattn.dequantize rounds it; the lanes past
 * n 0 (a masked tail's lanes would be -z * s). */
VEC_FN vf vec_code_at(enum npattn_dtype t, const void *p, int64_t n, const float *s, const float *z, const int zero) {
    const vf x = vec_row_at(t, p, n);
    const vf y = vmul(zero ? vsub(x, vbroadcast(z)) : x, vbroadcast(s));
#if VEC_MASKED_TAILS
    if (n < VEC_LANES) return vkeep(y, vlanes(n));
#endif
    return y;
}

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

/* vec_scores_block's columns d .. end (whole vectors) into acc: each key
 * vector converted once (codes, a constant: made their values with the
 * group's sk[a] and zk[a]) and used nr times. Returns end. */
VEC_FN int64_t vec_scores_run(enum npattn_dtype kt, const int zero, const int codes, const float *qr, const int nr,
                              int64_t D, const void *kr, int64_t ldk, const int nkb, int64_t d, int64_t end,
                              const float *sk, const float *zk, const void *pf, vf *acc) {
    enum { K = VEC_SCORE_KEYS };
    const int64_t es = npattn_stream_size(kt);
    for (; d < end; d += VEC_LANES) {
        if (pf && (d * es) % 64 == 0) /* the rows ahead, one prefetch per cache line */
            for (int a = 0; a < nkb; a++) vprefetch(npattn_stream_at(kt, pf, a * ldk + d));
        vf kv[VEC_SCORE_KEYS];
        for (int a = 0; a < nkb; a++) {
            const void *at = npattn_stream_at(kt, kr, a * ldk + d);
            kv[a] = codes ? vec_code_at(kt, at, D - d, &sk[a], &zk[a], zero) : vec_row_at(kt, at, D - d);
        }
        for (int b = 0; b < nr; b++) { /* one query vector at a time: avx2's 16 registers hold no more */
            const vf qv = vec_q_at(qr + b * D + d, D - d);
            for (int a = 0; a < nkb; a++) acc[K * b + a] = vfma(kv[a], qv, acc[K * b + a]);
        }
    }
    return end;
}

/* Scores of nr <= VEC_SCORE_ROWS rows of q (at qr) against nkb <=
 * VEC_SCORE_KEYS keys (rows of type kt at kr, ldk apart), into st (nr,
 * ldst): a small GEMM's microkernel, each key vector converted once and
 * used nr times, then one reduction per score (the layer's vsums, or
 * vstore_sums where the last columns were a masked vector) and the columns
 * past the last whole vector one by one. Codes (dq, and the keys' scales
 * and zero points from ks and kz, zero a constant) are made into their
 * values as they are converted, a group of D / G columns at a time: the
 * keys' scales of the group read once. pf: where the rows to prefetch for
 * these keys start, or NULL. */
VEC_FN void vec_scores_block(enum npattn_dtype kt, const int zero, const struct npattn_dequant *dq, const float *qr,
                             const int nr, int64_t D, const void *kr, const void *ks, const void *kz, int64_t ldk,
                             const int nkb, float *st, int64_t ldst, const void *pf) {
    enum { K = VEC_SCORE_KEYS };
    vf acc[VEC_SUMS]; /* acc[K * row + key] */
    for (int i = 0; i < VEC_SUMS; i++) acc[i] = vzero();
    const int codes = dq != NULL;
    const int64_t whole = VEC_MASKED_TAILS ? D : D / VEC_LANES * VEC_LANES;
    int64_t d = 0;
    if (!codes) d = vec_scores_run(kt, 0, 0, qr, nr, D, kr, ldk, nkb, 0, whole, NULL, NULL, pf, acc);
    for (int64_t g = 0; codes && d < whole; g++) { /* codes: a group at a time */
        float sk[VEC_SCORE_KEYS], zk[VEC_SCORE_KEYS]; /* the keys' scales and zero points of the group */
        for (int a = 0; a < nkb; a++) {
            sk[a] = vec_group_of(dq->scale_type, ks, dq->scale_row, dq->scale_col, a, g);
            zk[a] = zero ? vec_group_of(dq->zero_type, kz, dq->zero_row, dq->zero_col, a, g) : 0.0f;
        }
        const int64_t end = (g + 1) * dq->group < whole ? (g + 1) * dq->group : whole;
        d = vec_scores_run(kt, zero, 1, qr, nr, D, kr, ldk, nkb, d, end, sk, zk, pf, acc);
    }
#if VEC_MASKED_TAILS
    vstore_sums(acc, nr, nkb, st, ldst);
#else
    float out[VEC_SUMS];
    vsums(acc, nr * K, out);
    if (d < D) /* the columns past the last whole vector */
        for (int b = 0; b < nr; b++)
            for (int a = 0; a < nkb; a++) {
                const void *sa = codes ? npattn_stream_at(dq->scale_type, ks, a * dq->scale_row) : NULL;
                const void *za = codes && zero ? npattn_stream_at(dq->zero_type, kz, a * dq->zero_row) : NULL;
                const void *row = npattn_stream_at(kt, kr, a * ldk);
                for (int64_t e = d; e < D; e++)
                    out[K * b + a] += qr[b * D + e] * npattn_value_elem(kt, codes ? dq : NULL, row, e, sa, za);
            }
    for (int b = 0; b < nr; b++)
        for (int a = 0; a < nkb; a++) st[b * ldst + a] = out[K * b + a];
#endif
}

/* nkb keys (at kr, their scales and zero points at ks and kz) against
 * every row of q, VEC_SCORE_ROWS rows at a time, the rows left a block of
 * their own count; the first block prefetches. */
VEC_FN void vec_scores_keys(enum npattn_dtype kt, const int zero, const struct npattn_dequant *dq, const float *q,
                            int64_t M, int64_t D, const void *kr, const void *ks, const void *kz, int64_t ldk,
                            const int nkb, float *st, int64_t ldst, const void *pf) {
    enum { R = VEC_SCORE_ROWS };
#define BLOCK(nr, at) vec_scores_block(kt, zero, dq, q + r * D, nr, D, kr, ks, kz, ldk, nkb, st + r * ldst, ldst, at)
    int64_t r = 0;
    for (; r + R <= M; r += R) BLOCK(R, r == 0 ? pf : NULL);
    const void *pr = r == 0 ? pf : NULL;
    switch (M - r) {
    case 3: if (3 < R) BLOCK(3, pr); break;
    case 2: if (2 < R) BLOCK(2, pr); break;
    case 1: BLOCK(1, pr); break;
    default: break;
    }
#undef BLOCK
}

/* The spans' keys against every row of q, VEC_SCORE_KEYS keys at a time
 * (those prefetch their rows ahead), a span's last keys a block of their
 * own count. */
VEC_FN void vec_scores_of(enum npattn_dtype kt, const int zero, const struct npattn_dequant *dq, const float *q,
                          int64_t M, int64_t D, const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,
                          int64_t ldst) {
    enum { K = VEC_SCORE_KEYS };
    const int codes = dq != NULL;
    for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n) {
        const void *k = spans[i].rows;
        const int64_t nk = spans[i].n;
        float *sj = st + j0;
        int64_t j = 0;
#define KEYS(n, j, pf)                                                                                                 \
    vec_scores_keys(kt, zero, dq, q, M, D, npattn_stream_at(kt, k, (j) * ldk),                                       \
                    codes ? npattn_span_groups(spans[i].scale, dq->scale_type, dq->scale_row, j) : NULL,                \
                    codes && zero ? npattn_span_groups(spans[i].zero, dq->zero_type, dq->zero_row, j) : NULL, ldk, n,   \
                    sj + (j), ldst, pf)
        for (; j + K <= nk; j += K) KEYS(K, j, npattn_stream_at(kt, spans[i].ahead, j * ldk));
        switch (nk - j) {
        case 3: if (3 < K) KEYS(3, j, NULL); break;
        case 2: KEYS(2, j, NULL); break;
        case 1: KEYS(1, j, NULL); break;
        default: break;
        }
#undef KEYS
    }
}

/* The kinds of K or V rows that vec_scores and vec_accumulate keep a copy
 * of their loops for, X(name, type, zero, codes): floats of each type;
 * codes summed as their own values (a scale a row, applied after: no dq);
 * and codes made into their values with their groups' scales, with or
 * without zero points (fp8 has none). Each kind's copy is a function of its
 * own, not inlined into its caller, so that its conversion and constants
 * are inlined with no branch for the other kinds while no one function
 * holds every copy (one that did took the compiler minutes). */
#define VEC_KINDS(X)                                                                                                 \
    X(f32, NPATTN_DTYPE_F32, 0, 0)                                                                                   \
    X(f16, NPATTN_DTYPE_F16, 0, 0)                                                                                   \
    X(bf16, NPATTN_DTYPE_BF16, 0, 0)                                                                                 \
    X(i8, NPATTN_DTYPE_I8, 0, 0)                                                                                     \
    X(i8_scaled, NPATTN_DTYPE_I8, 0, 1)                                                                              \
    X(i8_zero, NPATTN_DTYPE_I8, 1, 1)                                                                                \
    X(u8, NPATTN_DTYPE_U8, 0, 0)                                                                                     \
    X(u8_scaled, NPATTN_DTYPE_U8, 0, 1)                                                                              \
    X(u8_zero, NPATTN_DTYPE_U8, 1, 1)                                                                                \
    X(e4m3, NPATTN_DTYPE_F8E4M3, 0, 0)                                                                               \
    X(e4m3_scaled, NPATTN_DTYPE_F8E4M3, 0, 1)                                                                        \
    X(e5m2, NPATTN_DTYPE_F8E5M2, 0, 0)                                                                               \
    X(e5m2_scaled, NPATTN_DTYPE_F8E5M2, 0, 1)

#define VEC_KIND_ENUM(name, t, z, c) VEC_KIND_##name,
enum vec_kind { VEC_KINDS(VEC_KIND_ENUM) VEC_N_KINDS };
#undef VEC_KIND_ENUM

/* The kind of rows of type t: codes with dq made their values unless raw
 * (summed as their own values). */
static inline enum vec_kind vec_kind_of(enum npattn_dtype t, const int raw, const struct npattn_dequant *dq) {
    const int scaled = dq && !raw, zero = scaled && dq->zero;
    switch (t) {
    case NPATTN_DTYPE_F16: return VEC_KIND_f16;
    case NPATTN_DTYPE_BF16: return VEC_KIND_bf16;
    case NPATTN_DTYPE_I8: return zero ? VEC_KIND_i8_zero : scaled ? VEC_KIND_i8_scaled : VEC_KIND_i8;
    case NPATTN_DTYPE_U8: return zero ? VEC_KIND_u8_zero : scaled ? VEC_KIND_u8_scaled : VEC_KIND_u8;
    case NPATTN_DTYPE_F8E4M3: return scaled ? VEC_KIND_e4m3_scaled : VEC_KIND_e4m3;
    case NPATTN_DTYPE_F8E5M2: return scaled ? VEC_KIND_e5m2_scaled : VEC_KIND_e5m2;
    default: return VEC_KIND_f32;
    }
}

/* A kind's copy: not inlined (see VEC_KINDS); (c) ? dq : NULL a constant NULL for floats and raw codes. */
#define VEC_KIND_FN static __attribute__((noinline)) VEC_TARGET

/* D = 64 as a constant for floats and raw codes, so that the loops over it
 * unroll (1.08-1.27x in cache on avx2, 0.98-1.28x on avx512; D = 128 so
 * unrolled ran faster alone but no faster in a decode); codes with grouped
 * scales, whose copies are the largest, take no such copy. */
#define VEC_SCORES_KIND(name, t, z, c)                                                                               \
    VEC_KIND_FN void vec_scores_##name(const struct npattn_dequant *dq, const float *q, int64_t M, int64_t D,        \
                                       const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,      \
                                       int64_t ldst) {                                                               \
        if (!(c) && D == 64) vec_scores_of(t, z, NULL, q, M, 64, spans, n_span, ldk, st, ldst);                      \
        else vec_scores_of(t, z, (c) ? dq : NULL, q, M, D, spans, n_span, ldk, st, ldst);                            \
    }
VEC_KINDS(VEC_SCORES_KIND)
#undef VEC_SCORES_KIND

#define VEC_KIND_PTR(prefix, name) prefix##name,
#define VEC_SCORES_PTR(name, t, z, c) VEC_KIND_PTR(vec_scores_, name)
static void (*const vec_scores_kinds[VEC_N_KINDS])(const struct npattn_dequant *, const float *, int64_t, int64_t,
                                                    const struct npattn_span *, int64_t, int64_t, float *,
                                                    int64_t) = {VEC_KINDS(VEC_SCORES_PTR)};
#undef VEC_SCORES_PTR

/* ---- codes with one scale a row (scalar.h's npattn_row_scaled) ---- */

/* The scales (s) and zero points (z: 0 without) of the spans' nk keys. */
VEC_FN void vec_row_groups(const struct npattn_dequant *dq, const struct npattn_span *spans, int64_t n_span, float *s,
                           float *z) {
    for (int64_t i = 0, j = 0; i < n_span; i++)
        for (int64_t a = 0; a < spans[i].n; a++, j++) {
            s[j] = npattn_stream_elem(dq->scale_type, spans[i].scale, a * dq->scale_row);
            z[j] = dq->zero ? npattn_stream_elem(dq->zero_type, spans[i].zero, a * dq->zero_row) : 0.0f;
        }
}

/* st (M, ldst): the rows of q's (M, D) sums against the spans' nk codes
 * made their scores, s_j (st - z_j sum(q_r)). */
VEC_FN void vec_scale_scores(const struct npattn_dequant *dq, const float *q, int64_t M, int64_t D,
                             const struct npattn_span *spans, int64_t n_span, int64_t nk, float *st, int64_t ldst) {
    float s[NPATTN_SCALED_KEYS], z[NPATTN_SCALED_KEYS];
    vec_row_groups(dq, spans, n_span, s, z);
    for (int64_t r = 0; r < M; r++) {
        vf sum = vzero(); /* q's row's sum, for the zero points */
        for (int64_t d = 0; d < D && dq->zero; d += VEC_LANES)
            sum = vadd(sum, D - d < VEC_LANES ? vload_part(q + r * D + d, D - d) : vload(q + r * D + d));
        const vf qs = vset1(vreduce_add(sum));
        float *sr = st + r * ldst;
        for (int64_t j = 0; j < nk; j += VEC_LANES) {
            const int64_t n = nk - j < VEC_LANES ? nk - j : VEC_LANES;
            const vf x = vload_part(sr + j, n), zx = vmul(vload_part(z + j, n), qs);
            vstore_part(sr + j, n, vmul(vload_part(s + j, n), dq->zero ? vsub(x, zx) : x));
        }
    }
}

/* w (M, NPATTN_SCALED_KEYS) = st (M, ldst) times each key's scale, and
 * shift[r] = sum_j w[r, j] z_j (0 without zero points). */
VEC_FN void vec_scale_weights(const struct npattn_dequant *dq, const float *st, int64_t ldst, int64_t M,
                              const struct npattn_span *spans, int64_t n_span, float *w, float *shift) {
    float s[NPATTN_SCALED_KEYS], z[NPATTN_SCALED_KEYS];
    vec_row_groups(dq, spans, n_span, s, z);
    const int64_t nk = npattn_span_keys(spans, n_span);
    for (int64_t r = 0; r < M; r++) {
        vf acc = vzero();
        for (int64_t j = 0; j < nk; j += VEC_LANES) {
            const int64_t n = nk - j < VEC_LANES ? nk - j : VEC_LANES;
            const vf x = vmul(vload_part(st + r * ldst + j, n), vload_part(s + j, n));
            vstore_part(w + r * NPATTN_SCALED_KEYS + j, n, x);
            acc = vfma(x, vload_part(z + j, n), acc);
        }
        shift[r] = vreduce_add(acc);
    }
}

/* o (M, Dv): each row's elements less its shift. */
VEC_FN void vec_shift_rows(const float *shift, int64_t M, int64_t Dv, float *o) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t e = 0; e < Dv; e += VEC_LANES) {
            const int64_t n = Dv - e < VEC_LANES ? Dv - e : VEC_LANES;
            vstore_part(o + r * Dv + e, n, vsub(vload_part(o + r * Dv + e, n), vset1(shift[r])));
        }
}

/* kernels.h's scores, without tiles (qb ignored): the rows the ISA's own
 * layout takes (one copy, the keys' type read as it goes), then the copy of
 * the loops for the keys' kind (VEC_KINDS), its conversion inlined; codes of a scale a row
 * summed as their own values, then scaled. */
static VEC_TARGET void vec_scores(const float *q, int64_t M, int64_t D, enum npattn_dtype kt,
                                  const struct npattn_dequant *dq, const struct npattn_span *spans, int64_t n_span,
                                  int64_t ldk, const uint32_t *qb, float *st, int64_t ldst) {
    (void)qb;
    const int64_t nk = npattn_span_keys(spans, n_span);
    const int raw = npattn_row_scaled(dq, D) && nk <= NPATTN_SCALED_KEYS; /* the codes' own values, scaled after */
    const struct npattn_dequant *values = raw ? NULL : dq; /* the codes' values: dq, unless raw */
    const int64_t own = isa_scores_own(kt, values, q, M, D, spans, n_span, ldk, st, ldst);
    if (own < M)
        vec_scores_kinds[vec_kind_of(kt, raw, dq)](dq, q + own * D, M - own, D, spans, n_span, ldk, st + own * ldst,
                                                    ldst);
    if (raw) vec_scale_scores(dq, q, M, D, spans, n_span, nk, st, ldst);
}

/* ---- accumulate: o (M, Dv) += P @ V, P given as st (M, ldst) ---- */

/* o (nr rows, nc vectors of columns from e0) += P @ v, o in registers
 * (nr * nc accumulators, from zero) while the value rows (type vt) of the
 * spans stream past, each row's vectors loaded and converted once for all
 * nr rows, a broadcast weight each; codes made into their values as they
 * are converted (dq: each vector within one group, its row's scale and
 * zero point read once for it, zero a constant). The block prefetches its
 * columns of every pf_every-th row ahead from row pf_first on (pf_every 0:
 * none; 1, a constant: every row, with no branch in the loop, which would
 * spill o). */
VEC_FN void vec_accumulate_block(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq,
                                 const float *st, int64_t ldst, const int nr, const int nc,
                                 const struct npattn_span *spans, int64_t n_span, int64_t ldv, int64_t Dv, int64_t e0,
                                 float *o, const int pf_every, int pf_first) {
    const int64_t es = npattn_stream_size(vt);
    const int codes = dq != NULL;
    vm m[VEC_ACC_CHUNKS];
    int64_t g[VEC_ACC_CHUNKS]; /* codes: each vector's group, the last group for one past Dv */
    for (int c = 0; c < nc; c++) {
        m[c] = VEC_MASKED_TAILS ? vlanes(Dv - e0 - VEC_LANES * c) : vall();
        if (codes) g[c] = (e0 + VEC_LANES * c < Dv ? e0 + VEC_LANES * c : Dv - 1) / dq->group;
    }
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
            float sv[VEC_ACC_CHUNKS], zv[VEC_ACC_CHUNKS]; /* codes: each vector's scale and zero point */
            for (int c = 0; c < nc && codes; c++) {
                const int same = c > 0 && g[c] == g[c - 1];
                sv[c] = same ? sv[c - 1] : vec_group_of(dq->scale_type, spans[ri].scale, dq->scale_row, dq->scale_col, i, g[c]);
                zv[c] = !zero ? 0.0f : same ? zv[c - 1] : vec_group_of(dq->zero_type, spans[ri].zero, dq->zero_row, dq->zero_col, i, g[c]);
            }
            vf vv[VEC_ACC_CHUNKS];
            for (int c = 0; c < nc; c++) {
                const char *at = v + (i * ldv + VEC_LANES * c) * es;
                vv[c] = vec_row_m(vt, at, m[c]);
                if (codes) vv[c] = vmul(zero ? vsub(vv[c], vbroadcast(&zv[c])) : vv[c], vbroadcast(&sv[c]));
            }
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

/* Dv = 64 as a constant likewise where the ISA asks for it (VEC_ACC_D64). */
#define VEC_ACCUMULATE_KIND(name, t, z, c)                                                                           \
    VEC_KIND_FN int64_t vec_accumulate_##name(const struct npattn_dequant *dq, const float *st, int64_t ldst,        \
                                              int64_t M, const struct npattn_span *spans, int64_t n_span,            \
                                              int64_t ldv, int64_t Dv, float *o) {                                   \
        if (!(c) && VEC_ACC_D64 && Dv == 64)                                                                         \
            return isa_accumulate_of(t, z, NULL, st, ldst, M, spans, n_span, ldv, 64, o);                            \
        return isa_accumulate_of(t, z, (c) ? dq : NULL, st, ldst, M, spans, n_span, ldv, Dv, o);                     \
    }
VEC_KINDS(VEC_ACCUMULATE_KIND)
#undef VEC_ACCUMULATE_KIND

#define VEC_ACCUMULATE_PTR(name, t, z, c) VEC_KIND_PTR(vec_accumulate_, name)
static int64_t (*const vec_accumulate_kinds[VEC_N_KINDS])(const struct npattn_dequant *, const float *, int64_t,
                                                          int64_t, const struct npattn_span *, int64_t, int64_t,
                                                          int64_t, float *) = {VEC_KINDS(VEC_ACCUMULATE_PTR)};
#undef VEC_ACCUMULATE_PTR

/* accumulate's blocks for the kind, then the columns they leave by the
 * portable code (raw: codes summed as their own values, dq unused). */
VEC_FN void vec_accumulate_of(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                              int64_t n_span, enum npattn_dtype vt, const int raw, const struct npattn_dequant *dq,
                              int64_t ldv, int64_t Dv, float *o) {
    const int64_t done = vec_accumulate_kinds[vec_kind_of(vt, raw, dq)](dq, st, ldst, M, spans, n_span, ldv, Dv, o);
    if (done < Dv) npattn_accumulate_columns(st, ldst, M, spans, n_span, vt, raw ? NULL : dq, ldv, Dv, done, o);
}

/* kernels.h's accumulate: the copy of the ISA's blocks for the values'
 * kind (VEC_KINDS), codes of a scale a row summed as their own values with
 * the weights times the rows' scales. */
static VEC_TARGET void vec_accumulate(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                      int64_t n_span, enum npattn_dtype vt, const struct npattn_dequant *dq,
                                      int64_t ldv, int64_t Dv, float *o) {
    if (!npattn_row_scaled(dq, Dv) || npattn_span_keys(spans, n_span) > NPATTN_SCALED_KEYS) {
        vec_accumulate_of(st, ldst, M, spans, n_span, vt, 0, dq, ldv, Dv, o);
        return;
    }
    float w[NPATTN_SCALED_ROWS * NPATTN_SCALED_KEYS]; /* the weights times the rows' scales */
    for (int64_t r = 0; r < M; r += NPATTN_SCALED_ROWS) {
        const int64_t nr = M - r < NPATTN_SCALED_ROWS ? M - r : NPATTN_SCALED_ROWS;
        float shift[NPATTN_SCALED_ROWS];
        vec_scale_weights(dq, st + r * ldst, ldst, nr, spans, n_span, w, shift);
        vec_accumulate_of(w, NPATTN_SCALED_KEYS, nr, spans, n_span, vt, 1, dq, ldv, Dv, o + r * Dv);
        if (dq->zero) vec_shift_rows(shift, nr, Dv, o + r * Dv);
    }
}

#endif

/* kernels/kernels.h: the hot inner pieces of the core, one dispatch table per
 * instruction set: this header is the tables' contract. portable.c, avx2.c,
 * avx512.c (with amx.c) and neon.c define complete tables; dispatch.c picks
 * the best this CPU runs. The SIMD tables' kernels are written once over a
 * vector layer (vec_avx2.h, vec_avx512.h, vec_neon.h; the list of its
 * operations, and how to add an element format, in vec_avx512.h) and built
 * per table; scalar.h holds the scalar helpers and conversions. Nothing
 * outside csrc/kernels/ contains SIMD code.
 *
 * Scores arrive transposed: st is (nk, ld) row-major, column r holding query
 * row r's raw dot products q.k for nk keys, so that one SIMD lane serves one
 * query row all the way down the column.
 */
#ifndef NPATTN_KERNELS_H
#define NPATTN_KERNELS_H

#include <stdint.h>

#include "../attention.h"

/* What turns a tile of raw dot products into final scores, query row by
 * query row: x = raw * scale; x = softcap * tanh(x / softcap) when softcap >
 * 0; x += bias (-inf hides); keys outside [lo[r], hi[r]] are hidden. The tile
 * is st (nk, ld) with one column per query row (gemm tiles), or st (M, ld)
 * with one row per query row (streamed tiles); bias has st's layout. */
struct npattn_score_tile {
    int64_t nk, M, ld;       /* keys, query rows, row stride of st and bias */
    float scale, softcap;    /* softcap 0: none */
    const float *bias;       /* NULL, or (nk, ld): the mask, 0 or -inf for a bool one */
    const int32_t *lo, *hi;  /* NULL, or [M]: column r sees tile keys lo[r] <= j <= hi[r] */
};

/* Rows a streaming kernel reads: n rows from `rows`, the call's ld elements
 * apart; and while it reads row i, it prefetches row i from `ahead` (ld
 * apart), the rows the caller reads next (never NULL: `rows` itself where
 * nothing follows). A dense tile is one span; a tile of a paged cache, a
 * span per page, and one call takes them all (a call per page paid the
 * kernels' setup per page: 15-20% of a decode over pages of 16 rows). */
struct npattn_span {
    const void *rows, *ahead;
    int64_t n;
    const void *scale, *zero; /* codes: row 0's scales and zero points (struct npattn_dequant); else unused */
};

/* How the rows of a streamed K or V of codes (I8, U8, F8E4M3, F8E5M2)
 * stand for values (SPEC section 14): element e of a span's row i is
 * (code - zero) * scale in float, code - zero rounded first (zero 0 without
 * zero points), the scale and zero point those of e's group, e / group, at
 *     span.scale + i * scale_row + e / group * scale_col
 * elements of scale_type, the zero point likewise. The kernels apply them
 * in registers as each row's vectors are loaded; so that one scale serves a
 * whole vector, a table takes rows of codes whose groups are the whole row
 * or a multiple of its code_step elements (forward.c converts others). */
struct npattn_dequant {
    enum npattn_dtype scale_type, zero_type; /* F32, F16 or BF16 */
    int64_t group;                           /* elements a group; the row's width for a scale a row */
    int64_t scale_row, scale_col, zero_row, zero_col;
    int zero;                                /* zero points given: every span's zero is one */
};

struct npattn_kernels {
    const char *name;

    /* One step of online softmax (FlashAttention-2, arXiv:2307.08691,
     * Algorithm 1) over a tile: st becomes exp(x - m_new) column by column,
     * with m[r] = m_new[r] = max(m[r], max of column r's x), l[r] = l[r] *
     * alpha[r] + the column's sum, and alpha[r] = exp(m_old - m_new), the
     * factor by which row r of the accumulator is rescaled. m is in natural
     * units. A column that has seen nothing visible yet (m stays -inf)
     * becomes zeros and leaves l at 0. Returns nonzero, leaving st, m, l and
     * alpha unspecified, when an unhidden score is NaN or infinite (overflow,
     * or NaN and infinity in the inputs): the caller then recomputes in
     * double. */
    int (*softmax_f32)(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha);

    /* The same step over a tile stored by rows, st (M, ld): row r holds
     * query row r's nk scores, as the streaming kernels leave them. */
    int (*softmax_rows_f32)(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha);

    /* Decode-sized tiles, which read each key and value row once, in its
     * own type: kt and vt are F32, F16 or BF16, converted in registers
     * (exactly), so that a half-precision cache is read at half the bytes;
     * or codes (I8, U8, F8E4M3, F8E5M2), converted likewise and each value
     * then made as dq says (struct npattn_dequant; dq NULL for floats), so
     * that an 8-bit cache is read at a quarter of float32's bytes and its
     * scores are those of its float32 values.
     * The keys are those of n_span spans, in order, nk in all (ldk and ldv
     * elements from one row to the next within a span). scores: st (M,
     * ldst) = raw scores of the M rows of q (M, D), row-major, against the
     * nk keys. accumulate: o (M, Dv) row-major += P @ v, P (M, nk) given as
     * st (M, ldst), the product summed from zero and then added to o: a
     * call's nk terms are one block (the streamed tiles' 256 keys at most),
     * so that o's rounding grows with the blocks, not the keys (many equal
     * weights round alike). The arithmetic is the same, in float, whatever
     * the types and spans (but for codes with one scale a row, whose scale
     * the SIMD tables apply to each sum: scalar.h's npattn_row_scaled),
     * except in the AVX-512 tables' scores of a bfloat16 K against the rows npattn_bf16_keys_in_lanes admits: there
     * each score is one FMA per element, in element order (keys in lanes,
     * no reduction tree); in the avx2 and neon tables' scores of
     * the rows npattn_rows_in_lanes admits, whatever K's type, likewise
     * (rows in lanes); and given qb (rows of q that are bfloat16
     * values), against a block of keys with no subnormal value: there the
     * sums are the bfloat16 dot products' (avx512bf16: vdpbf16ps, a pair
     * at a time; amx: the tiles). qb: q's rows as the table's q_tiles left
     * them, where it has one and that returned 1; else NULL (the other
     * tables ignore it). */
    void (*scores)(const float *q, int64_t M, int64_t D, enum npattn_dtype kt, const struct npattn_dequant *dq,
                   const struct npattn_span *spans, int64_t n_span, int64_t ldk, const uint32_t *qb, float *st,
                   int64_t ldst);
    /* The avx512bf16 and amx tables' (NULL elsewhere): qb = q's M rows of
     * D values as the operands of their streamed scores' dot products
     * (D / 2 * 16 words at most), once per task rather than per call (a
     * page); returns 0, qb unspecified, unless the rows are ones it takes
     * (avx512bf16: at most 16 that npattn_bf16_keys_in_lanes admits; amx:
     * those npattn_amx_stream_rows admits), every value a bfloat16 value,
     * none subnormal. */
    int (*q_tiles)(const float *q, int64_t M, int64_t D, uint32_t *qb);
    void (*accumulate)(const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans, int64_t n_span,
                       enum npattn_dtype vt, const struct npattn_dequant *dq, int64_t ldv, int64_t Dv, float *o);
    /* Rows of codes with groups of a multiple of code_step elements (or
     * one group a row) are what scores and accumulate read in place: the
     * table's vector width. */
    int64_t code_step;
    /* How many rows ahead accumulate wants its value rows' `ahead` for M
     * rows of Dv columns, given `rows`, the distance for one pass over each
     * value row, and the tile's keys (NULL: rows). */
    int64_t (*accumulate_ahead)(int64_t M, int64_t Dv, int64_t rows, int64_t tile);

    /* bfloat16 dot products (vdpbf16ps, AMX tiles, BFDOT), in the tables
     * that have them (NULL elsewhere). Operands come in pairs: a uint32
     * holds two bfloat16 values, the first in its low half, and each dot
     * product sums the two products of a pair. pair_bf16: out[c] = a[c] | b[c] << 16 for c < n
     * (b NULL: zeros; out NULL: only the check); pair_f32 likewise with a
     * and b rounded to nearest even bfloat16; bf16_f32: out[c] = x[c] so
     * rounded. All three return whether a value
     * was subnormal, which the dot products would take as 0 (its pair in
     * out is then unspecified): the caller then computes without them. scores_bf16: st (nk, ldst) columns r < M
     * = sum over pairs p < np of qp[p * ldq + r] . (k[j * ldk + 2p],
     * k[j * ldk + 2p + 1]), K's bfloat16 rows read in place (ldq a multiple
     * of 16 at least M, lanes past M ignored). accumulate_bf16: o (M, Dv)
     * row-major += sum over p < np of pp[p * ldp + r] . vp[p * ldv + e]
     * (ldv a multiple of 16 at least Dv). softmax_tiles_f32 and
     * accumulate_tiles_bf16, where a table has them (NULL elsewhere): a
     * softmax step as softmax_f32's (the same max and factor) whose
     * probabilities, from the faster exp of NPATTN_EXP2_FAST_* (their sum
     * too), go not to st (left unspecified) but to pa as A tiles' rows,
     * rounded to nearest even bfloat16 (a subnormal weight may read as 0):
     * pa[r * ldpa + p] =
     * (P[r][2p], P[r][2p + 1]) for r below M rounded up to 16 (zeros past
     * M) and p below (nk + 1) / 2 rounded up to 16 (zeros past nk); ldpa a
     * multiple of 16. accumulate_tiles_bf16: o (M, Dv) += the product of
     * those pairs (np = (nk + 1) / 2) and vp's, as accumulate_bf16; P
     * leaves the softmax as the tiles take it, with no pass of its own.
     * scores_bf16 takes K's rows of D
     * = 2 np values when D is a multiple of bf16_d_step. bf16_tile: the
     * keys per tile and the most stacked rows that suit them (0: the
     * float32 gemms' tile sizes), and bf16_tile_width the widest rows of K
     * (values) it takes on them (wider ones: slower code). */
    int64_t bf16_d_step, bf16_tile, bf16_tile_width;
    int (*pair_bf16)(const uint16_t *a, const uint16_t *b, int64_t n, uint32_t *out);
    int (*pair_f32)(const float *a, const float *b, int64_t n, uint32_t *out);
    int (*bf16_f32)(const float *x, int64_t n, uint16_t *out);
    void (*scores_bf16)(const uint32_t *qp, int64_t ldq, int64_t M, int64_t np, const uint16_t *k, int64_t ldk,
                        int64_t nk, float *st, int64_t ldst);
    void (*accumulate_bf16)(const uint32_t *pp, int64_t ldp, int64_t M, int64_t np, const uint32_t *vp, int64_t ldv,
                            int64_t Dv, float *o);
    int (*softmax_tiles_f32)(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha,
                             uint32_t *pa, int64_t ldpa);
    void (*accumulate_tiles_bf16)(const uint32_t *pa, int64_t ldpa, int64_t M, int64_t np, const uint32_t *vp,
                                  int64_t ldv, int64_t Dv, float *o);
    /* The avx512bf16 table's (NULL elsewhere; a Sapphire Rapids core ran
     * the FMAs faster: Qwen2-0.5B heads at 4096 keys, one thread, 306
     * against 378 us; a Zen 4 core 167 against 140): the streamed P @ V of
     * a bfloat16 V by the dot products, pairs of consecutive keys: o (M, Dv)
     * row-major = the sum over key pairs p of (pb[r * ldp + 2p], pb[r * ldp
     * + 2p + 1]) . (v[2p][e], v[2p + 1][e]), written (not added), P's rows
     * pb given as bfloat16 (ldp even, zeros from the keys' count to an even
     * one) and V's rows those of the spans, as accumulate reads them (a
     * zero row after an odd count). Returns whether a value of V was
     * subnormal (o then unspecified; the caller takes accumulate). */
    int (*accumulate_pairs)(const uint16_t *pb, int64_t ldp, int64_t M, const struct npattn_span *spans,
                            int64_t n_span, int64_t ldv, int64_t Dv, float *o);
    /* The amx table's (NULL elsewhere): the weights st (nk, M), ldst apart,
     * as A tiles' rows for accumulate_tiles_bf16 against V's float16 values
     * split in two (npattn_split_f16_twice): pa[r * ldpa + 2j] = pa[r *
     * ldpa + 2j + 1] = (hi, lo), hi st[j][r] cut to bfloat16 and lo the
     * rest rounded to it (nearest even; below 2^-126, 0), so hi + lo is
     * within 2^-15 of the weight; zeros for M <= r < rows (a multiple of
     * 16) and for pairs from 2 nk to a multiple of 16 (ldpa one too, at
     * least that). */
    void (*split_tiles)(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                        int64_t rows);
    /* The amx table's (NULL elsewhere): the weights st (nk, M), ldst apart,
     * as three arrays of A tiles' rows for accumulate_tiles_bf16 against
     * V's bfloat16 pairs, rows ldpa pairs apart, array k at pa + k * rows *
     * ldpa: the weights' first 8 significant bits, the next 8, and the rest
     * (rounded to nearest even; below 2^-126, 0), so that the three sum to
     * the weight exactly where none is below 2^-126; pa_k[r * ldpa + p] =
     * (part k of st[2p][r], of st[2p + 1][r]), zeros for M <= r < rows (a
     * multiple of 16) and for pairs past the keys' to a multiple of 16 (at
     * most ldpa). */
    void (*exact_tiles)(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                        int64_t rows);
    /* The amx table's (NULL elsewhere): a key tile's whole step of the
     * "fast" bfloat16 prefill, its products on the tiles by rows and
     * software-pipelined with the softmax (k_tiles, prefill_tiles_bf16).
     * k_tiles: the n <= NPATTN_STEP_KEYS keys' rows (rows[i], D
     * bfloat16 values each, D a multiple of 32) as B tiles of K^T's pairs:
     * per 16 keys g, kb[g * 8 D + p * 16 + i] = (values 2p, 2p + 1 of key
     * 16 g + i), zeros for the keys from n to a multiple of 32.
     * prefill_tiles_bf16: the scores (M, nk) = qa kb of the tile t (t->M
     * rows, t->nk keys; t->bias and the band by rows, t->ld apart), qa Q's
     * rows of D bfloat16 values (2 D bytes apart, zeros past M to a
     * multiple of 16); the step of softmax_tiles_f32 by rows (the same
     * probabilities, their sum in another order); O's rows (o: M rows of Dv
     * floats, Dv a multiple of 16, room for rows to a multiple of 16) times
     * alpha, where not 1, plus P @ V as accumulate_tiles_bf16 (vp: V's np =
     * (nk + 1) / 2 pairs, ldv apart). scratch: npattn_step_bytes(ldv)
     * bytes, 64-byte aligned. Returns 1 as the softmax does (o, m, l and
     * alpha then unspecified). */
    void (*k_tiles)(const uint16_t *const *rows, int64_t n, int64_t D, uint32_t *kb);
    int (*prefill_tiles_bf16)(const uint16_t *qa, int64_t D, const uint32_t *kb, const uint32_t *vp, int64_t ldv,
                              int64_t Dv, const struct npattn_score_tile *t, float *m, float *l, float *alpha,
                              float *o, void *scratch);

    /* The tiles' float products, where a table has them (NULL elsewhere:
     * OpenBLAS's sgemm): c (m, n) = alpha * a @ b + beta * c (beta 0: c
     * not read), a's element (i, p) at a[i * a_rs + p * a_ps] (a row-major
     * matrix or its transpose, read in place), b (k, n) and c row-major
     * with leading dimensions ldb and ldc. Each c element's sum runs over p
     * in order, one FMA a term, from zero for each block of the table's
     * packed rows of b, then scaled and added to c. Blocks of c are held in
     * registers, a's elements broadcast where they lie; only b's column
     * block is packed, where blocks of c's rows reuse it. */
    void (*gemm_f32)(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t a_rs, int64_t a_ps,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

    /* dst[j] = src[j] for j < n, float16 to float. */
    void (*f16_to_f32)(const uint16_t *src, int64_t n, float *dst);
    /* rowsT (w, M) = the transpose of rows (M, w): rowsT[d * ldt + r] =
     * rows[r * ldr + d]. Q^T for the tiles' products. NULL: the caller's
     * loop. */
    void (*transpose_f32)(const float *rows, int64_t ldr, int64_t M, int64_t w, float *rowsT, int64_t ldt);
    /* O's n rows finished and stored: row i of dst (dt F32, F16 or BF16,
     * its elements adjacent, ld elements from one row to the next) =
     * o[i * w + e] * (1 / l[i]) for e < w, rounded to nearest even
     * (subnormals kept, overflow to infinity); zeros where l[i] is 0; l
     * NULL: the values as they are (narrowed only).
     * Returns nonzero when an o value is NaN or infinite (the caller then
     * recomputes in double). */
    int (*finish_rows)(const float *o, int64_t n, int64_t w, const float *l, enum npattn_dtype dt, void *dst,
                       int64_t ld);
    /* o[i] += x[i] for i < n: a block's terms into the backward's sums. */
    void (*add_f32)(float *o, const float *x, int64_t n);

    /* A ceiling for the benchmarks, not used by attention: n rounds of
     * independent float32 FMAs in registers only, as many chains as the
     * ISA's FMA units need to stay busy; returns the flops done (and a sum
     * that keeps the compiler from dropping the loop in *sink). */
    double (*fma_loop)(int64_t n, float *sink);
    /* The same for the bfloat16 dot products, where a table has them (NULL
     * elsewhere), two flops a pair product: bf16_loop, vdpbf16ps in
     * registers only, as many chains as fma_loop; tile_loop, the amx
     * table's tdpbf16ps on tiles that stay loaded, four accumulators
     * against two A and two B tiles. */
    double (*bf16_loop)(int64_t n, float *sink);
    double (*tile_loop)(int64_t n, float *sink);
};

/* The most keys of prefill_tiles_bf16's tile, and the bytes of its
 * scratch: two blocks of 32 rows of scores and of P's pairs (rows padded by
 * 16 lanes), and V's last 16 pairs (ldv apart). */
#define NPATTN_STEP_KEYS 256
static inline size_t npattn_step_bytes(int64_t ldv) {
    return (size_t)(2 * 32 * (NPATTN_STEP_KEYS + 16) + 2 * 32 * (NPATTN_STEP_KEYS / 2 + 16) + 16 * ldv) * 4;
}

/* The tables; dispatch.c chooses among those this CPU can run. */
extern const struct npattn_kernels npattn_kernels_portable;
#if defined(__x86_64__) || defined(__i386__)
extern const struct npattn_kernels npattn_kernels_avx2;
extern const struct npattn_kernels npattn_kernels_avx512;
extern const struct npattn_kernels npattn_kernels_avx512bf16; /* avx512 with AVX512-BF16 dot products */
#if defined(__linux__)
#define NPATTN_HAVE_AMX 1
extern const struct npattn_kernels npattn_kernels_amx;        /* avx512bf16 with AMX-BF16 tiles (amx.c) */
#define NPATTN_AMX_MAX_D 512 /* the widest rows of K the tiles take from scratch (wider ones: avx512bf16's kernel) */
void npattn_amx_scores_bf16(const uint32_t *qp, int64_t ldq, int64_t M, int64_t np, const uint16_t *k, int64_t ldk,
                            int64_t nk, float *st, int64_t ldst);
void npattn_amx_scores(const float *q, int64_t M, int64_t D, enum npattn_dtype kt, const struct npattn_dequant *dq,
                       const struct npattn_span *spans, int64_t n_span, int64_t ldk, const uint32_t *qb, float *st,
                       int64_t ldst);
int npattn_amx_q_tiles(const float *q, int64_t M, int64_t D, uint32_t *qb);
void npattn_amx_split_tiles(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                            int64_t rows);
void npattn_amx_exact_tiles(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                            int64_t rows);
void npattn_amx_accumulate_bf16(const uint32_t *pp, int64_t ldp, int64_t M, int64_t np, const uint32_t *vp,
                                int64_t ldv, int64_t Dv, float *o);
void npattn_amx_accumulate_tiles_bf16(const uint32_t *pa, int64_t ldpa, int64_t M, int64_t np, const uint32_t *vp,
                                      int64_t ldv, int64_t Dv, float *o);
double npattn_amx_tile_loop(int64_t n, float *sink);
void npattn_amx_k_tiles(const uint16_t *const *rows, int64_t n, int64_t D, uint32_t *kb);
int npattn_amx_prefill_tiles_bf16(const uint16_t *qa, int64_t D, const uint32_t *kb, const uint32_t *vp, int64_t ldv,
                                  int64_t Dv, const struct npattn_score_tile *t, float *m, float *l, float *alpha,
                                  float *o, void *scratch);
/* Asks the OS for the tile data state (once per process is enough);
 * returns whether it was granted. */
int npattn_amx_request_permission(void);
#endif
#endif
#if defined(__aarch64__)
extern const struct npattn_kernels npattn_kernels_neon;
extern const struct npattn_kernels npattn_kernels_neonbf16; /* neon with BFDOT bfloat16 dot products */
#endif

/* The table in use. */
const struct npattn_kernels *npattn_kernels(void);

/* Test hook: use the named table ("" or NULL: the best this CPU has).
 * Returns -1, changing nothing, when this CPU cannot run it. */
int npattn_kernels_force(const char *name);

/* Test hook: deny 1 makes the dispatch act as if the OS had refused the
 * tile state that AMX needs (the amx table is then neither chosen nor
 * forceable); 0 asks the OS again. The table in use becomes the best left. */
void npattn_kernels_deny_amx(int deny);

/* The same online-softmax step in double, portable C on libm's exp: the path
 * of float64 problems and of float tiles that met an extreme. It never
 * fails: NaN and infinities propagate as the formula says. */
struct npattn_score_tile_f64 {
    int64_t nk, M, ld;
    double scale, softcap;
    const double *bias;
    const int32_t *lo, *hi;
};
void npattn_softmax_f64(double *st, const struct npattn_score_tile_f64 *t, double *m, double *l, double *alpha);

#if defined(__x86_64__) || defined(__i386__)
/* transpose_f32 in 8 x 8 blocks of AVX registers: the AVX2 table's and the
 * AVX-512 ones' (avx2.c). */
void npattn_transpose_f32_avx2(const float *rows, int64_t ldr, int64_t M, int64_t w, float *rowsT, int64_t ldt);
#endif

/* The rows of the transposes' register blocks (x86; NEON's are 4): a
 * transpose read in place a head at a time wants a whole block per head. */
#define NPATTN_TRANSPOSE_ROWS 8

/* ---- which rows the tables' streamed kernels take, and how ---- */

/* Whether the AVX-512 tables' streamed scores of a bfloat16 K put 32 keys in
 * the lanes (kernels.h's scores): rows of D <= NPATTN_LANES_MAX_D values, a
 * multiple of 32, against 5 or more rows of q (7 beyond D = 64). There that
 * beat the reduction trees, 1.18-1.65x on one Xeon core at D = 64 and
 * 1.09-1.43x at D = 128; it lost with fewer rows, and for float32 and
 * float16 rows, whose transposes cost twice the bfloat16 pairs'. The same
 * rows take the avx512bf16 table's dot products (q_tiles), the pairs in
 * lanes: Qwen2-0.5B heads (7 rows of 64), one Zen 4 core, 1.22-1.39x the
 * FMAs' decode (on a Sapphire Rapids core 0.8x: not in the amx table);
 * with 4 rows of 128 they lost to the FMAs' reduction trees, by reduction
 * trees of their own (0.8x) and in lanes (0.85x, K from memory). */
#define NPATTN_LANES_MAX_D 256
static inline int npattn_bf16_keys_in_lanes(int64_t M, int64_t D) {
    return D > 0 && D % 32 == 0 && D <= NPATTN_LANES_MAX_D && M >= (D <= 64 ? 5 : 7);
}

/* How many of M rows of D values the avx2 and neon tables' streamed scores
 * take with the rows in the lanes: 16 at a time (q transposed), each key
 * element broadcast (avx2) or taken by lane (neon) into the FMAs, so that
 * there is no reduction tree and each score is one FMA per element, in
 * element order; the rows left over take the reduction trees. For MQA and
 * wide groups: one Zen 4 thread (avx2), MQA 16/1/128 at 65536 keys (float32,
 * from memory) 6.2-6.5 against 6.7-7.0 ms. */
static inline int64_t npattn_rows_in_lanes(int64_t M, int64_t D) {
    return D <= NPATTN_LANES_MAX_D ? M / 16 * 16 : 0;
}

/* Whether the amx table's streamed scores of a bfloat16 K run on its tiles
 * for M rows of D values (where the rows of q are bfloat16 values and a
 * block of keys holds no subnormal value). With 16 rows that was
 * 1.36-1.38x the decode (D = 64 and 128, S = 4096-32768, one Xeon core),
 * with 8 1.27x at D = 128; with 4 and 7 it lost (0.7-0.9x where K came from
 * memory: the tiles do the rows' work no faster than the FMAs, and wait
 * longer). */
#define NPATTN_AMX_STREAM_MAX_D 256
static inline int npattn_amx_stream_rows(int64_t M, int64_t D) {
    return M >= 8 && M <= 16 && D > 0 && D % 32 == 0 && D <= NPATTN_AMX_STREAM_MAX_D;
}

/* Scalar helpers, element conversions and the portable pieces the tables
 * share (after the contract, whose types they use). */
#include "scalar.h"

#endif /* NPATTN_KERNELS_H */

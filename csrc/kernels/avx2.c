/* kernels/avx2.c: the avx2 table (AVX2 + FMA + F16C): the kernels written
 * once over the vector layer (vec_*.h), built on vec_avx2.h's 8 lanes, and
 * what is this ISA's own: the rows of q in the lanes (MQA and wide groups),
 * accumulate's register blocks for 16 registers, and their prefetch
 * distances. */
#if defined(__x86_64__) || defined(__i386__)
#include <float.h>
#include <immintrin.h>
#include <math.h>

#include "kernels.h"
#include "vec_avx2.h"
#include "vec_math.h"
#include "vec_softmax.h"
/* accumulate with Dv = 64 as a constant, as the scores (1.03-1.08x) */
#define VEC_ACC_D64 1
#include "vec_stream.h"
#include "vec_rows.h"
#include "vec_gemm.h"

/* MQA and wide groups, 16 rows or more a kv head: the scores of 16 rows
 * with the rows in the lanes of two vectors (q transposed, qt: D x 16) and
 * each key element broadcast into the FMAs: no reduction tree, each score
 * one FMA per element in order (K's half rows converted first, a block at
 * a time, so that their scores keep float32's bits). */
enum { LANES_ROWS = 16, LANES_KEYS = 6 };

/* The scores of 4 keys (a[0..3], a row a lane) into the 8 rows of st (ldst apart): a 4 x 8 transpose. */
VEC_FN void store_keys4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *st, int64_t ldst) {
    const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
    const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
    const __m256 r[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int i = 0; i < 4; i++) {
        _mm_storeu_ps(st + i * ldst, _mm256_castps256_ps128(r[i]));
        _mm_storeu_ps(st + (i + 4) * ldst, _mm256_extractf128_ps(r[i], 1));
    }
}

/* The same for 2 keys. */
VEC_FN void store_keys2(__m256 a0, __m256 a1, float *st, int64_t ldst) {
    const __m256 lo = _mm256_unpacklo_ps(a0, a1), hi = _mm256_unpackhi_ps(a0, a1);
    const __m128 r[4] = {_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi), _mm256_extractf128_ps(lo, 1),
                         _mm256_extractf128_ps(hi, 1)};
    for (int i = 0; i < 4; i++) {
        _mm_storel_pi((__m64 *)(st + 2 * i * ldst), r[i]);
        _mm_storeh_pi((__m64 *)(st + (2 * i + 1) * ldst), r[i]);
    }
}

/* 16 rows (qt) against nkb <= 6 keys, float32 rows at kr (ldk apart): 12
 * accumulators, two query vectors and a broadcast key element. pf: where
 * the rows to prefetch start (es bytes an element, ldp elements apart), or NULL. */
VEC_FN void scores_lanes_block(const float *qt, int64_t D, const float *kr, int64_t ldk, int nkb, float *st,
                               int64_t ldst, const void *pf, int64_t es, int64_t ldp) {
    __m256 acc[2 * LANES_KEYS];
    for (int i = 0; i < 2 * nkb; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        if (pf && (d * es) % 64 == 0)
            for (int a = 0; a < nkb; a++) vprefetch((const char *)pf + (a * ldp + d) * es);
        const __m256 q0 = _mm256_loadu_ps(qt + LANES_ROWS * d), q1 = _mm256_loadu_ps(qt + LANES_ROWS * d + 8);
        for (int a = 0; a < nkb; a++) {
            const __m256 kb = _mm256_broadcast_ss(kr + a * ldk + d);
            acc[2 * a] = _mm256_fmadd_ps(kb, q0, acc[2 * a]);
            acc[2 * a + 1] = _mm256_fmadd_ps(kb, q1, acc[2 * a + 1]);
        }
    }
    if (nkb == LANES_KEYS) {
        for (int h = 0; h < 2; h++) {
            float *sh = st + 8 * h * ldst;
            store_keys4(acc[h], acc[2 + h], acc[4 + h], acc[6 + h], sh, ldst);
            store_keys2(acc[8 + h], acc[10 + h], sh + 4, ldst);
        }
        return;
    }
    vec_store_lanes_scores(acc, nkb, st, ldst);
}

/* 16 rows of q against the spans' keys (of type kt; codes made into their
 * values as dq says), into st. */
VEC_FN void scores_lanes(enum npattn_dtype kt, const struct npattn_dequant *dq, const float *q, int64_t D,
                         const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st, int64_t ldst) {
    float qt[LANES_ROWS * NPATTN_LANES_MAX_D] __attribute__((aligned(64)));
    float kb[LANES_KEYS * NPATTN_LANES_MAX_D] __attribute__((aligned(64))); /* half keys, converted */
    vec_transpose_rows(q, D, LANES_ROWS, D, qt, LANES_ROWS);
    const int64_t es = npattn_stream_size(kt);
    for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n) {
        for (int64_t j = 0, nkb; j < spans[i].n; j += nkb) {
            nkb = spans[i].n - j < LANES_KEYS ? spans[i].n - j : LANES_KEYS;
            const float *kr = (const float *)npattn_stream_at(kt, spans[i].rows, j * ldk);
            int64_t ld = ldk;
            if (kt != NPATTN_DTYPE_F32) { /* the block's rows as floats, exactly (codes: their values) */
                for (int64_t a = 0; a < nkb; a++) {
                    const void *row = npattn_stream_at(kt, spans[i].rows, (j + a) * ldk);
                    if (!dq) vec_row_f32(kt, row, D, kb + a * D);
                    else vec_values_f32(kt, dq, row, D, npattn_span_groups(spans[i].scale, dq->scale_type, dq->scale_row, j + a),
                                        npattn_span_groups(spans[i].zero, dq->zero_type, dq->zero_row, j + a), kb + a * D);
                }
                kr = kb, ld = D;
            }
            const void *pf = nkb == LANES_KEYS ? npattn_stream_at(kt, spans[i].ahead, j * ldk) : NULL;
            float *sj = st + j0 + j;
            switch (nkb) {
            case 6: scores_lanes_block(qt, D, kr, ld, 6, sj, ldst, pf, es, ldk); break;
            case 5: scores_lanes_block(qt, D, kr, ld, 5, sj, ldst, pf, es, ldk); break;
            case 4: scores_lanes_block(qt, D, kr, ld, 4, sj, ldst, pf, es, ldk); break;
            case 3: scores_lanes_block(qt, D, kr, ld, 3, sj, ldst, pf, es, ldk); break;
            case 2: scores_lanes_block(qt, D, kr, ld, 2, sj, ldst, pf, es, ldk); break;
            default: scores_lanes_block(qt, D, kr, ld, 1, sj, ldst, pf, es, ldk); break;
            }
        }
    }
}

/* The rows npattn_rows_in_lanes admits, 16 at a time in the lanes; the
 * rows left take vec_stream.h's reduction trees. */
VEC_FN int64_t isa_scores_own(enum npattn_dtype kt, const struct npattn_dequant *dq, const float *q, int64_t M,
                              int64_t D, const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st,
                              int64_t ldst) {
    const int64_t lanes = npattn_rows_in_lanes(M, D);
    for (int64_t r = 0; r < lanes; r += LANES_ROWS)
        scores_lanes(kt, dq, q + r * D, D, spans, n_span, ldk, st + r * ldst, ldst);
    return lanes;
}

/* accumulate_of's blocks: blocks of 6 rows, then what is left; 4 + 3 for the last 7 */
static inline int acc_rows(int64_t left) { return left == 7 ? 4 : left > 6 ? 6 : (int)left; }

/* A block's column chunks: as many as fill 12 accumulators (at most 8, the
 * value vectors then FMA operands from memory); for half rows, whose
 * converted chunks all take registers, no more than fit in 16. A constant
 * for constant arguments. */
#define ACC_CHUNKS(nr, f32)                                                                                            \
    ((f32) ? (12 / (nr) < 8 ? 12 / (nr) : 8) : (12 / (nr) < 15 / ((nr) + 1) ? 12 / (nr) : 15 / ((nr) + 1)))

/* Rows [0, nr) of o, every whole 8 columns: blocks of nc chunks, then one
 * block of the chunks left, fewer than nc, each count a constant of its own
 * so that the accumulators stay in registers (the cases of nc or more never
 * occur, and compile to nothing). Each block prefetches its own columns of
 * the rows ahead that vec_accumulate_block's pf_every and pf_first name. */
VEC_FN void accumulate_rows(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq, const float *st,
                            int64_t ldst, int nr, int nc, const struct npattn_span *spans, int64_t n_span, int64_t ldv,
                            int64_t Dv, float *o, int pf_every, int pf_first) {
#define BLOCK(n) vec_accumulate_block(vt, zero, dq, st, ldst, nr, n, spans, n_span, ldv, Dv, e0, o, pf_every, pf_first)
    int64_t e0 = 0;
    for (; e0 + 8 * nc <= Dv; e0 += 8 * nc) BLOCK(nc);
    switch ((Dv - e0) / 8) {
    case 7: if (7 < nc) BLOCK(7); break;
    case 6: if (6 < nc) BLOCK(6); break;
    case 5: if (5 < nc) BLOCK(5); break;
    case 4: if (4 < nc) BLOCK(4); break;
    case 3: if (3 < nc) BLOCK(3); break;
    case 2: if (2 < nc) BLOCK(2); break;
    case 1: if (1 < nc) BLOCK(1); break;
    default: break;
    }
#undef BLOCK
}

/* o (M rows) += P @ v, in blocks of rows (acc_rows). Block b of n prefetches
 * every n-th row ahead from row b, so that the rows ahead come in over all
 * the passes, not in a burst over the first block's (from memory, one Zen 4
 * thread, medians of alternated calls: MQA 16/1/128 at 65536 keys 6.68
 * against 6.98 ms, 12/1/128 5.06 against 5.71). */
VEC_FN void accumulate_of(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq, const float *st,
                          int64_t ldst, int64_t M, const struct npattn_span *spans, int64_t n_span, int64_t ldv,
                          int64_t Dv, float *o) {
    const int f32 = vt == NPATTN_DTYPE_F32;
    int n_block = 0;
    for (int64_t r = 0; r < M; r += acc_rows(M - r)) n_block++;
    for (int64_t r = 0, nr, b = 0; r < M; r += nr, b++) {
        nr = acc_rows(M - r);
        const float *sr = st + r * ldst;
        float *orow = o + r * Dv;
        switch (nr) {
#define ROWS(n)                                                                                                        \
    case n:                                                                                                            \
        if (f32) accumulate_rows(vt, zero, dq, sr, ldst, n, ACC_CHUNKS(n, 1), spans, n_span, ldv, Dv, orow, n_block,  \
                                 (int)b);                                                                              \
        else accumulate_rows(vt, zero, dq, sr, ldst, n, ACC_CHUNKS(n, 0), spans, n_span, ldv, Dv, orow, n_block,      \
                             (int)b);                                                                                  \
        break;
            ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
#undef ROWS
        default: break;
        }
    }
}

/* accumulate_of; the columns past the last 8 left to the portable code. */
VEC_FN int64_t isa_accumulate_of(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq,
                                 const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                 int64_t n_span, int64_t ldv, int64_t Dv, float *o) {
    accumulate_of(vt, zero, dq, st, ldst, M, spans, n_span, ldv, Dv, o);
    return Dv / 8 * 8;
}

/* accumulate_of's passes over each value row, counted with float32's
 * blocks (half values' blocks, no wider, take as many or more). */
static int64_t accumulate_ahead_avx2(int64_t M, int64_t Dv, int64_t rows, int64_t tile) {
    int64_t passes = 0;
    for (int64_t r = 0, nr; r < M; r += nr) {
        nr = acc_rows(M - r);
        passes += (Dv / 8 + ACC_CHUNKS(nr, 1) - 1) / ACC_CHUNKS(nr, 1);
    }
    return npattn_ahead_of_passes(passes, rows, tile);
}

/* transpose_f32 in 8 x 8 blocks: the AVX2 table's and the AVX-512 ones'. */
VEC_TARGET void npattn_transpose_f32_avx2(const float *rows, int64_t ldr, int64_t M, int64_t w, float *rowsT, int64_t ldt) {
    vec_transpose_f32(rows, ldr, M, w, rowsT, ldt);
}

const struct npattn_kernels npattn_kernels_avx2 = {
    .name = "avx2",
    VEC_TABLE_KERNELS,
    .scores = vec_scores,
    .accumulate_ahead = accumulate_ahead_avx2,
    .transpose_f32 = npattn_transpose_f32_avx2,
    .finish_rows = vec_finish_rows,
};
#endif

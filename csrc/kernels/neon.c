/* kernels/neon.c: the neon and neonbf16 tables (aarch64, where NEON is
 * baseline): the kernels written once over the vector layer (vec_*.h),
 * built on vec_neon.h's 4 lanes, and what is this ISA's own: the rows of q
 * in the lanes (by-lane FMAs), accumulate's register blocks, and BFDOT's
 * bfloat16 pairs. */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "vec_neon.h"
#include "vec_math.h"
#include "vec_softmax.h"
#include "vec_stream.h"
#include "vec_rows.h"
#include "vec_gemm.h"

/* MQA and wide groups (npattn_rows_in_lanes), as avx2.c's scores_lanes: 16
 * rows in the lanes of four vectors (q transposed, qt: D x 16) and each key
 * element taken by lane into the FMAs, half keys converted in registers: no
 * reduction tree, each score one FMA per element in order. */
enum { LANES_ROWS = 16, LANES_KEYS = 4 };

/* 16 rows (qt) against nkb <= 4 keys (rows of type kt at kr): 16
 * accumulators, a key vector of 4 elements each, four query vectors an
 * element. pf: where the rows to prefetch for these keys start, or NULL. */
VEC_FN void scores_lanes_block(enum npattn_dtype kt, const float *qt, int64_t D, const void *kr, int64_t ldk, int nkb,
                               float *st, int64_t ldst, const void *pf) {
    float32x4_t acc[4 * LANES_KEYS]; /* acc[4 * key + v]: rows 4v .. 4v+3 */
    for (int i = 0; i < 4 * nkb; i++) acc[i] = vdupq_n_f32(0.0f);
    const int64_t es = npattn_stream_size(kt);
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
        if (pf && (d * es) % 64 == 0)
            for (int a = 0; a < nkb; a++) vprefetch(npattn_stream_at(kt, pf, a * ldk + d));
        float32x4_t kv[LANES_KEYS];
        for (int a = 0; a < nkb; a++) kv[a] = vload_as(kt, npattn_stream_at(kt, kr, a * ldk + d));
#define LANE(e)                                                                                                        \
    for (int v = 0; v < 4; v++) {                                                                                      \
        const float32x4_t qv = vld1q_f32(qt + LANES_ROWS * (d + e) + 4 * v);                                           \
        for (int a = 0; a < nkb; a++) acc[4 * a + v] = vfmaq_laneq_f32(acc[4 * a + v], qv, kv[a], e);                 \
    }
        LANE(0) LANE(1) LANE(2) LANE(3)
#undef LANE
    }
    for (; d < D; d++)
        for (int v = 0; v < 4; v++) {
            const float32x4_t qv = vld1q_f32(qt + LANES_ROWS * d + 4 * v);
            for (int a = 0; a < nkb; a++)
                acc[4 * a + v] = vfmaq_n_f32(acc[4 * a + v], qv, npattn_stream_elem(kt, kr, a * ldk + d));
        }
    if (nkb == LANES_KEYS) {
        for (int v = 0; v < 4; v++) {
            float32x4_t r[4] = {acc[v], acc[4 + v], acc[8 + v], acc[12 + v]};
            vtranspose(r);
            for (int i = 0; i < 4; i++) vst1q_f32(st + (4 * v + i) * ldst, r[i]);
        }
        return;
    }
    vec_store_lanes_scores(acc, nkb, st, ldst);
}

/* scores_lanes_block for nkb keys, each count a constant of its own. */
VEC_FN void scores_lanes_keys(enum npattn_dtype kt, const float *qt, int64_t D, const void *kr, int64_t ldk, int nkb,
                              float *st, int64_t ldst, const void *pf) {
    switch (nkb) {
    case 4: scores_lanes_block(kt, qt, D, kr, ldk, 4, st, ldst, pf); break;
    case 3: scores_lanes_block(kt, qt, D, kr, ldk, 3, st, ldst, pf); break;
    case 2: scores_lanes_block(kt, qt, D, kr, ldk, 2, st, ldst, pf); break;
    default: scores_lanes_block(kt, qt, D, kr, ldk, 1, st, ldst, pf); break;
    }
}

/* 16 rows of q against the spans' keys (of type kt), into st; codes made
 * into their values (dq) a block of keys at a time first, into floats. */
VEC_FN void scores_lanes(enum npattn_dtype kt, const struct npattn_dequant *dq, const float *q, int64_t D,
                         const struct npattn_span *spans, int64_t n_span, int64_t ldk, float *st, int64_t ldst) {
    float qt[LANES_ROWS * NPATTN_LANES_MAX_D] __attribute__((aligned(64)));
    float kb[LANES_KEYS * NPATTN_LANES_MAX_D] __attribute__((aligned(64))); /* codes' values */
    vec_transpose_rows(q, D, LANES_ROWS, D, qt, LANES_ROWS);
    const int codes = dq != NULL;
    for (int64_t i = 0, j0 = 0; i < n_span; j0 += spans[i++].n)
        for (int64_t j = 0, nkb; j < spans[i].n; j += nkb) {
            nkb = spans[i].n - j < LANES_KEYS ? spans[i].n - j : LANES_KEYS;
            const void *kr = npattn_stream_at(kt, spans[i].rows, j * ldk);
            const void *pf = nkb == LANES_KEYS ? npattn_stream_at(kt, spans[i].ahead, j * ldk) : NULL;
            float *sj = st + j0 + j;
            if (codes) {
                for (int64_t a = 0; a < nkb; a++)
                    vec_values_f32(kt, dq, npattn_stream_at(kt, spans[i].rows, (j + a) * ldk), D,
                                   npattn_span_groups(spans[i].scale, dq->scale_type, dq->scale_row, j + a),
                                   npattn_span_groups(spans[i].zero, dq->zero_type, dq->zero_row, j + a), kb + a * D);
                scores_lanes_keys(NPATTN_DTYPE_F32, qt, D, kb, D, (int)nkb, sj, ldst, NULL);
            } else {
                scores_lanes_keys(kt, qt, D, kr, ldk, (int)nkb, sj, ldst, pf);
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

/* Blocks of 4 rows by 16 columns; the first block of each pass over the
 * columns prefetches them (npattn_ahead_of_passes); the columns past the
 * last 16 left to the portable code. */
VEC_FN int64_t isa_accumulate_of(enum npattn_dtype vt, const int zero, const struct npattn_dequant *dq,
                                 const float *st, int64_t ldst, int64_t M, const struct npattn_span *spans,
                                 int64_t n_span, int64_t ldv, int64_t Dv, float *o) {
#define BLOCK(nr, pf)                                                                                                  \
    vec_accumulate_block(vt, zero, dq, st + r * ldst, ldst, nr, 4, spans, n_span, ldv, Dv, e0, o + r * Dv, pf, 0)
    int64_t e0 = 0;
    for (; e0 + 16 <= Dv; e0 += 16) {
        int64_t r = 0;
        for (; r + 4 <= M; r += 4)
            if (r == 0) BLOCK(4, 1);
            else BLOCK(4, 0);
        switch ((M - r) * 2 + (r == 0)) {
        case 7: BLOCK(3, 1); break;
        case 6: BLOCK(3, 0); break;
        case 5: BLOCK(2, 1); break;
        case 4: BLOCK(2, 0); break;
        case 3: BLOCK(1, 1); break;
        case 2: BLOCK(1, 0); break;
        default: break;
        }
    }
#undef BLOCK
    return e0;
}


/* isa_accumulate_of's passes over each value row: a block of 4 rows by 16 columns each. */
static int64_t accumulate_ahead_neon(int64_t M, int64_t Dv, int64_t rows, int64_t tile) {
    return npattn_ahead_of_passes((M + 3) / 4 * (Dv / 16), rows, tile);
}

/* ---- neonbf16: the neon table with BFDOT (FEAT_BF16: Apple M2 and later,
 * Graviton 3, Neoverse V1 and N2) ----
 *
 * BFDOT adds the two products of each pair of bfloat16 lanes to a float
 * accumulator. Without FEAT_EBF16 it rounds to odd and flushes subnormal
 * inputs and results to zero: the callers give it none (pair_bf16 and
 * pair_f32 report them), and a flushed product is below 2^-126, which no
 * score or output can tell. Each rounding is then within one ulp of float32,
 * not half of one, which the tolerances of the bfloat16 paths allow for. */
#define NEONBF16 __attribute__((target("arch=armv8.2-a+bf16")))

/* Whether a lane of x (bfloat16 bits) is subnormal: all ones there. */
VEC_FN uint16x8_t subnormal_bf16(uint16x8_t x) {
    const uint16x8_t expo = vandq_u16(x, vdupq_n_u16(0x7f80)), mag = vandq_u16(x, vdupq_n_u16(0x7fff));
    return vandq_u16(vceqzq_u16(expo), vtstq_u16(mag, mag));
}

/* x rounded to nearest even bfloat16, NaN kept (npattn_f32_to_bf16), in the
 * low halves of the lanes; *sub gains the lanes where x was subnormal. */
VEC_FN uint32x4_t round_bf16(float32x4_t x, uint32x4_t *sub) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x), mag = vandq_u32(bits, vdupq_n_u32(0x7fffffff));
    *sub = vorrq_u32(*sub, vandq_u32(vceqzq_u32(vandq_u32(bits, vdupq_n_u32(0x7f800000))), vtstq_u32(mag, mag)));
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7fff)), odd), 16);
    const uint32x4_t nan = vorrq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(0x40));
    return vbslq_u32(vcgtq_u32(mag, vdupq_n_u32(0x7f800000)), nan, rounded);
}

static int pair_bf16_neon(const uint16_t *a, const uint16_t *b, int64_t n, uint32_t *out) {
    uint16x8_t sub = vdupq_n_u16(0);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const uint16x8_t x = vld1q_u16(a + c), y = b ? vld1q_u16(b + c) : vdupq_n_u16(0);
        sub = vorrq_u16(sub, vorrq_u16(subnormal_bf16(x), subnormal_bf16(y)));
        if (out) {
            vst1q_u32(out + c, vreinterpretq_u32_u16(vzip1q_u16(x, y))); /* a[c] in the low half */
            vst1q_u32(out + c + 4, vreinterpretq_u32_u16(vzip2q_u16(x, y)));
        }
    }
    int tail = 0;
    for (; c < n; c++) {
        const uint16_t x = a[c], y = b ? b[c] : 0;
        tail |= npattn_bf16_subnormal(x) | npattn_bf16_subnormal(y);
        if (out) out[c] = x | (uint32_t)y << 16;
    }
    return tail || vmaxvq_u16(sub) != 0;
}

static int pair_f32_neon(const float *a, const float *b, int64_t n, uint32_t *out) {
    uint32x4_t sub = vdupq_n_u32(0);
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        const uint32x4_t x = round_bf16(vld1q_f32(a + c), &sub);
        const uint32x4_t y = b ? round_bf16(vld1q_f32(b + c), &sub) : vdupq_n_u32(0);
        vst1q_u32(out + c, vorrq_u32(x, vshlq_n_u32(y, 16)));
    }
    int tail = 0;
    for (; c < n; c++) {
        const float y = b ? b[c] : 0.0f;
        tail |= fpclassify(a[c]) == FP_SUBNORMAL || fpclassify(y) == FP_SUBNORMAL;
        out[c] = npattn_f32_to_bf16(a[c]) | (uint32_t)npattn_f32_to_bf16(y) << 16;
    }
    return tail || vmaxvq_u32(sub) != 0;
}

static int bf16_f32_neon(const float *x, int64_t n, uint16_t *out) {
    uint32x4_t sub = vdupq_n_u32(0);
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) vst1_u16(out + c, vmovn_u32(round_bf16(vld1q_f32(x + c), &sub)));
    int tail = 0;
    for (; c < n; c++) {
        tail |= fpclassify(x[c]) == FP_SUBNORMAL;
        out[c] = npattn_f32_to_bf16(x[c]);
    }
    return tail || vmaxvq_u32(sub) != 0;
}

/* acc + the pairs of x against pair `lane` of y (a constant after inlining). */
NEONBF16 VEC_FN float32x4_t bfdot_lane(float32x4_t acc, bfloat16x8_t x, bfloat16x8_t y, int lane) {
    switch (lane) {
    case 0: return vbfdotq_laneq_f32(acc, x, y, 0);
    case 1: return vbfdotq_laneq_f32(acc, x, y, 1);
    case 2: return vbfdotq_laneq_f32(acc, x, y, 2);
    default: return vbfdotq_laneq_f32(acc, x, y, 3);
    }
}

/* The n < 4 pairs of a row from k, zeros after. */
NEONBF16 VEC_FN bfloat16x8_t last_pairs(const uint16_t *k, int64_t n) {
    uint32_t w[4] = {0, 0, 0, 0};
    memcpy(w, k, (size_t)n * sizeof *w);
    return vreinterpretq_bf16_u32(vld1q_u32(w));
}

/* One step of SCORES_BF16_NEON: query pair p + l against lane l of each key's four. */
#define SCORES_STEP(l, NJ, NV)                                                                                          \
    do {                                                                                                                \
        bfloat16x8_t q[NV];                                                                                             \
        for (int v = 0; v < NV; v++) q[v] = vreinterpretq_bf16_u32(vld1q_u32(qp + (p + (l)) * ldq + 4 * v));            \
        for (int j = 0; j < NJ; j++)                                                                                    \
            for (int v = 0; v < NV; v++) acc[j][v] = bfdot_lane(acc[j][v], q[v], kp[j], (l));                           \
    } while (0)

/* st rows j .. j + NJ (keys), 4 * NV columns from r0 (nr of them live):
 * NJ * NV accumulators, each step four pairs of a key row (one vector, one
 * lane each) against NV vectors of query pairs. */
#define SCORES_BF16_NEON(NJ, NV)                                                                                        \
    NEONBF16 static void scores_bf16_##NJ##x##NV(const uint32_t *qp, int64_t ldq, int64_t np, const uint16_t *k,        \
                                                int64_t ldk, float *st, int64_t ldst, int64_t nr) {                     \
        float32x4_t acc[NJ][NV];                                                                                        \
        bfloat16x8_t kp[NJ];                                                                                            \
        for (int j = 0; j < NJ; j++)                                                                                    \
            for (int v = 0; v < NV; v++) acc[j][v] = vdupq_n_f32(0.0f);                                                 \
        int64_t p = 0;                                                                                                  \
        for (; p + 4 <= np; p += 4) {                                                                                   \
            for (int j = 0; j < NJ; j++) kp[j] = vreinterpretq_bf16_u16(vld1q_u16(k + j * ldk + 2 * p));                \
            SCORES_STEP(0, NJ, NV);                                                                                     \
            SCORES_STEP(1, NJ, NV);                                                                                     \
            SCORES_STEP(2, NJ, NV);                                                                                     \
            SCORES_STEP(3, NJ, NV);                                                                                     \
        }                                                                                                               \
        if (p < np) { /* the last pairs, fewer than four */                                                             \
            for (int j = 0; j < NJ; j++) kp[j] = last_pairs(k + j * ldk + 2 * p, np - p);                               \
            SCORES_STEP(0, NJ, NV);                                                                                     \
            if (np - p > 1) SCORES_STEP(1, NJ, NV);                                                                     \
            if (np - p > 2) SCORES_STEP(2, NJ, NV);                                                                     \
        }                                                                                                               \
        for (int j = 0; j < NJ; j++)                                                                                    \
            for (int v = 0; v < NV && 4 * v < nr; v++) vstore_part(st + j * ldst + 4 * v, nr - 4 * v, acc[j][v]);           \
    }

SCORES_BF16_NEON(4, 4) SCORES_BF16_NEON(1, 4) /* 16 columns: 4 keys at a time, then 1 */
SCORES_BF16_NEON(4, 1) SCORES_BF16_NEON(1, 1) /* 4 */

NEONBF16 static void scores_bf16_neon(const uint32_t *qp, int64_t ldq, int64_t M, int64_t np, const uint16_t *k,
                                      int64_t ldk, int64_t nk, float *st, int64_t ldst) {
    int64_t r = 0;
    for (; r + 16 <= M; r += 16) { /* 16 columns: four vectors */
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4) scores_bf16_4x4(qp + r, ldq, np, k + j * ldk, ldk, st + j * ldst + r, ldst, 16);
        for (; j < nk; j++) scores_bf16_1x4(qp + r, ldq, np, k + j * ldk, ldk, st + j * ldst + r, ldst, 16);
    }
    for (; r < M; r += 4) { /* then 4 at a time, the last cut at M */
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4) scores_bf16_4x1(qp + r, ldq, np, k + j * ldk, ldk, st + j * ldst + r, ldst, M - r);
        for (; j < nk; j++) scores_bf16_1x1(qp + r, ldq, np, k + j * ldk, ldk, st + j * ldst + r, ldst, M - r);
    }
}

/* o rows r .. r + 4, 4 * NV columns from e (nr rows and nc columns of them
 * live): 4 * NV accumulators, each step the four rows' weights of one pair
 * (one vector, one lane each) against NV vectors of value pairs. */
#define ACCUMULATE_BF16_NEON(NV)                                                                                        \
    NEONBF16 static void accumulate_bf16_4x##NV(const uint32_t *pp, int64_t ldp, int64_t np, const uint32_t *vp,        \
                                               int64_t ldv, float *o, int64_t ldo, int64_t nr, int64_t nc) {            \
        float32x4_t acc[4][NV];                                                                                         \
        for (int r = 0; r < 4; r++)                                                                                     \
            for (int v = 0; v < NV; v++)                                                                                \
                acc[r][v] = r < nr && 4 * v < nc ? vload_part(o + r * ldo + 4 * v, nc - 4 * v) : vdupq_n_f32(0.0f);         \
        for (int64_t p = 0; p < np; p++) {                                                                              \
            bfloat16x8_t x[NV];                                                                                         \
            for (int v = 0; v < NV; v++) x[v] = vreinterpretq_bf16_u32(vld1q_u32(vp + p * ldv + 4 * v));                \
            const bfloat16x8_t w = vreinterpretq_bf16_u32(vld1q_u32(pp + p * ldp));                                     \
            for (int v = 0; v < NV; v++) {                                                                              \
                acc[0][v] = vbfdotq_laneq_f32(acc[0][v], x[v], w, 0);                                                   \
                acc[1][v] = vbfdotq_laneq_f32(acc[1][v], x[v], w, 1);                                                   \
                acc[2][v] = vbfdotq_laneq_f32(acc[2][v], x[v], w, 2);                                                   \
                acc[3][v] = vbfdotq_laneq_f32(acc[3][v], x[v], w, 3);                                                   \
            }                                                                                                           \
        }                                                                                                               \
        for (int r = 0; r < 4 && r < nr; r++)                                                                           \
            for (int v = 0; v < NV && 4 * v < nc; v++) vstore_part(o + r * ldo + 4 * v, nc - 4 * v, acc[r][v]);             \
    }

ACCUMULATE_BF16_NEON(4)

NEONBF16 static void accumulate_bf16_neon(const uint32_t *pp, int64_t ldp, int64_t M, int64_t np, const uint32_t *vp,
                                          int64_t ldv, int64_t Dv, float *o) {
    for (int64_t r = 0; r < M; r += 4) /* 4 rows x 16 columns a block, the last ones cut at M and Dv */
        for (int64_t e = 0; e < Dv; e += 16)
            accumulate_bf16_4x4(pp + r, ldp, np, vp + e, ldv, o + r * Dv + e, Dv, M - r, Dv - e);
}

/* The float32 kernels, shared by the two NEON tables. */
#define NEON_F32_KERNELS                                                                                             \
    VEC_TABLE_KERNELS, .scores = vec_scores, .accumulate_ahead = accumulate_ahead_neon,                              \
    .transpose_f32 = vec_transpose_f32, .finish_rows = npattn_finish_rows

const struct npattn_kernels npattn_kernels_neon = {
    .name = "neon",
    NEON_F32_KERNELS,
};

const struct npattn_kernels npattn_kernels_neonbf16 = {
    .name = "neonbf16",
    NEON_F32_KERNELS,
    .bf16_d_step = 2,
    .pair_bf16 = pair_bf16_neon, .pair_f32 = pair_f32_neon, .bf16_f32 = bf16_f32_neon, /* BFDOT's operands */
    .scores_bf16 = scores_bf16_neon, .accumulate_bf16 = accumulate_bf16_neon,
};
#endif

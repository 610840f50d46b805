/* kernels/vec_avx512.h: the vector layer in AVX-512 (F, BW, VL), 16 float
 * lanes, masks in k registers.
 *
 * The layer. vec_avx2.h and vec_neon.h define the same names for their
 * widths: vf holds VEC_LANES floats, vm a mask of lanes, vi int32 lanes.
 * Every function is VEC_FN (inline, compiled for the layer's target), so
 * that the kernels written once over it (vec_math.h, vec_softmax.h,
 * vec_stream.h, vec_rows.h, vec_gemm.h) are built once per table by the
 * ISA file that includes them after its layer:
 *   vzero vset1 vbroadcast vload vstore vload_part vstore_part vload_m
 *   vstore_m vload_mask vstore_mask vall vlanes      floats and masks
 *   VEC_ELEMENTWISE (vadd vsub vmul vdiv vmax) vfma vabs vor_sign
 *   veq vne vge vlt vmand vany vselect vkeep         comparing, selecting
 *   vround vldexp_keep                               the exp2 polynomial's
 *   viset1 viload_m viota_plus vband                 the band mask
 *   VEC_INTEGER (viadd viand vior visrl16) vbits viselect   rounding bits
 *   vfirst vreduce_max vreduce_add vsums vtranspose  across lanes (vsums:
 *   here vstore_sums, into the scores)
 *   vload_as vstore_f16_m vstore_hi16_m vprefetch    stored rows
 * and the shapes its kernels take: VEC_MASKED_TAILS (whether a tail of
 * fewer than VEC_LANES columns runs as a masked vector, as here, or by the
 * portable code, where masked loads are slow or missing), the register
 * blocks of the streamed scores, accumulate and gemm, and fma_loop's chains.
 *
 * Element formats. A row stored as F32, F16 or BF16 is read by vload_as(t,
 * p) (here vload_as_m, with vload_as and vload_as_part on top of it):
 * VEC_LANES elements as float lanes, exactly. Adding a format is one case
 * in that load in each layer (here, vec_avx2.h, vec_neon.h), its scalar
 * element and size in scalar.h (npattn_stream_elem, npattn_stream_size:
 * the tails and the portable table), and one case in the type switches of
 * vec_scores and vec_accumulate (vec_stream.h), which then build their loops
 * once more for it, the conversion inlined; tests in test_attention.c's
 * streamed kernels. The 8-bit codes of SPEC 14 (int8, uint8, float8 e4m3fn
 * and e5m2) fit so: each code is a float exactly, so the load converts
 * codes to floats, and the scale and zero point (per row, or per group of G
 * elements along D) are applied after it by the kernels, once, over the
 * layer, not in each load. */
#ifndef NPATTN_KERNELS_VEC_H
#define NPATTN_KERNELS_VEC_H

#include <immintrin.h>

#include "avx512.h"
#include "kernels.h"
#include "vec_ops.h"

#define VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define VEC_FN static inline __attribute__((always_inline)) VEC_TARGET
#define VEC_LANES 16
#define VEC_MASKED_TAILS 1

typedef __m512 vf;
typedef __mmask16 vm;
typedef __m512i vi;

VEC_FN vf vzero(void) { return _mm512_setzero_ps(); }
VEC_FN vf vset1(float x) { return _mm512_set1_ps(x); }
VEC_FN vf vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
VEC_FN vf vload(const float *p) { return _mm512_loadu_ps(p); }
VEC_FN void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
VEC_FN vm vall(void) { return (vm)0xFFFF; }

/* The lanes below n (all where n >= 16, none where n <= 0). */
VEC_FN vm vlanes(int64_t n) { return n >= 16 ? (vm)0xFFFF : n <= 0 ? (vm)0 : (vm)((1u << n) - 1); }

/* The lanes of `live`, the others 0 (stores leave them). */
VEC_FN vf vload_m(const float *p, vm live) { return _mm512_maskz_loadu_ps(live, p); }
VEC_FN void vstore_m(float *p, vm live, vf x) { _mm512_mask_storeu_ps(p, live, x); }
VEC_FN vf vload_part(const float *p, int64_t n) { return vload_m(p, vlanes(n)); }
VEC_FN vf vload_mask(const float *p, vm m) { return vload_m(p, m); }
VEC_FN void vstore_mask(float *p, vm m, vf x) { vstore_m(p, m, x); }
VEC_FN void vstore_part(float *p, int64_t n, vf x) { vstore_m(p, vlanes(n), x); }

VEC_ELEMENTWISE(_mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_div_ps, _mm512_max_ps)
VEC_FN vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a * b + c, one rounding */
VEC_FN vf vabs(vf x) {
    return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_castps_si512(_mm512_set1_ps(-0.0f)), _mm512_castps_si512(x)));
}
/* x (not negative) with y's sign. */
VEC_FN vf vor_sign(vf x, vf y) {
    const __m512i sign = _mm512_castps_si512(_mm512_set1_ps(-0.0f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_and_si512(_mm512_castps_si512(y), sign)));
}

VEC_FN vm veq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
VEC_FN vm vne(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ); } /* NaN: not equal */
VEC_FN vm vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
VEC_FN vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
VEC_FN vm vmand(vm a, vm b) { return a & b; }
VEC_FN int vany(vm m) { return m != 0; }
VEC_FN vf vselect(vm m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); } /* m ? a : b */
VEC_FN vf vkeep(vf x, vm m) { return _mm512_maskz_mov_ps(m, x); }          /* m ? x : 0 */

VEC_FN vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n where keep (n an integer, -126 <= n <= 0 there), else 0. */
VEC_FN vf vldexp_keep(vf p, vf n, vm keep) { return _mm512_maskz_scalef_ps(keep, p, n); }

VEC_INTEGER(_mm512_set1_epi32, _mm512_add_epi32, _mm512_and_si512, _mm512_or_si512, _mm512_srli_epi32)
VEC_FN vi vbits(vf x) { return _mm512_castps_si512(x); }
VEC_FN vi viselect(vm m, vi a, vi b) { return _mm512_mask_blend_epi32(m, b, a); }
VEC_FN vi viload_m(const int32_t *p, vm live) { return _mm512_maskz_loadu_epi32(live, p); }
VEC_FN vi viota_plus(int64_t j) {
    return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), viset1((int32_t)j));
}
/* The band mask: the lanes where lo <= j <= hi. */
VEC_FN vm vband(vi lo, vi hi, vi j) {
    return _mm512_cmp_epi32_mask(lo, j, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(j, hi, _MM_CMPINT_LE);
}

VEC_FN float vfirst(vf x) { return _mm_cvtss_f32(_mm512_castps512_ps128(x)); }
VEC_FN float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }
VEC_FN float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }

/* The lane sums of the streamed scores' accumulators, acc[4 * row + key],
 * into st's nr rows (ldst apart) of nkb keys: a transpose-and-add tree (15
 * adds, 30 shuffles) instead of 16 horizontal reductions, 4 keys a row
 * stored as a 128-bit lane. */
#define VEC_SUMS 16
VEC_FN void vstore_sums(const vf v[VEC_SUMS], int nr, int nkb, float *st, int64_t ldst) {
    __m512 b[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *w = v + 4 * g;
        /* within each 128-bit lane: partial sums of w0, w1 (then w2, w3) interleaved */
        __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        /* each 128-bit lane now holds one partial sum of w0, w1, w2, w3 */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
        b[g] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* add the four 128-bit lanes, group g ending in lane g */
    __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
    if (nkb == 4) { /* lanes 4b .. 4b + 3: row b */
        if (nr > 0) _mm_storeu_ps(st, _mm512_extractf32x4_ps(sums, 0));
        if (nr > 1) _mm_storeu_ps(st + ldst, _mm512_extractf32x4_ps(sums, 1));
        if (nr > 2) _mm_storeu_ps(st + 2 * ldst, _mm512_extractf32x4_ps(sums, 2));
        if (nr > 3) _mm_storeu_ps(st + 3 * ldst, _mm512_extractf32x4_ps(sums, 3));
        return;
    }
    float out[16];
    _mm512_storeu_ps(out, sums);
    for (int r = 0; r < nr; r++)
        for (int a = 0; a < nkb; a++) st[r * ldst + a] = out[4 * r + a];
}

/* ---- stored rows: each element format as float lanes, exactly ---- */

/* The lanes of live of a row stored as type t at p, as floats, exactly
 * (the others 0): float16 through vcvtph2ps, bfloat16 widened into a
 * float's top half, int8 and uint8 codes widened to int32 and converted,
 * fp8 ones through float16 (e5m2 its top byte; e4m3fn's bits moved into
 * place, times 2^8, its NaN code NaN). One case per element format; no
 * branch besides, so that loops keeping many accumulators in registers do
 * not spill them. */
VEC_FN vf vload_as_m(enum npattn_dtype t, const void *p, vm live) {
    if (t == NPATTN_DTYPE_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p));
    if (t == NPATTN_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
    if (t == NPATTN_DTYPE_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(live, p)));
    if (t == NPATTN_DTYPE_U8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, p)));
    if (t == NPATTN_DTYPE_F8E5M2) /* the top byte of a float16 */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(live, p)), 8));
    if (t == NPATTN_DTYPE_F8E4M3) { /* as a float16 (sign, then exponent and mantissa 7 bits on), times 2^8 */
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(live, p)), 7),
                                           _mm256_set1_epi16((short)0xBFFF));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
        return _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f)), nan, _mm512_set1_ps(NAN));
    }
    return _mm512_maskz_loadu_ps(live, p);
}
/* The first n (the rest 0), and a whole vector; a whole vector's mask a
 * constant (a mask made in the scores' loops over a D that is not a
 * constant ran them 5-10% slower). */
VEC_FN vf vload_as_part(enum npattn_dtype t, const void *p, int64_t n) {
    return n >= 16 ? vload_as_m(t, p, vall()) : vload_as_m(t, p, vlanes(n));
}
VEC_FN vf vload_as(enum npattn_dtype t, const void *p) { return vload_as_m(t, p, vall()); }

/* Narrowing stores (vec_rows.h's vec_store_as rounds): the lanes of live,
 * y as float16 by vcvtps2ph (nearest even), and the high halves of r's
 * lanes. */
#define VEC_NARROW_STORES 1
VEC_FN void vstore_f16_m(void *p, vm live, vf y) {
    _mm256_mask_storeu_epi16(p, live, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
VEC_FN void vstore_hi16_m(void *p, vm live, vi r) {
    _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* The transpose of 16 vectors of 16 lanes, in place (avx512.h's transpose16). */
VEC_FN void vtranspose(vf x[16]) {
    __m512i y[16];
    for (int i = 0; i < 16; i++) y[i] = _mm512_castps_si512(x[i]);
    transpose16(y);
    for (int i = 0; i < 16; i++) x[i] = _mm512_castsi512_ps(y[i]);
}

/* The 64 bytes from p, into L2. */
VEC_FN void vprefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }

/* The streamed scores' register block (vec_stream.h): 4 rows of q against
 * 4 keys, one reduction tree for the 16 sums. */
/* gemm_f32's register block (vec_gemm.h): 6 rows x 4 vectors of sums in 24
 * of the 32 registers; 128 rows of b packed at a time (32 KiB) where
 * blocks of rows reuse them. */
#define VEC_GEMM_ROWS 6
#define VEC_GEMM_VECS 4
#define VEC_GEMM_PACK_K 128
#define VEC_GEMM_PAD 0
VEC_FN int vgemm_packs(int reused, int64_t w) { return (void)w, reused; }
VEC_FN int64_t vgemm_width(int64_t left) { return left < 64 ? left : 64; }

/* fma_loop's chains. */
#define VEC_FMA_CHAINS 16
#define VEC_SCORE_ROWS 4
/* accumulate's register blocks: at most VEC_ACC_REGS accumulators, rows
 * times vectors of columns, and VEC_ACC_CHUNKS vectors of a value row. */
#define VEC_ACC_REGS 16
#define VEC_ACC_CHUNKS 4
#define VEC_SCORE_KEYS 4

#endif

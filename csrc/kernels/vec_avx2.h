/* kernels/vec_avx2.h: the vector layer in AVX2 + FMA + F16C, 8 float lanes
 * (see vec_avx512.h for the layer's operations and how to add an element
 * format). Masks are vectors of all-ones lanes; masked loads and stores are
 * slow on some CPUs, so the kernels' column tails go to the portable code
 * (VEC_MASKED_TAILS 0) and a row's tail is masked only where it is short. */
#ifndef NPATTN_KERNELS_VEC_H
#define NPATTN_KERNELS_VEC_H

#include <immintrin.h>

#include "kernels.h"
#include "vec_ops.h"

#define VEC_TARGET __attribute__((target("avx2,fma,f16c")))
#define VEC_FN static inline __attribute__((always_inline)) VEC_TARGET
#define VEC_LANES 8
#define VEC_MASKED_TAILS 0

typedef __m256 vf;  /* float lanes */
typedef __m256 vm;  /* a lane mask: all ones or zeros */
typedef __m256i vi; /* int32 lanes */

VEC_FN vf vzero(void) { return _mm256_setzero_ps(); }
VEC_FN vf vset1(float x) { return _mm256_set1_ps(x); }
VEC_FN vf vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
VEC_FN vf vload(const float *p) { return _mm256_loadu_ps(p); }
VEC_FN void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
VEC_FN vm vall(void) { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }

/* The lanes below n (all where n >= 8), as a mask and as maskload's. */
VEC_FN __m256i vlanes_i(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(n > 8 ? 8 : n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
VEC_FN vm vlanes(int64_t n) { return _mm256_castsi256_ps(vlanes_i(n)); }

/* The first n lanes at p, the rest 0: a plain load where all 8 are there,
 * maskload only for a short tail; the store likewise. */
VEC_FN vf vload_part(const float *p, int64_t n) { return n >= 8 ? vload(p) : _mm256_maskload_ps(p, vlanes_i(n)); }
VEC_FN void vstore_part(float *p, int64_t n, vf x) {
    if (n >= 8) vstore(p, x);
    else _mm256_maskstore_ps(p, vlanes_i(n), x);
}
/* The lanes of mask m, the others 0 (stores leave them): maskload and
 * maskstore, for gemm's last columns (vec_gemm.h). */
VEC_FN vf vload_mask(const float *p, vm m) { return _mm256_maskload_ps(p, _mm256_castps_si256(m)); }
VEC_FN void vstore_mask(float *p, vm m, vf x) { _mm256_maskstore_ps(p, _mm256_castps_si256(m), x); }
/* The lanes of `live` (all lanes here: VEC_MASKED_TAILS is 0). */
VEC_FN vf vload_m(const float *p, vm live) { return (void)live, vload(p); }
VEC_FN void vstore_m(float *p, vm live, vf x) { (void)live, vstore(p, x); }

VEC_ELEMENTWISE(_mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_div_ps, _mm256_max_ps)
VEC_FN vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); } /* a * b + c, one rounding */
VEC_FN vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
/* x (not negative) with y's sign. */
VEC_FN vf vor_sign(vf x, vf y) { return _mm256_or_ps(x, _mm256_and_ps(y, _mm256_set1_ps(-0.0f))); }

VEC_FN vm veq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
VEC_FN vm vne(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_UQ); } /* NaN: not equal */
VEC_FN vm vge(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
VEC_FN vm vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
VEC_FN vm vmand(vm a, vm b) { return _mm256_and_ps(a, b); }
VEC_FN int vany(vm m) { return _mm256_movemask_ps(m) != 0; }
VEC_FN vf vselect(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); } /* m ? a : b */
VEC_FN vf vkeep(vf x, vm m) { return _mm256_and_ps(x, m); }             /* m ? x : 0 */

VEC_FN vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n where keep (n an integer, -126 <= n <= 0 there), else 0. */
VEC_FN vf vldexp_keep(vf p, vf n, vm keep) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

VEC_INTEGER(_mm256_set1_epi32, _mm256_add_epi32, _mm256_and_si256, _mm256_or_si256, _mm256_srli_epi32)
VEC_FN vi vbits(vf x) { return _mm256_castps_si256(x); }
VEC_FN vi viselect(vm m, vi a, vi b) { return _mm256_blendv_epi8(b, a, _mm256_castps_si256(m)); }
VEC_FN vi viload_m(const int32_t *p, vm live) { return (void)live, _mm256_loadu_si256((const __m256i *)p); }
VEC_FN vi viota_plus(int64_t j) { return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), viset1((int32_t)j)); }
/* The band mask: the lanes where lo <= j <= hi. */
VEC_FN vm vband(vi lo, vi hi, vi j) {
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(lo, j), _mm256_cmpgt_epi32(j, hi));
    return _mm256_andnot_ps(_mm256_castsi256_ps(out), vall());
}

VEC_FN float vfirst(vf x) { return _mm_cvtss_f32(_mm256_castps256_ps128(x)); }
VEC_FN float vreduce_max(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
VEC_FN float vreduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The lane sums of acc[0 .. n), n <= 16, into out: horizontal adds, 8 sums
 * a tree (acc[n .. 16) zeros where n > 8, their sums not used). */
VEC_FN __m256 vsum8(const vf v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 holds the low-half sums of v0..v3 in lanes 0..3 and the high-half ones in 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#define VEC_SUMS 16 /* the accumulators vsums reads */
VEC_FN void vsums(const vf acc[VEC_SUMS], int n, float *out) {
    _mm256_storeu_ps(out, vsum8(acc));
    if (n > 8) _mm256_storeu_ps(out + 8, vsum8(acc + 8));
}

/* ---- stored rows: each element format as float lanes, exactly ---- */

/* 8 elements of a row of type t at p: float16 through F16C, bfloat16
 * widened into a float's top half, int8 and uint8 codes widened to int32
 * and converted, fp8 ones through float16 (e5m2 its top byte; e4m3fn's
 * bits moved into place, times 2^8, its NaN code NaN). */
VEC_FN vf vload_as(enum npattn_dtype t, const void *p) {
    if (t == NPATTN_DTYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (t == NPATTN_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (t == NPATTN_DTYPE_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (t == NPATTN_DTYPE_U8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (t == NPATTN_DTYPE_F8E5M2)
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    if (t == NPATTN_DTYPE_F8E4M3) {
        const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                        _mm_set1_epi16((short)0xBFFF));
        const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)), _mm_set1_epi16(0x3F80));
        const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
        return _mm256_blendv_ps(x, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
    }
    return _mm256_loadu_ps((const float *)p);
}

/* Narrowing stores (vec_rows.h's vec_store_as rounds): y as float16 by
 * vcvtps2ph (nearest even), and the high halves of r's lanes. live: all
 * lanes here. */
#define VEC_NARROW_STORES 1
VEC_FN void vstore_f16_m(void *p, vm live, vf y) {
    (void)live;
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
VEC_FN void vstore_hi16_m(void *p, vm live, vi r) {
    (void)live;
    r = _mm256_srli_epi32(r, 16);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
}

/* The transpose of 8 vectors of 8 lanes, in place: 24 shuffles. */
VEC_FN void vtranspose(vf x[8]) {
    __m256 t[8], u[8];
    for (int r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_ps(x[r], x[r + 1]);
        t[r + 1] = _mm256_unpackhi_ps(x[r], x[r + 1]);
    }
    /* within each 128-bit half H: u[4g + c] = column 4H + c of rows 4g .. 4g + 3 */
    for (int g = 0; g < 2; g++) {
        u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xee);
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        x[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        x[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* The 64 bytes from p, into L2. */
VEC_FN void vprefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }

/* The streamed scores' register block (vec_stream.h): 4 rows of q against
 * 3 keys, 12 accumulators, 3 key vectors and a query vector: 16 registers. */
/* gemm_f32's register block (vec_gemm.h): 4 rows x 3 vectors of sums, 3 of
 * b, 1 of a: all 16 registers (6 x 2 and 3 x 4 ran 1-7% slower); 128 rows
 * of b packed at a time (12 KiB), only whole blocks of 24 columns, read
 * where blocks of rows reuse them. */
#define VEC_GEMM_ROWS 4
#define VEC_GEMM_VECS 3
#define VEC_GEMM_PACK_K 128
#define VEC_GEMM_PAD 0
VEC_FN int vgemm_packs(int reused, int64_t w) { return reused && w == 24; }
/* Blocks of 24 columns, but the last 25-32 as two of 16, not 24 and a
 * block of 8 (whose 4 sums, 4 chains, keep one FMA unit busy): n = 128,
 * 4.5% faster alone. */
VEC_FN int64_t vgemm_width(int64_t left) { return left > 32 || left == 24 ? 24 : left > 24 ? 16 : left; }

/* fma_loop's chains: two FMA units of 4-cycle latency want 8 or more. */
#define VEC_FMA_CHAINS 12
#define VEC_SCORE_ROWS 4
/* accumulate's register blocks: at most VEC_ACC_REGS accumulators, rows
 * times vectors of columns, and VEC_ACC_CHUNKS vectors of a value row. */
#define VEC_ACC_REGS 12
#define VEC_ACC_CHUNKS 8
#define VEC_SCORE_KEYS 3

#endif

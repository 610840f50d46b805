/* kernels/avx512.h: inline pieces shared by the AVX-512 kernels (avx512.c)
 * and the AMX ones (amx.c). */
#ifndef NPATTN_KERNELS_AVX512_H
#define NPATTN_KERNELS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* Lanes of a 16-float chunk c of a row of width n. */
static inline __attribute__((always_inline)) __mmask16 lanes(int64_t n, int64_t c) {
    int64_t left = n - 16 * c;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* Whether 16-bit lanes hold a bfloat16 subnormal value (which the bfloat16
 * dot products read as 0), over many vectors: `least` starts at
 * BF16_NONE_SEEN and keeps, lane by lane, the least of |x| - 1 as unsigned
 * (0 wraps to 0xFFFF), which is below 0x7F only for a subnormal x. */
#define BF16_NONE_SEEN _mm512_set1_epi16(-1)
__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline)) __m512i
bf16_least(__m512i least, __m512i x) {
    return _mm512_min_epu16(least, _mm512_sub_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(1)));
}
__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline)) int
bf16_any_subnormal(__m512i least) {
    return _mm512_cmplt_epu16_mask(least, _mm512_set1_epi16(0x7f)) != 0;
}

/* The transpose of 16 rows of 16 32-bit lanes, in place. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void transpose16(__m512i x[16]) {
    __m512i t[16], u[16];
    /* within each 128-bit lane L: u[4g + c] = column 4L + c of rows 4g .. 4g + 3 */
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* then column 4L + c is lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
    for (int c = 0; c < 4; c++) {
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        x[c] = _mm512_shuffle_i32x4(a, d, 0x88);
        x[4 + c] = _mm512_shuffle_i32x4(a, d, 0xdd);
        x[8 + c] = _mm512_shuffle_i32x4(b, e, 0x88);
        x[12 + c] = _mm512_shuffle_i32x4(b, e, 0xdd);
    }
}

#endif

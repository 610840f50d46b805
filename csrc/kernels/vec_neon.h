/* kernels/vec_neon.h: the vector layer in NEON (aarch64, where it is
 * baseline), 4 float lanes (see vec_avx512.h for the layer's operations and
 * how to add an element format). Masks are vectors of all-ones lanes. NEON
 * has no masked loads: a short tail goes through a buffer, and the kernels'
 * column tails to the portable code (VEC_MASKED_TAILS 0). */
#ifndef NPATTN_KERNELS_VEC_H
#define NPATTN_KERNELS_VEC_H

#include <arm_neon.h>
#include <string.h>

#include "kernels.h"
#include "vec_ops.h"

#define VEC_TARGET
#define VEC_FN static inline __attribute__((always_inline))
#define VEC_LANES 4
#define VEC_MASKED_TAILS 0

typedef float32x4_t vf;
typedef uint32x4_t vm;
typedef int32x4_t vi;

VEC_FN vf vzero(void) { return vdupq_n_f32(0.0f); }
VEC_FN vf vset1(float x) { return vdupq_n_f32(x); }
VEC_FN vf vbroadcast(const float *p) { return vdupq_n_f32(*p); }
VEC_FN vf vload(const float *p) { return vld1q_f32(p); }
VEC_FN void vstore(float *p, vf x) { vst1q_f32(p, x); }
VEC_FN vm vall(void) { return vdupq_n_u32(~0u); }

VEC_FN vi viota_plus(int64_t j) {
    static const int32_t iota[4] = {0, 1, 2, 3};
    return vaddq_s32(vld1q_s32(iota), vdupq_n_s32((int32_t)j));
}
/* The lanes below n (all where n >= 4). */
VEC_FN vm vlanes(int64_t n) { return vcgtq_s32(vdupq_n_s32((int32_t)(n > 4 ? 4 : n)), viota_plus(0)); }

/* The first n lanes at p, the rest 0: a tail of fewer than 4 through a buffer. */
VEC_FN vf vload_part(const float *p, int64_t n) {
    if (n >= 4) return vld1q_f32(p);
    float buf[4] = {0, 0, 0, 0};
    memcpy(buf, p, (size_t)n * sizeof *buf);
    return vld1q_f32(buf);
}
VEC_FN void vstore_part(float *p, int64_t n, vf x) {
    if (n >= 4) {
        vst1q_f32(p, x);
        return;
    }
    float buf[4];
    vst1q_f32(buf, x);
    memcpy(p, buf, (size_t)n * sizeof *buf);
}
/* The lanes of `live` (all lanes here: VEC_MASKED_TAILS is 0). */
VEC_FN vf vload_m(const float *p, vm live) { return (void)live, vld1q_f32(p); }
VEC_FN void vstore_m(float *p, vm live, vf x) { (void)live, vst1q_f32(p, x); }

VEC_ELEMENTWISE(vaddq_f32, vsubq_f32, vmulq_f32, vdivq_f32, vmaxq_f32)
VEC_FN vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); } /* a * b + c, one rounding */
VEC_FN vf vabs(vf x) { return vabsq_f32(x); }
/* x (not negative) with y's sign. */
VEC_FN vf vor_sign(vf x, vf y) { return vbslq_f32(vdupq_n_u32(0x80000000u), y, x); }

VEC_FN vm veq(vf a, vf b) { return vceqq_f32(a, b); }
VEC_FN vm vne(vf a, vf b) { return vmvnq_u32(vceqq_f32(a, b)); } /* NaN: not equal */
VEC_FN vm vge(vf a, vf b) { return vcgeq_f32(a, b); }
VEC_FN vm vlt(vf a, vf b) { return vcltq_f32(a, b); }
VEC_FN vm vmand(vm a, vm b) { return vandq_u32(a, b); }
VEC_FN int vany(vm m) { return vmaxvq_u32(m) != 0; }
VEC_FN vf vselect(vm m, vf a, vf b) { return vbslq_f32(m, a, b); } /* m ? a : b */
VEC_FN vf vkeep(vf x, vm m) { return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), m)); }

VEC_FN vf vround(vf x) { return vrndnq_f32(x); }
/* p * 2^n where keep (n an integer, -126 <= n <= 0 there), else 0. */
VEC_FN vf vldexp_keep(vf p, vf n, vm keep) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vkeep(vmulq_f32(p, vreinterpretq_f32_s32(e)), keep);
}

VEC_FN vi viset1(int32_t x) { return vdupq_n_s32(x); }
VEC_FN vi viload_m(const int32_t *p, vm live) { return (void)live, vld1q_s32(p); }
/* The band mask: the lanes where lo <= j <= hi. */
VEC_FN vm vband(vi lo, vi hi, vi j) { return vbicq_u32(vall(), vorrq_u32(vcgtq_s32(lo, j), vcgtq_s32(j, hi))); }

VEC_FN float vfirst(vf x) { return vgetq_lane_f32(x, 0); }
VEC_FN float vreduce_max(vf v) { return vmaxvq_f32(v); }
VEC_FN float vreduce_add(vf v) { return vaddvq_f32(v); }

/* The lane sums of acc[0 .. n) into out, one reduction each. */
#define VEC_SUMS 8
VEC_FN void vsums(const vf acc[VEC_SUMS], int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = vaddvq_f32(acc[i]);
}

/* ---- stored rows: each element format as float lanes, exactly ---- */

/* The 4 bytes at p in the low lanes. */
VEC_FN uint8x8_t vload_bytes4(const void *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return vreinterpret_u8_u32(vdup_n_u32(w));
}

/* 4 elements of a row of type t at p: float16 through fcvtl, bfloat16
 * widened into a float's top half (shll), int8 and uint8 codes widened to
 * int32 and converted, fp8 ones through float16 (e5m2 its top byte;
 * e4m3fn's bits moved into place, times 2^8, its NaN code NaN). */
VEC_FN vf vload_as(enum npattn_dtype t, const void *p) {
    if (t == NPATTN_DTYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
    if (t == NPATTN_DTYPE_BF16) return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
    if (t == NPATTN_DTYPE_I8)
        return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(vload_bytes4(p))))));
    if (t == NPATTN_DTYPE_U8) return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vload_bytes4(p)))));
    if (t == NPATTN_DTYPE_F8E5M2)
        return vcvt_f32_f16(vreinterpret_f16_u16(vshl_n_u16(vget_low_u16(vmovl_u8(vload_bytes4(p))), 8)));
    if (t == NPATTN_DTYPE_F8E4M3) {
        const int16x4_t b = vget_low_s16(vmovl_s8(vreinterpret_s8_u8(vload_bytes4(p))));
        const uint16x4_t h = vand_u16(vreinterpret_u16_s16(vshl_n_s16(b, 7)), vdup_n_u16(0xBFFF));
        const uint16x4_t nan = vceq_u16(vand_u16(h, vdup_n_u16(0x3F80)), vdup_n_u16(0x3F80));
        const float32x4_t x = vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(h)), vdupq_n_f32(256.0f));
        return vbslq_f32(vreinterpretq_u32_s32(vmovl_s16(vreinterpret_s16_u16(nan))), vdupq_n_f32(NAN), x);
    }
    return vld1q_f32((const float *)p);
}

/* The transpose of 4 vectors of 4 lanes, in place. */
VEC_FN void vtranspose(vf x[4]) {
    const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(x[0], x[1]));
    const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(x[0], x[1]));
    const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(x[2], x[3]));
    const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(x[2], x[3]));
    x[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
    x[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
    x[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
    x[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
}

/* The 64 bytes from p, into L2. */
VEC_FN void vprefetch(const void *p) { __builtin_prefetch(p, 0, 2); }

/* The streamed scores' register block (vec_stream.h): 2 rows of q against
 * 4 keys, a reduction per score. */
/* gemm_f32's register block (vec_gemm.h): 6 rows x 4 vectors of sums, 4 of
 * b: 28 of the 32 registers; 256 rows of b packed at a time (16 KiB) where
 * blocks of rows reuse them, or where a block ends inside a vector (zeros
 * after: NEON has no masked loads). */
#define VEC_GEMM_ROWS 6
#define VEC_GEMM_VECS 4
#define VEC_GEMM_PACK_K 256
#define VEC_GEMM_PAD 1
VEC_FN int vgemm_packs(int reused, int64_t w) { return reused || w % 4 != 0; }
VEC_FN int64_t vgemm_width(int64_t left) { return left < 16 ? left : 16; }

/* fma_loop's chains. */
#define VEC_FMA_CHAINS 16
#define VEC_NARROW_STORES 0 /* finish_rows: the portable code's */
#define VEC_SCORE_ROWS 2
/* accumulate's register blocks: at most VEC_ACC_REGS accumulators, rows
 * times vectors of columns, and VEC_ACC_CHUNKS vectors of a value row. */
#define VEC_ACC_REGS 16
#define VEC_ACC_CHUNKS 4
#define VEC_SCORE_KEYS 4

#endif

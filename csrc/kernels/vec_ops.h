/* kernels/vec_ops.h: the vector layer's elementwise operations, written
 * once: a layer (vec_avx2.h, vec_avx512.h, vec_neon.h) defines vf and
 * VEC_FN, then VEC_ELEMENTWISE(its add, sub, mul, div, max) defines vadd,
 * vsub, vmul, vdiv and vmax (vmax keeps its ISA's NaN rule: x86's gives
 * its second operand where either is NaN, NEON's NaN). */
#ifndef NPATTN_KERNELS_VEC_OPS_H
#define NPATTN_KERNELS_VEC_OPS_H

#define VEC_ELEMENTWISE(add, sub, mul, div, max)                                                                       \
    VEC_FN vf vadd(vf a, vf b) { return add(a, b); }                                                                   \
    VEC_FN vf vsub(vf a, vf b) { return sub(a, b); }                                                                   \
    VEC_FN vf vmul(vf a, vf b) { return mul(a, b); }                                                                   \
    VEC_FN vf vdiv(vf a, vf b) { return div(a, b); }                                                                   \
    VEC_FN vf vmax(vf a, vf b) { return max(a, b); }

/* And the int32 lanes' operations of the layers that round in integers
 * (VEC_NARROW_STORES): viset1, viadd, viand, vior and visrl16 (a logical
 * shift right by 16). */
#define VEC_INTEGER(set1, add, and, or, srli)                                                                          \
    VEC_FN vi viset1(int32_t x) { return set1(x); }                                                                    \
    VEC_FN vi viadd(vi a, vi b) { return add(a, b); }                                                                  \
    VEC_FN vi viand(vi a, vi b) { return and(a, b); }                                                                  \
    VEC_FN vi vior(vi a, vi b) { return or(a, b); }                                                                    \
    VEC_FN vi visrl16(vi a) { return srli(a, 16); }

#endif

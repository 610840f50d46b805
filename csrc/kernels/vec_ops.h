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

#endif

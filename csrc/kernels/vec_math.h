/* kernels/vec_math.h: exp and tanh written once over the vector layer (an
 * ISA file includes its vec_*.h, then this). The polynomials' constants are
 * scalar.h's, which portable.c evaluates for one lane the same way. */
#ifndef NPATTN_KERNELS_VEC_MATH_H
#define NPATTN_KERNELS_VEC_MATH_H

/* 2^y for y <= 0 (or -inf), 0 below 2^-126: 2^n p(y - n), n the nearest
 * integer, p Cephes's polynomial (NPATTN_EXP2_C*) or, `fast` (a constant),
 * the degree-4 one of the "fast" tiles' weights (NPATTN_EXP2_FAST_*). The
 * lanes below (-inf and NaN among them, whose polynomial is NaN) are zeroed
 * by the scaling's mask, so y needs no clamp. */
VEC_FN vf vexp2_nonpos(vf y, const int fast) {
    const vm keep = vge(y, vset1(NPATTN_EXP2_MIN));
    const vf n = vround(y);
    const vf f = vsub(y, n);
    vf p;
    if (fast) {
        p = vset1(NPATTN_EXP2_FAST_C4);
        p = vfma(p, f, vset1(NPATTN_EXP2_FAST_C3));
        p = vfma(p, f, vset1(NPATTN_EXP2_FAST_C2));
        p = vfma(p, f, vset1(NPATTN_EXP2_FAST_C1));
        p = vfma(p, f, vset1(NPATTN_EXP2_FAST_C0));
    } else {
        p = vset1(NPATTN_EXP2_C6);
        p = vfma(p, f, vset1(NPATTN_EXP2_C5));
        p = vfma(p, f, vset1(NPATTN_EXP2_C4));
        p = vfma(p, f, vset1(NPATTN_EXP2_C3));
        p = vfma(p, f, vset1(NPATTN_EXP2_C2));
        p = vfma(p, f, vset1(NPATTN_EXP2_C1));
        p = vfma(p, f, vset1(1.0f));
    }
    return vldexp_keep(p, n, keep);
}

/* exp(x) for x <= 0 (or -inf): exp2 of x * log2(e). */
VEC_FN vf vexp_nonpos(vf x) { return vexp2_nonpos(vmul(x, vset1(NPATTN_LOG2E)), 0); }

/* tanh(y): the odd polynomial near 0, (1 - e) / (1 + e) beyond (scalar.h). */
VEC_FN vf vtanh(vf y) {
    const vf one = vset1(1.0f);
    const vf a = vabs(y), u = vmul(y, y);
    vf p = vset1(NPATTN_TANH_P4);
    p = vfma(p, u, vset1(NPATTN_TANH_P3));
    p = vfma(p, u, vset1(NPATTN_TANH_P2));
    p = vfma(p, u, vset1(NPATTN_TANH_P1));
    p = vfma(p, u, vset1(NPATTN_TANH_P0));
    const vf near = vfma(vmul(y, u), p, y);
    const vf e = vexp_nonpos(vmul(a, vset1(-2.0f)));
    const vf far = vor_sign(vdiv(vsub(one, e), vadd(one, e)), y);
    return vselect(vlt(a, vset1(NPATTN_TANH_SPLIT)), near, far);
}

#endif

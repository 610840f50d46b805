/* kernels/vec_softmax.h: the online-softmax step (kernels.h's softmax_f32
 * and softmax_rows_f32) written once over the vector layer, for tiles stored
 * by columns (a lane per query row) and by rows (a lane per key). An ISA
 * file includes its vec_*.h and vec_math.h, then this, and puts
 * vec_softmax_columns and vec_softmax_rows in its table. */
#ifndef NPATTN_KERNELS_VEC_SOFTMAX_H
#define NPATTN_KERNELS_VEC_SOFTMAX_H

#include <float.h>
#include <math.h>

/* A softmax step's constants. */
struct vec_tile {
    vf scale, cap, inv_cap;
    int capped, plain;
};

VEC_FN struct vec_tile vec_tile_of(const struct npattn_score_tile *t) {
    const int capped = t->softcap > 0;
    const struct vec_tile c = {vset1(t->scale), vset1(t->softcap), vset1(capped ? 1.0f / t->softcap : 0.0f), capped,
                               npattn_tile_plain(t)};
    return c;
}

/* The final scores of raw scores x (lanes vis visible so far; band: key
 * positions j against lo and hi where t has a band; bias b where it has
 * one, read as the lanes vis, or the first n where n >= 0): scaled, capped,
 * biased, hidden ones -inf. nf gains x - x of the visible ones, which stays
 * 0 unless one is NaN or infinite. */
VEC_FN vf vec_scores_final(vf x, const struct vec_tile *c, const struct npattn_score_tile *t, vm vis, vi lo, vi hi,
                           vi j, const float *b_at, int64_t n, vf *nf) {
    const vf b = !b_at ? vzero() : n < 0 ? vload_m(b_at, vis) : vload_part(b_at, n);
    x = vmul(x, c->scale);
    vf check = vsub(x, x);
    if (c->capped) x = vmul(c->cap, vtanh(vmul(x, c->inv_cap)));
    if (t->lo) vis = vmand(vis, vband(lo, hi, j));
    if (b_at) {
        vis = vmand(vis, vne(b, vset1(-INFINITY)));
        x = vadd(x, b);
        check = vadd(check, vsub(x, x));
    }
    *nf = vadd(*nf, vkeep(check, vis));
    return vselect(vis, x, vset1(-INFINITY));
}

/* ---- by columns: st (nk, ld), the lanes query rows r .. r + VEC_LANES ---- */

/* The column max of the raw scores, times scale (plain tiles: rounding
 * keeps order); four chains of keys. nf gains their sum and the max. */
VEC_FN vf vec_columns_raw_max(const float *st, int64_t nk, int64_t ld, vm live, vf scale, vf *nf) {
    vf raw[4], sums[4];
    for (int c = 0; c < 4; c++) raw[c] = vset1(-FLT_MAX), sums[c] = vzero();
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4)
        for (int c = 0; c < 4; c++) {
            const vf x = vload_m(st + (j + c) * ld, live);
            sums[c] = vadd(sums[c], x);
            raw[c] = vmax(raw[c], x);
        }
    for (; j < nk; j++) {
        const vf x = vload_m(st + j * ld, live);
        sums[0] = vadd(sums[0], x);
        raw[0] = vmax(raw[0], x);
    }
    const vf top = vmul(vmax(vmax(raw[0], raw[1]), vmax(raw[2], raw[3])), scale);
    *nf = vadd(vadd(*nf, vadd(vadd(sums[0], sums[1]), vadd(sums[2], sums[3]))), top);
    return top;
}

/* Pass 1 of a softmax step for the columns from r (lanes live): the
 * columns' new max in *mx_out, pass 2's shift (the new max, or 0 for a
 * column that saw nothing) and the factor exp(old max - shift) in *a_out;
 * the scores (unless plain: only scaled) written back with scale, softcap,
 * bias and band applied. Returns 1 where a score or max is NaN or
 * infinite. */
VEC_FN int vec_columns_max(float *st, const struct npattn_score_tile *t, const float *m, int64_t r, vm live,
                           vf *mx_out, vf *shift_out, vf *a_out) {
    const struct vec_tile c = vec_tile_of(t);
    const vf ninf = vset1(-INFINITY), zero = vzero();
    const vf vmo = vload_m(m + r, live);
    vf mx = vmo, nf = vkeep(vsub(vmo, vmo), vne(vmo, ninf)); /* a NaN or +inf sink */
    const vi lo = t->lo ? viload_m(t->lo + r, live) : viset1(0), hi = t->lo ? viload_m(t->hi + r, live) : viset1(0);
    if (c.plain) mx = vmax(mx, vec_columns_raw_max(st + r, t->nk, t->ld, live, c.scale, &nf));
    for (int64_t j = 0; j < t->nk && !c.plain; j++) {
        float *row = st + j * t->ld + r;
        const vf x = vec_scores_final(vload_m(row, live), &c, t, live, lo, hi, viset1((int32_t)j),
                                      t->bias ? t->bias + j * t->ld + r : NULL, -1, &nf);
        vstore_m(row, live, x);
        mx = vmax(mx, x);
    }
    if (vany(vne(vsub(nf, nf), zero))) return 1;
    *mx_out = mx;
    *shift_out = vselect(veq(mx, ninf), zero, mx);
    *a_out = vexp_nonpos(vsub(vmo, *shift_out));
    return 0;
}

/* The columns' new sum, max and factor, after pass 2. */
VEC_FN void vec_columns_done(float *m, float *l, float *alpha, int64_t r, vm live, vf mx, vf a, vf sum) {
    vstore_m(l + r, live, vfma(vload_m(l + r, live), a, sum));
    vstore_m(m + r, live, mx);
    vstore_m(alpha + r, live, a);
}

/* The step for the columns from r (lanes live). */
VEC_FN int vec_softmax_block(float *st, const struct npattn_score_tile *t, float *m, float *l, float *alpha, int64_t r,
                             vm live) {
    const vf scale = vset1(t->scale);
    const int plain = npattn_tile_plain(t);
    vf mx, shift, a, sum = vzero();
    if (vec_columns_max(st, t, m, r, live, &mx, &shift, &a)) return 1;
    /* pass 2: probabilities against the new max (0 for a column that saw nothing) */
    for (int64_t j = 0; j < t->nk; j++) {
        float *row = st + j * t->ld + r;
        const vf x = vload_m(row, live);
        const vf p = vexp_nonpos(vsub(plain ? vmul(x, scale) : x, shift));
        vstore_m(row, live, p);
        sum = vadd(sum, p);
    }
    vec_columns_done(m, l, alpha, r, live, mx, a, sum);
    return 0;
}

/* kernels.h's softmax_f32: whole vectors of columns, then the columns left
 * as a masked vector or, in layers without cheap masks, by the portable code. */
static VEC_TARGET __attribute__((unused)) int vec_softmax_columns(float *st, const struct npattn_score_tile *t,
                                                                  float *m, float *l, float *alpha) {
    int64_t r = 0;
    for (; r + VEC_LANES <= t->M; r += VEC_LANES)
        if (vec_softmax_block(st, t, m, l, alpha, r, vall())) return 1;
    if (r == t->M) return 0;
    if (VEC_MASKED_TAILS) return vec_softmax_block(st, t, m, l, alpha, r, vlanes(t->M - r));
    return npattn_softmax_f32_columns(st, t, r, t->M, m, l, alpha);
}

/* ---- by rows: st (M, ld), the lanes keys j .. j + VEC_LANES of a row ---- */

/* A row's max of its nk raw scores, times scale (plain tiles), as a vector;
 * two chains. A lane no score reached holds -FLT_MAX before scaling. *nf:
 * finite unless a score is NaN or infinite, or scaling overflowed. */
VEC_FN vf vec_row_raw_max(const float *row, int64_t nk, float scale, vf *nf) {
    vf raw[2] = {vset1(-FLT_MAX), vset1(-FLT_MAX)}, sums[2] = {vzero(), vzero()};
    int64_t j = 0;
    for (; j + 2 * VEC_LANES <= nk; j += 2 * VEC_LANES)
        for (int c = 0; c < 2; c++) {
            const vf x = vload(row + j + VEC_LANES * c);
            sums[c] = vadd(sums[c], x);
            raw[c] = vmax(raw[c], x);
        }
    for (; j < nk; j += VEC_LANES) { /* the lanes past nk hold the max so far */
        const vf x = vselect(vlanes(nk - j), vload_part(row + j, nk - j), raw[0]);
        sums[0] = vadd(sums[0], x);
        raw[0] = vmax(raw[0], x);
    }
    const vf mx = vset1(vreduce_max(vmax(raw[0], raw[1])) * scale);
    const vf s = vadd(vadd(sums[0], sums[1]), mx);
    *nf = vsub(s, s);
    return mx;
}

/* Pass 2 of a row: its nk scores (times by) become exp(x - shift); returns their sum. */
VEC_FN float vec_row_exp(float *row, int64_t nk, vf by, vf shift) {
    vf sums[2] = {vzero(), vzero()};
    int64_t j = 0;
    for (; j + 2 * VEC_LANES <= nk; j += 2 * VEC_LANES)
        for (int c = 0; c < 2; c++) {
            const vf p = vexp_nonpos(vsub(vmul(vload(row + j + VEC_LANES * c), by), shift));
            vstore(row + j + VEC_LANES * c, p);
            sums[c] = vadd(sums[c], p);
        }
    for (; j < nk; j += VEC_LANES) {
        const vf x = vmul(vload_part(row + j, nk - j), by);
        const vf p = vkeep(vexp_nonpos(vsub(x, shift)), vlanes(nk - j));
        vstore_part(row + j, nk - j, p);
        sums[0] = vadd(sums[0], p);
    }
    return vreduce_add(vadd(sums[0], sums[1]));
}

/* Pass 1 of row r's step (its scores at row, bias row brow or NULL): the
 * row's max (plain: raw scores times scale; else the final scores, written
 * back) and its running max, as *mx and pass 2's shift (0 for a row that
 * has seen nothing). Returns 1 where a score or the running max is NaN or
 * infinite. */
VEC_FN int vec_row_max(float *row, const float *brow, const struct npattn_score_tile *t, const struct vec_tile *c,
                       const float *m, int64_t r, float *mx_out, float *shift_out) {
    if (m[r] != -INFINITY && m[r] - m[r] != 0.0f) return 1; /* a NaN or +inf sink */
    const vi lo = viset1(t->lo ? t->lo[r] : 0), hi = viset1(t->lo ? t->hi[r] : 0);
    vf vmx = vset1(-INFINITY), nf = vzero();
    if (c->plain) vmx = vec_row_raw_max(row, t->nk, t->scale, &nf);
    for (int64_t j = 0; j < t->nk && !c->plain; j += VEC_LANES) {
        const int64_t n = t->nk - j;
        const vf x = vec_scores_final(vload_part(row + j, n), c, t, vlanes(n), lo, hi, viota_plus(j),
                                      brow ? brow + j : NULL, n, &nf);
        vstore_part(row + j, n, x);
        vmx = vmax(vmx, x);
    }
    if (vany(vne(nf, vzero()))) return 1;
    float mx = vreduce_max(vmx);
    mx = m[r] > mx ? m[r] : mx;
    *mx_out = mx;
    *shift_out = mx == -INFINITY ? 0.0f : mx;
    return 0;
}

/* Row r's new sum, max and factor, after pass 2 summed its probabilities. */
VEC_FN void vec_row_done(float *m, float *l, float *alpha, int64_t r, float mx, float shift, float sum) {
    const float a = vfirst(vexp_nonpos(vsub(vset1(m[r]), vset1(shift))));
    l[r] = l[r] * a + sum;
    m[r] = mx;
    alpha[r] = a;
}

/* kernels.h's softmax_rows_f32. */
static VEC_TARGET __attribute__((unused)) int vec_softmax_rows(float *st, const struct npattn_score_tile *t, float *m,
                                                               float *l, float *alpha) {
    const struct vec_tile c = vec_tile_of(t);
    for (int64_t r = 0; r < t->M; r++) {
        float *row = st + r * t->ld;
        float mx, shift;
        if (vec_row_max(row, t->bias ? t->bias + r * t->ld : NULL, t, &c, m, r, &mx, &shift)) return 1;
        /* pass 2: probabilities against the new max (0 for a row that saw nothing) */
        const float sum = vec_row_exp(row, t->nk, c.plain ? c.scale : vset1(1.0f), vset1(shift));
        vec_row_done(m, l, alpha, r, mx, shift, sum);
    }
    return 0;
}

#endif

/* kernels/vec_rows.h: the tables' row kernels written once over the vector
 * layer (kernels.h's f16_to_f32, transpose_f32, finish_rows, add_f32 and
 * fma_loop). An ISA file includes its vec_*.h, then this, and puts in its
 * table those it uses (VEC_KERNEL: a table may leave one out, as the NEON
 * tables leave finish_rows to the portable code). */
#ifndef NPATTN_KERNELS_VEC_ROWS_H
#define NPATTN_KERNELS_VEC_ROWS_H

#define VEC_KERNEL static VEC_TARGET __attribute__((unused))

/* The entries every SIMD table takes from the kernels written over the
 * layer (vec_softmax.h, vec_stream.h, this, vec_gemm.h); a table adds its
 * scores, accumulate_ahead, transpose_f32 and finish_rows. */
#define VEC_TABLE_KERNELS                                                                                              \
    .softmax_f32 = vec_softmax_columns, .softmax_rows_f32 = vec_softmax_rows, .accumulate = vec_accumulate,            \
    .code_step = VEC_LANES, .f16_to_f32 = vec_f16_to_f32, .add_f32 = vec_add_f32, .fma_loop = vec_fma_loop,            \
    .gemm_f32 = vec_gemm_f32

/* The n elements of type t at src as floats at dst: a vector at a time,
 * then one by one. */
VEC_FN void vec_row_f32(enum npattn_dtype t, const void *src, int64_t n, float *dst) {
    int64_t j = 0;
    for (; j + VEC_LANES <= n; j += VEC_LANES) vstore(dst + j, vload_as(t, npattn_stream_at(t, src, j)));
    for (; j < n; j++) dst[j] = npattn_stream_elem(t, src, j);
}

VEC_KERNEL void vec_f16_to_f32(const uint16_t *src, int64_t n, float *dst) { vec_row_f32(NPATTN_DTYPE_F16, src, n, dst); }

/* The n elements of a row of type t at src as floats at dst: vec_row_f32,
 * and codes as the values they stand for (dq, the row's scales and zero
 * points at scale and zero), a group at a time: its vectors, then its
 * elements one by one. */
VEC_FN void vec_values_f32(enum npattn_dtype t, const struct npattn_dequant *dq, const void *src, int64_t n,
                           const void *scale, const void *zero, float *dst) {
    if (!dq) {
        vec_row_f32(t, src, n, dst);
        return;
    }
    for (int64_t g = 0, j = 0; j < n; g++) {
        const int64_t end = (g + 1) * dq->group < n ? (g + 1) * dq->group : n;
        const vf s = vset1(npattn_stream_elem(dq->scale_type, scale, g * dq->scale_col));
        const vf z = vset1(dq->zero ? npattn_stream_elem(dq->zero_type, zero, g * dq->zero_col) : 0.0f);
        for (; j + VEC_LANES <= end; j += VEC_LANES) {
            const vf x = vload_as(t, npattn_stream_at(t, src, j));
            vstore(dst + j, vmul(dq->zero ? vsub(x, z) : x, s));
        }
        for (; j < end; j++) dst[j] = npattn_value_elem(t, dq, src, j, scale, zero);
    }
}

/* rowsT (w, M) = the transpose of rows (M, w), ldt and ldr apart: blocks of
 * VEC_LANES x VEC_LANES through the registers (vtranspose), then the
 * columns and rows left over one by one. */
VEC_FN void vec_transpose_rows(const float *rows, int64_t ldr, int64_t M, int64_t w, float *rowsT, int64_t ldt) {
    int64_t r0 = 0;
    for (; r0 + VEC_LANES <= M; r0 += VEC_LANES) {
        int64_t d0 = 0;
        for (; d0 + VEC_LANES <= w; d0 += VEC_LANES) {
            vf x[VEC_LANES];
            for (int r = 0; r < VEC_LANES; r++) x[r] = vload(rows + (r0 + r) * ldr + d0);
            vtranspose(x);
            for (int c = 0; c < VEC_LANES; c++) vstore(rowsT + (d0 + c) * ldt + r0, x[c]);
        }
        for (int64_t d = d0; d < w; d++)
            for (int r = 0; r < VEC_LANES; r++) rowsT[d * ldt + r0 + r] = rows[(r0 + r) * ldr + d];
    }
    for (int64_t r = r0; r < M; r++)
        for (int64_t d = 0; d < w; d++) rowsT[d * ldt + r] = rows[r * ldr + d];
}

VEC_KERNEL void vec_transpose_f32(const float *rows, int64_t ldr, int64_t M, int64_t w, float *rowsT, int64_t ldt) {
    vec_transpose_rows(rows, ldr, M, w, rowsT, ldt);
}

#if VEC_NARROW_STORES
/* y's lanes of live stored as type t at p, rounded to nearest even
 * (subnormals kept, overflow to infinity): float16 by the layer's
 * conversion, bfloat16 in integers (+ 0x7fff + the kept bit's lowest, then
 * the high half; a NaN kept quiet: vcvtneps2bf16 would flush subnormals). */
VEC_FN void vec_store_as(enum npattn_dtype t, void *p, vm live, vf y) {
    if (t == NPATTN_DTYPE_F32) {
        vstore_m((float *)p, live, y);
        return;
    }
    if (t == NPATTN_DTYPE_F16) {
        vstore_f16_m(p, live, y);
        return;
    }
    const vi u = vbits(y);
    const vi r = viadd(u, viadd(viset1(0x7FFF), viand(visrl16(u), viset1(1))));
    vstore_hi16_m(p, live, viselect(vne(y, y), vior(u, viset1(0x400000)), r));
}

/* finish_rows: a vector of columns at a time (the last masked, or by the
 * portable code in layers without masks), rounded by vec_store_as. */
VEC_KERNEL int vec_finish_rows(const float *o, int64_t n, int64_t w, const float *l, enum npattn_dtype dt, void *dst,
                               int64_t ld) {
    const int64_t es = npattn_stream_size(dt), whole = VEC_MASKED_TAILS ? w : w / VEC_LANES * VEC_LANES;
    vf bad = vzero();
    int tail_bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float inv = npattn_finish_factor(l, i);
        const vf by = vset1(inv);
        const vm seen = inv == 0.0f ? vlanes(0) : vall();
        const float *x = o + i * w;
        char *row = (char *)dst + i * ld * es;
        int64_t e = 0;
        for (; e < whole; e += VEC_LANES) {
            const vm live = VEC_MASKED_TAILS ? vlanes(w - e) : vall();
            const vf v = vload_m(x + e, live);
            bad = vadd(bad, vsub(v, v));
            vec_store_as(dt, row + e * es, live, vkeep(vmul(v, by), seen));
        }
        if (!VEC_MASKED_TAILS) tail_bad |= npattn_finish_columns(x, e, w, inv, dt, row);
    }
    return tail_bad || vany(vne(bad, vzero()));
}
#endif

/* o[i] += x[i] for i < n. */
VEC_KERNEL void vec_add_f32(float *o, const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + VEC_LANES <= n; i += VEC_LANES) vstore(o + i, vadd(vload(o + i), vload(x + i)));
    if (i == n) return;
    if (VEC_MASKED_TAILS) vstore_part(o + i, n - i, vadd(vload_part(o + i, n - i), vload_part(x + i, n - i)));
    else npattn_add_f32(o + i, x + i, n - i);
}

/* VEC_FMA_CHAINS chains of FMAs in registers (kernels.h's fma_loop). */
VEC_KERNEL double vec_fma_loop(int64_t n, float *sink) {
    vf acc[VEC_FMA_CHAINS];
    const vf x = vset1(0.999999f), y = vset1(1e-7f);
    for (int i = 0; i < VEC_FMA_CHAINS; i++) acc[i] = vset1((float)i);
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < VEC_FMA_CHAINS; i++) acc[i] = vfma(acc[i], x, y);
    vf s = acc[0];
    for (int i = 1; i < VEC_FMA_CHAINS; i++) s = vadd(s, acc[i]);
    *sink = vreduce_add(s);
    return 2.0 * VEC_LANES * VEC_FMA_CHAINS * (double)n;
}

#endif

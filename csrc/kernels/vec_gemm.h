/* kernels/vec_gemm.h: the tiles' float products (kernels.h's gemm_f32)
 * written once over the vector layer. The layer gives the register block
 * (VEC_GEMM_ROWS rows of c by VEC_GEMM_VECS vectors), the rows of b packed
 * at a time (VEC_GEMM_PACK_K: each c element's sum restarts from zero per
 * packed block, so this is part of a table's bits), the width of a block of
 * columns (vgemm_width) and whether a block ending inside a vector is read
 * through a zero-padded copy (VEC_GEMM_PAD: layers without masked loads) or
 * with masked loads. An ISA file includes its vec_*.h, then this, and puts
 * vec_gemm_f32 in its table. */
#ifndef NPATTN_KERNELS_VEC_GEMM_H
#define NPATTN_KERNELS_VEC_GEMM_H

/* The last vector of a block of columns that ends inside it, its first
 * `last` lanes (mask lastm): of b, masked or, in padding layers, a whole
 * vector of the zero-padded copy; of c and of b as packed, masked, or the
 * padding layers' vload_part / vstore_part. */
#if VEC_GEMM_PAD
#define VEC_GEMM_B_LAST(p, last, lastm) ((void)(lastm), vload(p))
#define VEC_GEMM_LOAD_LAST(p, last, lastm) ((void)(lastm), vload_part(p, last))
#define VEC_GEMM_STORE_LAST(p, last, lastm, x) ((void)(lastm), vstore_part(p, last, x))
#else
#define VEC_GEMM_B_LAST(p, last, lastm) vload_mask(p, lastm)
#define VEC_GEMM_LOAD_LAST(p, last, lastm) ((void)(last), vload_mask(p, lastm))
#define VEC_GEMM_STORE_LAST(p, last, lastm, x) ((void)(last), vstore_mask(p, lastm, x))
#endif

/* One block of c = alpha * a @ b + beta * c, R rows by V vectors of
 * columns, the last one's first `last` lanes (lastm) c's unless full_c,
 * b's unless full_b (zeros after: a padded copy): the R x V sums stay in
 * registers over the whole of k, each step a row of b's block loaded and R
 * of a's elements broadcast. */
VEC_FN void vec_gemm_block(const int R, const int V, const int full_c, const int full_b, int64_t last, vm lastm, int64_t k,
                           float alpha, const float *a, int64_t a_rs, int64_t a_ps, const float *b, int64_t ldb,
                           float beta, float *c, int64_t ldc) {
    vf s[VEC_GEMM_ROWS][VEC_GEMM_VECS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) s[r][v] = vzero();
    for (int64_t p = 0; p < k; p++, a += a_ps, b += ldb) {
        vf bv[VEC_GEMM_VECS];
        for (int v = 0; v < V; v++)
            bv[v] = full_b || v < V - 1 ? vload(b + VEC_LANES * v) : VEC_GEMM_B_LAST(b + VEC_LANES * v, last, lastm);
        for (int r = 0; r < R; r++) {
            const vf x = vbroadcast(a + r * a_rs);
            for (int v = 0; v < V; v++) s[r][v] = vfma(x, bv[v], s[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) {
            const int whole = full_c || v < V - 1;
            float *to = c + r * ldc + VEC_LANES * v;
            vf x = vmul(s[r][v], vset1(alpha));
            if (beta != 0.0f) x = vfma(vset1(beta), whole ? vload(to) : VEC_GEMM_LOAD_LAST(to, last, lastm), x);
            if (whole) vstore(to, x);
            else VEC_GEMM_STORE_LAST(to, last, lastm, x);
        }
}

/* For each VEC_GEMM_PACK_K rows of b and each block of its columns: the
 * block packed where blocks of c's rows reuse it (its rows adjacent, so
 * that it stays in L1 without the cache-set conflicts of a power-of-two
 * leading dimension; 4-10% of a Qwen3-4B prefill), or where it ends inside
 * a vector of a padding layer, then every block of c's rows against it; the
 * block shapes as literals, each its own unrolled code. */
static VEC_TARGET void vec_gemm_f32(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t a_rs,
                                    int64_t a_ps, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    enum { W = VEC_LANES, ROWS = VEC_GEMM_ROWS };
    float pack[VEC_GEMM_PACK_K * VEC_LANES * VEC_GEMM_VECS] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += VEC_GEMM_PACK_K) { /* k = 0: c = beta * c */
        const int64_t kb = k - k0 < VEC_GEMM_PACK_K ? k - k0 : VEC_GEMM_PACK_K;
        const float beta_k = k0 == 0 ? beta : 1.0f;
        for (int64_t c0 = 0, w; c0 < n; c0 += w) {
            w = vgemm_width(n - c0);
            const int V = (int)((w + W - 1) / W), full = w % W == 0;
            const int64_t last = w - W * (V - 1);
            const vm lastm = vlanes(last);
            const float *bp = b + k0 * ldb + c0;
            int64_t ldp = ldb;
            if (vgemm_packs(m > ROWS && ldb != W * V, w)) {
                for (int64_t p = 0; p < kb; p++)
                    for (int v = 0; v < VEC_GEMM_VECS; v++) { /* a constant count: no call to memcpy */
                        const float *from = bp + p * ldb + W * v;
                        if (v < V) vstore(pack + (p * V + v) * W, full || v < V - 1 ? vload(from) : VEC_GEMM_LOAD_LAST(from, last, lastm));
                    }
                bp = pack, ldp = W * V;
            }
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                const int R = (int)(m - r0 >= ROWS ? ROWS : m - r0);
                const float *ar = a + r0 * a_rs + k0 * a_ps;
                float *cr = c + r0 * ldc + c0;
#define BLOCK(R_, V_, F_)                                                                                              \
    case ((R_) * 8 + (V_)) * 2 + (F_):                                                                                 \
        if ((R_) <= ROWS && (V_) <= VEC_GEMM_VECS)                                                                     \
            vec_gemm_block(R_, V_, F_, (F_) || VEC_GEMM_PAD, last, lastm, kb, alpha, ar, a_rs, a_ps, bp, ldp, beta_k, cr, \
                           ldc);                                                                               \
        break;
#define BLOCKS(R_) BLOCK(R_, 1, 0) BLOCK(R_, 1, 1) BLOCK(R_, 2, 0) BLOCK(R_, 2, 1) BLOCK(R_, 3, 0) BLOCK(R_, 3, 1)     \
    BLOCK(R_, 4, 0) BLOCK(R_, 4, 1)
                switch ((R * 8 + V) * 2 + full) {
                    BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4) BLOCKS(5) BLOCKS(6)
                }
#undef BLOCKS
#undef BLOCK
            }
        }
    }
}

#endif

/* kernels/amx.c: the bfloat16 products of gemm tiles on AMX-BF16 tiles
 * (Sapphire Rapids and newer), for the amx table, which is the avx512bf16
 * table with these entries (avx512.c). Same contracts as kernels.h's
 * scores_bf16, accumulate_bf16 and accumulate_tiles_bf16 (which only
 * this table has), and the same arithmetic: tdpbf16ps adds
 * the two products of each pair of bfloat16 lanes to a float accumulator,
 * one rounding each, subnormal inputs read as 0 and subnormal results
 * flushed (the callers give it none, as for vdpbf16ps).
 *
 * Tiles: all eight are 16 rows of 64 bytes. C (16 x 16 floats) += A (16 rows
 * x 16 pairs) . B (16 rows of pairs x 16 lanes), two A and two B tiles
 * against four accumulators per step of 32 bfloat16 values. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
#define _GNU_SOURCE
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512.h"
#include "kernels.h"
#include "vec_avx512.h"
#include "vec_math.h"
#include "vec_softmax.h"

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
/* The tile intrinsics do not tell the compiler that a tile load reads memory:
 * stores to a buffer must be done before one. */
#define BEFORE_TILE_LOAD() __asm__ __volatile__("" ::: "memory")

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

static const struct tile_config config = {
    .palette = 1,
    .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

int npattn_amx_request_permission(void) {
    /* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux 5.16 and newer */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* out (rows rows of w bfloat16 values, w apart) = the n <= rows rows at k
 * (ldk apart), zeros after them: the last keys of a call, as whole tiles. */
static const uint16_t *padded_rows(const uint16_t *k, int64_t ldk, int64_t n, int64_t rows, int64_t w, uint16_t *out) {
    for (int64_t i = 0; i < rows; i++)
        if (i < n) memcpy(out + i * w, k + i * ldk, (size_t)(2 * w));
        else memset(out + i * w, 0, (size_t)(2 * w));
    return out;
}

/* ---- scores: st (nk, M) = K Q^T, K's rows as A tiles in place ---- */

/* One block of 32 keys x 16 or 32 query columns (two: 32): C tiles 0 1 / 2 3
 * = keys (0-15, 16-31) x columns (0-15, 16-31); A 4, 5 from K's rows (ldk_b
 * bytes apart), B 6, 7 from Q's pairs. */
AMX static void scores_block(const uint16_t *k, int64_t ldk_b, const uint32_t *qp, int64_t ldq, int64_t np, int two,
                             float *c, int64_t ldc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < np; p += 16) {
        _tile_loadd(4, (const char *)k + 4 * p, ldk_b);
        _tile_loadd(5, (const char *)k + 16 * ldk_b + 4 * p, ldk_b);
        _tile_loadd(6, qp + p * ldq, ldq * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, qp + p * ldq + 16, ldq * 4);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    if (two) {
        _tile_stored(1, c + 16, ldc * 4);
        _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    }
}

AMX void npattn_amx_scores_bf16(const uint32_t *qp, int64_t ldq, int64_t M, int64_t np, const uint16_t *k,
                                int64_t ldk, int64_t nk, float *st, int64_t ldst) {
    if (2 * np > NPATTN_AMX_MAX_D) {
        npattn_kernels_avx512bf16.scores_bf16(qp, ldq, M, np, k, ldk, nk, st, ldst);
        return;
    }
    uint16_t kpad[32 * NPATTN_AMX_MAX_D] __attribute__((aligned(64))); /* the last keys, 32 rows padded with zeros */
    float spill[32 * 32] __attribute__((aligned(64)));          /* a block cut short, (32, 32) */
    _tile_loadconfig(&config);
    for (int64_t j = 0; j < nk; j += 32) {
        const int64_t nj = nk - j < 32 ? nk - j : 32;
        const uint16_t *kj = k + j * ldk;
        int64_t ldk_b = ldk * 2;
        if (nj < 32) {
            kj = padded_rows(kj, ldk, nj, 32, 2 * np, kpad), ldk_b = 4 * np;
            BEFORE_TILE_LOAD();
        }
        /* columns 32 at a time, 16 for a last block of 16 or fewer: the
         * lanes read lie within ldq, a multiple of 16 at least M */
        for (int64_t r = 0; r < M; r += 32) {
            const int64_t nr = M - r < 32 ? M - r : 32;
            if (nj == 32 && nr == 32) {
                scores_block(kj, ldk_b, qp + r, ldq, np, 1, st + j * ldst + r, ldst);
                continue;
            }
            scores_block(kj, ldk_b, qp + r, ldq, np, nr > 16, spill, 32);
            for (int64_t i = 0; i < nj; i++) memcpy(st + (j + i) * ldst + r, spill + 32 * i, (size_t)nr * sizeof *st);
        }
    }
    _tile_release();
}

/* ---- streamed scores: st (M, ldst) of rows of q that are bfloat16 values
 * against a bfloat16 K, as C tiles of 16 keys x 16 rows, then transposed
 * (kernels.h's scores, for the rows npattn_amx_stream_rows admits). The
 * arithmetic of scores_bf16: each product exact, the sums in float; a
 * subnormal value (read as 0 by the tiles) leaves its block of 64 keys to
 * the AVX-512 kernel, and rows of q that are not bfloat16 values leave it
 * all the keys. */

/* qb = the pairs of q's M rows as B tiles of Q^T (D / 2 rows of 16 lanes,
 * zeros past M), for the rows npattn_amx_stream_rows admits: the
 * avx512bf16 table's pairs, transposed. Returns 0, qb unspecified, for other
 * rows (the AVX-512 dot products that the avx512bf16 table takes for them
 * ran 0.8x the FMAs on this CPU: Qwen2-0.5B heads, 7 rows of 64, one
 * core), or unless every value is a bfloat16 value and none is subnormal.
 * The table's q_tiles. */
AMX int npattn_amx_q_tiles(const float *q, int64_t M, int64_t D, uint32_t *qb) {
    if (!npattn_amx_stream_rows(M, D) || !npattn_kernels_avx512bf16.q_tiles(q, M, D, qb)) return 0;
    uint32_t rows[16 * NPATTN_AMX_STREAM_MAX_D / 2] __attribute__((aligned(64)));
    memcpy(rows, qb, (size_t)(M * D / 2) * sizeof *qb);
    for (int64_t c = 0; c < D / 2; c += 16) {
        __m512i x[16];
        for (int m = 0; m < 16; m++) x[m] = m < M ? _mm512_loadu_si512(rows + m * D / 2 + c) : _mm512_setzero_si512();
        transpose16(x); /* x[p]: pair c + p of every row */
        for (int p = 0; p < 16; p++) _mm512_store_si512(qb + (c + p) * 16, x[p]);
    }
    return 1;
}

/* Whether any of the nj rows of D bfloat16 values at k (ldk apart) holds a
 * subnormal value. */
AMX static int any_subnormal(const uint16_t *k, int64_t ldk, int64_t nj, int64_t D) {
    __m512i least = BF16_NONE_SEEN;
    for (int64_t i = 0; i < nj; i++)
        for (int64_t c = 0; c < D; c += 32) least = bf16_least(least, _mm512_loadu_si512(k + i * ldk + c));
    return bf16_any_subnormal(least);
}

/* C tiles 0 .. nt - 1 = the nt <= 4 groups of 16 key rows at a[t] (lda[t]
 * bytes apart) against Q's B tiles qb (np pairs), into c (16 nt keys x 16
 * rows): the accumulators independent, so that their products overlap. */
AMX static void rows_block(const char *const a[4], const int64_t lda[4], int nt, const uint32_t *qb, int64_t np,
                           float *c) {
    _tile_zero(0);
    if (nt > 1) _tile_zero(1);
    if (nt > 2) _tile_zero(2);
    if (nt > 3) _tile_zero(3);
    for (int64_t p = 0; p < np; p += 16) {
        _tile_loadd(6, qb + p * 16, 64);
        _tile_loadd(4, a[0] + 4 * p, lda[0]);
        _tile_dpbf16ps(0, 4, 6);
        if (nt > 1) {
            _tile_loadd(5, a[1] + 4 * p, lda[1]);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (nt > 2) {
            _tile_loadd(7, a[2] + 4 * p, lda[2]);
            _tile_dpbf16ps(2, 7, 6);
        }
        if (nt > 3) {
            _tile_loadd(4, a[3] + 4 * p, lda[3]);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, c, 64);
    if (nt > 1) _tile_stored(1, c + 256, 64);
    if (nt > 2) _tile_stored(2, c + 512, 64);
    if (nt > 3) _tile_stored(3, c + 768, 64);
}

AMX void npattn_amx_scores(const float *q, int64_t M, int64_t D, enum npattn_dtype kt, const struct npattn_dequant *dq,
                           const struct npattn_span *spans, int64_t n_span, int64_t ldk, const uint32_t *qb, float *st,
                           int64_t ldst) {
    const struct npattn_kernels *up = &npattn_kernels_avx512bf16;
    if (kt != NPATTN_DTYPE_BF16 || !qb || !npattn_amx_stream_rows(M, D)) {
        up->scores(q, M, D, kt, dq, spans, n_span, ldk, NULL, st, ldst);
        return;
    }
    uint16_t kpad[16 * NPATTN_AMX_STREAM_MAX_D] __attribute__((aligned(64))); /* the last keys, padded with zeros */
    float c[64 * 16] __attribute__((aligned(64)));                             /* C tiles: 64 keys x 16 rows */
    _tile_loadconfig(&config);
    /* each span's keys 64 at a time, in place; the rows ahead listed before
     * the tiles' work (with them computed between, and this loop in a
     * function of its own, the scores of 16 rows against keys from memory
     * ran 1.7x slower) */
    for (int64_t si = 0, j0 = 0; si < n_span; j0 += spans[si++].n)
        for (int64_t i0 = 0; i0 < spans[si].n; i0 += 64) {
            const int64_t j = j0 + i0, nj = spans[si].n - i0 < 64 ? spans[si].n - i0 : 64;
            const uint16_t *kj = (const uint16_t *)spans[si].rows + i0 * ldk;
            const uint16_t *aj = (const uint16_t *)spans[si].ahead + i0 * ldk;
            if (any_subnormal(kj, ldk, nj, D)) {
                const struct npattn_span part = {kj, aj, nj, NULL, NULL};
                up->scores(q, M, D, kt, NULL, &part, 1, ldk, NULL, st + j, ldst);
                continue;
            }
            const void *ahead[64];
            for (int64_t i = 0; i < nj; i++) ahead[i] = aj + i * ldk;
            /* whole groups of 16 rows in place, a last short one padded */
            const int nt = (int)((nj + 15) / 16);
            const char *a[4] = {NULL};
            int64_t lda[4] = {0};
            for (int t = 0; t < nt; t++) a[t] = (const char *)(kj + 16 * t * ldk), lda[t] = 2 * ldk;
            if (nj % 16) {
                a[nt - 1] = (const char *)padded_rows(kj + 16 * (nt - 1) * ldk, ldk, nj % 16, 16, D, kpad);
                lda[nt - 1] = 2 * D;
                BEFORE_TILE_LOAD();
            }
            rows_block(a, lda, nt, qb, D / 2, c);
            /* C's tiles (keys, rows) as st's rows (rows, keys); the rows ahead
             * prefetched 16 at a time between, not all at once, which stalled
             * on the memory's queue */
            for (int64_t h = 0; h < nj; h += 16) {
                __m512i x[16];
                for (int i = 0; i < 16; i++) x[i] = _mm512_load_si512(c + (h + i) * 16);
                transpose16(x);
                const __mmask16 live = lanes(nj - h, 0);
                for (int64_t r = 0; r < M; r++) _mm512_mask_storeu_ps(st + r * ldst + j + h, live, (__m512)x[r]);
                for (int64_t i = h; i < h + 16 && i < nj; i++)
                    for (int64_t b = 0; b < 2 * D; b += 64) _mm_prefetch((const char *)ahead[i] + b, _MM_HINT_T1);
            }
        }
    _tile_release();
}

/* ---- P @ V: o (M, Dv) += P V, P's pairs as A tiles ---- */

/* pa (16 rows, n16 apart) = P's pairs pp[p * ldp + r] for 16 rows r0 .. r0
 * + 15 as A tiles, pa[i * n16 + p] the pair p of row r0 + i, zeros for p >=
 * np. */
AMX static void p_tiles(const uint32_t *pp, int64_t ldp, int64_t r0, int64_t np, int64_t n16, uint32_t *pa) {
    for (int64_t p0 = 0; p0 < n16; p0 += 16) {
        __m512i x[16];
        for (int i = 0; i < 16; i++) x[i] = p0 + i < np ? _mm512_loadu_si512(pp + (p0 + i) * ldp + r0) : _mm512_setzero_si512();
        transpose16(x);
        for (int i = 0; i < 16; i++) _mm512_store_si512(pa + i * n16 + p0, x[i]);
    }
}

/* o's nr <= 32 rows (Dv apart) += the product of their P's pairs, A tiles'
 * rows at pa (lda apart, n16 pairs each, zeros past np; rows past nr are
 * read only where nr > 16, and those results dropped), and V's pairs. */
AMX static void accumulate_rows(const uint32_t *pa, int64_t lda, int64_t nr, int64_t np, int64_t n16, const uint32_t *vp,
                                int64_t ldv, int64_t Dv, float *o) {
    uint32_t vpad[16 * 32] __attribute__((aligned(64))); /* V's last pairs (32 lanes), zeros past np and ldv */
    float spill[32 * 32] __attribute__((aligned(64)));   /* o's block when cut short, (32, 32) */
    for (int64_t e = 0; e < Dv; e += 32) {
        const int64_t ne = Dv - e < 32 ? Dv - e : 32;
        const int whole = nr == 32 && ne == 32;
        float *c = o + e;
        int64_t ldc = Dv;
        if (!whole) {
            memset(spill, 0, sizeof spill);
            for (int64_t i = 0; i < nr; i++) memcpy(spill + 32 * i, c + i * Dv, (size_t)ne * sizeof *c);
            c = spill, ldc = 32;
        }
        BEFORE_TILE_LOAD();
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
        _tile_zero(5);
        for (int64_t p = 0; p < n16; p += 16) {
            const uint32_t *b = vp + p * ldv + e;
            int64_t ldb = ldv;
            if (p + 16 > np || e + 32 > ldv) { /* pairs past np, or lanes past ldv: from a padded copy */
                memset(vpad, 0, sizeof vpad);
                for (int64_t i = 0; i < 16 && p + i < np; i++)
                    memcpy(vpad + 32 * i, b + i * ldv, (size_t)(ldv - e < 32 ? ldv - e : 32) * sizeof *b);
                b = vpad, ldb = 32;
                BEFORE_TILE_LOAD();
            }
            _tile_loadd(4, pa + p, lda * 4);
            if (nr > 16) _tile_loadd(5, pa + 16 * lda + p, lda * 4);
            _tile_loadd(6, b, ldb * 4);
            _tile_loadd(7, b + 16, ldb * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, ldc * 4);
        _tile_stored(1, c + 16, ldc * 4);
        _tile_stored(2, c + 16 * ldc, ldc * 4);
        _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
        if (!whole)
            for (int64_t i = 0; i < nr; i++) memcpy(o + i * Dv + e, spill + 32 * i, (size_t)ne * sizeof *o);
    }
}

AMX void npattn_amx_accumulate_bf16(const uint32_t *pp, int64_t ldp, int64_t M, int64_t np, const uint32_t *vp,
                                    int64_t ldv, int64_t Dv, float *o) {
    if (np > 256) { /* more than 512 keys: not a tile of forward.c's */
        npattn_kernels_avx512bf16.accumulate_bf16(pp, ldp, M, np, vp, ldv, Dv, o);
        return;
    }
    const int64_t n16 = (np + 15) / 16 * 16;
    uint32_t pa[32 * 256] __attribute__((aligned(64))); /* 32 rows of P's pairs, as A tiles */
    _tile_loadconfig(&config);
    for (int64_t r = 0; r < M; r += 32) {
        const int64_t nr = M - r < 32 ? M - r : 32;
        p_tiles(pp, ldp, r, np, n16, pa);
        if (nr > 16) p_tiles(pp, ldp, r + 16, np, n16, pa + 16 * n16);
        accumulate_rows(pa, n16, nr, np, n16, vp, ldv, Dv, o + r * Dv);
    }
    _tile_release();
}

/* kernels.h's split_tiles: 16 rows by 16 keys at a time, each weight split
 * in its lane, the block transposed, each pair then written twice. */
AMX void npattn_amx_split_tiles(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                                int64_t rows) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const __mmask16 live = lanes(M - r0, 0);
        for (int64_t j0 = 0; j0 < nk; j0 += 16) {
            __m512i x[16];
            for (int i = 0; i < 16; i++) {
                if (j0 + i >= nk) {
                    x[i] = _mm512_setzero_si512();
                    continue;
                }
                const __m512 f = _mm512_maskz_loadu_ps(live, st + (j0 + i) * ldst + r0);
                const __m512i hi = _mm512_and_si512(_mm512_castps_si512(f), top);
                const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(f, _mm512_castsi512_ps(hi)));
                x[i] = _mm512_or_si512(_mm512_srli_epi32(hi, 16), _mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16));
            }
            transpose16(x); /* x[r]: row r0 + r's pairs for keys j0 .. j0 + 15 */
            const int64_t n = ldpa - 2 * j0 < 32 ? ldpa - 2 * j0 : 32; /* pairs to write: whole vectors */
            const __mmask16 m0 = lanes(n, 0), m1 = lanes(n, 1);
            for (int r = 0; r < 16; r++) {
                uint32_t *to = pa + (r0 + r) * ldpa + 2 * j0;
                _mm512_mask_storeu_epi32(to, m0, _mm512_permutexvar_epi32(first, x[r]));
                _mm512_mask_storeu_epi32(to + 16, m1, _mm512_permutexvar_epi32(second, x[r]));
            }
        }
    }
}

/* Part k (0, 1, 2) of weights f: the first 8 significant bits, the next 8,
 * and the rest, each a bfloat16 value in the low half of its lane (the last
 * rounded by vcvtneps2bf16: below 2^-126, 0). */
AMX static inline __m512i weight_part(__m512 f, int k) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
    for (int i = 0; i < k; i++) f = _mm512_sub_ps(f, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(f), top)));
    if (k == 2) return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f));
    return _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(f), top), 16);
}

/* kernels.h's exact_tiles: per part, 32 keys of 16 rows at a time, the
 * parts of keys 2p and 2p + 1 paired in each row's lane, then transposed. */
AMX void npattn_amx_exact_tiles(const float *st, int64_t nk, int64_t M, int64_t ldst, uint32_t *pa, int64_t ldpa,
                                int64_t rows) {
    const int64_t n16 = (nk + 31) / 32 * 16;
    for (int k = 0; k < 3; k++)
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const __mmask16 live = lanes(M - r0, 0);
            for (int64_t p0 = 0; p0 < n16; p0 += 16) {
                __m512i x[16];
                for (int i = 0; i < 16; i++) {
                    const int64_t j = 2 * (p0 + i);
                    const __m512 a = j < nk ? _mm512_maskz_loadu_ps(live, st + j * ldst + r0) : _mm512_setzero_ps();
                    const __m512 b = j + 1 < nk ? _mm512_maskz_loadu_ps(live, st + (j + 1) * ldst + r0) : _mm512_setzero_ps();
                    x[i] = _mm512_or_si512(weight_part(a, k), _mm512_slli_epi32(weight_part(b, k), 16));
                }
                transpose16(x); /* x[r]: row r0 + r's pairs p0 .. p0 + 15 */
                for (int r = 0; r < 16; r++) _mm512_storeu_si512(pa + (k * rows + r0 + r) * ldpa + p0, x[r]);
            }
        }
}

/* kernels.h's tile_loop: four accumulators, each tdpbf16ps 16 x 16 x 32
 * products (16384 flops), against A and B tiles loaded once. */
AMX double npattn_amx_tile_loop(int64_t n, float *sink) {
    uint16_t a[16 * 32] __attribute__((aligned(64))), b[16 * 32] __attribute__((aligned(64)));
    float c[256] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) a[i] = 0x3F80, b[i] = 0x3380; /* 1 and 2^-24: the sums grow slowly */
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    BEFORE_TILE_LOAD();
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b, 64);
    for (int64_t r = 0; r < n; r++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(3, c, 64);
    _tile_release();
    *sink = c[0];
    return 4 * 16384.0 * (double)n;
}

AMX void npattn_amx_accumulate_tiles_bf16(const uint32_t *pa, int64_t ldpa, int64_t M, int64_t np, const uint32_t *vp,
                                          int64_t ldv, int64_t Dv, float *o) {
    const int64_t n16 = (np + 15) / 16 * 16;
    _tile_loadconfig(&config);
    for (int64_t r = 0; r < M; r += 32)
        accumulate_rows(pa + r * ldpa, ldpa, M - r < 32 ? M - r : 32, np, n16, vp, ldv, Dv, o + r * Dv);
    _tile_release();
}

/* ---- K's pairs as B tiles (kernels.h's k_tiles) ---- */

AMX void npattn_amx_k_tiles(const uint16_t *const *rows, int64_t n, int64_t D, uint32_t *kb) {
    for (int64_t g = 0; g < (n + 31) / 32 * 2; g++)
        for (int64_t c = 0; c < D; c += 32) {
            __m512i x[16];
            for (int i = 0; i < 16; i++)
                x[i] = 16 * g + i < n ? _mm512_loadu_si512(rows[16 * g + i] + c) : _mm512_setzero_si512();
            transpose16(x); /* x[p]: pair c / 2 + p of the 16 keys */
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(kb + g * 8 * D + (c / 2 + p) * 16, x[p]);
        }
}

/* ---- the pipelined step (kernels.h's prefill_tiles_bf16) ----
 * Blocks of PIPE_ROWS rows in three stages: the scores of block R + 1 (C
 * tiles 0-3 = rows 0-15, 16-31 x keys 0-15, 16-31 of a block of 32 keys;
 * A 4, 5 from Q's rows, B 6, 7 from K's pairs), block R's softmax by rows
 * on the vector units, and P @ V of block R - 1 (C 0-3 = O's rows 0-15,
 * 16-31 x 32 columns; A 4, 5 from P's rows, B 6, 7 from V's pairs). The
 * tiles' work comes in units of four products, issued between the softmax's
 * rows, so that the TMUL runs while the vector units work: the out-of-order
 * core holds a few units and a row or two at once. */

#define PIPE_ROWS 32
#define PASS2_WORK 6 /* a row's pass 2 against its pass 1, in vector instructions */

struct pipe {
    const char *qa;                /* Q's rows, lda bytes apart */
    int64_t lda, D, ks, nkb;       /* steps of 32 values; blocks of 32 keys */
    const uint32_t *kb;            /* K's pairs as B tiles: per 16 keys, 8 D words */
    const uint32_t *vp, *vlast;    /* V's pairs (ldv apart), its last 16 copied where the tile's end cuts them */
    int64_t ldv, Dv, ncb, nps;     /* column blocks of 32; steps of 16 pairs */
    float *o;                      /* O's rows, Dv apart */
    int64_t M, nblk;
    float *s[2];                   /* a block's scores, sld apart */
    uint32_t *pa[2];               /* its P's pairs, pld apart */
    int64_t sld, pld;
};

/* Unit u of block R's scores: step u % ks of the key block u / ks. */
AMX static inline void scores_unit(const struct pipe *pp, int64_t R, int64_t u) {
    const int64_t b = u / pp->ks, st = u % pp->ks;
    const int two = pp->M - PIPE_ROWS * R > 16;
    BEFORE_TILE_LOAD();
    if (st == 0) {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    const char *q = pp->qa + PIPE_ROWS * R * pp->lda + 64 * st;
    const uint32_t *k = pp->kb + 2 * b * 8 * pp->D + 256 * st;
    _tile_loadd(4, q, pp->lda);
    _tile_stream_loadd(6, k, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stream_loadd(7, k + 8 * pp->D, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
        _tile_loadd(5, q + 16 * pp->lda, pp->lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (st == pp->ks - 1) {
        float *c = pp->s[R % 2] + 32 * b;
        const int64_t ldc = pp->sld * 4;
        _tile_stored(0, c, ldc);
        _tile_stored(1, c + 16, ldc);
        if (two) {
            _tile_stored(2, c + 16 * pp->sld, ldc);
            _tile_stored(3, c + 16 * pp->sld + 16, ldc);
        }
    }
    BEFORE_TILE_LOAD();
}

/* Unit u of block R's P @ V: step u % nps of the column block u / nps, O's
 * block loaded at the first step and stored at the last. */
AMX static inline void pv_unit(const struct pipe *pp, int64_t R, int64_t u) {
    const int64_t cb = u / pp->nps, ps = u % pp->nps;
    const int two = pp->M - PIPE_ROWS * R > 16, wide = pp->Dv - 32 * cb > 16;
    float *o = pp->o + PIPE_ROWS * R * pp->Dv + 32 * cb;
    const int64_t ldo = pp->Dv * 4;
    BEFORE_TILE_LOAD();
    if (ps == 0) {
        _tile_loadd(0, o, ldo);
        if (wide) _tile_loadd(1, o + 16, ldo);
        if (two) _tile_loadd(2, o + 16 * pp->Dv, ldo);
        if (two && wide) _tile_loadd(3, o + 16 * pp->Dv + 16, ldo);
    }
    const uint32_t *a = pp->pa[R % 2] + 16 * ps;
    const int last = ps == pp->nps - 1 && pp->vlast;
    const uint32_t *v = (last ? pp->vlast : pp->vp + 16 * ps * pp->ldv) + 32 * cb;
    const int64_t ldv = pp->ldv * 4, lda = pp->pld * 4;
    _tile_loadd(4, a, lda);
    _tile_stream_loadd(6, v, ldv);
    _tile_dpbf16ps(0, 4, 6);
    if (wide) {
        _tile_stream_loadd(7, v + 16, ldv);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (two) {
        _tile_loadd(5, a + 16 * pp->pld, lda);
        _tile_dpbf16ps(2, 5, 6);
        if (wide) _tile_dpbf16ps(3, 5, 7);
    }
    if (ps == pp->nps - 1) {
        _tile_stored(0, o, ldo);
        if (wide) _tile_stored(1, o + 16, ldo);
        if (two) _tile_stored(2, o + 16 * pp->Dv, ldo);
        if (two && wide) _tile_stored(3, o + 16 * pp->Dv + 16, ldo);
    }
    BEFORE_TILE_LOAD();
}

/* 2^y for y <= 0 as vexp2_nonpos(y, 1) (the fast polynomial of y's
 * fraction f = y - round(y), vreduceps's), but unmasked: below 2^-126 it may
 * be subnormal where that is 0 (the bfloat16 pairs read both as 0), and a
 * NaN y gives NaN, which the row's sum shows (-inf gives 0: pass 1 finds
 * it). On a Sapphire Rapids core vreduceps runs beside the tiles' products
 * where vrndscaleps waits for them: the softmax between them took 0.91x the
 * time. */
AMX static inline __m512 exp2_plain(__m512 y) {
    const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(NPATTN_EXP2_FAST_C4);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(NPATTN_EXP2_FAST_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(NPATTN_EXP2_FAST_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(NPATTN_EXP2_FAST_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(NPATTN_EXP2_FAST_C0));
    return _mm512_scalef_ps(p, _mm512_sub_ps(y, f));
}

/* The keys of row r that a tile without bias and softcap lets it see:
 * [*a, *b), the band's where it has one, else all nk. */
AMX static inline void row_keys(const struct npattn_score_tile *t, int64_t r, int64_t *a, int64_t *b) {
    *a = 0, *b = t->nk;
    if (!t->lo) return;
    *a = t->lo[r] > 0 ? t->lo[r] : 0;
    *b = t->hi[r] + 1 < t->nk ? t->hi[r] + 1 : t->nk;
    if (*b < *a) *b = *a;
}

/* The lanes of keys j .. j + 15 within [a, b). */
AMX static inline __mmask16 keys_within(int64_t j, int64_t a, int64_t b) {
    return (__mmask16)(lanes(b - j, 0) & ~lanes(a - j, 0));
}

/* Pass 1 of row r of a tile without bias and softcap (scores at row, the
 * keys it sees [a, b)): their raw max times scale, against the running
 * max, as *mx and pass 2's shift (0 for a row that has seen nothing).
 * Returns 1 where a score it sees is infinite, or the max times scale or
 * the running max is not finite; a NaN score is left to pass 2. */
AMX static inline int row_max_range(const float *row, int64_t a, int64_t b, float scale, const float *m, int64_t r,
                                    float *mx, float *shift) {
    const float old = m[r];
    if (old != -INFINITY && old - old != 0.0f) return 1;
    if (a >= b) { /* nothing seen here */
        *mx = old;
        *shift = old == -INFINITY ? 0.0f : old;
        return 0;
    }
    __m512 hi0 = _mm512_set1_ps(-FLT_MAX), hi1 = hi0, lo0 = _mm512_set1_ps(FLT_MAX), lo1 = lo0;
    int64_t j = a;
    for (; j + 32 <= b; j += 32) {
        const __m512 x0 = _mm512_loadu_ps(row + j), x1 = _mm512_loadu_ps(row + j + 16);
        hi0 = _mm512_max_ps(hi0, x0), hi1 = _mm512_max_ps(hi1, x1);
        lo0 = _mm512_min_ps(lo0, x0), lo1 = _mm512_min_ps(lo1, x1);
    }
    for (; j < b; j += 16) {
        const __mmask16 live = lanes(b - j, 0);
        const __m512 x = _mm512_maskz_loadu_ps(live, row + j);
        hi0 = _mm512_mask_max_ps(hi0, live, hi0, x), lo0 = _mm512_mask_min_ps(lo0, live, lo0, x);
    }
    const float x = _mm512_reduce_max_ps(_mm512_max_ps(hi0, hi1)) * scale;
    const float lo = _mm512_reduce_min_ps(_mm512_min_ps(lo0, lo1)) * scale;
    if (x - x != 0.0f || lo - lo != 0.0f) return 1;
    *mx = old > x ? old : x;
    *shift = *mx;
    return 0;
}

/* 2^(x to2 + from) of the 16 scores at x in lanes `live`, 0 elsewhere: by
 * exp2_plain (plain), else by the masked exp. */
AMX static inline __m512 keys_exp(const float *x, __mmask16 live, __m512 to2, __m512 from, int plain) {
    const __m512 y = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, x), to2, from);
    return _mm512_maskz_mov_ps(live, plain ? exp2_plain(y) : vexp2_nonpos(y, 1));
}

/* Pass 2 of a row (its scores at row, pass 1's shift): the probabilities,
 * by the fast exp as softmax_tiles_avx512's, to prow as an A tile's row of
 * n16 pairs, rounded to nearest even bfloat16: consecutive keys are a pair,
 * so that no transpose is needed. Returns their sum. Without bias and
 * softcap (`range`), the keys [a, b) (zeros elsewhere), raw scores times
 * scale by exp2_plain, whose NaN the sum carries; else the final scores of
 * the keys below nk, -inf where hidden, by the masked exp. */
AMX static inline float row_pairs(const float *row, const struct npattn_score_tile *t, int range, int64_t a, int64_t b,
                                  float shift, uint32_t *prow, int64_t n16) {
    const __m512 to2 = _mm512_set1_ps((float)((range ? (double)t->scale : 1.0) * 1.4426950408889634));
    const __m512 from = _mm512_mul_ps(_mm512_set1_ps(shift), _mm512_set1_ps(-NPATTN_LOG2E));
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    if (!range) a = 0, b = t->nk;
    for (int64_t j = 0; j < 2 * n16; j += 32) {
        const __mmask16 m0 = keys_within(j, a, b), m1 = keys_within(j + 16, a, b);
        __m512 p0, p1;
        if (range && (m0 & m1) == 0xFFFF) {
            p0 = exp2_plain(_mm512_fmadd_ps(_mm512_loadu_ps(row + j), to2, from));
            p1 = exp2_plain(_mm512_fmadd_ps(_mm512_loadu_ps(row + j + 16), to2, from));
        } else if ((m0 | m1) == 0) {
            p0 = p1 = _mm512_setzero_ps();
        } else {
            p0 = keys_exp(row + j, m0, to2, from, range);
            p1 = keys_exp(row + j + 16, m1, to2, from, range);
        }
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
        _mm512_store_si512(prow + j / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

/* The rows r0 .. r0 + n - 1's new sums, maxima and factors, 16 at a time,
 * after pass 2 left their sums: as vec_columns_done. */
AMX static inline void block_done(float *m, float *l, float *alpha, int64_t r0, int64_t n, const float *mx,
                                  const float *shift, const float *sum) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = lanes(n - i, 0);
        const __m512 old = _mm512_maskz_loadu_ps(live, m + r0 + i), sh = _mm512_maskz_loadu_ps(live, shift + i);
        const __m512 a = vexp_nonpos(_mm512_sub_ps(old, sh)), s = _mm512_maskz_loadu_ps(live, sum + i);
        _mm512_mask_storeu_ps(l + r0 + i, live, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, l + r0 + i), a, s));
        _mm512_mask_storeu_ps(m + r0 + i, live, _mm512_maskz_loadu_ps(live, mx + i));
        _mm512_mask_storeu_ps(alpha + r0 + i, live, a);
    }
}

/* O's rows of block R times their factors, where not 1. */
AMX static void rescale_block(const struct pipe *pp, int64_t R, const float *alpha) {
    for (int64_t r = PIPE_ROWS * R; r < pp->M && r < PIPE_ROWS * (R + 1); r++)
        if (alpha[r] != 1.0f) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            float *o = pp->o + r * pp->Dv;
            for (int64_t e = 0; e < pp->Dv; e += 16) _mm512_storeu_ps(o + e, _mm512_mul_ps(_mm512_loadu_ps(o + e), a));
        }
}

AMX int npattn_amx_prefill_tiles_bf16(const uint16_t *qa, int64_t D, const uint32_t *kb, const uint32_t *vp,
                                      int64_t ldv, int64_t Dv, const struct npattn_score_tile *t, float *m, float *l,
                                      float *alpha, float *o, void *scratch) {
    const int64_t M = t->M, nk = t->nk, np = (nk + 1) / 2, n16 = (np + 15) / 16 * 16;
    struct pipe pp = {.qa = (const char *)qa, .lda = 2 * D, .D = D, .ks = D / 32, .nkb = (nk + 31) / 32, .kb = kb,
                      .vp = vp, .ldv = ldv, .Dv = Dv, .ncb = (Dv + 31) / 32, .nps = n16 / 16, .o = o, .M = M,
                      .nblk = (M + PIPE_ROWS - 1) / PIPE_ROWS, .sld = NPATTN_STEP_KEYS + 16,
                      .pld = NPATTN_STEP_KEYS / 2 + 16};
    float *s = scratch;
    pp.s[0] = s, pp.s[1] = s + PIPE_ROWS * pp.sld;
    pp.pa[0] = (uint32_t *)(s + 2 * PIPE_ROWS * pp.sld), pp.pa[1] = pp.pa[0] + PIPE_ROWS * pp.pld;
    uint32_t *vlast = pp.pa[1] + PIPE_ROWS * pp.pld; /* 16 rows of ldv */
    if (np % 16) { /* V's last pairs past the tile's: zeros (the weights' 0 against them must not meet a NaN) */
        const int64_t p0 = n16 - 16;
        memcpy(vlast, vp + p0 * ldv, (size_t)((np - p0) * ldv) * sizeof *vp);
        memset(vlast + (np - p0) * ldv, 0, (size_t)((n16 - np) * ldv) * sizeof *vp);
        pp.vlast = vlast;
    }
    /* the rows of P past M in the last block: zeros */
    const int64_t last = M - PIPE_ROWS * (pp.nblk - 1), pad = (last + 15) / 16 * 16;
    if (last < pad) memset(pp.pa[(pp.nblk - 1) % 2] + last * pp.pld, 0, (size_t)((pad - last) * pp.pld) * 4);
    const struct vec_tile c = vec_tile_of(t);
    const int range = !t->bias && t->softcap <= 0 && t->scale > 0; /* plain, or a band's range of keys per row */
    const int64_t us = pp.nkb * pp.ks, up = pp.ncb * pp.nps;
    float mx[PIPE_ROWS], shift[PIPE_ROWS], sum[PIPE_ROWS];
    _tile_loadconfig(&config);
    for (int64_t u = 0; u < us; u++) scores_unit(&pp, 0, u);
    for (int64_t R = 0; R < pp.nblk; R++) {
        const int64_t n_s = R + 1 < pp.nblk ? us : 0, n_p = R > 0 ? up : 0, units = n_s + n_p;
        const int64_t r0 = PIPE_ROWS * R, rows = M - r0 < PIPE_ROWS ? M - r0 : PIPE_ROWS;
        if (R > 0) rescale_block(&pp, R - 1, alpha);
        /* the block's passes, row by row, the units spread over them as
         * their work: a row's pass 2 about PASS2_WORK times its pass 1 */
        const int64_t work = rows * (1 + PASS2_WORK);
        int64_t done = 0, at = 0;
        for (int64_t i = 0; i < 2 * rows; i++) {
            const int second = i >= rows;
            const int64_t row = second ? i - rows : i, r = r0 + row;
            float *srow = pp.s[R % 2] + row * pp.sld;
            int64_t a, b;
            row_keys(t, r, &a, &b);
            if (second) {
                sum[row] = row_pairs(srow, t, range, a, b, shift[row], pp.pa[R % 2] + row * pp.pld, n16);
                if (sum[row] - sum[row] != 0.0f) {
                    _tile_release();
                    return 1;
                }
            } else if (range ? row_max_range(srow, a, b, t->scale, m, r, mx + row, shift + row)
                             : vec_row_max(srow, t->bias ? t->bias + r * t->ld : NULL, t, &c, m, r, mx + row,
                                           shift + row)) {
                _tile_release();
                return 1;
            }
            /* then the units whose share of the work is done: units * at / work of them (issued before
             * the row, they ran 1.08-1.10x slower) */
            for (at += (second ? PASS2_WORK : 1) * units; at >= work; at -= work, done++)
                if (done < n_s) scores_unit(&pp, R + 1, done);
                else pv_unit(&pp, R - 1, done - n_s);
        }
        block_done(m, l, alpha, r0, rows, mx, shift, sum);
    }
    rescale_block(&pp, pp.nblk - 1, alpha);
    for (int64_t u = 0; u < up; u++) pv_unit(&pp, pp.nblk - 1, u);
    _tile_release();
    return 0;
}
#endif

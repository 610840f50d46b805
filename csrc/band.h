/* band.h: which keys a query row may see, from positions alone: the causal
 * rule and the window, written once as a band of diagonals (as
 * flash-attention's mask.h writes causal and local attention).
 *
 * Query row i sits at position q_offset + i, key row j at k_offset + j. With
 * diag = q_offset - k_offset, row i sees keys
 *
 *     i + lo_diag <= j <= i + hi_diag
 *
 * where hi_diag = diag + right and lo_diag = diag - left, right being
 * window_right (unbounded without a window), at most 0 when causal, and
 * left window_left (unbounded without one). Causal is the band (-inf, 0].
 * With per-request key ranges (k_start) key row j sits at
 * k_offset + j - k_start[b], so request b's diag is
 * q_offset[b] - k_offset + k_start[b] (npattn_band_for).
 * diag +- a window side may pass int64 (offsets are any int64), so each edge
 * is computed exactly and then clamped to [-L, S]: for rows in [0, L) and
 * keys in [0, S), j - i lies in (-L, S), and an edge beyond it decides every
 * pair as the exact one does. Any int64 offsets are safe.
 */
#ifndef NPATTN_BAND_H
#define NPATTN_BAND_H

#include <stdint.h>

#include "attention.h"

struct npattn_band {
    int64_t lo_diag, hi_diag; /* INT64_MIN / INT64_MAX: unbounded on that side */
};

static inline int64_t npattn_sat_add(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) return b > 0 ? INT64_MAX : INT64_MIN;
    return r;
}

static inline int64_t npattn_sat_sub(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
    return r;
}

/* a - b + c + d, exactly, clamped to [lo, hi]. Each int64 step that
 * overflows wraps by 2^64 (in the direction of its sign, counted in
 * `wraps`); the exact value is the wrapped one plus wraps * 2^64, beyond
 * int64 unless the wraps cancel. */
static inline int64_t npattn_band_edge(int64_t a, int64_t b, int64_t c, int64_t d, int64_t lo, int64_t hi) {
    int64_t x, y, z;
    int wraps = 0;
    if (__builtin_sub_overflow(a, b, &x)) wraps += a >= 0 ? 1 : -1;
    if (__builtin_add_overflow(x, c, &y)) wraps += c > 0 ? 1 : -1;
    if (__builtin_add_overflow(y, d, &z)) wraps += d > 0 ? 1 : -1;
    if (wraps > 0 || (wraps == 0 && z > hi)) return hi;
    if (wraps < 0 || z < lo) return lo;
    return z;
}

/* The band of one request whose query row 0 sits at q_offset and whose key
 * row k_start at k_offset (key row j at k_offset + j - k_start): the
 * diagonal is q_offset - k_offset + k_start. */
static inline struct npattn_band npattn_band_for(const struct npattn_problem *p, int64_t q_offset, int64_t k_start) {
    struct npattn_band b = {INT64_MIN, INT64_MAX};
    const int64_t L = p->n_query, S = p->n_key;
    int64_t right = p->window_right;
    if (p->causal && (right == NPATTN_UNBOUNDED || right > 0)) right = 0;
    if (right != NPATTN_UNBOUNDED) b.hi_diag = npattn_band_edge(q_offset, p->k_offset, k_start, right, -L, S);
    if (p->window_left != NPATTN_UNBOUNDED)
        b.lo_diag = npattn_band_edge(q_offset, p->k_offset, k_start, -p->window_left, -L, S);
    return b;
}

/* The band of a problem without per-request ranges or offsets. */
static inline struct npattn_band npattn_band_of(const struct npattn_problem *p) {
    int64_t q_offset, k_start, k_length;
    npattn_request_positions(p, -1, &q_offset, &k_start, &k_length);
    return npattn_band_for(p, q_offset, 0);
}

/* Request b's band (the problem's, `common`, when no request has its own
 * range or offset), and the key rows [*k0, *k1) it reads. */
static inline struct npattn_band npattn_band_request(const struct npattn_problem *p, const struct npattn_band *common,
                                                     int64_t b, int64_t *k0, int64_t *k1) {
    if (!p->k_start && !p->k_length && !p->q_offsets) {
        *k0 = 0, *k1 = p->n_key;
        return *common;
    }
    int64_t q_offset, k_length;
    npattn_request_positions(p, b, &q_offset, k0, &k_length);
    *k1 = *k0 + k_length;
    return npattn_band_for(p, q_offset, *k0);
}

/* The first and the last key row i may see (may lie outside [0, S)). */
static inline int64_t npattn_band_lo(const struct npattn_band *b, int64_t i) {
    return b->lo_diag == INT64_MIN ? INT64_MIN : npattn_sat_add(i, b->lo_diag);
}
static inline int64_t npattn_band_hi(const struct npattn_band *b, int64_t i) {
    return b->hi_diag == INT64_MAX ? INT64_MAX : npattn_sat_add(i, b->hi_diag);
}

/* Keys [*j0, *j1) that some row of [i0, i1) may see, within [0, S); empty
 * (*j0 == *j1) when none. The band moves right with i, so the first row
 * bounds it on the left and the last on the right. */
static inline void npattn_band_keys(const struct npattn_band *b, int64_t i0, int64_t i1, int64_t S, int64_t *j0,
                                    int64_t *j1) {
    int64_t lo = npattn_band_lo(b, i0), hi = npattn_band_hi(b, i1 - 1);
    lo = lo < 0 ? 0 : lo;
    hi = hi >= S ? S - 1 : hi;
    *j0 = lo > hi ? 0 : lo;
    *j1 = lo > hi ? 0 : hi + 1;
}

/* Query rows [*i0, *i1) that may see some key of [j0, j1), within [0, L). */
static inline void npattn_band_rows(const struct npattn_band *b, int64_t j0, int64_t j1, int64_t L, int64_t *i0,
                                    int64_t *i1) {
    /* row i sees key j only if j <= i + hi_diag and i + lo_diag <= j */
    int64_t first = b->hi_diag == INT64_MAX ? 0 : npattn_sat_sub(j0, b->hi_diag);
    int64_t last = b->lo_diag == INT64_MIN ? L - 1 : npattn_sat_sub(j1 - 1, b->lo_diag);
    first = first < 0 ? 0 : first;
    last = last >= L ? L - 1 : last;
    *i0 = first > last ? 0 : first;
    *i1 = first > last ? 0 : last + 1;
}

/* Whether every row of [i0, i1) sees every key of [j0, j1). */
static inline int npattn_band_covers(const struct npattn_band *b, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    return npattn_band_lo(b, i1 - 1) <= j0 && npattn_band_hi(b, i0) >= j1 - 1;
}

/* Row i's visible keys of the tile [j0, j0 + nk), as tile indices: lo .. hi,
 * clipped to [0, nk] and [-1, nk - 1] so that they fit an int32. */
static inline void npattn_band_tile(const struct npattn_band *b, int64_t i, int64_t j0, int64_t nk, int32_t *lo,
                                    int32_t *hi) {
    int64_t l = npattn_sat_sub(npattn_band_lo(b, i), j0), h = npattn_sat_sub(npattn_band_hi(b, i), j0);
    *lo = (int32_t)(l < 0 ? 0 : l > nk ? nk : l);
    *hi = (int32_t)(h < -1 ? -1 : h > nk - 1 ? nk - 1 : h);
}

/* For stacked rows r = 0 .. M-1 (query i0 + r % nq) against the key tile
 * [j0, j0 + nk): 0 if the band lets every row see every key, else 1 with
 * each row's visible tile keys in lo[r] .. hi[r]. */
static inline int npattn_band_clip(const struct npattn_band *b, int64_t i0, int64_t nq, int64_t M, int64_t j0,
                                   int64_t nk, int32_t *lo, int32_t *hi) {
    if (npattn_band_covers(b, i0, i0 + nq, j0, j0 + nk)) return 0;
    for (int64_t r = 0; r < M; r++) npattn_band_tile(b, i0 + r % nq, j0, nk, lo + r, hi + r);
    return 1;
}

#endif /* NPATTN_BAND_H */

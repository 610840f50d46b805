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
 * All arithmetic saturates, so any int64 offsets are safe.
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

static inline struct npattn_band npattn_band_of(const struct npattn_problem *p) {
    int64_t diag = npattn_sat_sub(p->q_offset, p->k_offset);
    struct npattn_band b = {INT64_MIN, INT64_MAX};
    int64_t right = p->window_right;
    if (p->causal && (right == NPATTN_UNBOUNDED || right > 0)) right = 0;
    if (right != NPATTN_UNBOUNDED) b.hi_diag = npattn_sat_add(diag, right);
    if (p->window_left != NPATTN_UNBOUNDED) b.lo_diag = npattn_sat_sub(diag, p->window_left);
    return b;
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

#endif /* NPATTN_BAND_H */

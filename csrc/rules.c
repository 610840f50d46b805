/* rules.c: the rules of attention.h, checked once for every caller: one
 * status per rule, each with its sentence in one table, and a verdict that
 * names the operand which breaks it (as BLIS's bli_error.c). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- the statuses and their sentences ---- */

static const char *const sentences[NPATTN_STATUS_COUNT] = {
    [NPATTN_STATUS_OK] = "success",
    [NPATTN_STATUS_NO_MEMORY] = "could not allocate scratch memory",
    [NPATTN_STATUS_CANCELLED] = "the call was cancelled",
    [NPATTN_STATUS_BLAS_WRONG] = "the BLAS library computes wrong matrix products on this CPU",
    [NPATTN_STATUS_NO_PROBLEM] = "the problem is NULL",
    [NPATTN_STATUS_BAD_BATCH] = "n_batch_dim and every batch size must be at least 0, with a batch_shape",
    [NPATTN_STATUS_BATCH_OVERFLOW] = "the batch sizes multiply beyond int64",
    [NPATTN_STATUS_NO_KV_HEAD] = "n_head_kv must be at least 1",
    [NPATTN_STATUS_HEADS_NOT_MULTIPLE] = "n_head_q must be a multiple of n_head_kv, at least 0",
    [NPATTN_STATUS_NEGATIVE_SIZE] = "n_query, n_key and n_embd_v must be at least 0",
    [NPATTN_STATUS_NO_WIDTH] = "n_embd_k (D) must be at least 1",
    [NPATTN_STATUS_TOO_LARGE] = "D or D_v exceeds what one BLAS call can take (INT_MAX)",
    [NPATTN_STATUS_BAD_SCALE] = "scale must be finite",
    [NPATTN_STATUS_BAD_SOFTCAP] = "softcap must be finite and at least 0 (0: none)",
    [NPATTN_STATUS_BAD_WINDOW] = "window_left and window_right must be at least 0, or NPATTN_UNBOUNDED",
    [NPATTN_STATUS_BAD_MASK_KIND] = "mask_kind must be one of enum npattn_mask_kind",
    [NPATTN_STATUS_BAD_THREADS] = "n_threads must be from 0 to NPATTN_MAX_THREADS",
    [NPATTN_STATUS_BAD_THREADS_ENV] = "NPATTN_NUM_THREADS, where set, must be an int from 1 to NPATTN_MAX_THREADS",
    [NPATTN_STATUS_BAD_DTYPE] = "an operand's dtype must be one of enum npattn_dtype",
    [NPATTN_STATUS_NOT_WIDE] = "lse, dq, dk and dv must be F32 or F64",
    [NPATTN_STATUS_NO_STRIDES] = "an operand with batch dims needs a batch_stride",
    [NPATTN_STATUS_OUT_OF_RANGE] = "an operand's elements must lie within int64 bytes of its data",
    [NPATTN_STATUS_NO_DATA] = "an operand that is read or written needs data",
    [NPATTN_STATUS_OVERLAPS_ITSELF] = "an output must not overlap itself",
    [NPATTN_STATUS_OVERLAPS] = "an output must share no byte with another operand",
    [NPATTN_STATUS_BAD_K_START] = "every k_start[b] must lie in [0, S]",
    [NPATTN_STATUS_BAD_K_LENGTH] = "every k_length[b] must be at least 0, with k_start[b] + k_length[b] at most S",
    [NPATTN_STATUS_BAD_PAGES] = "paged K/V needs a block table, page_size >= 1, S = max_pages * page_size, table_stride >= 0, no k_start",
    [NPATTN_STATUS_BAD_PAGE] = "every live block_table entry must lie in [0, n_page)",
    [NPATTN_STATUS_BAD_PRECISION] = "precision must be one of enum npattn_precision",
    [NPATTN_STATUS_BAD_Q_OFFSET] = "with q_bottom_right and key ranges, k_offset + k_length[b] - L must fit int64",
    [NPATTN_STATUS_NO_CODE_SCALE] = "k or v of codes needs its scale",
    [NPATTN_STATUS_NOT_CODES] = "a scale or zero point is for k or v of codes, not of floats",
    [NPATTN_STATUS_BAD_GROUPS] = "the codes' n_group must be at least 1 and divide the row width (D, or D_v for v)",
    [NPATTN_STATUS_SYMMETRIC_CODES] = "fp8 codes are symmetric: they take no zero point",
    [NPATTN_STATUS_CODES_NO_GRADIENT] = "there is no gradient through codes: a backward problem's k and v are floats",
};

const char *npattn_status_string(enum npattn_status status) {
    return status >= 0 && status < NPATTN_STATUS_COUNT && sentences[status] ? sentences[status] : "unknown status";
}

static const char *const operand_names[NPATTN_OPERAND_COUNT] = {
    [NPATTN_OPERAND_NONE] = "",     [NPATTN_OPERAND_Q] = "q",        [NPATTN_OPERAND_K] = "k",
    [NPATTN_OPERAND_V] = "v",       [NPATTN_OPERAND_MASK] = "mask",  [NPATTN_OPERAND_SINKS] = "sinks",
    [NPATTN_OPERAND_OUT] = "out",   [NPATTN_OPERAND_LSE] = "lse",    [NPATTN_OPERAND_WEIGHTS] = "weights",
    [NPATTN_OPERAND_DOUT] = "dout", [NPATTN_OPERAND_DQ] = "dq",      [NPATTN_OPERAND_DK] = "dk",
    [NPATTN_OPERAND_DV] = "dv",     [NPATTN_OPERAND_DSINKS] = "dsinks", [NPATTN_OPERAND_K_SCALE] = "k_scale",
    [NPATTN_OPERAND_K_ZERO] = "k_zero", [NPATTN_OPERAND_V_SCALE] = "v_scale", [NPATTN_OPERAND_V_ZERO] = "v_zero",
};

const char *npattn_operand_name(enum npattn_operand operand) {
    return operand >= 0 && operand < NPATTN_OPERAND_COUNT ? operand_names[operand] : "";
}

/* A verdict: the rule broken, and by which operand(s). */
static enum npattn_status refuse(struct npattn_verdict *why, enum npattn_status status, enum npattn_operand operand,
                                 enum npattn_operand other) {
    why->status = status, why->operand = operand, why->other = other;
    return status;
}

/* A verdict on request b's key range or position. */
static enum npattn_status refuse_request(struct npattn_verdict *why, enum npattn_status status, int64_t b) {
    refuse(why, status, NPATTN_OPERAND_NONE, NPATTN_OPERAND_NONE);
    why->entry = b;
    return status;
}

void npattn_request_positions(const struct npattn_problem *p, int64_t b, int64_t *q_offset, int64_t *k_start,
                              int64_t *k_length) {
    const int ranges = b >= 0 && (p->k_start || p->k_length);
    *k_start = b >= 0 && p->k_start ? p->k_start[b] : 0;
    *k_length = b >= 0 && p->k_length ? p->k_length[b] : p->n_key - *k_start;
    if (!p->q_bottom_right) *q_offset = b >= 0 && p->q_offsets ? p->q_offsets[b] : p->q_offset;
    else if (ranges) *q_offset = p->k_offset + *k_length - p->n_query; /* the bottom-right corner of its own keys */
    else *q_offset = p->n_key - p->n_query;                             /* of all S keys, whatever k_offset */
}

/* ---- extents and overlaps ---- */

/* The byte range [lo, hi] a tensor's elements span. */
struct extent {
    int64_t lo, hi;
    int empty;
};

/* 0 if the span overflows int64. */
static int span(int64_t n, int64_t stride, struct extent *e) {
    int64_t reach;
    if (n <= 1) return 1;
    if (__builtin_mul_overflow(n - 1, stride, &reach)) return 0;
    return !__builtin_add_overflow(reach > 0 ? e->hi : e->lo, reach, reach > 0 ? &e->hi : &e->lo);
}

static int extent_rest(const struct npattn_tensor *t, const int64_t dims[3], int64_t size, struct extent *e);

/* The extent of t over the batch shape and (heads, rows, cols) = dims, with
 * elements of `size` bytes; 0 if it overflows int64. */
static int extent_of(const struct npattn_problem *p, const struct npattn_tensor *t, const int64_t dims[3],
                     int64_t size, struct extent *e) {
    e->lo = e->hi = 0;
    e->empty = 0;
    for (int32_t d = 0; d < p->n_batch_dim; d++) e->empty |= p->batch_shape[d] == 0;
    for (int i = 0; i < 3; i++) e->empty |= dims[i] == 0;
    if (e->empty) return 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++)
        if (!span(p->batch_shape[d], t->batch_stride[d], e)) return 0;
    return extent_rest(t, dims, size, e);
}

/* The extent of a page store (k or v of a paged problem): n_page pages of
 * (heads, page_size, cols), `page_stride` apart. */
static int page_extent_of(const struct npattn_tensor *t, int64_t n_page, int64_t page_stride, const int64_t dims[3],
                          int64_t size, struct extent *e) {
    e->lo = e->hi = 0;
    e->empty = n_page == 0 || dims[0] == 0 || dims[1] == 0 || dims[2] == 0;
    if (e->empty) return 1;
    if (!span(n_page, page_stride, e)) return 0;
    return extent_rest(t, dims, size, e);
}

/* The extent's (heads, rows, cols) spans, in bytes; 0 if it overflows int64. */
static int extent_rest(const struct npattn_tensor *t, const int64_t dims[3], int64_t size, struct extent *e) {
    const int64_t strides[3] = {t->head_stride, t->row_stride, t->col_stride};
    for (int i = 0; i < 3; i++)
        if (!span(dims[i], strides[i], e)) return 0;
    if (__builtin_mul_overflow(e->lo, size, &e->lo) || __builtin_mul_overflow(e->hi, size, &e->hi) ||
        __builtin_add_overflow(e->hi, size - 1, &e->hi))
        return 0;
    return 1;
}

/* Whether two tensors' byte ranges meet. */
static int meet(const void *a, const struct extent *ea, const void *b, const struct extent *eb) {
    if (ea->empty || eb->empty) return 0;
    intptr_t a0 = (intptr_t)a + (intptr_t)ea->lo, a1 = (intptr_t)a + (intptr_t)ea->hi;
    intptr_t b0 = (intptr_t)b + (intptr_t)eb->lo, b1 = (intptr_t)b + (intptr_t)eb->hi;
    return a0 <= b1 && b0 <= a1;
}

/* Whether distinct indices of t can reach the same element: with the axes
 * sorted by stride, each must step past everything the smaller ones span.
 * With `sums` (a gradient) a batch axis of stride 0 is summed over, not an
 * overlap. */
static int overlaps_itself(const struct npattn_problem *p, const struct npattn_tensor *t, const int64_t dims[3],
                           int sums) {
    int64_t n[3 + 64], s[3 + 64];
    int k = 0;
    if (p->n_batch_dim > 64) return 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) {
        if (p->batch_shape[d] == 0) return 0;
        if (p->batch_shape[d] > 1 && !(sums && t->batch_stride[d] == 0))
            n[k] = p->batch_shape[d], s[k++] = llabs(t->batch_stride[d]);
    }
    const int64_t strides[3] = {t->head_stride, t->row_stride, t->col_stride};
    for (int i = 0; i < 3; i++) {
        if (dims[i] == 0) return 0;
        if (dims[i] > 1) n[k] = dims[i], s[k++] = llabs(strides[i]);
    }
    for (int i = 1; i < k; i++) /* insertion sort by stride */
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            int64_t tn = n[j], ts = s[j];
            n[j] = n[j - 1], s[j] = s[j - 1], n[j - 1] = tn, s[j - 1] = ts;
        }
    int64_t reach = 0; /* the farthest element the smaller axes reach */
    for (int i = 0; i < k; i++) {
        if (s[i] <= reach) return 1;
        reach += s[i] * (n[i] - 1);
    }
    return 0;
}

static int dtype_ok(enum npattn_dtype t) { return t >= NPATTN_DTYPE_F32 && t <= NPATTN_DTYPE_BF16; }
static int wide_ok(enum npattn_dtype t) { return t == NPATTN_DTYPE_F32 || t == NPATTN_DTYPE_F64; }
static int scale_ok(enum npattn_dtype t) { return t == NPATTN_DTYPE_F32 || t == NPATTN_DTYPE_F16 || t == NPATTN_DTYPE_BF16; }
static int kv_ok(enum npattn_dtype t) { return dtype_ok(t) || npattn_is_code(t); }

/* ---- the operand table ---- */

/* One operand of a problem, as the checks see it; a table is indexed by
 * enum npattn_operand. */
struct operand {
    const struct npattn_tensor *t; /* NULL: the sinks or dsinks (plain arrays of doubles) */
    const void *data;
    int given;                     /* read or written in this problem */
    int output;
    int64_t dims[3];               /* heads, rows, cols */
    int64_t size;                  /* bytes per element */
    struct extent e;
    int paged;                     /* with pages: held in pages, page_stride elements apart */
    int64_t page_stride;
};

#define N_ALL NPATTN_OPERAND_COUNT

static void put(struct operand *ops, enum npattn_operand at, const struct npattn_tensor *t, const void *data,
                int given, int output, int64_t heads, int64_t rows, int64_t cols, int64_t size) {
    struct operand o = {t, data, given, output, {heads, rows, cols}, size, {0, 0, 0}, 0, 0};
    ops[at] = o;
}

/* A paged operand: k, v, or their scales and zero points. */
static void put_paged(struct operand *ops, enum npattn_operand at, int64_t page_stride) {
    ops[at].paged = 1;
    ops[at].page_stride = page_stride;
}

/* The rules every operand table keeps: batch strides, extents that fit int64,
 * data where something is read or written, and outputs that overlap neither
 * themselves, another output, nor an input. */
static enum npattn_status check_operands(const struct npattn_problem *p, struct operand *ops, int n, int empty,
                                         struct npattn_verdict *why) {
    for (int i = 1; i < n; i++) {
        struct operand *o = &ops[i];
        if (!o->given) continue;
        if (!o->t) {
            o->e.lo = 0, o->e.hi = o->size * o->dims[0] - 1, o->e.empty = o->dims[0] == 0;
            continue;
        }
        const struct npattn_pages *pg = p->pages;
        if (pg && o->paged) {
            const int64_t dims[3] = {o->dims[0], pg->page_size, o->dims[2]};
            if (!page_extent_of(o->t, pg->n_page, o->page_stride, dims, o->size, &o->e))
                return refuse(why, NPATTN_STATUS_OUT_OF_RANGE, i, 0);
            continue;
        }
        if (p->n_batch_dim > 0 && !o->t->batch_stride) return refuse(why, NPATTN_STATUS_NO_STRIDES, i, 0);
        if (!extent_of(p, o->t, o->dims, o->size, &o->e)) return refuse(why, NPATTN_STATUS_OUT_OF_RANGE, i, 0);
    }
    if (empty) return NPATTN_STATUS_OK; /* nothing is read or written */
    for (int i = 1; i < n; i++)
        if (ops[i].given && !ops[i].e.empty && !ops[i].data) return refuse(why, NPATTN_STATUS_NO_DATA, i, 0);
    if (p->n_embd_k > INT_MAX) return refuse(why, NPATTN_STATUS_TOO_LARGE, NPATTN_OPERAND_Q, 0);
    if (p->n_embd_v > INT_MAX) return refuse(why, NPATTN_STATUS_TOO_LARGE, NPATTN_OPERAND_V, 0);
    for (int i = 1; i < n; i++) {
        const struct operand *o = &ops[i];
        if (!o->given || !o->output) continue;
        const int sums = i == NPATTN_OPERAND_DQ || i == NPATTN_OPERAND_DK || i == NPATTN_OPERAND_DV;
        if (o->t && overlaps_itself(p, o->t, o->dims, sums)) return refuse(why, NPATTN_STATUS_OVERLAPS_ITSELF, i, 0);
        for (int j = 1; j < n; j++)
            if (j != i && ops[j].given && meet(o->data, &o->e, ops[j].data, &ops[j].e))
                return refuse(why, NPATTN_STATUS_OVERLAPS, i, j);
    }
    return NPATTN_STATUS_OK;
}

/* The rules of k's (or v's) codes (t), whose rows are `width` wide: a
 * scale where t holds codes, of F32, F16 or BF16, with n_group dividing
 * width; a zero point only for int8 and uint8 codes; neither for floats.
 * `scale` names the scale's operand, the zero point's the one after it. */
static enum npattn_status codes_rules(const struct npattn_tensor *t, const struct npattn_codes *c, int64_t width,
                                      enum npattn_operand scale, struct npattn_verdict *why) {
    const enum npattn_operand zero = scale + 1, none = NPATTN_OPERAND_NONE;
    if (!npattn_is_code(t->dtype)) {
        if (c->scale.data) return refuse(why, NPATTN_STATUS_NOT_CODES, scale, none);
        if (c->zero.data) return refuse(why, NPATTN_STATUS_NOT_CODES, zero, none);
        return NPATTN_STATUS_OK;
    }
    if (!c->scale.data) return refuse(why, NPATTN_STATUS_NO_CODE_SCALE, scale, none);
    if (!scale_ok(c->scale.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, scale, none);
    if (c->zero.data && !scale_ok(c->zero.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, zero, none);
    if (c->n_group < 1 || width % c->n_group != 0) return refuse(why, NPATTN_STATUS_BAD_GROUPS, scale, none);
    if (c->zero.data && t->dtype != NPATTN_DTYPE_I8 && t->dtype != NPATTN_DTYPE_U8)
        return refuse(why, NPATTN_STATUS_SYMMETRIC_CODES, zero, none);
    return NPATTN_STATUS_OK;
}

/* The scalar rules of a problem, and its forward operands (ops[1 .. N_ALL);
 * the backward's own not given). */
static enum npattn_status problem_operands(const struct npattn_problem *p, struct operand *ops, int *empty,
                                           struct npattn_verdict *why) {
    const enum npattn_operand none = NPATTN_OPERAND_NONE;
    if (!p) return refuse(why, NPATTN_STATUS_NO_PROBLEM, none, none);
    if (p->n_batch_dim < 0 || (p->n_batch_dim > 0 && !p->batch_shape)) return refuse(why, NPATTN_STATUS_BAD_BATCH, none, none);
    int64_t n_batch = 1;
    for (int32_t d = 0; d < p->n_batch_dim; d++) {
        if (p->batch_shape[d] < 0) return refuse(why, NPATTN_STATUS_BAD_BATCH, none, none);
        if (__builtin_mul_overflow(n_batch, p->batch_shape[d], &n_batch))
            return refuse(why, NPATTN_STATUS_BATCH_OVERFLOW, none, none);
    }
    if (p->n_head_kv < 1) return refuse(why, NPATTN_STATUS_NO_KV_HEAD, NPATTN_OPERAND_K, none);
    if (p->n_head_q < 0 || p->n_head_q % p->n_head_kv != 0)
        return refuse(why, NPATTN_STATUS_HEADS_NOT_MULTIPLE, NPATTN_OPERAND_Q, NPATTN_OPERAND_K);
    if (p->n_query < 0 || p->n_key < 0 || p->n_embd_v < 0) return refuse(why, NPATTN_STATUS_NEGATIVE_SIZE, none, none);
    if (p->n_embd_k < 1) return refuse(why, NPATTN_STATUS_NO_WIDTH, NPATTN_OPERAND_Q, NPATTN_OPERAND_K);
    if (!isfinite(p->scale)) return refuse(why, NPATTN_STATUS_BAD_SCALE, none, none);
    if (!(p->softcap >= 0) || !isfinite(p->softcap)) return refuse(why, NPATTN_STATUS_BAD_SOFTCAP, none, none);
    if (p->window_left < NPATTN_UNBOUNDED || p->window_right < NPATTN_UNBOUNDED)
        return refuse(why, NPATTN_STATUS_BAD_WINDOW, none, none);
    if (p->mask_kind < NPATTN_MASK_NONE || p->mask_kind > NPATTN_MASK_ADD)
        return refuse(why, NPATTN_STATUS_BAD_MASK_KIND, NPATTN_OPERAND_MASK, none);
    if (p->n_threads < 0 || p->n_threads > NPATTN_MAX_THREADS) return refuse(why, NPATTN_STATUS_BAD_THREADS, none, none);
    if (p->n_threads == 0 && npattn_env_threads() < 0) return refuse(why, NPATTN_STATUS_BAD_THREADS_ENV, none, none);
    if (p->precision != NPATTN_PRECISION_HIGHEST && p->precision != NPATTN_PRECISION_FAST)
        return refuse(why, NPATTN_STATUS_BAD_PRECISION, none, none);
    const struct npattn_pages *pg = p->pages;
    if (pg) { /* before the key ranges, which S = max_pages * page_size bounds */
        int64_t S;
        if (!pg->block_table || pg->page_size < 1 || pg->n_page < 0 || pg->max_pages < 0 || pg->table_stride < 0 ||
            p->k_start ||
            __builtin_mul_overflow(pg->max_pages, pg->page_size, &S) || S != p->n_key)
            return refuse(why, NPATTN_STATUS_BAD_PAGES, none, none);
    }
    for (int64_t b = 0; b < n_batch && (p->k_start || p->k_length); b++) {
        const int64_t start = p->k_start ? p->k_start[b] : 0;
        int64_t at;
        if (start < 0 || start > p->n_key) return refuse_request(why, NPATTN_STATUS_BAD_K_START, b);
        if (p->k_length && (p->k_length[b] < 0 || p->k_length[b] > p->n_key - start))
            return refuse_request(why, NPATTN_STATUS_BAD_K_LENGTH, b);
        const int64_t length = p->k_length ? p->k_length[b] : p->n_key - start;
        if (p->q_bottom_right && __builtin_add_overflow(p->k_offset, length - p->n_query, &at))
            return refuse_request(why, NPATTN_STATUS_BAD_Q_OFFSET, b);
    }
    if (pg) {
        for (int64_t b = 0; b < n_batch; b++) {
            /* the pages that hold rows below k_length[b] */
            const int64_t live = p->k_length ? (p->k_length[b] + pg->page_size - 1) / pg->page_size : pg->max_pages;
            const int64_t *row = npattn_table_row(pg, b);
            for (int64_t i = 0; i < live; i++) {
                const int64_t page = row[i];
                if (page < 0 || page >= pg->n_page) {
                    refuse(why, NPATTN_STATUS_BAD_PAGE, NPATTN_OPERAND_NONE, none);
                    why->entry = b * pg->max_pages + i;
                    return NPATTN_STATUS_BAD_PAGE;
                }
            }
        }
    }
    const int has_mask = p->mask_kind != NPATTN_MASK_NONE, has_out = p->n_embd_v > 0;
    const int has_lse = p->lse.data != NULL, has_w = p->weights.data != NULL;
    if (!dtype_ok(p->q.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_Q, none);
    if (!kv_ok(p->k.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_K, none);
    if (has_out && !kv_ok(p->v.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_V, none);
    enum npattn_status status = codes_rules(&p->k, &p->k_codes, p->n_embd_k, NPATTN_OPERAND_K_SCALE, why);
    if (status == NPATTN_STATUS_OK && has_out)
        status = codes_rules(&p->v, &p->v_codes, p->n_embd_v, NPATTN_OPERAND_V_SCALE, why);
    if (status != NPATTN_STATUS_OK) return status;
    if (has_out && !dtype_ok(p->out.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_OUT, none);
    if (p->mask_kind == NPATTN_MASK_ADD && !dtype_ok(p->mask.dtype))
        return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_MASK, none);
    if (has_w && !dtype_ok(p->weights.dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, NPATTN_OPERAND_WEIGHTS, none);
    if (has_lse && !wide_ok(p->lse.dtype)) return refuse(why, NPATTN_STATUS_NOT_WIDE, NPATTN_OPERAND_LSE, none);
    const int64_t H_q = p->n_head_q, H_kv = p->n_head_kv, L = p->n_query, S = p->n_key, D = p->n_embd_k,
                  Dv = p->n_embd_v;
#define SIZE(t) ((int64_t)npattn_dtype_size((t).dtype))
    put(ops, NPATTN_OPERAND_Q, &p->q, p->q.data, 1, 0, H_q, L, D, SIZE(p->q));
    put(ops, NPATTN_OPERAND_K, &p->k, p->k.data, 1, 0, H_kv, S, D, SIZE(p->k));
    put(ops, NPATTN_OPERAND_V, &p->v, p->v.data, has_out, 0, H_kv, S, Dv, SIZE(p->v));
    put(ops, NPATTN_OPERAND_MASK, &p->mask, p->mask.data, has_mask, 0, H_q, L, S, npattn_mask_size(p));
    put(ops, NPATTN_OPERAND_SINKS, NULL, p->sinks, p->sinks != NULL, 0, H_q, 1, 1, (int64_t)sizeof(double));
    put(ops, NPATTN_OPERAND_OUT, &p->out, p->out.data, has_out, 1, H_q, L, Dv, SIZE(p->out));
    put(ops, NPATTN_OPERAND_LSE, &p->lse, p->lse.data, has_lse, 1, H_q, L, 1, SIZE(p->lse));
    put(ops, NPATTN_OPERAND_WEIGHTS, &p->weights, p->weights.data, has_w, 1, H_q, L, S, SIZE(p->weights));
    const struct npattn_codes *codes[2] = {&p->k_codes, &p->v_codes};
    for (int i = 0; i < 2; i++) { /* the scales and zero points of codes: (*B, H_kv, S, n_group) */
        const struct npattn_codes *c = codes[i];
        const int given = npattn_is_code(i ? p->v.dtype : p->k.dtype) && (i == 0 || has_out);
        const enum npattn_operand at = i ? NPATTN_OPERAND_V_SCALE : NPATTN_OPERAND_K_SCALE;
        put(ops, at, &c->scale, c->scale.data, given, 0, H_kv, S, c->n_group, SIZE(c->scale));
        put(ops, at + 1, &c->zero, c->zero.data, given && c->zero.data, 0, H_kv, S, c->n_group, SIZE(c->zero));
        if (pg) put_paged(ops, at, c->scale_page_stride), put_paged(ops, at + 1, c->zero_page_stride);
    }
    if (pg) put_paged(ops, NPATTN_OPERAND_K, pg->k_page_stride), put_paged(ops, NPATTN_OPERAND_V, pg->v_page_stride);
#undef SIZE
    *empty = n_batch == 0 || H_q == 0 || L == 0;
    return NPATTN_STATUS_OK;
}

enum npattn_status npattn_check(const struct npattn_problem *p, struct npattn_verdict *why) {
    struct npattn_verdict ignored;
    struct operand ops[N_ALL];
    int empty;
    if (!why) why = &ignored;
    why->status = NPATTN_STATUS_OK, why->operand = why->other = NPATTN_OPERAND_NONE, why->entry = -1;
    memset(ops, 0, sizeof ops);
    enum npattn_status status = problem_operands(p, ops, &empty, why);
    return status != NPATTN_STATUS_OK ? status : check_operands(p, ops, N_ALL, empty, why);
}

enum npattn_status npattn_check_backward(const struct npattn_backward_problem *bp, struct npattn_verdict *why) {
    struct npattn_verdict ignored;
    struct operand ops[N_ALL];
    int empty;
    if (!why) why = &ignored;
    why->status = NPATTN_STATUS_OK, why->operand = why->other = NPATTN_OPERAND_NONE, why->entry = -1;
    if (!bp) return refuse(why, NPATTN_STATUS_NO_PROBLEM, NPATTN_OPERAND_NONE, NPATTN_OPERAND_NONE);
    const struct npattn_problem *p = &bp->fwd;
    if (p->pages) return refuse(why, NPATTN_STATUS_BAD_PAGES, NPATTN_OPERAND_NONE, NPATTN_OPERAND_NONE);
    if (npattn_is_code(p->k.dtype)) return refuse(why, NPATTN_STATUS_CODES_NO_GRADIENT, NPATTN_OPERAND_K, NPATTN_OPERAND_NONE);
    if (npattn_is_code(p->v.dtype)) return refuse(why, NPATTN_STATUS_CODES_NO_GRADIENT, NPATTN_OPERAND_V, NPATTN_OPERAND_NONE);
    memset(ops, 0, sizeof ops);
    enum npattn_status status = problem_operands(p, ops, &empty, why);
    if (status != NPATTN_STATUS_OK) return status;
    /* forward's results are inputs here, the weights are unused */
    ops[NPATTN_OPERAND_OUT].output = ops[NPATTN_OPERAND_LSE].output = 0;
    ops[NPATTN_OPERAND_OUT].given = ops[NPATTN_OPERAND_LSE].given = 1;
    ops[NPATTN_OPERAND_WEIGHTS].given = 0;
    if (!p->lse.data) return refuse(why, NPATTN_STATUS_NO_DATA, NPATTN_OPERAND_LSE, NPATTN_OPERAND_NONE);
    const struct {
        enum npattn_operand at;
        enum npattn_dtype dtype;
        int wide;
    } dtypes[] = {{NPATTN_OPERAND_LSE, p->lse.dtype, 1},   {NPATTN_OPERAND_OUT, p->out.dtype, 0},
                  {NPATTN_OPERAND_V, p->v.dtype, 0},       {NPATTN_OPERAND_DOUT, bp->dout.dtype, 0},
                  {NPATTN_OPERAND_DQ, bp->dq.dtype, 1},    {NPATTN_OPERAND_DK, bp->dk.dtype, 1},
                  {NPATTN_OPERAND_DV, bp->dv.dtype, 1}};
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
        if (!dtype_ok(dtypes[i].dtype)) return refuse(why, NPATTN_STATUS_BAD_DTYPE, dtypes[i].at, NPATTN_OPERAND_NONE);
        if (dtypes[i].wide && !wide_ok(dtypes[i].dtype))
            return refuse(why, NPATTN_STATUS_NOT_WIDE, dtypes[i].at, NPATTN_OPERAND_NONE);
    }
    const int64_t H_q = p->n_head_q, H_kv = p->n_head_kv, L = p->n_query, S = p->n_key, D = p->n_embd_k,
                  Dv = p->n_embd_v;
    const int64_t n_batch = npattn_n_batch(p);
#define SIZE(t) ((int64_t)npattn_dtype_size((t).dtype))
    put(ops, NPATTN_OPERAND_DOUT, &bp->dout, bp->dout.data, 1, 0, H_q, L, Dv, SIZE(bp->dout));
    put(ops, NPATTN_OPERAND_DQ, &bp->dq, bp->dq.data, 1, 1, H_q, L, D, SIZE(bp->dq));
    put(ops, NPATTN_OPERAND_DK, &bp->dk, bp->dk.data, 1, 1, H_kv, S, D, SIZE(bp->dk));
    put(ops, NPATTN_OPERAND_DV, &bp->dv, bp->dv.data, 1, 1, H_kv, S, Dv, SIZE(bp->dv));
    put(ops, NPATTN_OPERAND_DSINKS, NULL, bp->dsinks, p->sinks != NULL, 1, n_batch * H_q, 1, 1, (int64_t)sizeof(double));
#undef SIZE
    /* an empty batch or no query head: nothing is read or written */
    (void)empty;
    return check_operands(p, ops, N_ALL, n_batch == 0 || H_q == 0, why);
}

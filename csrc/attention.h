/* attention.h: npattn's core, scaled dot-product attention with grouped-query
 * attention (GQA), in pure C on OpenBLAS. No Python here.
 *
 *     out = softmax(scale * q @ k^T + mask) @ v      per query head, per row
 *
 * Shape legend (outermost first, as NumPy prints shapes):
 *
 *     q    (*B, H_q,  L, D)       B    batch dims, already broadcast by the caller
 *     k    (*B, H_kv, S, D)       H_q  query heads, a multiple of H_kv
 *     v    (*B, H_kv, S, D_v)     L    query rows, S key rows
 *     out  (*B, H_q,  L, D_v)     D    q/k row width, D_v v/out row width
 *     mask (*B, H_q,  L, S)       read through strides: zero strides broadcast
 *
 * GQA: query head h reads key/value head h / (H_q / H_kv), so each key/value
 * head serves a contiguous group of H_q / H_kv query heads (as MLX, PyTorch,
 * JAX and llama.cpp).
 *
 * Causal masks: NPATTN_MASK_CAUSAL lets query i see key j iff
 * j <= i + (S - L), aligned to the bottom-right corner as MLX does, so that
 * a decode step (L = 1) sees every key. NPATTN_MASK_CAUSAL_TOP_LEFT lets it
 * see j <= i, as PyTorch's is_causal=True.
 *
 * A row that sees no key (every score -inf, no sink) comes out as zeros, never
 * NaN; S = 0 gives such rows. NaN in the inputs propagates to the rows that
 * see it.
 *
 * Strides are in elements and may be negative or zero, except where BLAS reads
 * the operand: k and v need a contiguous last axis and a row stride of at
 * least their row width, at most INT_MAX. q, out and mask are read and written
 * by npattn itself and take any strides.
 *
 * float16 and bfloat16 are computed in float: each tile of q, k and v is
 * converted as it is used, and out is rounded to nearest even.
 *
 * Not supported here: masks in another dtype than the one computed in,
 * dropout, and anything that is not inference.
 *
 * Scratch memory is bounded by the tile sizes times the number of threads,
 * never L * S. The core never aborts, exits or prints; every failure is a
 * status. One call may run while others run in other threads.
 */
#ifndef NPATTN_ATTENTION_H
#define NPATTN_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of q, k, v and out. An additive mask is double for F64 and
 * float otherwise. */
enum npattn_dtype {
    NPATTN_DTYPE_F32,  /* float, through sgemm, float accumulation */
    NPATTN_DTYPE_F64,  /* double, through dgemm */
    NPATTN_DTYPE_F16,  /* IEEE half, converted to float tile by tile */
    NPATTN_DTYPE_BF16, /* bfloat16 (the top half of a float), likewise */
};

enum npattn_mask_kind {
    NPATTN_MASK_NONE,             /* every key visible */
    NPATTN_MASK_CAUSAL,           /* j <= i + (S - L), bottom-right */
    NPATTN_MASK_CAUSAL_TOP_LEFT,  /* j <= i, top-left */
    NPATTN_MASK_BOOL,             /* mask is uint8: nonzero = visible */
    NPATTN_MASK_ADD,              /* mask is float (double for F64); added to the scaled scores */
};

enum npattn_status {
    NPATTN_STATUS_OK = 0,
    NPATTN_STATUS_NO_MEMORY,      /* an allocation failed; nothing leaked */
    NPATTN_STATUS_CANCELLED,      /* the cancel callback asked to stop */
    NPATTN_STATUS_INVALID,        /* the problem breaks a rule of this header */
    NPATTN_STATUS_TOO_LARGE,      /* a size BLAS cannot take in one int */
    NPATTN_STATUS_NO_THREADS,     /* no thread could be started */
};

/* One attention problem. Batch strides are arrays of n_batch_dim entries. */
struct npattn_problem {
    enum npattn_dtype dtype;          /* element type of q, k, v, out; strides count these */

    int32_t n_batch_dim;              /* number of batch dims, may be 0 */
    const int64_t *batch_shape;       /* [n_batch_dim], each >= 0 */
    int64_t n_head_q;                 /* H_q >= 0, a multiple of n_head_kv */
    int64_t n_head_kv;                /* H_kv >= 1 */
    int64_t n_query;                  /* L >= 0 */
    int64_t n_key;                    /* S >= 0 */
    int64_t n_embd_k;                 /* D >= 1, row width of q and k */
    int64_t n_embd_v;                 /* D_v >= 0, row width of v and out */

    const void *q;                    /* q[b..., h, i, d] */
    const int64_t *q_batch_stride;    /* [n_batch_dim] */
    int64_t q_head_stride, q_row_stride, q_col_stride;

    const void *k;                    /* k[b..., g, j, d]; contiguous last axis */
    const int64_t *k_batch_stride;
    int64_t k_head_stride, k_row_stride;

    const void *v;                    /* v[b..., g, j, e]; contiguous last axis */
    const int64_t *v_batch_stride;
    int64_t v_head_stride, v_row_stride;

    void *out;                        /* out[b..., h, i, e]; must overlap no input */
    const int64_t *out_batch_stride;
    int64_t out_head_stride, out_row_stride, out_col_stride;

    double scale;                     /* multiplies q @ k^T; finite */

    enum npattn_mask_kind mask_kind;
    const void *mask;                 /* BOOL: uint8; ADD: dtype; else unused */
    const int64_t *mask_batch_stride; /* [n_batch_dim] */
    int64_t mask_head_stride, mask_row_stride, mask_col_stride;

    const double *sinks;              /* NULL, or [n_head_q] logits: exp(sink) joins the denominator */

    int32_t n_threads;                /* >= 1: threads that run tiles (at most 256), the caller waiting */

    /* NULL, or polled by the calling thread about every 50 ms while it waits;
     * nonzero stops the call between tiles with NPATTN_STATUS_CANCELLED. */
    int (*cancel)(void *cancel_arg);
    void *cancel_arg;
};

/* Computes one problem into p->out. Blocks until done, failed or cancelled;
 * out is unspecified unless the status is NPATTN_STATUS_OK. */
enum npattn_status npattn_sdpa(const struct npattn_problem *p);

/* A sentence that says what a status means. Never NULL. */
const char *npattn_status_string(enum npattn_status status);

/* Test hook: after n more successful allocations inside the core, every
 * allocation fails; n < 0 (the default) turns the hook off. Not for
 * production use and not thread-safe with concurrent calls. */
void npattn_debug_fail_alloc_after(int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* NPATTN_ATTENTION_H */

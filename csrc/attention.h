/* attention.h: npattn's core, scaled dot-product attention with grouped-query
 * attention (GQA) and its gradients, in pure C on OpenBLAS. No Python here.
 *
 *     s   = scale * q @ k^T                          per query head, per row
 *     s   = softcap * tanh(s / softcap)              when softcap > 0
 *     out = softmax(s + mask) @ v                    hidden keys: mask -inf
 *     lse = log(sum(exp(s + mask)) + exp(sink))      natural log, per row
 *
 * Shape legend (outermost first, as NumPy prints shapes):
 *
 *     q    (*B, H_q,  L, D)       B    batch dims, already broadcast by the caller
 *     k    (*B, H_kv, S, D)            (a broadcast operand has batch stride 0)
 *     v    (*B, H_kv, S, D_v)     H_q  query heads, a multiple of H_kv
 *     out  (*B, H_q,  L, D_v)     L    query rows, S key rows
 *     lse  (*B, H_q,  L)          D    q/k row width, D_v v/out row width
 *     mask (*B, H_q,  L, S)       read through strides: zero strides broadcast
 *
 * GQA: query head h reads key/value head h / (H_q / H_kv), so each key/value
 * head serves a contiguous group of H_q / H_kv query heads (as MLX, PyTorch,
 * JAX and llama.cpp).
 *
 * Positions and the band: query row i sits at position q_offset + i, key row
 * j at k_offset + j. A key is visible to a query iff
 *
 *     causal:  k_pos <= q_pos
 *     window:  q_pos - window_left <= k_pos <= q_pos + window_right
 *     mask:    the bool mask is nonzero, or the additive mask is not -inf
 *
 * all of those that are given. q_offset = S - L, k_offset = 0 is the causal
 * mask aligned to the bottom-right corner (MLX, the tutorial), so that a
 * decode step (L = 1) sees every key; q_offset = 0 is PyTorch's top-left
 * is_causal=True. Key tiles that the band hides are never read, so a window
 * over a long context costs O(L * window), not O(L * S).
 *
 * A row that sees no key (every score -inf, no sink) comes out as zeros, never
 * NaN, with lse -inf; S = 0 gives such rows. NaN in the inputs propagates to
 * the rows that see it. The result is exact wherever it is representable:
 * float32 tiles that overflow, or meet NaN or infinity, are recomputed in
 * double.
 *
 * Strides are in elements of each operand's own dtype and may be anything,
 * negative and zero included. K and V tiles go to BLAS in place when their
 * rows are contiguous in the computed dtype; otherwise each tile is converted
 * or gathered into scratch as it is used, never the whole operand.
 *
 * Scratch memory is bounded by the tile sizes times the number of threads,
 * never L * S. The core never aborts, exits or prints; every failure is a
 * status. One call may run while others run in other threads; the calling
 * thread computes too, and helper threads join only when the work repays
 * waking them.
 *
 * Not supported here: dropout, and gradients of the mask.
 */
#ifndef NPATTN_ATTENTION_H
#define NPATTN_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. Float16 and bfloat16 are computed in float; the result is
 * computed in double iff out is F64. */
enum npattn_dtype {
    NPATTN_DTYPE_F32,  /* float */
    NPATTN_DTYPE_F64,  /* double */
    NPATTN_DTYPE_F16,  /* IEEE half */
    NPATTN_DTYPE_BF16, /* bfloat16, the top half of a float */
};

/* An array mask, besides the band of positions. */
enum npattn_mask_kind {
    NPATTN_MASK_NONE, /* no array mask */
    NPATTN_MASK_BOOL, /* mask elements are uint8: nonzero = visible (its dtype is ignored) */
    NPATTN_MASK_ADD,  /* added to the (capped) scores; -inf hides; finite values beyond
                         the computed dtype's range saturate to its largest finite value */
};

enum npattn_status {
    NPATTN_STATUS_OK = 0,
    NPATTN_STATUS_NO_MEMORY, /* an allocation failed; nothing leaked */
    NPATTN_STATUS_CANCELLED, /* the cancel callback asked to stop, or the process is exiting */
    NPATTN_STATUS_INVALID,   /* the problem breaks a rule of this header */
    NPATTN_STATUS_TOO_LARGE, /* D or D_v beyond what one BLAS call takes (INT_MAX) */
    NPATTN_STATUS_BLAS_WRONG, /* the BLAS failed its check (npattn_blas_ok): nothing computed */
};

/* window_left / window_right: no bound on that side. */
#define NPATTN_UNBOUNDED (-1)

/* One operand: element [b..., h, i, e] sits at data plus
 * sum_d b_d * batch_stride[d] + h * head_stride + i * row_stride + e * col_stride
 * elements of dtype. */
struct npattn_tensor {
    void *data;                   /* NULL where the operand is not given */
    enum npattn_dtype dtype;
    const int64_t *batch_stride;  /* [n_batch_dim] */
    int64_t head_stride, row_stride, col_stride;
};

/* One attention problem. */
struct npattn_problem {
    int32_t n_batch_dim;              /* number of batch dims, may be 0 */
    const int64_t *batch_shape;       /* [n_batch_dim], each >= 0 */
    int64_t n_head_q;                 /* H_q >= 0, a multiple of n_head_kv */
    int64_t n_head_kv;                /* H_kv >= 1 */
    int64_t n_query;                  /* L >= 0 */
    int64_t n_key;                    /* S >= 0 */
    int64_t n_embd_k;                 /* D >= 1, row width of q and k */
    int64_t n_embd_v;                 /* D_v >= 0, row width of v and out */

    struct npattn_tensor q, k, v;     /* read only */
    struct npattn_tensor out;         /* written; its dtype is the result's. It must share no
                                         byte range with an input, nor overlap itself */
    struct npattn_tensor lse;         /* written if data != NULL: F32, or F64 for an F64 out;
                                         col_stride unused */
    struct npattn_tensor weights;     /* written if data != NULL: the probabilities (*B, H_q, L, S)
                                         in out's dtype; then v and out may be absent (D_v = 0) */

    double scale;                     /* multiplies q @ k^T; finite */
    double softcap;                   /* > 0: s = softcap * tanh(s / softcap); 0: none */

    int32_t causal;                   /* nonzero: keys after the query's position are hidden */
    int64_t q_offset, k_offset;       /* positions of query row 0 and key row 0 */
    int64_t window_left, window_right;/* >= 0, or NPATTN_UNBOUNDED */

    enum npattn_mask_kind mask_kind;
    struct npattn_tensor mask;        /* BOOL: uint8; ADD: any dtype */

    const double *sinks;              /* NULL, or [n_head_q] logits: exp(sink) joins the
                                         denominator, unscaled and unmasked */

    int32_t n_threads;                /* >= 1: at most this many threads, the caller included;
                                         0: the CPUs this process may run on (capped by
                                         npattn_set_num_threads). It also decides how work
                                         is split, so the same value gives bitwise-identical
                                         results, however many threads actually start. */

    /* NULL, or polled by the calling thread about every 50 ms; nonzero stops
     * the call between tiles with NPATTN_STATUS_CANCELLED. */
    int (*cancel)(void *cancel_arg);
    void *cancel_arg;
};

/* Computes one problem: out, and lse and weights where given. Blocks until
 * done, failed or cancelled; the outputs are unspecified unless the status is
 * NPATTN_STATUS_OK. */
enum npattn_status npattn_sdpa(const struct npattn_problem *p);

/* The gradients of sum(dout * out) with respect to q, k, v and the sinks,
 * after FlashAttention-2's backward pass (arXiv:2307.08691, Algorithm 2):
 * each tile recomputes its probabilities from the saved lse. It extends the
 * forward problem as flash-attention's Flash_bwd_params extends its forward
 * parameters. Gradients are accumulated in the computed dtype (F32, or F64
 * for an F64 forward out) with contiguous rows (col_stride 1); dk and dv
 * sum the query heads of their group, at the broadcast batch shape B. */
struct npattn_backward_problem {
    struct npattn_problem fwd;        /* the forward problem; fwd.out and fwd.lse hold its results
                                         and are read here, fwd.weights is unused */
    struct npattn_tensor dout;        /* (*B, H_q, L, D_v), read */
    struct npattn_tensor dq;          /* (*B, H_q, L, D), written */
    struct npattn_tensor dk;          /* (*B, H_kv, S, D), written */
    struct npattn_tensor dv;          /* (*B, H_kv, S, D_v), written */
    double *dsinks;                   /* with fwd.sinks: [n_batch][n_head_q] written, row-major
                                         over the flattened batch; else unused */
};

enum npattn_status npattn_sdpa_backward(const struct npattn_backward_problem *p);

/* Whether the BLAS library computes right: checked once, on first use, with
 * small products of every transposition against a plain loop. When it does
 * not, every call returns NPATTN_STATUS_BLAS_WRONG instead of a wrong
 * answer. (OpenBLAS 0.3.34's SME kernels, its core "armv9sme", compute some
 * of them wrong unless the CPU's streaming vector length is 512 bits, as on
 * Apple M4; OPENBLAS_CORETYPE=NEOVERSEN1 avoids them.) npattn_blas_core()
 * names the BLAS's kernel core. */
int npattn_blas_ok(void);
const char *npattn_blas_core(void);

/* A sentence that says what a status means. Never NULL. */
const char *npattn_status_string(enum npattn_status status);

/* Stops every call in flight (they return NPATTN_STATUS_CANCELLED, as every
 * later call does) and waits, at most 5 s, until none computes: for a
 * program's exit, so that no tile runs while libraries are torn down. The
 * core registers it with atexit(); an embedding runtime may call it earlier
 * (Python does, before it stops its threads). */
void npattn_shutdown(void);

/* The default thread count (n_threads = 0): the CPUs this process may run on,
 * at most n if npattn_set_num_threads(n) was called with n >= 1 (n < 1 lifts
 * the cap). For threadpoolctl and alike, which find them by name in a shared
 * library built with hidden visibility: hence exported. */
#if defined(__GNUC__) || defined(__clang__)
#define NPATTN_EXPORTED __attribute__((visibility("default")))
#else
#define NPATTN_EXPORTED
#endif
NPATTN_EXPORTED int npattn_get_num_threads(void);
NPATTN_EXPORTED void npattn_set_num_threads(int n);

/* Test hooks, not for production use and not thread-safe with concurrent calls:
 * after n more successful allocations inside the core every allocation fails
 * (n < 0, the default, turns it off); and the pool's mode: 0 normal, 1 no
 * helper thread ever starts, 2 helpers join whatever the size of the work. */
void npattn_debug_fail_alloc_after(int64_t n);
void npattn_debug_pool_mode(int mode);

#ifdef __cplusplus
}
#endif

#endif /* NPATTN_ATTENTION_H */

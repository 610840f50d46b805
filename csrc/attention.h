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
 * over a long context costs O(L * window), not O(L * S). Per-request key
 * ranges (k_start, k_length) and positions (q_offsets) narrow each
 * request's keys and shift its band; tiles outside a range are skipped.
 * q_bottom_right asks for the default position, the bottom-right corner of
 * each request's own keys (npattn_request_positions says what it resolves to).
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
 * computed in double iff out is F64. The 8-bit codes (SPEC section 14) are
 * for k and v alone, each with its scales (struct npattn_codes): a code
 * stands for the float scale * (code - zero); the fp8 formats' NaN and
 * infinite codes stand for NaN and infinity. */
enum npattn_dtype {
    NPATTN_DTYPE_F32,    /* float */
    NPATTN_DTYPE_F64,    /* double */
    NPATTN_DTYPE_F16,    /* IEEE half */
    NPATTN_DTYPE_BF16,   /* bfloat16, the top half of a float */
    NPATTN_DTYPE_I8,     /* int8 codes, -128 .. 127 */
    NPATTN_DTYPE_U8,     /* uint8 codes, 0 .. 255 */
    NPATTN_DTYPE_F8E4M3, /* fp8 e4m3fn codes (bias 7, no infinities, NaN 0x7f and 0xff), up to 448 */
    NPATTN_DTYPE_F8E5M2, /* fp8 e5m2 codes (bias 15: the top byte of a float16), up to 57344 */
};

/* Whether t is one of the codes (I8, U8, F8E4M3, F8E5M2). */
static inline int npattn_is_code(enum npattn_dtype t) { return t >= NPATTN_DTYPE_I8 && t <= NPATTN_DTYPE_F8E5M2; }

/* How half-precision inputs may be computed (SPEC section 11). */
enum npattn_precision {
    NPATTN_PRECISION_HIGHEST, /* correctly rounded from a float32 computation, subnormals included */
    NPATTN_PRECISION_FAST,    /* half inputs: the weights may be rounded to the half type before P @ V, and
                                 the products may use half-precision dot products (float32 accumulation).
                                 This build does so for bfloat16 q, k and v in gemm tiles on the amx and
                                 avx512bf16 kernel tables; elsewhere it computes as HIGHEST */
};

/* An array mask, besides the band of positions. */
enum npattn_mask_kind {
    NPATTN_MASK_NONE, /* no array mask */
    NPATTN_MASK_BOOL, /* mask elements are uint8: nonzero = visible (its dtype is ignored) */
    NPATTN_MASK_ADD,  /* added to the (capped) scores; -inf hides; finite values beyond
                         the computed dtype's range saturate to its largest finite value */
};

/* What a call returns. Every rule of this header that the core checks has a
 * status of its own (one sentence each, npattn_status_string), and
 * npattn_check names the operand that breaks it. */
enum npattn_status {
    NPATTN_STATUS_OK = 0,
    NPATTN_STATUS_NO_MEMORY,      /* an allocation failed; nothing leaked */
    NPATTN_STATUS_CANCELLED,      /* the cancel callback asked to stop, or the process is exiting */
    NPATTN_STATUS_BLAS_WRONG,     /* the BLAS failed its check (npattn_blas_ok): nothing computed */
    /* the rules */
    NPATTN_STATUS_NO_PROBLEM,         /* the problem is NULL */
    NPATTN_STATUS_BAD_BATCH,          /* n_batch_dim < 0, a batch size < 0, or no batch_shape */
    NPATTN_STATUS_BATCH_OVERFLOW,     /* the batch sizes multiply beyond int64 */
    NPATTN_STATUS_NO_KV_HEAD,         /* n_head_kv < 1 */
    NPATTN_STATUS_HEADS_NOT_MULTIPLE, /* n_head_q < 0, or not a multiple of n_head_kv */
    NPATTN_STATUS_NEGATIVE_SIZE,      /* n_query, n_key or n_embd_v < 0 */
    NPATTN_STATUS_NO_WIDTH,           /* n_embd_k (D) < 1 */
    NPATTN_STATUS_TOO_LARGE,          /* D or D_v beyond what one BLAS call takes (INT_MAX) */
    NPATTN_STATUS_BAD_SCALE,          /* scale not finite */
    NPATTN_STATUS_BAD_SOFTCAP,        /* softcap negative, NaN or infinite */
    NPATTN_STATUS_BAD_WINDOW,         /* a window side below NPATTN_UNBOUNDED */
    NPATTN_STATUS_BAD_MASK_KIND,      /* mask_kind not one of enum npattn_mask_kind */
    NPATTN_STATUS_BAD_THREADS,        /* n_threads outside 0 .. NPATTN_MAX_THREADS */
    NPATTN_STATUS_BAD_THREADS_ENV,    /* n_threads 0 and NPATTN_NUM_THREADS set, but not to an int
                                         from 1 to NPATTN_MAX_THREADS */
    NPATTN_STATUS_BAD_DTYPE,          /* an operand's dtype is not one of enum npattn_dtype */
    NPATTN_STATUS_NOT_WIDE,           /* lse, dq, dk or dv neither F32 nor F64 */
    NPATTN_STATUS_NO_STRIDES,         /* batch dims, but the operand has no batch_stride */
    NPATTN_STATUS_OUT_OF_RANGE,       /* an operand's elements reach beyond int64 bytes */
    NPATTN_STATUS_NO_DATA,            /* an operand read or written has no data */
    NPATTN_STATUS_OVERLAPS_ITSELF,    /* two indices of an output reach one element */
    NPATTN_STATUS_OVERLAPS,           /* an output shares bytes with another operand */
    NPATTN_STATUS_BAD_K_START,        /* a k_start[b] outside [0, S] */
    NPATTN_STATUS_BAD_K_LENGTH,       /* a k_length[b] < 0, or past S from k_start[b] */
    NPATTN_STATUS_BAD_PAGES,          /* pages: no block table, page_size < 1, n_page < 0, S not
                                         max_pages * page_size, table_stride < 0, k_start given, or a
                                         backward pass */
    NPATTN_STATUS_BAD_PAGE,           /* pages: a live block_table entry outside [0, n_page) */
    NPATTN_STATUS_BAD_PRECISION,      /* precision not one of enum npattn_precision */
    NPATTN_STATUS_BAD_Q_OFFSET,       /* q_bottom_right with key ranges: a request's default
                                         position, k_offset + k_length[b] - L, beyond int64 */
    NPATTN_STATUS_NO_CODE_SCALE,      /* k or v of codes without its scale */
    NPATTN_STATUS_NOT_CODES,          /* a scale or zero point for k or v of floats */
    NPATTN_STATUS_BAD_GROUPS,         /* codes' n_group < 1, or not dividing D (D_v for v) */
    NPATTN_STATUS_SYMMETRIC_CODES,    /* a zero point for fp8 codes, which are symmetric */
    NPATTN_STATUS_CODES_NO_GRADIENT,  /* a backward problem of codes: there is no gradient through them */
    NPATTN_STATUS_COUNT
};

/* The operands of a problem, as a verdict names them. */
enum npattn_operand {
    NPATTN_OPERAND_NONE, /* a rule of the problem's sizes or scalars */
    NPATTN_OPERAND_Q,
    NPATTN_OPERAND_K,
    NPATTN_OPERAND_V,
    NPATTN_OPERAND_MASK,
    NPATTN_OPERAND_SINKS,
    NPATTN_OPERAND_OUT,
    NPATTN_OPERAND_LSE,
    NPATTN_OPERAND_WEIGHTS,
    NPATTN_OPERAND_DOUT, /* the backward's operands */
    NPATTN_OPERAND_DQ,
    NPATTN_OPERAND_DK,
    NPATTN_OPERAND_DV,
    NPATTN_OPERAND_DSINKS,
    NPATTN_OPERAND_K_SCALE, /* the scales and zero points of codes */
    NPATTN_OPERAND_K_ZERO,
    NPATTN_OPERAND_V_SCALE,
    NPATTN_OPERAND_V_ZERO,
    NPATTN_OPERAND_COUNT
};

/* Why a problem is refused: the rule (its status), the operand that breaks
 * it, and for NPATTN_STATUS_OVERLAPS the operand it overlaps. */
struct npattn_verdict {
    enum npattn_status status;
    enum npattn_operand operand, other;
    int64_t entry; /* NPATTN_STATUS_BAD_PAGE: the flat index b * max_pages + i of the entry;
                      BAD_K_START, BAD_K_LENGTH, BAD_Q_OFFSET: the request b (flattened batch); else -1 */
};

/* The most threads a problem may ask for (n_threads), and the most one call
 * runs on. */
#define NPATTN_MAX_THREADS 256

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

/* How k's (or v's) codes stand for values (SPEC section 14). A row of D
 * elements comes in n_group groups of D / n_group: element e of row i of
 * head h stands for
 *     scale[b..., h, i, e / (D / n_group)] * (code - zero[b..., h, i, e / (D / n_group)])
 * computed in float (code - zero rounded, then times the scale rounded; zero
 * 0 where zero.data is NULL). scale and zero are (*B, H_kv, S, n_group)
 * tensors read through their strides, a zero stride broadcasting: so one
 * scale per tensor has every stride 0, per head a head stride, per token a
 * row stride, per channel n_group = D, and llama.cpp's q8_0 n_group = D /
 * 32 with F16 scales. Their dtypes are F32, F16 or BF16; a zero point is
 * for I8 and U8 codes only. With pages, they are paged as k and v are:
 * row r of page P of head h at P * page_stride + h * head_stride + r *
 * row_stride (their batch strides unused). Scales are finite: the core
 * reads them as they are, and a NaN or infinite one makes the rows that
 * read it NaN or infinite. */
struct npattn_codes {
    struct npattn_tensor scale;   /* data NULL: k (v) holds floats */
    struct npattn_tensor zero;    /* data NULL: zero points 0 */
    int64_t n_group;              /* groups a row, >= 1, dividing D (D_v) */
    int64_t scale_page_stride, zero_page_stride; /* paged: elements from one page to the next */
};

/* A paged K/V cache (vLLM's block tables; tiny-llm's paged attention). k
 * and v then hold n_page physical pages of page_size rows each, in place of
 * batch dims: row r of page P of k's head h starts at element
 *     P * k_page_stride + h * k.head_stride + r * k.row_stride
 * (their batch strides are unused), and v likewise. Request b's key row j is
 * row j % page_size of page block_table[b * table_stride + j / page_size], and
 * the problem's S is max_pages * page_size. Only the live pages of a request
 * (those that hold its rows below k_length[b]; every page without k_length)
 * are read, so entries past them may hold anything (-1, customarily); two
 * requests may share a page. Pages never appear in a backward problem. */
struct npattn_pages {
    const int64_t *block_table;       /* request b's entries at b * table_stride + i, i < max_pages */
    int64_t max_pages;                /* >= 0 */
    int64_t n_page;                   /* physical pages, >= 0 */
    int64_t page_size;                /* rows per page, >= 1 */
    int64_t k_page_stride, v_page_stride; /* elements from one page to the next */
    int64_t table_stride;             /* entries from one request's row of block_table to the next's:
                                         0 is max_pages (a row-major [n_batch][max_pages] table); a
                                         table of each request's live entries alone may be narrower */
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

    struct npattn_tensor q, k, v;     /* read only; k and v may hold codes (I8, U8, F8E4M3, F8E5M2) */
    struct npattn_codes k_codes, v_codes; /* their scales where they hold codes; all zeros for floats */
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
    int32_t q_bottom_right;           /* nonzero: q_offset and q_offsets are unused, and query row 0
                                         sits at the bottom-right corner of its request's keys:
                                         k_offset + k_length[b] - L with key ranges (k_start or
                                         k_length given), else S - L (the default of sdpa's
                                         q_offset=None) */
    int64_t window_left, window_right;/* >= 0, or NPATTN_UNBOUNDED */

    /* Per-request key ranges and positions, each NULL or [n_batch] over the
     * flattened batch (row-major over batch_shape). Request b reads only the
     * key rows k_start[b] <= j < k_start[b] + k_length[b]; rows outside are
     * never read and count as hidden. Key row j then sits at position
     * k_offset + j - k_start[b], so positions count from the first row read. */
    const int64_t *k_start;           /* NULL: 0; else each in [0, S] */
    const int64_t *k_length;          /* NULL: S - k_start[b]; else each >= 0, k_start[b] + k_length[b] <= S */
    const int64_t *q_offsets;         /* NULL: q_offset for every request; else request b's query row 0 */

    /* NULL, or a paged K/V cache: k and v hold physical pages, read through
     * each request's block table (struct npattn_pages). */
    const struct npattn_pages *pages;

    enum npattn_mask_kind mask_kind;
    struct npattn_tensor mask;        /* BOOL: uint8; ADD: any dtype */

    const double *sinks;              /* NULL, or [n_head_q] logits: exp(sink) joins the
                                         denominator, unscaled and unmasked */

    enum npattn_precision precision;  /* HIGHEST (0) unless asked */

    int32_t n_threads;                /* 1 .. NPATTN_MAX_THREADS: at most this many threads, the caller included;
                                         0: the environment's NPATTN_NUM_THREADS where it is
                                         set (an int from 1 to NPATTN_MAX_THREADS, spaces
                                         around it allowed), else the CPUs this process may
                                         run on (capped by npattn_set_num_threads). It also
                                         decides how work is split, so the same value gives
                                         bitwise-identical results, however many threads
                                         actually start. */

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
 * sum the query heads of their group. A gradient may have batch stride 0
 * along a batch dim, as a broadcast operand has: it then holds the sum over
 * that dim, accumulated in place, one task per slice in a fixed order (so k
 * broadcast over a batch needs dk and dv of its own size, never B's). */
struct npattn_backward_problem {
    struct npattn_problem fwd;        /* the forward problem; fwd.out and fwd.lse hold its results
                                         and are read here, fwd.weights is unused */
    struct npattn_tensor dout;        /* (*B, H_q, L, D_v), read */
    struct npattn_tensor dq;          /* (*B, H_q, L, D), written; batch stride 0: summed there */
    struct npattn_tensor dk;          /* (*B, H_kv, S, D), written; batch stride 0: summed there */
    struct npattn_tensor dv;          /* (*B, H_kv, S, D_v), written; batch stride 0: summed there */
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

/* Checks a problem against the rules of this header without computing it:
 * NPATTN_STATUS_OK, or the status of the first rule it breaks (what
 * npattn_sdpa and npattn_sdpa_backward would return), with the operand
 * named in *why when why is not NULL. */
enum npattn_status npattn_check(const struct npattn_problem *p, struct npattn_verdict *why);
enum npattn_status npattn_check_backward(const struct npattn_backward_problem *p, struct npattn_verdict *why);

/* Request b's positions, the defaults resolved, as the core computes them:
 * where its query row 0 sits (*q_offset), and the key rows it reads,
 * [*k_start, *k_start + *k_length). b indexes the flattened batch, for a
 * problem that npattn_check accepts; b = -1 gives the positions of the
 * problem's scalars alone (k_start 0, k_length S, per-request arrays aside). */
void npattn_request_positions(const struct npattn_problem *p, int64_t b, int64_t *q_offset, int64_t *k_start,
                              int64_t *k_length);

/* A sentence that says what a status means (for a rule: the rule). Never NULL. */
const char *npattn_status_string(enum npattn_status status);

/* An operand's name as this header spells it ("q", "dsinks"; "" for
 * NPATTN_OPERAND_NONE). Never NULL. */
const char *npattn_operand_name(enum npattn_operand operand);

/* The kernel table in use ("avx512", "avx2", "neon" or "portable"); the BLAS
 * library linked, and its own configuration string (NULL where it has none). */
const char *npattn_simd(void);
const char *npattn_blas_library(void);
const char *npattn_blas_config(void);

/* Stops every call in flight (they return NPATTN_STATUS_CANCELLED, as every
 * later call does) and waits, at most 5 s, until none computes: for a
 * program's exit, so that no tile runs while libraries are torn down. The
 * core registers it with atexit(); an embedding runtime may call it earlier
 * (Python does, before it stops its threads). */
void npattn_shutdown(void);

/* The default thread count (n_threads = 0) where NPATTN_NUM_THREADS is not
 * set: the CPUs this process may run on, at most n if
 * npattn_set_num_threads(n) was called with n >= 1 (n < 1 lifts the cap). For threadpoolctl and alike, which find them by name in a shared
 * library built with hidden visibility: hence exported. */
#if defined(__GNUC__) || defined(__clang__)
#define NPATTN_EXPORTED __attribute__((visibility("default")))
#else
#define NPATTN_EXPORTED
#endif
NPATTN_EXPORTED int npattn_get_num_threads(void);
NPATTN_EXPORTED void npattn_set_num_threads(int n);

/* A host's OpenMP team as the helpers. A program whose own parallel work runs
 * on OpenMP (PyTorch does) keeps a team of threads that spin for a while after
 * each parallel region; helpers of npattn's own pool started right then would
 * share the cores with them. Given the host runtime's entry points, as libgomp
 * exports them (LLVM's libomp exports the same names): GOMP_parallel(fn, data,
 * num_threads, flags), which runs fn(data) on a team whose member 0 is the
 * calling thread, and omp_get_thread_num(); a thread that then asks for it
 * (npattn_pool_openmp_here(1)) has its calls' helpers come from that team.
 * Both NULL: no host runtime. Forks and exit stay the host runtime's to
 * manage. npattn_pool_openmp_here returns the thread's setting before. */
typedef void (*npattn_omp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*npattn_omp_thread_num_fn)(void);
void npattn_pool_use_openmp(npattn_omp_parallel_fn parallel, npattn_omp_thread_num_fn thread_num);
int npattn_pool_openmp_here(int on);

#ifdef __cplusplus
}
#endif

#endif /* NPATTN_ATTENTION_H */

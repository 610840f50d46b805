/* module.h: what the three files of npattn._core, the CPython + NumPy glue
 * around the C core, share:
 *
 *   module.c         the entry points: allocation, the GIL and Ctrl-C, the
 *                    method table and the module
 *   module_args.c    the arguments: the keyword set, and a reader for each
 *                    argument, which describes it to the core in place
 *   module_errors.c  the errors: the messages, and the map from the core's
 *                    statuses (its verdicts) to exceptions
 *
 * Only the glue includes it; the core knows nothing of Python. The names below
 * are the extension's own (built with hidden visibility).
 */
#ifndef NPATTN_MODULE_H
#define NPATTN_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* NumPy's C API, imported once (module.c) for the three files */
#define PY_ARRAY_UNIQUE_SYMBOL npattn_ARRAY_API
#ifndef NPATTN_IMPORTS_NUMPY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>
#include <stdatomic.h>
#include <stdint.h>

#include "attention.h"
#include "hooks.h"

/* ---- the keyword set: every option of every entry point, read in one place ---- */

#define OPTIONS(X)                                                                                                     \
    X(q) X(k) X(v) X(dout) X(out) X(lse) X(scale) X(mask) X(sinks) X(window) X(softcap) X(q_offset) X(k_offset)        \
        X(k_start) X(k_lengths) X(return_lse) X(precision) X(threads) X(block_table) X(context_lens) X(page_size)        \
            X(agree) X(k_scale) X(k_zero) X(v_scale) X(v_zero)
#define AS_ENUM(name) OPT_##name,
enum option { OPTIONS(AS_ENUM) N_OPTION };
#undef AS_ENUM

#define BIT(name) (1u << OPT_##name)
/* The options every entry point takes, and each one's own. */
#define COMMON                                                                                                         \
    (BIT(q) | BIT(k) | BIT(scale) | BIT(mask) | BIT(sinks) | BIT(window) | BIT(softcap) | BIT(q_offset) |              \
     BIT(k_offset) | BIT(k_start) | BIT(k_lengths) | BIT(precision) | BIT(threads))
#define K_CODES (BIT(k_scale) | BIT(k_zero))
#define V_CODES (BIT(v_scale) | BIT(v_zero))
#define SDPA_OPTIONS (COMMON | BIT(v) | BIT(return_lse) | BIT(out) | K_CODES | V_CODES)
#define WEIGHTS_OPTIONS (COMMON | K_CODES)
#define BACKWARD_OPTIONS (COMMON | BIT(v) | BIT(dout) | BIT(out) | BIT(lse) | BIT(agree))
#define PAGED_OPTIONS                                                                                                  \
    (BIT(q) | BIT(k) | BIT(v) | BIT(block_table) | BIT(context_lens) | BIT(page_size) | BIT(scale) | BIT(mask) |       \
     BIT(sinks) | BIT(window) | BIT(softcap) | BIT(q_offset) | BIT(return_lse) | BIT(precision) | BIT(out) |         \
     BIT(threads) | K_CODES | V_CODES)

/* ---- one call: what it read, what it owns ---- */

/* One operand's array and its element strides, batch dims right-aligned to
 * the broadcast batch shape (stride 0 where the operand broadcasts). */
struct operand {
    PyArrayObject *a;
    int64_t batch_stride[NPY_MAXDIMS];
};

#define MAX_OWNED 24
#define MAX_INPUTS 32

struct call {
    const char *fn;                /* "sdpa", "attention_weights", "sdpa_backward": starts each message */
    PyObject *opt[N_OPTION];       /* the arguments as given (borrowed) */
    PyObject *owned[MAX_OWNED];    /* converted and new arrays, released at the end */
    int n_owned;
    struct {
        PyArrayObject *a;
        const char *name;
    } inputs[MAX_INPUTS];          /* every array read, as given and as converted: out must overlap none */
    int n_inputs;
    int nb;                        /* broadcast batch dims */
    int64_t batch[NPY_MAXDIMS];
    int rank2;                     /* all of q, k (and v) rank 2: results without heads */
    int result;                    /* the result's core dtype */
    int top_left;                  /* mask="causal_top_left" */
    int paged;                     /* paged_attention: k and v are key_pages and value_pages */
    PyArrayObject *table;          /* paged_attention: block_table as given (its int64 copy: pages.block_table) */
    struct npattn_pages pages;
    struct npattn_problem p;
    /* last: their strides are written as each is described, never read before */
    struct operand q, k, v, mask, out, lse, weights, dout, dq, dk, dv, k_scale, k_zero, v_scale, v_zero;
};

/* ---- module.c: the entry points ---- */

extern atomic_int shutting_down; /* _core.shutdown() ran: the interpreter is exiting */

/* A new C-contiguous array, owned by the call; NULL with the error naming
 * `what` and its shape (a MemoryError beyond the machine's memory and swap). */
PyArrayObject *new_array(struct call *c, const npy_intp *shape, int nd, int npy_type, const char *what);

/* ---- module_args.c: the arguments ---- */

extern int bfloat16_type;   /* ml_dtypes.bfloat16's type number, once Python has seen it (-1) */
extern int float8_types[2]; /* ml_dtypes.float8_e4m3fn's and float8_e5m2's, likewise */
extern PyObject *converter; /* npattn._args.convert(fn, name, x), registered by set_converter */

int args_init(void); /* at import: the keywords' names interned; 0 with the error */

/* A call: begun, its arrays released, a new reference taken into it (NULL passes through). */
void call_init(struct call *c, const char *fn);
void call_release(struct call *c);
PyObject *own(struct call *c, PyObject *o);

/* The keywords of an entry point that takes exactly the options `want`. */
int read_keywords(struct call *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, unsigned want);

/* An option's name as the entry point spells it (key_pages for k when paged). */
const char *name_of(const struct call *c, enum option o);

/* Dtypes: the core's of a NumPy type number or array (-1: none), promotion, and back.
 * core_dtype_of and core_dtype know the floats alone; code_dtype the codes. */
int core_dtype_of(int t);
int core_dtype(PyArrayObject *a);
int code_dtype(PyArrayObject *a);
int promote(int a, int b);
int npy_type_of(int dtype);

/* type(x).__name__; a shape as a tuple. */
const char *type_name(PyObject *x);
PyObject *tuple_of(const npy_intp *dims, int nd);
PyObject *shape_of(PyArrayObject *a);

/* Fills t from operand o whose last `tail` dims are (heads, rows[, cols]). */
void describe(struct call *c, struct operand *o, struct npattn_tensor *t, int dtype, int tail);

/* The readers, each 1 or 0 with the error naming the argument. */
PyArrayObject *float_array(struct call *c, enum option o);
int read_qkv(struct call *c, int has_v);
int read_paged(struct call *c);
int read_codes(struct call *c, int has_v); /* k_scale, k_zero (and v_scale, v_zero) */
int read_scale(struct call *c);
int read_mask(struct call *c);
int read_options(struct call *c); /* every option but the arrays of results */
int read_out(struct call *c, const npy_intp *shape, int nd);
int read_fitting(struct call *c, enum option o, struct operand *op, struct npattn_tensor *t, const npy_intp *shape,
                 int nd, const char *what);

/* out overlaps none of the arrays the call read. */
int out_clear_of_inputs(struct call *c);

/* The options the core computes a read call under, its defaults resolved (a dict). */
PyObject *options_used(struct call *c);

/* ---- module_errors.c: the messages, and the core's verdicts as exceptions ---- */

/* Raises exc with "fn: " + fmt made of x (a new reference, consumed). Returns 0. */
int raise_with(struct call *c, PyObject *exc, const char *fmt, PyObject *x);

/* At most n characters of repr(x), or of str(x). */
PyObject *short_repr(PyObject *x, Py_ssize_t n);
PyObject *short_str(PyObject *x, Py_ssize_t n);

/* A rule of q's, k's and v's shapes broken: ValueError with their shapes. Returns 0. */
int shapes_break(struct call *c, const char *rule);

/* out shares memory with the input `name`: the ValueError. Returns 0. */
int out_shares(struct call *c, const char *name);

/* Request b's index in the batch shape, "[1, 0]" ("" without batch dims). */
#define REQUEST_INDEX (24 * NPY_MAXDIMS + 3)
void request_index(const struct call *c, int64_t b, char *index);

/* Raises the exception a refused call deserves; returns NULL. bp: the
 * backward problem, or NULL for the forward one. */
PyObject *refused(struct call *c, enum npattn_status status, const struct npattn_backward_problem *bp);

#endif /* NPATTN_MODULE_H */

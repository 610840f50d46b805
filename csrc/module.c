/* module.c: npattn._core, the CPython + NumPy glue around the C core.
 *
 * npattn.sdpa, attention_weights and sdpa_backward (python/npattn/_api.py)
 * hand every argument here by name, as given, through one keyword set
 * (OPTIONS below). This file reads each one once: NumPy arrays of float16,
 * bfloat16, float32 or float64, aligned and native, with any strides, and
 * plain numbers are described to the core in place, without a copy; an
 * argument it cannot read in place (a list, an MLX array or torch tensor, a
 * byte-swapped or misaligned array) goes through the conversion function
 * that npattn._args registers (set_converter), and is then read the same
 * way. It releases the GIL around the call and raises the error a broken
 * rule deserves, naming the argument, the rule and what it got.
 *
 * The rules of attention.h are the core's: the core's verdict names the rule
 * and the operand, and this file only phrases it (refused() below). What is
 * checked here is what describing the arguments needs: their kinds, ranks,
 * dtypes, and the sizes that two operands share.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <numpy/arrayobject.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "hooks.h"

static int bfloat16_type = -1; /* ml_dtypes.bfloat16's type number, once Python has seen it */
static atomic_int shutting_down; /* _core.shutdown() ran: the interpreter is exiting */
static PyObject *converter;      /* npattn._args.convert(fn, name, x): an array the core reads */

/* ---- Ctrl-C: the computing caller takes the GIL back to check for signals ---- */

struct wait_state {
    PyThreadState *saved;
};

static int check_signals(void *arg) {
    struct wait_state *w = arg;
    /* exiting: never take the GIL inside the core, where a daemon thread could
     * be stopped for good */
    if (atomic_load(&shutting_down)) return 1;
    PyEval_RestoreThread(w->saved);
    int interrupted = PyErr_CheckSignals() != 0;
    w->saved = PyEval_SaveThread();
    return interrupted;
}

/* ---- the keyword set: every option of every entry point, read in one place ---- */

#define OPTIONS(X)                                                                                                     \
    X(q) X(k) X(v) X(dout) X(out) X(lse) X(scale) X(mask) X(sinks) X(window) X(softcap) X(q_offset) X(k_offset)        \
        X(k_start) X(k_lengths) X(return_lse) X(precision) X(threads) X(block_table) X(context_lens) X(page_size)        \
            X(agree)
#define AS_ENUM(name) OPT_##name,
#define AS_NAME(name) #name,
enum option { OPTIONS(AS_ENUM) N_OPTION };
static const char *const option_names[N_OPTION] = {OPTIONS(AS_NAME)};
static PyObject *option_strings[N_OPTION]; /* interned at import */
#undef AS_ENUM
#undef AS_NAME

#define BIT(name) (1u << OPT_##name)
/* The options every entry point takes, and each one's own. */
#define COMMON                                                                                                         \
    (BIT(q) | BIT(k) | BIT(scale) | BIT(mask) | BIT(sinks) | BIT(window) | BIT(softcap) | BIT(q_offset) |              \
     BIT(k_offset) | BIT(k_start) | BIT(k_lengths) | BIT(precision) | BIT(threads))
#define SDPA_OPTIONS (COMMON | BIT(v) | BIT(return_lse) | BIT(out))
#define WEIGHTS_OPTIONS COMMON
#define BACKWARD_OPTIONS (COMMON | BIT(v) | BIT(dout) | BIT(out) | BIT(lse) | BIT(agree))
#define PAGED_OPTIONS                                                                                                  \
    (BIT(q) | BIT(k) | BIT(v) | BIT(block_table) | BIT(context_lens) | BIT(page_size) | BIT(scale) | BIT(mask) |       \
     BIT(sinks) | BIT(window) | BIT(softcap) | BIT(q_offset) | BIT(return_lse) | BIT(precision) | BIT(out) |         \
     BIT(threads))

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
    struct operand q, k, v, mask, out, lse, weights, dout, dq, dk, dv;
};

static void call_init(struct call *c, const char *fn) {
    memset(c, 0, offsetof(struct call, q));
    struct operand *ops[] = {&c->q, &c->k, &c->v, &c->mask, &c->out, &c->lse, &c->weights, &c->dout, &c->dq, &c->dk, &c->dv};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) ops[i]->a = NULL;
    c->fn = fn;
}

static void call_release(struct call *c) {
    for (int i = 0; i < c->n_owned; i++) Py_DECREF(c->owned[i]);
    c->n_owned = 0;
}

/* Takes the new reference o into the call (NULL passes through). */
static PyObject *own(struct call *c, PyObject *o) {
    if (o && c->n_owned == MAX_OWNED) {
        Py_DECREF(o);
        return PyErr_Format(PyExc_RuntimeError, "%s: internal error: too many arrays", c->fn);
    }
    if (o) c->owned[c->n_owned++] = o;
    return o;
}

/* Reads the keywords of an entry point that takes exactly `want`. */
static int read_keywords(struct call *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, unsigned want) {
    Py_ssize_t n = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    unsigned got = 0;
    if (nargs != 0) {
        PyErr_Format(PyExc_TypeError, "_core.%s takes keyword arguments only", c->fn);
        return 0;
    }
    int next = 0; /* keywords mostly come in the order of OPTIONS: look there first */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        int o = next < N_OPTION && option_strings[next] == key ? next : 0;
        while (o < N_OPTION && option_strings[o] != key) o++;
        if (o == N_OPTION) /* not interned: compare the text */
            for (o = 0; o < N_OPTION && PyUnicode_Compare(key, option_strings[o]) != 0; o++) {
            }
        if (o == N_OPTION || !(want & (1u << o))) {
            PyErr_Format(PyExc_TypeError, "_core.%s got an unexpected keyword argument %R", c->fn, key);
            return 0;
        }
        c->opt[o] = args[i];
        got |= 1u << o;
        next = o + 1;
    }
    if (got != want) {
        int o = 0;
        while (!((want & ~got) & (1u << o))) o++;
        PyErr_Format(PyExc_TypeError, "_core.%s missing the keyword argument '%s'", c->fn, option_names[o]);
        return 0;
    }
    return 1;
}

/* An option's name as the entry point spells it. */
static const char *name_of(const struct call *c, enum option o) {
    if (c->paged && o == OPT_k) return "key_pages";
    if (c->paged && o == OPT_v) return "value_pages";
    return option_names[o];
}

/* ---- describing arrays ---- */

/* The core's dtype of a NumPy type number, or -1. */
static int core_dtype_of(int t) {
    if (t == NPY_FLOAT32) return NPATTN_DTYPE_F32;
    if (t == NPY_FLOAT64) return NPATTN_DTYPE_F64;
    if (t == NPY_HALF) return NPATTN_DTYPE_F16;
    if (t == bfloat16_type && bfloat16_type >= 0) return NPATTN_DTYPE_BF16;
    return -1;
}

/* The core's dtype of a NumPy array, or -1. */
static int core_dtype(PyArrayObject *a) { return core_dtype_of(PyArray_TYPE(a)); }

/* The dtype of the result of two dtypes, as np.result_type (float16 with
 * bfloat16, which NumPy cannot promote, gives float32). The one rule of
 * promotion: Python reads it through result_dtype() below. */
static int promote(int a, int b) {
    if (a == b) return a;
    if (a == NPATTN_DTYPE_F64 || b == NPATTN_DTYPE_F64) return NPATTN_DTYPE_F64;
    return NPATTN_DTYPE_F32;
}

static int npy_type_of(int dtype) {
    switch (dtype) {
    case NPATTN_DTYPE_F32: return NPY_FLOAT32;
    case NPATTN_DTYPE_F64: return NPY_FLOAT64;
    case NPATTN_DTYPE_F16: return NPY_HALF;
    default: return bfloat16_type;
    }
}

/* An array the core can read in place: aligned, native, whole-element strides. */
static int readable(PyObject *o, int bool_ok) {
    if (!PyArray_Check(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    if (!(bool_ok && PyArray_TYPE(a) == NPY_BOOL) && core_dtype(a) < 0) return 0;
    if (!PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a)) return 0;
    for (int d = 0; d < PyArray_NDIM(a); d++)
        if (PyArray_STRIDE(a, d) % PyArray_ITEMSIZE(a) != 0) return 0;
    return 1;
}

/* Notes that the call reads x (if an array) under `name`: out must share no
 * memory with it. Every argument read goes through here, as given and as
 * converted (a converted array may be a view of what was given). */
static int reads(struct call *c, PyObject *x, const char *name) {
    if (!PyArray_Check(x)) return 1;
    for (int i = 0; i < c->n_inputs; i++)
        if (c->inputs[i].a == (PyArrayObject *)x) return 1;
    if (c->n_inputs == MAX_INPUTS) {
        PyErr_Format(PyExc_RuntimeError, "%s: internal error: too many inputs", c->fn);
        return 0;
    }
    c->inputs[c->n_inputs].a = (PyArrayObject *)x;
    c->inputs[c->n_inputs++].name = name;
    return 1;
}

/* x as an array: itself where the core reads it in place, else what the
 * registered conversion function makes of it (a borrowed reference either
 * way; NULL with the conversion's error). */
static PyArrayObject *array_of(struct call *c, PyObject *x, const char *name, int bool_ok) {
    if (!reads(c, x, name)) return NULL;
    if (readable(x, bool_ok)) return (PyArrayObject *)x;
    if (!converter) {
        PyErr_Format(PyExc_RuntimeError, "%s: internal error: no conversion function registered", c->fn);
        return NULL;
    }
    PyObject *a = own(c, PyObject_CallFunction(converter, "ssO", c->fn, name, x));
    if (!a) return NULL;
    if (!PyArray_Check(a)) {
        PyErr_Format(PyExc_RuntimeError, "%s: internal error: %s was not converted to an array", c->fn, name);
        return NULL;
    }
    return reads(c, a, name) ? (PyArrayObject *)a : NULL;
}

/* The last part of a type's name, as type(x).__name__. */
static const char *type_name(PyObject *x) {
    const char *name = Py_TYPE(x)->tp_name, *dot = strrchr(name, '.');
    return dot ? dot + 1 : name;
}

static PyObject *tuple_of(const npy_intp *dims, int nd) {
    PyObject *t = PyTuple_New(nd);
    for (int d = 0; t && d < nd; d++) {
        PyObject *n = PyLong_FromSsize_t(dims[d]);
        if (!n) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, d, n);
    }
    return t;
}

static PyObject *shape_of(PyArrayObject *a) { return tuple_of(PyArray_DIMS(a), PyArray_NDIM(a)); }

/* Raises exc with "fn: " + the message fmt makes of one object (a new
 * reference, consumed; NULL passes its error through). Returns 0. */
static int raise_with(struct call *c, PyObject *exc, const char *fmt, PyObject *x) {
    if (x) {
        PyObject *m = PyUnicode_FromFormat(fmt, x);
        if (m) {
            PyErr_Format(exc, "%s: %U", c->fn, m);
            Py_DECREF(m);
        }
        Py_DECREF(x);
    }
    return 0;
}

/* At most n characters of repr(x), or of str(x) (a number as it prints). */
static PyObject *shortened(PyObject *r, Py_ssize_t n);
static PyObject *short_repr(PyObject *x, Py_ssize_t n) { return shortened(PyObject_Repr(x), n); }
static PyObject *short_str(PyObject *x, Py_ssize_t n) { return shortened(PyObject_Str(x), n); }
static PyObject *shortened(PyObject *r, Py_ssize_t n) {
    if (!r || PyUnicode_GET_LENGTH(r) <= n) return r;
    PyObject *cut = PyUnicode_Substring(r, 0, n);
    Py_DECREF(r);
    return cut;
}

/* "got q (..), k (..), v (..)": the shapes of q, k and v, for a message. */
static PyObject *got_shapes(struct call *c) {
    PyObject *q = shape_of(c->q.a), *k = shape_of(c->k.a), *v = c->v.a ? shape_of(c->v.a) : NULL, *got = NULL;
    const char *kn = name_of(c, OPT_k), *vn = name_of(c, OPT_v);
    if (q && k && (v || !c->v.a))
        got = v ? PyUnicode_FromFormat("got q %S, %s %S, %s %S", q, kn, k, vn, v)
                : PyUnicode_FromFormat("got q %S, %s %S", q, kn, k);
    Py_XDECREF(q);
    Py_XDECREF(k);
    Py_XDECREF(v);
    return got;
}

/* Whether rank-4 q, k (and v) keep the rules of heads and rows, read as
 * (B, H, L, D), or with `swapped` as (B, L, H, D), as models store them. */
static int heads_and_rows_fit(const struct call *c, int swapped) {
    PyArrayObject *ops[3] = {c->q.a, c->k.a, c->v.a};
    int n = c->v.a ? 3 : 2, h = swapped ? 2 : 1, r = swapped ? 1 : 2;
    for (int i = 0; i < n; i++)
        if (!ops[i] || PyArray_NDIM(ops[i]) != 4) return 0;
    const npy_intp *qs = PyArray_DIMS(c->q.a), *ks = PyArray_DIMS(c->k.a);
    if (ks[h] < 1 || qs[h] % ks[h] != 0 || qs[3] != ks[3]) return 0;
    if (c->v.a) {
        const npy_intp *vs = PyArray_DIMS(c->v.a);
        if (vs[h] != ks[h] || vs[r] != ks[r]) return 0;
    }
    return 1;
}

/* A rule of q's, k's and v's shapes broken: ValueError with their shapes, and
 * a hint where the shapes fit once read as (B, L, H, D). */
static int shapes_break(struct call *c, const char *rule) {
    PyObject *got = got_shapes(c);
    if (got) {
        const char *hint = !c->paged && !heads_and_rows_fit(c, 0) && heads_and_rows_fit(c, 1)
                               ? "; if your arrays are (B, L, H, D), pass x.transpose(0, 2, 1, 3): no copy is made"
                               : "";
        PyErr_Format(PyExc_ValueError, "%s: %s; %U%s", c->fn, rule, got, hint);
        Py_DECREF(got);
    }
    return 0;
}

/* An array operand: a TypeError naming it unless its dtype is one the core computes. */
static int float_dtype(struct call *c, PyArrayObject *a, const char *name) {
    if (core_dtype(a) >= 0) return 1;
    PyArray_Descr *d = PyArray_DESCR(a);
    if (d->kind == 'f' && PyDataType_ELSIZE(d) > 8)
        PyErr_Format(PyExc_TypeError, "%s: %s has dtype %S; the widest dtype computed is float64", c->fn, name, d);
    else
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of floats, got dtype %S", c->fn, name, d);
    return 0;
}

/* Fills t from operand o whose last `tail` dims are (heads, rows, cols), or
 * (heads, rows) for tail 2, the rest batch dims broadcast against c->batch.
 * Dims the array lacks, and dims of size 1, get stride 0. */
static void describe(struct call *c, struct operand *o, struct npattn_tensor *t, int dtype, int tail) {
    PyArrayObject *a = o->a;
    int nd = PyArray_NDIM(a);
    npy_intp item = PyArray_ITEMSIZE(a);
#define STRIDE(ax) ((ax) >= 0 && PyArray_DIM(a, ax) != 1 ? (int64_t)(PyArray_STRIDE(a, ax) / item) : 0)
    t->data = PyArray_DATA(a);
    t->dtype = (enum npattn_dtype)dtype;
    t->head_stride = STRIDE(nd - tail);
    t->row_stride = STRIDE(nd - tail + 1);
    t->col_stride = tail == 3 ? STRIDE(nd - 1) : 0;
    int own_dims = nd > tail ? nd - tail : 0;
    for (int d = 0; d < c->nb; d++) o->batch_stride[d] = STRIDE(d - (c->nb - own_dims));
#undef STRIDE
    t->batch_stride = o->batch_stride;
}

/* Broadcasts the leading dims of a (before its last `tail`) into c->batch. */
static int broadcast_batch(struct call *c, PyArrayObject *a, int tail) {
    int own_dims = PyArray_NDIM(a) - tail;
    if (own_dims <= 0) return 1;
    if (own_dims > c->nb) {
        for (int d = c->nb - 1; d >= 0; d--) c->batch[d + own_dims - c->nb] = c->batch[d];
        for (int d = 0; d < own_dims - c->nb; d++) c->batch[d] = 1;
        c->nb = own_dims;
    }
    for (int d = 0; d < own_dims; d++) {
        npy_intp n = PyArray_DIM(a, d);
        int64_t *b = &c->batch[c->nb - own_dims + d];
        if (n == *b || n == 1) continue;
        if (*b != 1) return shapes_break(c, "the batch dims of q, k and v do not broadcast");
        *b = n;
    }
    return 1;
}

/* ---- reading the arguments ---- */

/* Option o as an array of floats the core reads (converted where it cannot
 * read it in place); NULL with the error naming it. */
static PyArrayObject *float_array(struct call *c, enum option o) {
    const char *name = name_of(c, o);
    PyObject *x = c->opt[o];
    if (x == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of floats, got None", c->fn, name);
        return NULL;
    }
    PyArrayObject *a = array_of(c, x, name, 0);
    return a && float_dtype(c, a, name) ? a : NULL;
}

/* q, k or v: an array of floats of rank >= 2. */
static int read_operand(struct call *c, enum option o, struct operand *op) {
    const char *name = name_of(c, o);
    PyArrayObject *a = float_array(c, o);
    if (!a) return 0;
    if (PyArray_NDIM(a) < 2) {
        PyObject *got = shape_of(a);
        if (got) PyErr_Format(PyExc_ValueError, "%s: %s must have rank >= 2 (..., L, D), got shape %S", c->fn, name, got);
        Py_XDECREF(got);
        return 0;
    }
    op->a = a;
    return 1;
}

/* q, k and (if has_v) v, whose shared sizes agree. */
static int read_qkv(struct call *c, int has_v) {
    if (!read_operand(c, OPT_q, &c->q) || !read_operand(c, OPT_k, &c->k) || (has_v && !read_operand(c, OPT_v, &c->v)))
        return 0;
    int nq = PyArray_NDIM(c->q.a), nk = PyArray_NDIM(c->k.a), nv = has_v ? PyArray_NDIM(c->v.a) : 2;
    c->rank2 = nq == 2 && nk == 2 && nv == 2;
    npy_intp *qs = PyArray_DIMS(c->q.a), *ks = PyArray_DIMS(c->k.a);
    npy_intp H_q = nq > 2 ? qs[nq - 3] : 1, H_kv = nk > 2 ? ks[nk - 3] : 1;
    if (ks[nk - 1] != qs[nq - 1]) return shapes_break(c, "k's row width D must equal q's");
    c->result = promote(core_dtype(c->q.a), core_dtype(c->k.a));
    if (has_v) {
        npy_intp *vs = PyArray_DIMS(c->v.a);
        if (vs[nv - 2] != ks[nk - 2]) return shapes_break(c, "v must have as many rows S as k");
        if ((nv > 2 ? vs[nv - 3] : 1) != H_kv) return shapes_break(c, "v must have as many heads as k");
        c->result = promote(c->result, core_dtype(c->v.a));
    }
    c->nb = 0;
    if (!broadcast_batch(c, c->q.a, 3) || !broadcast_batch(c, c->k.a, 3) || (has_v && !broadcast_batch(c, c->v.a, 3)))
        return 0;
    struct npattn_problem *p = &c->p;
    p->n_batch_dim = c->nb;
    p->batch_shape = c->batch;
    p->n_head_q = H_q;
    p->n_head_kv = H_kv;
    p->n_query = qs[nq - 2];
    p->n_key = ks[nk - 2];
    p->n_embd_k = qs[nq - 1];
    p->n_embd_v = has_v ? PyArray_DIM(c->v.a, nv - 1) : 0;
    describe(c, &c->q, &p->q, core_dtype(c->q.a), 3);
    describe(c, &c->k, &p->k, core_dtype(c->k.a), 3);
    if (has_v) describe(c, &c->v, &p->v, core_dtype(c->v.a), 3);
    return 1;
}

static PyObject *numbers_real; /* numbers.Real, imported when first needed */
static PyObject *zero_int;     /* 0, made at import */

/* A real number (never a bool) as a double: 1; not a real number: 0; an
 * error: -1. A value beyond the range of a double reads as infinity. */
static int real_of(PyObject *x, double *v) {
    if (PyBool_Check(x) || PyArray_IsScalar(x, Bool)) return 0;
    if (!(PyFloat_Check(x) || PyLong_Check(x) || PyArray_IsScalar(x, Floating) || PyArray_IsScalar(x, Integer))) {
        if (PyArray_Check(x) || PyArray_IsScalar(x, Generic)) return 0;
        if (!numbers_real) {
            PyObject *m = PyImport_ImportModule("numbers");
            if (!m) return -1;
            numbers_real = PyObject_GetAttrString(m, "Real");
            Py_DECREF(m);
            if (!numbers_real) return -1;
        }
        int real = PyObject_IsInstance(x, numbers_real);
        if (real <= 0) return real;
    }
    *v = PyFloat_AsDouble(x);
    if (*v == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        PyObject *zero = PyLong_FromLong(0);
        int negative = zero ? PyObject_RichCompareBool(x, zero, Py_LT) : -1;
        Py_XDECREF(zero);
        if (negative < 0) return -1;
        *v = negative ? -INFINITY : INFINITY; /* the core refuses it, by its rule */
    }
    return 1;
}

/* An int64 from a Python or NumPy integer (never a bool), at least `low`
 * (INT64_MIN or 0); else the error that names it. */
static int read_int64(struct call *c, PyObject *x, const char *name, int64_t low, int64_t *v) {
    if (PyBool_Check(x) || !(PyLong_Check(x) || PyArray_IsScalar(x, Integer))) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, got %s", c->fn, name, type_name(x));
        return 0;
    }
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (n == -1 && PyErr_Occurred()) return 0;
    if (overflow || n < low) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be an int from %s to 2**63 - 1, got %S", c->fn, name,
                     low == 0 ? "0" : "-2**63", x);
        return 0;
    }
    *v = (int64_t)n;
    return 1;
}

/* scale: a real number, a 0-d array of one, or None (1 / sqrt(D)). */
static int read_scale(struct call *c) {
    PyObject *x = c->opt[OPT_scale];
    struct npattn_problem *p = &c->p;
    if (x == Py_None) {
        p->scale = 1.0 / sqrt((double)p->n_embd_k);
        return 1;
    }
    int real = real_of(x, &p->scale);
    if (real == 0 && !PyArray_IsScalar(x, Generic) && PyObject_HasAttrString(x, "shape")) {
        /* a 0-d array of NumPy, MLX or PyTorch */
        PyArrayObject *a = array_of(c, x, "scale", 1);
        if (!a) return 0;
        if (PyArray_NDIM(a) != 0)
            return raise_with(c, PyExc_TypeError, "scale must be a real number or a 0-d array, got an array of shape %S",
                              shape_of(a));
        PyObject *scalar = own(c, PyArray_ToScalar(PyArray_DATA(a), a));
        if (!scalar) return 0;
        x = scalar;
        real = real_of(x, &p->scale);
    }
    if (real < 0) return 0;
    if (real == 0) {
        PyErr_Format(PyExc_TypeError, "%s: scale must be a real number or None, got %s", c->fn, type_name(x));
        return 0;
    }
    c->opt[OPT_scale] = x; /* as read, for a message */
    return 1;
}

/* mask: None, "causal", "causal_top_left", or a bool or float array that
 * broadcasts to (*B, H_q, L, S) without growing B. */
static int read_mask(struct call *c) {
    PyObject *mask = c->opt[OPT_mask];
    struct npattn_problem *p = &c->p;
    p->mask_kind = NPATTN_MASK_NONE;
    if (mask == Py_None) return 1;
    if (PyUnicode_Check(mask)) {
        if (PyUnicode_CompareWithASCIIString(mask, "causal") == 0) {
            p->causal = 1;
        } else if (PyUnicode_CompareWithASCIIString(mask, "causal_top_left") == 0) {
            p->causal = c->top_left = 1;
        } else {
            PyErr_Format(PyExc_ValueError, "%s: mask must be \"causal\", \"causal_top_left\"%s, got %R", c->fn,
                         c->paged ? " or None" : ", None or an array", mask);
            return 0;
        }
        return 1;
    }
    if (PyBool_Check(mask) || PyLong_Check(mask) || PyFloat_Check(mask) || PyComplex_Check(mask) || PyBytes_Check(mask) ||
        PyArray_IsScalar(mask, Generic)) {
        PyErr_Format(PyExc_TypeError, "%s: mask must be a string, None, or a bool or float array, got %s", c->fn,
                     type_name(mask));
        return 0;
    }
    PyArrayObject *m = array_of(c, mask, "mask", 1);
    if (!m) return 0;
    int is_bool = PyArray_TYPE(m) == NPY_BOOL;
    if (!is_bool && core_dtype(m) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: mask must be a bool or float array, got dtype %S", c->fn, PyArray_DESCR(m));
        return 0;
    }
    int nd = PyArray_NDIM(m), fits = nd <= c->nb + 3;
    npy_intp full[NPY_MAXDIMS + 3];
    for (int d = 0; d < c->nb; d++) full[d] = (npy_intp)c->batch[d];
    full[c->nb] = (npy_intp)p->n_head_q, full[c->nb + 1] = (npy_intp)p->n_query, full[c->nb + 2] = (npy_intp)p->n_key;
    for (int d = 0; fits && d < nd; d++) {
        npy_intp n = PyArray_DIM(m, d), want = full[c->nb + 3 - nd + d];
        fits = n == want || n == 1;
    }
    if (!fits) {
        PyObject *f = tuple_of(full, c->nb + 3), *got = shape_of(m);
        if (f && got)
            PyErr_Format(PyExc_ValueError, "%s: mask must broadcast to (*B, H_q, L, S) = %S, got shape %S", c->fn, f, got);
        Py_XDECREF(f);
        Py_XDECREF(got);
        return 0;
    }
    c->mask.a = m;
    p->mask_kind = is_bool ? NPATTN_MASK_BOOL : NPATTN_MASK_ADD;
    describe(c, &c->mask, &p->mask, is_bool ? NPATTN_DTYPE_F32 : core_dtype(m), 3);
    return 1;
}

/* sinks: None, or H_q real numbers, read as float64. */
static int read_sinks(struct call *c) {
    PyObject *x = c->opt[OPT_sinks];
    struct npattn_problem *p = &c->p;
    p->sinks = NULL;
    if (x == Py_None) return 1;
    PyArrayObject *s = (PyArrayObject *)x;
    if (!reads(c, x, "sinks")) return 0;
    if (!(PyArray_Check(x) && PyArray_TYPE(s) == NPY_FLOAT64 && PyArray_NDIM(s) == 1 &&
          PyArray_DIM(s, 0) == p->n_head_q && PyArray_IS_C_CONTIGUOUS(s) && PyArray_ISALIGNED(s) &&
          PyArray_ISNOTSWAPPED(s))) {
        if (!(s = array_of(c, x, "sinks", 1))) return 0;
        char kind = PyArray_DESCR(s)->kind;
        if (!(kind == 'f' || kind == 'i' || kind == 'u' || core_dtype(s) == NPATTN_DTYPE_BF16)) {
            PyErr_Format(PyExc_TypeError, "%s: sinks must be real numbers, got dtype %S", c->fn, PyArray_DESCR(s));
            return 0;
        }
        if (PyArray_NDIM(s) != 1 || PyArray_DIM(s, 0) != p->n_head_q) {
            PyObject *got = shape_of(s);
            if (got)
                PyErr_Format(PyExc_ValueError, "%s: sinks must have shape (H_q,) = (%lld,), got %S", c->fn,
                             (long long)p->n_head_q, got);
            Py_XDECREF(got);
            return 0;
        }
        /* a small aligned float64 copy the core reads */
        s = (PyArrayObject *)own(c, PyArray_FromAny((PyObject *)s, PyArray_DescrFromType(NPY_FLOAT64), 1, 1,
                                                    NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST, NULL));
        if (!s) return 0;
    }
    p->sinks = PyArray_DATA(s);
    return 1;
}

/* window: None, or a pair (left, right) of ints >= 0 or None. */
static int read_window(struct call *c) {
    PyObject *window = c->opt[OPT_window];
    struct npattn_problem *p = &c->p;
    p->window_left = p->window_right = NPATTN_UNBOUNDED;
    if (window == Py_None) return 1;
    if (!(PyTuple_Check(window) || PyList_Check(window)) || PySequence_Fast_GET_SIZE(window) != 2)
        return raise_with(c, PyExc_TypeError, "window must be None or a pair (left, right) of ints >= 0 or None, got %U",
                          short_repr(window, 60));
    int64_t *side[2] = {&p->window_left, &p->window_right};
    for (int i = 0; i < 2; i++) {
        PyObject *w = PySequence_Fast_GET_ITEM(window, i);
        if (w != Py_None && !read_int64(c, w, i ? "window[1]" : "window[0]", 0, side[i])) return 0;
    }
    return 1;
}

/* softcap: None (no cap) or a real number > 0 (the core refuses one that is
 * not finite). */
static int read_softcap(struct call *c) {
    PyObject *x = c->opt[OPT_softcap];
    c->p.softcap = 0;
    if (x == Py_None) return 1;
    int real = real_of(x, &c->p.softcap);
    if (real < 0) return 0;
    if (real == 0) {
        PyErr_Format(PyExc_TypeError, "%s: softcap must be a real number > 0 or None, got %s", c->fn, type_name(x));
        return 0;
    }
    if (c->p.softcap <= 0) c->p.softcap = -1; /* 0 means no cap to the core: refused as negative */
    return 1;
}

static PyArrayObject *new_array(struct call *c, const npy_intp *shape, int nd, int npy_type, const char *what);

/* x, an int or an array of ints of any integer dtype (a Python int beyond
 * int64 too, which NumPy holds as an object), as an array; NULL with the
 * error naming it, `what` saying what it must be. */
static PyArrayObject *int_array(struct call *c, PyObject *x, const char *name, const char *what) {
    PyArrayObject *a = (PyArrayObject *)own(c, PyArray_FromAny(x, NULL, 0, 0, 0, NULL));
    if (!a || !reads(c, x, name) || !reads(c, (PyObject *)a, name)) return NULL;
    const char kind = PyArray_DESCR(a)->kind;
    if (kind == 'i' || kind == 'u') return a;
    if (kind == 'O') { /* only ints */
        PyArrayObject *flat = (PyArrayObject *)own(c, PyArray_Ravel(a, NPY_CORDER));
        if (!flat) return NULL;
        PyObject **items = PyArray_DATA(flat);
        npy_intp n = PyArray_SIZE(flat), i = 0;
        while (i < n && !PyBool_Check(items[i]) && (PyLong_Check(items[i]) || PyArray_IsScalar(items[i], Integer))) i++;
        if (i == n) return a;
        PyErr_Format(PyExc_TypeError, "%s: %s must be %s, got dtype object holding %s", c->fn, name, what,
                     type_name(items[i]));
        return NULL;
    }
    PyErr_Format(PyExc_TypeError, "%s: %s must be %s, got dtype %S", c->fn, name, what, PyArray_DESCR(a));
    return NULL;
}

/* Element i (C order) of a, an array int_array read, as an int64: 1; 0 if
 * it lies beyond int64 (a Python int, or a uint64 past 2**63 - 1). */
static int int64_at(PyArrayObject *a, npy_intp i, int64_t *v) {
    PyObject *x = PyArray_GETITEM(a, PyArray_GETPTR1(a, i));
    if (!x) return -1;
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(x, &overflow);
    Py_DECREF(x);
    if (n == -1 && PyErr_Occurred()) return -1;
    *v = (int64_t)n;
    return !overflow;
}

/* The request that element i (C order) of a, broadcast to the batch shape,
 * first reaches: its flat index. */
static int64_t request_of(const struct call *c, PyArrayObject *a, npy_intp i) {
    const int nd = PyArray_NDIM(a);
    int64_t b = 0, step = 1;
    for (int d = c->nb - 1; d >= 0; d--) {
        const int ad = d - (c->nb - nd);
        npy_intp digit = 0;
        if (ad >= 0) digit = i % PyArray_DIM(a, ad), i /= PyArray_DIM(a, ad);
        b += (int64_t)digit * step, step *= c->batch[d];
    }
    return b;
}

static void request_index(const struct call *c, int64_t b, char *index);
#define REQUEST_INDEX (24 * NPY_MAXDIMS + 3)

/* x, an int or an array of ints (any integer dtype) broadcastable to the
 * batch shape B, one per request (k_start, k_lengths, q_offset,
 * context_lens): a new C-contiguous int64 copy of shape B owned by the call,
 * its data (NULL with the error naming it; a value beyond int64 named with
 * its request). Memory O(B). */
static const int64_t *read_per_request(struct call *c, PyObject *x, const char *name) {
    PyArrayObject *a = int_array(c, x, name, "an int or an array of ints");
    if (!a) return NULL;
    npy_intp want[NPY_MAXDIMS];
    int nd = PyArray_NDIM(a), fits = nd <= c->nb;
    for (int d = 0; d < c->nb; d++) want[d] = (npy_intp)c->batch[d];
    for (int d = 0; fits && d < nd; d++) fits = PyArray_DIM(a, d) == 1 || PyArray_DIM(a, d) == want[c->nb - nd + d];
    if (!fits) {
        PyObject *batch = tuple_of(want, c->nb), *got = shape_of(a);
        if (batch && got)
            PyErr_Format(PyExc_ValueError, "%s: %s must broadcast to the batch shape B = %S, got shape %S", c->fn, name,
                         batch, got);
        Py_XDECREF(batch);
        Py_XDECREF(got);
        return NULL;
    }
    const char kind = PyArray_DESCR(a)->kind;
    if (kind == 'O' || (kind == 'u' && PyArray_ITEMSIZE(a) == 8)) { /* values that may lie beyond int64 */
        PyArrayObject *flat = (PyArrayObject *)own(c, PyArray_Ravel(a, NPY_CORDER));
        PyArrayObject *values = flat ? (PyArrayObject *)own(c, PyArray_NewLikeArray(a, NPY_CORDER,
                                                                                      PyArray_DescrFromType(NPY_INT64), 0))
                                     : NULL;
        if (!values) return NULL;
        int64_t *v = PyArray_DATA(values);
        for (npy_intp i = 0; i < PyArray_SIZE(flat); i++) {
            const int fits64 = int64_at(flat, i, &v[i]);
            if (fits64 < 0) return NULL;
            if (fits64) continue;
            char index[REQUEST_INDEX];
            request_index(c, request_of(c, a, i), index);
            PyObject *given = PyArray_GETITEM(flat, PyArray_GETPTR1(flat, i));
            if (given)
                PyErr_Format(PyExc_ValueError, "%s: %s%s = %S lies outside int64, [-2**63, 2**63 - 1]", c->fn, name,
                             index, given);
            Py_XDECREF(given);
            return NULL;
        }
        a = values;
    }
    PyArrayObject *copy = new_array(c, want, c->nb, NPY_INT64, name);
    return copy && PyArray_CopyInto(copy, a) == 0 ? PyArray_DATA(copy) : NULL;
}

/* The entries of a request's row of the block table that the core reads:
 * those of the pages that hold its `length` keys; none where the length or
 * the page size breaks its rule (the core refuses the call before it reads
 * the table). */
static int64_t live_pages(int64_t length, int64_t page_size, int64_t max_pages) {
    if (page_size < 1 || length < 0 || length / page_size > max_pages) return 0;
    const int64_t n = length / page_size + (length % page_size != 0);
    return n <= max_pages ? n : 0;
}

/* paged_attention's block_table, (B, max_pages) ints of any integer dtype,
 * strides and size: the live entries alone (live_pages), copied as int64
 * into a table of B rows as wide as the longest, the rest -1
 * (pages->table_stride). The
 * dead entries are never read: a broadcast view of any width costs no more
 * than its live entries, and a dead one may hold anything (a Python int
 * beyond int64 too). A live entry beyond int64 becomes -1, which the core
 * refuses, and refused() names it with its value as given (c->table). */
static int read_block_table(struct call *c, struct npattn_pages *pages) {
    PyArrayObject *a = int_array(c, c->opt[OPT_block_table], "block_table", "an array of ints");
    if (!a) return 0;
    const npy_intp B = (npy_intp)c->batch[0];
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 0) != B) {
        PyObject *got = shape_of(a);
        if (got)
            PyErr_Format(PyExc_ValueError, "%s: block_table must have shape (B, max_pages) with B = %lld, got %S", c->fn,
                         (long long)B, got);
        Py_XDECREF(got);
        return 0;
    }
    const int typed = PyArray_DESCR(a)->kind != 'O';
    if (typed && !(a = (PyArrayObject *)own(c, PyArray_FromAny((PyObject *)a, NULL, 0, 0, NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED, NULL))))
        return 0;
    const int64_t max_pages = PyArray_DIM(a, 1), page_size = pages->page_size, *length = c->p.k_length;
    int64_t widest = 0;
    for (npy_intp b = 0; b < B; b++) {
        const int64_t n = live_pages(length[b], page_size, max_pages);
        widest = n > widest ? n : widest;
    }
    const npy_intp shape[2] = {B, (npy_intp)widest};
    PyArrayObject *table = new_array(c, shape, 2, NPY_INT64, "block_table");
    if (!table) return 0;
    int64_t *at = PyArray_DATA(table);
    const char kind = PyArray_DESCR(a)->kind;
    const int size = (int)PyArray_ITEMSIZE(a);
    for (npy_intp b = 0; b < B; b++) {
        const int64_t n = live_pages(length[b], page_size, max_pages);
        for (npy_intp i = 0; i < widest; i++) {
            int64_t v = -1;
            const char *e = i < n ? PyArray_GETPTR2(a, b, i) : NULL;
            if (!e) {
            } else if (!typed) {
                int overflow = 0;
                long long n64 = PyLong_AsLongLongAndOverflow(*(PyObject *const *)e, &overflow);
                if (n64 == -1 && PyErr_Occurred()) return 0;
                v = overflow ? -1 : (int64_t)n64;
            } else if (kind == 'i') {
                v = size == 1 ? *(const int8_t *)e : size == 2 ? *(const int16_t *)e : size == 4 ? *(const int32_t *)e
                                                                                                 : *(const int64_t *)e;
            } else {
                const uint64_t u = size == 1 ? *(const uint8_t *)e : size == 2 ? *(const uint16_t *)e
                                   : size == 4 ? *(const uint32_t *)e : *(const uint64_t *)e;
                v = u > (uint64_t)INT64_MAX ? -1 : (int64_t)u;
            }
            at[b * widest + i] = v;
        }
    }
    c->table = a;
    pages->block_table = at;
    pages->max_pages = max_pages;
    pages->table_stride = widest;
    return 1;
}

/* q_offset (None: the core's default, the bottom-right corner; 0 with
 * mask="causal_top_left"; an int array: one per request), k_offset, k_start
 * and k_lengths. */
static int read_offsets(struct call *c) {
    PyObject *q_offset = c->opt[OPT_q_offset];
    struct npattn_problem *p = &c->p;
    const int scalar = q_offset == Py_None || PyLong_Check(q_offset) || PyFloat_Check(q_offset) ||
                       PyArray_IsScalar(q_offset, Generic) || PyUnicode_Check(q_offset) ||
                       !(PyArray_Check(q_offset) || PySequence_Check(q_offset) || PyObject_HasAttrString(q_offset, "__array__"));
    p->q_offset = 0;
    p->q_bottom_right = q_offset == Py_None && !c->top_left;
    if (q_offset != Py_None) {
        if (scalar && !read_int64(c, q_offset, "q_offset", INT64_MIN, &p->q_offset)) return 0;
        if (!scalar && !(p->q_offsets = read_per_request(c, q_offset, "q_offset"))) return 0;
        if (c->top_left) {
            PyErr_Format(PyExc_ValueError,
                         "%s: q_offset cannot be given with mask=\"causal_top_left\", which means q_offset=0; "
                         "use mask=\"causal\" with q_offset=%S",
                         c->fn, q_offset);
            return 0;
        }
    }
    if (!read_int64(c, c->opt[OPT_k_offset], "k_offset", INT64_MIN, &p->k_offset)) return 0;
    PyObject *k_start = c->opt[OPT_k_start], *k_lengths = c->opt[OPT_k_lengths];
    if (k_start != Py_None && !(p->k_start = read_per_request(c, k_start, "k_start"))) return 0;
    if (k_lengths != Py_None && !(p->k_length = read_per_request(c, k_lengths, "k_lengths"))) return 0;
    return 1;
}

/* threads: an int from 1 to NPATTN_MAX_THREADS, or None: 0, the core's
 * default (NPATTN_NUM_THREADS where set, else the CPUs). */
static int read_threads(struct call *c) {
    PyObject *x = c->opt[OPT_threads];
    int64_t n;
    c->p.n_threads = 0;
    if (x == Py_None) return 1;
    if (PyBool_Check(x) || !(PyLong_Check(x) || PyArray_IsScalar(x, Integer))) {
        PyErr_Format(PyExc_TypeError, "%s: threads must be an int >= 1 or None, got %s", c->fn, type_name(x));
        return 0;
    }
    int overflow = 0;
    n = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (n == -1 && PyErr_Occurred()) return 0;
    if (overflow || n < 1 || n > NPATTN_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be an int from 1 to %d, got %S", c->fn, NPATTN_MAX_THREADS, x);
        return 0;
    }
    c->p.n_threads = (int32_t)n;
    return 1;
}

/* paged_attention's operands: q (B, H_q, L, D); key_pages (P, H_kv,
 * page_size, D) and value_pages (P, H_kv, page_size, D_v), any strides;
 * block_table (B, max_pages) and context_lens (B,) of ints; page_size None
 * or key_pages.shape[2]. The pages are described in place, the page dim
 * taking the place of a batch dim; the tables as int64 copies, O(B *
 * max_pages). The core checks the live entries. */
static int read_paged(struct call *c) {
    if (!read_operand(c, OPT_q, &c->q) || !read_operand(c, OPT_k, &c->k) || !read_operand(c, OPT_v, &c->v)) return 0;
    PyArrayObject *q = c->q.a, *k = c->k.a, *v = c->v.a;
    if (PyArray_NDIM(q) != 4 || PyArray_NDIM(k) != 4 || PyArray_NDIM(v) != 4)
        return shapes_break(c, "q must be (B, H_q, L, D), key_pages (P, H_kv, page_size, D) and value_pages "
                               "(P, H_kv, page_size, D_v)");
    const npy_intp *qs = PyArray_DIMS(q), *ks = PyArray_DIMS(k), *vs = PyArray_DIMS(v);
    if (ks[3] != qs[3]) return shapes_break(c, "key_pages' row width D must equal q's");
    if (vs[0] != ks[0] || vs[1] != ks[1] || vs[2] != ks[2])
        return shapes_break(c, "value_pages must have key_pages' pages, heads and page size (P, H_kv, page_size)");
    PyObject *ps = c->opt[OPT_page_size];
    int64_t page_size = ks[2];
    if (ps != Py_None) {
        if (!read_int64(c, ps, "page_size", 0, &page_size)) return 0;
        if (page_size != ks[2]) {
            PyErr_Format(PyExc_ValueError, "%s: page_size = %lld must equal key_pages.shape[2] = %lld", c->fn,
                         (long long)page_size, (long long)ks[2]);
            return 0;
        }
    }
    c->result = promote(promote(core_dtype(q), core_dtype(k)), core_dtype(v));
    c->nb = 1;
    c->batch[0] = qs[0];

    struct npattn_problem *p = &c->p;
    if (!(p->k_length = read_per_request(c, c->opt[OPT_context_lens], "context_lens"))) return 0;
    c->pages.n_page = ks[0];
    c->pages.page_size = page_size;
    if (!read_block_table(c, &c->pages)) return 0;

    p->pages = &c->pages;
    p->n_batch_dim = 1;
    p->batch_shape = c->batch;
    p->n_head_q = qs[1];
    p->n_head_kv = ks[1];
    p->n_query = qs[2];
    if (__builtin_mul_overflow(c->pages.max_pages, page_size, &p->n_key)) p->n_key = INT64_MAX; /* refused: S overflows */
    p->n_embd_k = qs[3];
    p->n_embd_v = vs[3];
    describe(c, &c->q, &p->q, core_dtype(q), 3);
    /* the page dim reads as a batch dim; its stride goes to the pages */
    describe(c, &c->k, &p->k, core_dtype(k), 3);
    describe(c, &c->v, &p->v, core_dtype(v), 3);
    c->pages.k_page_stride = c->k.batch_stride[0];
    c->pages.v_page_stride = c->v.batch_stride[0];
    c->k.batch_stride[0] = c->v.batch_stride[0] = 0;
    /* no dense key ranges or key positions: keys sit at 0 .. context_lens[b] - 1 */
    c->opt[OPT_k_offset] = zero_int;
    c->opt[OPT_k_start] = c->opt[OPT_k_lengths] = Py_None;
    PyObject *mask = c->opt[OPT_mask];
    if (mask != Py_None && !PyUnicode_Check(mask)) {
        PyErr_Format(PyExc_TypeError, "%s: mask must be \"causal\", \"causal_top_left\" or None, got %s", c->fn,
                     type_name(mask));
        return 0;
    }
    return 1;
}

/* precision: "highest" or "fast" (SPEC section 11). */
static int read_precision(struct call *c) {
    PyObject *x = c->opt[OPT_precision];
    if (PyUnicode_Check(x) && PyUnicode_CompareWithASCIIString(x, "highest") == 0) {
        c->p.precision = NPATTN_PRECISION_HIGHEST;
    } else if (PyUnicode_Check(x) && PyUnicode_CompareWithASCIIString(x, "fast") == 0) {
        c->p.precision = NPATTN_PRECISION_FAST;
    } else {
        return raise_with(c, PyExc_ValueError, "precision must be \"highest\" or \"fast\", got %U", short_repr(x, 60));
    }
    return 1;
}

/* Every option but the arrays of results, in the order the docs list them. */
static int read_options(struct call *c) {
    return read_scale(c) && read_mask(c) && read_sinks(c) && read_window(c) && read_softcap(c) && read_offsets(c) &&
           read_precision(c) && read_threads(c);
}

/* ---- results ---- */

/* The result's shape: (*B, H_q, rows, last), or (rows, last) for rank-2
 * inputs; with_last 0 drops the last axis. */
static int result_shape(const struct call *c, npy_intp heads, npy_intp rows, npy_intp last, int with_last,
                        npy_intp *shape) {
    int nd = 0;
    if (!c->rank2) {
        for (int d = 0; d < c->nb; d++) shape[nd++] = (npy_intp)c->batch[d];
        shape[nd++] = heads;
    }
    shape[nd++] = rows;
    if (with_last) shape[nd++] = last;
    return nd;
}

/* A new C-contiguous array, owned by the call; NULL with the error naming
 * `what` and its shape. */
static PyArrayObject *new_array(struct call *c, const npy_intp *shape, int nd, int npy_type, const char *what) {
    PyArray_Descr *d = PyArray_DescrFromType(npy_type);
    if (!d) return NULL;
    /* more bytes than the machine's memory and swap: refused before an
     * overcommitting kernel could promise them (more than an array can
     * index is NumPy's ValueError, below) */
    double bytes = (double)PyDataType_ELSIZE(d);
    for (int i = 0; i < nd; i++) bytes *= (double)shape[i];
    /* the system asked only for a large result: a call's usual one costs no syscall */
    const double limit = bytes > 1073741824.0 ? (double)npattn_memory_limit() : 0;
    const int beyond = limit > 0 && bytes > limit && bytes < 9.2e18;
    int memory = 1;
    PyObject *a = NULL;
    if (!beyond) {
        Py_INCREF(d); /* PyArray_NewFromDescr steals it */
        a = PyArray_NewFromDescr(&PyArray_Type, d, nd, (npy_intp *)shape, NULL, NULL, 0, NULL);
        if (a) {
            Py_DECREF(d);
            return (PyArrayObject *)own(c, a);
        }
        memory = PyErr_ExceptionMatches(PyExc_MemoryError);
        PyErr_Clear();
    }
    PyObject *t = tuple_of(shape, nd);
    if (t) {
        char size[96]; /* PyErr_Format has no %g */
        snprintf(size, sizeof size, "%.3g GiB, more than this machine's memory and swap (%.3g GiB)",
                 bytes / 1073741824.0, limit / 1073741824.0);
        if (beyond)
            PyErr_Format(PyExc_MemoryError, "%s: cannot allocate %s, shape %S of %S: %s", c->fn, what, t, d, size);
        else if (memory)
            PyErr_Format(PyExc_MemoryError, "%s: cannot allocate %s, shape %S of %S", c->fn, what, t, d);
        else
            PyErr_Format(PyExc_ValueError, "%s: %s, shape %S of %S, is too large for an array", c->fn, what, t, d);
    }
    Py_XDECREF(t);
    Py_XDECREF(d);
    return NULL;
}

/* sdpa's out: the caller's array, of exactly the result's shape and dtype,
 * writeable and readable in place. */
static int read_out(struct call *c, const npy_intp *shape, int nd) {
    PyObject *out = c->opt[OPT_out];
    if (!PyArray_Check(out)) {
        PyErr_Format(PyExc_TypeError, "%s: out must be a numpy.ndarray or None, got %s", c->fn, type_name(out));
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)out;
    int fits = PyArray_NDIM(a) == nd && core_dtype(a) == c->result;
    for (int d = 0; fits && d < nd; d++) fits = PyArray_DIM(a, d) == shape[d];
    if (!fits) {
        PyObject *want = tuple_of(shape, nd), *got = shape_of(a);
        PyArray_Descr *dt = PyArray_DescrFromType(npy_type_of(c->result));
        if (want && got && dt)
            PyErr_Format(PyExc_ValueError, "%s: out must have the result's shape %S and dtype %S, got shape %S and dtype %S",
                         c->fn, want, dt, got, PyArray_DESCR(a));
        Py_XDECREF(want);
        Py_XDECREF(got);
        Py_XDECREF(dt);
        return 0;
    }
    if (!PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s: out must be writeable, got a read-only array", c->fn);
        return 0;
    }
    if (!readable(out, 0)) {
        PyErr_Format(PyExc_ValueError, "%s: out must be aligned and in native byte order", c->fn);
        return 0;
    }
    c->out.a = a;
    return 1;
}

/* The bytes [*lo, *hi) that a's elements span; 0 for an empty array. */
static int byte_span(PyArrayObject *a, const char **lo, const char **hi) {
    if (PyArray_SIZE(a) == 0) return 0;
    const char *l = PyArray_BYTES(a), *h = l;
    for (int d = 0; d < PyArray_NDIM(a); d++) {
        const npy_intp reach = (PyArray_DIM(a, d) - 1) * PyArray_STRIDE(a, d);
        if (reach < 0) l += reach;
        else h += reach;
    }
    *lo = l, *hi = h + PyArray_ITEMSIZE(a);
    return 1;
}

/* out shares memory with the input `name`: the ValueError. Returns 0. */
static int out_shares(struct call *c, const char *name) {
    PyErr_Format(PyExc_ValueError, "%s: out must not share memory with an input, got out sharing memory with %s", c->fn,
                 name);
    return 0;
}

/* out overlaps none of the arrays the call read, as given or as converted
 * (numpy.may_share_memory's bounds): checked here once for every operand,
 * the core's copies and int arrays included, before anything is written. */
static int out_clear_of_inputs(struct call *c) {
    const char *lo, *hi, *in_lo, *in_hi;
    if (!byte_span(c->out.a, &lo, &hi)) return 1;
    for (int i = 0; i < c->n_inputs; i++)
        if (byte_span(c->inputs[i].a, &in_lo, &in_hi) && in_lo < hi && lo < in_hi) return out_shares(c, c->inputs[i].name);
    return 1;
}

/* ---- running the core, and phrasing its verdict ---- */

/* Request b's index in the batch shape, "[1, 0]" ("" without batch dims). */
static void request_index(const struct call *c, int64_t b, char *index) {
    size_t at = 0;
    int64_t rest = b, digits[NPY_MAXDIMS];
    index[0] = '\0';
    if (c->nb == 0) return;
    for (int d = c->nb - 1; d >= 0; d--) digits[d] = rest % c->batch[d], rest /= c->batch[d];
    for (int d = 0; d < c->nb; d++)
        at += (size_t)snprintf(index + at, REQUEST_INDEX - at, "%s%lld", d ? ", " : "[", (long long)digits[d]);
    snprintf(index + at, REQUEST_INDEX - at, "]");
}

/* Request b's key range broke its rule (status): the error naming the
 * request, "k_lengths[1] = 9 runs past S = 7 (k_start[1] = 2)". */
static void bad_range(struct call *c, enum npattn_status status, int64_t b) {
    const struct npattn_problem *p = &c->p;
    const int64_t start = p->k_start ? p->k_start[b] : 0, length = p->k_length ? p->k_length[b] : 0;
    char index[REQUEST_INDEX];
    request_index(c, b, index);
    if (c->paged)
        PyErr_Format(PyExc_ValueError, "%s: context_lens[%lld] = %lld lies outside [0, max_pages * page_size] = [0, %lld]",
                     c->fn, (long long)b, (long long)length, (long long)p->n_key);
    else if (status == NPATTN_STATUS_BAD_K_START)
        PyErr_Format(PyExc_ValueError, "%s: k_start%s = %lld lies outside [0, S] = [0, %lld]", c->fn, index,
                     (long long)start, (long long)p->n_key);
    else if (length < 0)
        PyErr_Format(PyExc_ValueError, "%s: k_lengths%s = %lld must be at least 0", c->fn, index, (long long)length);
    else
        PyErr_Format(PyExc_ValueError, "%s: k_lengths%s = %lld runs past S = %lld (k_start%s = %lld)", c->fn, index,
                     (long long)length, (long long)p->n_key, index, (long long)start);
}

/* Raises the exception a refused call deserves; returns NULL. bp: the
 * backward problem, or NULL for the forward one. */
static PyObject *refused(struct call *c, enum npattn_status status, const struct npattn_backward_problem *bp) {
    const struct npattn_problem *p = &c->p;
    struct npattn_verdict why = {status, NPATTN_OPERAND_NONE, NPATTN_OPERAND_NONE, -1};
    char rule[200];
    switch (status) {
    case NPATTN_STATUS_CANCELLED:
        /* a daemon thread's call stopped by the interpreter's exit ends the thread quietly */
        if (!PyErr_Occurred() && atomic_load(&shutting_down))
            PyErr_Format(PyExc_SystemExit, "%s: the interpreter is exiting", c->fn);
        else if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyboardInterrupt, "%s: cancelled", c->fn);
        return NULL;
    case NPATTN_STATUS_NO_MEMORY:
        return PyErr_Format(PyExc_MemoryError, "%s: %s", c->fn, npattn_status_string(status));
    case NPATTN_STATUS_BLAS_WRONG:
        return PyErr_Format(PyExc_RuntimeError, "%s: %s", c->fn, npattn_status_string(status));
    default:
        if (bp) npattn_check_backward(bp, &why);
        else npattn_check(p, &why);
    }
    switch (why.status) {
    case NPATTN_STATUS_NO_KV_HEAD: return shapes_break(c, "k needs at least one head"), NULL;
    case NPATTN_STATUS_HEADS_NOT_MULTIPLE:
        snprintf(rule, sizeof rule, "q has %lld heads, not a multiple of k's %lld heads", (long long)p->n_head_q,
                 (long long)p->n_head_kv);
        return shapes_break(c, rule), NULL;
    case NPATTN_STATUS_NO_WIDTH: return shapes_break(c, "q and k need a row width D >= 1"), NULL;
    case NPATTN_STATUS_TOO_LARGE:
        return shapes_break(c, "D and D_v must be at most 2**31 - 1, what one BLAS call takes"), NULL;
    case NPATTN_STATUS_BATCH_OVERFLOW:
        return shapes_break(c, "the batch dims of q, k and v multiply beyond int64"), NULL;
    case NPATTN_STATUS_BAD_SCALE:
        return raise_with(c, PyExc_ValueError, "scale must be finite, got %U", short_str(c->opt[OPT_scale], 40)), NULL;
    case NPATTN_STATUS_BAD_SOFTCAP:
        return raise_with(c, PyExc_ValueError, "softcap must be a finite number > 0, got %U",
                          short_str(c->opt[OPT_softcap], 40)),
               NULL;
    case NPATTN_STATUS_OVERLAPS_ITSELF:
        if (why.operand == NPATTN_OPERAND_OUT) {
            PyArrayObject *a = c->out.a;
            PyObject *strides = tuple_of(PyArray_STRIDES(a), PyArray_NDIM(a)), *shape = shape_of(a);
            if (strides && shape)
                PyErr_Format(PyExc_ValueError, "%s: out must not overlap itself, got strides %S for shape %S", c->fn,
                             strides, shape);
            Py_XDECREF(strides);
            Py_XDECREF(shape);
            return NULL;
        }
        break;
    case NPATTN_STATUS_OVERLAPS:
        if (why.operand == NPATTN_OPERAND_OUT) return out_shares(c, npattn_operand_name(why.other)), NULL;
        break;
    case NPATTN_STATUS_BAD_K_START:
    case NPATTN_STATUS_BAD_K_LENGTH: return bad_range(c, why.status, why.entry), NULL;
    case NPATTN_STATUS_BAD_THREADS_ENV: {
        const char *env = getenv("NPATTN_NUM_THREADS");
        PyObject *text = env ? PyUnicode_DecodeFSDefault(env) : PyUnicode_FromString("");
        if (text)
            PyErr_Format(PyExc_ValueError, "%s: NPATTN_NUM_THREADS must be an int from 1 to %d, got %R", c->fn,
                         NPATTN_MAX_THREADS, text);
        Py_XDECREF(text);
        return NULL;
    }
    case NPATTN_STATUS_BAD_Q_OFFSET: {
        char index[REQUEST_INDEX];
        request_index(c, why.entry, index);
        return PyErr_Format(PyExc_ValueError,
                            "%s: q_offset's default, k_offset + k_lengths%s - L, passes int64; give q_offset", c->fn,
                            index);
    }
    case NPATTN_STATUS_BAD_PAGE: {
        const int64_t m = c->pages.max_pages, b = why.entry / m, i = why.entry % m;
        /* the entry as given: a uint64 one beyond int64 wrapped in the copy the core read */
        PyArrayObject *t = c->table;
        PyObject *entry = PyArray_GETITEM(t, PyArray_GETPTR2(t, b, i));
        if (!entry) return NULL;
        PyErr_Format(PyExc_ValueError,
                     "%s: block_table[%lld, %lld] = %S is not a page of key_pages, which holds P = %lld pages; "
                     "request %lld's context_lens = %lld keys live in its first %lld entries",
                     c->fn, (long long)b, (long long)i, entry, (long long)c->pages.n_page, (long long)b,
                     (long long)p->k_length[b], (long long)((p->k_length[b] + c->pages.page_size - 1) / c->pages.page_size));
        Py_DECREF(entry);
        return NULL;
    }
    case NPATTN_STATUS_BAD_PAGES:
        if (c->paged && c->pages.page_size < 1)
            return shapes_break(c, "pages must hold at least one row (page_size >= 1)"), NULL;
        if (c->paged && p->n_key == INT64_MAX)
            return PyErr_Format(PyExc_ValueError, "%s: max_pages * page_size = %lld * %lld passes int64", c->fn,
                                (long long)c->pages.max_pages, (long long)c->pages.page_size);
        break;
    default: break;
    }
    return PyErr_Format(PyExc_RuntimeError, "%s: internal error: %s (%s)", c->fn, npattn_status_string(why.status),
                        npattn_operand_name(why.operand));
}

/* Runs the forward core without the GIL, Ctrl-C relayed. */
static enum npattn_status run_forward(struct call *c) {
    struct wait_state w;
    c->p.cancel = check_signals;
    c->p.cancel_arg = &w;
    w.saved = PyEval_SaveThread();
    enum npattn_status status = npattn_sdpa(&c->p);
    PyEval_RestoreThread(w.saved);
    return status;
}

/* ---- the options a call computed under ---- */

/* A window side: None where unbounded. */
static PyObject *window_side(int64_t side) {
    return side == NPATTN_UNBOUNDED ? Py_NewRef(Py_None) : PyLong_FromLongLong((long long)side);
}

/* The options the core computes a read call under, its defaults resolved:
 * what the lse of sdpa records, and what sdpa_backward compares with it. A
 * dict of scale (a float), window ((left, right), None where unbounded),
 * softcap (a float, or None), k_offset, and each request's q_offset,
 * k_start and k_lengths (npattn_request_positions): ints where no request
 * has its own, else read-only int64 copies of the batch shape B. */
static PyObject *options_used(struct call *c) {
    const struct npattn_problem *p = &c->p;
    PyObject *pos[3] = {NULL, NULL, NULL}, *result = NULL;
    if (p->k_start || p->k_length || p->q_offsets) {
        npy_intp shape[NPY_MAXDIMS], n = 1;
        for (int d = 0; d < c->nb; d++) n *= (shape[d] = (npy_intp)c->batch[d]);
        int64_t *at[3];
        for (int i = 0; i < 3; i++) {
            if (!(pos[i] = PyArray_SimpleNew(c->nb, shape, NPY_INT64))) goto done;
            at[i] = PyArray_DATA((PyArrayObject *)pos[i]);
        }
        for (npy_intp b = 0; b < n; b++) npattn_request_positions(p, b, &at[0][b], &at[1][b], &at[2][b]);
        for (int i = 0; i < 3; i++) PyArray_CLEARFLAGS((PyArrayObject *)pos[i], NPY_ARRAY_WRITEABLE);
    } else {
        int64_t v[3];
        npattn_request_positions(p, -1, &v[0], &v[1], &v[2]);
        for (int i = 0; i < 3; i++)
            if (!(pos[i] = PyLong_FromLongLong((long long)v[i]))) goto done;
    }
    PyObject *left = window_side(p->window_left), *right = window_side(p->window_right);
    PyObject *softcap = p->softcap > 0 ? PyFloat_FromDouble(p->softcap) : Py_NewRef(Py_None);
    if (left && right && softcap)
        result = Py_BuildValue("{s:d,s:(OO),s:O,s:L,s:O,s:O,s:O}", "scale", p->scale, "window", left, right, "softcap",
                               softcap, "k_offset", (long long)p->k_offset, "q_offset", pos[0], "k_start", pos[1],
                               "k_lengths", pos[2]);
    Py_XDECREF(left);
    Py_XDECREF(right);
    Py_XDECREF(softcap);
done:
    for (int i = 0; i < 3; i++) Py_XDECREF(pos[i]);
    return result;
}

/* ---- the entry points ---- */

/* The forward result of a call whose operands and options are read: out,
 * or (out, lse) with return_lse, and with `record` the options the lse was
 * computed under, (out, lse, options_used). */
static PyObject *forward_result(struct call *c, int record) {
    PyObject *result = NULL;
    PyObject *return_lse = c->opt[OPT_return_lse];
    if (!PyBool_Check(return_lse) && !PyArray_IsScalar(return_lse, Bool)) {
        PyErr_Format(PyExc_TypeError, "%s: return_lse must be True or False, got %s", c->fn, type_name(return_lse));
        goto done;
    }
    const int with_lse = PyObject_IsTrue(return_lse);
    const int wide = c->result == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    npy_intp shape[NPY_MAXDIMS + 2];
    int nd = result_shape(c, (npy_intp)c->p.n_head_q, (npy_intp)c->p.n_query, (npy_intp)c->p.n_embd_v, 1, shape);
    /* the result first: a result too large to allocate fails before the core is asked */
    if (c->opt[OPT_out] == Py_None) {
        if (!(c->out.a = new_array(c, shape, nd, npy_type_of(c->result), "the result"))) goto done;
    } else if (!read_out(c, shape, nd) || !out_clear_of_inputs(c)) {
        goto done;
    }
    if (with_lse && !(c->lse.a = new_array(c, shape, nd - 1, npy_type_of(wide), "lse"))) goto done;
    describe(c, &c->out, &c->p.out, c->result, 3);
    if (c->lse.a) describe(c, &c->lse, &c->p.lse, wide, 2);
    enum npattn_status status = run_forward(c);
    if (status != NPATTN_STATUS_OK) {
        refused(c, status, NULL);
        goto done;
    }
    if (c->lse.a && record) {
        PyObject *used = options_used(c);
        result = used ? PyTuple_Pack(3, c->out.a, c->lse.a, used) : NULL;
        Py_XDECREF(used);
    } else {
        result = c->lse.a ? PyTuple_Pack(2, c->out.a, c->lse.a) : Py_NewRef((PyObject *)c->out.a);
    }
done:
    call_release(c);
    return result;
}

static PyObject *core_sdpa(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    struct call c;
    call_init(&c, "sdpa");
    if (!read_keywords(&c, args, nargs, kwnames, SDPA_OPTIONS) || !read_qkv(&c, 1) || !read_options(&c)) {
        call_release(&c);
        return NULL;
    }
    return forward_result(&c, 1);
}

static PyObject *core_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    struct call c;
    call_init(&c, "paged_attention");
    c.paged = 1;
    if (!read_keywords(&c, args, nargs, kwnames, PAGED_OPTIONS) || !read_paged(&c) || !read_options(&c)) {
        call_release(&c);
        return NULL;
    }
    return forward_result(&c, 0);
}

static PyObject *core_attention_weights(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    struct call c;
    PyObject *result = NULL;
    call_init(&c, "attention_weights");
    if (!read_keywords(&c, args, nargs, kwnames, WEIGHTS_OPTIONS) || !read_qkv(&c, 0) || !read_options(&c)) goto done;
    npy_intp shape[NPY_MAXDIMS + 2];
    int nd = result_shape(&c, (npy_intp)c.p.n_head_q, (npy_intp)c.p.n_query, (npy_intp)c.p.n_key, 1, shape);
    if (!(c.weights.a = new_array(&c, shape, nd, npy_type_of(c.result), "the weights"))) goto done;
    describe(&c, &c.weights, &c.p.weights, c.result, 3);
    enum npattn_status status = run_forward(&c);
    if (status != NPATTN_STATUS_OK) {
        refused(&c, status, NULL);
        goto done;
    }
    result = Py_NewRef((PyObject *)c.weights.a);
done:
    call_release(&c);
    return result;
}

/* The size of operand a (q, k or v, as read) along broadcast batch dim d. */
static npy_intp batch_size(const struct call *c, PyArrayObject *a, int d) {
    const int own_dims = PyArray_NDIM(a) > 3 ? PyArray_NDIM(a) - 3 : 0, at = d - (c->nb - own_dims);
    return at >= 0 ? PyArray_DIM(a, at) : 1;
}

/* An input of the backward pass (dout, out, lse) of exactly `shape`, `what`
 * naming that shape; an lse of float16 or bfloat16 is read as float32. */
static int read_fitting(struct call *c, enum option o, struct operand *op, struct npattn_tensor *t, const npy_intp *shape,
                        int nd, const char *what) {
    const char *name = name_of(c, o);
    PyArrayObject *a = float_array(c, o);
    if (!a) return 0;
    int fits = PyArray_NDIM(a) == nd;
    for (int d = 0; fits && d < nd; d++) fits = PyArray_DIM(a, d) == shape[d];
    if (!fits) {
        PyObject *want = tuple_of(shape, nd), *got = shape_of(a);
        if (want && got) PyErr_Format(PyExc_ValueError, "%s: %s must have %s %S, got %S", c->fn, name, what, want, got);
        Py_XDECREF(want);
        Py_XDECREF(got);
        return 0;
    }
    if (o == OPT_lse && (core_dtype(a) == NPATTN_DTYPE_F16 || core_dtype(a) == NPATTN_DTYPE_BF16)) {
        a = (PyArrayObject *)own(c, PyArray_CastToType(a, PyArray_DescrFromType(NPY_FLOAT32), 0));
        if (!a) return 0;
    }
    op->a = a;
    describe(c, op, t, core_dtype(a), o == OPT_lse ? 2 : 3);
    return 1;
}

/* The gradients (dq, dk, dv, dsinks) in the computed dtype (a half-precision
 * operand's own where the glue need not sum them further), and the arrays
 * q, k, v as read, whose shapes and dtypes the gradients go back to. dk and
 * dv have k's and v's own batch sizes (1 where broadcast: the core sums
 * there), as dq has where k or v is broadcast too; elsewhere dq has the
 * result's batch size. dsinks: float64 (n_batch, H_q), or None. */
static PyObject *core_sdpa_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    struct call c;
    struct npattn_backward_problem bp;
    PyObject *result = NULL;
    call_init(&c, "sdpa_backward");
    memset(&bp, 0, sizeof bp);
    if (!read_keywords(&c, args, nargs, kwnames, BACKWARD_OPTIONS) || !read_qkv(&c, 1) || !read_options(&c)) goto done;
    const struct npattn_problem *p = &c.p;
    const npy_intp H_q = (npy_intp)p->n_head_q, H_kv = (npy_intp)p->n_head_kv, L = (npy_intp)p->n_query;
    const npy_intp S = (npy_intp)p->n_key, D = (npy_intp)p->n_embd_k, Dv = (npy_intp)p->n_embd_v;
    const int wide = c.result == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    npy_intp shape[NPY_MAXDIMS + 2];
    int nd = result_shape(&c, H_q, L, Dv, 1, shape);
    if (!read_fitting(&c, OPT_dout, &c.dout, &bp.dout, shape, nd, "the result's shape") ||
        !read_fitting(&c, OPT_out, &c.out, &c.p.out, shape, nd, "the result's shape") ||
        !read_fitting(&c, OPT_lse, &c.lse, &c.p.lse, shape, nd - 1, "the result's shape without its last axis"))
        goto done;
    struct {
        struct operand *op;
        struct npattn_tensor *t;
        npy_intp heads, rows, width;
        const char *what;
    } grads[3] = {{&c.dq, &bp.dq, H_q, L, D, "dq"}, {&c.dk, &bp.dk, H_kv, S, D, "dk"}, {&c.dv, &bp.dv, H_kv, S, Dv, "dv"}};
    int empty_batch = 0;
    for (int d = 0; d < c.nb; d++) empty_batch |= c.batch[d] == 0;
    for (int i = 0; i < 3; i++) {
        int n = result_shape(&c, grads[i].heads, grads[i].rows, grads[i].width, 1, shape);
        if (!c.rank2) /* a batch dim the operand broadcasts along is 1: the core sums along it */
            for (int d = 0; d < c.nb; d++) {
                const npy_intp nq = batch_size(&c, c.q.a, d), nk = batch_size(&c, c.k.a, d);
                const npy_intp nv = batch_size(&c, c.v.a, d);
                shape[d] = i == 1 ? nk : i == 2 ? nv : nq == 1 && (nk == 1 || nv == 1) ? 1 : shape[d];
            }
        if (!(grads[i].op->a = new_array(&c, shape, n, npy_type_of(wide), grads[i].what))) goto done;
        if (empty_batch) /* a sum over no entry, which the core never visits */
            memset(PyArray_DATA(grads[i].op->a), 0, (size_t)PyArray_NBYTES(grads[i].op->a));
        describe(&c, grads[i].op, grads[i].t, wide, 3);
    }
    PyArrayObject *dsinks = NULL;
    if (p->sinks) {
        npy_intp n_batch = 1;
        for (int d = 0; d < c.nb; d++) n_batch *= (npy_intp)c.batch[d];
        const npy_intp ds_shape[2] = {n_batch, H_q};
        if (!(dsinks = new_array(&c, ds_shape, 2, NPY_FLOAT64, "dsinks"))) goto done;
        bp.dsinks = PyArray_DATA(dsinks);
    }
    bp.fwd = c.p;
    if (c.opt[OPT_agree] != Py_None) { /* the lse's record against these options, the rules kept first */
        enum npattn_status status = npattn_check_backward(&bp, NULL);
        if (status != NPATTN_STATUS_OK) {
            refused(&c, status, &bp);
            goto done;
        }
        PyObject *used = options_used(&c), *agreed = used ? PyObject_CallOneArg(c.opt[OPT_agree], used) : NULL;
        Py_XDECREF(used);
        if (!agreed) goto done;
        Py_DECREF(agreed);
    }
    struct wait_state w;
    bp.fwd.cancel = check_signals;
    bp.fwd.cancel_arg = &w;
    w.saved = PyEval_SaveThread();
    enum npattn_status status = npattn_sdpa_backward(&bp);
    PyEval_RestoreThread(w.saved);
    if (status != NPATTN_STATUS_OK) {
        refused(&c, status, &bp);
        goto done;
    }
    /* a half-precision operand's gradient in its own dtype, rounded by the
     * kernels' SIMD (NumPy's cast from float32 to bfloat16, an element at a
     * time, took 13% of a bfloat16 backward on one thread); float32 or 64
     * where computed in double, or where the glue still sums dims the
     * operand was broadcast along */
    PyArrayObject *given[3] = {c.q.a, c.k.a, c.v.a};
    for (int i = 0; i < 3; i++) {
        PyArrayObject *g = grads[i].op->a, *h;
        const int dt = core_dtype(given[i]);
        if ((dt != NPATTN_DTYPE_F16 && dt != NPATTN_DTYPE_BF16) || wide != NPATTN_DTYPE_F32 ||
            PyArray_SIZE(g) != PyArray_SIZE(given[i]))
            continue;
        if (!(h = new_array(&c, PyArray_DIMS(g), PyArray_NDIM(g), npy_type_of(dt), grads[i].what))) goto done;
        w.saved = PyEval_SaveThread();
        status = npattn_narrow_f32(dt, PyArray_DATA(g), (int64_t)PyArray_SIZE(g), PyArray_DATA(h), c.p.n_threads);
        PyEval_RestoreThread(w.saved);
        if (status != NPATTN_STATUS_OK) {
            refused(&c, status, &bp);
            goto done;
        }
        grads[i].op->a = h;
    }
    result = Py_BuildValue("(OOOO(OOO))", c.dq.a, c.dk.a, c.dv.a, dsinks ? (PyObject *)dsinks : Py_None, c.q.a, c.k.a,
                           c.v.a);
done:
    call_release(&c);
    return result;
}

/* check_mask(fn, mask, full): the mask as sdpa reads it for a problem of
 * result shape full = (*B, H_q, L, S): None, a string, or an array. */
static PyObject *core_check_mask(PyObject *self, PyObject *args) {
    (void)self;
    const char *fn;
    PyObject *mask, *full;
    if (!PyArg_ParseTuple(args, "sOO!", &fn, &mask, &PyTuple_Type, &full)) return NULL;
    struct call c;
    PyObject *result = NULL;
    call_init(&c, fn);
    Py_ssize_t n = PyTuple_GET_SIZE(full);
    if (n < 3 || n > NPY_MAXDIMS + 3) return PyErr_Format(PyExc_ValueError, "check_mask: full must have 3 to %d dims", NPY_MAXDIMS + 3);
    int64_t dims[NPY_MAXDIMS + 3];
    for (Py_ssize_t d = 0; d < n; d++)
        if ((dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(full, d))) == -1 && PyErr_Occurred()) return NULL;
    c.nb = (int)n - 3;
    for (int d = 0; d < c.nb; d++) c.batch[d] = dims[d];
    c.p.n_head_q = dims[n - 3], c.p.n_query = dims[n - 2], c.p.n_key = dims[n - 1];
    c.opt[OPT_mask] = mask;
    if (read_mask(&c)) result = Py_NewRef(c.mask.a ? (PyObject *)c.mask.a : mask);
    call_release(&c);
    return result;
}

/* check_scale(fn, scale, D): scale as sdpa reads it, a float. */
static PyObject *core_check_scale(PyObject *self, PyObject *args) {
    (void)self;
    const char *fn;
    PyObject *scale;
    long long D;
    if (!PyArg_ParseTuple(args, "sOL", &fn, &scale, &D)) return NULL;
    struct call c;
    PyObject *result = NULL;
    call_init(&c, fn);
    c.p.n_embd_k = D;
    c.p.n_head_kv = 1;
    c.opt[OPT_scale] = scale;
    if (read_scale(&c)) {
        enum npattn_status status = npattn_check(&c.p, NULL);
        if (status == NPATTN_STATUS_BAD_SCALE) refused(&c, status, NULL);
        else result = PyFloat_FromDouble(c.p.scale);
    }
    call_release(&c);
    return result;
}

/* result_dtype(*dtypes): the dtype of a result computed from arrays of these
 * dtypes (promote), or None where one is not a dtype the core computes. */
static PyObject *core_result_dtype(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1) return PyErr_Format(PyExc_TypeError, "result_dtype: needs at least one dtype");
    int result = -1;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyArray_Descr *d = NULL;
        if (!PyArray_DescrConverter(args[i], &d)) return NULL;
        const int t = core_dtype_of(d->type_num);
        Py_DECREF(d);
        if (t < 0) Py_RETURN_NONE;
        result = i ? promote(result, t) : t;
    }
    return (PyObject *)PyArray_DescrFromType(npy_type_of(result));
}

static PyObject *core_set_converter(PyObject *self, PyObject *fn) {
    (void)self;
    if (!PyCallable_Check(fn)) return PyErr_Format(PyExc_TypeError, "set_converter: not callable: %R", fn);
    Py_XSETREF(converter, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyObject *core_set_bfloat16(PyObject *self, PyObject *arg) {
    (void)self;
    PyArray_Descr *d = NULL;
    if (!PyArray_DescrConverter(arg, &d)) return NULL;
    if (PyDataType_ELSIZE(d) != 2 || d->type_num < NPY_USERDEF) {
        Py_DECREF(d);
        return PyErr_Format(PyExc_ValueError, "not a bfloat16 dtype: %R", arg);
    }
    bfloat16_type = d->type_num;
    Py_DECREF(d);
    Py_RETURN_NONE;
}

static PyObject *core_shutdown(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    atomic_store(&shutting_down, 1);
    Py_BEGIN_ALLOW_THREADS /* threads waiting for the GIL inside a call get it, and leave */
    npattn_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *core_blas_info(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    const char *config = npattn_blas_config();
    return PyUnicode_FromFormat("%s: %s", npattn_blas_library(), config ? config : "?");
}

static PyObject *core_debug_fail_alloc_after(PyObject *self, PyObject *arg) {
    (void)self;
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    npattn_debug_fail_alloc_after((int64_t)n);
    Py_RETURN_NONE;
}

static PyObject *core_debug_pool_mode(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    npattn_debug_pool_mode((int)n);
    Py_RETURN_NONE;
}

static PyObject *core_fma_peak(PyObject *self, PyObject *arg) {
    (void)self;
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (!(seconds > 0 && seconds <= 60)) return PyErr_Format(PyExc_ValueError, "fma_peak: seconds must be in (0, 60]");
    double gflops;
    Py_BEGIN_ALLOW_THREADS gflops = npattn_fma_peak(seconds);
    Py_END_ALLOW_THREADS return PyFloat_FromDouble(gflops);
}

static PyObject *core_simd(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyUnicode_FromString(npattn_simd());
}

static PyObject *core_debug_force_simd(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (npattn_debug_force_simd(name) != 0) return PyErr_Format(PyExc_ValueError, "this CPU cannot run the %R kernels", arg);
    Py_RETURN_NONE;
}

static PyObject *core_get_num_threads(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromLong(npattn_get_num_threads());
}

static PyObject *core_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    npattn_set_num_threads((int)(n > NPATTN_MAX_THREADS ? NPATTN_MAX_THREADS : n));
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"sdpa", (PyCFunction)(void (*)(void))core_sdpa, METH_FASTCALL | METH_KEYWORDS,
     "sdpa(*, q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, return_lse, precision, out, "
     "threads)\n--\n\n"
     "Private: npattn.sdpa's arguments, by name, as given; with return_lse, (out, lse, the options used)."},
    {"attention_weights", (PyCFunction)(void (*)(void))core_attention_weights, METH_FASTCALL | METH_KEYWORDS,
     "attention_weights(*, q, k, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, precision, "
     "threads)\n--\n\n"
     "Private: npattn.attention_weights's arguments, by name, as given."},
    {"paged_attention", (PyCFunction)(void (*)(void))core_paged_attention, METH_FASTCALL | METH_KEYWORDS,
     "paged_attention(*, q, k, v, block_table, context_lens, page_size, scale, mask, sinks, window, softcap, q_offset, "
     "return_lse, precision, out, threads)\n--\n\n"
     "Private: npattn.paged_attention's arguments, by name, as given (k, v: the key and value pages)."},
    {"sdpa_backward", (PyCFunction)(void (*)(void))core_sdpa_backward, METH_FASTCALL | METH_KEYWORDS,
     "sdpa_backward(*, dout, q, k, v, out, lse, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, "
     "k_lengths, precision, threads, agree)\n--\n\n"
     "Private: (dq, dk, dv, dsinks) at the result's batch shape, and (q, k, v) as read; agree(options), if not None, "
     "is called with the options used before computing, and may raise to refuse them."},
    {"check_mask", core_check_mask, METH_VARARGS,
     "check_mask(fn, mask, full)\n--\n\nThe mask as sdpa reads it for a result of shape full = (*B, H_q, L, S)."},
    {"check_scale", core_check_scale, METH_VARARGS, "check_scale(fn, scale, D)\n--\n\nThe scale as sdpa reads it."},
    {"result_dtype", (PyCFunction)(void (*)(void))core_result_dtype, METH_FASTCALL,
     "result_dtype(*dtypes)\n--\n\nThe result's dtype of these inputs' dtypes; None if one is not the core's."},
    {"set_converter", core_set_converter, METH_O,
     "set_converter(fn)\n--\n\nfn(fn_name, name, x): x as an array the core reads in place."},
    {"set_bfloat16", core_set_bfloat16, METH_O, "set_bfloat16(dtype)\n--\n\nTell the core ml_dtypes.bfloat16's dtype."},
    {"blas_info", core_blas_info, METH_NOARGS, "blas_info()\n--\n\nWhich OpenBLAS npattn runs on."},
    {"shutdown", core_shutdown, METH_NOARGS,
     "shutdown()\n--\n\nAt exit (atexit): stop every call in flight; later calls raise SystemExit."},
    {"fma_peak", core_fma_peak, METH_O,
     "fma_peak(seconds)\n--\n\nThe float32 FMA peak of this thread's core in GFLOP/s (the kernel table in use), for "
     "benchmarks."},
    {"simd", core_simd, METH_NOARGS, "simd()\n--\n\nThe kernel table in use: amx, avx512bf16, avx512, avx2, neon or portable."},
    {"get_num_threads", core_get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\nThe default thread count: the CPUs available, capped by set_num_threads."},
    {"set_num_threads", core_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nCap the default thread count at n (n < 1: no cap)."},
    {"debug_force_simd", core_debug_force_simd, METH_O,
     "debug_force_simd(name)\n--\n\nTest hook: run the named kernel table; '' restores the best."},
    {"debug_fail_alloc_after", core_debug_fail_alloc_after, METH_O,
     "debug_fail_alloc_after(n)\n--\n\nTest hook: allocations in the core fail after n more; -1 turns it off."},
    {"debug_pool_mode", core_debug_pool_mode, METH_O,
     "debug_pool_mode(mode)\n--\n\nTest hook: 0 normal, 1 no helper thread starts, 2 helpers join any work."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "npattn._core", "npattn's C core (private).", -1, core_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    if (!npattn_blas_ok())
        return PyErr_Format(PyExc_ImportError,
                            "npattn: the OpenBLAS it runs on (kernel core %s) computes wrong matrix products on this "
                            "CPU, so npattn will not run; set OPENBLAS_CORETYPE=NEOVERSEN1 (on ARM) before starting "
                            "Python to use other kernels",
                            npattn_blas_core());
    if (!zero_int && !(zero_int = PyLong_FromLong(0))) return NULL;
    for (int o = 0; o < N_OPTION; o++)
        if (!option_strings[o] && !(option_strings[o] = PyUnicode_InternFromString(option_names[o]))) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_THREADS", NPATTN_MAX_THREADS)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

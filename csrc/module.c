/* module.c: npattn._core, the CPython + NumPy glue around the C core.
 *
 * npattn.sdpa (python/npattn/_api.py) hands its arguments here first, as
 * given. When they are in a form the core reads directly (NumPy arrays of
 * float16, bfloat16, float32 or float64, aligned and native, any strides; a
 * string or array mask; plain numbers), this file describes them to the core
 * in a struct npattn_problem, without copying, releases the GIL around the
 * call and maps its status to an exception. Anything else, and any argument
 * that breaks a rule, gives NotImplemented: the Python layer then converts
 * what needs converting, or raises the error that names the argument, and
 * calls again with prepared=True.
 *
 * This file checks only what describing the arrays needs (ranks, and the
 * sizes that two operands share); the core checks the rules of attention.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <numpy/arrayobject.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

static int bfloat16_type = -1; /* ml_dtypes.bfloat16's type number, once Python has seen it */
static atomic_int shutting_down; /* _core.shutdown() ran: the interpreter is exiting */

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

/* ---- reading the arguments ---- */

#define NOT_READY 0 /* a form the core does not read, or a broken rule: NotImplemented */
#define READY 1

/* The core's dtype of a NumPy array, or -1. */
static int core_dtype(PyArrayObject *a) {
    int t = PyArray_TYPE(a);
    if (t == NPY_FLOAT32) return NPATTN_DTYPE_F32;
    if (t == NPY_FLOAT64) return NPATTN_DTYPE_F64;
    if (t == NPY_HALF) return NPATTN_DTYPE_F16;
    if (t == bfloat16_type && bfloat16_type >= 0) return NPATTN_DTYPE_BF16;
    return -1;
}

/* The dtype of the result of two dtypes, as np.result_type (float16 with
 * bfloat16, which NumPy cannot promote, gives float32). */
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

/* A finite double from a Python int or float, or a NumPy integer or float
 * scalar (never a bool); 0 if it is none of these or not finite. */
static int finite_number(PyObject *o, double *x) {
    if (PyBool_Check(o)) return 0;
    if (PyFloat_Check(o) || PyLong_Check(o) || PyArray_IsScalar(o, Floating) || PyArray_IsScalar(o, Integer)) {
        *x = PyFloat_AsDouble(o);
        if (*x == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return isfinite(*x);
    }
    return 0;
}

/* An int64 from a Python or NumPy integer (never a bool); 0 otherwise. */
static int int64_of(PyObject *o, int64_t *x) {
    if (PyBool_Check(o) || !(PyLong_Check(o) || PyArray_IsScalar(o, Integer))) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow) return 0;
    *x = (int64_t)v;
    return 1;
}

/* One operand's element strides, batch dims right-aligned to the broadcast
 * batch shape (stride 0 where the operand broadcasts). */
struct operand {
    PyArrayObject *a;
    int64_t batch_stride[NPY_MAXDIMS];
};

/* Everything one call describes to the core. */
struct call {
    struct operand q, k, v, out, mask, lse, weights;
    int nb;                        /* broadcast batch dims */
    int64_t batch[NPY_MAXDIMS];
    int rank2;                     /* all of q, k (and v) rank 2: results without heads */
    int result;                    /* the result's core dtype */
    struct npattn_problem p;
};

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
    int own = nd > tail ? nd - tail : 0;
    for (int d = 0; d < c->nb; d++) o->batch_stride[d] = STRIDE(d - (c->nb - own));
#undef STRIDE
    t->batch_stride = o->batch_stride;
}

/* Broadcasts `own` leading dims of a (before its last `tail`) into c->batch. */
static int broadcast_batch(struct call *c, PyArrayObject *a, int tail) {
    int own = PyArray_NDIM(a) - tail;
    if (own <= 0) return READY;
    if (own > c->nb) {
        for (int d = c->nb - 1; d >= 0; d--) c->batch[d + own - c->nb] = c->batch[d];
        for (int d = 0; d < own - c->nb; d++) c->batch[d] = 1;
        c->nb = own;
    }
    for (int d = 0; d < own; d++) {
        npy_intp n = PyArray_DIM(a, d);
        int64_t *b = &c->batch[c->nb - own + d];
        if (n == *b || n == 1) continue;
        if (*b != 1) return NOT_READY;
        *b = n;
    }
    return READY;
}

/* Reads q, k and (if has_v) v: readable arrays whose shared sizes agree. */
static int read_qkv(struct call *c, PyObject *q, PyObject *k, PyObject *v, int has_v) {
    if (!readable(q, 0) || !readable(k, 0) || (has_v && !readable(v, 0))) return NOT_READY;
    c->q.a = (PyArrayObject *)q, c->k.a = (PyArrayObject *)k, c->v.a = has_v ? (PyArrayObject *)v : NULL;
    int nq = PyArray_NDIM(c->q.a), nk = PyArray_NDIM(c->k.a), nv = has_v ? PyArray_NDIM(c->v.a) : 2;
    if (nq < 2 || nk < 2 || nv < 2) return NOT_READY;
    c->rank2 = nq == 2 && nk == 2 && nv == 2;
    npy_intp *qs = PyArray_DIMS(c->q.a), *ks = PyArray_DIMS(c->k.a);
    npy_intp H_q = nq > 2 ? qs[nq - 3] : 1, H_kv = nk > 2 ? ks[nk - 3] : 1;
    if (ks[nk - 1] != qs[nq - 1]) return NOT_READY; /* D */
    c->result = promote(core_dtype(c->q.a), core_dtype(c->k.a));
    if (has_v) {
        npy_intp *vs = PyArray_DIMS(c->v.a);
        if (vs[nv - 2] != ks[nk - 2] || (nv > 2 ? vs[nv - 3] : 1) != H_kv) return NOT_READY; /* S, H_kv */
        c->result = promote(c->result, core_dtype(c->v.a));
    }
    c->nb = 0;
    if (!broadcast_batch(c, c->q.a, 3) || !broadcast_batch(c, c->k.a, 3) || (has_v && !broadcast_batch(c, c->v.a, 3)))
        return NOT_READY;
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
    return READY;
}

/* mask, window, softcap, q_offset, k_offset, scale and sinks. */
static int read_options(struct call *c, PyObject *scale, PyObject *mask, PyObject *sinks, PyObject *window,
                        PyObject *softcap, PyObject *q_offset, PyObject *k_offset) {
    struct npattn_problem *p = &c->p;
    p->scale = 1.0 / sqrt((double)p->n_embd_k);
    if (scale != Py_None && !finite_number(scale, &p->scale)) return NOT_READY;
    int top_left = 0;
    p->mask_kind = NPATTN_MASK_NONE;
    if (PyUnicode_Check(mask)) {
        if (PyUnicode_CompareWithASCIIString(mask, "causal") == 0) p->causal = 1;
        else if (PyUnicode_CompareWithASCIIString(mask, "causal_top_left") == 0) p->causal = top_left = 1;
        else return NOT_READY;
    } else if (mask != Py_None) {
        if (!readable(mask, 1)) return NOT_READY;
        PyArrayObject *m = (PyArrayObject *)mask;
        int nd = PyArray_NDIM(m);
        /* broadcastable to (*B, H_q, L, S) without growing B */
        const npy_intp full[3] = {(npy_intp)p->n_head_q, (npy_intp)p->n_query, (npy_intp)p->n_key};
        if (nd > c->nb + 3) return NOT_READY;
        for (int d = 0; d < nd; d++) {
            int fd = c->nb + 3 - nd + d;
            npy_intp want = fd < c->nb ? (npy_intp)c->batch[fd] : full[fd - c->nb];
            if (PyArray_DIM(m, d) != want && PyArray_DIM(m, d) != 1) return NOT_READY;
        }
        c->mask.a = m;
        int is_bool = PyArray_TYPE(m) == NPY_BOOL;
        p->mask_kind = is_bool ? NPATTN_MASK_BOOL : NPATTN_MASK_ADD;
        describe(c, &c->mask, &p->mask, is_bool ? NPATTN_DTYPE_F32 : core_dtype(m), 3);
    }
    p->window_left = p->window_right = NPATTN_UNBOUNDED;
    if (window != Py_None) {
        if (!PyTuple_Check(window) || PyTuple_GET_SIZE(window) != 2) return NOT_READY;
        int64_t *side[2] = {&p->window_left, &p->window_right};
        for (int i = 0; i < 2; i++) {
            PyObject *w = PyTuple_GET_ITEM(window, i);
            if (w != Py_None && (!int64_of(w, side[i]) || *side[i] < 0)) return NOT_READY;
        }
    }
    p->softcap = 0;
    if (softcap != Py_None && (!finite_number(softcap, &p->softcap) || !(p->softcap > 0))) return NOT_READY;
    p->k_offset = 0;
    if (!int64_of(k_offset, &p->k_offset)) return NOT_READY;
    if (q_offset == Py_None) {
        p->q_offset = top_left ? 0 : p->n_key - p->n_query;
    } else if (top_left || !int64_of(q_offset, &p->q_offset)) {
        return NOT_READY;
    }
    p->sinks = NULL;
    if (sinks != Py_None) {
        if (!PyArray_Check(sinks)) return NOT_READY;
        PyArrayObject *s = (PyArrayObject *)sinks;
        if (PyArray_TYPE(s) != NPY_FLOAT64 || PyArray_NDIM(s) != 1 || PyArray_DIM(s, 0) != p->n_head_q ||
            !PyArray_IS_C_CONTIGUOUS(s) || !PyArray_ISALIGNED(s) || !PyArray_ISNOTSWAPPED(s))
            return NOT_READY;
        p->sinks = PyArray_DATA(s);
    }
    return READY;
}

/* threads: an int from 1 to NPATTN_MAX_THREADS; None: NPATTN_NUM_THREADS if set, else 0
 * (the core's default). */
static int read_threads(struct call *c, PyObject *threads) {
    int64_t n;
    if (threads == Py_None) {
        const char *env = getenv("NPATTN_NUM_THREADS");
        if (!env) {
            c->p.n_threads = 0;
            return READY;
        }
        char *end;
        long v = strtol(env, &end, 10);
        if (end == env || *end != '\0' || v < 1 || v > NPATTN_MAX_THREADS) return NOT_READY;
        c->p.n_threads = (int32_t)v;
        return READY;
    }
    if (!int64_of(threads, &n) || n < 1 || n > NPATTN_MAX_THREADS) return NOT_READY;
    c->p.n_threads = (int32_t)n;
    return READY;
}

/* An output operand of `shape` (the result's dims, rank2 dropping batch and
 * heads): the caller's array if it fits exactly, else NOT_READY. */
static int read_out(struct call *c, PyObject *out, const npy_intp *shape, int nd) {
    if (!PyArray_Check(out)) return NOT_READY;
    PyArrayObject *a = (PyArrayObject *)out;
    if (core_dtype(a) != c->result || !readable(out, 0) || !PyArray_ISWRITEABLE(a) || PyArray_NDIM(a) != nd)
        return NOT_READY;
    for (int d = 0; d < nd; d++)
        if (PyArray_DIM(a, d) != shape[d]) return NOT_READY;
    c->out.a = a;
    return READY;
}

/* A new C-contiguous array; NULL with the error cleared on failure (the
 * Python layer allocates again and names the shape). */
static PyArrayObject *new_array(const npy_intp *shape, int nd, int npy_type) {
    PyArrayObject *a = (PyArrayObject *)PyArray_SimpleNew(nd, (npy_intp *)shape, npy_type);
    if (!a) PyErr_Clear();
    return a;
}

/* The result's shape: (*B, H_q, L, last), or (L, last) for rank-2 inputs. */
static int result_shape(const struct call *c, npy_intp last, int with_last, npy_intp *shape) {
    int nd = 0;
    if (!c->rank2) {
        for (int d = 0; d < c->nb; d++) shape[nd++] = (npy_intp)c->batch[d];
        shape[nd++] = (npy_intp)c->p.n_head_q;
    }
    shape[nd++] = (npy_intp)c->p.n_query;
    if (with_last) shape[nd++] = last;
    return nd;
}

static npy_intp batch_size(const struct call *c) {
    npy_intp n = 1;
    for (int d = 0; d < c->nb; d++) n *= (npy_intp)c->batch[d];
    return n;
}

/* Maps a core status: 1 done, 0 NotImplemented (a broken rule, unprepared),
 * -1 an exception. */
static int map_status(enum npattn_status status, int prepared, const char *fn) {
    switch (status) {
    case NPATTN_STATUS_OK: return 1;
    case NPATTN_STATUS_CANCELLED:
        /* a daemon thread's call stopped by the interpreter's exit ends the thread quietly */
        if (!PyErr_Occurred() && atomic_load(&shutting_down))
            PyErr_Format(PyExc_SystemExit, "%s: the interpreter is exiting", fn);
        else if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyboardInterrupt, "%s: cancelled", fn);
        return -1;
    case NPATTN_STATUS_NO_MEMORY:
        PyErr_Format(PyExc_MemoryError, "%s: %s", fn, npattn_status_string(status));
        return -1;
    default:
        if (!prepared) return 0;
        PyErr_Format(PyExc_RuntimeError, "%s: internal error: %s", fn, npattn_status_string(status));
        return -1;
    }
}

/* Runs the forward core without the GIL, Ctrl-C relayed; maps its status, named fn. */
static int run(struct call *c, int prepared, const char *fn) {
    struct wait_state w;
    c->p.cancel = check_signals;
    c->p.cancel_arg = &w;
    w.saved = PyEval_SaveThread();
    enum npattn_status status = npattn_sdpa(&c->p);
    PyEval_RestoreThread(w.saved);
    return map_status(status, prepared, fn);
}

static PyObject *not_ready(int prepared, const char *fn, const char *what) {
    if (prepared) return PyErr_Format(PyExc_RuntimeError, "%s: internal error: %s not prepared", fn, what);
    Py_RETURN_NOTIMPLEMENTED;
}

/* sdpa(q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset,
 *      return_lse, out, threads, prepared) */
static PyObject *core_sdpa(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14) return PyErr_Format(PyExc_TypeError, "_core.sdpa takes 14 arguments, got %zd", nargs);
    int prepared = PyObject_IsTrue(args[13]);
    if (prepared < 0) return NULL;
    struct call c;
    memset(&c, 0, sizeof c);
    if (!read_qkv(&c, args[0], args[1], args[2], 1)) return not_ready(prepared, "sdpa", "q, k or v");
    if (!read_options(&c, args[3], args[4], args[5], args[6], args[7], args[8], args[9]))
        return not_ready(prepared, "sdpa", "an option");
    if (!read_threads(&c, args[12])) return not_ready(prepared, "sdpa", "threads");
    int return_lse = args[10] == Py_True;
    if (!return_lse && args[10] != Py_False) return not_ready(prepared, "sdpa", "return_lse");

    npy_intp shape[NPY_MAXDIMS + 2];
    int nd = result_shape(&c, (npy_intp)c.p.n_embd_v, 1, shape);
    if (args[11] != Py_None) {
        if (!read_out(&c, args[11], shape, nd)) return not_ready(prepared, "sdpa", "out");
        Py_INCREF(c.out.a);
    } else if (!(c.out.a = new_array(shape, nd, npy_type_of(c.result)))) {
        return not_ready(prepared, "sdpa", "the result");
    }
    if (return_lse && !(c.lse.a = new_array(shape, nd - 1, c.result == NPATTN_DTYPE_F64 ? NPY_FLOAT64 : NPY_FLOAT32))) {
        Py_DECREF(c.out.a);
        return not_ready(prepared, "sdpa", "lse");
    }
    describe(&c, &c.out, &c.p.out, c.result, 3);
    if (c.lse.a) describe(&c, &c.lse, &c.p.lse, c.result == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32, 2);

    int done = run(&c, prepared, "sdpa");
    if (done <= 0) {
        Py_DECREF(c.out.a);
        Py_XDECREF(c.lse.a);
        if (done == 0) Py_RETURN_NOTIMPLEMENTED;
        return NULL;
    }
    if (!c.lse.a) return (PyObject *)c.out.a;
    PyObject *pair = PyTuple_Pack(2, c.out.a, c.lse.a);
    Py_DECREF(c.out.a);
    Py_DECREF(c.lse.a);
    return pair;
}

/* attention_weights(q, k, scale, mask, sinks, window, softcap, q_offset,
 *                   k_offset, weights, threads): arguments prepared by Python. */
static PyObject *core_attention_weights(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) return PyErr_Format(PyExc_TypeError, "_core.attention_weights takes 11 arguments, got %zd", nargs);
    struct call c;
    memset(&c, 0, sizeof c);
    if (!read_qkv(&c, args[0], args[1], NULL, 0)) return not_ready(1, "attention_weights", "q or k");
    if (!read_options(&c, args[2], args[3], args[4], args[5], args[6], args[7], args[8]))
        return not_ready(1, "attention_weights", "an option");
    if (!read_threads(&c, args[10])) return not_ready(1, "attention_weights", "threads");
    npy_intp shape[NPY_MAXDIMS + 2];
    int nd = result_shape(&c, (npy_intp)c.p.n_key, 1, shape);
    if (!read_out(&c, args[9], shape, nd)) return not_ready(1, "attention_weights", "weights");
    c.weights.a = c.out.a;
    c.out.a = NULL;
    describe(&c, &c.weights, &c.p.weights, c.result, 3);
    if (run(&c, 1, "attention_weights") <= 0) return NULL;
    Py_INCREF(c.weights.a);
    return (PyObject *)c.weights.a;
}

/* An operand the backward pass reads or writes, of the result's batch shape and
 * logical shape (heads, rows, width) or (rows, width) at rank 2; NOT_READY unless
 * it is exactly so. */
static int read_full(struct call *c, PyObject *o, struct operand *op, struct npattn_tensor *t, npy_intp heads,
                     npy_intp rows, npy_intp width, int tail, int core_type) {
    if (!readable(o, 0)) return NOT_READY;
    PyArrayObject *a = (PyArrayObject *)o;
    npy_intp shape[NPY_MAXDIMS + 3];
    int nd = 0;
    if (!c->rank2) {
        for (int d = 0; d < c->nb; d++) shape[nd++] = (npy_intp)c->batch[d];
        shape[nd++] = heads;
    }
    shape[nd++] = rows;
    if (tail == 3) shape[nd++] = width;
    if (PyArray_NDIM(a) != nd || (core_type >= 0 && core_dtype(a) != core_type)) return NOT_READY;
    for (int d = 0; d < nd; d++)
        if (PyArray_DIM(a, d) != shape[d]) return NOT_READY;
    op->a = a;
    describe(c, op, t, core_dtype(a), tail);
    return READY;
}

/* sdpa_backward(dout, q, k, v, out, lse, scale, mask, sinks, window, softcap,
 *               q_offset, k_offset, dq, dk, dv, dsinks, threads): arguments
 * prepared by Python; dq, dk, dv of the result's batch shape in the computed
 * dtype, dsinks None or float64 (n_batch, H_q). */
static PyObject *core_sdpa_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 18) return PyErr_Format(PyExc_TypeError, "_core.sdpa_backward takes 18 arguments, got %zd", nargs);
    struct call c;
    struct npattn_backward_problem bp;
    memset(&c, 0, sizeof c);
    memset(&bp, 0, sizeof bp);
    if (!read_qkv(&c, args[1], args[2], args[3], 1)) return not_ready(1, "sdpa_backward", "q, k or v");
    if (!read_options(&c, args[6], args[7], args[8], args[9], args[10], args[11], args[12]))
        return not_ready(1, "sdpa_backward", "an option");
    if (!read_threads(&c, args[17])) return not_ready(1, "sdpa_backward", "threads");
    const struct npattn_problem *p = &c.p;
    const npy_intp H_q = (npy_intp)p->n_head_q, H_kv = (npy_intp)p->n_head_kv, L = (npy_intp)p->n_query;
    const npy_intp S = (npy_intp)p->n_key, D = (npy_intp)p->n_embd_k, Dv = (npy_intp)p->n_embd_v;
    const int wide = c.result == NPATTN_DTYPE_F64 ? NPATTN_DTYPE_F64 : NPATTN_DTYPE_F32;
    struct operand dout, dq, dk, dv;
    if (!read_full(&c, args[0], &dout, &bp.dout, H_q, L, Dv, 3, -1) ||
        !read_full(&c, args[4], &c.out, &c.p.out, H_q, L, Dv, 3, -1) ||
        !read_full(&c, args[5], &c.lse, &c.p.lse, H_q, L, 1, 2, -1) ||
        !read_full(&c, args[13], &dq, &bp.dq, H_q, L, D, 3, wide))
        return not_ready(1, "sdpa_backward", "dout, out, lse or dq");
    /* dk and dv: the kv heads at the result's batch shape */
    if (!read_full(&c, args[14], &dk, &bp.dk, H_kv, S, D, 3, wide) ||
        !read_full(&c, args[15], &dv, &bp.dv, H_kv, S, Dv, 3, wide))
        return not_ready(1, "sdpa_backward", "dk or dv");
    if (args[16] != Py_None) {
        PyArrayObject *ds = (PyArrayObject *)args[16];
        if (!PyArray_Check(args[16]) || PyArray_TYPE(ds) != NPY_FLOAT64 || !PyArray_IS_C_CONTIGUOUS(ds) ||
            PyArray_SIZE(ds) != batch_size(&c) * H_q || !p->sinks)
            return not_ready(1, "sdpa_backward", "dsinks");
        bp.dsinks = PyArray_DATA(ds);
    } else if (p->sinks) {
        return not_ready(1, "sdpa_backward", "dsinks");
    }
    bp.fwd = c.p;
    struct wait_state w;
    bp.fwd.cancel = check_signals;
    bp.fwd.cancel_arg = &w;
    w.saved = PyEval_SaveThread();
    enum npattn_status status = npattn_sdpa_backward(&bp);
    PyEval_RestoreThread(w.saved);
    if (map_status(status, 1, "sdpa_backward") <= 0) return NULL;
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
    {"sdpa", (PyCFunction)(void (*)(void))core_sdpa, METH_FASTCALL,
     "sdpa(q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, return_lse, out, threads, prepared)\n"
     "--\n\nPrivate: npattn.sdpa's fast path. NotImplemented means: prepare the arguments."},
    {"attention_weights", (PyCFunction)(void (*)(void))core_attention_weights, METH_FASTCALL,
     "attention_weights(q, k, scale, mask, sinks, window, softcap, q_offset, k_offset, weights, threads)\n--\n\n"
     "Private: fills the prepared array weights with npattn.attention_weights's result."},
    {"sdpa_backward", (PyCFunction)(void (*)(void))core_sdpa_backward, METH_FASTCALL,
     "sdpa_backward(dout, q, k, v, out, lse, scale, mask, sinks, window, softcap, q_offset, k_offset, dq, dk, dv, "
     "dsinks, threads)\n--\n\nPrivate: fills the prepared dq, dk, dv (and dsinks) for npattn.sdpa_backward."},
    {"set_bfloat16", core_set_bfloat16, METH_O, "set_bfloat16(dtype)\n--\n\nTell the core ml_dtypes.bfloat16's dtype."},
    {"blas_info", core_blas_info, METH_NOARGS, "blas_info()\n--\n\nWhich OpenBLAS npattn runs on."},
    {"shutdown", core_shutdown, METH_NOARGS,
     "shutdown()\n--\n\nAt exit (atexit): stop every call in flight; later calls raise SystemExit."},
    {"simd", core_simd, METH_NOARGS, "simd()\n--\n\nThe kernel table in use: avx512, avx2, neon or portable."},
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
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "BLAS_INT_MAX", 2147483647) || PyModule_AddIntConstant(m, "MAX_THREADS", NPATTN_MAX_THREADS)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

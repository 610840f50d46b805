/* module.c: npattn._core, the CPython + NumPy glue around the C core; this
 * file holds its entry points (module.h says what the other two do).
 *
 * npattn.sdpa, paged_attention, attention_weights and sdpa_backward
 * (python/npattn/_api.py) hand every argument here by name, as given,
 * through one keyword set (OPTIONS in module.h). An entry point reads them
 * (module_args.c), allocates its results, runs the core without the GIL,
 * taking it back only to relay Ctrl-C, and on a refusal raises the error
 * the core's verdict deserves (module_errors.c).
 *
 * The rules of attention.h are the core's: the core's verdict names the rule
 * and the operand, and the glue only phrases it. What the glue checks is
 * what describing the arguments needs: their kinds, ranks, dtypes, and the
 * sizes that two operands share.
 */
#define NPATTN_IMPORTS_NUMPY /* import_array() is called here, for the three files */
#include "module.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

atomic_int shutting_down; /* _core.shutdown() ran: the interpreter is exiting */

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

/* ---- results: allocation, and running the core ---- */

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
PyArrayObject *new_array(struct call *c, const npy_intp *shape, int nd, int npy_type, const char *what) {
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
    if (!read_keywords(&c, args, nargs, kwnames, SDPA_OPTIONS) || !read_qkv(&c, 1) || !read_codes(&c, 1) ||
        !read_options(&c)) {
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
    if (!read_keywords(&c, args, nargs, kwnames, PAGED_OPTIONS) || !read_paged(&c) || !read_codes(&c, 1) ||
        !read_options(&c)) {
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
    if (!read_keywords(&c, args, nargs, kwnames, WEIGHTS_OPTIONS) || !read_qkv(&c, 0) || !read_codes(&c, 0) ||
        !read_options(&c))
        goto done;
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

static PyObject *core_set_float8(PyObject *self, PyObject *arg) {
    (void)self;
    PyArray_Descr *d = NULL;
    if (!PyArray_DescrConverter(arg, &d)) return NULL;
    PyObject *name = PyDataType_ELSIZE(d) == 1 && d->type_num >= NPY_USERDEF ? PyObject_GetAttrString((PyObject *)d, "name") : NULL;
    int which = -1;
    if (name && PyUnicode_Check(name)) {
        if (PyUnicode_CompareWithASCIIString(name, "float8_e4m3fn") == 0) which = 0;
        else if (PyUnicode_CompareWithASCIIString(name, "float8_e5m2") == 0) which = 1;
    }
    PyErr_Clear();
    Py_XDECREF(name);
    if (which < 0) {
        PyErr_Format(PyExc_ValueError, "not ml_dtypes' float8_e4m3fn or float8_e5m2: %R", arg);
        Py_DECREF(d);
        return NULL;
    }
    float8_types[which] = d->type_num;
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

/* One of the core's ceilings (npattn_fma_peak and its kin) over `seconds`, the GIL released. */
static PyObject *peak_of(const char *fn, double (*peak)(double), PyObject *arg) {
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (!(seconds > 0 && seconds <= 60)) return PyErr_Format(PyExc_ValueError, "%s: seconds must be in (0, 60]", fn);
    double gflops;
    Py_BEGIN_ALLOW_THREADS gflops = peak(seconds);
    Py_END_ALLOW_THREADS return PyFloat_FromDouble(gflops);
}

static PyObject *core_fma_peak(PyObject *self, PyObject *arg) {
    (void)self;
    return peak_of("fma_peak", npattn_fma_peak, arg);
}

static PyObject *core_bf16_peak(PyObject *self, PyObject *arg) {
    (void)self;
    return peak_of("bf16_peak", npattn_bf16_peak, arg);
}

static PyObject *core_tile_peak(PyObject *self, PyObject *arg) {
    (void)self;
    return peak_of("tile_peak", npattn_tile_peak, arg);
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

static PyObject *core_set_openmp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *parallel, *thread_num;
    if (!PyArg_ParseTuple(args, "OO:set_openmp", &parallel, &thread_num)) return NULL;
    void *p = PyLong_AsVoidPtr(parallel), *t = p || !PyErr_Occurred() ? PyLong_AsVoidPtr(thread_num) : NULL;
    if (PyErr_Occurred()) return NULL;
    /* function pointers from the addresses ctypes found */
    npattn_omp_parallel_fn pf;
    npattn_omp_thread_num_fn tf;
    memcpy(&pf, &p, sizeof pf);
    memcpy(&tf, &t, sizeof tf);
    npattn_pool_use_openmp(pf, tf);
    Py_RETURN_NONE;
}

static PyObject *core_openmp_here(PyObject *self, PyObject *on) {
    (void)self;
    int flag = PyObject_IsTrue(on);
    if (flag < 0) return NULL;
    return PyBool_FromLong(npattn_pool_openmp_here(flag));
}

static PyMethodDef core_methods[] = {
    {"sdpa", (PyCFunction)(void (*)(void))core_sdpa, METH_FASTCALL | METH_KEYWORDS,
     "sdpa(*, q, k, v, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, return_lse, precision, out, "
     "threads, k_scale, k_zero, v_scale, v_zero)\n--\n\n"
     "Private: npattn.sdpa's arguments, by name, as given; with return_lse, (out, lse, the options used)."},
    {"attention_weights", (PyCFunction)(void (*)(void))core_attention_weights, METH_FASTCALL | METH_KEYWORDS,
     "attention_weights(*, q, k, scale, mask, sinks, window, softcap, q_offset, k_offset, k_start, k_lengths, precision, "
     "threads, k_scale, k_zero)\n--\n\n"
     "Private: npattn.attention_weights's arguments, by name, as given."},
    {"paged_attention", (PyCFunction)(void (*)(void))core_paged_attention, METH_FASTCALL | METH_KEYWORDS,
     "paged_attention(*, q, k, v, block_table, context_lens, page_size, scale, mask, sinks, window, softcap, q_offset, "
     "return_lse, precision, out, threads, k_scale, k_zero, v_scale, v_zero)\n--\n\n"
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
    {"set_float8", core_set_float8, METH_O,
     "set_float8(dtype)\n--\n\nTell the core ml_dtypes.float8_e4m3fn's or float8_e5m2's dtype."},
    {"blas_info", core_blas_info, METH_NOARGS, "blas_info()\n--\n\nWhich OpenBLAS npattn runs on."},
    {"shutdown", core_shutdown, METH_NOARGS,
     "shutdown()\n--\n\nAt exit (atexit): stop every call in flight; later calls raise SystemExit."},
    {"fma_peak", core_fma_peak, METH_O,
     "fma_peak(seconds)\n--\n\nThe float32 FMA peak of this thread's core in GFLOP/s (the kernel table in use), for "
     "benchmarks."},
    {"bf16_peak", core_bf16_peak, METH_O,
     "bf16_peak(seconds)\n--\n\nThe bfloat16 dot products' peak (vdpbf16ps) of this thread's core in GFLOP/s, 0 where "
     "the kernel table in use has none, for benchmarks."},
    {"tile_peak", core_tile_peak, METH_O,
     "tile_peak(seconds)\n--\n\nThe AMX tiles' peak (tdpbf16ps on loaded tiles) of this thread's core in GFLOP/s, 0 "
     "unless the kernel table in use is amx, for benchmarks."},
    {"simd", core_simd, METH_NOARGS, "simd()\n--\n\nThe kernel table in use: amx, avx512bf16, avx512, avx2, neon or portable."},
    {"get_num_threads", core_get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\nThe default thread count: the CPUs available, capped by set_num_threads."},
    {"set_num_threads", core_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nCap the default thread count at n (n < 1: no cap)."},
    {"set_openmp", core_set_openmp, METH_VARARGS,
     "set_openmp(parallel, thread_num)\n--\n\nThe addresses of a loaded OpenMP runtime's GOMP_parallel and "
     "omp_get_thread_num (0, 0: none), whose team openmp_here lets a thread's calls use."},
    {"openmp_here", core_openmp_here, METH_O,
     "openmp_here(on)\n--\n\nWhether this thread's calls take their helpers from that OpenMP team; returns the "
     "setting before."},
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
    if (!args_init()) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_THREADS", NPATTN_MAX_THREADS)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

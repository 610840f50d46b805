/* module.c: npattn._core, the CPython + NumPy glue around the C core.
 *
 * The public npattn.sdpa (python/npattn/_api.py) validates and converts the
 * user's arguments; this file re-checks the layout it relies on, turns the
 * arrays into a struct npattn_problem (element strides, no copies), releases
 * the GIL around the core, relays Ctrl-C into the core's cancel callback and
 * maps statuses to exceptions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <numpy/arrayobject.h>

#include "attention.h"
#include "blas.h"
#include "kernels.h"

/* ---- Ctrl-C: the waiting caller takes the GIL back to check for signals ---- */

struct wait_state {
    PyThreadState *saved;
    int interrupted; /* a signal handler raised; the exception is set */
};

static int check_signals(void *arg) {
    struct wait_state *w = arg;
    PyEval_RestoreThread(w->saved);
    if (PyErr_CheckSignals() != 0) w->interrupted = 1;
    w->saved = PyEval_SaveThread();
    return w->interrupted;
}

/* ---- layout checks: what _api.py promised ---- */

static int fail(const char *msg) {
    PyErr_Format(PyExc_ValueError, "sdpa: internal layout check failed: %s", msg);
    return -1;
}

/* Element strides of a, or -1 with an exception if a stride is not a whole
 * number of elements. */
static int element_strides(PyArrayObject *a, int64_t *out) {
    npy_intp item = PyArray_ITEMSIZE(a);
    for (int d = 0; d < PyArray_NDIM(a); d++) {
        npy_intp s = PyArray_STRIDE(a, d);
        if (s % item != 0) return fail("a stride is not a whole number of elements");
        out[d] = (int64_t)(s / item);
    }
    return 0;
}

/* type is a NumPy type number, or -1 for bfloat16: a 2-byte user dtype. */
static int check_array(PyObject *o, int type, int nd, int writeable, const char *name) {
    if (!PyArray_Check(o)) return fail(name);
    PyArrayObject *a = (PyArrayObject *)o;
    int type_ok = type >= 0 ? PyArray_TYPE(a) == type
                            : PyArray_TYPE(a) >= NPY_USERDEF && PyArray_ITEMSIZE(a) == 2;
    if (!type_ok || PyArray_NDIM(a) != nd || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) ||
        (writeable && !PyArray_ISWRITEABLE(a)))
        return fail(name);
    return 0;
}

/* The core's dtype for a NumPy type (-1: bfloat16), or -1. */
static int core_dtype(int type) {
    switch (type) {
    case NPY_FLOAT32: return NPATTN_DTYPE_F32;
    case NPY_FLOAT64: return NPATTN_DTYPE_F64;
    case NPY_HALF: return NPATTN_DTYPE_F16;
    case -1: return NPATTN_DTYPE_BF16;
    default: return -1;
    }
}

static PyObject *core_sdpa(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *ko, *vo, *oo, *mo, *so;
    double scale;
    int mask_kind, threads, bf16;
    if (!PyArg_ParseTuple(args, "OOOOdiOOip", &qo, &ko, &vo, &oo, &scale, &mask_kind, &mo, &so, &threads, &bf16))
        return NULL;
    if (!PyArray_Check(qo)) return fail("q"), NULL;
    int type = bf16 ? -1 : PyArray_TYPE((PyArrayObject *)qo);
    int dtype = core_dtype(type);
    if (dtype < 0) return fail("dtype"), NULL;
    int mask_type = dtype == NPATTN_DTYPE_F64 ? NPY_FLOAT64 : NPY_FLOAT32;
    int nd = PyArray_NDIM((PyArrayObject *)qo);
    if (nd < 3 || nd > NPY_MAXDIMS) return fail("rank"), NULL;
    if (check_array(qo, type, nd, 0, "q") || check_array(ko, type, nd, 0, "k") ||
        check_array(vo, type, nd, 0, "v") || check_array(oo, type, nd, 1, "out"))
        return NULL;
    PyArrayObject *q = (PyArrayObject *)qo, *k = (PyArrayObject *)ko, *v = (PyArrayObject *)vo,
                  *out = (PyArrayObject *)oo, *mask = NULL;
    int nb = nd - 3;
    npy_intp *qs = PyArray_DIMS(q), *ks = PyArray_DIMS(k), *vs = PyArray_DIMS(v), *os = PyArray_DIMS(out);
    for (int d = 0; d < nb; d++)
        if (ks[d] != qs[d] || vs[d] != qs[d] || os[d] != qs[d]) return fail("batch shapes"), NULL;
    if (ks[nb] < 1 || vs[nb] != ks[nb] || qs[nb] % ks[nb] != 0 || os[nb] != qs[nb]) return fail("heads"), NULL;
    if (vs[nb + 1] != ks[nb + 1] || os[nb + 1] != qs[nb + 1]) return fail("rows"), NULL;
    if (ks[nb + 2] != qs[nb + 2] || qs[nb + 2] < 1 || os[nb + 2] != vs[nb + 2]) return fail("widths"), NULL;
    if (threads < 1) return fail("threads"), NULL;

    if (mask_kind == NPATTN_MASK_BOOL || mask_kind == NPATTN_MASK_ADD) {
        if (check_array(mo, mask_kind == NPATTN_MASK_BOOL ? NPY_BOOL : mask_type, nd, 0, "mask")) return NULL;
        mask = (PyArrayObject *)mo;
        npy_intp *ms = PyArray_DIMS(mask);
        for (int d = 0; d < nb; d++)
            if (ms[d] != qs[d]) return fail("mask batch shape"), NULL;
        if (ms[nb] != qs[nb] || ms[nb + 1] != qs[nb + 1] || ms[nb + 2] != ks[nb + 1]) return fail("mask shape"), NULL;
    } else if (mask_kind < NPATTN_MASK_NONE || mask_kind > NPATTN_MASK_CAUSAL_TOP_LEFT) {
        return fail("mask kind"), NULL;
    }
    const double *sinks = NULL;
    if (so != Py_None) {
        if (check_array(so, NPY_FLOAT64, 1, 0, "sinks") || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)so) ||
            PyArray_DIM((PyArrayObject *)so, 0) != qs[nb])
            return fail("sinks"), NULL;
        sinks = PyArray_DATA((PyArrayObject *)so);
    }

    int64_t batch_shape[NPY_MAXDIMS], qst[NPY_MAXDIMS], kst[NPY_MAXDIMS], vst[NPY_MAXDIMS], ost[NPY_MAXDIMS],
        mst[NPY_MAXDIMS] = {0};
    if (element_strides(q, qst) || element_strides(k, kst) || element_strides(v, vst) ||
        element_strides(out, ost) || (mask && element_strides(mask, mst)))
        return NULL;
    for (int d = 0; d < nb; d++) batch_shape[d] = qs[d];
    /* BLAS reads k and v: contiguous last axis (the core checks the row stride) */
    if (ks[nb + 1] > 0 && ((ks[nb + 2] > 1 && kst[nb + 2] != 1) || (vs[nb + 2] > 1 && vst[nb + 2] != 1)))
        return fail("k or v last axis is not contiguous"), NULL;

    struct npattn_problem p = {
        .dtype = (enum npattn_dtype)dtype,
        .n_batch_dim = nb,
        .batch_shape = batch_shape,
        .n_head_q = qs[nb],
        .n_head_kv = ks[nb],
        .n_query = qs[nb + 1],
        .n_key = ks[nb + 1],
        .n_embd_k = qs[nb + 2],
        .n_embd_v = vs[nb + 2],
        .q = PyArray_DATA(q),
        .q_batch_stride = qst,
        .q_head_stride = qst[nb],
        .q_row_stride = qst[nb + 1],
        .q_col_stride = qst[nb + 2],
        .k = PyArray_DATA(k),
        .k_batch_stride = kst,
        .k_head_stride = kst[nb],
        .k_row_stride = kst[nb + 1],
        .v = PyArray_DATA(v),
        .v_batch_stride = vst,
        .v_head_stride = vst[nb],
        .v_row_stride = vst[nb + 1],
        .out = PyArray_DATA(out),
        .out_batch_stride = ost,
        .out_head_stride = ost[nb],
        .out_row_stride = ost[nb + 1],
        .out_col_stride = ost[nb + 2],
        .scale = scale,
        .mask_kind = (enum npattn_mask_kind)mask_kind,
        .mask = mask ? PyArray_DATA(mask) : NULL,
        .mask_batch_stride = mst,
        .mask_head_stride = mst[nb],
        .mask_row_stride = mst[nb + 1],
        .mask_col_stride = mst[nb + 2],
        .sinks = sinks,
        .n_threads = threads,
        .cancel = check_signals,
    };
    struct wait_state w = {NULL, 0};
    p.cancel_arg = &w;

    w.saved = PyEval_SaveThread();
    enum npattn_status status = npattn_sdpa(&p);
    PyEval_RestoreThread(w.saved);

    switch (status) {
    case NPATTN_STATUS_OK:
        Py_RETURN_NONE;
    case NPATTN_STATUS_CANCELLED:
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyboardInterrupt, "sdpa: cancelled");
        return NULL;
    case NPATTN_STATUS_NO_MEMORY:
        PyErr_Format(PyExc_MemoryError, "sdpa: %s", npattn_status_string(status));
        return NULL;
    case NPATTN_STATUS_TOO_LARGE:
        PyErr_Format(PyExc_ValueError, "sdpa: %s", npattn_status_string(status));
        return NULL;
    default:
        PyErr_Format(PyExc_RuntimeError, "sdpa: internal error: %s", npattn_status_string(status));
        return NULL;
    }
}

static PyObject *core_blas_info(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    const char *config = npattn_blas_get_config();
#ifdef NPATTN_BLAS_SCIPY
    const char *source = "scipy-openblas32 (bundled)";
#else
    const char *source = "system OpenBLAS";
#endif
    return PyUnicode_FromFormat("%s: %s", source, config ? config : "?");
}

static PyObject *core_debug_fail_alloc_after(PyObject *self, PyObject *arg) {
    (void)self;
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    npattn_debug_fail_alloc_after((int64_t)n);
    Py_RETURN_NONE;
}

static PyObject *core_simd(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyUnicode_FromString(npattn_simd_name());
}

static PyObject *core_debug_force_simd(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (npattn_simd_force(name) != 0)
        return PyErr_Format(PyExc_ValueError, "this CPU cannot run the %R kernels", arg);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"sdpa", core_sdpa, METH_VARARGS,
     "sdpa(q, k, v, out, scale, mask_kind, mask, sinks, threads, bfloat16)\n--\n\n"
     "Private: npattn.sdpa validates, then calls this on prepared arrays."},
    {"blas_info", core_blas_info, METH_NOARGS, "blas_info()\n--\n\nWhich OpenBLAS npattn runs on."},
    {"simd", core_simd, METH_NOARGS, "simd()\n--\n\nThe float32 kernel variant in use: avx512, avx2 or portable."},
    {"debug_force_simd", core_debug_force_simd, METH_O,
     "debug_force_simd(name)\n--\n\nTest hook: run the named kernel variant; '' restores the best."},
    {"debug_fail_alloc_after", core_debug_fail_alloc_after, METH_O,
     "debug_fail_alloc_after(n)\n--\n\nTest hook: allocations in the core fail after n more; -1 turns it off."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "npattn._core", "npattn's C core (private).", -1, core_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "MASK_NONE", NPATTN_MASK_NONE) ||
        PyModule_AddIntConstant(m, "MASK_CAUSAL", NPATTN_MASK_CAUSAL) ||
        PyModule_AddIntConstant(m, "MASK_CAUSAL_TOP_LEFT", NPATTN_MASK_CAUSAL_TOP_LEFT) ||
        PyModule_AddIntConstant(m, "MASK_BOOL", NPATTN_MASK_BOOL) ||
        PyModule_AddIntConstant(m, "MASK_ADD", NPATTN_MASK_ADD)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

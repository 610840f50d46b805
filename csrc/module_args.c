/* module_args.c: npattn._core's arguments. The keyword set (OPTIONS in
 * module.h) names every option of every entry point; each option has one
 * reader here, which checks what describing it needs (its kind, rank, dtype,
 * and the sizes two operands share) and describes it to the core in place:
 * NumPy arrays of the core's dtypes, aligned and native, with any strides.
 * What it cannot read in place (a list, an MLX array, a torch tensor, a
 * byte-swapped or misaligned array) goes through the conversion function
 * npattn._args registers (set_converter), then is read the same way. Every
 * array read is noted (reads()), so that out is checked against them all.
 */
#include "module.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#define AS_NAME(name) #name,
/* ---- the keyword set: every option of every entry point, read in one place ---- */

static const char *const option_names[N_OPTION] = {OPTIONS(AS_NAME)};
static PyObject *option_strings[N_OPTION]; /* interned at import (args_init) */

int bfloat16_type = -1; /* ml_dtypes.bfloat16's type number, once Python has seen it */
int float8_types[2] = {-1, -1}; /* ml_dtypes.float8_e4m3fn's and float8_e5m2's, likewise */
PyObject *converter;    /* npattn._args.convert(fn, name, x): an array the core reads */

void call_init(struct call *c, const char *fn) {
    memset(c, 0, offsetof(struct call, q));
    struct operand *ops[] = {&c->q,  &c->k,  &c->v,  &c->mask,    &c->out,    &c->lse,     &c->weights, &c->dout,
                             &c->dq, &c->dk, &c->dv, &c->k_scale, &c->k_zero, &c->v_scale, &c->v_zero};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) ops[i]->a = NULL;
    c->fn = fn;
}

void call_release(struct call *c) {
    for (int i = 0; i < c->n_owned; i++) Py_DECREF(c->owned[i]);
    c->n_owned = 0;
}

/* Takes the new reference o into the call (NULL passes through). */
PyObject *own(struct call *c, PyObject *o) {
    if (o && c->n_owned == MAX_OWNED) {
        Py_DECREF(o);
        return PyErr_Format(PyExc_RuntimeError, "%s: internal error: too many arrays", c->fn);
    }
    if (o) c->owned[c->n_owned++] = o;
    return o;
}

/* Reads the keywords of an entry point that takes exactly `want`. */
int read_keywords(struct call *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, unsigned want) {
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
const char *name_of(const struct call *c, enum option o) {
    if (c->paged && o == OPT_k) return "key_pages";
    if (c->paged && o == OPT_v) return "value_pages";
    return option_names[o];
}

/* ---- describing arrays ---- */

/* The core's dtype of a NumPy type number, or -1. */
int core_dtype_of(int t) {
    if (t == NPY_FLOAT32) return NPATTN_DTYPE_F32;
    if (t == NPY_FLOAT64) return NPATTN_DTYPE_F64;
    if (t == NPY_HALF) return NPATTN_DTYPE_F16;
    if (t == bfloat16_type && bfloat16_type >= 0) return NPATTN_DTYPE_BF16;
    return -1;
}

/* The core's dtype of a NumPy array, or -1. */
int core_dtype(PyArrayObject *a) { return core_dtype_of(PyArray_TYPE(a)); }

/* The core's code dtype of a NumPy array (int8, uint8, ml_dtypes' fp8), or -1. */
int code_dtype(PyArrayObject *a) {
    const int t = PyArray_TYPE(a);
    if (t == NPY_INT8) return NPATTN_DTYPE_I8;
    if (t == NPY_UINT8) return NPATTN_DTYPE_U8;
    if (t == float8_types[0] && t >= 0) return NPATTN_DTYPE_F8E4M3;
    if (t == float8_types[1] && t >= 0) return NPATTN_DTYPE_F8E5M2;
    return -1;
}

/* k's or v's dtype for the core: its float dtype, or its codes'. */
static int kv_dtype(PyArrayObject *a) { return code_dtype(a) >= 0 ? code_dtype(a) : core_dtype(a); }

/* The dtype of the result of two dtypes, as np.result_type (float16 with
 * bfloat16, which NumPy cannot promote, gives float32). The one rule of
 * promotion: Python reads it through result_dtype() below. */
int promote(int a, int b) {
    if (a == b) return a;
    if (a == NPATTN_DTYPE_F64 || b == NPATTN_DTYPE_F64) return NPATTN_DTYPE_F64;
    return NPATTN_DTYPE_F32;
}

int npy_type_of(int dtype) {
    switch (dtype) {
    case NPATTN_DTYPE_F32: return NPY_FLOAT32;
    case NPATTN_DTYPE_F64: return NPY_FLOAT64;
    case NPATTN_DTYPE_F16: return NPY_HALF;
    default: return bfloat16_type;
    }
}

/* What an array read in place may hold besides floats. */
enum { READ_BOOL = 1, READ_CODES = 2 };

/* An array the core can read in place: aligned, native, whole-element strides,
 * of floats or the `kinds` of READ_BOOL and READ_CODES. */
static int readable(PyObject *o, int kinds) {
    if (!PyArray_Check(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    const int other = ((kinds & READ_BOOL) && PyArray_TYPE(a) == NPY_BOOL) || ((kinds & READ_CODES) && code_dtype(a) >= 0);
    if (!other && core_dtype(a) < 0) return 0;
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
static PyArrayObject *array_of(struct call *c, PyObject *x, const char *name, int kinds) {
    if (!reads(c, x, name)) return NULL;
    if (readable(x, kinds)) return (PyArrayObject *)x;
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
const char *type_name(PyObject *x) {
    const char *name = Py_TYPE(x)->tp_name, *dot = strrchr(name, '.');
    return dot ? dot + 1 : name;
}

PyObject *tuple_of(const npy_intp *dims, int nd) {
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

PyObject *shape_of(PyArrayObject *a) { return tuple_of(PyArray_DIMS(a), PyArray_NDIM(a)); }

/* An array operand: a TypeError naming it unless its dtype is one the core
 * computes (`codes`: or codes). */
static int float_dtype(struct call *c, PyArrayObject *a, const char *name, int codes) {
    if (core_dtype(a) >= 0 || (codes && code_dtype(a) >= 0)) return 1;
    PyArray_Descr *d = PyArray_DESCR(a);
    if (d->kind == 'f' && PyDataType_ELSIZE(d) > 8)
        PyErr_Format(PyExc_TypeError, "%s: %s has dtype %S; the widest dtype computed is float64", c->fn, name, d);
    else
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of floats%s, got dtype %S", c->fn, name,
                     codes ? " (or of int8, uint8, float8_e4m3fn or float8_e5m2 codes, with their scale)" : "", d);
    return 0;
}

/* Fills t from operand o whose last `tail` dims are (heads, rows, cols), or
 * (heads, rows) for tail 2, the rest batch dims broadcast against c->batch.
 * Dims the array lacks, and dims of size 1, get stride 0. */
void describe(struct call *c, struct operand *o, struct npattn_tensor *t, int dtype, int tail) {
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
PyArrayObject *float_array(struct call *c, enum option o) {
    const char *name = name_of(c, o);
    PyObject *x = c->opt[o];
    if (x == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of floats, got None", c->fn, name);
        return NULL;
    }
    PyArrayObject *a = array_of(c, x, name, 0);
    return a && float_dtype(c, a, name, 0) ? a : NULL;
}

/* q, k or v: an array of floats of rank >= 2 (k and v: or of codes). */
static int read_operand(struct call *c, enum option o, struct operand *op) {
    const char *name = name_of(c, o);
    PyArrayObject *a;
    if (o == OPT_q) {
        a = float_array(c, o);
    } else if (c->opt[o] == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an array of floats or codes, got None", c->fn, name);
        return 0;
    } else {
        a = array_of(c, c->opt[o], name, READ_CODES);
        if (a && !float_dtype(c, a, name, 1)) a = NULL;
    }
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

/* The result's dtype of q, k and v (NULL: none): promoted from the float
 * operands' (codes take no part: they stand for floats of their scale's
 * precision, and the result is q's where both k and v hold codes). */
static int result_of(PyArrayObject *q, PyArrayObject *k, PyArrayObject *v) {
    int result = core_dtype(q);
    if (code_dtype(k) < 0) result = promote(result, core_dtype(k));
    if (v && code_dtype(v) < 0) result = promote(result, core_dtype(v));
    return result;
}

/* q, k and (if has_v) v, whose shared sizes agree. */
int read_qkv(struct call *c, int has_v) {
    if (!read_operand(c, OPT_q, &c->q) || !read_operand(c, OPT_k, &c->k) || (has_v && !read_operand(c, OPT_v, &c->v)))
        return 0;
    int nq = PyArray_NDIM(c->q.a), nk = PyArray_NDIM(c->k.a), nv = has_v ? PyArray_NDIM(c->v.a) : 2;
    c->rank2 = nq == 2 && nk == 2 && nv == 2;
    npy_intp *qs = PyArray_DIMS(c->q.a), *ks = PyArray_DIMS(c->k.a);
    npy_intp H_q = nq > 2 ? qs[nq - 3] : 1, H_kv = nk > 2 ? ks[nk - 3] : 1;
    if (ks[nk - 1] != qs[nq - 1]) return shapes_break(c, "k's row width D must equal q's");
    c->result = result_of(c->q.a, c->k.a, has_v ? c->v.a : NULL);
    if (has_v) {
        npy_intp *vs = PyArray_DIMS(c->v.a);
        if (vs[nv - 2] != ks[nk - 2]) return shapes_break(c, "v must have as many rows S as k");
        if ((nv > 2 ? vs[nv - 3] : 1) != H_kv) return shapes_break(c, "v must have as many heads as k");
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
    describe(c, &c->k, &p->k, kv_dtype(c->k.a), 3);
    if (has_v) describe(c, &c->v, &p->v, kv_dtype(c->v.a), 3);
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
int read_scale(struct call *c) {
    PyObject *x = c->opt[OPT_scale];
    struct npattn_problem *p = &c->p;
    if (x == Py_None) {
        p->scale = 1.0 / sqrt((double)p->n_embd_k);
        return 1;
    }
    int real = real_of(x, &p->scale);
    if (real == 0 && !PyArray_IsScalar(x, Generic) && PyObject_HasAttrString(x, "shape")) {
        /* a 0-d array of NumPy, MLX or PyTorch */
        PyArrayObject *a = array_of(c, x, "scale", READ_BOOL);
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
int read_mask(struct call *c) {
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
    PyArrayObject *m = array_of(c, mask, "mask", READ_BOOL);
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
        if (!(s = array_of(c, x, "sinks", READ_BOOL))) return 0;
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
int read_paged(struct call *c) {
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
    c->result = result_of(q, k, v);
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
    describe(c, &c->k, &p->k, kv_dtype(k), 3);
    describe(c, &c->v, &p->v, kv_dtype(v), 3);
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

/* ---- codes: k_scale, k_zero, v_scale, v_zero (SPEC section 14) ---- */

/* Whether the elements of a (F32, F16 or BF16) from dim d on, at `at`, are
 * all finite: each distinct one read once (a zero-stride dim once). */
static int finite_from(PyArrayObject *a, int dtype, int d, const char *at) {
    const int nd = PyArray_NDIM(a);
    if (d == nd) { /* a 0-d array's one element */
        if (dtype == NPATTN_DTYPE_F32) return (*(const uint32_t *)at & 0x7f800000u) != 0x7f800000u;
        const uint16_t mask = dtype == NPATTN_DTYPE_F16 ? 0x7c00 : 0x7f80;
        return (*(const uint16_t *)at & mask) != mask;
    }
    const npy_intp st = PyArray_STRIDE(a, d), n = st == 0 && PyArray_DIM(a, d) > 0 ? 1 : PyArray_DIM(a, d);
    if (d < nd - 1) {
        for (npy_intp i = 0; i < n; i++)
            if (!finite_from(a, dtype, d + 1, at + i * st)) return 0;
        return 1;
    }
    int bad = 0; /* the last dim: a loop the compiler vectorises where the stride is one element */
    if (dtype == NPATTN_DTYPE_F32)
        for (npy_intp i = 0; i < n; i++) bad |= (*(const uint32_t *)(at + i * st) & 0x7f800000u) == 0x7f800000u;
    else {
        const uint16_t mask = dtype == NPATTN_DTYPE_F16 ? 0x7c00 : 0x7f80;
        for (npy_intp i = 0; i < n; i++) bad |= (*(const uint16_t *)(at + i * st) & mask) == mask;
    }
    return !bad;
}

/* Whether the scales (or zero points) a of a paged call that it reads are
 * finite: those of the pages its requests' live entries name (entries
 * outside [0, P), which the core refuses, skipped), or all of them where
 * the pages share them. */
static int pages_finite(struct call *c, PyArrayObject *a, int dtype) {
    if (PyArray_NDIM(a) < 4 || PyArray_DIM(a, 0) == 1) return finite_from(a, dtype, 0, PyArray_BYTES(a));
    const struct npattn_pages *pg = &c->pages;
    for (int64_t b = 0; b < c->batch[0]; b++)
        for (int64_t i = 0; i < pg->table_stride; i++) {
            const int64_t page = pg->block_table[b * pg->table_stride + i];
            if (page >= 0 && page < pg->n_page && !finite_from(a, dtype, 1, PyArray_BYTES(a) + page * PyArray_STRIDE(a, 0)))
                return 0;
        }
    return 1;
}

/* The last axis of a scale or zero point: its groups (1 for a 0-d array). */
static npy_intp groups_of(PyArrayObject *a) { return PyArray_NDIM(a) ? PyArray_DIM(a, PyArray_NDIM(a) - 1) : 1; }

/* The ValueError of a scale (or zero point) `name` whose shape does not
 * broadcast to codes' groups, codes.shape[:-1] + (G,). Returns 0. */
static int groups_break(struct call *c, const char *name, PyArrayObject *a, PyArrayObject *codes, const char *codes_name,
                        npy_intp G) {
    npy_intp want[NPY_MAXDIMS];
    const int nc = PyArray_NDIM(codes);
    for (int d = 0; d < nc - 1; d++) want[d] = PyArray_DIM(codes, d);
    want[nc - 1] = G;
    PyObject *groups = tuple_of(want, nc), *got = shape_of(a), *shape = shape_of(codes);
    if (groups && got && shape)
        PyErr_Format(PyExc_ValueError, "%s: %s %S does not broadcast to %S, %s's shape %S with %zd %s a row", c->fn,
                     name, got, groups, codes_name, shape, (Py_ssize_t)G, G == 1 ? "scale" : "groups");
    Py_XDECREF(groups);
    Py_XDECREF(got);
    Py_XDECREF(shape);
    return 0;
}

/* A scale or zero point (option o) of k or v: an array of float32, float16
 * or bfloat16 the core reads in place; NULL with the TypeError naming it. */
static PyArrayObject *groups_array(struct call *c, enum option o) {
    const char *name = name_of(c, o);
    PyArrayObject *a = array_of(c, c->opt[o], name, 0);
    if (!a) return NULL;
    const int t = core_dtype(a);
    if (t == NPATTN_DTYPE_F32 || t == NPATTN_DTYPE_F16 || t == NPATTN_DTYPE_BF16) return a;
    PyErr_Format(PyExc_TypeError, "%s: %s must be float32, float16 or bfloat16%s, got dtype %S", c->fn, name,
                 t == NPATTN_DTYPE_F64 ? " (np.float32(x) for one number)" : "", PyArray_DESCR(a));
    return NULL;
}

/* The scale and zero point (options os, oz; operands so, zo) of k or v
 * (codes), as the core reads them (*cd): arrays whose shapes broadcast to
 * codes.shape[:-1] + (G,), G their last axis (one of them may have 1:
 * broadcast to the other's), read in place through their strides, a
 * dim of size 1 broadcasting; paged like the pages where codes are pages.
 * Each finite (the elements a call reads: for pages, those of its live
 * pages). Where codes holds floats, the core refuses a scale given. */
static int read_groups(struct call *c, struct operand *codes, enum option os, enum option oz, struct operand *so,
                       struct operand *zo, struct npattn_codes *cd) {
    memset(cd, 0, sizeof *cd);
    const int is_codes = code_dtype(codes->a) >= 0;
    const char *codes_name = name_of(c, codes == &c->k ? OPT_k : OPT_v);
    const enum option opts[2] = {os, oz};
    struct operand *ops[2] = {so, zo};
    struct npattn_tensor *ts[2] = {&cd->scale, &cd->zero};
    for (int i = 0; i < 2; i++) { /* the arrays and their dtypes */
        if (c->opt[opts[i]] == Py_None) continue;
        if (!(ops[i]->a = groups_array(c, opts[i]))) return 0;
    }
    const npy_intp Gs = so->a ? groups_of(so->a) : 1, Gz = zo->a ? groups_of(zo->a) : 1;
    const npy_intp G = Gs == 1 ? Gz : Gs;
    for (int i = 0; i < 2; i++) {
        PyArrayObject *a = ops[i]->a;
        if (!a) continue;
        const int nd = PyArray_NDIM(a), nc = PyArray_NDIM(codes->a);
        int fits = !is_codes || nd <= nc;
        for (int d = 0; is_codes && fits && d < nd; d++) {
            const npy_intp n = PyArray_DIM(a, d), want = d == nd - 1 ? G : PyArray_DIM(codes->a, nc - nd + d);
            fits = n == want || n == 1;
        }
        if (!fits) return groups_break(c, name_of(c, opts[i]), a, codes->a, codes_name, G);
        if (is_codes && !(c->paged ? pages_finite(c, a, core_dtype(a)) : finite_from(a, core_dtype(a), 0, PyArray_BYTES(a)))) {
            PyObject *got = shape_of(a);
            if (got) PyErr_Format(PyExc_ValueError, "%s: %s holds NaN or infinity; got %s %S", c->fn, name_of(c, opts[i]),
                                  name_of(c, opts[i]), got);
            Py_XDECREF(got);
            return 0;
        }
        describe(c, ops[i], ts[i], core_dtype(a), 3);
        if (c->paged) { /* the page dim reads as the batch dim; its stride goes to the pages */
            int64_t *page_stride = i ? &cd->zero_page_stride : &cd->scale_page_stride;
            *page_stride = ops[i]->batch_stride[0];
            ops[i]->batch_stride[0] = 0;
        }
    }
    cd->n_group = G;
    return 1;
}

int read_codes(struct call *c, int has_v) {
    struct npattn_problem *p = &c->p;
    if (!read_groups(c, &c->k, OPT_k_scale, OPT_k_zero, &c->k_scale, &c->k_zero, &p->k_codes)) return 0;
    if (!has_v) return 1;
    return read_groups(c, &c->v, OPT_v_scale, OPT_v_zero, &c->v_scale, &c->v_zero, &p->v_codes);
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
int read_options(struct call *c) {
    return read_scale(c) && read_mask(c) && read_sinks(c) && read_window(c) && read_softcap(c) && read_offsets(c) &&
           read_precision(c) && read_threads(c);
}

/* sdpa's out: the caller's array, of exactly the result's shape and dtype,
 * writeable and readable in place. */
int read_out(struct call *c, const npy_intp *shape, int nd) {
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

/* out overlaps none of the arrays the call read, as given or as converted
 * (numpy.may_share_memory's bounds): checked here once for every operand,
 * the core's copies and int arrays included, before anything is written. */
int out_clear_of_inputs(struct call *c) {
    const char *lo, *hi, *in_lo, *in_hi;
    if (!byte_span(c->out.a, &lo, &hi)) return 1;
    for (int i = 0; i < c->n_inputs; i++)
        if (byte_span(c->inputs[i].a, &in_lo, &in_hi) && in_lo < hi && lo < in_hi) return out_shares(c, c->inputs[i].name);
    return 1;
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
PyObject *options_used(struct call *c) {
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

/* An input of the backward pass (dout, out, lse) of exactly `shape`, `what`
 * naming that shape; an lse of float16 or bfloat16 is read as float32. */
int read_fitting(struct call *c, enum option o, struct operand *op, struct npattn_tensor *t, const npy_intp *shape,
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

/* The keywords' names interned and 0 made, once, at import; 0 with the error. */
int args_init(void) {
    if (!zero_int && !(zero_int = PyLong_FromLong(0))) return 0;
    for (int o = 0; o < N_OPTION; o++)
        if (!option_strings[o] && !(option_strings[o] = PyUnicode_InternFromString(option_names[o]))) return 0;
    return 1;
}

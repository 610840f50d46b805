/* module_errors.c: npattn._core's errors. Each names the argument, the rule
 * and what it got; refused() maps the core's verdict (a status, the operand,
 * the request or table entry) to the exception it deserves, phrasing the
 * core's rules without checking them again.
 */
#include "module.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Raises exc with "fn: " + the message fmt makes of one object (a new
 * reference, consumed; NULL passes its error through). Returns 0. */
int raise_with(struct call *c, PyObject *exc, const char *fmt, PyObject *x) {
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
PyObject *short_repr(PyObject *x, Py_ssize_t n) { return shortened(PyObject_Repr(x), n); }
PyObject *short_str(PyObject *x, Py_ssize_t n) { return shortened(PyObject_Str(x), n); }
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
int shapes_break(struct call *c, const char *rule) {
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

/* out shares memory with the input `name`: the ValueError. Returns 0. */
int out_shares(struct call *c, const char *name) {
    PyErr_Format(PyExc_ValueError, "%s: out must not share memory with an input, got out sharing memory with %s", c->fn,
                 name);
    return 0;
}

/* ---- the core's verdict, phrased ---- */

/* Request b's index in the batch shape, "[1, 0]" ("" without batch dims). */
void request_index(const struct call *c, int64_t b, char *index) {
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

/* The verdict on codes and their scales (SPEC section 14), phrased:
 * TypeError for codes without their scale, or in a backward problem;
 * ValueError for the rest. Returns 0. */
static int codes_refused(struct call *c, const struct npattn_verdict *why) {
    const enum npattn_operand at = why->operand;
    const int of_v = at == NPATTN_OPERAND_V || at == NPATTN_OPERAND_V_SCALE || at == NPATTN_OPERAND_V_ZERO;
    PyArrayObject *codes = of_v ? c->v.a : c->k.a;
    const char *codes_name = name_of(c, of_v ? OPT_v : OPT_k);
    const enum option scale = of_v ? OPT_v_scale : OPT_k_scale, zero = of_v ? OPT_v_zero : OPT_k_zero;
    PyArray_Descr *d = PyArray_DESCR(codes);
    switch (why->status) {
    case NPATTN_STATUS_NO_CODE_SCALE:
        PyErr_Format(PyExc_TypeError,
                     "%s: %s holds %S codes, which need %s, the scale each code is multiplied by (npattn.quantize "
                     "returns codes with their scale)",
                     c->fn, codes_name, d, name_of(c, scale));
        return 0;
    case NPATTN_STATUS_NOT_CODES:
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is for codes (int8, uint8, float8_e4m3fn, float8_e5m2), but %s holds %S values",
                     c->fn, npattn_operand_name(at), codes_name, d);
        return 0;
    case NPATTN_STATUS_SYMMETRIC_CODES:
        PyErr_Format(PyExc_ValueError, "%s: %s: %S codes are symmetric and take no zero point", c->fn,
                     name_of(c, zero), d);
        return 0;
    case NPATTN_STATUS_CODES_NO_GRADIENT:
        PyErr_Format(PyExc_TypeError,
                     "%s: %s holds %S codes, and there is no gradient through codes; for the gradients of the "
                     "values they stand for, pass npattn.dequantize(%s, scale, zero)",
                     c->fn, codes_name, d, codes_name);
        return 0;
    default: break;
    }
    /* the groups: named after the array whose last axis gave them */
    const struct npattn_codes *cd = of_v ? &c->p.v_codes : &c->p.k_codes;
    struct operand *op = of_v ? &c->v_scale : &c->k_scale, *zop = of_v ? &c->v_zero : &c->k_zero;
    const int by_zero = zop->a && op->a && PyArray_NDIM(zop->a) && PyArray_DIM(zop->a, PyArray_NDIM(zop->a) - 1) == cd->n_group &&
                        !(PyArray_NDIM(op->a) && PyArray_DIM(op->a, PyArray_NDIM(op->a) - 1) == cd->n_group);
    PyArrayObject *a = by_zero ? zop->a : op->a;
    const char *name = name_of(c, by_zero ? zero : scale);
    PyObject *got = shape_of(a), *shape = shape_of(codes);
    const npy_intp width = PyArray_DIM(codes, PyArray_NDIM(codes) - 1);
    if (got && shape)
        PyErr_Format(PyExc_ValueError,
                     "%s: %s's last axis, %lld groups, must divide %s's row width %s = %zd; got %s %S, %s %S", c->fn,
                     name, (long long)cd->n_group, codes_name, of_v ? "D_v" : "D", (Py_ssize_t)width, name, got,
                     codes_name, shape);
    Py_XDECREF(got);
    Py_XDECREF(shape);
    return 0;
}

/* Raises the exception a refused call deserves; returns NULL. bp: the
 * backward problem, or NULL for the forward one. */
PyObject *refused(struct call *c, enum npattn_status status, const struct npattn_backward_problem *bp) {
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
    case NPATTN_STATUS_NO_CODE_SCALE:
    case NPATTN_STATUS_NOT_CODES:
    case NPATTN_STATUS_BAD_GROUPS:
    case NPATTN_STATUS_SYMMETRIC_CODES:
    case NPATTN_STATUS_CODES_NO_GRADIENT: return codes_refused(c, &why), NULL;
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

/* plan.c: what the forward and backward planners share: whether a problem
 * computes in double, whether BLAS reads an operand in place, the threads
 * the work repays, and the per-slot scratch with the rerun in double of a
 * float task that met an extreme. The planners themselves are forward.c and
 * backward.c. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "internal.h"

static int float_normal(double x) { return x == 0 || (fabs(x) >= FLT_MIN && fabs(x) <= FLT_MAX); }

int npattn_computes_f64(const struct npattn_problem *p, enum npattn_dtype result) {
    return result == NPATTN_DTYPE_F64 || !float_normal(p->scale) ||
           (p->softcap > 0 && (!float_normal(p->softcap) || !float_normal(1.0 / p->softcap)));
}

int npattn_blas_direct(const struct npattn_tensor *t, enum npattn_dtype dtype, int64_t rows, int64_t width,
                       int64_t *ld) {
    if (t->dtype != dtype || (width > 1 && t->col_stride != 1)) return 0;
    *ld = rows > 1 ? t->row_stride : (width > 1 ? width : 1);
    return *ld >= width && *ld >= 1 && *ld <= INT_MAX;
}

struct npattn_threads npattn_plan_threads(double flops, double wake, double want, int32_t n_threads) {
    struct npattn_threads t = {1, 1};
    const int repays = flops >= wake, every = npattn_pool_mode() == 2;
    if (repays || every) {
        int32_t avail = npattn_pool_threads(n_threads);
        t.plan = repays ? (int32_t)min64(avail, max64(2, (int64_t)want)) : 1;
        t.run = every ? avail : t.plan;
    }
    return t;
}

enum npattn_status npattn_slots_alloc(struct npattn_slots *s, int32_t n, size_t size, size_t exact_size) {
    memset(s, 0, sizeof *s);
    s->n = n, s->size = (size + 63) / 64 * 64, s->exact_size = exact_size;
    if (n > 0 && s->size > SIZE_MAX / (size_t)n) return NPATTN_STATUS_NO_MEMORY;
    s->scratch = npattn_alloc(s->size * (size_t)n);
    if (s->scratch && exact_size) {
        s->exact = npattn_alloc((size_t)n * sizeof *s->exact);
        if (s->exact) memset(s->exact, 0, (size_t)n * sizeof *s->exact);
    }
    if (!s->scratch || (exact_size && !s->exact)) {
        npattn_slots_free(s);
        return NPATTN_STATUS_NO_MEMORY;
    }
    return NPATTN_STATUS_OK;
}

void npattn_slots_free(struct npattn_slots *s) {
    if (s->exact)
        for (int32_t i = 0; i < s->n; i++) npattn_free(s->exact[i]);
    npattn_free(s->exact);
    npattn_free(s->scratch);
    memset(s, 0, sizeof *s);
}

void npattn_run_exact(void *plan, int64_t task, int32_t slot, struct npattn_slots *s, npattn_tile_fn in_f32,
                      npattn_tile_fn in_f64, struct npattn_run *run) {
    if (!s->exact) {
        in_f64(plan, task, slot, npattn_slot(s, slot));
        return;
    }
    if (!in_f32(plan, task, slot, npattn_slot(s, slot))) return;
    if (!s->exact[slot] && !(s->exact[slot] = npattn_alloc(s->exact_size))) {
        npattn_run_fail(run, NPATTN_STATUS_NO_MEMORY);
        return;
    }
    in_f64(plan, task, slot, s->exact[slot]);
}

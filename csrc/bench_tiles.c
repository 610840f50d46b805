/* bench_tiles.c: the stages of one key tile of the amx table's bfloat16
 * prefill, timed on one core against the core's ceilings. Not a test: `make
 * -C csrc bench` builds it at setup.py's -O3 and runs it.
 *
 * The tile is the Qwen3-4B "fast" prefill's as forward.c sizes it: 256
 * stacked rows (4 query heads x 64 positions), 256 keys, D = D_v = 128, no
 * mask within it. Its stages as tile_fwd.h runs them on the PV_PATH_BF16_TILES
 * path: scores on the tiles (scores_bf16), the softmax that writes P's
 * pairs as A tiles (softmax_tiles_f32), O's rows rescaled where their max
 * grew, P @ V on the tiles (accumulate_tiles_bf16); the step, all four in
 * turn; and the table's pipelined step (prefill_tiles_bf16: the same on K's
 * pairs laid out as B tiles, the softmax by rows between the tiles'
 * products), which replaces them where the table has it. The ceilings:
 * fma_loop, bf16_loop (vdpbf16ps) and tile_loop (tdpbf16ps), in registers.
 *
 * Each figure is the minimum and the median over rounds in which every
 * stage runs once, in turn, so that a shared core's noise hits them alike;
 * two entries of the same step ("step" and "step again") show that noise.
 *
 *   bench_tiles [rounds] [table]     (defaults: 400, amx)
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hooks.h"
#include "kernels/kernels.h"

#define ROWS 256 /* stacked rows */
#define NK 256   /* keys */
#define D 128    /* = D_v */
#define NP (NK / 2)
#define MAX_STAGES 16

static uint64_t seed = 88172645463325252ull;
static double uniform(void) { /* xorshift64, in [-1, 1) */
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return (double)(seed >> 11) / (double)(1ull << 52) - 1.0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The tile's operands and scratch, 64-byte aligned. */
struct bench {
    const struct npattn_kernels *kn;
    uint16_t *q, *k, *v;          /* rows (ROWS, D), (NK, D), (NK, D) as bfloat16 */
    uint32_t *qp, *vp, *pa, *kb;  /* Q^T's pairs (D / 2, ROWS); V's pairs (NP, D); P's A tiles (ROWS, NP); K's B tiles */
    float *st, *o, *m, *l, *alpha, *m0, *work;
    struct npattn_score_tile tile;
};

static void *aligned(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, (bytes + 63) / 64 * 64)) {
        fprintf(stdout, "out of memory\n");
        exit(1);
    }
    memset(p, 0, bytes);
    return p;
}

/* Random rows of bfloat16 values about N(0, 1), their pairs, and each row's
 * running max set to its scores' max, so that the step's factors are 1 as
 * in most tiles of a long prefill. */
static void bench_init(struct bench *b) {
    b->q = aligned(ROWS * D * 2), b->k = aligned(NK * D * 2), b->v = aligned(NK * D * 2);
    b->qp = aligned(D / 2 * ROWS * 4), b->vp = aligned(NP * D * 4), b->pa = aligned(3 * ROWS * NP * 4);
    b->kb = aligned(NK * D * 2);
    b->st = aligned(NK * ROWS * 4), b->o = aligned(ROWS * D * 4), b->work = aligned((size_t)1 << 20);
    b->m = aligned(ROWS * 4), b->l = aligned(ROWS * 4), b->alpha = aligned(ROWS * 4), b->m0 = aligned(ROWS * 4);
    uint16_t *rows[3] = {b->q, b->k, b->v};
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < (t ? NK : ROWS) * D; i++) rows[t][i] = npattn_f32_to_bf16((float)(1.7 * uniform()));
    for (int p = 0; p < D / 2; p++)
        for (int r = 0; r < ROWS; r++) b->qp[p * ROWS + r] = b->q[r * D + 2 * p] | (uint32_t)b->q[r * D + 2 * p + 1] << 16;
    for (int p = 0; p < NP; p++)
        for (int e = 0; e < D; e++) b->vp[p * D + e] = b->v[2 * p * D + e] | (uint32_t)b->v[(2 * p + 1) * D + e] << 16;
    const struct npattn_score_tile tile = {.nk = NK, .M = ROWS, .ld = ROWS, .scale = 1.0f / sqrtf((float)D)};
    b->tile = tile;
    for (int r = 0; r < ROWS; r++) {
        float mx = -INFINITY;
        for (int j = 0; j < NK; j++) {
            float s = 0;
            for (int d = 0; d < D; d++) s += npattn_bf16_to_f32(b->q[r * D + d]) * npattn_bf16_to_f32(b->k[j * D + d]);
            mx = fmaxf(mx, s * tile.scale);
        }
        b->m0[r] = mx + 0.5f; /* above the tile's: no factor but 1 */
    }
}

static void reset_state(struct bench *b) {
    memcpy(b->m, b->m0, ROWS * 4);
    for (int r = 0; r < ROWS; r++) b->l[r] = 1.0f;
}

/* ---- the stages ---- */

static void stage_scores(struct bench *b) { b->kn->scores_bf16(b->qp, ROWS, ROWS, D / 2, b->k, D, NK, b->st, ROWS); }

static void stage_softmax(struct bench *b) {
    reset_state(b);
    if (b->kn->softmax_tiles_f32(b->st, &b->tile, b->m, b->l, b->alpha, b->pa, NP)) printf("softmax: extreme\n");
}

/* tile_fwd.h's loop over O's rows: a row whose factor is not 1 is rescaled. */
static void stage_rescale(struct bench *b) {
    for (int64_t r = 0; r < ROWS; r++)
        if (b->alpha[r] != 1.0f)
            for (int64_t e = 0; e < D; e++) b->o[r * D + e] *= b->alpha[r];
}

static void stage_pv(struct bench *b) { b->kn->accumulate_tiles_bf16(b->pa, NP, ROWS, NP, b->vp, D, D, b->o); }

static void stage_step(struct bench *b) {
    stage_scores(b);
    stage_softmax(b);
    stage_rescale(b);
    stage_pv(b);
}

/* The table's pipelined step, on K's pairs laid out once as B tiles. */
static void stage_pipelined(struct bench *b) {
    reset_state(b);
    struct npattn_score_tile t = b->tile;
    t.ld = NK;
    if (b->kn->prefill_tiles_bf16(b->q, D, b->kb, b->vp, D, D, &t, b->m, b->l, b->alpha, b->o, b->work))
        printf("pipelined: extreme\n");
}

static void stage_k_tiles(struct bench *b) {
    const uint16_t *rows[NK];
    for (int j = 0; j < NK; j++) rows[j] = b->k + j * D;
    b->kn->k_tiles(rows, NK, D, b->kb);
}

/* The pipelined step against the stages in turn, from the same state: O
 * and m should match bit for bit (the same products in the same order), l
 * within a few roundings (its sums in another order). */
static void check(struct bench *b) {
    float *o = aligned(ROWS * D * 4), *l = aligned(ROWS * 4), *m = aligned(ROWS * 4);
    memset(b->o, 0, ROWS * D * 4);
    stage_step(b);
    memcpy(o, b->o, ROWS * D * 4), memcpy(l, b->l, ROWS * 4), memcpy(m, b->m, ROWS * 4);
    memset(b->o, 0, ROWS * D * 4);
    stage_pipelined(b);
    int64_t o_diff = 0, m_diff = 0;
    double l_rel = 0;
    for (int i = 0; i < ROWS * D; i++) o_diff += memcmp(o + i, b->o + i, 4) != 0;
    for (int r = 0; r < ROWS; r++) {
        m_diff += m[r] != b->m[r];
        l_rel = fmax(l_rel, fabs((double)l[r] - b->l[r]) / l[r]);
    }
    printf("pipelined against the stages: %lld of O's values differ, %lld of m's, l within %.2g\n", (long long)o_diff,
           (long long)m_diff, l_rel);
    free(o), free(l), free(m);
}

struct stage {
    const char *name;
    void (*run)(struct bench *b);
    double flops;  /* per run */
    const char *ceiling; /* "tile", "bf16", "fma", or NULL */
    double *t;     /* per round, seconds */
};

static int by_value(const void *x, const void *y) {
    const double a = *(const double *)x, c = *(const double *)y;
    return (a > c) - (a < c);
}

static double loop_gflops(double (*loop)(int64_t, float *)) {
    if (!loop) return 0;
    float sink = 0;
    double best = 0;
    for (int i = 0; i < 7; i++) {
        const double t0 = now(), f = loop(1 << 16, &sink), t1 = now();
        if (f / (t1 - t0) > best) best = f / (t1 - t0);
    }
    if (sink == 12345.0f) printf(" ");
    return best / 1e9;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 400;
    const char *table = argc > 2 ? argv[2] : "amx";
    if (npattn_kernels_force(table) != 0) {
        printf("this CPU cannot run the %s table\n", table);
        return 0;
    }
    struct bench b = {.kn = npattn_kernels()};
    if (!b.kn->scores_bf16 || !b.kn->softmax_tiles_f32) {
        printf("the %s table has no tiles' prefill\n", table);
        return 0;
    }
    bench_init(&b);
    const double products = 2.0 * ROWS * NK * D; /* one product's flops */
    struct stage stages[MAX_STAGES] = {
        {"scores (scores_bf16)", stage_scores, products, "tile", NULL},
        {"softmax (softmax_tiles_f32)", stage_softmax, 0, NULL, NULL},
        {"O rescaled (factors 1)", stage_rescale, 0, NULL, NULL},
        {"P @ V (accumulate_tiles_bf16)", stage_pv, products, "tile", NULL},
        {"step", stage_step, 2 * products, "tile", NULL},
        {"step again", stage_step, 2 * products, "tile", NULL},
    };
    int n = 6;
    if (b.kn->prefill_tiles_bf16) {
        stage_k_tiles(&b);
        check(&b);
        stages[n++] = (struct stage){"K's pairs as B tiles (k_tiles)", stage_k_tiles, 0, NULL, NULL};
        stages[n++] = (struct stage){"pipelined step (prefill_tiles_bf16)", stage_pipelined, 2 * products, "tile", NULL};
        stages[n++] = (struct stage){"pipelined step again", stage_pipelined, 2 * products, "tile", NULL};
    }
    for (int i = 0; i < n; i++) stages[i].t = calloc((size_t)rounds, sizeof(double));
    for (int i = 0; i < n; i++) stages[i].run(&b); /* warm */
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < n; i++) {
            const double t0 = now();
            stages[i].run(&b);
            stages[i].t[r] = now() - t0;
        }
    const double peaks[3] = {loop_gflops(b.kn->tile_loop), loop_gflops(b.kn->bf16_loop), loop_gflops(b.kn->fma_loop)};
    printf("table %s, %d rounds; one key tile: %d rows, %d keys, D = %d\n", b.kn->name, rounds, ROWS, NK, D);
    printf("ceilings (GFLOP/s, one core): tdpbf16ps %.0f, vdpbf16ps %.0f, FMA %.0f\n", peaks[0], peaks[1], peaks[2]);
    printf("%-36s %9s %9s %9s %9s %7s\n", "stage", "min us", "med us", "p90 us", "GFLOP/s", "% peak");
    for (int i = 0; i < n; i++) {
        qsort(stages[i].t, (size_t)rounds, sizeof(double), by_value);
        const double lo = stages[i].t[0], med = stages[i].t[rounds / 2], p90 = stages[i].t[rounds * 9 / 10];
        printf("%-36s %9.2f %9.2f %9.2f", stages[i].name, 1e6 * lo, 1e6 * med, 1e6 * p90);
        if (stages[i].flops > 0) {
            const double rate = stages[i].flops / med / 1e9;
            const double peak = !strcmp(stages[i].ceiling, "tile") ? peaks[0] : !strcmp(stages[i].ceiling, "bf16") ? peaks[1] : peaks[2];
            printf(" %9.0f %6.1f%%", rate, peak > 0 ? 100 * rate / peak : 0.0);
        }
        printf("\n");
    }
    return 0;
}

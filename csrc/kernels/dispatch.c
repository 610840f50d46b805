/* kernels/dispatch.c: which table of kernels runs, chosen once at run time
 * from what the CPU has. NEON is baseline on aarch64, so there it is the
 * table, with no choice to make. */
#include <stddef.h>
#include <string.h>

#include "kernels.h"

static const struct npattn_kernels *best(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &npattn_kernels_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &npattn_kernels_avx2;
#elif defined(__aarch64__)
    return &npattn_kernels_neon;
#endif
    return &npattn_kernels_portable;
}

/* The tables this CPU can run, best first. */
static const struct npattn_kernels *runnable(int i) {
    const struct npattn_kernels *b = best();
#if defined(__x86_64__) || defined(__i386__)
    const struct npattn_kernels *x86[] = {&npattn_kernels_avx512, &npattn_kernels_avx2, &npattn_kernels_portable};
    int first = b == &npattn_kernels_avx512 ? 0 : b == &npattn_kernels_avx2 ? 1 : 2;
    return first + i < 3 ? x86[first + i] : NULL;
#else
    if (i == 0) return b;
    if (i == 1 && b != &npattn_kernels_portable) return &npattn_kernels_portable;
    return NULL;
#endif
}

static const struct npattn_kernels *_Atomic chosen;

const struct npattn_kernels *npattn_kernels(void) {
    const struct npattn_kernels *k = chosen;
    if (!k) chosen = k = best();
    return k;
}

int npattn_kernels_force(const char *name) {
    if (!name || !*name) {
        chosen = best();
        return 0;
    }
    for (int i = 0; runnable(i); i++)
        if (!strcmp(runnable(i)->name, name)) {
            chosen = runnable(i);
            return 0;
        }
    return -1;
}

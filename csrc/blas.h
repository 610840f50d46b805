/* blas.h: the few OpenBLAS entry points npattn uses, under one set of names.
 *
 * The default build links the scipy-openblas32 wheel's library, whose symbols
 * carry a `scipy_` prefix (its cblas.h declares the prefixed names); the
 * system build (NPATTN_BLAS=system) links Debian's libopenblas, whose names
 * are plain. setup.py defines NPATTN_BLAS_SCIPY for the former. Both are LP64
 * with a 32-bit BLAS `int`, which is why no single call may exceed INT_MAX.
 */
#ifndef NPATTN_BLAS_H
#define NPATTN_BLAS_H

#include <cblas.h>

#ifdef NPATTN_BLAS_SCIPY
#define npattn_cblas_sgemm scipy_cblas_sgemm
#define npattn_cblas_dgemm scipy_cblas_dgemm
#define npattn_blas_set_num_threads scipy_openblas_set_num_threads
#define npattn_blas_get_config scipy_openblas_get_config
#define npattn_blas_get_corename scipy_openblas_get_corename
#else
#define npattn_cblas_sgemm cblas_sgemm
#define npattn_cblas_dgemm cblas_dgemm
#define npattn_blas_set_num_threads openblas_set_num_threads
#define npattn_blas_get_config openblas_get_config
#define npattn_blas_get_corename openblas_get_corename
#endif

/* The tiles' products: through the pool (pool.c), which runs a float one
 * on the kernel table's gemm_f32 where it has one, and else first makes
 * sure that OpenBLAS has room for the work buffer a product needs, failing
 * the run with NPATTN_STATUS_NO_MEMORY (skipping the product) without it. */
struct npattn_run;
void npattn_pool_sgemm(struct npattn_run *run, enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb,
                       int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
void npattn_pool_dgemm(struct npattn_run *run, enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb,
                       int M, int N, int K, double alpha, const double *A, int lda, const double *B, int ldb, double beta, double *C,
                       int ldc);

#endif /* NPATTN_BLAS_H */

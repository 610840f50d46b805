/* reals.h: the task header TASK (a file name, as a string), with tile.h
 * before it, included twice: for REAL = float (SFX f32, GEMM the pool's sgemm, the
 * kernels' float score tiles) and for REAL = double (SFX f64, GEMM its dgemm),
 * the double copy also being the exact path of a float task that met an
 * extreme. A driver defines TASK and includes this once. */
#define REAL float
#define SFX f32
#define IS_F64 0
#define GEMM(...) npattn_pool_sgemm(&pl->run, __VA_ARGS__) /* a tile's products: its plan pl in scope */
#define SCORE_TILE struct npattn_score_tile
#include "tile.h"
#include TASK
#undef REAL
#undef SFX
#undef IS_F64
#undef GEMM
#undef SCORE_TILE
#undef LOAD
#undef STORE
#undef DEQUANT

#define REAL double
#define SFX f64
#define IS_F64 1
#define GEMM(...) npattn_pool_dgemm(&pl->run, __VA_ARGS__)
#define SCORE_TILE struct npattn_score_tile_f64
#include "tile.h"
#include TASK
#undef REAL
#undef SFX
#undef IS_F64
#undef GEMM
#undef SCORE_TILE
#undef LOAD
#undef STORE
#undef DEQUANT
#undef CAT
#undef CAT_
#undef TASK

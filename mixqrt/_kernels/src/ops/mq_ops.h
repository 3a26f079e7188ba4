/* Kernels of mixqrt.ops: products straight from packed weights, activation quantization, the
 * native thread pool and the other ops of a Qwen2 layer. Byte layouts: mq_format.h (prose: mixqrt/formats/layout.py).
 *
 * Integer path (every packed format). A row is nc chunks of 32 weights; chunk c has u8 levels
 * U[i] = L[q_i] + off (off = MQ_FORMATS[fmt].off: 128 for q8, 32 for q6, else 0), a weight scale dw_c and an additive
 * term m_c, so w_i = dw_c * (U[i] - off) + m_c. The activation x is quantized per chunk of 32 to
 * int8 a_i with scale dx_c (x ~ dx_c * a_i); s_c = dx_c * sum(a_i). Then
 *     y = sum_c  (dw_c * dx_c) * isum_c  +  (m_c - off * dw_c) * s_c,   isum_c = sum_i U[i] a_i
 * isum_c is exact in every tier (vpdpbusd / vpmaddubsw / scalar); only the float combination
 * order differs between tiers. */
#ifndef MIXQRT_MQ_OPS_H
#define MIXQRT_MQ_OPS_H
#include <stddef.h>
#include <stdint.h>

#include "mq_kern.h"    /* mq_act, mq_mm_job, scratch buffers (shared by every tier) */
#include "misc.h"        /* the float ops of a layer */
#include "bw.h"          /* the bandwidth probe */

/* ---------------------------------------------------------------- products (dispatch.c)
 * Each call runs the tier mq_isa_get() names (kern_generic.c, kern_avx2.c, kern_*_avx512.c); all tiers
 * give the same integer sums, only the float combination order differs (see above). */
void mq_quantize_act_rows(const float *x, size_t ldx, mq_act *a, int t0, int t1);
void mq_mm_rows(const mq_mm_job *j, int n0, int n1);
/* The AVX-512 GEMM's activation layout for token groups of gt: bytes, and groups [g0, g1) of it
 * (the same bytes gemm_fmt builds for itself); 0 bytes where the tier has no GEMM. */
int mq_gemm_shared_gt(const mq_mm_job *j);    /* the GEMM's group size for job j if shared, else 0 */
size_t mq_gemm_act_bytes(const mq_act *a, int gt);
void mq_gemm_interleave(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out);

/* Cached GEMM tiles (AVX-512 tier; the other tiers ignore j->tiles): the VNNI-interleaved levels and
 * scale vectors that the GEMM would otherwise unpack on every call, stored once per tensor, so a
 * batched decode step reads them instead of unpacking (docs/kernels.md, "GEMM tile cache").
 * Layout: one block of mq_gemm_tile_stride(nc) bytes per 16 rows; in it, per chunk c < nc2 (nc rounded
 * up to even), 640 bytes: levels u32[8 k4 steps][16 rows], dw f32[16], mm f32[16]. 64-byte aligned.
 * mq_gemm_tiles_build fills the blocks of rows [n0, n1) (n0 a multiple of 16); returns 0, or -1
 * where this CPU has no AVX-512 tier (nothing written). */
int mq_gemm_tiles_build(const mq_mm_job *j, uint8_t *out, int n0, int n1);

/* Tuning switches of the AVX-512 tier (no-ops returning 0 elsewhere). mixqrt.platform.tuning sets them once at
 * import from the MIXQRT_* environment; the kernels never read the environment themselves. The int
 * setters take on < 0 as a query and return the previous state. */
void mq_set_gemm_min_t(int t);  /* row formats: the AVX-512 GEMM for T >= t (t <= 0: never); default 18 */
int mq_set_lean_mv(int on);    /* lean decode path for q3p/q4/q3u/q6 (default on) */
int mq_set_few_max_t(int t);   /* q4x/q6x/q3x products of 9..t rows by the few-row kernels over L2 row blocks
                                  (default 64; 0: the GEMM); t < 0 queries */
int mq_set_mv_xpf(int on);    /* q4x / q6x decode software prefetch into L2 (default on) */
int mq_set_q2c_mv(int on);    /* q2c decode by mv_q2c (default on) */
int mq_set_q6_fold(int on);    /* q6 short-row decode by mv_q6f (default on) */
int mq_set_float_mv(int on);   /* 4-row prefetched float decode (default off) */
void mq_set_float_pf(size_t nbytes);   /* that path's in-row prefetch distance (default 2048; 0: none) */

/* ---------------------------------------------------------------- thread pool (pool.c) */
typedef void (*mq_task_fn)(void *arg, int64_t i0, int64_t i1);
/* Start (or restart with) n threads including the caller; cpus: affinity list for pinning
 * (ncpus entries, may be 0 to skip pinning). Returns the thread count. */
int mq_pool_start(int n, const int *cpus, int ncpus);
int mq_pool_size(void);
void mq_pool_set_spin_us(long us);   /* idle workers spin this long before sleeping (default 100), from the next start */
void mq_pool_stop(void);
/* Split [0, n) in ranges aligned to `align` over the pool; the caller runs part 0. Blocks until
 * all parts are done. GIL must be released by the caller. */
void mq_pool_run(mq_task_fn fn, void *arg, int64_t n, int64_t align);
/* Same with at most `nthreads` parts (<= 0: the whole pool; 1: inline on the caller, pool untouched).
 * If another thread is using the pool the job runs inline on the calling thread. */
void mq_pool_run_n(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads);
/* as mq_pool_run_n, the range cut in chunks of `chunk` units (of align) that the threads take in turn;
 * chunk <= 0 (or >= the units): one static part per thread */
void mq_pool_run_chunked(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads, int64_t chunk);
/* Gap prefetch: the workers (not the caller) read bytes [p, p + n) in the background, the starts of
 * its `parts` equal slices first (the row split of the product that will read it); the next job,
 * mq_pool_prefetch_wait or stop aborts it and waits. A no-op with one thread or a busy pool. The
 * caller keeps the memory mapped until then. */
void mq_pool_prefetch(const uint8_t *p, size_t n, int parts);
void mq_pool_prefetch_wait(void);
/* hot != 0: idle workers (and a waiting caller) spin without sleeping until set back to 0 */
void mq_pool_set_hot(int hot);
int mq_pool_get_hot(void);

#endif

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

#include "mq_format.h"   /* format ids, block layouts, fp16, the dequantizer */

/* Quantized activations of T rows. Row t: q + t*kp (int8, kp a multiple of 128, zero padded),
 * d + t*ncp and s + t*ncp (ncp = kp / 32). */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int T, K, kp, ncp;
    /* the AVX-512 GEMM's interleaved copy of these activations for token groups of il_gt, made once
     * per product on the pool (mq_gemm_interleave); NULL: each GEMM call interleaves its own */
    const uint8_t *il;
    int il_gt;
} mq_act;

/* One product y[t, n] = sum_k W[n, k] x[t, k] over rows [n0, n1) of W. */
typedef struct {
    int fmt;
    const uint8_t *w;       /* packed bytes (or plain f32/f16/bf16 values) */
    size_t row_bytes;
    int N, K, nc;           /* nc: chunks per row including block padding */
    const mq_act *a;        /* packed formats */
    const float *x;         /* float formats: [T, K] row-major, row stride ldx */
    int T;
    size_t ldx;
    float *y;               /* [T, N] row stride ldy */
    size_t ldy;
    const uint8_t *q3p_levels; /* 8 bytes */
    float q5_lo, q5_step;      /* q5g trailer, decoded */
    const uint8_t *tiles;      /* NULL, or the tensor's cached GEMM tiles (mq_gemm_tiles_build; AVX-512 only) */
} mq_mm_job;

/* tiers: all have identical semantics */
void mq_quantize_act_rows(const float *x, size_t ldx, mq_act *a, int t0, int t1);
void mq_quantize_act_generic(const float *x, int K, int kp, int8_t *q, float *d, float *s);
void mq_quantize_act_avx2(const float *x, int K, int kp, int8_t *q, float *d, float *s);
void mq_quantize_act_avx512(const float *x, int K, int kp, int8_t *q, float *d, float *s);

void mq_mm_rows(const mq_mm_job *j, int n0, int n1);            /* dispatch by mq_isa_get() */
/* The AVX-512 GEMM's activation layout for token groups of gt: bytes, and groups [g0, g1) of it
 * (the same bytes gemm_fmt builds for itself); 0 bytes where the tier has no GEMM. */
int mq_gemm_shared_gt(const mq_mm_job *j);    /* the GEMM's group size for job j if shared, else 0 */
size_t mq_gemm_act_bytes(const mq_act *a, int gt);
void mq_gemm_interleave(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out);
void mq_mm_rows_generic(const mq_mm_job *j, int n0, int n1);
void mq_mm_rows_avx2(const mq_mm_job *j, int n0, int n1);
void mq_mm_rows_avx512(const mq_mm_job *j, int n0, int n1);
/* AVX-512 prefill GEMM path for T >= t (t <= 0: never); default 8 */
void mq_set_gemm_min_t(int t);
int mq_set_few_t(int on);      /* AVX-512 q4x/q6x/q3x products of 2-4 rows by the decode unpack (default on); on < 0 queries */
int mq_set_lean_mv(int on);    /* AVX-512 lean decode path for q3p/q3u/q6 (default on); on < 0 queries; returns the old state */
int mq_set_q6_fold(int on);    /* AVX-512 q6 short-row decode by mv_q6f (default off); on < 0 queries; returns the old state */
int mq_set_float_mv(int on);   /* AVX-512 4-row prefetched float decode (default on); on < 0 queries; returns the old state */

/* Cached GEMM tiles (AVX-512 tier; the other tiers ignore j->tiles): the VNNI-interleaved levels and
 * scale vectors that the GEMM would otherwise unpack on every call, stored once per tensor, so a
 * batched decode step reads them instead of unpacking (docs/kernels.md, "GEMM tile cache").
 * Layout: one block of mq_gemm_tile_stride(nc) bytes per 16 rows; in it, per chunk c < nc2 (nc rounded
 * up to even), 640 bytes: levels u32[8 k4 steps][16 rows], dw f32[16], mm f32[16]. 64-byte aligned.
 * mq_gemm_tiles_build fills the blocks of rows [n0, n1) (n0 a multiple of 16); returns 0, or -1
 * where this CPU has no AVX-512 tier (nothing written). */
size_t mq_gemm_tile_stride(int nc);
/* q3x decode's software prefetch distance into L2, bytes (MIXQRT_Q3X_PF, default 16384; 0: none),
 * shared by the AVX-512 and AVX2 mv_q3x */
size_t mq_q3x_prefetch(void);
int mq_gemm_tiles_build(const mq_mm_job *j, uint8_t *out, int n0, int n1);
int mq_gemm_tiles_build_avx512(const mq_mm_job *j, uint8_t *out, int n0, int n1);

/* Unpack one packed row to u8 levels lv[nc*32], dw[nc], mm[nc] (mm = m - off*dw). Portable. */
void mq_unpack_row_generic(const mq_mm_job *j, const uint8_t *row, uint8_t *lv, float *dw, float *mm);
/* per-thread scratch, 64 B aligned, grows, never freed (generic.c) */
void *mq_scratch(size_t n);
void *mq_call_buf(size_t n);          /* ops.matmul's per-thread activation buffer (generic.c) */
void mq_call_buf_release(void *p);

/* ---------------------------------------------------------------- thread pool (pool.c) */
typedef void (*mq_task_fn)(void *arg, int64_t i0, int64_t i1);
/* Start (or restart with) n threads including the caller; cpus: affinity list for pinning
 * (ncpus entries, may be 0 to skip pinning). Returns the thread count. */
int mq_pool_start(int n, const int *cpus, int ncpus);
int mq_pool_size(void);
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

/* ---------------------------------------------------------------- bandwidth probe (bw.c) */
/* best of every pattern this CPU runs, bytes/s (-1 on failure) */
double mq_read_bandwidth(size_t nbytes, int threads, int reps);
int mq_bw_set_cpus(const int *cpus, int n);   /* pinning order of the probe's threads; 0: affinity order */
int mq_bw_npatterns(void);
const char *mq_bw_pattern_name(int i);
int mq_bw_pattern_available(int i);            /* 0 where the CPU/OS lacks the ISA */
double mq_read_bandwidth_pattern(size_t nbytes, int threads, int reps, int pattern);  /* -1: unavailable */
/* every pattern on one buffer: out[mq_bw_npatterns()] bytes/s (-1: unavailable); returns the best */
double mq_read_bandwidth_all(size_t nbytes, int threads, int reps, double *out);
/* one sweep over n bytes (n a multiple of 256, 64 B aligned); returns a checksum (bw_avx2.c, bw_avx512.c) */
uint64_t mq_bw_sweep_avx2(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_1s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_1s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_2s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_2s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_8s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s_nt(const uint8_t *b, size_t n);

/* ---------------------------------------------------------------- other ops (misc.c) */
void mq_rmsnorm(const float *x, const float *w, float *y, int T, int D, float eps);
void mq_rope(float *x, const int64_t *pos, int T, int H, int Dh, double theta);
void mq_silu_mul(const float *g, const float *u, float *y, size_t n);
/* y = H_b (s * x) per block of b (a power of two dividing K), H_b scaled by `scale`; s may be NULL */
void mq_hadamard(const float *x, float *y, const float *s, int T, int K, int b, float scale);
void mq_softmax_rows(float *x, int rows, int n, int fast);
/* causal softmax of score rows [r0, r1) of [rows, n]; row r is query r % T at position pos0 + r % T */
void mq_softmax_causal(float *x, int n, int T, int pos0, int r0, int r1);
float mq_expf_fast(float x);   /* valid on [-87, 88]; see misc.c */
/* scratch: MQ_ATT_SCRATCH(S, Dh, T) floats (score rows for MQ_ATT_GB heads of one KV group at up to
 * MQ_ATT_TP query positions at once; a group of more heads runs in passes of MQ_ATT_GB) */
void mq_attention(const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                  int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch);
#define MQ_ATT_GB 8
#define MQ_ATT_TP 8
#define MQ_ATT_SCRATCH(S, Dh, T) ((size_t)((T) < 1 ? 1 : (T) < MQ_ATT_TP ? (T) : MQ_ATT_TP) * MQ_ATT_GB * ((size_t)(S) + 16) \
                                  + 2 * (size_t)(Dh) + 16)
#endif

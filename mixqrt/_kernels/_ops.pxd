# Declarations of src/ops/mq_ops.h.
from libc.stdint cimport int8_t, uint8_t, uint16_t, int64_t

cdef extern from "mq_format.h" nogil:
    uint16_t mq_f32_to_f16(float f)
    void mq_dequant_row(int fmt, const uint8_t *row, int64_t k, float *out, const uint8_t *levels,
                        float q5_lo, float q5_step)
    void mq_dequant_row_at(int fmt, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, float *out,
                           const uint8_t *levels, float q5_lo, float q5_step)

cdef extern from "mq_ops.h" nogil:
    ctypedef struct mq_act:
        int8_t *q
        float *d
        float *s
        int T, K, kp, ncp
        const uint8_t *il
        int il_gt
    ctypedef struct mq_mm_job:
        int fmt
        const uint8_t *w
        size_t row_bytes
        int N, K, nc
        const mq_act *a
        const float *x
        int T
        size_t ldx
        float *y
        size_t ldy
        const uint8_t *q3p_levels
        float q5_lo, q5_step
        const uint8_t *tiles
    ctypedef void (*mq_task_fn)(void *arg, int64_t i0, int64_t i1) noexcept nogil
    void mq_quantize_act_rows(const float *x, size_t ldx, mq_act *a, int t0, int t1)
    void mq_mm_rows(const mq_mm_job *j, int n0, int n1)
    int mq_gemm_shared_gt(const mq_mm_job *j)
    size_t mq_gemm_act_bytes(const mq_act *a, int gt)
    void mq_gemm_interleave(const mq_act *a, int fmt, int gt, int g0, int g1, uint8_t *out)
    void mq_set_gemm_min_t(int t)
    size_t mq_gemm_tile_stride(int nc)
    int mq_gemm_tiles_build(const mq_mm_job *j, uint8_t *out, int n0, int n1)
    int mq_set_lean_mv(int on)
    int mq_set_float_mv(int on)
    int mq_set_q6_fold(int on)
    int mq_set_q2c_mv(int on)
    int mq_set_few_max_t(int t)
    int mq_set_mv_xpf(int on)
    void mq_set_float_pf(size_t nbytes)
    void mq_set_q3x_prefetch(size_t nbytes)
    size_t mq_q3x_prefetch()
    void mq_pool_set_spin_us(long us)
    int mq_pool_start(int n, const int *cpus, int ncpus)
    int mq_pool_size()
    void mq_pool_stop()
    void mq_pool_run(mq_task_fn fn, void *arg, int64_t n, int64_t align)
    void mq_pool_run_n(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads)
    void mq_pool_run_chunked(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads, int64_t chunk)
    void mq_pool_set_hot(int hot)
    void mq_pool_prefetch(const uint8_t *p, size_t n, int parts)
    void mq_pool_prefetch_wait()
    int mq_pool_get_hot()
    void *mq_scratch(size_t n)
    void *mq_call_buf(size_t n)
    void mq_call_buf_release(void *p)
    double mq_read_bandwidth(size_t nbytes, int threads, int reps)
    int mq_bw_set_cpus(const int *cpus, int n)
    int mq_bw_npatterns()
    const char *mq_bw_pattern_name(int i)
    int mq_bw_pattern_available(int i)
    double mq_read_bandwidth_pattern(size_t nbytes, int threads, int reps, int pattern)
    double mq_read_bandwidth_all(size_t nbytes, int threads, int reps, double *out)
    void mq_rmsnorm(const float *x, const float *w, float *y, int T, int D, float eps)
    void mq_rope(float *x, const int64_t *pos, int T, int H, int Dh, double theta)
    void mq_silu_mul(const float *g, const float *u, float *y, size_t n)
    void mq_dot_rows(const float *w, const float *x, float *y, int N, int K, int T)
    void mq_hadamard(const float *x, float *y, const float *s, int T, int K, int b, float scale)
    void mq_softmax_rows(float *x, int rows, int n, int fast)
    void mq_softmax_causal(float *x, int n, int T, int pos0, int r0, int r1)
    float mq_expf_fast(float x)
    void mq_attention(const float *q, const void *k, const void *v, int kv_f16, float *out, int T,
                      int Hq, int Hkv, int Dh, int S, int pos0, int h0, int h1, float *scratch)
    size_t MQ_ATT_SCRATCH(int S, int Dh, int T)
    ctypedef struct mq_kvatt:
        const float *q
        float *out
        const uint16_t *kf
        const uint16_t *vf
        const uint8_t *pk
        int T, Hq, Hkv, Dh, S, pos0, bits, window, block_bytes
    void mq_kvattn(const mq_kvatt *a, int kh, int r0, int r1, float *scratch)
    void mq_kv_fwht(float *x, int n)
    void mq_kv_pack(const uint16_t *kf, const uint16_t *vf, int S, int Dh, int Hkv, int b0, int b1, int bits,
                    uint8_t *pk, int NB)
    size_t MQ_KV_SCRATCH_FLOATS(int Dh)
    int MQ_KV_BLOCK_BYTES(int Dh, int bits)
    int MQ_KV_TR

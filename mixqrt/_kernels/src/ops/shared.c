/* Helpers every product tier and the dispatcher share (mq_kern.h): per-thread scratch buffers, the
 * cached GEMM tiles' stride, and the tuning values more than one tier reads. Nothing tier-specific. */
#include <stdlib.h>

#include "mq_kern.h"

static __thread uint8_t *tl_buf = NULL;
static __thread size_t tl_cap = 0;

/* a per-thread buffer of at least n bytes, 64 B aligned: grown (contents not kept), never shrunk */
void *mq_tl_grow(uint8_t **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        free(*buf);
        size_t c = (n + 4095) & ~(size_t)4095;
        if (posix_memalign((void **)buf, 64, c)) { *buf = NULL; *cap = 0; return NULL; }
        *cap = c;
    }
    return *buf;
}

void *mq_scratch(size_t n) {      /* per-thread scratch of the kernels, never freed */
    return mq_tl_grow(&tl_buf, &tl_cap, n);
}

/* ops.matmul's activation buffer (quantized rows, and the GEMM's interleaved copy of them): a second
 * per-thread buffer, since the kernels take mq_scratch inside the same call. Kept between calls up to
 * MQ_CALL_BUF_KEEP bytes (a 512-token prefill chunk of K = 4864 needs ~3.1 MB, ~6.5 MB with the
 * shared interleaved copy); a malloc per call made glibc give the pages back and fault them in
 * again, 54k page faults per rotated 128-token prefill. Larger requests get their own block, which
 * mq_call_buf_release frees. */
#define MQ_CALL_BUF_KEEP ((size_t)64 << 20)
static __thread uint8_t *tl_call = NULL;
static __thread size_t tl_call_cap = 0;

void *mq_call_buf(size_t n) {
    if (n > MQ_CALL_BUF_KEEP) {
        void *p = NULL;
        return posix_memalign(&p, 64, n) ? NULL : p;
    }
    return mq_tl_grow(&tl_call, &tl_call_cap, n);
}

void mq_call_buf_release(void *p) {
    if (p != NULL && p != (void *)tl_call) free(p);
}

size_t mq_gemm_tile_stride(int nc) {
    size_t nc2 = ((size_t)nc + 1) & ~(size_t)1;
    return nc2 * (8 * 16 * 4 + 2 * 16 * 4);
}

/* set once at import (mixqrt.platform.tuning, MIXQRT_Q3X_PF), before any product runs */
static size_t q3x_pf = 16384;
size_t mq_q3x_prefetch(void) { return q3x_pf; }
void mq_set_q3x_prefetch(size_t nbytes) { q3x_pf = nbytes; }

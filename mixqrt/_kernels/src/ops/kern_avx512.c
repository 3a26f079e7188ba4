/* AVX-512 tier (F/BW/VL/DQ + VNNI + VBMI): every packed format is unpacked two chunks (64 codes)
 * at a time into one zmm of u8 levels with a broadcast, a per-qword shift and a mask (+ vpshufb for
 * table levels), then multiplied with the int8 activations by vpdpbusd. Decode (T == 1) runs fused
 * from the packed bytes. On the row formats 1 < T < mq_gemm_min_t (default MQ_EXACT_T + 1 = 18) runs
 * rows_exact (every row bit for bit the T = 1 row), T >= mq_gemm_min_t the VNNI-interleaved
 * GEMM (gemm_fmt, see docs/kernels.md) in token groups of 2, 4 or 8; on q4x / q6x / q3x 2 <= T <= 8
 * runs the few-row kernels, more rows the GEMM, and every row of either is the T = 1 row.
 * The tier's files: kern_avx512_impl.h lists them. This one holds the tier's traits table (each format's
 * kernels, MQ_AVX512_TRAITS) and routes a product to the kernel of its format and shape. */
#include "kern_avx512_impl.h"

/* ------------------------------------------------------------------ tuning switches (mq_ops.h: mq_set_*) */
static int mq_lean_mv = 1;   /* the lean decode kernels (MIXQRT_LEAN_MV=0: off, every format its plain mv) */
static int mq_q6_fold = 1;   /* q6 short rows through mv_q6f (MIXQRT_Q6_FOLD=0: off) */
static int mq_q2c_mv = 1;    /* q2c through mv_q2c (MIXQRT_Q2C_MV=0: the unpack path) */
/* the row formats' GEMM for T >= this (<= 0: never); below it rows_exact (each row the T = 1 row).
 * q4x / q6x / q3x run the GEMM above MQ_FEW_T rows whatever it is (their GEMM rows are the T = 1 rows). */
static int mq_gemm_min_t = MQ_EXACT_T + 1;

int mq_avx512_set_lean_mv(int on) { int old = mq_lean_mv; if (on >= 0) mq_lean_mv = on != 0; return old; }
int mq_avx512_set_q6_fold(int on) { int old = mq_q6_fold; if (on >= 0) mq_q6_fold = on != 0; return old; }
int mq_avx512_set_q2c_mv(int on) { int old = mq_q2c_mv; if (on >= 0) mq_q2c_mv = on != 0; return old; }
void mq_avx512_set_gemm_min_t(int t) { mq_gemm_min_t = t; }
static int gemm_on(int T) { return mq_gemm_min_t > 0 && T >= mq_gemm_min_t; }

/* ------------------------------------------------------------------ the traits table */
#define ROW(name, F) [F] = {.mv = mq_avx512_mv_##name, .mm = mq_avx512_mm_##name, \
    .gemm = {mq_avx512_gemm2_##name, mq_avx512_gemm4_##name, mq_avx512_gemm8_##name}, .tiles = mq_avx512_tiles_##name},
#define XFMT(name, F) [F] = {.mv = mq_avx512_mv_##name, .few = mq_avx512_few_##name, \
    .gemm = {mq_avx512_gemm2_##name, mq_avx512_gemm4_##name, mq_avx512_gemm8_##name}, \
    .tiles = mq_avx512_tiles_##name, .groups = 1},
static const mq_avx512_traits MQ_AVX512_TRAITS[MQ_NFMT] = {
    MQ_FOR_ROW_FORMATS(ROW)
    MQ_FOR_X_FORMATS(XFMT)
    /* f32 / f16 / bf16: mq_avx512_float */
};
#undef ROW
#undef XFMT

/* the lean decode kernels a format may take instead of its plain one (T == 1 with MIXQRT_LEAN_MV),
 * the first that fits (kern NULL: none) */
static const mq_avx512_lean LEAN_KERNELS[MQ_NFMT][2] = {
    [MQ_Q6] = {{mq_avx512_lean_q6f, 2, LEAN_SHORT, &mq_q6_fold}, {mq_avx512_lean_q6, 2, LEAN_LONG, NULL}},
    [MQ_Q4] = {{mq_avx512_lean_q4c, 2, LEAN_ANY, NULL}},
    [MQ_Q3U] = {{mq_avx512_lean_q3u, 1, LEAN_ANY, NULL}},
    [MQ_Q3P] = {{mq_avx512_lean_q3c, 1, LEAN_ANY, NULL}},
    [MQ_Q2C] = {{mq_avx512_lean_q2c, 4, LEAN_ANY, &mq_q2c_mv}},
};

/* the T = 1 kernel of a packed product (the decode and rows_exact agree on it) */
static mq_avx512_kern mv_kernel(const mq_mm_job *j) {
    if (mq_lean_mv) {
        const int shortr = (size_t)NRL * j->row_bytes <= LEAN_SHORT_TILE;
        for (int i = 0; i < 2 && LEAN_KERNELS[j->fmt][i].kern != NULL; i++) {
            const mq_avx512_lean *l = &LEAN_KERNELS[j->fmt][i];
            if (j->nc % l->nc_mult == 0 && (l->rows == LEAN_ANY || (l->rows == LEAN_SHORT) == shortr)
                && (l->on == NULL || *l->on))
                return l->kern;
        }
    }
    return MQ_AVX512_TRAITS[j->fmt].mv;
}

/* ------------------------------------------------------------------ row formats, 2 <= T <= MQ_EXACT_T
 * Every row bit for bit the T = 1 row: where T = 1 runs the plain mv, the unpacked 4-row tiles of mm
 * (mv's fold, the unpack once for all tokens); where it runs one of the lean kernels (each with its own
 * fold: lanes across rows, tile and tail rows summed differently), that kernel itself, token by token,
 * over blocks of rows that stay in L2 for the next token. Block edges are multiples of 16 rows from n0
 * and the last one ends at n1, so each row falls in the same 4-row tile (or tail) as in the T = 1
 * product (whose parts start at multiples of 16 rows too). */
#ifndef EXACT_BLOCK_BYTES
#define EXACT_BLOCK_BYTES (128 << 10)
#endif
static void rows_exact(const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const mq_avx512_kern mv = mv_kernel(j);
    if (mv == MQ_AVX512_TRAITS[j->fmt].mv) { MQ_AVX512_TRAITS[j->fmt].mm(cx, j, n0, n1); return; }
    const mq_act *a = j->a;
    size_t rows = EXACT_BLOCK_BYTES / j->row_bytes / 16 * 16;
    if (rows < 16) rows = 16;
    mq_act at = *a;
    at.T = 1; at.il = NULL; at.il_gt = 0;
    mq_mm_job jt = *j;
    jt.T = 1; jt.a = &at; jt.tiles = NULL;
    for (int b0 = n0; b0 < n1; b0 += (int)rows) {
        const int b1 = (size_t)(n1 - b0) <= rows ? n1 : b0 + (int)rows;
        for (int t = 0; t < j->T; t++) {
            at.q = a->q + (size_t)t * a->kp; at.d = a->d + (size_t)t * a->ncp; at.s = a->s + (size_t)t * a->ncp;
            jt.y = j->y + (size_t)t * j->ldy;
            mv(cx, &jt, b0, b1);
        }
    }
}

/* ------------------------------------------------------------------ MQ_FEW_T < T <= mq_few_max_t tokens on the
 * interleaved formats (a speculative verify of up to 64 drafts): the few-token kernels over blocks of rows that
 * stay in L2, the tokens in groups of 2..8 (as even as they split), each group reading the block the first one
 * brought in. The weights come from memory once, as in a decode step, and each row is bit for bit the T = 1 row
 * (the few-token kernels' fold). The VNNI GEMM unpacks every tile for its token groups: from 9 to 64 tokens that
 * unpack was most of its cost (docs/speculative.md, "Verify cost"). Block edges are multiples of MQ_XROWS rows
 * from n0, so every group of rows is whole. */
#ifndef FEW_BLOCK_BYTES
#define FEW_BLOCK_BYTES (192 << 10)
#endif
static int mq_few_max_t = 64;   /* 0 (or <= MQ_FEW_T): T > MQ_FEW_T through the GEMM (MIXQRT_FEW_MAX_T) */
int mq_avx512_set_few_max_t(int t) { int old = mq_few_max_t; if (t >= 0) mq_few_max_t = t; return old; }

static void few_blocked(mq_avx512_kern few, const ctx_t *cx, const mq_mm_job *j, int n0, int n1) {
    const mq_act *a = j->a;
    int rows = (int)(FEW_BLOCK_BYTES / j->row_bytes) / MQ_XROWS * MQ_XROWS;
    if (rows < MQ_XROWS) rows = MQ_XROWS;
    const int ng = (j->T + MQ_FEW_T - 1) / MQ_FEW_T;
    mq_act at = *a;
    at.il = NULL; at.il_gt = 0;
    mq_mm_job jt = *j;
    jt.a = &at; jt.tiles = NULL;
    for (int b0 = n0; b0 < n1; b0 += rows) {
        const int b1 = n1 - b0 <= rows ? n1 : b0 + rows;
        for (int g = 0, t0 = 0; g < ng; g++) {
            const int nt = j->T / ng + (g < j->T % ng);     /* 2..8 tokens: T > 8 gives ng >= 2 */
            at.T = jt.T = nt;
            at.q = a->q + (size_t)t0 * a->kp;
            at.d = a->d + (size_t)t0 * a->ncp;
            at.s = a->s + (size_t)t0 * a->ncp;
            jt.y = j->y + (size_t)t0 * j->ldy;
            few(cx, &jt, b0, b1);
            t0 += nt;
        }
    }
}

/* ------------------------------------------------------------------ the tier's entries (kern_avx512.h) */
void mq_mm_rows_avx512(const mq_mm_job *j, int n0, int n1) {
    if (j->fmt >= MQ_F32) { mq_avx512_float(j, n0, n1); return; }
    const mq_avx512_traits *t = &MQ_AVX512_TRAITS[j->fmt];
    ctx_t cx;
    ctx_init(&cx, j);
    if (j->T == 1) mv_kernel(j)(&cx, j, n0, n1);
    else if (t->few != NULL && j->T <= MQ_FEW_T) t->few(&cx, j, n0, n1);   /* (the GEMM lost there: 1.2-1.6x) */
    else if (t->few != NULL && j->T <= mq_few_max_t) few_blocked(t->few, &cx, j, n0, n1);   /* (and 1.3-1.9x here) */
    else if (t->mm != NULL && !gemm_on(j->T)) rows_exact(&cx, j, n0, n1);
    else t->gemm[j->T <= 2 ? 0 : j->T <= 4 ? 1 : 2](&cx, j, n0, n1);
}

/* The token group size of the GEMM the routing above gives a whole product j when it is GTT, else 0:
 * then _mm_run interleaves the activations once for every thread (mq_gemm_interleave on the pool)
 * instead of once per thread and call. */
int mq_gemm_shared_gt_avx512(const mq_mm_job *j) {
    if (j->fmt >= MQ_F32 || j->T <= 4) return 0;
    if (MQ_AVX512_TRAITS[j->fmt].groups)
        return j->N % MQ_XROWS == 0 && j->T > MQ_FEW_T && j->T > mq_few_max_t ? GTT : 0;
    return gemm_on(j->T) ? GTT : 0;   /* below: rows_exact */
}

int mq_gemm_tiles_build_avx512(const mq_mm_job *j, uint8_t *out, int n0, int n1) {
    if (j->fmt < 0 || j->fmt >= MQ_F32 || n0 % 16 || ((uintptr_t)out & 63)) return -1;
    const mq_avx512_traits *t = &MQ_AVX512_TRAITS[j->fmt];
    if (t->tiles == NULL || (t->groups && n1 % MQ_XROWS)) return -1;
    ctx_t cx;
    ctx_init(&cx, j);
    t->tiles(&cx, j, out, n0, n1);
    return 0;
}

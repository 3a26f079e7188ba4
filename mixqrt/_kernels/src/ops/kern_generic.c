/* Portable C tier: activation quantization, unpack and the integer-dot product.
 * The numpy emulation in tests/test_ops_matmul.py follows this file line by line. */
#include <math.h>
#include <string.h>

#include "mq_kern.h"
#include "kern_generic.h"


/* ------------------------------------------------------------------ activations */
void mq_quantize_act_generic(const float *x, int K, int kp, int8_t *q, float *d, float *s) {
    for (int c = 0; c < kp / 32; c++) {
        int k0 = c * 32, n = K - k0;
        if (n > 32) n = 32;
        if (n <= 0) {
            memset(q + k0, 0, 32); d[c] = 0.0f; s[c] = 0.0f;
            continue;
        }
        float amax = 0.0f;
        for (int i = 0; i < n; i++) { float a = fabsf(x[k0 + i]); if (a > amax) amax = a; }
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = i < n ? (int)nearbyintf(x[k0 + i] * id) : 0;
            q[k0 + i] = (int8_t)v; sum += v;
        }
        d[c] = dd; s[c] = dd * (float)sum;
    }
}

/* ------------------------------------------------------------------ unpack
 * Every row format by its row of MQ_FORMATS (mq_format.h): its packing, header and how its codes
 * become levels (mq_fmt_spec.levels); no per-format code in this tier. q4x / q6x / q3x reach it as
 * q4 / q6 / q3p rows (dispatch.c). */
void mq_unpack_row_generic(const mq_mm_job *j, const uint8_t *row, uint8_t *lv, float *dw, float *mm) {
    const mq_fmt_spec *f = &MQ_FORMATS[j->fmt];
    const int cpb = f->group / MQ_CHUNK, nb = j->nc / cpb, cb = MQ_CHUNK_BYTES(f->bits);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * f->block_bytes;
        float d, m = 0.0f;
        if (f->trailer > 0) { d = j->q5_step; m = j->q5_lo; }   /* q5g: the tensor's trailer */
        else {
            d = mq_f16_to_f32(mq_get16(blk + MQ_HDR_D));
            if (f->header > MQ_HDR_M) m = mq_f16_to_f32(mq_get16(blk + MQ_HDR_M));
        }
        for (int c = 0; c < cpb; c++) {
            int ci = b * cpb + c;
            uint8_t *o = lv + (size_t)ci * MQ_CHUNK;
            mq_unpack_chunk(blk + f->header + c * cb, f->pack, o);
            if (f->levels == MQ_LV_SIGNED) for (int i = 0; i < 32; i++) o[i] ^= 0x80;
            else if (f->levels == MQ_LV_TABLE) for (int i = 0; i < 32; i++) o[i] = j->q3p_levels[o[i]];
            else if (f->levels == MQ_LV_BLOCK_LUT) for (int i = 0; i < 32; i++) o[i] = blk[MQ_HDR_LUT + o[i]];
            dw[ci] = d;
            /* signed (q8): the product subtracts off * sum(q) in integers (exact signed sums), as every tier does */
            mm[ci] = f->levels == MQ_LV_SIGNED ? m : m - (float)f->off * d;
        }
    }
}

/* ------------------------------------------------------------------ products */
static float dot_f32(const float *w, const float *x, int K) {
    float a[8] = {0};
    int k = 0;
    for (; k + 8 <= K; k += 8) for (int i = 0; i < 8; i++) a[i] += w[k + i] * x[k + i];
    for (; k < K; k++) a[k & 7] += w[k] * x[k];
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

void mq_mm_rows_generic(const mq_mm_job *j, int n0, int n1) {
    if (j->fmt >= MQ_F32) {
        float *wf = (float *)mq_scratch((size_t)j->K * 4);
        for (int n = n0; n < n1; n++) {
            const float *wr;
            if (j->fmt == MQ_F32) wr = (const float *)(j->w + (size_t)n * j->row_bytes);
            else { mq_dequant_row(j->fmt, j->w + (size_t)n * j->row_bytes, j->K, wf, NULL, 0.0f, 0.0f); wr = wf; }
            for (int t = 0; t < j->T; t++) j->y[(size_t)t * j->ldy + n] = dot_f32(wr, j->x + (size_t)t * j->ldx, j->K);
        }
        return;
    }
    int nc = j->nc;
    uint8_t *lv = (uint8_t *)mq_scratch((size_t)nc * 40);
    float *dw = (float *)(lv + (size_t)nc * 32), *mm = dw + nc;
    const mq_act *a = j->a;
    const int signed_off = MQ_FORMATS[j->fmt].levels == MQ_LV_SIGNED, off = MQ_FORMATS[j->fmt].off;
    for (int n = n0; n < n1; n++) {
        mq_unpack_row_generic(j, j->w + (size_t)n * j->row_bytes, lv, dw, mm);
        for (int t = 0; t < j->T; t++) {
            const int8_t *q = a->q + (size_t)t * a->kp;
            const float *xd = a->d + (size_t)t * a->ncp, *xs = a->s + (size_t)t * a->ncp;
            float acc = 0.0f;
            for (int c = 0; c < nc; c++) {
                int32_t is = 0;
                for (int i = 0; i < 32; i++) is += (int32_t)lv[c * 32 + i] * q[c * 32 + i];
                if (signed_off)
                    for (int i = 0; i < 32; i++) is -= off * q[c * 32 + i];
                acc += (dw[c] * xd[c]) * (float)is;
                acc += mm[c] * xs[c];
            }
            j->y[(size_t)t * j->ldy + n] = acc;
        }
    }
}


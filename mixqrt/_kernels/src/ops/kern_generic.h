/* The portable tier's entries (kern_generic.c), for the dispatcher. */
#ifndef MIXQRT_KERN_GENERIC_H
#define MIXQRT_KERN_GENERIC_H
#include "mq_kern.h"

void mq_quantize_act_generic(const float *x, int K, int kp, int8_t *q, float *d, float *s);
void mq_mm_rows_generic(const mq_mm_job *j, int n0, int n1);
/* Unpack one packed row to u8 levels lv[nc*32], dw[nc], mm[nc] (mm = m - off*dw). */
void mq_unpack_row_generic(const mq_mm_job *j, const uint8_t *row, uint8_t *lv, float *dw, float *mm);
#endif

/* q2c's 4-level k-means block quantizer (kmeans.c), for quant.c. */
#ifndef MIXQRT_KMEANS_H
#define MIXQRT_KMEANS_H
#include <stdint.h>

/* q2c: one block of nv (<= 128) values -> 40 packed bytes; scratch >= 4 * 128 doubles */
void mq_q2c_block(const float *x, int nv, uint8_t *dst);
#endif

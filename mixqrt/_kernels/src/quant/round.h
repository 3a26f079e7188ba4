/* The fp16 scale rounding every quantizer shares (quant.c, kmeans.c, search.c): round toward zero,
 * then snap to the scale that hits the block's extreme exactly (see mixqrt/formats/codec.py). */
#ifndef MIXQRT_ROUND_H
#define MIXQRT_ROUND_H
#include <stdint.h>

#include "mq_format.h"   /* fp16 conversions */

/* ---------------------------------------------------------------- fp16 scale rounding */
/* round toward zero: the scale never exceeds the exact quotient (see formats.py) */
static inline uint16_t mq_f32_to_f16_rtz(float f) {
    uint16_t h = mq_f32_to_f16(f);
    float back = mq_f16_to_f32(h);
    if ((back < 0 ? -back : back) > (f < 0 ? -f : f)) h = (uint16_t)(h - 1);
    return h;
}

/* keep d if fl(d*top + m) == target, else the next fp16 up if that one hits target exactly */
static inline uint16_t mq_snap(uint16_t d, float m, float top, float target) {
    if (mq_f16_to_f32(d) * top + m == target) return d;
    uint32_t up = (uint32_t)d + 1;
    if (up < 0x7c00u && mq_f16_to_f32((uint16_t)up) * top + m == target) return (uint16_t)up;
    return d;
}

#endif

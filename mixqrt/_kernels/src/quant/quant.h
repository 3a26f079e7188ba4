/* Quantize + pack and dequantize for every mixqrt format (the fast path of mixqrt.formats.codec).
 * Bit-exact with the numpy reference: float32 ops in the reference's order, no contraction
 * (-ffp-contract=off), fp16 conversion with round-to-nearest-even including subnormals. */
#ifndef MIXQRT_QUANT_H
#define MIXQRT_QUANT_H
#include <stdint.h>
#include <string.h>

#include "mq_format.h"   /* ids, layouts, fp16, chunk packing, the dequantizer */

/* x: n rows of k float32 (row stride k); out: layout.expected_nbytes(fmt, (n, k)) bytes.
 * levels: the q3p table (MQ_Q3P_NLEVELS bytes). lo/hi: q5g range (already validated). Returns 0, or -1 for a bad fmt. */
int mq_quantize(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *levels,
                float lo, float hi);

/* Dequantize rows ids[0..nids) (or rows 0..nids when ids == NULL) of a packed [*, k] tensor into
 * out [nids, k]. lo/hi: the q5g trailer. */
int mq_dequantize_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *ids, int64_t nids,
                       float *out, const uint8_t *levels, float lo, float hi);

/* Error-minimising (d, m) search for q6/q4/q3u/q3p, same layouts (search.c; spec: formats.py
 * _search_parts). imp: k per-column weights (imatrix) or NULL for plain squared error.
 * Returns 0, or -1 for a format without a search. */
int mq_quantize_search(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *levels,
                       const float *imp);

#endif

"""Kernels of mixqrt.ops: products from packed weights, activation quantization, the thread pool,
the bandwidth probe and the float ops of a layer. Thin wrappers: check shapes and dtypes, release
the GIL, run on the native pool. Declarations: _ops.pxd; C sources: src/ops/. The code is in the
_ops_*.pxi files included at the end, one per topic."""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, uint16_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
from libc.math cimport NAN
from mixqrt._kernels.cpu cimport mq_isa_get, mq_isa_set
from mixqrt._kernels.format cimport (MQ_FORMATS, MQ_NFMT, MQ_NPACKED, MQ_CHUNK, MQ_Q3P, MQ_Q3P_NLEVELS,
                                     MQ_Q3P_LEVEL_MAX, MQ_Q3X, MQ_XROWS, mq_row_bytes, mq_x_base)

cnp.import_array()


def set_isa(int isa):
    return mq_isa_set(isa)


def get_isa():
    return mq_isa_get()


cdef inline void* _ptr(cnp.ndarray a) noexcept:
    return cnp.PyArray_DATA(a)


include "_ops_tuning.pxi"
include "_ops_matmul.pxi"
include "_ops_pool.pxi"
include "_ops_float.pxi"
include "_ops_kv.pxi"
include "_ops_decode.pxi"

"""Fast path of mixqrt.formats.codec: quantize+pack and dequantize rows (C in src/quant/).

Thin wrappers: check dtype, shape and contiguity, release the GIL, call C. The numpy reference in
formats.py is the spec; tests check these are bit-exact with it on every ISA tier.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t
from mixqrt._kernels.format cimport mq_row_bytes

from mixqrt._kernels.cpu cimport mq_isa_get, mq_isa_set
from mixqrt._kernels.format cimport MQ_NFMT, MQ_XROWS, mq_x_base, MQ_Q5G, MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P, MQ_Q3P_NLEVELS
from mixqrt.errors import KernelError

cnp.import_array()

cdef extern from "quant.h" nogil:
    int mq_quantize(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out, const uint8_t *levels,
                    float lo, float hi)
    int mq_dequantize_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *ids, int64_t nids,
                           float *out, const uint8_t *levels, float lo, float hi)
    int mq_quantize_search(int fmt, const float *x, int64_t n, int64_t k, uint8_t *out,
                           const uint8_t *levels, const float *imp)
    unsigned short mq_f32_to_f16(float f)
    float mq_f16_to_f32(unsigned short h)

NFMT = MQ_NFMT
_Q5G = MQ_Q5G


def get_isa():
    return mq_isa_get()


def set_isa(int isa):
    return mq_isa_set(isa)


cdef void _check_levels(const uint8_t[::1] levels) except *:
    if levels.shape[0] != MQ_Q3P_NLEVELS:
        raise KernelError(f"q3p levels table must have {MQ_Q3P_NLEVELS} entries, got {levels.shape[0]}")


def quantize(int fmt, const float[:, ::1] x not None, uint8_t[::1] out not None,
             const uint8_t[::1] levels not None, float lo=0.0, float hi=0.0):
    """x float32 C-contiguous [n, k] -> out (exactly the packed size of fmt)."""
    if fmt < 0 or fmt >= NFMT:
        raise KernelError(f"unknown format id {fmt}")
    _check_levels(levels)
    cdef int64_t n = x.shape[0], k = x.shape[1]
    cdef int64_t need = n * mq_row_bytes(fmt, k) + (8 if fmt == _Q5G else 0)
    if out.shape[0] != need:
        raise KernelError(f"output buffer holds {out.shape[0]} bytes; format {fmt} [{n}, {k}] needs {need}")
    cdef int rc
    with nogil:
        rc = mq_quantize(fmt, &x[0, 0], n, k, &out[0], &levels[0], lo, hi)
    if rc:
        raise KernelError(f"quantize failed for format id {fmt}")


SEARCH_IDS = (MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P)


def quantize_search(int fmt, const float[:, ::1] x not None, uint8_t[::1] out not None,
                    const uint8_t[::1] levels not None, imp=None):
    """Error-minimising quantize+pack (src/quant/search.c); imp: float32 [k] column weights or None."""
    if fmt not in SEARCH_IDS:
        raise KernelError(f"format id {fmt} has no search quantizer")
    _check_levels(levels)
    cdef int64_t n = x.shape[0], k = x.shape[1]
    cdef int64_t need = n * mq_row_bytes(fmt, k)
    if out.shape[0] != need:
        raise KernelError(f"output buffer holds {out.shape[0]} bytes; format {fmt} [{n}, {k}] needs {need}")
    cdef const float[::1] iv
    cdef const float *ip = NULL
    if imp is not None:
        iv = np.ascontiguousarray(imp, dtype=np.float32)
        if iv.shape[0] != k:
            raise KernelError(f"importance has {iv.shape[0]} entries, rows have {k} columns")
        ip = &iv[0]
    cdef int rc
    with nogil:
        rc = mq_quantize_search(fmt, &x[0, 0], n, k, &out[0], &levels[0], ip)
    if rc:
        raise KernelError(f"search quantize failed for format id {fmt}")


def dequantize_rows(int fmt, const uint8_t[::1] raw not None, int64_t k, ids, float[:, ::1] out not None,
                    const uint8_t[::1] levels not None, float lo=0.0, float hi=0.0):
    """Rows `ids` (int64 array, or None for every row) of a packed [*, k] tensor -> out [len, k]."""
    if fmt < 0 or fmt >= NFMT:
        raise KernelError(f"unknown format id {fmt}")
    _check_levels(levels)
    cdef int64_t rb = mq_row_bytes(fmt, k)
    cdef int64_t nrows = (raw.shape[0] - (8 if fmt == _Q5G else 0)) // rb if rb > 0 else 0
    cdef const int64_t[::1] idv
    cdef const int64_t *idp = NULL
    cdef int64_t nids
    if out.shape[1] != k:
        raise KernelError(f"output has {out.shape[1]} columns, tensor rows have {k}")
    if mq_x_base(fmt) >= 0 and nrows % MQ_XROWS:
        raise KernelError(f"a row-interleaved buffer holds whole groups of {MQ_XROWS} rows, this one {nrows} rows")
    if ids is None:
        nids = out.shape[0]
        if nids > nrows:
            raise KernelError(f"asked for {nids} rows, the buffer holds {nrows}")
    else:
        idv = np.ascontiguousarray(ids, dtype=np.int64)
        nids = idv.shape[0]
        if nids != out.shape[0]:
            raise KernelError(f"{nids} row ids but the output has {out.shape[0]} rows")
        if nids:
            if np.min(idv) < 0 or np.max(idv) >= nrows:
                raise KernelError(f"row id out of range [0, {nrows})")
            idp = &idv[0]
    if nids == 0:
        return
    with nogil:
        mq_dequantize_rows(fmt, &raw[0], k, idp, nids, &out[0, 0], &levels[0], lo, hi)


def f32_to_f16_bits(const float[::1] x not None):
    """fp16 bits of each float32 (round to nearest even): exposed so tests can compare with numpy."""
    cdef Py_ssize_t i
    out = np.empty(x.shape[0], dtype=np.uint16)
    cdef unsigned short[::1] o = out
    for i in range(x.shape[0]):
        o[i] = mq_f32_to_f16(x[i])
    return out


def f16_bits_to_f32(const unsigned short[::1] h not None):
    cdef Py_ssize_t i
    out = np.empty(h.shape[0], dtype=np.float32)
    cdef float[::1] o = out
    for i in range(h.shape[0]):
        o[i] = mq_f16_to_f32(h[i])
    return out

# Declarations of src/common/mq_format.h (the format spec), shared by every kernel module.
from libc.stdint cimport int64_t

cdef extern from "mq_format.h" nogil:
    ctypedef struct mq_fmt_spec:
        const char *name
        int bits, group, header, block_bytes, trailer, off, pack, levels
    const mq_fmt_spec MQ_FORMATS[]
    int MQ_NFMT, MQ_NPACKED, MQ_LV_CODES, MQ_LV_SIGNED, MQ_LV_TABLE, MQ_LV_BLOCK_LUT, MQ_CHUNK, MQ_Q3P_NLEVELS, MQ_Q3P_LEVEL_MAX, MQ_PACK3C
    int MQ_Q8, MQ_Q6, MQ_Q4, MQ_Q3U, MQ_Q3P, MQ_Q2C, MQ_Q5G, MQ_Q4X, MQ_Q3X, MQ_F32, MQ_F16, MQ_BF16, MQ_XROWS
    int64_t mq_row_bytes(int fmt, int64_t k)
    int mq_x_base(int fmt)

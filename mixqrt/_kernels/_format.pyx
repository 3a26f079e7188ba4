"""The format spec of src/common/mq_format.h as Python values: mixqrt.formats.layout reads format ids
and block sizes from here, so C and Python cannot drift apart."""
from mixqrt._kernels.format cimport MQ_FORMATS, MQ_NFMT, MQ_NPACKED, MQ_CHUNK, MQ_Q3P_NLEVELS, MQ_Q3P_LEVEL_MAX, MQ_PACK3C, MQ_XROWS

CHUNK = MQ_CHUNK
NPACKED = MQ_NPACKED
Q3P_NLEVELS = MQ_Q3P_NLEVELS
Q3P_LEVEL_MAX = MQ_Q3P_LEVEL_MAX
PACK3C = MQ_PACK3C
XROWS = MQ_XROWS


def format_table():
    """[(id, name, bits, group, header, block_bytes, trailer, pack)] for every format, in id order.
    Plain formats (id >= NPACKED) have group 1 and block_bytes = bytes per value."""
    cdef int i
    return [(i, MQ_FORMATS[i].name.decode(), MQ_FORMATS[i].bits, MQ_FORMATS[i].group, MQ_FORMATS[i].header,
             MQ_FORMATS[i].block_bytes, MQ_FORMATS[i].trailer, MQ_FORMATS[i].pack) for i in range(MQ_NFMT)]

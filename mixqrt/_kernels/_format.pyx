"""The format spec of src/common/mq_format.h as Python values: mixqrt.formats.layout reads format ids
and block sizes from here, so C and Python cannot drift apart."""
from mixqrt._kernels.format cimport (MQ_FORMATS, MQ_NFMT, MQ_NPACKED, MQ_CHUNK, MQ_Q3P_NLEVELS, MQ_Q3P_LEVEL_MAX,
                                     MQ_PACK3C, MQ_XROWS, mq_x_base, MQ_LV_CODES, MQ_LV_SIGNED, MQ_LV_TABLE,
                                     MQ_LV_BLOCK_LUT)

CHUNK = MQ_CHUNK
NPACKED = MQ_NPACKED
Q3P_NLEVELS = MQ_Q3P_NLEVELS
Q3P_LEVEL_MAX = MQ_Q3P_LEVEL_MAX
PACK3C = MQ_PACK3C
XROWS = MQ_XROWS
# how a format's codes become the kernels' levels (enum mq_levels), by name
LEVELS = {MQ_LV_CODES: "codes", MQ_LV_SIGNED: "signed", MQ_LV_TABLE: "table", MQ_LV_BLOCK_LUT: "block_lut"}


def format_table():
    """[(id, name, bits, group, header, block_bytes, trailer, pack)] for every format, in id order.
    Plain formats (id >= NPACKED) have group 1 and block_bytes = bytes per value."""
    cdef int i
    return [(i, MQ_FORMATS[i].name.decode(), MQ_FORMATS[i].bits, MQ_FORMATS[i].group, MQ_FORMATS[i].header,
             MQ_FORMATS[i].block_bytes, MQ_FORMATS[i].trailer, MQ_FORMATS[i].pack) for i in range(MQ_NFMT)]


def format_specs():
    """Every row of the C table as a dict, in id order: id, name, bits, group, header, block_bytes,
    trailer, pack, off (the kernels' level offset), levels (how the codes become levels: a LEVELS name)
    and base (the id of the format whose blocks a row-interleaved form holds, mq_x_base; -1 for the
    others)."""
    cdef int i
    return [dict(id=i, name=MQ_FORMATS[i].name.decode(), bits=MQ_FORMATS[i].bits, group=MQ_FORMATS[i].group,
                 header=MQ_FORMATS[i].header, block_bytes=MQ_FORMATS[i].block_bytes,
                 trailer=MQ_FORMATS[i].trailer, pack=MQ_FORMATS[i].pack, off=MQ_FORMATS[i].off,
                 levels=LEVELS[MQ_FORMATS[i].levels], base=mq_x_base(i)) for i in range(MQ_NFMT)]

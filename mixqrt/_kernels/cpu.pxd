# Declarations shared by every kernel module (src/common/cpu.h).
from libc.stdint cimport uint32_t

cdef extern from "cpu.h" nogil:
    uint32_t mq_cpu_features()
    int mq_cpu_best_isa()
    void mq_cpu_vendor(char* out)
    void mq_cpu_brand(char* out)
    int mq_isa_get()
    int mq_isa_set(int isa)

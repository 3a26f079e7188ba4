"""CPU detection: features, vendor, best ISA tier (cpuid + xgetbv)."""
from mixqrt._kernels.cpu cimport (mq_cpu_features, mq_cpu_best_isa, mq_cpu_vendor, mq_cpu_brand,
                                  mq_isa_get, mq_isa_set)

FEATURE_NAMES = ("ssse3", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
                 "avx512dq", "avx512vnni", "avx512vbmi", "avx512bf16", "os_ymm", "os_zmm")


def features():
    """Set of feature names the CPU reports (and the OS enables, for os_ymm / os_zmm)."""
    cdef unsigned int f = mq_cpu_features()
    return {n for i, n in enumerate(FEATURE_NAMES) if f & (1u << i)}


def best_isa():
    return mq_cpu_best_isa()


def vendor():
    cdef char buf[13]
    mq_cpu_vendor(buf)
    return buf[:12].decode("ascii", "replace").strip("\x00 ")


def brand():
    cdef char buf[49]
    mq_cpu_brand(buf)
    return buf[:48].decode("ascii", "replace").strip("\x00 ")


def get_isa():
    return mq_isa_get()


def set_isa(int isa):
    return mq_isa_set(isa)

/* Runtime CPU detection. Tiers are decided from cpuid *and* xgetbv: a CPU that reports AVX-512
 * under an OS (or hypervisor) that does not save zmm/opmask state must not run AVX-512 code. */
#include "cpu.h"
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static void cpuid2(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

uint32_t mq_cpu_features(void) {
    static int done = 0;
    static uint32_t feats = 0;
    if (done) return feats;
    uint32_t r[4], f = 0;
    cpuid2(0, 0, r);
    uint32_t max_leaf = r[0];
    cpuid2(1, 0, r);
    int osxsave = (r[2] >> 27) & 1;
    if ((r[2] >> 9) & 1) f |= MQ_F_SSSE3;
    if ((r[2] >> 28) & 1) f |= MQ_F_AVX;
    if ((r[2] >> 12) & 1) f |= MQ_F_FMA;
    if ((r[2] >> 29) & 1) f |= MQ_F_F16C;
    if (osxsave) {
        uint64_t xcr0 = xgetbv0();
        if ((xcr0 & 0x6) == 0x6) f |= MQ_F_OS_YMM;
        if ((xcr0 & 0xe6) == 0xe6) f |= MQ_F_OS_ZMM;
    }
    if (max_leaf >= 7) {
        cpuid2(7, 0, r);
        if ((r[1] >> 5) & 1) f |= MQ_F_AVX2;
        if ((r[1] >> 8) & 1) f |= MQ_F_BMI2;
        if ((r[1] >> 16) & 1) f |= MQ_F_AVX512F;
        if ((r[1] >> 17) & 1) f |= MQ_F_AVX512DQ;
        if ((r[1] >> 30) & 1) f |= MQ_F_AVX512BW;
        if ((r[1] >> 31) & 1) f |= MQ_F_AVX512VL;
        if ((r[2] >> 1) & 1) f |= MQ_F_AVX512VBMI;
        if ((r[2] >> 11) & 1) f |= MQ_F_AVX512VNNI;
        cpuid2(7, 1, r);
        if ((r[0] >> 5) & 1) f |= MQ_F_AVX512BF16;
    }
    feats = f;
    done = 1;
    return f;
}

void mq_cpu_vendor(char out[13]) {
    uint32_t r[4];
    cpuid2(0, 0, r);
    memcpy(out, &r[1], 4);
    memcpy(out + 4, &r[3], 4);
    memcpy(out + 8, &r[2], 4);
    out[12] = 0;
}

void mq_cpu_brand(char out[49]) {
    uint32_t r[4];
    memset(out, 0, 49);
    cpuid2(0x80000000u, 0, r);
    if (r[0] < 0x80000004u) return;
    for (uint32_t i = 0; i < 3; i++) {
        cpuid2(0x80000002u + i, 0, r);
        memcpy(out + 16 * i, r, 16);
    }
}
#else
uint32_t mq_cpu_features(void) { return 0; }
void mq_cpu_vendor(char out[13]) { strcpy(out, "unknown"); }
void mq_cpu_brand(char out[49]) { strcpy(out, "unknown"); }
#endif

int mq_cpu_best_isa(void) {
    uint32_t f = mq_cpu_features();
    const uint32_t need2 = MQ_F_AVX | MQ_F_AVX2 | MQ_F_FMA | MQ_F_F16C | MQ_F_BMI2 | MQ_F_OS_YMM;
    const uint32_t need512 = need2 | MQ_F_AVX512F | MQ_F_AVX512BW | MQ_F_AVX512VL | MQ_F_AVX512DQ |
                             MQ_F_AVX512VNNI | MQ_F_AVX512VBMI | MQ_F_OS_ZMM;
    if ((f & need512) == need512) return MQ_ISA_AVX512;
    if ((f & need2) == need2) return MQ_ISA_AVX2;
    return MQ_ISA_GENERIC;
}

static int g_isa = -1;

int mq_isa_set(int isa) {
    int best = mq_cpu_best_isa();
    if (isa < 0 || isa > best) isa = best;
    g_isa = isa;
    return isa;
}

/* the best tier until mq_isa_set: MIXQRT_ISA reaches every kernel module through mixqrt.platform.isa at import
 * (mixqrt.platform.tuning reads it), so C does not read the environment */
int mq_isa_get(void) {
    if (g_isa >= 0) return g_isa;
    return mq_isa_set(-1);
}

/* CPU feature detection and ISA tier selection (cpuid + xgetbv). */
#ifndef MIXQRT_CPU_H
#define MIXQRT_CPU_H
#include <stdint.h>

enum mq_isa { MQ_ISA_GENERIC = 0, MQ_ISA_AVX2 = 1, MQ_ISA_AVX512 = 2 };

/* feature bits reported by mq_cpu_features() */
#define MQ_F_SSSE3      (1u << 0)
#define MQ_F_AVX        (1u << 1)
#define MQ_F_AVX2       (1u << 2)
#define MQ_F_FMA        (1u << 3)
#define MQ_F_F16C       (1u << 4)
#define MQ_F_BMI2       (1u << 5)
#define MQ_F_AVX512F    (1u << 6)
#define MQ_F_AVX512BW   (1u << 7)
#define MQ_F_AVX512VL   (1u << 8)
#define MQ_F_AVX512DQ   (1u << 9)
#define MQ_F_AVX512VNNI (1u << 10)
#define MQ_F_AVX512VBMI (1u << 11)
#define MQ_F_AVX512BF16 (1u << 12)
#define MQ_F_OS_YMM     (1u << 13)  /* XCR0 has SSE+AVX state: OS saves ymm */
#define MQ_F_OS_ZMM     (1u << 14)  /* XCR0 has opmask+zmm state: OS saves zmm */

uint32_t mq_cpu_features(void);
/* highest tier this CPU and OS can run (never one that would SIGILL) */
int mq_cpu_best_isa(void);
/* vendor string (12 chars + NUL) and brand string (48 chars + NUL) */
void mq_cpu_vendor(char out[13]);
void mq_cpu_brand(char out[49]);



/* The tier kernels use now. First use reads MIXQRT_ISA (generic|avx2|avx512), clamped to
 * mq_cpu_best_isa(). Each extension module holds its own copy; mixqrt.platform.isa keeps them in step. */
int mq_isa_get(void);
/* Set the tier (clamped to what the CPU supports); returns the tier actually set. */
int mq_isa_set(int isa);
#endif

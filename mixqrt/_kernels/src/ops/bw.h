/* The memory-bandwidth probe (bw.c) and its per-tier read patterns (bw_avx2.c, bw_avx512.c). */
#ifndef MIXQRT_BW_H
#define MIXQRT_BW_H
#include <stddef.h>
#include <stdint.h>

/* best of every pattern this CPU runs, bytes/s (-1 on failure) */
double mq_read_bandwidth(size_t nbytes, int threads, int reps);
int mq_bw_set_cpus(const int *cpus, int n);   /* pinning order of the probe's threads; 0: affinity order */
int mq_bw_npatterns(void);
const char *mq_bw_pattern_name(int i);
int mq_bw_pattern_available(int i);            /* 0 where the CPU/OS lacks the ISA */
double mq_read_bandwidth_pattern(size_t nbytes, int threads, int reps, int pattern);  /* -1: unavailable */
/* every pattern on one buffer: out[mq_bw_npatterns()] bytes/s (-1: unavailable); returns the best */
double mq_read_bandwidth_all(size_t nbytes, int threads, int reps, double *out);
/* one sweep over n bytes (n a multiple of 256, 64 B aligned); returns a checksum (bw_avx2.c, bw_avx512.c) */
uint64_t mq_bw_sweep_avx2(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_1s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_1s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_2s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_2s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_8s_pf(const uint8_t *b, size_t n);
uint64_t mq_bw_sweep_avx512_4s_nt(const uint8_t *b, size_t n);

#endif

/* Read-bandwidth probe. A decode step streams the weights once, so the honest bound for it is the
 * fastest read the machine can sustain, not what one naive loop reaches: one stream per thread
 * leaves the memory controller idle between hardware-prefetcher ramps. Each pattern below reads the
 * same buffer (2 MiB aligned, MADV_HUGEPAGE, pages touched first so no fault is timed) on threads
 * pinned one per CPU (mq_bw_set_cpus order, else the affinity mask); mq_read_bandwidth_pattern reports one pattern and
 * mq_read_bandwidth the best of them. Wide-load patterns live in bw_avx2.c / bw_avx512.c and are
 * offered only where cpuid + xgetbv say they run (mq_cpu_best_isa), whatever tier MIXQRT_ISA forces:
 * the bound belongs to the machine. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cpu.h"
#include "mq_ops.h"

#define BW_STREAMS 4
#define BW_PF 1024    /* software prefetch distance per stream, bytes */

static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }

/* one stream, no prefetch: the probe mixqrt used before, kept as a pattern for comparison */
static uint64_t sweep_scalar(const uint8_t *b, size_t n) {
    const uint64_t *p = (const uint64_t *)b;
    n /= 8;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

/* BW_STREAMS independent streams (the slice cut in BW_STREAMS parts), each prefetched BW_PF ahead */
static uint64_t sweep_scalar_ms(const uint8_t *b, size_t n) {
    size_t part = n / BW_STREAMS / 64 * 64;
    const uint64_t *p0 = (const uint64_t *)b, *p1 = (const uint64_t *)(b + part),
                   *p2 = (const uint64_t *)(b + 2 * part), *p3 = (const uint64_t *)(b + 3 * part);
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (size_t i = 0; i < part / 8; i += 8) {
        __builtin_prefetch((const uint8_t *)(p0 + i) + BW_PF);
        __builtin_prefetch((const uint8_t *)(p1 + i) + BW_PF);
        __builtin_prefetch((const uint8_t *)(p2 + i) + BW_PF);
        __builtin_prefetch((const uint8_t *)(p3 + i) + BW_PF);
        for (int k = 0; k < 8; k++) { a0 += p0[i + k]; a1 += p1[i + k]; a2 += p2[i + k]; a3 += p3[i + k]; }
    }
    return a0 + a1 + a2 + a3;
}

typedef uint64_t (*bw_fn)(const uint8_t *, size_t);

typedef struct { const char *name; bw_fn fn; int isa; size_t il; } bw_pattern;

static const bw_pattern PATTERNS[] = {
    {"scalar-1stream", sweep_scalar, MQ_ISA_GENERIC},
    {"scalar-4stream-pf", sweep_scalar_ms, MQ_ISA_GENERIC},
#if defined(__x86_64__)
    {"avx2-4stream-pf", mq_bw_sweep_avx2, MQ_ISA_AVX2},
    {"avx512-1stream", mq_bw_sweep_avx512_1s, MQ_ISA_AVX512},
    {"avx512-1stream-pf", mq_bw_sweep_avx512_1s_pf, MQ_ISA_AVX512},
    {"avx512-2stream", mq_bw_sweep_avx512_2s, MQ_ISA_AVX512},
    {"avx512-2stream-pf", mq_bw_sweep_avx512_2s_pf, MQ_ISA_AVX512},
    {"avx512-4stream", mq_bw_sweep_avx512_4s, MQ_ISA_AVX512},
    {"avx512-4stream-pf", mq_bw_sweep_avx512_4s_pf, MQ_ISA_AVX512},
    {"avx512-8stream-pf", mq_bw_sweep_avx512_8s_pf, MQ_ISA_AVX512},
    {"avx512-4stream-nt", mq_bw_sweep_avx512_4s_nt, MQ_ISA_AVX512},
    {"avx512-1stream-il16k", mq_bw_sweep_avx512_1s, MQ_ISA_AVX512, 16 << 10},
    {"avx512-1stream-il256k", mq_bw_sweep_avx512_1s, MQ_ISA_AVX512, 256 << 10},
    {"avx512-1stream-pf-il16k", mq_bw_sweep_avx512_1s_pf, MQ_ISA_AVX512, 16 << 10},
#endif
};
#define NPAT ((int)(sizeof PATTERNS / sizeof PATTERNS[0]))

int mq_bw_npatterns(void) { return NPAT; }

const char *mq_bw_pattern_name(int i) { return (i >= 0 && i < NPAT) ? PATTERNS[i].name : NULL; }

int mq_bw_pattern_available(int i) { return i >= 0 && i < NPAT && PATTERNS[i].isa <= mq_cpu_best_isa(); }

typedef struct {
    bw_fn fn;
    const uint8_t *p;
    size_t n;
    size_t il;          /* > 0: p is the whole buffer, this thread reads chunks idx, idx + step, ... of il bytes */
    int idx, step;
    int reps, cpu;
    uint64_t sink;
    _Atomic int *ready, *go;    /* start line: each thread counts itself ready, then waits for go (1: run, -1: abort) */
    double t0, t1;
} bw_arg;

static uint64_t run_once(const bw_arg *a) {
    if (!a->il) return a->fn(a->p, a->n);
    uint64_t s = 0;
    for (size_t c = (size_t)a->idx; (c + 1) * a->il <= a->n; c += (size_t)a->step) s += a->fn(a->p + c * a->il, a->il);
    return s;
}

static void *bw_thread(void *vp) {
    bw_arg *a = (bw_arg *)vp;
    if (a->cpu >= 0) {
        cpu_set_t cs; CPU_ZERO(&cs); CPU_SET(a->cpu, &cs);
        pthread_setaffinity_np(pthread_self(), sizeof cs, &cs);
    }
    a->sink = run_once(a);    /* warm: TLB, page tables, prefetcher training */
    atomic_fetch_add(a->ready, 1);
    int g;
    while ((g = atomic_load(a->go)) == 0) sched_yield();
    if (g < 0) return NULL;
    /* each thread times itself: the caller may be descheduled after the start */
    a->t0 = now_s();
    for (int r = 0; r < a->reps; r++) a->sink += run_once(a);
    a->t1 = now_s();
    return NULL;
}

/* The CPUs the probe's threads are pinned to, in order (thread i on cpus[i % n]); unset: the
 * affinity mask in CPU order. Python sets the pool's order (platform.affinity.worker_cpus: one
 * thread per core before SMT siblings), so the probe at n threads reads with the cores decode uses. */
static int bw_cpus[64];
static _Atomic int bw_ncpu = 0;

int mq_bw_set_cpus(const int *cpus, int n) {
    if (n < 0) n = 0;
    if (n > 64) n = 64;
    atomic_store(&bw_ncpu, 0);
    for (int i = 0; i < n; i++) bw_cpus[i] = cpus[i];
    atomic_store(&bw_ncpu, n);
    return n;
}

/* 2 MiB-aligned anonymous buffer advised for transparent huge pages; map and maplen for munmap */
static uint8_t *huge_alloc(size_t n, void **map, size_t *maplen) {
    const size_t H = 2u << 20;
    size_t len = n + H;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + H - 1) & ~(uintptr_t)(H - 1));
#ifdef MADV_HUGEPAGE
    madvise(p, n, MADV_HUGEPAGE);
#endif
    *map = m; *maplen = len;
    return p;
}

/* One buffer and one set of pinned threads for every pattern with want[i] != 0: out[i] = bytes/s
 * (-1 where not run). Returns the best. */
static double probe(size_t nbytes, int threads, int reps, const int *want, double *out) {
    for (int i = 0; i < NPAT; i++) out[i] = -1.0;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (reps < 1) reps = 1;
    /* per thread: a multiple of the largest interleave chunk, so every byte counted is read */
    const size_t unit = 256u << 10;
    size_t per = nbytes / threads / unit * unit;
    if (per < unit) per = unit;
    void *map; size_t maplen;
    uint8_t *buf = huge_alloc(per * threads, &map, &maplen);
    if (!buf) return -1.0;
    uint64_t *w = (uint64_t *)buf;
    for (size_t i = 0; i < per * threads / 8; i++) w[i] = i * 0x9e3779b97f4a7c15ull;
    int cpus[64], ncpu = atomic_load(&bw_ncpu);
    for (int i = 0; i < ncpu; i++) cpus[i] = bw_cpus[i];
    cpu_set_t cs;
    if (ncpu == 0 && sched_getaffinity(0, sizeof cs, &cs) == 0)
        for (int c = 0; c < CPU_SETSIZE && ncpu < 64; c++) if (CPU_ISSET(c, &cs)) cpus[ncpu++] = c;
    double best = -1.0;
    for (int pat = 0; pat < NPAT; pat++) {
        if (!want[pat] || !mq_bw_pattern_available(pat)) continue;
        _Atomic int ready = 0, go = 0;
        pthread_t th[64];
        bw_arg a[64];
        int started = 0;
        for (int i = 0; i < threads; i++) {
            const size_t il = PATTERNS[pat].il;
            a[i] = (bw_arg){PATTERNS[pat].fn, il ? buf : buf + (size_t)i * per, il ? per * threads : per, il, i, threads,
                            reps, ncpu ? cpus[i % ncpu] : -1, 0, &ready, &go, 0, 0};
            if (pthread_create(&th[i], NULL, bw_thread, &a[i]) != 0) break;
            started++;
        }
        if (started < threads) {    /* a thread could not start: release the others unmeasured, give up */
            atomic_store(&go, -1);
            for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
            break;
        }
        while (atomic_load(&ready) < threads) sched_yield();
        atomic_store(&go, 1);
        for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
        double t0 = a[0].t0, t1 = a[0].t1;
        volatile uint64_t sink = 0;
        for (int i = 0; i < threads; i++) {
            sink += a[i].sink;
            if (a[i].t0 < t0) t0 = a[i].t0;
            if (a[i].t1 > t1) t1 = a[i].t1;
        }
        double t = t1 - t0;
        (void)sink;
        out[pat] = (double)per * threads * reps / t;
        if (out[pat] > best) best = out[pat];
    }
    munmap(map, maplen);
    return best;
}

double mq_read_bandwidth_all(size_t nbytes, int threads, int reps, double *out) {
    int want[NPAT];
    for (int i = 0; i < NPAT; i++) want[i] = 1;
    return probe(nbytes, threads, reps, want, out);
}

double mq_read_bandwidth_pattern(size_t nbytes, int threads, int reps, int pattern) {
    if (!mq_bw_pattern_available(pattern)) return -1.0;
    int want[NPAT];
    double out[NPAT];
    for (int i = 0; i < NPAT; i++) want[i] = i == pattern;
    return probe(nbytes, threads, reps, want, out);
}

double mq_read_bandwidth(size_t nbytes, int threads, int reps) {
    double out[NPAT];
    return mq_read_bandwidth_all(nbytes, threads, reps, out);
}

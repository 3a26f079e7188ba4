/* Read-bandwidth probe: `threads` pinned-free threads each stream over their slice of one buffer
 * (>> LLC) `reps` times; returns bytes read per second over the timed reps (first pass untimed). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mq_ops.h"

typedef struct {
    const uint64_t *p;
    size_t n;
    int reps;
    uint64_t sink;
    pthread_barrier_t *bar;
    double t;
} bw_arg;

static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }

static uint64_t sweep(const uint64_t *p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

static void *bw_thread(void *vp) {
    bw_arg *a = (bw_arg *)vp;
    a->sink = sweep(a->p, a->n);    /* warm: page tables, TLB */
    pthread_barrier_wait(a->bar);
    double t0 = now_s();
    for (int r = 0; r < a->reps; r++) a->sink += sweep(a->p, a->n);
    a->t = now_s() - t0;
    return NULL;
}

double mq_read_bandwidth(size_t nbytes, int threads, int reps) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (reps < 1) reps = 1;
    size_t n = nbytes / 8 / threads / 8 * 8;
    uint64_t *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, n * threads * 8)) return -1.0;
    for (size_t i = 0; i < n * threads; i++) buf[i] = i * 0x9e3779b97f4a7c15ull;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, threads + 1);
    pthread_t th[64];
    bw_arg a[64];
    for (int i = 0; i < threads; i++) {
        a[i] = (bw_arg){buf + (size_t)i * n, n, reps, 0, &bar, 0};
        pthread_create(&th[i], NULL, bw_thread, &a[i]);
    }
    pthread_barrier_wait(&bar);
    double t0 = now_s();
    for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
    double t = now_s() - t0;
    pthread_barrier_destroy(&bar);
    volatile uint64_t s = 0;
    for (int i = 0; i < threads; i++) s += a[i].sink;
    free(buf);
    return (double)n * 8 * threads * reps / t;
}

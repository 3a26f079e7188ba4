/* Native thread pool: threads started once and pinned, no GIL while working; between jobs a worker
 * spins for MIXQRT_SPIN_US (default 100 us) and then sleeps on a futex, so an idle pool costs no CPU;
 * in hot mode (mq_pool_set_hot, ops.hot) workers never sleep: no futex wake-up per job while a model
 * decodes. The caller thread is part 0 of every job. One job at a time: a caller that finds the pool
 * busy (another Python thread) runs its job inline.
 *
 * A job is split in one static part per thread (mq_pool_run_n), or in chunks of `chunk` units that
 * the threads take in turn from an atomic counter (mq_pool_run_chunked: decode products, so that both
 * threads read neighbouring bytes and a late or slower thread takes fewer chunks; never fewer chunks
 * than threads).
 *
 * Gap prefetch (mq_pool_prefetch): an asynchronous job for the workers only. They read a byte range
 * (the weights of the next product) into their caches while the caller returns to the work between
 * two products (norms, attention, Python), which leaves the memory bus idle otherwise; the next
 * job (or stop) aborts it within a few KB and waits for it. Zen's L3 is filled by L2 evictions,
 * so what a worker reads is an L3 hit for the caller's core too. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mq_ops.h"   /* the pool API (mq_ops.h includes nothing of a tier) */

#define MQ_MAXT 256

static struct {
    int n;
    pthread_t th[MQ_MAXT];
    int cpu[MQ_MAXT];
    _Atomic uint32_t gen;       /* bumped once per job; workers futex-wait on it */
    _Atomic uint32_t pending;   /* parts not yet finished; the caller futex-waits on it */
    _Atomic int sleepers;       /* workers asleep on gen */
    _Atomic int caller_sleeps;
    _Atomic int stop;
    mq_task_fn fn;
    void *arg;
    int64_t total, align;
    int nparts;                 /* parts of the current job (<= n); workers >= nparts skip it */
    int64_t chunk;              /* > 0: chunks of this many units, taken in turn (P.next) */
    _Atomic int64_t next;
    _Atomic int hot;            /* spin without sleeping while set (ops.hot) */
    long spin_ns;
    uint32_t start_gen;
    _Atomic int async;          /* a gap prefetch was posted and may still run */
    _Atomic int pf_abort;       /* set to stop it */
    _Atomic int pf_ticket;      /* workers take their slice of it in turn */
    const uint8_t *pf_p;
    size_t pf_n;
    int pf_parts;               /* the compute split it mirrors: slices interleave the parts' starts */
} P = {.n = 1, .nparts = 1};

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static void fwait(_Atomic uint32_t *a, uint32_t v) { syscall(SYS_futex, (uint32_t *)a, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0); }
static void fwake(_Atomic uint32_t *a) { syscall(SYS_futex, (uint32_t *)a, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
static long now_ns(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1000000000L + ts.tv_nsec; }

static void part_range(int part, int nparts, int64_t *i0, int64_t *i1) {
    int64_t units = (P.total + P.align - 1) / P.align;
    int64_t u0 = units * part / nparts, u1 = units * (part + 1) / nparts;
    *i0 = u0 * P.align < P.total ? u0 * P.align : P.total;
    *i1 = u1 * P.align < P.total ? u1 * P.align : P.total;
}

/* this participant's share of the current job: its static part, or chunks taken in turn */
static void run_share(int part) {
    int64_t i0, i1;
    if (P.chunk <= 0) {
        part_range(part, P.nparts, &i0, &i1);
        if (i1 > i0) P.fn(P.arg, i0, i1);
        return;
    }
    const int64_t step = P.chunk * P.align;
    int64_t c;
    while ((c = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed)) * step < P.total) {
        i0 = c * step;
        i1 = i0 + step < P.total ? i0 + step : P.total;
        P.fn(P.arg, i0, i1);
    }
}

static void *worker(void *argp) {
    int idx = (int)(intptr_t)argp;
    if (P.cpu[idx] >= 0) {
        cpu_set_t cs; CPU_ZERO(&cs); CPU_SET(P.cpu[idx], &cs);
        pthread_setaffinity_np(pthread_self(), sizeof cs, &cs);
    }
    uint32_t seen = P.start_gen;   /* not a fresh load: a job may already have been posted */
    for (;;) {
        uint32_t g;
        long t0 = 0;
        int it = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            relax();
            if ((++it & 255) == 0) {
                long t = now_ns();
                if (!t0) t0 = t;
                else if (t - t0 > P.spin_ns && !atomic_load_explicit(&P.hot, memory_order_relaxed)) {
                    atomic_fetch_add(&P.sleepers, 1);
                    if (atomic_load(&P.gen) == seen) fwait(&P.gen, seen);
                    atomic_fetch_sub(&P.sleepers, 1);
                    t0 = 0;
                }
            }
        }
        seen = g;
        if (atomic_load(&P.stop)) return NULL;
        if (idx < P.nparts) run_share(idx);
        if (atomic_fetch_sub(&P.pending, 1) == 1 && atomic_load(&P.caller_sleeps)) fwake(&P.pending);
    }
}

/* wait until every worker has finished the posted job (spin, then sleep on the futex) */
static void wait_pending(void) {
    long t0 = 0;
    int it = 0;
    uint32_t p;
    while ((p = atomic_load_explicit(&P.pending, memory_order_acquire)) != 0) {
        relax();
        if ((++it & 255) == 0) {
            long t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > P.spin_ns && !atomic_load_explicit(&P.hot, memory_order_relaxed)) {
                atomic_store(&P.caller_sleeps, 1);
                if ((p = atomic_load(&P.pending)) != 0) fwait(&P.pending, p);
                atomic_store(&P.caller_sleeps, 0);
            }
        }
    }
}

/* stop a running gap prefetch and wait for it (run_lock held) */
static void finish_async(void) {
    if (!atomic_load(&P.async)) return;
    atomic_store(&P.pf_abort, 1);
    wait_pending();
    atomic_store(&P.async, 0);
}

/* the gap prefetch task: worker w of the n - 1 workers reads every (n-1)-th 4 KB piece of each of the
 * pf_parts slices, slice starts first (each compute thread's first rows are the ones it needs
 * first); one load per line, so the hardware prefetcher follows, checking for an abort per piece */
#define PF_PIECE 4096
static void pf_task(void *arg, int64_t i0, int64_t i1) {
    (void)arg; (void)i0; (void)i1;
    const int nw = P.n - 1, w = atomic_fetch_add(&P.pf_ticket, 1) % (nw > 0 ? nw : 1);
    const size_t slice = P.pf_n / (size_t)P.pf_parts;
    const uint8_t *p = P.pf_p;
    uint64_t acc = 0;
    for (size_t off = (size_t)w * PF_PIECE; off < slice; off += (size_t)nw * PF_PIECE) {
        for (int q = 0; q < P.pf_parts; q++) {
            if (atomic_load_explicit(&P.pf_abort, memory_order_relaxed)) goto done;
            const volatile uint8_t *b = (const volatile uint8_t *)(p + (size_t)q * slice + off);
            size_t e = slice - off < PF_PIECE ? slice - off : PF_PIECE;
            for (size_t o = 0; o < e; o += 64) acc += b[o];
        }
    }
done:
    __asm__ volatile("" : : "r"(acc));
}

void mq_pool_prefetch(const uint8_t *p, size_t n, int parts) {
    if (P.n <= 1 || n == 0 || pthread_mutex_trylock(&run_lock) != 0) return;
    finish_async();
    if (parts < 1) parts = 1;
    if (parts > P.n) parts = P.n;
    P.pf_p = p; P.pf_n = n; P.pf_parts = parts;
    atomic_store(&P.pf_abort, 0);
    atomic_store(&P.pf_ticket, 0);
    P.fn = pf_task; P.arg = NULL; P.total = P.n; P.align = 1; P.nparts = P.n; P.chunk = 0;
    atomic_store(&P.async, 1);
    atomic_store(&P.pending, (uint32_t)(P.n - 1));
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (atomic_load(&P.sleepers) > 0) fwake(&P.gen);
    pthread_mutex_unlock(&run_lock);
}

void mq_pool_prefetch_wait(void) {
    pthread_mutex_lock(&run_lock);
    finish_async();
    pthread_mutex_unlock(&run_lock);
}

static void pool_stop_unlocked(void) {
    finish_async();
    if (P.n <= 1) { P.n = 1; return; }
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.gen, 1);
    fwake(&P.gen);
    for (int i = 1; i < P.n; i++) pthread_join(P.th[i], NULL);
    atomic_store(&P.stop, 0);
    P.n = 1;
}

/* how long an idle worker spins before it sleeps on the futex, from the next start on (MIXQRT_SPIN_US,
 * set by mixqrt.platform.tuning before the pool first starts) */
static long spin_us = 100;
void mq_pool_set_spin_us(long us) { spin_us = us < 0 ? 0 : us; }

int mq_pool_start(int n, const int *cpus, int ncpus) {
    pthread_mutex_lock(&start_lock);
    pthread_mutex_lock(&run_lock);
    pool_stop_unlocked();
    if (n < 1) n = 1;
    if (n > MQ_MAXT) n = MQ_MAXT;
    P.spin_ns = spin_us * 1000L;
    for (int i = 0; i < n; i++) P.cpu[i] = (ncpus > 0) ? cpus[i % ncpus] : -1;
    P.n = 1;
    P.start_gen = atomic_load(&P.gen);
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.th[i], NULL, worker, (void *)(intptr_t)i) != 0) break;
        P.n = i + 1;
    }
    pthread_mutex_unlock(&run_lock);
    pthread_mutex_unlock(&start_lock);
    return P.n;
}

void mq_pool_stop(void) {
    pthread_mutex_lock(&run_lock);
    pool_stop_unlocked();
    pthread_mutex_unlock(&run_lock);
}

int mq_pool_size(void) { return P.n; }

void mq_pool_set_hot(int hot) { atomic_store(&P.hot, hot ? 1 : 0); }
int mq_pool_get_hot(void) { return atomic_load(&P.hot); }

void mq_pool_run(mq_task_fn fn, void *arg, int64_t n, int64_t align) { mq_pool_run_n(fn, arg, n, align, 0); }

void mq_pool_run_n(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads) {
    mq_pool_run_chunked(fn, arg, n, align, nthreads, 0);
}

void mq_pool_run_chunked(mq_task_fn fn, void *arg, int64_t n, int64_t align, int nthreads, int64_t chunk) {
    if (align < 1) align = 1;
    int np = (nthreads <= 0 || nthreads > P.n) ? P.n : nthreads;
    int64_t units = (n + align - 1) / align;
    if (np > units) np = (int)units;
    if (np <= 1 || pthread_mutex_trylock(&run_lock) != 0) { if (n > 0) fn(arg, 0, n); return; }
    finish_async();
    if (P.n <= 1) { pthread_mutex_unlock(&run_lock); if (n > 0) fn(arg, 0, n); return; }
    P.fn = fn; P.arg = arg; P.total = n; P.align = align; P.nparts = np;
    /* fewer chunks than participants would leave threads idle (a 0.6 MB product in 256 KiB chunks
     * is 3 chunks for 16 threads): then one chunk each, as even as the units allow */
    if (chunk > 0 && chunk < units && (units + chunk - 1) / chunk < np) chunk = (units + np - 1) / np;
    P.chunk = chunk > 0 && chunk < units ? chunk : 0;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    atomic_store(&P.pending, (uint32_t)(P.n - 1));
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (atomic_load(&P.sleepers) > 0) fwake(&P.gen);
    run_share(0);
    wait_pending();
    pthread_mutex_unlock(&run_lock);
}

/* Blocking side of the SPSC rings: a "bell" (an eventcount on a futex word) that lets a consumer
 * fed by several rings sleep when all of them are empty, and a producer wake it after a push.
 *
 * ring.h stays lock-free and non-blocking; this header adds only the sleep/wake protocol.
 * Correctness (no lost wake-up) is the usual Dekker pairing with seq_cst fences:
 *   producer: publish tail (release) ; fence ; load sleepers   -> if > 0: bump epoch, FUTEX_WAKE
 *   consumer: epoch snapshot ; sleepers++ ; fence ; re-check rings -> if still empty: FUTEX_WAIT(epoch)
 * Either the producer sees the sleeper and bumps the epoch (so the wait returns at once), or the
 * consumer's re-check sees the message. The wait also has a timeout, so a stop flag is polled.
 * On 2 shared cores pure spinning starves the peer thread, so the consumer spins only `spin_ns`.
 */
#ifndef MQ_RING_WAIT_H
#define MQ_RING_WAIT_H

#include <limits.h>
#include <time.h>

#include "ring.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

typedef struct {
    _Alignas(MQ_CACHE_LINE) _Atomic uint32_t epoch;   /* futex word: bumped by a notify that saw sleepers */
    _Atomic uint32_t sleepers;                        /* consumers inside the sleep path */
    uint64_t wakes;                                   /* futex wakes issued (statistics, producer side) */
    char _pad[MQ_CACHE_LINE - 2 * sizeof(uint32_t) - sizeof(uint64_t)];
} mq_bell;

_Static_assert(sizeof(mq_bell) == MQ_CACHE_LINE, "mq_bell is one cache line");

static inline int64_t mq_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void mq_bell_init(mq_bell *b) {
    memset(b, 0, sizeof(*b));
    atomic_store_explicit(&b->epoch, 0, memory_order_relaxed);
    atomic_store_explicit(&b->sleepers, 0, memory_order_relaxed);
}

/* Producer side, after a successful mq_ring_push onto a ring whose consumer waits on `b`. */
static inline void mq_bell_notify(mq_bell *b) {
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&b->sleepers, memory_order_relaxed) != 0) {
        atomic_fetch_add_explicit(&b->epoch, 1, memory_order_seq_cst);
        b->wakes++;
#if defined(__linux__)
        syscall(SYS_futex, (uint32_t *)&b->epoch, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

static inline int mq_pop_first(mq_ring *const *rs, int n, mq_msg *m) {
    for (int i = 0; i < n; i++)
        if (mq_ring_pop(rs[i], m)) return i;
    return -1;
}

/* Consumer side: pop from the first non-empty ring of rs[0..n) (all consumed by this thread and all
 * notifying `b`). Spins up to spin_ns, then sleeps on the bell; -1 after timeout_ns with nothing. */
static inline int mq_ring_pop_any_wait(mq_ring *const *rs, int n, mq_bell *b, mq_msg *m,
                                       int64_t spin_ns, int64_t timeout_ns) {
    int i = mq_pop_first(rs, n, m);
    if (i >= 0) return i;
    const int64_t t0 = mq_now_ns();
    for (unsigned it = 1;; it++) {
        if ((i = mq_pop_first(rs, n, m)) >= 0) return i;
        if ((it & 63) != 0) { mq_cpu_relax(); continue; }
        int64_t el = mq_now_ns() - t0;
        if (el >= timeout_ns) return -1;
        if (el < spin_ns) continue;
        uint32_t e = atomic_load_explicit(&b->epoch, memory_order_acquire);
        atomic_fetch_add_explicit(&b->sleepers, 1, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        i = mq_pop_first(rs, n, m);
        if (i < 0) {
            int64_t left = timeout_ns - el;
            if (left > 20000000LL) left = 20000000LL;   /* re-check at least every 20 ms */
#if defined(__linux__)
            struct timespec ts = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
            syscall(SYS_futex, (uint32_t *)&b->epoch, FUTEX_WAIT_PRIVATE, e, &ts, NULL, 0);
#else
            (void)e;
            sched_yield();
#endif
        }
        atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_seq_cst);
        if (i >= 0) return i;
    }
}

#endif

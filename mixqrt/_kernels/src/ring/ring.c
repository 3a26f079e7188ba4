/* Native stress harness for the SPSC ring: two pthreads, no GIL, every message checked. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include "ring.h"

/* Spin briefly with pause, then yield: on an oversubscribed box (2 cores, other work) a pure spin
 * would burn the peer's time slice. */
#define MQ_SPINS_BEFORE_YIELD 64

typedef struct {
    mq_ring *ring;
    uint64_t n, skip_seq;
    mq_ring_stress_result *res;
} stress_arg;

static inline void derive(uint64_t seq, mq_msg *m) {
    m->seq = seq;
    m->op = (uint32_t)(seq * 2654435761u);
    m->aux = (uint32_t)(seq >> 7);
    m->ptr = seq * 64u + 0x1000u;
    m->len = seq ^ 0x5bd1e995u;
}

static void *producer(void *p) {
    stress_arg *a = (stress_arg *)p;
    uint64_t full = 0, sent = 0;
    mq_msg m;
    for (uint64_t s = 0; s < a->n; s++) {
        if (s == a->skip_seq) continue;
        derive(s, &m);
        unsigned spins = 0;
        while (!mq_ring_push(a->ring, &m)) {
            full++;
            if (++spins < MQ_SPINS_BEFORE_YIELD) mq_cpu_relax();
            else { spins = 0; sched_yield(); }
        }
        sent++;
    }
    /* end marker: op 0xFFFFFFFF, not counted as a message */
    m.seq = UINT64_MAX; m.op = 0xFFFFFFFFu; m.aux = 0; m.ptr = 0; m.len = 0;
    unsigned spins = 0;
    while (!mq_ring_push(a->ring, &m)) {
        if (++spins < MQ_SPINS_BEFORE_YIELD) mq_cpu_relax();
        else { spins = 0; sched_yield(); }
    }
    a->res->sent = sent;
    a->res->push_full = full;
    return NULL;
}

static void *consumer(void *p) {
    stress_arg *a = (stress_arg *)p;
    uint64_t expect = 0, got = 0, seq_err = 0, field_err = 0, empty = 0;
    mq_msg m, want;
    for (;;) {
        unsigned spins = 0;
        while (!mq_ring_pop(a->ring, &m)) {
            empty++;
            if (++spins < MQ_SPINS_BEFORE_YIELD) mq_cpu_relax();
            else { spins = 0; sched_yield(); }
        }
        if (m.op == 0xFFFFFFFFu && m.seq == UINT64_MAX) break;
        got++;
        if (m.seq != expect) {
            seq_err++;
            expect = m.seq;  /* resynchronise so one loss counts once */
        }
        derive(m.seq, &want);
        if (memcmp(&m, &want, sizeof m) != 0) field_err++;
        expect++;
    }
    if (expect != a->n) seq_err++;  /* trailing messages lost */
    a->res->received = got;
    a->res->seq_errors = seq_err;
    a->res->field_errors = field_err;
    a->res->pop_empty = empty;
    return NULL;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void mq_ring_stress(uint64_t capacity, uint64_t n, uint64_t skip_seq, mq_ring_stress_result *out) {
    memset(out, 0, sizeof *out);
    mq_ring *ring = NULL;
    if (posix_memalign((void **)&ring, MQ_CACHE_LINE, sizeof(mq_ring)) != 0) { out->status = -2; return; }
    int rc = mq_ring_init(ring, capacity);
    if (rc != 0) { free(ring); out->status = rc; return; }
    stress_arg a = {ring, n, skip_seq, out};
    pthread_t tp, tc;
    uint64_t t0 = now_ns();
    if (pthread_create(&tc, NULL, consumer, &a) != 0) { out->status = -3; goto done; }
    if (pthread_create(&tp, NULL, producer, &a) != 0) {
        /* consumer waits for an end marker: push it ourselves (we are the only producer now) */
        mq_msg end = {UINT64_MAX, 0xFFFFFFFFu, 0, 0, 0};
        while (!mq_ring_push(ring, &end)) sched_yield();
        pthread_join(tc, NULL);
        out->status = -3;
        goto done;
    }
    pthread_join(tp, NULL);
    pthread_join(tc, NULL);
    out->elapsed_ns = now_ns() - t0;
done:
    mq_ring_destroy(ring);
    free(ring);
}

/* Single-producer / single-consumer lock-free ring of small fixed-size messages.
 *
 * Header-only (static inline) so any kernel extension can include it and share a ring with another
 * (e.g. the scheduler's worker threads). Exactly one thread may push and exactly one may pop.
 *
 * Indices run freely (uint64, never wrap in practice) and are masked on access, so "full" is
 * tail - head == capacity and no slot is wasted. The producer owns `tail`, the consumer owns `head`;
 * each lives on its own cache line next to the owner's cached copy of the other index, so in steady
 * state a push or pop touches the shared line only when the cached copy says full/empty.
 * Messages carry offsets/pointers into weight or activation buffers, never the data itself.
 */
#ifndef MQ_RING_H
#define MQ_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MQ_CACHE_LINE 64

typedef struct {
    uint64_t seq;   /* sender's sequence number */
    uint32_t op;    /* opcode (scheduler-defined) */
    uint32_t aux;   /* small argument: layer, row-block index, ... */
    uint64_t ptr;   /* pointer or byte offset of the operand (no copies of activations) */
    uint64_t len;   /* length in bytes or elements */
} mq_msg;           /* 32 bytes: two messages per cache line */

typedef struct {
    /* producer's line */
    _Alignas(MQ_CACHE_LINE) _Atomic uint64_t tail;
    uint64_t head_cache;  /* producer's last view of head */
    char _pad0[MQ_CACHE_LINE - 2 * sizeof(uint64_t)];
    /* consumer's line */
    _Alignas(MQ_CACHE_LINE) _Atomic uint64_t head;
    uint64_t tail_cache;  /* consumer's last view of tail */
    char _pad1[MQ_CACHE_LINE - 2 * sizeof(uint64_t)];
    /* read-only after init */
    _Alignas(MQ_CACHE_LINE) uint64_t capacity;
    uint64_t mask;
    mq_msg *buf;
    char _pad2[MQ_CACHE_LINE - 2 * sizeof(uint64_t) - sizeof(mq_msg *)];
} mq_ring;

_Static_assert(sizeof(mq_msg) == 32, "mq_msg must stay 32 bytes");
_Static_assert(offsetof(mq_ring, head) == MQ_CACHE_LINE, "head must start its own cache line");
_Static_assert(offsetof(mq_ring, capacity) == 2 * MQ_CACHE_LINE, "capacity line");

static inline void mq_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* 0 on success, -1 if capacity is not a power of two >= 2, -2 if out of memory. */
static inline int mq_ring_init(mq_ring *r, uint64_t capacity) {
    memset(r, 0, sizeof(*r));
    if (capacity < 2 || (capacity & (capacity - 1)) != 0 || capacity > ((uint64_t)1 << 40)) return -1;
    void *p = NULL;
    if (posix_memalign(&p, MQ_CACHE_LINE, (size_t)capacity * sizeof(mq_msg)) != 0) return -2;
    memset(p, 0, (size_t)capacity * sizeof(mq_msg));
    r->buf = (mq_msg *)p;
    r->capacity = capacity;
    r->mask = capacity - 1;
    atomic_store_explicit(&r->head, 0, memory_order_relaxed);
    atomic_store_explicit(&r->tail, 0, memory_order_relaxed);
    return 0;
}

static inline void mq_ring_destroy(mq_ring *r) {
    free(r->buf);
    r->buf = NULL;
    r->capacity = r->mask = 0;
}

/* Producer only. 1 if pushed, 0 if full. */
static inline int mq_ring_push(mq_ring *r, const mq_msg *m) {
    uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
    if (t - r->head_cache >= r->capacity) {
        r->head_cache = atomic_load_explicit(&r->head, memory_order_acquire);
        if (t - r->head_cache >= r->capacity) return 0;
    }
    r->buf[t & r->mask] = *m;
    atomic_store_explicit(&r->tail, t + 1, memory_order_release);
    return 1;
}

/* Consumer only. 1 if popped into *m, 0 if empty. */
static inline int mq_ring_pop(mq_ring *r, mq_msg *m) {
    uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (h == r->tail_cache) {
        r->tail_cache = atomic_load_explicit(&r->tail, memory_order_acquire);
        if (h == r->tail_cache) return 0;
    }
    *m = r->buf[h & r->mask];
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    return 1;
}

/* Approximate fill level; exact only when called by the producer or consumer with the other idle. */
static inline uint64_t mq_ring_size(mq_ring *r) {
    uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
    uint64_t t = atomic_load_explicit(&r->tail, memory_order_acquire);
    return t - h;
}

/* Result of the native two-thread stress run (ring.c). */
typedef struct {
    uint64_t sent, received;
    uint64_t seq_errors;     /* message arrived out of order, duplicated or lost */
    uint64_t field_errors;   /* op/aux/ptr/len do not match what the producer derived from seq */
    uint64_t push_full;      /* times the producer found the ring full */
    uint64_t pop_empty;      /* times the consumer found it empty */
    uint64_t elapsed_ns;
    int status;              /* 0 ok, <0 setup error (bad capacity, no memory, thread spawn) */
} mq_ring_stress_result;

/* Spawns a producer and a consumer pthread that pass n messages through a ring of `capacity`.
 * skip_seq != UINT64_MAX makes the producer drop that message (to prove the checker sees losses). */
void mq_ring_stress(uint64_t capacity, uint64_t n, uint64_t skip_seq, mq_ring_stress_result *out);

#endif

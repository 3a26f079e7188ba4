"""SPSC lock-free ring buffers (src/ring/ring.h): Python push/pop for tests, native stress run.

The rings the scheduler uses are driven from C (include ``src/ring/ring.h``); this module is the
Python face: ``Ring`` for single-threaded or one-producer/one-consumer Python use, and ``stress``,
which runs a producer and a consumer pthread in C with the GIL released.
"""
from libc.stdint cimport uint32_t, uint64_t, uintptr_t, UINT64_MAX
from libc.stdlib cimport free
from posix.stdlib cimport posix_memalign

from mixqrt._kernels.cpu cimport mq_isa_get, mq_isa_set
from mixqrt.errors import KernelError

cdef extern from "ring.h" nogil:
    ctypedef struct mq_msg:
        uint64_t seq
        uint32_t op
        uint32_t aux
        uint64_t ptr
        uint64_t len
    ctypedef struct mq_ring:
        uint64_t capacity
    ctypedef struct mq_ring_stress_result:
        uint64_t sent, received, seq_errors, field_errors, push_full, pop_empty, elapsed_ns
        int status
    int mq_ring_init(mq_ring *r, uint64_t capacity)
    void mq_ring_destroy(mq_ring *r)
    int mq_ring_push(mq_ring *r, const mq_msg *m)
    int mq_ring_pop(mq_ring *r, mq_msg *m)
    uint64_t mq_ring_size(mq_ring *r)
    void mq_ring_stress(uint64_t capacity, uint64_t n, uint64_t skip_seq, mq_ring_stress_result *out)

MESSAGE_BYTES = sizeof(mq_msg)


cdef _check_capacity(capacity):
    if not isinstance(capacity, int) or capacity < 2 or capacity & (capacity - 1) or capacity > (1 << 40):
        raise KernelError(f"ring capacity must be a power of two in [2, 2**40], got {capacity!r}")


cdef class Ring:
    """A ring of ``capacity`` (power of two) messages ``(seq, op, aux, ptr, len)``.

    One producer thread calls ``push``, one consumer thread calls ``pop``. Both are non-blocking.
    """
    cdef mq_ring *r

    def __cinit__(self, capacity=1024):
        _check_capacity(capacity)
        cdef void *p = NULL
        if posix_memalign(&p, 64, sizeof(mq_ring)) != 0:
            raise MemoryError("ring header")
        self.r = <mq_ring *>p
        if mq_ring_init(self.r, capacity) != 0:
            free(p)
            self.r = NULL
            raise MemoryError(f"ring of {capacity} messages")

    def __dealloc__(self):
        if self.r != NULL:
            mq_ring_destroy(self.r)
            free(self.r)
            self.r = NULL

    @property
    def capacity(self):
        return self.r.capacity

    @property
    def address(self):
        """Address of the ``mq_ring`` header, for C code in another extension (keep this object alive)."""
        return <uintptr_t>self.r

    def __len__(self):
        return mq_ring_size(self.r)

    def push(self, uint64_t seq, uint32_t op=0, uint32_t aux=0, uint64_t ptr=0, uint64_t len=0):
        """Append one message; False if the ring is full (nothing written)."""
        cdef mq_msg m
        m.seq = seq
        m.op = op
        m.aux = aux
        m.ptr = ptr
        m.len = len
        return mq_ring_push(self.r, &m) == 1

    def pop(self):
        """Oldest message as ``(seq, op, aux, ptr, len)``, or None if the ring is empty."""
        cdef mq_msg m
        if mq_ring_pop(self.r, &m) == 0:
            return None
        return (m.seq, m.op, m.aux, m.ptr, m.len)


def stress(uint64_t n_messages=2_000_000, capacity=1024, skip_seq=None):
    """Pass ``n_messages`` through a fresh ring between two native threads (GIL released).

    Every message is checked on arrival: its sequence number must be the next one and its other
    fields must match what the producer derived from it. Returns a dict of counts and timing;
    ``skip_seq`` makes the producer drop one message (a self-test of the checker).
    """
    _check_capacity(capacity)
    cdef uint64_t cap = capacity
    cdef uint64_t skip = UINT64_MAX if skip_seq is None else <uint64_t>skip_seq
    cdef mq_ring_stress_result res
    with nogil:
        mq_ring_stress(cap, n_messages, skip, &res)
    if res.status == -2:
        raise MemoryError(f"ring of {capacity} messages")
    if res.status != 0:
        raise KernelError(f"ring stress could not start its threads (status {res.status})")
    secs = res.elapsed_ns / 1e9
    return {
        "sent": res.sent, "received": res.received, "seq_errors": res.seq_errors,
        "field_errors": res.field_errors, "push_full": res.push_full, "pop_empty": res.pop_empty,
        "seconds": secs, "messages_per_s": (res.received / secs) if secs > 0 else float("inf"),
    }


def get_isa():
    return mq_isa_get()


def set_isa(int isa):
    return mq_isa_set(isa)

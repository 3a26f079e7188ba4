"""SPSC lock-free ring buffers (src/ring/ring.h): Python push/pop for tests, native stress run.

The rings the scheduler uses are driven from C (include ``src/ring/ring.h``); this module is the
Python face: ``Ring`` for single-threaded or one-producer/one-consumer Python use, and ``stress``,
which runs a producer and a consumer pthread in C with the GIL released.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t, UINT64_MAX
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

cdef extern from "ring_wait.h" nogil:
    ctypedef struct mq_bell:
        uint64_t wakes
    void mq_bell_init(mq_bell *b)
    void mq_bell_notify(mq_bell *b)
    int mq_ring_pop_any_wait(mq_ring **rs, int n, mq_bell *b, mq_msg *m, int64_t spin_ns, int64_t timeout_ns)
    uint64_t mq_ring_pushed "mq_ring_pushed_"(mq_ring *r)
    uint64_t mq_ring_popped "mq_ring_popped_"(mq_ring *r)

cdef extern from *:
    """
    static inline uint64_t mq_ring_pushed_(mq_ring *r) { return atomic_load_explicit(&r->tail, memory_order_acquire); }
    static inline uint64_t mq_ring_popped_(mq_ring *r) { return atomic_load_explicit(&r->head, memory_order_acquire); }
    """

cdef enum:
    MAX_WAIT_RINGS = 8

MESSAGE_BYTES = sizeof(mq_msg)


cdef _check_capacity(capacity):
    if not isinstance(capacity, int) or capacity < 2 or capacity & (capacity - 1) or capacity > (1 << 40):
        raise KernelError(f"ring capacity must be a power of two in [2, 2**40], got {capacity!r}")


cdef class Bell:
    """Sleep/wake point of one consumer thread fed by one or more rings (``Ring(..., bell=b)``).

    ``pop_any(rings, bell)`` spins briefly, then sleeps on a futex with the GIL released; a push onto
    any ring carrying this bell wakes it. Only the consumer thread may wait on a bell.
    """
    cdef mq_bell *b

    def __cinit__(self):
        cdef void *p = NULL
        if posix_memalign(&p, 64, sizeof(mq_bell)) != 0:
            raise MemoryError("bell")
        self.b = <mq_bell *>p
        mq_bell_init(self.b)

    def __dealloc__(self):
        free(self.b)
        self.b = NULL

    @property
    def wakes(self):
        """Futex wake-ups issued by producers (how often the consumer had gone to sleep)."""
        return self.b.wakes


cdef class Ring:
    """A ring of ``capacity`` (power of two) messages ``(seq, op, aux, ptr, len)``.

    One producer thread calls ``push``, one consumer thread calls ``pop``. Both are non-blocking.
    With ``bell=``, each push also wakes a consumer sleeping in ``pop_any`` / ``pop_wait``.
    """
    cdef mq_ring *r
    cdef readonly Bell bell

    def __cinit__(self, capacity=1024, Bell bell=None):
        self.bell = bell
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
        if mq_ring_push(self.r, &m) != 1:
            return False
        if self.bell is not None:
            mq_bell_notify(self.bell.b)
        return True

    @property
    def pushed(self):
        """Messages pushed since creation (the producer's free-running index)."""
        return mq_ring_pushed(self.r)

    @property
    def popped(self):
        """Messages popped since creation (the consumer's free-running index)."""
        return mq_ring_popped(self.r)

    def pop_wait(self, double timeout=1.0, double spin_us=20.0):
        """Like ``pop`` but blocks (GIL released) up to ``timeout`` seconds; needs a bell."""
        got = pop_any((self,), self.bell, timeout, spin_us)
        return None if got is None else got[1]

    def pop(self):
        """Oldest message as ``(seq, op, aux, ptr, len)``, or None if the ring is empty."""
        cdef mq_msg m
        if mq_ring_pop(self.r, &m) == 0:
            return None
        return (m.seq, m.op, m.aux, m.ptr, m.len)


def pop_any(rings, Bell bell, double timeout=1.0, double spin_us=20.0):
    """Oldest message of the first non-empty ring, as ``(ring_index, (seq, op, aux, ptr, len))``.

    Blocks with the GIL released: spins ``spin_us`` microseconds, then sleeps on ``bell`` (every ring
    must have been created with this bell and be consumed only by the calling thread). None after
    ``timeout`` seconds with every ring empty.
    """
    if bell is None:
        raise KernelError("pop_any needs the consumer's Bell (create the rings with bell=...)")
    cdef int n = len(rings), i, got
    if n < 1 or n > MAX_WAIT_RINGS:
        raise KernelError(f"pop_any: between 1 and {MAX_WAIT_RINGS} rings, got {n}")
    cdef mq_ring *rs[MAX_WAIT_RINGS]
    cdef Ring rg
    for i in range(n):
        rg = rings[i]
        if rg.bell is not bell:
            raise KernelError(f"pop_any: ring {i} does not ring this bell")
        rs[i] = rg.r
    cdef mq_msg m
    cdef int64_t spin = <int64_t>(spin_us * 1e3), tmo = <int64_t>(max(timeout, 0.0) * 1e9)
    with nogil:
        got = mq_ring_pop_any_wait(rs, n, bell.b, &m, spin, tmo)
    if got < 0:
        return None
    return got, (m.seq, m.op, m.aux, m.ptr, m.len)


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

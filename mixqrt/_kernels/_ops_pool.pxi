# The native thread pool, gap prefetch and the bandwidth probe. Included by _ops.pyx (one extension; module-level names are shared).

def pool_start(int n, cpus=()):
    """(Re)start the pool with n threads (caller included), pinning thread i to cpus[i % len]."""
    cdef int nc = len(cpus), i, r
    cdef int *c = <int*>malloc(sizeof(int) * (nc + 1))
    for i in range(nc):
        c[i] = int(cpus[i])
    with nogil:
        r = mq_pool_start(n, c, nc)
    free(c)
    return r


def pool_size():
    return mq_pool_size()


def set_hot(bint hot):
    """Hot mode: idle pool workers spin instead of sleeping (no futex wake-up per job)."""
    mq_pool_set_hot(hot)


def get_hot():
    return bool(mq_pool_get_hot())


_pf_keep = None      # the array a gap prefetch reads: referenced until the next one (an mmap stays open)


def prefetch(cnp.ndarray raw, size_t nbytes, int parts=0):
    """Gap prefetch: the pool's workers read the first `nbytes` of `raw` (uint8, contiguous) in the
    background, the starts of its `parts` equal slices first (0: one per pool thread, the split of
    a decode product); the next pool job aborts it. Returns at once. A no-op with one thread."""
    global _pf_keep
    if parts <= 0:
        parts = mq_pool_size()
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raise ValueError("prefetch: raw must be a contiguous 1-D uint8 array")
    if nbytes > <size_t>raw.shape[0]:
        nbytes = <size_t>raw.shape[0]
    # wait, swap the reference and post with the GIL held (the workers never take it; the wait is an
    # abort within 4 KiB): another Python thread cannot post in between and have its array let go
    # while the workers read it
    mq_pool_prefetch_wait()
    _pf_keep = raw
    mq_pool_prefetch(<const uint8_t*>_ptr(raw), nbytes, parts)


def prefetch_wait():
    """Stop a running gap prefetch, wait for it and drop its array (a closed model's mapping can go)."""
    global _pf_keep
    mq_pool_prefetch_wait()
    _pf_keep = None


def pool_stop():
    with nogil:
        mq_pool_stop()


def read_bandwidth(size_t nbytes=1 << 28, int threads=1, int reps=3):
    """Read bandwidth in bytes/s: the best of every probe pattern this CPU runs (src/ops/bw.c)."""
    cdef double r
    with nogil:
        r = mq_read_bandwidth(nbytes, threads, reps)
    return r


def bw_set_cpus(cpus):
    """Pin the probe's thread i to cpus[i % len(cpus)] (at most 64 kept); empty: the affinity mask
    in CPU order."""
    cdef int buf[64]
    cdef int n = 0
    for c in list(cpus)[:64]:
        buf[n] = int(c)
        n += 1
    return mq_bw_set_cpus(buf, n)


def bw_patterns():
    """Names of the probe's read patterns this CPU can run, in probe order."""
    return [mq_bw_pattern_name(i).decode() for i in range(mq_bw_npatterns()) if mq_bw_pattern_available(i)]


def read_bandwidth_all(size_t nbytes=1 << 28, int threads=1, int reps=3):
    """{pattern: bytes/s} for every probe pattern this CPU runs, all on one buffer."""
    cdef int n = mq_bw_npatterns(), i
    cdef double *out = <double*>malloc(sizeof(double) * n)
    if out == NULL:
        raise MemoryError()
    with nogil:
        mq_read_bandwidth_all(nbytes, threads, reps, out)
    r = {mq_bw_pattern_name(i).decode(): out[i] for i in range(n) if mq_bw_pattern_available(i)}
    free(out)
    return r


def read_bandwidth_pattern(str name, size_t nbytes=1 << 28, int threads=1, int reps=3):
    """Read bandwidth in bytes/s of one probe pattern (see bw_patterns)."""
    cdef int i, idx = -1
    cdef double r
    for i in range(mq_bw_npatterns()):
        if mq_bw_pattern_name(i).decode() == name and mq_bw_pattern_available(i):
            idx = i
    if idx < 0:
        raise ValueError(f"unknown or unavailable bandwidth pattern {name!r}; have {bw_patterns()}")
    with nogil:
        r = mq_read_bandwidth_pattern(nbytes, threads, reps, idx)
    return r

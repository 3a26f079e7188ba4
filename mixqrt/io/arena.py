"""Arena: one read-only mmap of a model file, handing out zero-copy uint8 views.

The .mxq reader (mixqrt/io/mxq.py) decides *where* tensors are; the arena only maps the file,
slices it and passes madvise hints (huge pages, read-ahead of one layer's span for the prefetcher).
Nothing here reads tensor bytes, so mapping a file adds nothing to RSS until a kernel touches a page.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from mixqrt.errors import FormatError

ALIGN = 64                      # every tensor starts on a cache line (AVX-512 loads, no splits)
PAGE = 4096                     # default span alignment written into .mxq files
SYS_PAGE = mmap.PAGESIZE        # what madvise() needs; may exceed PAGE on some machines

_MADV = {name: getattr(mmap, "MADV_" + name.upper(), None)
         for name in ("willneed", "dontneed", "hugepage", "sequential", "random", "normal")}


def align_up(x: int, a: int) -> int:
    """Smallest multiple of `a` (a power of two) that is >= x."""
    return (x + a - 1) & ~(a - 1)


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def file_identity(st) -> tuple:
    """What tells a file's content changed, from an os.stat_result: the inode, its size, mtime and
    ctime. ctime matters: restoring an old mtime after rewriting a file (touch -r, utime) sets the
    ctime to now, and nothing but the kernel sets ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def drop_cached(fd: int) -> bool:
    """Drop a just-written file's pages from the page cache (POSIX_FADV_DONTNEED; call after fsync:
    dirty pages are not dropped). What write() leaves in the page cache is held in small folios,
    which a mapping can only map with 4 KiB page-table entries; read back through a
    MADV_HUGEPAGE mapping (Arena(hugepages=True), what mixqrt.load uses) the file comes in 2 MiB
    folios that the mapping maps whole: decode 1.05x at 2 threads and 1.13x at 1 on the 0.5B model
    (docs/runtime.md, "Weights in 2 MiB pages"). Best effort: False where the platform lacks it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


class Arena:
    """Read-only mmap of `path`.

    hugepages: madvise(MADV_HUGEPAGE) on the whole mapping. For a file mapping this only has an effect
        when the kernel has CONFIG_READ_ONLY_THP_FOR_FS and khugepaged collapses the range; it is a
        hint and never an error.
    willneed: madvise(MADV_WILLNEED) on the whole file: starts read-ahead into the page cache without
        faulting pages into this process (RSS grows only when a page is touched).
    copy: read the whole file into private anonymous memory instead of mapping it (what `mixqrt
        serve` does, docs/server.md "The served file"): nothing done to the file afterwards (a `cp`
        over it, a truncation) can change or fault the weights being served. Costs the file's size
        in RSS at once and one read of it; the copy is checked against the file's identity
        (inode, size, mtime, ctime) before and after the read, so a file changing while it is read
        is a FormatError, not a torn copy.
    """

    def __init__(self, path, *, hugepages: bool = False, willneed: bool = False, copy: bool = False):
        self.path = os.fspath(path)
        self._mm = None
        self.copied = bool(copy)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(self._fd)
            self.size = st.st_size
            if self.size == 0:
                raise FormatError(f"{self.path}: empty file")
            if copy:
                self._mm = self._read_copy(st, hugepages)
            else:
                self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            if len(self._mm) != self.size:              # file changed under us between fstat and mmap
                raise FormatError(f"{self.path}: file size changed while mapping")
        except BaseException:
            self.close()
            raise
        if hugepages:
            self.advise("hugepage")
        if willneed:
            self.advise("willneed")

    def _read_copy(self, st, hugepages: bool):
        mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hugepages and _MADV["hugepage"] is not None and hasattr(mm, "madvise"):
            try:
                mm.madvise(_MADV["hugepage"])       # anonymous memory does get 2 MiB pages (THP)
            except OSError:
                pass
        view, off, chunk = memoryview(mm), 0, 64 << 20
        try:
            while off < self.size:
                n = os.preadv(self._fd, [view[off:off + chunk]], off)
                if n <= 0:
                    raise FormatError(f"{self.path}: file truncated while being read ({off} of {self.size} bytes)")
                off += n
        finally:
            view.release()
        if file_identity(os.fstat(self._fd)) != file_identity(st):
            mm.close()
            raise FormatError(f"{self.path}: the file changed while being read into memory; load it again")
        return mm

    # ------------------------------------------------------------------ access
    def stat(self) -> os.stat_result:
        """fstat of the mapped file (the inode this arena maps, even after the path is replaced)."""
        return os.fstat(self._fd)

    @property
    def closed(self) -> bool:
        return self._mm is None or self._mm.closed

    def _check(self, offset: int, nbytes: int) -> None:
        if self.closed:
            raise FormatError(f"{self.path}: arena is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise FormatError(f"{self.path}: range [{offset}, {offset + nbytes}) outside the file of {self.size} bytes")

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Zero-copy 1-D uint8 view of [offset, offset + nbytes); read-only."""
        self._check(offset, nbytes)
        v = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=offset)
        v.flags.writeable = False                   # (a copy's memory is writable; its views are not)
        return v

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of [offset, offset + nbytes), by pread() so that the pages never enter this process's
        RSS through the mapping (used for the prefix and the header only)."""
        self._check(offset, nbytes)
        out = os.pread(self._fd, nbytes, offset)
        if len(out) != nbytes:
            raise FormatError(f"{self.path}: short read at {offset} (file truncated while open?)")
        return out

    def advise(self, advice: str, offset: int = 0, nbytes: int | None = None) -> bool:
        """madvise() a byte range (rounded out to system pages). Returns False when the platform lacks
        the advice or the kernel refuses it; hints never raise."""
        flag = _MADV.get(advice)
        if flag is None or self.closed or not hasattr(self._mm, "madvise"):
            return False
        if nbytes is None:
            nbytes = self.size - offset
        self._check(offset, nbytes)
        start = offset - offset % SYS_PAGE
        length = min(align_up(offset + nbytes, SYS_PAGE), align_up(self.size, SYS_PAGE)) - start
        if length <= 0:
            return True
        try:
            self._mm.madvise(flag, start, length)
        except (OSError, ValueError):
            return False
        return True

    def touch(self) -> None:
        """Fault every page of the mapping in (one byte read per page), as a full forward pass would."""
        if not self.closed:
            np.frombuffer(self._mm, dtype=np.uint8)[::SYS_PAGE].max()

    def huge_fraction(self) -> float | None:
        """The fraction of the file that this process maps with 2 MiB entries (FilePmdMapped in
        /proc/self/smaps over the file size), after the pages were touched; None where the kernel does
        not say. Low on a file whose page cache came from write() or a copy: see recache()."""
        if self.closed:
            return None
        start = np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data
        try:
            with open("/proc/self/smaps") as fh:
                inside = False
                for line in fh:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        lo, _, hi = head.partition("-")
                        inside = int(lo, 16) <= start < int(hi, 16)
                    elif inside and head == "FilePmdMapped:":
                        return min(1.0, int(line.split()[1]) * 1024 / self.size)
        except (OSError, ValueError):
            return None
        return None

    def recache(self) -> bool:
        """Read the file into the page cache again so that it comes in 2 MiB folios: unmap this
        process's pages of it (MADV_DONTNEED: the mapping stays valid, its pages fault back in), drop
        the cached pages that no other process maps (POSIX_FADV_DONTNEED), then advise huge pages
        and read-ahead. Costs one read of the file from storage; pages another process maps stay as
        they are. Returns False where a step is not available (nothing is then changed for the worse)."""
        if self.closed or self.copied or not self.advise("dontneed"):
            return False
        if not drop_cached(self._fd):
            return False
        self.advise("hugepage")
        self.advise("willneed")
        return True

    def prefetch(self, offset: int, nbytes: int) -> bool:
        """Read-ahead hint for one span (the prefetch thread calls this a layer ahead)."""
        return self.advise("willneed", offset, nbytes)

    def close(self) -> None:
        """Unmap now if no view is alive; otherwise the mapping goes when the last view is collected."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        mm, self._mm = self._mm, None
        if mm is not None and not mm.closed:
            try:
                mm.close()
            except BufferError:
                pass     # numpy views still export the buffer; the mmap object frees itself later

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

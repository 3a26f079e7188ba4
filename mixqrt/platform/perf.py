"""Hardware counters through perf_event_open (ctypes), for `bench --perf` and `doctor`.

Counts cache-misses and instructions of this process (user space only, all threads created after
opening inherit). Falls back to None with a reason when the kernel or the hypervisor refuses.
"""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
import sys



def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


_NR = {"x86_64": 298, "aarch64": 241}
PERF_TYPE_HARDWARE = 0
HW_INSTRUCTIONS = 1
HW_CACHE_MISSES = 3
HW_CYCLES = 0
_IOC_ENABLE, _IOC_DISABLE, _IOC_RESET = 0x2400, 0x2401, 0x2403


def cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs from /proc/stat's "cpu" line; None where unavailable.
    Steal is time a hypervisor ran something else while this guest wanted the CPU."""
    try:
        with open("/proc/stat") as fh:
            f = fh.readline().split()
    except OSError:
        return None
    if len(f) < 9 or f[0] != "cpu":
        return None
    vals = [int(v) for v in f[1:9]]          # user nice system idle iowait irq softirq steal
    return vals[7], sum(vals)


def steal_fraction(before, after) -> float | None:
    """The share of all CPUs' time stolen by the hypervisor between two cpu_jiffies() readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _attr(config: int) -> bytes:
    # struct perf_event_attr (size 128): type, size, config, sample_period, sample_type, read_format, flags...
    flags = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6)   # disabled, inherit, exclude_kernel, exclude_hv
    head = struct.pack("<IIQQQQQ", PERF_TYPE_HARDWARE, 128, config, 0, 0, 0, flags)
    return head + b"\0" * (128 - len(head))


class Counters:
    """with Counters() as c: ...;  c.values -> {"instructions": n, "cache_misses": n, "cycles": n}"""

    NAMES = {"instructions": HW_INSTRUCTIONS, "cache_misses": HW_CACHE_MISSES, "cycles": HW_CYCLES}

    def __init__(self):
        self.fds: dict[str, int] = {}
        self.values: dict[str, int] = {}
        self.error: str | None = None
        nr = _NR.get(platform.machine())
        if nr is None:
            self.error = f"perf_event_open not wired for {platform.machine()}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong)
        self._ioctl = libc.ioctl
        for name, cfg in self.NAMES.items():
            buf = ctypes.create_string_buffer(_attr(cfg), 128)
            fd = libc.syscall(nr, buf, 0, -1, -1, 0)
            if fd < 0:
                err = ctypes.get_errno()
                self.error = f"perf_event_open({name}) failed: {os.strerror(err)} (perf_event_paranoid, container or VM)"
                self.close()
                return
            self.fds[name] = fd

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.fds)

    def __enter__(self):
        for fd in self.fds.values():
            self._ioctl(fd, _IOC_RESET, 0)
            self._ioctl(fd, _IOC_ENABLE, 0)
        return self

    def __exit__(self, *exc):
        for name, fd in self.fds.items():
            self._ioctl(fd, _IOC_DISABLE, 0)
            self.values[name] = struct.unpack("<Q", os.read(fd, 8))[0]
        self.close()
        return False

    def close(self):
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}

    def miss_ratio(self) -> float | None:
        ins = self.values.get("instructions")
        return self.values.get("cache_misses", 0) / ins if ins else None

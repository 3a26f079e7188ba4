"""Public ops used by the model graph. Signatures are those of mixqrt.ops.ref (the numpy spec);
the C kernels of mixqrt._kernels._ops do the work, on a native thread pool (started on first use,
``set_num_threads`` / ``get_num_threads``; MIXQRT_NUM_THREADS overrides the default,
platform.topology.usable_cpus: the affinity set capped by the cgroup CPU quota). A thread can keep
its ops off the pool with ``local_threads(1)`` (the core-slicing scheduler's stage threads do).

Extras over the reference: ``out=`` on the hot ops, ``softmax(fast=...)`` and f16 KV caches in
``attention``.

One file per job, this package re-exporting their public names (``ops.matmul(...)``):

- ``pool``: the thread pool (thread count, ``local_threads``, ``hot``) and the compiled module;
- ``matmul``: weight argument packing, the GEMM tile cache, ``matmul``, ``embed``, the fused decode layer;
- ``attention``: ``attention``, ``attention_batch``, the window and BLAS paths and their constants;
- ``elementwise``: rmsnorm, rope, silu_mul, softmax, gelu, router_logits, hadamard;
- ``probes``: the memory bandwidth probes;
- ``ref``: the numpy reference (the spec the kernels are tested against).

``ops.matmul`` and ``ops.attention`` are the functions; the files of the same name are reached as
``from mixqrt.ops.attention import ...``. Module state (switches such as ``ops.FUSED_DECODE`` and
``ops.GAP_PREFETCH_BYTES``, the caches, ``ops._ops``) lives in the file that owns it: reading it
here reads that file's current value, and setting it here (a test's monkeypatch, a benchmark's A/B)
sets it there, so the code that reads it sees the change.
"""
from __future__ import annotations

import sys
import types

from mixqrt.ops import ref  # noqa: F401
from mixqrt.ops.attention import (  # noqa: F401
    _attention_blas, _attention_window, attention, attention_batch, kv_attention, kv_attention_batch,
)
from mixqrt.ops.elementwise import (  # noqa: F401
    _router_f32, gelu_tanh_mul, hadamard, rmsnorm, rope, rope_freqs, router_logits, silu_mul, softmax,
)
from mixqrt.ops.matmul import (  # noqa: F401
    _gemm_tiles, _q3p_levels, _rot, _TileCache, _weight_args, _weight_args_uncached, decode_layer, embed,
    gemm_cache_info, layer_weight, matmul, prefetch_wait, run_decode_layers, set_decode_chunk,
    set_decode_static_threads, set_gemm_cache,
)
from mixqrt.ops.pool import (  # noqa: F401
    _limit_blas, _parts, _start_pool, _threads, _worker_order, default_num_threads, get_num_threads, hot,
    is_hot, local_threads, set_num_threads,
)
from mixqrt.ops.probes import probe_bytes, read_bandwidth, read_bandwidth_patterns  # noqa: F401
from mixqrt.ops.ref import rope_cos_sin  # noqa: F401  (re-exported)

# the files that own the state, in lookup order
_PARTS = tuple(sys.modules[f"{__name__}.{m}"] for m in ("pool", "matmul", "elementwise", "attention", "probes"))


def _forwarded(name: str) -> property:
    """A property of the package reading `name` from the file that owns it and writing it to every
    file that holds it."""
    owners = tuple(m for m in _PARTS if name in m.__dict__)

    def get(self):
        return owners[0].__dict__[name]

    def put(self, value):
        for m in owners:
            setattr(m, name, value)
    return property(get, put)


class _Ops(types.ModuleType):
    """mixqrt.ops: a name the files hold but this package does not bind (a switch, a cache, ``_ops``)
    is a property reading the owner's current value; a write to any name goes to every file that
    holds it, so ``ops.X = v`` (a test's monkeypatch, a benchmark's A/B) acts as it did when the ops
    were one module."""

    def __setattr__(self, name, value):
        if not isinstance(getattr(type(self), name, None), property):
            for m in _PARTS:
                if name in m.__dict__:
                    setattr(m, name, value)
        super().__setattr__(name, value)


for _name in sorted({n for m in _PARTS for n in m.__dict__} - set(globals())):
    if not _name.startswith("__"):
        setattr(_Ops, _name, _forwarded(_name))
del _name
sys.modules[__name__].__class__ = _Ops

"""The architectures, one file each: what a family needs besides its graph, declared beside it.

Each `mixqrt/models/<name>.py` that defines a graph also declares its ``Arch`` and registers it once:

    ARCH = register(Arch("llama", "LlamaForCausalLM", native_decode=True, gguf_permuted_qk=True, ...))

and every place that used to branch on the architecture's name reads a field instead: the tensors a
checkpoint holds (spec.ModelSpec: biases, q/k norms, the norms around the FFN, experts), norm folding
(spec.norm_feeds), the GGUF reader (io/gguf.py: tensor names, metadata -> config, q/k permutation,
norms stored as 1 + w, RoPE factors), recipes (norm vectors kept in float), the tiny test model
(testing/tiny.py) and which graphs decode through the fused native layer. The base graph
(models/qwen2.py) reads ``Arch`` fields and names no subclass.

``get(name)`` finds an architecture by its HF model_type (or an alias); the registry fills itself on
first use by importing every module of mixqrt/models/ (each registers its own), so a new architecture
is one new file (docs/architecture.md, "Adding an architecture").
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import threading
from dataclasses import dataclass, field
from typing import Callable

from mixqrt.errors import ModelError

# modules of mixqrt/models/ that define no architecture
_INFRA = {"arch", "base", "spec", "moe", "__init__"}


@dataclass(frozen=True)
class Arch:
    """One architecture (an HF model_type) and what differs in it.

    qkv_bias: "always" (q/k/v biases, no o_proj bias, whatever config.attention_bias says: Qwen2) or
    "config" (config.attention_bias gives q/k/v and o biases, default False: Llama). qk_norm: an RMSNorm
    per head on q and k. ffn_norms: norms before and after the FFN (pre_feedforward_layernorm,
    post_feedforward_layernorm). moe: routed experts (models/moe.py). fold_norms: its norms may be folded
    into the weights they feed (calibration). float_norms: recipes keep its norm vectors in float.
    native_decode: one token per layer runs as one native call (ops.decode_layer computes its layer).
    norm_plus_one: its RMSNorms multiply by 1 + weight (llama.cpp's converter stores 1 + w).
    gguf_*: llama.cpp's spelling: general.architecture, layer tensor names beyond the shared ones
    (q/k norms and experts come with qk_norm and moe), q/k rows permuted by the converter,
    rope_freqs.weight understood, gguf_config(m, cfg) adding its config keys from the metadata
    (m: io.gguf's reader of "{architecture}.KEY" values). tiny: the tiny test model's config keys
    beyond the shared ones (testing/tiny.py), tiny_tokenizer its tokenizer style."""
    name: str
    hf_class: str
    module: str | None = None              # mixqrt.models.<module> (default: name), or a dotted module path
    aliases: tuple = ()
    qkv_bias: str = "config"
    qk_norm: bool = False
    ffn_norms: bool = False
    moe: bool = False
    fold_norms: bool = True
    float_norms: bool = False
    native_decode: bool = False
    gguf_name: str | None = None
    gguf_aliases: tuple = ()               # other general.architecture names read as this one
    gguf_names: dict = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    norm_plus_one: bool = False            # its norms multiply by 1 + weight (llama.cpp stores 1 + w)
    gguf_rope_freqs: bool = False
    gguf_config: Callable | None = None
    tiny: dict = field(default_factory=dict)
    tiny_tokenizer: str = "smollm"

    def biases(self, config: dict) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias) of a checkpoint with this config."""
        if self.qkv_bias == "always":
            return True, False
        b = bool(config.get("attention_bias", False))
        return b, b


_REGISTRY: dict[str, Arch] = {}
_ALIASES: dict[str, str] = {}
_LOCK = threading.RLock()
_LOADED = False


def register(arch: Arch) -> Arch:
    """Add an architecture (each models/<name>.py calls this once for its own; a test may add a toy one)."""
    with _LOCK:
        old = _REGISTRY.get(arch.name)
        if old is not None and old != arch:
            raise ModelError(f"architecture {arch.name!r} is registered twice")
        _REGISTRY[arch.name] = arch
        for a in arch.aliases:
            _ALIASES[a] = arch.name
    return arch


def unregister(name: str) -> None:
    """Undo register (tests)."""
    with _LOCK:
        arch = _REGISTRY.pop(name)
        for a in arch.aliases:
            _ALIASES.pop(a, None)


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        for m in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):
            if m.name not in _INFRA and not m.name.startswith("_"):
                importlib.import_module(f"mixqrt.models.{m.name}")
        _LOADED = True


def names() -> tuple[str, ...]:
    """Every architecture's name, in registration order."""
    _load()
    return tuple(_REGISTRY)


def find(name) -> Arch | None:
    """The architecture an HF model_type (or alias) names, or None."""
    if not isinstance(name, str):
        return None
    _load()
    return _REGISTRY.get(_ALIASES.get(name, name))


def get(name) -> Arch:
    """The architecture `name` names; ModelError listing the supported ones otherwise."""
    a = find(name)
    if a is None:
        raise ModelError(f"unknown architecture {str(name)[:40]!r}; supported: {', '.join(sorted(names()))}")
    return a


def by_hf_class(cls: str) -> Arch | None:
    _load()
    return next((a for a in _REGISTRY.values() if a.hf_class == cls), None)


def by_gguf_name(garch: str) -> Arch | None:
    _load()
    return next((a for a in _REGISTRY.values() if garch in (a.gguf_name, a.name, *a.gguf_aliases)), None)

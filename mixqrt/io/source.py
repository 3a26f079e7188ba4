"""The Source contract: one model checkpoint seen through Hugging Face's names and layouts.

Every reader (GGUF file, HF safetensors folder, hub snapshot) presents the same thing:

    src.config                 dict with HF config.json keys (hidden_size, num_hidden_layers, ...)
    src.arch                   "qwen2" | "llama"
    src.tensor_names()         HF names: model.layers.0.self_attn.q_proj.weight, ...
    src.tensor_info(name)      (shape tuple in HF order [out, in], source dtype str)
    src.get(name)              float32 ndarray, one tensor at a time (never the whole model)
    src.tokenizer              mixqrt.generation.tokenizer.Tokenizer
    src.generation_config      dict

Layout checks live here so both readers refuse the same broken checkpoints with the same words:
a tensor that disagrees with config.json, or a missing one, is a ModelError at open time (cheap:
only headers are read); NaN/Inf is found by .get (reading the data is the only way to see it).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mixqrt.errors import FormatError, ModelError
from mixqrt.models.config_limits import check_config_limits
from mixqrt.models import arch as archs
from mixqrt.models.spec import ModelSpec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")



class Source:
    """Base class: subclasses fill config/arch/tokenizer/generation_config and the tensor table."""

    path: Path
    config: dict
    arch: str
    generation_config: dict

    def __init__(self):
        self._tokenizer = None
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}   # HF name -> (HF shape, source dtype)

    # -- tensors ---------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._info)

    def tensor_info(self, name: str) -> tuple[tuple[int, ...], str]:
        try:
            return self._info[name]
        except KeyError:
            raise ModelError(f"{self.path}: no tensor named {name!r}") from None

    def _read(self, name: str) -> np.ndarray:
        """Subclass hook: the tensor as float32 in HF layout (a fresh array, not a view)."""
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        """One tensor as a float32 array in HF layout; FormatError if it holds NaN or Inf."""
        if name not in self:
            raise ModelError(f"{self.path}: no tensor named {name!r}")
        arr = self._read(name)
        if not np.isfinite(arr).all():
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            raise FormatError(f"{self.path}: tensor {name!r} holds {bad} NaN/Inf value(s)")
        return arr

    # an embedding model's settings (mixqrt.generation.embed.EmbeddingInfo.to_meta's shape), None for a plain LM
    embedding: dict | None = None

    def extra_tensor(self, name: str) -> np.ndarray:
        """A tensor outside the graph's contract that the .mxq carries as float32 (an embedding
        model's dense projections, named in ``embedding["dense"]``)."""
        raise ModelError(f"{self.path}: no tensor named {name!r}")

    # True where the format's own tie flag is authoritative (HF config.json's tie_word_embeddings:
    # the reader drops lm_head when tied), so a source holding both matrices is untied without
    # comparing them; GGUF has no such flag, and recipes.tie_source compares rows there.
    declares_tie: bool = False

    def rows(self, name: str, idx) -> np.ndarray:
        """Rows `idx` of a 2-D tensor as float32 [len(idx), cols] (readers that can, read only
        those rows; this fallback reads the tensor once and keeps the rows)."""
        return np.ascontiguousarray(self.get(name)[np.asarray(idx, dtype=np.int64)])

    def __contains__(self, name: str) -> bool:
        return name in self._info

    # -- lazily built pieces ---------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self):
        raise NotImplementedError

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"{type(self).__name__}({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.tensor_names())})"


# -- architecture and layout checks ----------------------------------------------------------

def arch_from_config(config: dict, where: str) -> str:
    """The architecture (mixqrt.models.arch) of an HF config: its model_type (or an alias), else a
    known `architectures` class; ModelError naming anything else."""
    mt = config.get("model_type")
    a = archs.find(mt)
    if a is not None:
        return a.name
    classes = config.get("architectures") or ()
    classes = [c for c in classes if isinstance(c, str)] if isinstance(classes, list) else []
    for cls in classes:
        a = archs.by_hf_class(cls)
        if a is not None:
            return a.name
    name = str(mt)[:40] if mt else ",".join(classes)[:80] or "(none given)"
    raise ModelError(f"{where}: unknown architecture {name} (supported: {', '.join(archs.names())})")


_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_config(config: dict, where: str, names: dict | None = None) -> None:
    """The config keys the graph needs must be present integers inside mixqrt.models.config_limits' bounds
    (`names`: HF key -> the file's own name for it, for the messages)."""
    names = names or {}
    for key in _REQUIRED_KEYS:
        v = config.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ModelError(f"{where}: config key {names.get(key, key)!r} must be a positive integer, "
                             f"got {str(v)[:40]!r}")
    check_config_limits(config, where, names)
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    if config["num_attention_heads"] % kv:
        raise ModelError(f"{where}: num_key_value_heads={kv!r} must divide "
                         f"num_attention_heads={config['num_attention_heads']}")


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def check_layer_count(config: dict, names, where) -> None:
    """The tensor table must hold exactly layers 0 .. num_hidden_layers-1: checked before
    anything is sized from the config, so a lying layer count costs nothing."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))}
    n = config["num_hidden_layers"]
    if layers != set(range(n)):
        have = f"layers 0..{max(layers)}" if layers == set(range(len(layers))) and layers else \
            f"{len(layers)} distinct layer indices"
        raise ModelError(f"{where}: config says {n} layers, the tensor table holds {have}")


def check_layout(src: Source) -> None:
    """ModelError for a missing tensor, one whose shape disagrees with the config, or one the graph
    has no place for (the rules are models/spec.py's). The layer count is checked against the
    tensor table first, so a lying config sizes nothing."""
    names = list(src.tensor_names())
    check_layer_count(src.config, names, src.path)
    ModelSpec(src.config, src.arch).check({n: src.tensor_info(n)[0] for n in names}, str(src.path))


# -- dispatch --------------------------------------------------------------------------------

def refuse_pickle(path: Path) -> None:
    raise FormatError(f"{path}: pickle checkpoints ({', '.join(PICKLE_SUFFIXES)}) are refused — loading "
                      "them can run arbitrary code. Convert to safetensors (e.g. transformers' "
                      "save_pretrained(..., safe_serialization=True)) or use a GGUF file")

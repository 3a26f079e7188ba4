"""Upper bounds on model hyperparameters, checked wherever a config is read (config.json, GGUF
metadata, an .mxq header) before anything is sized from it.

A hostile 400-byte file can claim 10^9 layers; without a bound every loop over layers (expected
tensor names, the KV cache, the graph) grows memory before the first real check. The bounds are
generous: about 8x past the largest open models (Llama-3.1-405B: 126 layers, hidden 16384,
vocab 128k; Gemma: vocab 256k; 1M-token contexts) so that no real checkpoint meets them.
"""
from __future__ import annotations

import math

from mixqrt.errors import ModelError

# The context a Pipeline or Engine allots by default when not told (the model's own, capped here):
# the KV cache of every slot is sized from it, so a 128k-context model does not reserve 128k.
DEFAULT_MAX_CONTEXT = 4096

# key -> (smallest, largest) accepted value
INT_LIMITS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 19),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
}
# key -> (exclusive lower bound, inclusive upper bound)
FLOAT_LIMITS = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e12),
}
ROPE_FACTOR_MAX = 1024.0


def _is_int(v) -> bool:
    import numpy as np
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v) -> bool:
    import numpy as np
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(float(v))


def check_int(name: str, v, lo: int, hi: int, where: str, err=ModelError) -> int:
    """v as an int in [lo, hi], else `err` naming the field (strings, floats and bools are refused)."""
    if not _is_int(v):
        raise err(f"{where}: {name} must be an integer, got {type(v).__name__} {str(v)[:40]!r}")
    if not lo <= v <= hi:
        raise err(f"{where}: {name}={int(v)} is outside [{lo}, {hi}]")
    return int(v)


def check_float(name: str, v, lo: float, hi: float, where: str, err=ModelError) -> float:
    """v as a finite float in (lo, hi], else `err` naming the field."""
    if not _is_num(v):
        raise err(f"{where}: {name} must be a finite number, got {type(v).__name__} {str(v)[:40]!r}")
    if not lo < float(v) <= hi:
        raise err(f"{where}: {name}={float(v)!r} is outside ({lo}, {hi}]")
    return float(v)


def check_config_limits(config: dict, where: str, names: dict | None = None, err=ModelError) -> None:
    """Every bounded key that is present (and not None) must be a number inside its bounds.

    `names` maps HF keys to the names the file uses (GGUF metadata keys), so the message names
    the field as the user will find it. Presence of required keys is the caller's business.
    """
    names = names or {}
    for key, (lo, hi) in INT_LIMITS.items():
        if config.get(key) is not None:
            check_int(names.get(key, key), config[key], lo, hi, where, err)
    for key, (lo, hi) in FLOAT_LIMITS.items():
        if config.get(key) is not None:
            check_float(names.get(key, key), config[key], lo, hi, where, err)
    rs = config.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise err(f"{where}: rope_scaling must be an object, got {type(rs).__name__}")
        if rs.get("factor") is not None:
            check_float("rope_scaling.factor", rs["factor"], 0.0, ROPE_FACTOR_MAX, where, err)
        if rs.get("original_max_position_embeddings") is not None:
            check_int("rope_scaling.original_max_position_embeddings", rs["original_max_position_embeddings"],
                      *INT_LIMITS["max_position_embeddings"], where, err)

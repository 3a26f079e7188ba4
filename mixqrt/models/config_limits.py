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

_BYTE_UNITS = {"": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1 << 20,
               "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30}


def parse_bytes(v: str) -> int:
    """A byte count on the command line: 1048576, 50MiB, 1.5GB (0 allowed); argparse's type error otherwise."""
    import argparse
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"must be a byte count like 1073741824, 512MiB or 1GB, got {v!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def context_window(model_context: int, asked=None) -> int:
    """The context a Pipeline or an Engine allots: `asked` (the model's own when not given), never
    more than the model's own (max_position_embeddings): the one cap, so the two cannot differ."""
    return min(int(asked) if asked else int(model_context), int(model_context))


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


# ============================================================================ every value of a config
MAX_CONFIG_STRING = 1 << 24         # characters of one string value (a chat template is ~10-50 K)
MAX_CONFIG_INT = 1 << 63            # |int| (int64: what GGUF stores and numpy sizes take)
MAX_CONFIG_ITEMS = 1 << 22          # values walked in one config (a GGUF vocabulary is ~260 K strings)


def check_values(obj, where: str, *, skip=(), err=None):
    """The one check of every value read from a model's configs (config.json, generation_config.json,
    tokenizer_config.json, GGUF metadata, an .mxq header) before any of it reaches a str, an int or
    a float: strings valid Unicode (no lone surrogate: writing one later was a raw
    UnicodeEncodeError) and at most MAX_CONFIG_STRING characters, ints within int64, floats finite,
    at most MAX_CONFIG_ITEMS values. Raises `err` (FormatError) naming the field as a dotted path
    (`generation_config.json: top_p`); `skip`: top-level keys not walked (a GGUF vocabulary keeps
    raw bytes as surrogate escapes on purpose). Returns obj."""
    import numpy as np

    from mixqrt.errors import FormatError
    err = err or FormatError
    todo = [(k, v) for k, v in obj.items() if k not in skip] if isinstance(obj, dict) else [("", obj)]
    for k, _ in todo:
        if isinstance(k, str) and k:
            _check_text(k, k, where, err, "key")
    seen = 0
    while todo:
        path, v = todo.pop()
        seen += 1
        if seen > MAX_CONFIG_ITEMS:
            raise err(f"{where}: more than {MAX_CONFIG_ITEMS} values")
        if isinstance(v, str):
            _check_text(v, path, where, err)
        elif isinstance(v, (bool, np.bool_)) or v is None:
            pass
        elif isinstance(v, (int, np.integer)):
            if not -MAX_CONFIG_INT <= int(v) < MAX_CONFIG_INT:
                raise err(f"{where}: {_field(path)} = {str(int(v))[:30]}... is outside int64")
        elif isinstance(v, (float, np.floating)):
            if not math.isfinite(float(v)):
                raise err(f"{where}: {_field(path)} = {float(v)} is not a finite number")
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str):
                    _check_text(k, (path, k), where, err, "key")
                todo.append(((path, k), x))
        elif isinstance(v, (list, tuple)):
            todo.extend(((path, i), x) for i, x in enumerate(v))
        elif isinstance(v, np.ndarray):
            if v.dtype.kind == "f" and v.size and not np.isfinite(v).all():
                raise err(f"{where}: {_field(path)} holds a non-finite number")
        elif isinstance(v, (bytes, bytearray)):
            pass
        else:
            raise err(f"{where}: {_field(path)} has an unexpected type {type(v).__name__}")
    return obj


def _check_text(v: str, path, where: str, err, what: str = "") -> None:
    if len(v) > MAX_CONFIG_STRING:
        raise err(f"{where}: {_field(path)}{what and ' (its ' + what + ')'} is a string of {len(v)} characters; "
                  f"at most {MAX_CONFIG_STRING}")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise err(f"{where}: {_field(path)}{what and ' (its ' + what + ')'} holds a lone surrogate "
                      f"(\\u{ord(v[e.start]):04x} at character {e.start}), not text") from None


def _field(path) -> str:
    """("a", ("b", 0)) nested pairs -> "a.b[0]"."""
    parts = []
    while isinstance(path, tuple):
        path, last = path
        parts.append(f"[{last}]" if isinstance(last, int) else "." + str(last).encode("ascii", "backslashreplace").decode())
    parts.append(str(path).encode("ascii", "backslashreplace").decode())
    return "".join(reversed(parts)).lstrip(".") or "(value)"


# generation_config.json keys mixqrt reads -> (type check, what it must be)
_GEN_FIELDS = {
    "temperature": (lambda v: _is_num(v) and float(v) >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_num(v) and 0 <= float(v) <= 1, "a number in [0, 1]"),
    "min_p": (lambda v: _is_num(v) and 0 <= float(v) <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: _is_int(v) and 0 <= v < 1 << 31, "an integer >= 0"),
    "repetition_penalty": (lambda v: _is_num(v) and 0 < float(v) <= 1e6, "a number > 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "max_new_tokens": (lambda v: _is_int(v) and 0 <= v < 1 << 31, "an integer >= 0"),
    "max_length": (lambda v: _is_int(v) and 0 <= v < 1 << 31, "an integer >= 0"),
    "eos_token_id": (lambda v: _is_int(v) or isinstance(v, list) and all(_is_int(x) for x in v),
                     "a token id or a list of them"),
    "bos_token_id": (_is_int, "a token id"),
    "pad_token_id": (_is_int, "a token id"),
}


def check_generation_config(gen, where: str, err=None) -> dict:
    """generation_config (from generation_config.json, GGUF general.sampling.*, an .mxq header):
    check_values, then each key mixqrt reads is None or of its type and range (FormatError naming
    it); unknown keys are kept as they are."""
    from mixqrt.errors import FormatError
    err = err or FormatError
    if gen is None:
        return {}
    if not isinstance(gen, dict):
        raise err(f"{where}: generation_config must be an object, got {type(gen).__name__}")
    check_values(gen, where, err=err)
    for key, (ok, what) in _GEN_FIELDS.items():
        v = gen.get(key)
        if v is not None and not ok(v):
            raise err(f"{where}: {key} must be {what}, got {type(v).__name__} {str(v)[:40]!r}")
    return gen

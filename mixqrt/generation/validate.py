"""The value checks of request arguments, shared by the Python API, the HTTP API and the engine:
each returns the checked value or raises ``RequestError(name, message)`` naming the argument
(HTTP 400 with OpenAI's ``param``). Messages quote a value through ``show`` (ASCII only, cut), so no
surrogate or control character of a hostile value reaches a reply or a log."""
from __future__ import annotations

import json
import math

import numpy as np

from mixqrt.errors import RequestError

__all__ = ["show", "number", "integer", "boolean", "string", "json_size"]


def show(v, limit: int = 60) -> str:
    """A value for an error message: repr, ASCII only, cut to `limit` characters."""
    r = ascii(v)
    return r if len(r) <= limit else r[:limit] + "..."


def number(name, v, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """A finite int or float within the bounds (lo_open / hi_open: the bound itself is refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise RequestError(name, f"{name} must be a finite number, got {show(v)}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(name, f"{name} must be {'>' if lo_open else '>='} {lo}, got {show(v)}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise RequestError(name, f"{name} must be {'<' if hi_open else '<='} {hi}, got {show(v)}")
    return float(v)


def integer(name, v, lo=0, hi=None) -> int:
    """An int within [lo, hi] (None: unbounded); a float holding an integer (JSON's 64.0) passes."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise RequestError(name, f"{name} must be an integer, got {show(v)}")
    if lo is not None and v < lo:
        raise RequestError(name, f"{name} must be >= {lo}, got {show(v)}")
    if hi is not None and v > hi:
        raise RequestError(name, f"{name} must be <= {hi}, got {show(v)}")
    return int(v)


def boolean(name, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise RequestError(name, f"{name} must be true or false, got {show(v)}")
    return bool(v)


def string(name, v, limit: int) -> str:
    """A str of at most `limit` characters."""
    if not isinstance(v, str):
        raise RequestError(name, f"{name} must be a string, got {show(v)}")
    if len(v) > limit:
        raise RequestError(name, f"{name} is {len(v)} characters; at most {limit}")
    return v


def json_size(name, v, limit: int) -> int:
    """The bytes of v serialized as JSON, refused above `limit`."""
    n = len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
    if n > limit:
        raise RequestError(name, f"{name} is {n} bytes of JSON; at most {limit}")
    return n

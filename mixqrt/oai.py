"""OpenAI's request and reply objects, in one place: mixqrt.api and mixqrt.serve both use this.

    req = parse("chat", body)                      # a dict (JSON body or api keyword arguments)
    req.gen_kwargs(context)                        # -> Engine.submit / Pipeline.stream keyword arguments
    reply = Reply(req, model="qwen")               # renders every reply shape of that request
    reply.whole([Choice(text, "stop")], usage(...))

Parsing checks every field's type, value and size and raises ``RequestError(field, message)``
(HTTP 400 with OpenAI's ``param``). The fields other parts of mixqrt consume (response_format,
tools, tool_choice, parallel_tool_calls, cache_salt, cache_prompt, user) are shape-checked,
size-bounded and passed through as plain values. ``loads`` is the server's JSON decoder: a body
that is not UTF-8, not JSON, too deep, holds a lone surrogate, a non-finite number or an integer
of more than MAX_INT_DIGITS digits is a RequestError naming the field where it was found.

Replies keep llama-cpp-python's / OpenAI's shapes (the two agree): "text_completion" and
"chat.completion" objects, their streaming chunks, usage with prompt_tokens_details.cached_tokens,
and error bodies {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass

from mixqrt.errors import GenerationError, RequestError
from mixqrt import sample_utils

__all__ = ["RequestError", "Request", "Reply", "Choice", "Assembler", "parse", "loads", "usage", "usage_of",
           "finish_reason", "error_body", "model_card", "model_list", "check_messages", "MAX_JSON_DEPTH"]

# ---------------------------------------------------------------------------- bounds
MAX_JSON_DEPTH = 32                 # OpenAI bodies nest 5 deep (messages -> content parts); schemas more
MAX_INT_DIGITS = 40                 # past int64 / uint64 (20 digits) with room; Python refuses 4300+
MAX_STOP = 4                        # OpenAI's limits on stop strings
MAX_STOP_BYTES = 256
MAX_N = 8                           # choices per request
MAX_TOP_LOGPROBS = 20               # OpenAI's bound
MAX_LOGIT_BIAS = 300                # entries (OpenAI accepts 300)
MAX_TOOLS = 128                     # OpenAI's bound on functions
MAX_SPEC_BYTES = 128 << 10          # a response_format / one tool, serialized
MAX_TOOLS_BYTES = 512 << 10         # all tools together
MAX_ID_CHARS = 256                  # user, cache_salt
MAX_NAME = 64                       # a function / schema name (OpenAI: ^[a-zA-Z0-9_-]{1,64}$)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SEED_RANGE = (-(1 << 63), 1 << 64)  # int64 or uint64 seeds; negative = random (llama.cpp's -1)

ROLES = ("system", "developer", "user", "assistant", "tool")
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")   # the last two: mixqrt's
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


_show = sample_utils._show


def _safe(s) -> str:
    """A user-given name (a JSON key) as printable ASCII."""
    return ascii(str(s))[1:-1][:MAX_NAME * 2]


# ============================================================================ JSON decoding
class _Bad:
    """What the JSON hooks put in place of a value the scan must refuse (it never escapes loads)."""

    def __init__(self, why: str):
        self.why = why


def _parse_int(s: str):
    return int(s) if len(s) <= MAX_INT_DIGITS + 1 else _Bad(f"an integer of {len(s.lstrip('-'))} digits "
                                                            f"(at most {MAX_INT_DIGITS})")


def _parse_float(s: str):
    v = float(s)
    return v if math.isfinite(v) else _Bad(f"the number {s[:30]} overflows a double")


def _parse_constant(s: str):
    return _Bad(f"{s} (JSON has no non-finite numbers)")


_LONG_NUMBER = re.compile(r"\d{%d,}|[eE][+-]?0*\d{3,}" % (MAX_INT_DIGITS + 1))


def loads(raw, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """A request body (bytes or str) -> a dict, checked by ``check_values``; RequestError otherwise."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(None, f"request body is not UTF-8 (byte {e.start})") from None
    # per-number hooks are slow (a Python call per number): only when a number could be out of range
    hooks = {"parse_int": _parse_int, "parse_float": _parse_float} if _LONG_NUMBER.search(raw) else {}
    try:
        body = json.loads(raw, parse_constant=_parse_constant, **hooks)
    except json.JSONDecodeError as e:
        raise RequestError(None, f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except RecursionError:
        raise RequestError(None, f"request body nests deeper than {max_depth} levels") from None
    if not isinstance(body, dict):
        raise RequestError(None, "request body must be a JSON object")
    check_values(body, max_depth)
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + _safe(p))
    return out


def check_values(body: dict, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Every value of a request: nesting within max_depth, no lone UTF-16 surrogate in a string or a
    key (it cannot be encoded, tokenized or sent back), no non-finite number, no huge integer.
    Iterative; the error names the top-level field and the path inside it."""
    stack = [(body, ())]
    while stack:
        o, where = stack.pop()
        if len(where) >= max_depth:
            raise RequestError(_top(where), f"request body nests deeper than {max_depth} levels "
                                            f"(at {_path(where[:8])}...)")
        is_dict = isinstance(o, dict)
        for k, v in (o.items() if is_dict else enumerate(o)):
            if is_dict and (not isinstance(k, str) or (not k.isascii() and _SURROGATE.search(k))):
                raise RequestError(_top(where + (k,)), f"{_path(where + (k,))}: a key holds a lone UTF-16 "
                                                       "surrogate (not valid text)")
            t = type(v)
            if t is str:
                if not v.isascii() and _SURROGATE.search(v):
                    raise RequestError(_top(where + (k,)), f"{_path(where + (k,))}: the text holds a lone UTF-16 "
                                                           "surrogate (not valid Unicode)")
            elif t is int or t is bool or v is None:
                if t is int and v.bit_length() > 4 * MAX_INT_DIGITS:
                    raise RequestError(_top(where + (k,)), f"{_path(where + (k,))}: the integer is too large")
            elif isinstance(v, (dict, list, tuple)):
                stack.append((v, where + (k,)))
            elif isinstance(v, _Bad):
                raise RequestError(_top(where + (k,)), f"{_path(where + (k,))}: {v.why}")
            elif isinstance(v, float) and not math.isfinite(v):
                raise RequestError(_top(where + (k,)), f"{_path(where + (k,))}: {v} is not a finite number")
            elif isinstance(v, str):                 # a str subclass
                check_values({"": str(v)}, 2)


def _top(where) -> str | None:
    return _safe(where[0]) if where else None


def error_body(message: str, param=None, code=None, type_: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_card(model_id: str, created: int) -> dict:
    """GET /v1/models/{id}: OpenAI's model object."""
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "mixqrt"}


def model_list(cards: list) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": list(cards)}


# ============================================================================ field checks
def _number(name, v, lo=None, hi=None, lo_open=False):
    return None if v is None else sample_utils._number(name, v, lo, hi, lo_open)


def _integer(name, v, lo=None, hi=None):
    return None if v is None else sample_utils._int(name, v, lo=lo, hi=hi)


def _bool(name, v, default=None):
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(name, f"{name} must be true or false, got {_show(v)}")
    return v


def _string(name, v, limit=MAX_ID_CHARS):
    if v is None:
        return None
    if not isinstance(v, str):
        raise RequestError(name, f"{name} must be a string, got {_show(v)}")
    if len(v) > limit:
        raise RequestError(name, f"{name} is {len(v)} characters; at most {limit}")
    return v


def _size(name, v, limit) -> int:
    n = len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
    if n > limit:
        raise RequestError(name, f"{name} is {n} bytes of JSON; at most {limit}")
    return n


def check_stops(stop) -> list[str] | None:
    """Stop strings (generate.check_stops: an empty one is refused), at most MAX_STOP of at most
    MAX_STOP_BYTES bytes each (OpenAI's limits)."""
    from mixqrt.generate import check_stops as generate_check

    if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP:
        raise RequestError("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    try:
        stops = generate_check(stop)
    except GenerationError as e:
        raise RequestError("stop", f"stop: {e}") from None
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for s in stops):
        raise RequestError("stop", f"a stop string is at most {MAX_STOP_BYTES} bytes")
    return stops or None


def _content(i, m) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):          # OpenAI content parts: only text parts
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError("messages", f"messages[{i}].content[{j}]: only text parts are supported, "
                                               f"got {_show(kind)}")
            out.append(part["text"])
        return "".join(out)
    if c is None and (m.get("tool_calls") or m.get("role") == "assistant"):
        return ""                   # an assistant turn that only called tools
    raise RequestError("messages", f"messages[{i}].content must be a string or a list of text parts, "
                                   f"got {_show(c)}")


def check_messages(messages) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content"}] for the model's chat template.

    "developer" (OpenAI's newer name for the system role) becomes "system"; an assistant message
    keeps its tool_calls and a "tool" message its tool_call_id (mixqrt.tools renders them for the
    template); other fields (name, ...) are dropped; "function" messages are refused.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("messages", f"messages[{i}] must be an object with 'role' and 'content', "
                                           f"got {_show(m)}")
        role = m.get("role")
        if role not in ROLES:
            what = "the deprecated 'function' role is not supported (use 'tool')" if role == "function" else \
                f"unknown role {_show(role)} (expected one of {', '.join(ROLES)})"
            raise RequestError("messages", f"messages[{i}]: {what}")
        msg = {"role": "system" if role == "developer" else role, "content": _content(i, m)}
        _tool_fields(i, m, msg)
        out.append(msg)
    return out


def _tool_fields(i: int, m: dict, msg: dict) -> None:
    """An assistant message's tool_calls and a tool message's tool_call_id, checked, into msg."""
    calls = m.get("tool_calls")
    if msg["role"] == "assistant" and calls:
        if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
            raise RequestError("messages", f"messages[{i}].tool_calls must be a list of at most {MAX_TOOLS} calls")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise RequestError("messages", f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', "
                                               "'id': ..., 'function': {'name': ..., 'arguments': '<JSON text>'}}")
        msg["tool_calls"] = calls
    if msg["role"] == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise RequestError("messages", f"messages[{i}].tool_call_id must be a string")
        msg["tool_call_id"] = tid


def check_prompt(prompt) -> str:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "prompt is empty")
        return prompt
    if isinstance(prompt, (list, tuple)) and len(prompt) == 1 and isinstance(prompt[0], str):
        return check_prompt(prompt[0])
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        raise RequestError("prompt", "a batch of prompts is not supported: send one prompt per request")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, int) for p in prompt):
        raise RequestError("prompt", "token-id prompts are not supported: send the prompt as a string")
    what = "nothing" if prompt is None else type(prompt).__name__
    raise RequestError("prompt", f"prompt is required: a non-empty string, got {what}")


def _text_field(name, v) -> str:
    if not isinstance(v, str):
        raise RequestError(name, f"{name} must be a string, got {_show(v)}")
    return v


def _stream_options(v) -> bool:
    if v is None:
        return False
    if not isinstance(v, dict) or not isinstance(v.get("include_usage", False), bool):
        raise RequestError("stream_options", "stream_options must be an object like {'include_usage': true}")
    return v.get("include_usage", False)


def _logit_bias(v) -> dict[int, float] | None:
    """{token id (int or its decimal string): bias in [-100, 100]} -> {int: float}; ids are checked
    against the vocabulary by the engine."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RequestError("logit_bias", f"logit_bias must be an object {{token id: bias}}, got {_show(v)}")
    if len(v) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, b in v.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
            t = int(k)
        elif isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 1 << 32:
            t = int(k)
        else:
            raise RequestError("logit_bias", f"logit_bias keys must be token ids, got {_show(k)}")
        out[t] = _number("logit_bias", b, lo=-100.0, hi=100.0)
    return out or None


def _function_name(field_, v):
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise RequestError(field_, f"{field_}: a function name is 1-{MAX_NAME} of a-z, A-Z, 0-9, _ and -, "
                                   f"got {_show(v)}")
    return v


def _response_format(v) -> dict | None:
    """Shape and size only; the grammar layer compiles it. {"type": "text"} -> None."""
    if v is None:
        return None
    name = "response_format"
    if not isinstance(v, dict) or v.get("type") not in FORMAT_TYPES:
        raise RequestError(name, f"response_format must be an object with 'type' one of "
                                 f"{', '.join(FORMAT_TYPES)}, got {_show(v)}")
    _size(name, v, MAX_SPEC_BYTES)
    t = v["type"]
    if t == "text":
        return None
    if t == "json_object" and v.get("schema") is not None and not isinstance(v.get("schema"), dict):
        raise RequestError(name, "response_format.schema must be a JSON schema object")
    if t == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise RequestError(name, "response_format json_schema must be {'json_schema': {'name': ..., "
                                     "'schema': {...}}}")
        if js.get("name") is not None:
            _function_name(name, js["name"])
        _bool(name, js.get("strict"))
    if t in ("regex", "grammar") and (not isinstance(v.get(t), str) or not v[t]):
        raise RequestError(name, f"response_format of type {t!r} needs a non-empty string {t!r}")
    return v


def _tools(v) -> list | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise RequestError("tools", f"tools must be a list of {{'type': 'function', 'function': ...}}, got {_show(v)}")
    if len(v) > MAX_TOOLS:
        raise RequestError("tools", f"{len(v)} tools; at most {MAX_TOOLS}")
    total = 0
    for i, t in enumerate(v):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise RequestError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        _function_name("tools", f.get("name"))
        _string("tools", f.get("description"), MAX_SPEC_BYTES)
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        _bool("tools", f.get("strict"))
        total += _size("tools", t, MAX_SPEC_BYTES)
        if total > MAX_TOOLS_BYTES:
            raise RequestError("tools", f"tools are over {MAX_TOOLS_BYTES} bytes of JSON")
    return v or None


def _tool_choice(v):
    if v is None or v in ("none", "auto", "required"):
        return v
    f = v.get("function") if isinstance(v, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(f, dict):
        raise RequestError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                          "{'type': 'function', 'function': {'name': ...}}")
    _function_name("tool_choice", f.get("name"))
    return v


# ============================================================================ the request
@dataclass
class Request:
    """One parsed request. Sampling fields left None come from the model's generation_config."""
    kind: str                               # "chat" | "completion"
    messages: list | None = None            # chat: [{"role", "content"}] (checked, normalised)
    prompt: str | None = None               # completion
    max_tokens: int | None = None           # None: until the context is full
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    stop: list | None = None
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str | None = None
    # consumed by the grammar and prompt-cache layers
    response_format: dict | None = None     # None for {"type": "text"}
    tools: list | None = None
    tool_choice: object = None
    parallel_tool_calls: bool | None = None
    cache_salt: str | None = None
    cache_prompt: bool = True
    user: str | None = None
    suffix: str | None = None               # completion: the text after the insertion (fill-in-the-middle)

    def gen_kwargs(self, context: int) -> dict:
        """-> keyword arguments of Engine.submit / Pipeline.stream (None ones left out: model defaults)."""
        mt = self.max_tokens if self.max_tokens is not None and self.max_tokens > 0 else int(context)
        kw = {"max_new_tokens": mt, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
              "min_p": self.min_p, "repetition_penalty": self.repeat_penalty, "stop": self.stop, "seed": self.seed,
              "presence_penalty": self.presence_penalty or None, "frequency_penalty": self.frequency_penalty or None,
              "logit_bias": self.logit_bias, "n": self.n if self.n != 1 else None,
              "logprobs": True if self.logprobs else None, "top_logprobs": self.top_logprobs or None,
              "response_format": self.response_format, "tools": self.tools,
              "tool_choice": self.tool_choice if self.tools else None,
              "parallel_tool_calls": self.parallel_tool_calls if self.tools else None}
        return {k: v for k, v in kw.items() if v is not None}


_COMMON = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
           "frequency_penalty", "logit_bias", "stop", "seed", "n", "logprobs", "stream", "stream_options",
           "model", "user", "cache_salt", "cache_prompt"}
FIELDS = {"chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                             "tool_choice", "parallel_tool_calls", "functions", "function_call"},
          "completion": _COMMON | {"prompt", "suffix", "echo", "best_of"}}
IGNORED = {"metadata", "store", "service_tier"}     # accepted, change nothing (one model, no accounts)


def parse(kind: str, body: dict, *, max_tokens_cap: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> Request:
    """Check a request dict -> Request; RequestError naming the field otherwise.

    None values count as absent. Unknown fields are refused (a misspelt argument is not silently
    dropped); max_tokens_cap (a server's --max-tokens) bounds max_tokens.
    """
    if kind not in FIELDS:
        raise RequestError(None, f"unknown request kind {kind!r}")
    if not isinstance(body, dict):
        raise RequestError(None, "request body must be a JSON object")
    check_values(body, max_depth)
    allowed = FIELDS[kind]
    for k in body:
        if k not in allowed and k not in IGNORED:
            raise RequestError(_safe(k), f"unrecognized request argument: {_safe(k)}")
    b = {k: v for k, v in body.items() if v is not None}
    key = "messages" if kind == "chat" else "prompt"
    r = Request(kind)
    if kind == "chat":                        # absent: the same error as a wrong type
        r.messages = check_messages(b.get(key))
    elif b.get("suffix") not in (None, "") and b.get(key) in ("", [""]):
        r.prompt = ""                         # fill-in-the-middle at the start of a file
    else:
        r.prompt = check_prompt(b.get(key))

    for name in ("max_tokens", "max_completion_tokens"):
        mt = _integer(name, b.get(name))
        if mt is not None and max_tokens_cap is not None and mt > max_tokens_cap:
            raise RequestError(name, f"{name}={mt} is over this server's limit of {max_tokens_cap}")
        if mt is not None:
            r.max_tokens = mt                 # max_completion_tokens (OpenAI's newer name) wins
    if kind == "completion" and "max_tokens" not in b:
        r.max_tokens = 16                     # OpenAI's and llama-cpp-python's default for completions
    if max_tokens_cap is not None and (r.max_tokens is None or r.max_tokens <= 0 or r.max_tokens > max_tokens_cap):
        r.max_tokens = max_tokens_cap         # "until the context is full" stops at the server's cap too
    r.temperature = _number("temperature", b.get("temperature"), lo=0.0)
    r.top_p = _number("top_p", b.get("top_p"), lo=0.0, hi=1.0, lo_open=True)
    r.top_k = _integer("top_k", b.get("top_k"))
    if r.top_k is not None and r.top_k < 0:
        r.top_k = 0                           # llama.cpp: top_k <= 0 means the whole vocabulary
    r.min_p = _number("min_p", b.get("min_p"), lo=0.0, hi=1.0)
    r.repeat_penalty = _number("repeat_penalty", b.get("repeat_penalty"), lo=0.0, lo_open=True)
    r.presence_penalty = _number("presence_penalty", b.get("presence_penalty"), lo=-2.0, hi=2.0) or 0.0
    r.frequency_penalty = _number("frequency_penalty", b.get("frequency_penalty"), lo=-2.0, hi=2.0) or 0.0
    r.logit_bias = _logit_bias(b.get("logit_bias"))
    r.stop = check_stops(b.get("stop"))
    r.seed = _integer("seed", b.get("seed"), lo=SEED_RANGE[0], hi=SEED_RANGE[1] - 1)
    if r.seed is not None and r.seed < 0:
        r.seed = None                         # llama.cpp: seed -1 means random
    r.n = _integer("n", b.get("n"), lo=1, hi=MAX_N) or 1
    r.stream = _bool("stream", b.get("stream"), False)
    r.include_usage = _stream_options(b.get("stream_options"))
    if b.get("model") is not None and not isinstance(b["model"], str):
        raise RequestError("model", f"model must be a string, got {_show(b['model'])}")
    r.model = b.get("model")
    r.user = _string("user", b.get("user"))
    r.cache_salt = _string("cache_salt", b.get("cache_salt"))
    r.cache_prompt = _bool("cache_prompt", b.get("cache_prompt"), True)

    if kind == "chat":
        r.logprobs = _bool("logprobs", b.get("logprobs"), False)
        r.top_logprobs = _integer("top_logprobs", b.get("top_logprobs"), lo=0, hi=MAX_TOP_LOGPROBS) or 0
        if r.top_logprobs and not r.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
        r.response_format = _response_format(b.get("response_format"))
        r.tools = _tools(b.get("tools"))
        if b.get("functions") not in (None, []):
            raise RequestError("functions", "functions (the old function calling) is not supported: use tools")
        if b.get("function_call") not in (None, "none", "auto"):
            raise RequestError("function_call", "function_call is not supported: use tool_choice")
        r.tool_choice = _tool_choice(b.get("tool_choice"))
        r.parallel_tool_calls = _bool("parallel_tool_calls", b.get("parallel_tool_calls"))
    else:
        lp = _integer("logprobs", b.get("logprobs"), lo=0, hi=MAX_TOP_LOGPROBS)
        r.logprobs, r.top_logprobs = lp is not None, lp or 0
        if b.get("suffix") not in (None, ""):     # fill-in-the-middle (mixqrt.fim): the prompt is the prefix
            r.suffix = _text_field("suffix", b["suffix"])
            if r.echo or b.get("echo"):
                raise RequestError("echo", "echo with suffix (fill-in-the-middle) is not supported")
        r.echo = _bool("echo", b.get("echo"), False)
        if r.echo and r.logprobs:
            raise RequestError("logprobs", "logprobs with echo (the prompt's logprobs) is not supported")
        best_of = _integer("best_of", b.get("best_of"), lo=1)
        if best_of not in (None, r.n):
            raise RequestError("best_of", "best_of must equal n (no server-side ranking)")
    _not_yet(r)
    return r


def _not_yet(r: Request) -> None:
    """response_format and tools beyond their shape (mixqrt.grammar / mixqrt.tools): the kind of
    format, the tool names tool_choice refers to. The grammar itself compiles in the engine, off
    the request's path; one that cannot is a 400 from there."""
    from mixqrt.grammar import grammar_from_response_format
    from mixqrt.tools import check_tool_choice, check_tools

    grammar_from_response_format(r.response_format)
    check_tool_choice(r.tool_choice, check_tools(r.tools))


# ============================================================================ replies
def finish_reason(r) -> str:
    """A GenerationResponse's finish_reason as OpenAI names it ("cancelled" or none: "stop")."""
    reason = getattr(r, "finish_reason", r if isinstance(r, str) else None)
    return reason if reason in FINISH_REASONS else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, draft_tokens: int = 0,
          accepted_draft_tokens: int = 0) -> dict:
    p, c = int(prompt_tokens), int(completion_tokens)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}   # OpenAI's field: prompt-cache hits
    if draft_tokens:        # speculative decoding: OpenAI's predicted-output fields
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": int(accepted_draft_tokens),
            "rejected_prediction_tokens": int(draft_tokens) - int(accepted_draft_tokens)}
    return out


def usage_of(lasts) -> dict:
    """Usage from the last GenerationResponse of each choice (prompt counted once)."""
    lasts = [r for r in (lasts if isinstance(lasts, (list, tuple)) else [lasts]) if r is not None]
    if not lasts:
        return usage(0, 0)
    g = lambda r, k: int(getattr(r, k, 0) or 0)   # noqa: E731
    return usage(g(lasts[0], "prompt_tokens"), sum(g(r, "generation_tokens") for r in lasts),
                 g(lasts[0], "cached_tokens"), g(lasts[0], "draft_tokens"), g(lasts[0], "accepted_draft_tokens"))


@dataclass
class Choice:
    text: str
    finish_reason: str | None = "stop"
    logprobs: dict | None = None
    message: dict | None = None             # chat with tools: content and tool_calls (mixqrt.tools)


class Reply:
    """Every reply object of one request, chat or completion, whole or as stream chunks."""

    def __init__(self, req: Request, model: str, *, id: str | None = None, created: int | None = None):
        self.kind = req.kind
        self.echo = req.prompt if (req.kind == "completion" and req.echo) else None
        self.include_usage = req.include_usage
        prefix, obj = ("chatcmpl", "chat.completion") if self.kind == "chat" else ("cmpl", "text_completion")
        self.head = {"id": id or f"{prefix}-{uuid.uuid4().hex}", "object": obj,
                     "created": int(time.time()) if created is None else created, "model": model}
        self.chunk_object = "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    # ------------------------------------------------------------------ whole
    def whole(self, choices: list[Choice], usage_: dict) -> dict:
        out = []
        for i, c in enumerate(choices):
            if self.kind == "chat":
                out.append({"index": i, "message": c.message or {"role": "assistant", "content": c.text},
                            "logprobs": c.logprobs, "finish_reason": finish_reason(c.finish_reason)})
            else:
                out.append({"text": (self.echo or "") + c.text, "index": i, "logprobs": c.logprobs,
                            "finish_reason": finish_reason(c.finish_reason)})
        return {**self.head, "choices": out, "usage": usage_}

    # ------------------------------------------------------------------ stream
    def chunk(self, payload, index: int = 0, reason=None, logprobs=None) -> dict:
        """payload: a delta dict (chat) or a text piece (completion)."""
        if self.kind == "chat":
            c = {"index": index, "delta": payload, "logprobs": logprobs, "finish_reason": reason}
        else:
            c = {"text": payload, "index": index, "logprobs": logprobs, "finish_reason": reason}
        return {**self.head, "object": self.chunk_object, "choices": [c]}

    def start(self, index: int = 0) -> list:
        if self.kind == "chat":
            return [self.chunk({"role": "assistant"}, index)]
        return [self.chunk(self.echo, index)] if self.echo else []

    def piece(self, text: str, index: int = 0, logprobs=None) -> list:
        if not text and logprobs is None:
            return []
        return [self.chunk({"content": text} if self.kind == "chat" else text, index, logprobs=logprobs)]

    def end(self, reason, index: int = 0) -> list:
        return [self.chunk({} if self.kind == "chat" else "", index, finish_reason(reason))]

    def usage_chunk(self, usage_: dict) -> list:
        return [{**self.head, "object": self.chunk_object, "choices": [], "usage": usage_}] if self.include_usage \
            else []


def safe_message(e) -> str:
    """An exception's message as valid text (a lone surrogate becomes a \\uXXXX escape)."""
    return str(e).encode("utf-8", "backslashreplace").decode("utf-8")


# ============================================================================ assembling a run
def token_text(tokenizer):
    """-> f(token id) -> (its text, its UTF-8 bytes as a list of ints), memoized: the `token` and
    `bytes` of OpenAI's logprobs (a token may hold part of a character: its text then has U+FFFD,
    its bytes are exact)."""
    memo: dict = {}

    def f(i: int):
        out = memo.get(i)
        if out is None:
            b = tokenizer.token_bytes(i) if hasattr(tokenizer, "token_bytes") else None
            if b is None:
                b = tokenizer.decode([i]).encode("utf-8", "replace")
            out = memo[i] = (b.decode("utf-8", "replace"), list(b))
        return out

    return f


class Assembler:
    """Turns a run's GenerationResponse pieces (with ``index`` for n choices and ``logprobs``)
    into reply chunks as they come, and into the whole reply at the end. api (sync) and the server
    (async) drive one each: the same pieces give the same objects."""

    def __init__(self, req: Request, reply: Reply, tokenizer=None):
        self.reply, self.kind, self.n = reply, req.kind, req.n
        self.want_lp = req.logprobs
        self.text_of = token_text(tokenizer) if req.logprobs else None
        self.texts = [[] for _ in range(self.n)]
        self.lasts = [None] * self.n
        self.lps = [[] for _ in range(self.n)]              # chat entries, or (text, lp, top) for completions
        self.offset = [len(reply.echo or "")] * self.n
        self.ended = set()
        self.tool_replies = _tool_replies(req, tokenizer)

    def start(self) -> list:
        return [c for i in range(self.n) for c in self.reply.start(i)]

    def _entry(self, lp):
        tok, b = self.text_of(lp.token)
        if self.kind == "chat":
            top = []
            for tid, v in lp.top:
                t, tb = self.text_of(tid)
                top.append({"token": t, "logprob": v, "bytes": tb})
            return {"token": tok, "logprob": lp.logprob, "bytes": b, "top_logprobs": top}
        return tok, lp.logprob, {self.text_of(i)[0]: v for i, v in lp.top}

    def _legacy(self, entries, index) -> dict:
        """Completions' logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
        offsets = []
        for tok, _, _ in entries:
            offsets.append(self.offset[index])
            self.offset[index] += len(tok)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": offsets}

    def feed(self, r) -> list:
        """One piece -> the chunks to stream for it."""
        i = int(getattr(r, "index", 0) or 0)
        self.texts[i].append(r.text)
        self.lasts[i] = r
        piece_lp = None
        lp = getattr(r, "logprobs", None)
        if self.want_lp and lp is not None:
            e = self._entry(lp)
            self.lps[i].append(e)
            piece_lp = {"content": [e]} if self.kind == "chat" else self._legacy([e], i)
        tr = self.tool_replies[i] if self.tool_replies else None
        if tr is None:
            out = self.reply.piece(r.text, i, piece_lp)
        else:                                   # tool calls parsed out of the text as it comes
            deltas = tr.deltas(r.text) or ([{}] if piece_lp is not None else [])
            out = [self.reply.chunk(d, i, logprobs=piece_lp if k == 0 else None) for k, d in enumerate(deltas)]
        if getattr(r, "finish_reason", None) is not None and i not in self.ended:
            self.ended.add(i)
            out += self._end(r.finish_reason, i)
        return out

    def _end(self, reason, i: int) -> list:
        tr = self.tool_replies[i] if self.tool_replies else None
        if tr is None:
            return self.reply.end(reason, i)
        tail, reason = tr.end(finish_reason(reason))
        return [self.reply.chunk(d, i) for d in tail] + self.reply.end(reason, i)

    def finish(self) -> list:
        """After the last piece: the end chunks not sent yet, then the usage chunk (when asked)."""
        out = [c for i in range(self.n) if i not in self.ended for c in self._end(self.lasts[i], i)]
        self.ended.update(range(self.n))
        return out + self.reply.usage_chunk(usage_of(self.lasts))

    def whole(self) -> dict:
        choices = []
        for i in range(self.n):
            lps = None
            if self.want_lp:
                if self.kind == "chat":
                    lps = {"content": self.lps[i], "refusal": None}
                else:
                    self.offset[i] = len(self.reply.echo or "")
                    lps = self._legacy(self.lps[i], i)
            text, reason, message = "".join(self.texts[i]), finish_reason(self.lasts[i]), None
            if self.tool_replies:
                message, reason = self.tool_replies[i].message(text, reason)
            choices.append(Choice(text, reason, lps, message))
        return self.reply.whole(choices, usage_of(self.lasts))


def _tool_replies(req: Request, tokenizer) -> list | None:
    """One mixqrt.tools.ChatReply per choice when a chat request has tools in play, else None."""
    if req.kind != "chat" or not req.tools:
        return None
    from mixqrt.tools import ChatReply, check_tool_choice, check_tools, tool_format
    tools = check_tools(req.tools)
    choice = check_tool_choice(req.tool_choice, tools)
    if choice == "none":
        return None
    return [ChatReply(tools, choice, tool_format(tokenizer)) for _ in range(req.n)]


# ============================================================================ embeddings
EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


@dataclass
class EmbeddingRequest:
    input: object
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_embeddings(body: dict, max_depth: int = MAX_JSON_DEPTH) -> EmbeddingRequest:
    """Check an OpenAI embeddings body -> EmbeddingRequest (input's contents are checked when it is
    encoded: mixqrt.embed.encode_inputs); RequestError naming the field otherwise."""
    if not isinstance(body, dict):
        raise RequestError(None, "request body must be a JSON object")
    check_values(body, max_depth)
    for k in body:
        if k not in EMBEDDING_FIELDS and k not in IGNORED:
            raise RequestError(_safe(k), f"unrecognized request argument: {_safe(k)}")
    if body.get("input") is None:
        raise RequestError("input", "input is required: a string, a list of strings or token ids")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("encoding_format", f"encoding_format must be 'float' or 'base64', got {_show(fmt)}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model", f"model must be a string, got {_show(body['model'])}")
    return EmbeddingRequest(body["input"], body.get("model"), fmt, _integer("dimensions", body.get("dimensions"), lo=1),
                            _string("user", body.get("user")))


def embeddings_reply(vectors, model: str, prompt_tokens: int, encoding_format: str = "float") -> dict:
    """OpenAI's embeddings list: float lists, or base64 of little-endian float32 (what the openai
    client asks for by default and decodes with numpy)."""
    import base64

    import numpy as np
    data = []
    for i, v in enumerate(vectors):
        v = np.asarray(v, dtype="<f4")
        emb = base64.b64encode(v.tobytes()).decode("ascii") if encoding_format == "base64" else \
            [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": int(prompt_tokens), "total_tokens": int(prompt_tokens)}}

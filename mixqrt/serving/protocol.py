"""OpenAI's request and reply objects, in one place: mixqrt.serving.api and mixqrt.serving.server both use this.

    req = parse("chat", body)                      # a dict (JSON body or api keyword arguments)
    req.params                                     # its SamplingParams -> Engine.submit / Pipeline.stream
    reply = Reply(req, model="qwen")               # renders every reply shape of that request
    reply.whole([Choice(text, "stop")], usage(...))

Parsing checks every field's type, value and size and raises ``RequestError(field, message)``
(HTTP 400 with OpenAI's ``param``). The generation options (sampling, stop, n, logprobs,
response_format, tools, cache_salt, ...) are mixqrt.generation.params' (SamplingParams.from_openai: each
option's OpenAI spellings, checks and bounds are defined there once); this module adds the input
(messages, prompt) and the fields that shape the reply (stream, stream_options, echo, model). ``loads`` is the server's JSON decoder: a body
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

from mixqrt.errors import RequestError
from mixqrt.generation.params import MAX_ID_CHARS, MAX_NAME, PARAMS, UNTIL_FULL, SamplingParams
from mixqrt.generation.tool_calls import MAX_TOOLS
from mixqrt.generation.validate import boolean, integer, show, string

__all__ = ["RequestError", "Request", "Reply", "Choice", "Assembler", "parse", "loads", "usage", "usage_of",
           "finish_reason", "error_body", "model_card", "model_list", "check_messages", "MAX_JSON_DEPTH"]

# ---------------------------------------------------------------------------- bounds
MAX_JSON_DEPTH = 32                 # OpenAI bodies nest 5 deep (messages -> content parts); schemas more
MAX_INT_DIGITS = 40                 # past int64 / uint64 (20 digits) with room; Python refuses 4300+

ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


_show = show


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
def _bool(name, v, default=None):
    return default if v is None else boolean(name, v)


def _string(name, v, limit=MAX_ID_CHARS):
    return None if v is None else string(name, v, limit)


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
    keeps its tool_calls and a "tool" message its tool_call_id (mixqrt.generation.tool_calls renders them for the
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


# ============================================================================ the request
@dataclass
class Request:
    """One parsed request: its input (messages or prompt), its generation options (``params``, a
    mixqrt.generation.params.SamplingParams: sampling fields left None come from the model's
    generation_config) and the fields that shape the reply."""
    kind: str                               # "chat" | "completion"
    params: SamplingParams
    messages: list | None = None            # chat: [{"role", "content"}] (checked, normalised)
    prompt: str | None = None               # completion
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str | None = None
    user: str | None = None
    suffix: str | None = None               # completion: the text after the insertion (fill-in-the-middle)


# the fields of a body that are not generation options (SamplingParams.openai_fields adds those)
_REPLY = {"stream", "stream_options", "model", "user"}
_OWN = {"chat": _REPLY | {"messages", "functions", "function_call"},
        "completion": _REPLY | {"prompt", "suffix", "echo", "best_of"}}
IGNORED = {"metadata", "store", "service_tier"}     # accepted, change nothing (one model, no accounts)


def fields(kind: str) -> set[str]:
    """Every field an OpenAI body of this kind may hold (an unknown one is refused)."""
    return _OWN[kind] | SamplingParams.openai_fields(kind)


def parse(kind: str, body: dict, *, max_tokens_cap: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> Request:
    """Check a request dict -> Request; RequestError naming the field otherwise.

    None values count as absent. Unknown fields are refused (a misspelt argument is not silently
    dropped); max_tokens_cap (a server's --max-tokens) bounds max_tokens, and "until the context
    is full" (no max_tokens in a chat body) stops there too.
    """
    if kind not in _OWN:
        raise RequestError(None, f"unknown request kind {kind!r}")
    if not isinstance(body, dict):
        raise RequestError(None, "request body must be a JSON object")
    check_values(body, max_depth)
    allowed = fields(kind)
    for k in body:
        if k not in allowed and k not in IGNORED:
            raise RequestError(_safe(k), f"unrecognized request argument: {_safe(k)}")
    b = {k: v for k, v in body.items() if v is not None}
    key = "messages" if kind == "chat" else "prompt"
    if kind == "chat":                        # absent: the same error as a wrong type
        messages, prompt = check_messages(b.get(key)), None
    elif b.get("suffix") not in (None, "") and b.get(key) in ("", [""]):
        messages, prompt = None, ""           # fill-in-the-middle at the start of a file
    else:
        messages, prompt = None, check_prompt(b.get(key))
    if max_tokens_cap is not None:
        for name in PARAMS["max_new_tokens"].spellings(kind):
            if name in b and integer(name, b[name], lo=None) > max_tokens_cap:
                raise RequestError(name, f"{name}={b[name]} is over this server's limit of {max_tokens_cap}")
    params = SamplingParams.from_openai(kind, b)
    if max_tokens_cap is not None and (params.max_new_tokens == UNTIL_FULL or params.max_new_tokens > max_tokens_cap):
        params = params.replace(max_new_tokens=max_tokens_cap)   # "until the context is full" stops at the cap too
    if b.get("model") is not None and not isinstance(b["model"], str):
        raise RequestError("model", f"model must be a string, got {_show(b['model'])}")
    r = Request(kind, params, messages, prompt, stream=_bool("stream", b.get("stream"), False),
                include_usage=_stream_options(b.get("stream_options")), model=b.get("model"),
                user=_string("user", b.get("user")))
    if kind == "chat":
        if b.get("functions") not in (None, []):
            raise RequestError("functions", "functions (the old function calling) is not supported: use tools")
        if b.get("function_call") not in (None, "none", "auto"):
            raise RequestError("function_call", "function_call is not supported: use tool_choice")
    else:
        if b.get("suffix") not in (None, ""):     # fill-in-the-middle (mixqrt.generation.fim): the prompt is the prefix
            r.suffix = _text_field("suffix", b["suffix"])
            if b.get("echo"):
                raise RequestError("echo", "echo with suffix (fill-in-the-middle) is not supported")
        r.echo = _bool("echo", b.get("echo"), False)
        if r.echo and params.logprobs:
            raise RequestError("logprobs", "logprobs with echo (the prompt's logprobs) is not supported")
        best_of = None if b.get("best_of") is None else integer("best_of", b["best_of"], lo=1)
        if best_of not in (None, params.n):
            raise RequestError("best_of", "best_of must equal n (no server-side ranking)")
    return r


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
    message: dict | None = None             # chat with tools: content and tool_calls (mixqrt.generation.tool_calls)


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
        self.reply, self.kind, self.n = reply, req.kind, req.params.n
        self.want_lp = req.params.logprobs
        self.text_of = token_text(tokenizer) if req.params.logprobs else None
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
    """One mixqrt.generation.tool_calls.ChatReply per choice when a chat request has tools in play, else None."""
    if req.kind != "chat" or not req.params.tools:
        return None
    from mixqrt.generation.tool_calls import ChatReply, check_tool_choice, check_tools, tool_format
    tools = check_tools(req.params.tools)
    choice = check_tool_choice(req.params.tool_choice, tools)
    if choice == "none":
        return None
    return [ChatReply(tools, choice, tool_format(tokenizer)) for _ in range(req.params.n)]


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
    encoded: mixqrt.generation.embed.encode_inputs); RequestError naming the field otherwise."""
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
    dims = body.get("dimensions")
    return EmbeddingRequest(body["input"], body.get("model"), fmt, None if dims is None else integer("dimensions", dims, lo=1),
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

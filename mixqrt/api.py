"""llama-cpp-python-shaped completions on top of a Pipeline (OpenAI's response objects).

    from mixqrt.api import create_completion, create_chat_completion
    out = create_completion(pipe, "def quicksort(xs):", max_tokens=32)
    out["choices"][0]["text"]
    out = create_chat_completion(pipe, [{"role": "user", "content": "hi"}])
    out["choices"][0]["message"]["content"]
    for chunk in create_chat_completion(pipe, messages, stream=True):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")

Only `pipe.stream(text_or_messages, **kwargs)` (GenerationResponse pieces) and, for the model
name, `pipe.model_name` or `pipe.path` are used, so any object with that shape works.

Sampling arguments left at None fall back to the model's generation_config.json like transformers
(greedy when it does not ask for sampling), not to llama-cpp-python's fixed 0.8/0.95/40 defaults.
Arguments that cannot be honoured (n > 1, logprobs, tools, non-zero presence/frequency penalties...)
raise a RequestError naming the argument instead of being silently ignored.
"""
from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Iterator

from mixqrt.errors import GenerationError
from mixqrt.errors import RequestError as FieldError

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(GenerationError):
    """A bad or unsupported request argument; `param` names it (OpenAI's error "param")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


# ============================================================================ argument checks
def _num(name, v, lo=None, hi=None, lo_open=False):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise RequestError(f"{name} must be <= {hi}, got {v!r}", name)
    return float(v)


def _integer(name, v, lo=None):
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)          # JSON clients sometimes send 64.0
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise RequestError(f"{name} must be >= {lo}, got {v!r}", name)
    return v


def _unsupported(name, v, ok=(None,)):
    if not any(v is o or (v == o and type(v) is type(o)) for o in ok):
        raise RequestError(f"{name}={v!r} is not supported by mixqrt", name)


def _stop(stop):
    """The stop rule is generate.check_stops (an empty string is refused, not dropped); here it
    becomes a 400 that names the parameter."""
    from mixqrt.generate import check_stops

    try:
        return check_stops(stop) or None
    except GenerationError as e:
        raise RequestError(str(e), "stop") from None


def _gen_kwargs(*, max_tokens, context, temperature, top_p, top_k, min_p, repeat_penalty, stop, seed,
                frequency_penalty, presence_penalty, n, logit_bias) -> dict:
    """OpenAI / llama-cpp names -> Pipeline.stream keyword arguments (None = model default)."""
    max_tokens = _integer("max_tokens", max_tokens)
    if max_tokens is None or max_tokens <= 0:   # llama-cpp: <= 0 or None = until the context is full
        max_tokens = int(context)
    kw = {"max_new_tokens": max_tokens,
          "temperature": _num("temperature", temperature, lo=0.0),
          "top_p": _num("top_p", top_p, lo=0.0, hi=1.0, lo_open=True),
          "top_k": _integer("top_k", top_k),
          "min_p": _num("min_p", min_p, lo=0.0, hi=1.0),
          "repetition_penalty": _num("repeat_penalty", repeat_penalty, lo=0.0, lo_open=True),
          "stop": _stop(stop),
          "seed": _integer("seed", seed)}
    if kw["top_k"] is not None and kw["top_k"] < 0:
        kw["top_k"] = 0                          # llama.cpp: top_k <= 0 means the whole vocabulary
    if kw["seed"] is not None and kw["seed"] < 0:
        kw["seed"] = None                        # llama.cpp: seed -1 means random
    for name, v in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if _num(name, v) not in (None, 0.0):
            raise RequestError(f"{name} is not supported (OpenAI's additive penalty); use repeat_penalty, "
                               "the multiplicative one of llama.cpp and transformers", name)
    n = _integer("n", n)
    if n not in (None, 1):
        raise RequestError(f"n={n} is not supported: one choice per request", "n")
    if logit_bias not in (None, {}):
        raise RequestError("logit_bias is not supported", "logit_bias")
    return {k: v for k, v in kw.items() if v is not None}


def _context(pipe) -> int:
    ctx = getattr(pipe, "max_context", None)
    if ctx is None:
        ctx = pipe.model.context_length
    return int(ctx)


def _content(i, m) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):          # OpenAI content parts: only text parts
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}",
                                   "messages")
            out.append(part["text"])
        return "".join(out)
    if c is None and (m.get("tool_calls") or m.get("role") == "assistant"):
        return None
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {c!r}", "messages")


def check_messages(messages) -> list[dict]:
    """Validate OpenAI chat messages -> [{"role", "content"}] for the model's chat template.

    "developer" (OpenAI's newer name for the system role) becomes "system"; an assistant
    message keeps its tool_calls and a "tool" message its tool_call_id (mixqrt.tools renders them
    for the template); other fields (name, ...) are dropped; "function" messages are rejected.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects",
                           "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content', got {m!r}", "messages")
        role = m.get("role")
        if role not in ROLES:
            what = "the deprecated 'function' role is not supported (use 'tool')" if role == "function" else \
                f"unknown role {role!r} (expected one of {', '.join(ROLES)})"
            raise RequestError(f"messages[{i}]: {what}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": _content(i, m)}
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"messages[{i}].tool_calls must be a list", "messages")
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", "{}"), (str, dict)):
                    raise RequestError(f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'id': ..., "
                                       "'function': {'name': ..., 'arguments': '<JSON text>'}}", "messages")
            msg["tool_calls"] = m["tool_calls"]
        elif msg["content"] is None:
            msg["content"] = ""
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise RequestError(f"messages[{i}].tool_call_id must be a string", "messages")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def structured_kwargs(response_format=None, tools=None, tool_choice=None, parallel_tool_calls=None) -> dict:
    """response_format / tools / tool_choice / parallel_tool_calls checked -> Engine.submit (and
    Pipeline.stream) keyword arguments; RequestError naming the field. The grammar itself is
    compiled by the engine (mixqrt.grammar), off the request's path."""
    from mixqrt.grammar import grammar_from_response_format
    from mixqrt.tools import check_tool_choice, check_tools

    try:
        checked = check_tools(tools)
        choice = check_tool_choice(tool_choice, checked)
        grammar_from_response_format(response_format)
    except FieldError as e:
        raise RequestError(str(e), e.field) from None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    kw = {}
    if response_format is not None:
        kw["response_format"] = response_format
    if checked:
        kw.update(tools=checked, tool_choice=choice if choice in ("none", "auto", "required") else
                  {"type": "function", "function": {"name": choice["name"]}})
        if parallel_tool_calls is not None:
            kw["parallel_tool_calls"] = parallel_tool_calls
    return kw


def chat_reply(tokenizer, kw: dict):
    """The tool-aware reply shape (mixqrt.tools.ChatReply) for structured_kwargs' result."""
    from mixqrt.tools import ChatReply, check_tool_choice, tool_format

    tools = kw.get("tools")
    if not tools:
        return ChatReply()
    return ChatReply(tools, check_tool_choice(kw.get("tool_choice"), tools), tool_format(tokenizer))


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, (list, tuple)) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _prompt_text(prompt[0])
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        raise RequestError("a batch of prompts is not supported: send one prompt per request", "prompt")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, int) for p in prompt):
        raise RequestError("token-id prompts are not supported: send the prompt as a string", "prompt")
    raise RequestError(f"prompt must be a non-empty string, got {type(prompt).__name__}", "prompt")


def model_name(pipe) -> str:
    name = getattr(pipe, "model_name", None)
    if name:
        return str(name)
    path = getattr(pipe, "path", None)
    return Path(str(path)).stem if path else "mixqrt"


# ============================================================================ running
def _responses(pipe, prompt, kw) -> Iterator:
    """pipe.stream(...) with a "context_length_exceeded" code on the too-long-prompt error."""
    it = iter(pipe.stream(prompt, **kw))
    try:
        while True:
            try:
                r = next(it)
            except StopIteration:
                return
            except RequestError:
                raise
            except FieldError as e:         # e.g. a grammar the engine could not compile
                raise RequestError(str(e), e.field, e.code) from e
            except GenerationError as e:
                msg = str(e)
                code = "context_length_exceeded" if "context" in msg and "prompt" in msg else None
                raise RequestError(msg, None, code) from e
            yield r
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _include_usage(stream_options) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object like {'include_usage': true}", "stream_options")
    return stream_options.get("include_usage", False)


def _usage(last) -> dict:
    p = int(getattr(last, "prompt_tokens", 0) or 0) if last is not None else 0
    c = int(getattr(last, "generation_tokens", 0) or 0) if last is not None else 0
    cached = int(getattr(last, "cached_tokens", 0) or 0) if last is not None else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}   # OpenAI's field: prompt-cache hits


def _head(prefix: str, obj: str, model: str | None, pipe) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": model if model is not None else model_name(pipe)}


class Stats:
    """The last GenerationResponse of a run (tokens/s, TTFT), for logging; None until it ends."""
    last = None


# ============================================================================ completions
def create_completion(pipe, prompt, *, suffix=None, max_tokens: int | None = 16, temperature: float | None = None,
                      top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                      repeat_penalty: float | None = None, frequency_penalty: float | None = None,
                      presence_penalty: float | None = None, stop=None, seed: int | None = None,
                      stream: bool = False, echo: bool = False, logprobs=None, n: int | None = None,
                      best_of: int | None = None, logit_bias=None, model: str | None = None,
                      stream_options=None, stats: Stats | None = None):
    """A "text_completion" dict, or with stream=True an iterator of chunk dicts of the same shape.

    Arguments are checked here, before anything runs; errors from the model (prompt longer than
    the context) come from the first next() of the stream. Closing the iterator stops generation.
    """
    text = _prompt_text(prompt)
    _unsupported("suffix", suffix, (None, ""))
    _unsupported("logprobs", logprobs, (None, 0, False))
    if _integer("best_of", best_of) not in (None, 1):
        raise RequestError("best_of > 1 is not supported", "best_of")
    for name, v in (("stream", stream), ("echo", echo)):
        if not isinstance(v, bool):
            raise RequestError(f"{name} must be true or false, got {v!r}", name)
    include_usage = _include_usage(stream_options)
    kw = _gen_kwargs(max_tokens=max_tokens, context=_context(pipe), temperature=temperature, top_p=top_p,
                     top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, stop=stop, seed=seed,
                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, n=n,
                     logit_bias=logit_bias)
    head = _head("cmpl", "text_completion", model, pipe)

    def choice(t, reason):
        return {"text": t, "index": 0, "logprobs": None, "finish_reason": reason}

    if not stream:
        pieces, last = [text] if echo else [], None
        for r in _responses(pipe, text, kw):
            pieces.append(r.text)
            last = r
        if stats is not None:
            stats.last = last
        reason = getattr(last, "finish_reason", None) or "stop"
        return {**head, "choices": [choice("".join(pieces), reason)], "usage": _usage(last)}

    def chunks():
        responses = _responses(pipe, text, kw)
        last, first = None, True
        try:
            for r in responses:
                last = r
                piece = (text + r.text) if (first and echo) else r.text
                first = False
                if piece:
                    yield {**head, "choices": [choice(piece, None)]}
        finally:
            responses.close()
        if stats is not None:
            stats.last = last
        yield {**head, "choices": [choice("", getattr(last, "finish_reason", None) or "stop")]}
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(last)}

    return chunks()


# ============================================================================ chat
def create_chat_completion(pipe, messages, *, max_tokens: int | None = None, temperature: float | None = None,
                           top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                           repeat_penalty: float | None = None, frequency_penalty: float | None = None,
                           presence_penalty: float | None = None, stop=None, seed: int | None = None,
                           stream: bool = False, logprobs=None, top_logprobs=None, n: int | None = None,
                           logit_bias=None, response_format=None, tools=None, tool_choice=None,
                           parallel_tool_calls=None, functions=None, function_call=None, model: str | None = None,
                           stream_options=None, stats: Stats | None = None):
    """A "chat.completion" dict, or with stream=True an iterator of "chat.completion.chunk" dicts:
    delta {"role": "assistant"}, then {"content": piece}..., then {} with finish_reason.

    The prompt is the model's own chat template with the generation prompt appended.
    stream_options={"include_usage": True} adds OpenAI's last chunk (empty choices, usage).
    response_format (json_object, json_schema, and mixqrt's regex / grammar: mixqrt.grammar)
    constrains the reply; tools / tool_choice / parallel_tool_calls as OpenAI defines them
    (mixqrt.tools): the template renders the tools, the reply's calls come back as
    message.tool_calls with finish_reason "tool_calls" (streamed as tool_calls deltas).
    """
    msgs = check_messages(messages)
    _unsupported("logprobs", logprobs, (None, False))
    _unsupported("top_logprobs", top_logprobs, (None, 0))
    if functions not in (None, []):
        raise RequestError("functions (the deprecated form of tools) is not supported; use tools", "functions")
    _unsupported("function_call", function_call, (None, "none", "auto"))
    skw = structured_kwargs(response_format, tools, tool_choice, parallel_tool_calls)
    reply = chat_reply(getattr(pipe, "tokenizer", None), skw)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = _include_usage(stream_options)
    kw = _gen_kwargs(max_tokens=max_tokens, context=_context(pipe), temperature=temperature, top_p=top_p,
                     top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, stop=stop, seed=seed,
                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, n=n,
                     logit_bias=logit_bias)
    kw.update(skw)
    head = _head("chatcmpl", "chat.completion", model, pipe)

    if not stream:
        pieces, last = [], None
        for r in _responses(pipe, msgs, kw):
            pieces.append(r.text)
            last = r
        if stats is not None:
            stats.last = last
        message, reason = reply.message("".join(pieces), getattr(last, "finish_reason", None))
        return {**head, "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "usage": _usage(last)}

    head["object"] = "chat.completion.chunk"

    def chunk(delta, reason=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    def chunks():
        responses = _responses(pipe, msgs, kw)
        last = None
        try:
            last = next(responses, None)   # prefill first: a too-long prompt fails before any chunk
            yield chunk({"role": "assistant"})
            if last is not None:
                for d in reply.deltas(last.text):
                    yield chunk(d)
                for r in responses:
                    last = r
                    for d in reply.deltas(r.text):
                        yield chunk(d)
        finally:
            responses.close()
        if stats is not None:
            stats.last = last
        tail, reason = reply.end(getattr(last, "finish_reason", None))
        for d in tail:
            yield chunk(d)
        yield chunk({}, reason)
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(last)}

    return chunks()

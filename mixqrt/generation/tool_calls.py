"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) for a model's chat template.

    fmt = tool_format(tokenizer)                       # "qwen" (<tool_call> JSON) or "llama3"
    msgs = template_messages(openai_messages)          # tool results / assistant calls for the template
    g = tool_grammar(tokenizer, tools, "required", parallel=True)   # lark text, or None (no constraint)
    calls, content = parse_tool_calls(text, fmt, tools)
    stream = ToolStream(fmt, tools); stream.feed(piece) -> events; stream.finish() -> events

Formats the replies are parsed from:
  qwen:   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Hermes-style
          templates; one block per call). Also used for a template that does not render tools at
          all: the tools are then described in a system message of mixqrt's own.
  llama3: {"name": "f", "parameters": {...}}   (Llama 3.1's JSON tool calls, optionally after
          <|python_tag|>; several separated by ';').
`required` and a named function are constrained by a grammar (mixqrt.generation.grammar), so the arguments
always parse and match the function's parameter schema; `auto` leaves the model free and parses
what it wrote; `none` leaves the tools out of the prompt.
"""
from __future__ import annotations

import json
import re
import uuid

from mixqrt.errors import RequestError

__all__ = ["check_tools", "check_tool_choice", "tool_format", "template_messages", "tool_grammar",
           "parse_tool_calls", "ToolStream", "system_prompt_for_tools", "MAX_TOOLS"]

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


# ============================================================================ request checks
def check_tools(tools) -> list[dict] | None:
    """OpenAI's tools list -> the same list with 'parameters' filled in; RequestError("tools")."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError("tools", f"tools must be a list of at most {MAX_TOOLS} function tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'")
        if name in seen:
            raise RequestError("tools", f"tools[{i}]: the function name {name!r} is used twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise RequestError("tools", f"tools[{i}].function.description must be a string")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def check_tool_choice(tool_choice, tools) -> str | dict:
    """-> "none" | "auto" | "required" | {"name": f}; the OpenAI default is "auto" with tools,
    "none" without."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise RequestError("tool_choice", "tool_choice 'required' needs tools")
        return tool_choice
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if not any(t["function"]["name"] == name for t in tools or ()):
                raise RequestError("tool_choice", f"tool_choice names {name[:64]!r}, which is not in tools")
            return {"name": name}
    raise RequestError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}")


# ============================================================================ templates
def _template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default") or ""
    return t or ""


def tool_format(tokenizer) -> str:
    """Which call syntax the model's template teaches: "llama3" or "qwen" (also the fallback)."""
    t = _template_text(tokenizer)
    if "<tool_call>" not in t and ("<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t)):
        return "llama3"
    return "qwen"


def renders_tools(tokenizer) -> bool:
    """The template itself does something with `tools`."""
    return "tools" in _template_text(tokenizer)


def system_prompt_for_tools(tools) -> str:
    """A system message describing the tools and the <tool_call> syntax, for a template that does
    not render tools itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _arguments(i: int, j: int, v):
    if isinstance(v, dict):
        return v
    if isinstance(v, str):
        try:
            out = json.loads(v) if v.strip() else {}
        except (ValueError, RecursionError):
            raise RequestError("messages", f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        if isinstance(out, dict):
            return out
    raise RequestError("messages", f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")


def template_messages(messages: list[dict], tokenizer=None, tools=None) -> list[dict]:
    """Checked OpenAI messages -> what chat templates expect: assistant tool_calls with their
    arguments as objects (OpenAI sends JSON text), tool results as {"role": "tool", "content",
    "tool_call_id", "name"}; content None -> "". When the template does not render tools, they
    go into (or before) the system message."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise RequestError("messages", f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError("messages", f"messages[{i}].tool_calls[{j}] must have function.name")
                fixed.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": _arguments(i, j, fn.get("arguments"))}})
            m["tool_calls"] = fixed
        elif "tool_calls" in m:
            m.pop("tool_calls")
        out.append(m)
    if tools and tokenizer is not None and not renders_tools(tokenizer):
        text = system_prompt_for_tools(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
        out = [_plain(m) for m in out]
    return out


def _plain(m: dict) -> dict:
    """For a template without tool support: tool calls and results as ordinary text turns."""
    if m.get("role") == "assistant" and m.get("tool_calls"):
        body = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments":
                                                       c["function"]["arguments"]}, ensure_ascii=False)
                         + "\n</tool_call>" for c in m["tool_calls"])
        return {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + body}
    if m.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return m


# ============================================================================ grammar
def _call_schema(tool: dict, fmt: str) -> dict:
    fn = tool["function"]
    key = "parameters" if fmt == "llama3" else "arguments"
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def _tag(tokenizer, text: str) -> str:
    """A lark atom for a tag: the token itself when the vocabulary has it as one added token
    (llguidance treats added tokens as special), else the literal text."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def tool_grammar(tokenizer, tools, tool_choice, parallel: bool = True) -> str | None:
    """Lark grammar text that forces tool calls for "required" / a named function; None otherwise."""
    if tool_choice in (None, "none", "auto") or not tools:
        return None
    if isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["name"]]
        parallel = False
    else:
        chosen = tools
    fmt = tool_format(tokenizer)
    schemas = [_call_schema(t, fmt) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    from mixqrt.generation.grammar import JSON_OPTIONS
    schema = {**schema, "x-guidance": JSON_OPTIONS}     # the layout of response_format's JSON
    obj = "obj: %json " + json.dumps(schema, ensure_ascii=False)
    if fmt == "llama3":
        more = '(";" obj)*' if parallel else ""
        return f"start: obj {more}\n{obj}\n"
    call = f'call: {_tag(tokenizer, "<tool_call>")} "\\n" obj "\\n" {_tag(tokenizer, "</tool_call>")}'
    more = '("\\n" call)*' if parallel else ""
    return f"start: call {more}\n{call}\n{obj}\n"


# ============================================================================ parsing
_QWEN_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(name, args) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)
                         if not isinstance(args, str) else args}}


def _one(body: str, names: set, fmt: str):
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], args)


def parse_tool_calls(text: str, fmt: str, tools) -> tuple[list[dict], str | None]:
    """The reply's text -> (OpenAI tool_calls, remaining content or None). A reply whose calls do
    not parse, or name a function not in tools, is content with no calls."""
    names = {t["function"]["name"] for t in tools or ()}
    if not names:
        return [], text
    if fmt == "llama3":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return [], text
        calls = [_one(p, names, fmt) for p in _split_json(body)]
        if calls and all(calls):
            return calls, None
        return [], text
    if "<tool_call>" not in text:
        # a small model sometimes leaves the tags out: a reply that is exactly one call's JSON
        body = text.strip()
        call = _one(body, names, fmt) if body.startswith("{") else None
        return ([call], None) if call is not None else ([], text)
    blocks = _QWEN_BLOCK.findall(text)
    if blocks and not re.search(r"</tool_call>\s*$", text) and len(blocks) > 1 and _one(blocks[-1], names, fmt) is None:
        blocks = blocks[:-1]            # the budget ran out inside a further call: drop that one
    calls = [_one(b, names, fmt) for b in blocks]
    if not calls or not all(calls):
        return [], text
    content = _QWEN_BLOCK.sub("", text).strip()
    if len(blocks) < len(_QWEN_BLOCK.findall(text)):
        content = text[:text.find("<tool_call>")].strip()
    return calls, content or None


def _split_json(body: str) -> list[str]:
    """'{...}; {...}' -> the JSON texts (split on ';' outside strings and braces)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            elif ch != "\\":
                esc = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


class ToolStream:
    """Streaming: text pieces in, events out — ("content", text) for text that is surely not part
    of a call, ("call", index, tool_call) once a call is complete. Text that could still become a
    call is held back; a reply that starts with "{" (a call without tags, Llama 3.1's form) is held
    to the end; at the end, a call that did not parse comes out as content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: str, tools):
        self.fmt = fmt
        self.tools = tools
        self.names = {t["function"]["name"] for t in tools or ()}
        self.buf = ""
        self.n = 0
        self.whole = None           # True: hold the whole reply (it starts like a bare JSON call)

    def feed(self, piece: str) -> list[tuple]:
        self.buf += piece
        if self.whole is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self.whole = head.startswith("{") or head.startswith("<|python_tag|>")
        if self.whole:
            return []
        if self.fmt == "llama3":
            out, self.buf = self.buf, ""
            return [("content", out)]
        events = []
        while True:
            i = self.buf.find(self.OPEN)
            if i < 0:
                hold = max((k for k in range(1, len(self.OPEN)) if self.buf.endswith(self.OPEN[:k])), default=0)
                cut = len(self.buf) - hold
                if self.n and not self.buf[:cut].strip():
                    cut = 0                 # whitespace between calls: held (dropped at the end)
                if cut > 0:
                    events.append(("content", self.buf[:cut]))
                    self.buf = self.buf[cut:]
                return events
            if i > 0:
                if not (self.n and not self.buf[:i].strip()):
                    events.append(("content", self.buf[:i]))
                self.buf = self.buf[i:]
            j = self.buf.find(self.CLOSE)
            if j < 0:
                return events
            block, self.buf = self.buf[:j + len(self.CLOSE)], self.buf[j + len(self.CLOSE):]
            call = _one(block[len(self.OPEN):-len(self.CLOSE)].strip(), self.names, self.fmt)
            if call is None:
                events.append(("content", block))
            else:
                events.append(("call", self.n, call))
                self.n += 1

    def finish(self) -> list[tuple]:
        rest, self.buf = self.buf, ""
        if not rest.strip():
            return [] if self.n or not rest else [("content", rest)]
        calls, content = parse_tool_calls(rest, self.fmt, self.tools)
        events = [("call", self.n + k, c) for k, c in enumerate(calls)]
        self.n += len(calls)
        if content:
            events.insert(0, ("content", content))
        return events


# ============================================================================ OpenAI reply shapes
class ChatReply:
    """A chat reply's OpenAI shape when tools are in play: the message (content and tool_calls),
    the stream's deltas (content pieces; for each call its id, type and name first, then its
    arguments), and finish_reason "tool_calls" when the model called tools. With tool_choice
    "none" (or no tools) it passes text through unchanged."""

    def __init__(self, tools=None, tool_choice="none", fmt: str = "qwen"):
        self.active = bool(tools) and tool_choice != "none"
        self.tools, self.fmt = tools, fmt
        self.stream = ToolStream(fmt, tools) if self.active else None
        self.calls = 0

    def message(self, text: str, reason: str | None) -> tuple[dict, str]:
        if not self.active:
            return {"role": "assistant", "content": text}, reason or "stop"
        calls, content = parse_tool_calls(text, self.fmt, self.tools)
        if not calls:
            return {"role": "assistant", "content": text}, reason or "stop"
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if reason in (None, "stop") else reason)

    def _deltas(self, events) -> list[dict]:
        out = []
        for ev in events:
            if ev[0] == "content":
                if ev[1]:
                    out.append({"content": ev[1]})
                continue
            _, i, call = ev
            self.calls += 1
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": call["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
        return out

    def deltas(self, piece: str) -> list[dict]:
        if not self.active:
            return [{"content": piece}] if piece else []
        return self._deltas(self.stream.feed(piece))

    def end(self, reason: str | None) -> tuple[list[dict], str]:
        """-> (the last deltas, the finish_reason)."""
        if not self.active:
            return [], reason or "stop"
        out = self._deltas(self.stream.finish())
        return out, ("tool_calls" if self.calls and reason in (None, "stop") else (reason or "stop"))


def chat_ids(tokenizer, messages, tools=None, tool_choice=None) -> list[int]:
    """Prompt ids of checked chat messages with the tools rendered by the model's template (or,
    for a template without tool support, described in a system message). tool_choice "none"
    leaves the tools out of the prompt."""
    rendered = tools if tools and check_tool_choice(tool_choice, tools) != "none" else None
    msgs = template_messages(list(messages), tokenizer, rendered)
    return tokenizer.encode_chat(msgs, add_generation_prompt=True,
                                 tools=rendered if rendered and renders_tools(tokenizer) else None)

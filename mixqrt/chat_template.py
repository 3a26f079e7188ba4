"""Chat templates rendered the way transformers renders them, from the model's own Jinja text.

render_parts() marks which characters of the prompt came from message text, so that the tokenizer
can encode that text with special tokens off (only the template may emit control tokens).

Same environment as transformers' apply_chat_template: an immutable sandbox (templates come from
downloaded files and must not reach Python internals), trim_blocks/lstrip_blocks, loop controls,
raise_exception(), a tojson that keeps non-ASCII text readable, and strftime_now(). Matching it
matters: a template rendered with different whitespace rules produces a prompt the model never
saw in training.
"""
from __future__ import annotations

import json
import secrets
from datetime import datetime
from functools import lru_cache

from mixqrt.errors import GenerationError, ModelError


class TemplateError(GenerationError):
    """The template itself called raise_exception() (e.g. roles not alternating)."""


def _raise_exception(message):
    raise TemplateError(f"chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template does not parse (line {e.lineno}): {e.message}") from None


def render(source: str, messages, *, add_generation_prompt: bool = True, tools=None, **context) -> str:
    """Render `source` with transformers' variable names (messages, tools, add_generation_prompt...)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise GenerationError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise GenerationError(f"messages[{i}] has no 'role'")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise GenerationError("tools must be a list of JSON-schema dicts")
    import jinja2

    tmpl = compile_template(source)
    try:
        return tmpl.render(messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                           **context)
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise GenerationError(f"chat template failed to render: {e}") from None


def render_parts(source: str, messages, *, add_generation_prompt: bool = True, tools=None,
                 **context) -> list[tuple[str, bool]]:
    """The rendered prompt as [(text, from_message)] pieces; "".join(texts) == render(...).

    Each message's string content is rendered once as a random placeholder; the pieces between
    placeholders are the template's own text. When a template transforms the content (trim,
    slicing, upper...) the placeholders do not map back exactly, and the whole prompt is one
    message piece: nothing in it is then trusted to be a control token except what the caller
    finds outside message text, i.e. nothing (safe, at the price of a prompt without turns).
    """
    text = render(source, messages, add_generation_prompt=add_generation_prompt, tools=tools, **context)
    nonce = secrets.token_hex(8)
    marks, contents, masked = [], [], []
    for i, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, str) and c:
            mark = f"@@mixqrt-{nonce}-{i}@@"
            marks.append(mark)
            contents.append(c)
            m = {**m, "content": mark}
        masked.append(m)
    if not marks:
        return [(text, False)]
    tmpl = render(source, masked, add_generation_prompt=add_generation_prompt, tools=tools, **context)
    parts, rest = [], tmpl
    for mark, c in zip(marks, contents):
        head, sep, rest = rest.partition(mark)
        if not sep or mark in rest:
            return [(text, True)]
        parts += [(head, False), (c, True)]
    parts.append((rest, False))
    if "".join(t for t, _ in parts) != text:
        return [(text, True)]
    return [(t, user) for t, user in parts if t]

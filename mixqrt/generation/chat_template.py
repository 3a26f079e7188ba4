"""Chat templates rendered the way transformers renders them, from the model's own Jinja text.

render_parts() marks which characters of the prompt came from message text, so that the tokenizer
can encode that text with special tokens off (only the template may emit control tokens).

Same environment as transformers' apply_chat_template: an immutable sandbox (templates come from
downloaded files and must not reach Python internals), trim_blocks/lstrip_blocks, loop controls,
raise_exception(), a tojson that keeps non-ASCII text readable, and strftime_now(). Matching it
matters: a template rendered with different whitespace rules produces a prompt the model never
saw in training.

Templates come with downloaded models: they are untrusted input. Beyond the sandbox's own checks
(no Python internals, no mutation of lists and dicts, range() of at most 100,000), each render is
bounded (issue 39): MAX_TEMPLATE_CHARS of output, MAX_TEMPLATE_WORK characters built by string
operations (`*`, `+`, `~`, `%`, join, replace, padding and format widths are checked before they
run, so `'x' * 10**9` is refused without allocating it), MAX_TEMPLATE_STEPS loop iterations and
MAX_TEMPLATE_SECONDS. Over a bound, or on any exception inside the template (`1/0`), render()
raises TemplateError naming it: a typed error for that request (a 400 from the server), never a
500 or an out-of-memory kill. probe() renders a small conversation, for a warning at load.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import time
from datetime import datetime
from functools import lru_cache

from mixqrt.errors import GenerationError, MixqrtError, ModelError

MAX_TEMPLATE_CHARS = 4 << 20        # the rendered prompt, and any one value (a 1 MiB request body, in turns)
MAX_TEMPLATE_WORK = 64 << 20        # characters built by string operations during one render
# ... and relative to what the render was given: a template may wrap the messages and tools it
# renders, not invent text, since the prompt is then tokenized (~200 bytes of peak memory a
# character): at most TEMPLATE_GROWTH x their characters + TEMPLATE_OWN_CHARS + 2 x its own source,
# for the output and each value, and 8x that for the work
TEMPLATE_GROWTH = 2
TEMPLATE_OWN_CHARS = 64 << 10
MAX_TEMPLATE_STEPS = 1_000_000      # loop iterations during one render
MAX_TEMPLATE_SECONDS = 2.0          # one render's wall time
MAX_POWER_BITS = 4096               # 2**4096: larger powers are refused before they are computed


class TemplateError(GenerationError):
    """The template refused the messages (raise_exception()), failed (an exception inside it), or
    went over one of the render bounds."""


def _raise_exception(message):
    raise TemplateError(f"chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and not 0 <= indent <= 64 or isinstance(indent, str) and len(indent) > 64:
        raise TemplateError(f"chat template: tojson(indent={str(indent)[:20]}) is over 64")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


# ============================================================================ render bounds
_budget = threading.local()         # the render running on this thread: steps, work, deadline


class _Budget:
    __slots__ = ("steps", "work", "deadline", "chars", "work_limit")

    def __init__(self, chars: int = MAX_TEMPLATE_CHARS):
        self.steps, self.work, self.deadline = 0, 0, time.monotonic() + MAX_TEMPLATE_SECONDS
        self.chars = min(MAX_TEMPLATE_CHARS, chars)
        self.work_limit = min(MAX_TEMPLATE_WORK, 8 * self.chars)


def _over(what: str):
    raise TemplateError(f"chat template went over {what}; refused (a hostile or broken template)")


def _tick(n: int = 1) -> None:
    b = getattr(_budget, "b", None)
    if b is None:
        return
    b.steps += n
    if b.steps > MAX_TEMPLATE_STEPS:
        _over(f"{MAX_TEMPLATE_STEPS} loop steps (MAX_TEMPLATE_STEPS)")
    if time.monotonic() > b.deadline:
        _over(f"{MAX_TEMPLATE_SECONDS:g} s (MAX_TEMPLATE_SECONDS)")


def _spend(n: int) -> None:
    """About to build a string or list of `n` characters/items: within the bounds, or refused."""
    b = getattr(_budget, "b", None)
    if n > (b.chars if b is not None else MAX_TEMPLATE_CHARS):
        _over(f"{b.chars if b is not None else MAX_TEMPLATE_CHARS} characters in one value (MAX_TEMPLATE_CHARS, "
              "TEMPLATE_GROWTH)")
    if b is not None:
        b.work += n
        if b.work > b.work_limit:
            _over(f"{b.work_limit} characters built (MAX_TEMPLATE_WORK)")
        _tick(0)


def _size(x, cap: int = MAX_TEMPLATE_CHARS) -> int:
    """About how many characters str(x) has: strings' lengths summed through lists, tuples and
    dicts (a list of 1000 references to one long string counts it 1000 times, as str() would);
    the walk stops once past `cap`."""
    if isinstance(x, (str, bytes)):
        return len(x)
    if not isinstance(x, (list, tuple, dict)):
        return 0
    n, todo = 0, [x]
    while todo and n <= cap:
        v = todo.pop()
        if isinstance(v, (str, bytes)):
            n += len(v)
        elif isinstance(v, (list, tuple)):
            n += 2 * len(v)
            todo.extend(v)
        elif isinstance(v, dict):
            n += 4 * len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
        else:
            n += 1
    return n


def _check_args(args, kwargs) -> None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple, dict)) and _size(a) > MAX_TEMPLATE_CHARS:
            _over(f"{MAX_TEMPLATE_CHARS} characters in one value (MAX_TEMPLATE_CHARS)")


def _finalize(value):
    """Every {{ value }} before it becomes text."""
    if isinstance(value, (list, tuple, dict)):
        _spend(_size(value))
    return value


_WIDTH = re.compile(r"[0-9]+")


def _check_widths(fmt) -> None:
    """A format string (for %, |format, str.format) must not ask for a field wider than the bound."""
    if isinstance(fmt, str) and any(int(n) > MAX_TEMPLATE_CHARS for n in _WIDTH.findall(fmt) if len(n) < 40) or \
            isinstance(fmt, str) and any(len(n) >= 40 for n in _WIDTH.findall(fmt)):
        _over(f"{MAX_TEMPLATE_CHARS} characters in one field width (MAX_TEMPLATE_CHARS)")


def _bounded_iter(it):
    """Every `{% for %}` loop iterates through this (the template cannot name or replace it)."""
    for x in it:
        _tick()
        yield x


def _concat(parts):
    """`a ~ b ~ c`, sized before it is built."""
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    _spend(sum(map(len, strs)))
    return "".join(strs)


def _estimate_call(fn, args, kwargs) -> int:
    """The size of what str methods and padding filters would build (0: nothing large)."""
    name = getattr(fn, "__name__", "")
    owner = getattr(fn, "__self__", None)
    ints = [a for a in list(args) + list(kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if isinstance(owner, str):
        if name in ("ljust", "rjust", "center", "zfill"):
            return max(ints, default=0)
        if name == "expandtabs":
            return len(owner) * max(ints or [8])
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            hits = len(owner) + 1 if args[0] == "" else owner.count(args[0])
            return len(owner) + hits * len(args[1])
        if name == "join" and isinstance(args[0] if args else None, (list, tuple)):
            return len(owner) * len(args[0]) + sum(_size(x) for x in args[0])
        if name in ("format", "format_map"):
            _check_widths(owner)
    return max(ints, default=0) if name in ("center", "indent", "do_center", "do_indent") else 0


def _environment():
    import operator

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/"})

        def call_binop(self, context, op, left, right):
            _tick()
            if op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                        _spend(max(len(seq), _size(seq)) * max(0, n))
            elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    max(1, abs(left).bit_length()) * right > MAX_POWER_BITS and abs(left) > 1:
                _over(f"2**{MAX_POWER_BITS} in one number (MAX_POWER_BITS)")
            elif op == "+" and isinstance(left, (str, list, tuple)):
                _spend(_size(left) + _size(right))
            elif op == "%" and isinstance(left, str):
                _check_widths(left)
                _spend(len(left) + sum(_size(a) for a in (right if isinstance(right, tuple) else (right,))))
            return {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod,
                    "//": operator.floordiv, "/": operator.truediv}[op](left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 — the sandbox's own signature
            _tick()
            _check_args(args, kwargs)
            n = _estimate_call(getattr(__obj, "__wrapped__", __obj), args, kwargs)
            if n:
                _spend(n)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _tick(0)
            return super().getattr(obj, attribute)

    return BoundedEnvironment


def _bounded_filter(f, estimate=None):
    """A filter checked before it runs: no argument over the size bound (most filters str() their
    value), and `estimate` (what it builds) within the bounds."""
    def bounded(*args, **kwargs):
        _tick()
        _check_args(args, kwargs)
        n = estimate(*args, **kwargs) if estimate is not None else 0
        if n:
            _spend(n)
        return f(*args, **kwargs)
    bounded.__name__ = getattr(f, "__name__", "filter")
    for attr in ("jinja_pass_arg",):
        if hasattr(f, attr):
            setattr(bounded, attr, getattr(f, attr))
    return bounded


def _filter_estimates():
    def width(value, width=80, *a, **k):
        return (_size(value) + abs(width) * (_size(value) // 40 + 2)) if isinstance(width, int) else \
            _size(value) * (_size(width) + 1)

    def fmt(value, *args, **kwargs):
        _check_widths(value)
        return _size(value) + sum(_size(a) for a in args)

    def replace(*args, **kwargs):
        s, old, new = (list(args[-3:]) + [None] * 3)[:3] if len(args) >= 3 else (None, None, None)
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            hits = len(s) + 1 if old == "" else s.count(old)
            return len(s) + hits * len(new)
        return 0

    return {"center": width, "indent": width, "format": fmt, "replace": replace}


def _join(eval_ctx, value, d="", attribute=None):
    """|join, sized before it is built (the items are counted, then joined by jinja's own)."""
    from jinja2.filters import do_join
    items = []
    for x in value:
        _tick()
        items.append(x)
    if attribute is None:
        _spend(len(str(d)) * len(items) + sum(_size(x) if isinstance(x, (str, list, tuple, dict)) else 24
                                              for x in items))
    return do_join(eval_ctx, items, d, attribute)


def _bound_tree(tree):
    """Route every for-loop's iterable through the loop bound and every `~` through _concat: as
    filters, which a template cannot define or shadow (a global could be `{% set %}` over)."""
    from jinja2 import nodes
    for node in tree.find_all(nodes.For):
        node.iter = nodes.Filter(node.iter, "mixqrt_bounded_iter", [], [], None, None, lineno=node.lineno)
    for node in list(tree.find_all(nodes.Concat)):
        node.__class__ = nodes.Filter
        parts = node.nodes
        del node.nodes
        node.node, node.name, node.args, node.kwargs, node.dyn_args, node.dyn_kwargs = \
            nodes.List(parts, lineno=node.lineno), "mixqrt_concat", [], [], None, None
    return tree


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols

    env = _environment()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    from jinja2.utils import pass_eval_context
    env.filters["join"] = pass_eval_context(_join)
    estimates = _filter_estimates()
    for name in list(env.filters):
        env.filters[name] = _bounded_filter(env.filters[name], estimates.get(name))
    env.finalize = _finalize
    env.filters["mixqrt_bounded_iter"] = _bounded_iter
    env.filters["mixqrt_concat"] = _concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(_bound_tree(env.parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template does not parse (line {e.lineno}): {e.message}") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as e:
        raise ModelError(f"chat template cannot be compiled: {type(e).__name__}: {str(e)[:200]}") from None


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
    outer = getattr(_budget, "b", None)
    given = _size(list(messages), MAX_TEMPLATE_CHARS) + _size(tools or [], MAX_TEMPLATE_CHARS) + \
        sum(_size(v, MAX_TEMPLATE_CHARS) for v in context.values())
    _budget.b = b = _Budget(TEMPLATE_GROWTH * given + TEMPLATE_OWN_CHARS + 2 * len(source))
    try:
        out, n = [], 0
        for chunk in tmpl.generate(messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                                   **context):
            n += len(chunk)
            if n > b.chars:
                _over(f"{b.chars} characters of output (MAX_TEMPLATE_CHARS, TEMPLATE_GROWTH)")
            _tick(0)
            out.append(chunk)
        text = "".join(out)
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TemplateError(f"chat template wrote a lone surrogate (\\u{ord(text[e.start]):04x}), "
                                    "not text") from None
        return text
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template tried an unsafe operation: {str(e)[:300]}") from None
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {str(e)[:300]}") from None
    except MixqrtError:
        raise
    except (Exception, RecursionError, MemoryError) as e:  # noqa: BLE001 — anything inside the template
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {str(e)[:200]}") from None
    finally:
        _budget.b = outer


PROBE_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"},
                  {"role": "user", "content": "What is 2+2?"}]


def probe(source: str, **context) -> str | None:
    """Why `source` cannot render a small conversation (with, then without, a system turn), or None."""
    try:
        compile_template(source)
    except MixqrtError as e:
        return str(e)
    err = None
    for msgs in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):
        try:
            render(source, msgs, add_generation_prompt=True, **context)
            return None
        except MixqrtError as e:
            err = err or str(e)
    return err


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

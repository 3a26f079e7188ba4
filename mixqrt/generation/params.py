"""One request object: ``SamplingParams``, every generation option of a request once.

    p = SamplingParams(max_new_tokens=64, temperature=0.7, stop=["\\n\\n"])     # checked here
    pipe.stream(messages, p)          # or pipe.stream(messages, temperature=0.7): kwargs build one
    engine.submit(ids, p)             # Engine, Pipeline, api and mixqrt.serving.protocol (the HTTP body) all take it

Each option is one ``Param`` of ``PARAMS`` below: its name (the Python and transformers spelling,
the attribute), its default, its check (type and bounds; a bad value raises ``RequestError`` naming
the spelling the caller used), its other keyword spellings, its spellings in an OpenAI request
body (``mixqrt.serving.protocol`` parses a body into a SamplingParams from them, so a new option with an
``openai`` spelling is served over HTTP too) and, for an option that edits the logits, the
processor it adds. The limits shared by the Python and HTTP APIs (n, top_logprobs, logit_bias,
stop strings, "until the context is full") are defined here once.

Adding an option: one ``Param(...)`` entry in PARAMS (plus its test); see docs/architecture.md,
"Adding a request field". A value left at None means "not given": the model's generation_config
(generate.resolve_sampling) or the default below applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mixqrt.errors import RequestError
from mixqrt.generation.sampling import (MAX_LOGIT_BIAS, check_logit_bias, make_logit_bias, make_presence_frequency_penalty,
                                 make_repetition_penalty)
from mixqrt.generation.validate import boolean, integer, json_size, number, show, string

__all__ = ["SamplingParams", "Param", "PARAMS", "add_param", "UNTIL_FULL", "MAX_N", "MAX_TOP_LOGPROBS",
           "MAX_LOGIT_BIAS", "MAX_STOP", "MAX_STOP_BYTES", "SEED_RANGE", "KINDS"]

# ---------------------------------------------------------------------------- limits (the only copy)
UNTIL_FULL = 0                      # max_new_tokens <= 0 (or an HTTP body without max_tokens): until the
                                    # context is full (the prompt's room left in the context)
DEFAULT_MAX_NEW_TOKENS = 256
MAX_N = 8                           # choices per request
MAX_TOP_LOGPROBS = 20               # OpenAI's bound
MAX_STOP = 4                        # OpenAI's limits on stop strings
MAX_STOP_BYTES = 256
MAX_CACHE_SALT = 1024               # characters (a server prefixes the HTTP field's <= 256 with its key's hash)
MAX_ID_CHARS = 256                  # cache_salt over HTTP (and oai's user)
MAX_SPEC_BYTES = 128 << 10          # a response_format / one tool, serialized
MAX_TOOLS_BYTES = 512 << 10         # all tools together
MAX_NAME = 64                       # a function / schema name (OpenAI: ^[a-zA-Z0-9_-]{1,64}$)
SEED_RANGE = (-(1 << 63), 1 << 64)  # int64 or uint64 seeds; negative = random (llama.cpp's -1)
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")   # the last two: mixqrt's
KINDS = ("chat", "completion")      # OpenAI's request kinds


# ---------------------------------------------------------------------------- checks of the options
def _opt_number(**bounds):
    return lambda name, v: number(name, v, **bounds)


def _max_new_tokens(name, v) -> int:
    """transformers' max_new_tokens is >= 1; OpenAI's and llama-cpp-python's max_tokens <= 0 is
    "until the context is full" (UNTIL_FULL)."""
    if name == "max_new_tokens":
        return integer(name, v, lo=1)
    v = integer(name, v, lo=None)
    return v if v > 0 else UNTIL_FULL


def _top_k(name, v) -> int:
    return max(integer(name, v, lo=None), 0)         # llama.cpp: top_k <= 0 means the whole vocabulary


def _seed(name, v):
    v = integer(name, v, lo=SEED_RANGE[0], hi=SEED_RANGE[1] - 1)
    return None if v < 0 else v                      # llama.cpp: seed -1 means random


def check_stops(name, stop) -> list[str] | None:
    """A stop string or a list of them: at most MAX_STOP of 1 to MAX_STOP_BYTES bytes each (OpenAI's
    limits; an empty one would end every reply at once)."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise RequestError(name, f"{name} must be a string or a list of strings, got {show(stop)}")
    if len(stops) > MAX_STOP:
        raise RequestError(name, f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise RequestError(name, f"{name}: stop strings must be non-empty (an empty one would end the reply at once)")
    if any(len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for s in stops):
        raise RequestError(name, f"a stop string is at most {MAX_STOP_BYTES} bytes")
    return list(stops) or None


def _function_name(field, v):
    import re
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", v):
        raise RequestError(field, f"{field}: a function name is 1-{MAX_NAME} of a-z, A-Z, 0-9, _ and -, "
                                  f"got {show(v)}")
    return v


def check_response_format(name, v) -> dict | None:
    """Shape and size, and the kind of format (mixqrt.generation.grammar); the grammar compiles in the engine.
    {"type": "text"} -> None."""
    from mixqrt.generation.grammar import grammar_from_response_format

    if not isinstance(v, dict) or v.get("type") not in FORMAT_TYPES:
        raise RequestError(name, f"{name} must be an object with 'type' one of "
                                 f"{', '.join(FORMAT_TYPES)}, got {show(v)}")
    json_size(name, v, MAX_SPEC_BYTES)
    t = v["type"]
    if t == "text":
        return None
    if t == "json_object" and v.get("schema") is not None and not isinstance(v.get("schema"), dict):
        raise RequestError(name, f"{name}.schema must be a JSON schema object")
    if t == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise RequestError(name, f"{name} json_schema must be {{'json_schema': {{'name': ..., "
                                     "'schema': {...}}}")
        if js.get("name") is not None:
            _function_name(name, js["name"])
        if js.get("strict") is not None:
            boolean(name, js["strict"])
    if t in ("regex", "grammar") and (not isinstance(v.get(t), str) or not v[t]):
        raise RequestError(name, f"{name} of type {t!r} needs a non-empty string {t!r}")
    grammar_from_response_format(v, name)
    return v


def check_tools_shape(name, v) -> list | None:
    """OpenAI's tools: at most 128 function tools of bounded size (mixqrt.generation.tool_calls checks the rest)."""
    from mixqrt.generation.tool_calls import MAX_TOOLS, check_tools

    if not isinstance(v, list):
        raise RequestError(name, f"{name} must be a list of {{'type': 'function', 'function': ...}}, got {show(v)}")
    if len(v) > MAX_TOOLS:
        raise RequestError(name, f"{len(v)} tools; at most {MAX_TOOLS}")
    total = 0
    for i, t in enumerate(v):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise RequestError(name, f"{name}[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        _function_name(name, f.get("name"))
        if f.get("description") is not None:
            string(name, f["description"], MAX_SPEC_BYTES)
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError(name, f"{name}[{i}].function.parameters must be a JSON schema object")
        if f.get("strict") is not None:
            boolean(name, f["strict"])
        total += json_size(name, t, MAX_SPEC_BYTES)
        if total > MAX_TOOLS_BYTES:
            raise RequestError(name, f"{name} are over {MAX_TOOLS_BYTES} bytes of JSON")
    check_tools(v)
    return v or None


def _tool_choice(name, v):
    if v in ("none", "auto", "required"):
        return v
    f = v.get("function") if isinstance(v, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(f, dict):
        raise RequestError(name, f"{name} must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
    _function_name(name, f.get("name"))
    return v


def _eos_token_ids(name, v):
    import numpy as np
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return [int(v)]
    if isinstance(v, (list, tuple, set, frozenset, np.ndarray)) and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
        return [int(x) for x in v]
    raise RequestError(name, f"{name} must be an int or a list of ints, got {show(v)}")


def _do_sample(name, v):
    return boolean(name, v)


def _prediction(name, v):
    from mixqrt.generation.speculative import prediction_text
    try:
        return prediction_text(v)
    except RequestError as e:
        raise RequestError(name, str(e)) from None


# ---------------------------------------------------------------------------- HTTP spellings unlike the Python ones
def _wire_logprobs(kind, spelling, v) -> dict:
    """Chat: logprobs true/false (top_logprobs apart). Completions: logprobs=k, the top k too."""
    if kind == "chat":
        return {"logprobs": boolean(spelling, v)}
    k = integer(spelling, v, lo=0, hi=MAX_TOP_LOGPROBS)
    return {"logprobs": True, "top_logprobs": k}


def _wire_cache_salt(kind, spelling, v) -> dict:
    return {"cache_salt": string(spelling, v, MAX_ID_CHARS)}


# ---------------------------------------------------------------------------- logits processors
def _repetition(p, ctx):
    if p.repetition_penalty is None or p.repetition_penalty == 1.0:
        return None
    return make_repetition_penalty(p.repetition_penalty, p.repetition_context_size)


def _presence_frequency(p, ctx):
    if not (p.presence_penalty or p.frequency_penalty):
        return None
    return make_presence_frequency_penalty(p.presence_penalty, p.frequency_penalty, ctx.prompt_tokens)


def _logit_bias(p, ctx):
    if not p.logit_bias:
        return None
    if ctx.vocab_size is None:
        raise RequestError("logit_bias", "logit_bias needs the vocabulary size")
    return make_logit_bias(p.logit_bias, ctx.vocab_size)


# ---------------------------------------------------------------------------- the options
@dataclass(frozen=True)
class Param:
    """One request option.

    name: the attribute and keyword argument (transformers' spelling where it has one); default:
    when not given (None is "not given"); check(spelling, value) -> the checked value, raising
    RequestError(spelling, ...); aliases: other keyword spellings (transformers', OpenAI's);
    openai: its spellings in an OpenAI body, each a name (every kind) or (name, kinds);
    openai_default: {kind: value} when the body leaves it out; wire(kind, spelling, value) -> {name:
    value, ...}: an HTTP value that reads unlike the Python one; llama_cpp: llama.cpp server's
    spelling (documentation); processor(params, ctx) -> a logits processor (tokens, logits) ->
    logits, or None: applied in PARAMS order after the grammar's mask, before the sampler
    (ctx.prompt_tokens, ctx.vocab_size); doc: one line for docs and errors."""
    name: str
    default: Any = None
    check: Callable | None = None
    doc: str = ""
    aliases: tuple = ()
    openai: tuple = ()
    openai_default: dict | None = None
    wire: Callable | None = None
    llama_cpp: str | None = None
    processor: Callable | None = None

    def spellings(self, kind: str) -> list[str]:
        """Its names in an OpenAI body of this kind, in the order they apply (a later one wins)."""
        out = []
        for s in self.openai:
            name, kinds = (s, KINDS) if isinstance(s, str) else s
            if kind in kinds:
                out.append(name)
        return out


PARAMS: dict[str, Param] = {}


def add_param(p: Param) -> Param:
    """Register an option (PARAMS below is built with this; a test may add a toy one)."""
    if p.name in PARAMS or p.name in _SPELLING:
        raise ValueError(f"request option {p.name!r} is already defined")
    PARAMS[p.name] = p
    for s in (p.name, *p.aliases):
        _SPELLING[s] = p.name
    return p


def remove_param(name: str) -> None:
    """Undo add_param (tests)."""
    p = PARAMS.pop(name)
    for s in (p.name, *p.aliases):
        _SPELLING.pop(s, None)


_SPELLING: dict[str, str] = {}      # keyword spelling -> option name

for _p in (
    Param("max_new_tokens", DEFAULT_MAX_NEW_TOKENS, _max_new_tokens,
          "new tokens at most (>= 1); max_tokens <= 0: until the context is full",
          aliases=("max_tokens",), openai=("max_tokens", ("max_completion_tokens", ("chat",))),
          openai_default={"chat": UNTIL_FULL, "completion": 16}, llama_cpp="n_predict"),
    Param("temperature", None, _opt_number(lo=0.0), "0: greedy", openai=("temperature",),
          llama_cpp="temperature"),
    Param("top_k", None, _top_k, "keep the k most likely tokens; <= 0: off", openai=("top_k",),
          llama_cpp="top_k"),
    Param("top_p", None, _opt_number(lo=0.0, hi=1.0, lo_open=True), "nucleus mass; 1: off", openai=("top_p",),
          llama_cpp="top_p"),
    Param("min_p", None, _opt_number(lo=0.0, hi=1.0), "keep p >= min_p * p_max; 0: off", openai=("min_p",),
          llama_cpp="min_p"),
    Param("do_sample", None, _do_sample, "transformers': False is greedy, True samples, None: the model's "
          "generation_config decides"),
    Param("seed", None, _seed, "the sampler's seed; negative or None: random", openai=("seed",), llama_cpp="seed"),
    Param("repetition_penalty", None, _opt_number(lo=0.0, lo_open=True),
          "divide positive (multiply negative) logits of recent tokens; 1: off", openai=("repeat_penalty",),
          llama_cpp="repeat_penalty", processor=_repetition),
    Param("repetition_context_size", 64, lambda name, v: integer(name, v, lo=1),
          "how many recent tokens (prompt included) repetition_penalty looks at", llama_cpp="repeat_last_n"),
    Param("presence_penalty", 0.0, _opt_number(lo=-2.0, hi=2.0), "OpenAI's, over the generated tokens",
          openai=("presence_penalty",), llama_cpp="presence_penalty", processor=_presence_frequency),
    Param("frequency_penalty", 0.0, _opt_number(lo=-2.0, hi=2.0), "OpenAI's, over the generated tokens",
          openai=("frequency_penalty",), llama_cpp="frequency_penalty"),
    Param("logit_bias", None, check_logit_bias, "{token id: bias in [-100, 100]} added to the logits",
          openai=("logit_bias",), llama_cpp="logit_bias", processor=_logit_bias),
    Param("stop", None, check_stops, "stop strings (not part of the text)", aliases=("stop_strings",),
          openai=("stop",), llama_cpp="stop"),
    Param("eos_token_ids", None, _eos_token_ids, "tokens that end the reply (None: the model's)"),
    Param("n", 1, lambda name, v: integer(name, v, lo=1, hi=MAX_N), f"choices, 1 to {MAX_N}, sharing one prefill",
          openai=("n",)),
    Param("logprobs", False, lambda name, v: boolean(name, v), "each piece carries its token's log-probability",
          openai=("logprobs",), wire=_wire_logprobs, llama_cpp="n_probs"),
    Param("top_logprobs", 0, lambda name, v: integer(name, v, lo=0, hi=MAX_TOP_LOGPROBS),
          f"and the {MAX_TOP_LOGPROBS} at most most likely tokens' (needs logprobs)",
          openai=(("top_logprobs", ("chat",)),)),
    Param("response_format", None, check_response_format, "structured output (mixqrt.generation.grammar)",
          openai=(("response_format", ("chat",)),), llama_cpp="response_format"),
    Param("tools", None, check_tools_shape, "OpenAI's function tools (mixqrt.generation.tool_calls)",
          openai=(("tools", ("chat",)),)),
    Param("tool_choice", None, _tool_choice, "'none', 'auto', 'required' or a named function",
          openai=(("tool_choice", ("chat",)),)),
    Param("parallel_tool_calls", True, lambda name, v: boolean(name, v), "several tool calls in one reply",
          openai=(("parallel_tool_calls", ("chat",)),)),
    Param("draft_k", None, lambda name, v: integer(name, v, lo=0),
          "drafts per speculative step (None: the drafter's; 0: off; capped at speculative.MAX_DRAFT)"),
    Param("prediction", None, _prediction,
          "text the reply is expected to repeat (the file being edited): the copy drafter drafts from it first; "
          "OpenAI's {'type': 'content', 'content': str or text parts}, a string or token ids",
          openai=("prediction",)),
    Param("cache_salt", None, lambda name, v: string(name, v, MAX_CACHE_SALT),
          "requests share cached prompt K/V only with the same salt", openai=("cache_salt",),
          wire=_wire_cache_salt),
    Param("cache_prompt", True, lambda name, v: boolean(name, v),
          "False: neither reuse cached K/V nor leave this request's behind", openai=("cache_prompt",),
          llama_cpp="cache_prompt"),
):
    add_param(_p)
del _p


# ---------------------------------------------------------------------------- the object
class SamplingParams:
    """Every generation option of one request (see PARAMS), checked when built.

    ``SamplingParams(**kwargs)`` takes each option by any of its keyword spellings (None: not
    given); an unknown keyword raises RequestError naming it. ``replace(**kwargs)`` returns a copy
    with some options changed (checked); ``asdict()`` every option's value."""

    def __init__(self, **kwargs):
        given: dict[str, tuple[str, Any]] = {}
        for spelling, v in kwargs.items():
            name = _SPELLING.get(spelling)
            if name is None:
                raise RequestError(spelling, f"unknown generation argument(s): {show(spelling)}")
            if v is None or (name in given and spelling != name):
                continue                     # None: not given; the canonical spelling wins over an alias
            given[name] = (spelling, v)
        self._set(given, defaults=True)

    def _set(self, given: dict, defaults: bool) -> None:
        for name, p in PARAMS.items():
            if name in given:
                spelling, v = given[name]
                object.__setattr__(self, name, p.check(spelling, v) if p.check is not None else v)
            elif defaults:
                object.__setattr__(self, name, p.default)
        self._check_together()

    def _check_together(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tool_choice is not None or self.tools is not None:
            from mixqrt.generation.tool_calls import check_tool_choice, check_tools
            check_tool_choice(self.tool_choice, check_tools(self.tools))

    @classmethod
    def from_openai(cls, kind: str, body: dict) -> "SamplingParams":
        """The options of an OpenAI body (None values count as absent): each option's spellings of
        this kind, a later spelling winning (max_completion_tokens over max_tokens); the body's
        other fields are mixqrt.serving.protocol's."""
        given: dict[str, tuple[str, Any]] = {}
        for name, p in PARAMS.items():
            for spelling in p.spellings(kind):
                v = body.get(spelling)
                if v is None:
                    continue
                if p.wire is not None:
                    for k, val in p.wire(kind, spelling, v).items():
                        given[k] = (spelling, val)
                else:
                    given[name] = (spelling, v)
            if name not in given and p.openai_default and kind in p.openai_default:
                given[name] = (p.spellings(kind)[0], p.openai_default[kind])
        out = cls.__new__(cls)
        out._set(given, defaults=True)
        return out

    @staticmethod
    def openai_fields(kind: str) -> set[str]:
        """Every option spelling an OpenAI body of this kind may hold."""
        return {s for p in PARAMS.values() for s in p.spellings(kind)}

    def replace(self, **kwargs) -> "SamplingParams":
        """A copy with these options changed (checked; None: left as it is)."""
        given = {}
        for spelling, v in kwargs.items():
            name = _SPELLING.get(spelling)
            if name is None:
                raise RequestError(spelling, f"unknown generation argument(s): {show(spelling)}")
            if v is not None:
                given[name] = (spelling, v)
        out = self.__class__.__new__(self.__class__)
        out.__dict__.update(self.__dict__)
        if given:
            out._set(given, defaults=False)
        return out

    def asdict(self) -> dict:
        return {name: getattr(self, name) for name in PARAMS}

    def logits_processors(self, prompt_tokens: int, vocab_size: int | None) -> list:
        """The processors the options ask for, in PARAMS order: (tokens so far, logits) -> logits."""
        ctx = _Context(prompt_tokens, vocab_size)
        out = []
        for p in PARAMS.values():
            if p.processor is not None:
                proc = p.processor(self, ctx)
                if proc is not None:
                    out.append(proc)
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, SamplingParams) and self.asdict() == other.asdict()

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.asdict().items() if v != PARAMS[k].default)
        return f"SamplingParams({changed})"


@dataclass(frozen=True)
class _Context:
    prompt_tokens: int
    vocab_size: int | None


def as_params(params=None, **kwargs) -> SamplingParams:
    """A SamplingParams from one (kwargs change it) or from keyword arguments alone."""
    if params is None:
        return SamplingParams(**kwargs)
    if not isinstance(params, SamplingParams):
        raise RequestError(None, f"params must be a SamplingParams, got {type(params).__name__}")
    return params.replace(**kwargs) if kwargs else params

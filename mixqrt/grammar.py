"""Constrained decoding: a request's `response_format` (or a forced tool call) as a token mask.

The grammar engine is llguidance (chosen by measurement, docs/structured-output.md): a Rust library
with a numpy interface that builds the lexer lazily, releases the GIL while it computes a mask and
bounds its own work (parser limits, "fuel"). This module is the only place that imports it.

    g = grammar_from_response_format({"type": "json_schema", "json_schema": {"schema": {...}}})
    c = compile_constraint(tokenizer, g, n_vocab=151936, eos_ids={151645})   # Constraint (blocking)
    c.compute_mask()          # the next token's mask (may run in another thread while the forward runs)
    c.apply(logits)           # logits of forbidden tokens -> -inf (uses the computed mask)
    c.consume(tok)            # advance by the sampled token
    c.rollback(n) / c.consume_many(toks) / c.validate(toks)   # for speculative decoding

Inputs of response_format (OpenAI's, llama-cpp-python's, and mixqrt's own extensions):
  {"type": "text"}                                           no constraint
  {"type": "json_object"}                                    any JSON object
  {"type": "json_object", "schema": {...}}                   llama-cpp-python's JSON schema form
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   OpenAI's structured output
  {"type": "regex", "regex": "..."}                          mixqrt extension
  {"type": "grammar", "grammar": "...", "syntax": "lark"}    mixqrt extension (syntax "lark" or "gbnf")
Anything the library cannot compile is a RequestError naming response_format, raised from the
compile; compiles run on a small pool of their own threads with a deadline (compile_async), never on
the engine's thread.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mixqrt.errors import GenerationError, RequestError

__all__ = ["Constraint", "compile_constraint", "compile_async", "grammar_from_response_format",
           "json_schema_grammar", "COMPILE_TIMEOUT_S", "MAX_GRAMMAR_CHARS"]

COMPILE_TIMEOUT_S = 10.0          # a grammar that is not ready by then is refused (400)
MAX_GRAMMAR_CHARS = 1 << 20       # grammar / regex / schema text (JSON) above this is refused
COMPILE_WORKERS = 2               # compiles at a time, process-wide; more wait their turn
MAX_PENDING_COMPILES = 64         # compiles waiting or running, process-wide; more are refused
# JSON output: no free whitespace (a small model asked for "any whitespace" may emit newlines
# forever); ", " and ": " as separators, the layout models are trained on
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FIELD = "response_format"


def _llg():
    try:
        import llguidance
    except ImportError:                             # a dependency of mixqrt: a broken install
        raise GenerationError("structured output (response_format, forced tool calls) needs the "
                              "llguidance package: pip install llguidance") from None
    return llguidance


def _limits():
    # the library's own bounds on one compile and one mask step; the lexer-state bound keeps a
    # hostile grammar's memory to tens of MiB (1-2 KiB a state) instead of the default's hundreds
    return _llg().LLParserLimits(max_lexer_states=20_000, max_grammar_size=200_000,
                                 initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                                 verbose_errors=False)


# ============================================================================ request -> grammar text
def _text(field: str, v, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise RequestError(field, f"{field}: {what} must be a non-empty string")
    if len(v) > MAX_GRAMMAR_CHARS:
        raise RequestError(field, f"{field}: {what} is {len(v)} characters; at most {MAX_GRAMMAR_CHARS}")
    return v


def json_schema_grammar(schema, field: str = FIELD) -> str:
    """A JSON schema (dict, or True for any JSON value) -> llguidance grammar text."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestError(field, f"{field}: the JSON schema must be an object")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(field, f"{field}: the JSON schema is not JSON: {str(e)[:200]}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(field, f"{field}: the JSON schema is {len(text)} characters; at most "
                                  f"{MAX_GRAMMAR_CHARS}")
    try:
        return _llg().LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise RequestError(field, f"{field}: the JSON schema cannot be used: {str(e)[:300]}") from None


def grammar_from_response_format(rf, field: str = FIELD) -> str | None:
    """A response_format dict -> llguidance grammar text, or None for plain text. RequestError
    (naming `field`) for a shape this does not know; the grammar itself is checked at compile."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise RequestError(field, f"{field} must be an object with a 'type' "
                                  "(text, json_object, json_schema, regex or grammar)")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")                   # llama-cpp-python's form
        return json_schema_grammar({"type": "object"} if schema is None else schema, field)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError(field, f"{field}.json_schema must be an object with 'name' and 'schema'")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError(field, f"{field}.json_schema.name must be a string")
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise RequestError(field, f"{field}.json_schema.strict must be true or false")
        schema = js.get("schema", js.get("schema_", True))
        return json_schema_grammar(schema, f"{field}.json_schema.schema" if field == FIELD else field)
    llg = _llg()
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(_text(field, rf.get("regex"), "'regex'"))
    if kind == "grammar":
        text = _text(field, rf.get("grammar"), "'grammar'")
        syntax = rf.get("syntax", "lark")
        if syntax == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 — the converter's own parse errors, any type
                raise RequestError(field, f"{field}: the GBNF grammar does not parse: {str(e)[:300]}") from None
        elif syntax != "lark":
            raise RequestError(field, f"{field}.syntax must be 'lark' or 'gbnf', got {str(syntax)[:40]!r}")
        return llg.LLMatcher.grammar_from_lark(text)
    raise RequestError(field, f"{field}.type {kind[:40]!r} is not supported (text, json_object, json_schema, "
                              "regex, grammar)")


# ============================================================================ tokenizer adapter
_tok_lock = threading.Lock()


def grammar_tokenizer(tokenizer, n_vocab: int, eos_ids):
    """llguidance's view of the model's tokenizer (built once per tokenizer, vocabulary size and
    eos set: ~2-4 s for a 151k vocabulary, so it is cached on the tokenizer object)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GenerationError("structured output needs a mixqrt Tokenizer (an HF `tokenizers` backend)")
    key = (int(n_vocab), tuple(sorted(int(e) for e in eos_ids)))
    with _tok_lock:
        cache = tokenizer.__dict__.setdefault("_grammar_tokenizers", {})
        lt = cache.get(key)
        if lt is None:
            if not key[1]:
                raise GenerationError("structured output needs an end-of-sequence token")
            lt = cache[key] = _llg().LLTokenizer(backend.to_str(), n_vocab=key[0], eos_token=list(key[1]))
        return lt


# ============================================================================ the per-request state
# byte of a bitmask -> its 8 tokens' additive bias (bit set: 0, allowed; clear: -inf, forbidden)
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") != 0,
                      np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


class Constraint:
    """One request's grammar state: a matcher, its next-token mask, the operations decoding needs.

    compute_mask() and apply() are separate so that the mask can be computed in another thread
    while the batched forward runs (llguidance releases the GIL); apply() computes it itself when
    nobody did. consume / consume_many / rollback / validate are the matcher operations a
    speculative decoder needs (check a draft, accept a prefix, undo)."""

    def __init__(self, matcher, n_vocab: int, grammar: str = ""):
        self.matcher = matcher
        self.n_vocab = int(n_vocab)
        self.grammar = grammar
        self.mask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self.bias = None            # float32 [32 * words]: 0 / -inf per token (compute_mask)
        self.ready = False          # self.mask is the mask of the current state
        self.mask_seconds = 0.0     # time spent computing masks (for stats)
        self.masks = 0

    def copy(self) -> "Constraint":
        """An independent copy in the same state (n samples of one prompt share the compile)."""
        c = Constraint(self.matcher.deep_copy(), self.n_vocab, self.grammar)
        c.mask[:] = self.mask
        c.bias = None if self.bias is None else self.bias.copy()
        c.ready = self.ready
        return c

    def compute_mask(self) -> None:
        """The next token's bitmask, and from it the additive bias (0 allowed, -inf forbidden) that
        apply() adds: both off the hot path when called from the engine's masker thread (the
        library and numpy's gather release the GIL)."""
        if self.ready:
            return
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.bias = np.take(_BYTE_BIAS, self.mask.view(np.uint8), axis=0).reshape(-1)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        self.ready = True

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next."""
        self.compute_mask()
        return np.unpackbits(self.mask.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Forbidden tokens' logits -> -inf, in place (logits [vocab]; a wider row's extra ids are
        forbidden too). A dead end (no token allowed) is a GenerationError. One add over the row
        (a masked store cost ~20x more, measured)."""
        self.compute_mask()
        if self.matcher.is_error() or not self.mask.any():
            raise GenerationError(f"the grammar allows no next token: {self.error() or 'dead end'}")
        v = min(logits.shape[-1], self.n_vocab)
        row = logits[..., :v]
        np.add(row, self.bias[:v], out=row)
        logits[..., v:] = -np.inf
        return logits

    def consume(self, tok: int) -> bool:
        """Advance by one sampled token; False when the grammar refuses it (then in error)."""
        self.ready = False
        return bool(self.matcher.consume_token(int(tok)))

    def consume_many(self, toks) -> bool:
        self.ready = False
        return bool(self.matcher.consume_tokens([int(t) for t in toks]))

    def validate(self, toks) -> int:
        """How many of the draft tokens `toks` the grammar accepts from here (state unchanged)."""
        return int(self.matcher.validate_tokens([int(t) for t in toks]))

    def rollback(self, n: int) -> bool:
        """Undo the last n consumed tokens."""
        self.ready = False
        return bool(self.matcher.rollback(int(n)))

    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def is_stopped(self) -> bool:
        """Nothing but an end-of-sequence token can follow: the grammar's end."""
        return bool(self.matcher.is_stopped())

    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def _message(err: str) -> str:
    err = err.split("<state>")[0].strip()
    return " ".join(err.split())[:400]


def compile_constraint(tokenizer, grammar: str, *, n_vocab: int, eos_ids, field: str = FIELD) -> Constraint:
    """Grammar text -> a Constraint at its start state, with its first mask computed (a grammar that
    cannot produce a first token fails here, not in the engine). Blocking: see compile_async."""
    llg = _llg()
    lt = grammar_tokenizer(tokenizer, n_vocab, eos_ids)
    try:
        m = llg.LLMatcher(lt, grammar, log_level=0, limits=_limits())
    except Exception as e:  # noqa: BLE001 — API-level misuse is reported the same way
        raise RequestError(field, f"{field}: the grammar cannot be compiled: {_message(str(e))}") from None
    if m.is_error():
        raise RequestError(field, f"{field}: the grammar cannot be compiled: {_message(m.get_error())}")
    c = Constraint(m, n_vocab, grammar)
    c.compute_mask()
    if m.is_error() or not c.mask.any():
        raise RequestError(field, f"{field}: the grammar cannot start: {_message(m.get_error()) or 'no token fits'}")
    return c


_pool: ThreadPoolExecutor | None = None
_pending = 0
_pool_lock = threading.Lock()


def compile_async(tokenizer, grammar: str, *, n_vocab: int, eos_ids, on_done, field: str = FIELD,
                  timeout: float = COMPILE_TIMEOUT_S) -> None:
    """Compile on the grammar pool; on_done(Constraint or exception) is called exactly once, from a
    pool thread, or with a RequestError after `timeout` seconds if the compile has not finished (its
    late result is then dropped). The tokenizer adapter is built first and is not timed (once per
    model). RequestError at once when MAX_PENDING_COMPILES compiles are already pending."""
    global _pool, _pending
    with _pool_lock:
        if _pending >= MAX_PENDING_COMPILES:
            raise RequestError(field, f"{field}: {_pending} grammars are already being compiled; retry later")
        if _pool is None:
            _pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="mixqrt-grammar")
        _pending += 1
    state = {"done": False}
    lock = threading.Lock()

    def finish(result):
        with lock:
            if state["done"]:
                return
            state["done"] = True
        on_done(result)

    def job():
        global _pending
        timer = None
        try:
            grammar_tokenizer(tokenizer, n_vocab, eos_ids)
            timer = threading.Timer(timeout, finish, (RequestError(
                field, f"{field}: the grammar took longer than {timeout:g} s to compile"),))
            timer.daemon = True
            timer.start()
            result = compile_constraint(tokenizer, grammar, n_vocab=n_vocab, eos_ids=eos_ids, field=field)
        except BaseException as e:  # noqa: BLE001 — handed to the request
            result = e
        finally:
            if timer is not None:
                timer.cancel()
            with _pool_lock:
                _pending -= 1
        finish(result)

    _pool.submit(job)

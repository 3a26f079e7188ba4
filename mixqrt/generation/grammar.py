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

Hostile grammars (docs/structured-output.md, "Bounds"): the library compiles by recursion, so a
grammar whose rules or `$ref`s form a long chain overflows the thread's stack (SIGSEGV, the whole
process) although it is small and shallow as JSON. grammar_cost() measures what a compile costs
before the library sees the text (reference-chain depth, rules, schema nodes) and check_cost()
refuses it over the bounds (400 naming the bound); compile_async() then compiles it first in a
worker process of its own, with a deadline and a memory limit, so that whatever the library still
does wrong on a grammar inside the bounds kills that process, not the server, and is a 400.
"""
from __future__ import annotations

import json
import os
import queue
import re
import select
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from mixqrt.errors import GenerationError, RequestError

__all__ = ["Constraint", "compile_constraint", "compile_async", "grammar_from_response_format",
           "json_schema_grammar", "grammar_cost", "check_cost", "COMPILE_TIMEOUT_S", "MAX_GRAMMAR_CHARS",
           "MAX_GRAMMAR_DEPTH", "MAX_GRAMMAR_RULES", "MAX_SCHEMA_NODES", "COMPILE_MEMORY_BYTES"]

COMPILE_TIMEOUT_S = 10.0          # a grammar that is not ready by then is refused (400)
MAX_GRAMMAR_CHARS = 1 << 20       # grammar / regex / schema text (JSON) above this is refused
COMPILE_WORKERS = 2               # compiles at a time, process-wide; more wait their turn
MAX_PENDING_COMPILES = 64         # compiles waiting or running, process-wide; more are refused
# What one compile may cost (grammar_cost; docs/structured-output.md, "Bounds", says how each was found).
# Depth: the longest chain of rule references / $ref hops / nesting; the library recurses once per
# level, and an 8 MiB stack overflows at 2,490 levels of a $ref chain, the lowest of the four
# chains of issue 39 (grammar_cost's measure; Lark rules 2,682, objects 2,775, anyOf 3,126): 256
# is ~10x below, ~10x the deepest real schema seen, and compiles run on COMPILE_STACK_BYTES
# stacks (another 8x).
MAX_GRAMMAR_DEPTH = 256
MAX_GRAMMAR_RULES = 4096          # Lark rule and terminal definitions
MAX_SCHEMA_NODES = 50_000         # objects and arrays in the JSON schemas (after `$ref`s, each once)
COMPILE_STACK_BYTES = 64 << 20    # the compile threads' stacks (virtual: only the used part is memory)
COMPILE_MEMORY_BYTES = 2 << 30    # data the compile worker process may allocate (RLIMIT_DATA)
COMPILE_IN_WORKER = True          # compile_async: compile in a worker process first (False: in-process only)
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


# ============================================================================ what a compile costs
_LARK_TOKEN = re.compile(r"""
    (?P<nl>\n) | (?P<ws>[ \t\r\f]+) | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<special><[^>\n]*>)
  | (?P<json>%json\b) | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<open>[(\[]) | (?P<close>[)\]])
  | (?P<other>.)""", re.VERBOSE | re.DOTALL)
_LARK_DEF = re.compile(r"[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\{[^}\n]*\})?(?:\.-?[0-9]+)?[ \t]*:")


def _regex_depth(rx: str) -> int:
    """Nesting of groups in a regex literal (escapes and character classes skipped)."""
    depth = best = 0
    i, in_class = 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
            best = max(best, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return best


def _longest_chain(children: dict, base: dict) -> int:
    """Longest path over a graph of named nodes: depth(n) = max(base[n], max(w + depth(m) for
    (m, w) in children[n])); an edge back to a node on the current path counts 0 (recursion is a
    loop to the library, not a chain). Iterative: a 10^5-long chain costs no Python stack."""
    depth: dict = {}
    on_path: set = set()
    for root in children:
        if root in depth:
            continue
        stack = [(root, iter(children.get(root, ())), 0)]      # (node, its edges left, weight from parent)
        on_path.add(root)
        best = {root: base.get(root, 0)}
        while stack:
            node, it, _ = stack[-1]
            for m, w in it:
                if m in depth:
                    best[node] = max(best[node], w + depth[m])
                elif m not in on_path and m in children:
                    on_path.add(m)
                    best[m] = base.get(m, 0)
                    stack.append((m, iter(children[m]), w))
                    break
            else:
                _, _, w = stack.pop()
                on_path.discard(node)
                depth[node] = best.pop(node)
                if stack:
                    parent = stack[-1][0]
                    best[parent] = max(best[parent], w + depth[node])
    return max(depth.values(), default=0)


def _schema_cost(schema) -> tuple[int, int]:
    """(depth, nodes) of a JSON schema: nesting of objects and arrays, a local `$ref` ("#/...")
    one more level into its target."""
    ids: dict = {}           # id(container) -> the container (kept alive while we look)
    children: dict = {}

    def resolve(ref: str):
        if ref != "#" and not ref.startswith("#/"):
            return None                             # "#anchor": the library resolves it (or not)
        node = schema
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, (dict, list)) else None

    todo = [schema] if isinstance(schema, (dict, list)) else []
    while todo:
        node = todo.pop()
        if id(node) in children:
            continue
        ids[id(node)] = node
        kids = []
        values = node.values() if isinstance(node, dict) else node
        for v in values:
            if isinstance(v, (dict, list)):
                kids.append((id(v), 1))
                todo.append(v)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = resolve(node["$ref"])
            if target is not None:
                kids.append((id(target), 1))
                todo.append(target)
        children[id(node)] = kids
        if len(children) > MAX_SCHEMA_NODES:
            break
    if not children:
        return 0, 0
    return _longest_chain(children, dict.fromkeys(children, 1)), len(children)


def _lark_cost(text: str) -> dict:
    """{"depth", "rules", "nodes"} of Lark grammar text: the longest chain of rule references
    (nesting of parentheses and regex groups included), the rule and terminal definitions, and the
    cost of the JSON schemas inlined with %json."""
    children: dict = {}
    base: dict = {}
    rule, nest = "", 0
    nodes = 0
    line_start = True
    pos = 0
    while pos < len(text):
        if line_start:
            line_start = False
            m = _LARK_DEF.match(text, pos)
            if m:
                rule, nest = m.group(1), 0
                children.setdefault(rule, [])
                base.setdefault(rule, 0)
                if len(children) > MAX_GRAMMAR_RULES:
                    break
                pos = m.end()
                continue
        m = _LARK_TOKEN.match(text, pos)
        kind = m.lastgroup
        pos = m.end()
        if kind == "nl":
            line_start = True
        elif kind == "json":
            start = pos + len(text[pos:]) - len(text[pos:].lstrip())
            try:
                obj, end = json.JSONDecoder().raw_decode(text, start)
            except RecursionError:
                obj, end = None, len(text)
                base[rule] = max(base.get(rule, 0), MAX_GRAMMAR_DEPTH + 1)
            except ValueError:
                continue                            # the library reports the bad JSON
            pos = end
            d, n = _schema_cost(obj)
            nodes += n
            base[rule] = max(base.get(rule, 0), nest + d)
        elif kind == "regex":
            base[rule] = max(base.get(rule, 0), nest + _regex_depth(m.group()))
        elif kind == "open":
            nest += 1
            base[rule] = max(base.get(rule, 0), nest)
        elif kind == "close":
            nest = max(0, nest - 1)
        elif kind == "name" and rule:
            children.setdefault(rule, []).append((m.group(), nest + 1))
    for r in children:                              # references to undefined names: the library's error
        children[r] = [(m, w) for m, w in children[r] if m in children]
    return {"depth": _longest_chain(children, base), "rules": len(children), "nodes": nodes}


def grammar_cost(grammar: str) -> dict:
    """What compiling `grammar` (llguidance's text: Lark, or its JSON with "grammars") costs, as
    {"depth", "rules", "nodes"}: the longest chain of references and nesting (what the library's
    recursion follows), the Lark definitions, the JSON schema objects and arrays."""
    cost = {"depth": 0, "rules": 0, "nodes": 0}
    grammars = None
    if grammar.lstrip().startswith("{"):
        try:
            top = json.loads(grammar)
        except RecursionError:
            return {**cost, "depth": MAX_GRAMMAR_DEPTH + 1}
        except ValueError:
            top = None
        if isinstance(top, dict) and isinstance(top.get("grammars"), list):
            grammars = top["grammars"]
    for g in grammars if grammars is not None else [{"lark_grammar": grammar}]:
        if not isinstance(g, dict):
            continue
        if isinstance(g.get("lark_grammar"), str):
            c = _lark_cost(g["lark_grammar"])
        elif g.get("json_schema") is not None:
            d, n = _schema_cost(g["json_schema"])
            c = {"depth": d, "rules": 0, "nodes": n}
        else:
            continue
        cost = {"depth": max(cost["depth"], c["depth"]), "rules": cost["rules"] + c["rules"],
                "nodes": cost["nodes"] + c["nodes"]}
    return cost


_BOUNDS = (("depth", "MAX_GRAMMAR_DEPTH", "a chain of references and nesting {n} levels deep"),
           ("rules", "MAX_GRAMMAR_RULES", "{n} rule definitions"),
           ("nodes", "MAX_SCHEMA_NODES", "{n} schema objects and arrays"))


def check_cost(grammar: str, field: str = FIELD) -> dict:
    """grammar_cost(grammar), or a RequestError (400, code grammar_too_complex) naming the bound
    it is over. (Counting stops just past a bound: "over N" then.)"""
    c = grammar_cost(grammar)
    for key, name, what in _BOUNDS:
        bound = globals()[name]
        if c[key] > bound:
            raise RequestError(field, f"{field}: the grammar has {what.format(n=c[key])}; at most {bound} "
                                      f"({name})", code="grammar_too_complex")
    return c


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


def _compile(lt, grammar: str, n_vocab: int, field: str) -> Constraint:
    llg = _llg()
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


def compile_constraint(tokenizer, grammar: str, *, n_vocab: int, eos_ids, field: str = FIELD) -> Constraint:
    """Grammar text -> a Constraint at its start state, with its first mask computed (a grammar that
    cannot produce a first token fails here, not in the engine). A grammar over the cost bounds
    (check_cost) is refused before the library sees it. Blocking, in this process: see compile_async."""
    lt = grammar_tokenizer(tokenizer, n_vocab, eos_ids)
    check_cost(grammar, field)
    return _compile(lt, grammar, n_vocab, field)


# ============================================================================ the compile worker
# A process of its own that compiles each grammar (and its first mask) before this process does,
# on a thread with the same stack, under a memory limit and a deadline: a grammar that crashes the
# library, eats memory or never finishes kills or stalls the worker, which is then replaced, and
# the request gets a 400. Frames on its stdin / stdout: 4-byte little-endian length + JSON.
WORKER_START_TIMEOUT_S = 120.0    # the worker's own tokenizer adapter (~2-4 s for a 151k vocabulary)


def _send(f, obj) -> None:
    data = json.dumps(obj, ensure_ascii=True).encode("ascii")
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def _recv_blocking(f):
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = f.read(n)
    return json.loads(data) if len(data) == n else None


def _on_big_stack(fn, *args):
    """fn(*args) on a thread with a COMPILE_STACK_BYTES stack; its result or exception."""
    out = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 — handed back
            out["error"] = e
    _big_stack_thread(run, "mixqrt-grammar-compile").join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _big_stack_thread(target, name: str) -> threading.Thread:
    """A started daemon thread running target() on a COMPILE_STACK_BYTES stack."""
    with _stack_lock:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            t = threading.Thread(target=target, daemon=True, name=name)
            t.start()           # the stack size applies to threads started while it is set
        finally:
            threading.stack_size(old)
    return t


_stack_lock = threading.Lock()


def _worker_main() -> None:          # pragma: no cover — runs in the worker process
    """The compile worker's loop (python -c "from mixqrt.generation.grammar import _worker_main; ...")."""
    import resource
    rin, rout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                         # nothing else may write to the frame pipe
    hello = _recv_blocking(rin)
    if hello is None:
        return
    mem = int(hello["memory"])
    if mem > 0:
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (mem, mem))
        except (ValueError, OSError):
            pass
    lt = _llg().LLTokenizer(hello["tokenizer"], n_vocab=int(hello["n_vocab"]), eos_token=list(hello["eos"]))
    _send(rout, {"ready": True})
    while True:
        msg = _recv_blocking(rin)
        if msg is None:
            return
        try:
            _on_big_stack(_compile, lt, msg["grammar"], int(hello["n_vocab"]), msg["field"])
            reply = {"ok": True}
        except RequestError as e:
            reply = {"ok": False, "error": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": f"{msg['field']}: the grammar needs more than "
                                           f"{mem >> 20} MiB to compile"}
        _send(rout, reply)


class _Worker:
    def __init__(self, tok_json: str, n_vocab: int, eos: list):
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-c", "from mixqrt.generation.grammar import _worker_main; _worker_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, close_fds=True)
        _send(self.proc.stdin, {"tokenizer": tok_json, "n_vocab": n_vocab, "eos": eos,
                                "memory": COMPILE_MEMORY_BYTES})
        if self.recv(WORKER_START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise GenerationError("the grammar compile worker did not start")

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def recv(self, timeout: float):
        """The worker's next reply; None when it died; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        head = self._read(4, deadline)
        if head is None:
            return None
        data = self._read(struct.unpack("<I", head)[0], deadline)
        return None if data is None else json.loads(data)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def how_it_died(self) -> str:
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if rc < 0:
            import signal
            try:
                return f"crashed ({signal.Signals(-rc).name})"
            except ValueError:
                return f"crashed (signal {-rc})"
        return f"exited with status {rc}"


_workers_lock = threading.Lock()


def _worker_check(tokenizer, grammar: str, *, n_vocab: int, eos_ids, field: str, timeout: float) -> None:
    """Compile `grammar` in a worker process first: RequestError when it fails there, crashes the
    worker (the library's fault: this process would have died), or takes longer than `timeout`."""
    key = (int(n_vocab), tuple(sorted(int(e) for e in eos_ids)))
    with _workers_lock:
        idle = tokenizer.__dict__.setdefault("_grammar_workers", {}).setdefault(key, [])
        w = idle.pop() if idle else None
    if w is None:
        w = _Worker(tokenizer.backend.to_str(), key[0], list(key[1]))
    reuse = False                   # a worker that answered is kept; one that died or stalled is not
    try:
        try:
            _send(w.proc.stdin, {"grammar": grammar, "field": field})
            reply = w.recv(timeout)
        except TimeoutError:
            raise RequestError(field, f"{field}: the grammar took longer than {timeout:g} s to compile",
                               code="grammar_too_complex") from None
        except (OSError, ValueError):
            reply = None
        if reply is None:
            why = w.how_it_died()
            raise RequestError(field, f"{field}: the grammar library {why} compiling this grammar (in the "
                                      f"compile worker: the server is unaffected); simplify the grammar",
                               code="grammar_too_complex")
        reuse = True
        if not reply.get("ok"):
            raise RequestError(field, reply.get("error") or f"{field}: the grammar cannot be compiled")
    finally:
        if reuse and w.proc.poll() is None:
            with _workers_lock:
                tokenizer.__dict__["_grammar_workers"][key].append(w)
        else:
            w.kill()


_jobs: "queue.Queue | None" = None
_pending = 0
_pool_lock = threading.Lock()


def _pool_thread() -> None:
    while True:
        _jobs.get()()


def compile_async(tokenizer, grammar: str, *, n_vocab: int, eos_ids, on_done, field: str = FIELD,
                  timeout: float = COMPILE_TIMEOUT_S) -> None:
    """Compile on the grammar pool; on_done(Constraint or exception) is called exactly once, from a
    pool thread, or with a RequestError after `timeout` seconds if the compile has not finished (its
    late result is then dropped). The grammar's cost is checked first (check_cost), then it is
    compiled in a worker process (COMPILE_IN_WORKER, same deadline), then here. The tokenizer
    adapters (here and in a new worker) are built first and are not timed (once per model).
    RequestError at once when MAX_PENDING_COMPILES compiles are already pending."""
    global _jobs, _pending
    with _pool_lock:
        if _pending >= MAX_PENDING_COMPILES:
            raise RequestError(field, f"{field}: {_pending} grammars are already being compiled; retry later")
        if _jobs is None:
            _jobs = queue.Queue()
            for i in range(COMPILE_WORKERS):
                _big_stack_thread(_pool_thread, f"mixqrt-grammar-{i}")
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
            check_cost(grammar, field)
            if COMPILE_IN_WORKER:
                _worker_check(tokenizer, grammar, n_vocab=n_vocab, eos_ids=eos_ids, field=field, timeout=timeout)
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

    _jobs.put(job)

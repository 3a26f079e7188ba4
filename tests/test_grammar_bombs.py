"""Grammar and schema bombs (issue 39, item 1): a grammar whose rules or `$ref`s form a long chain
overflowed the grammar library's recursion and took the whole server down (SIGSEGV). Now the cost
of a compile is bounded before the library sees the text (mixqrt.generation.grammar.check_cost), and what
the library still does wrong inside the bounds happens in a compile worker process that can die
alone. The server test runs in a child process, so that a crash is a failure, not a dead pytest."""
from __future__ import annotations

import json
import random
import threading

import pytest

from mixqrt.generation import grammar as G
from mixqrt.errors import RequestError


# ============================================================================ the issue's four chains
def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1}: "a"\n'


def _defs_chain(n: int, link) -> dict:
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_chain(n: int) -> dict:
    return _defs_chain(n, lambda r: {"$ref": r})


def object_chain(n: int) -> dict:
    return _defs_chain(n, lambda r: {"type": "object", "properties": {"x": {"$ref": r}}, "required": ["x"]})


def anyof_chain(n: int) -> dict:
    return _defs_chain(n, lambda r: {"anyOf": [{"$ref": r}, {"type": "integer"}]})


def allof_chain(n: int) -> dict:
    return _defs_chain(n, lambda r: {"allOf": [{"$ref": r}]})


def items_chain(n: int) -> dict:
    return _defs_chain(n, lambda r: {"type": "array", "items": {"$ref": r}, "maxItems": 1})


def schema_rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def lark_rf(text: str, syntax: str = "lark") -> dict:
    return {"type": "grammar", "grammar": text, "syntax": syntax}


ISSUE_CHAINS = [("lark rule chain of 3000", lark_rf(lark_chain(3000))),
                ("$ref chain of 2500", schema_rf(ref_chain(2500))),
                ("object chain through $ref of 1000", schema_rf(object_chain(1000))),
                ("anyOf chain of 1500", schema_rf(anyof_chain(1500)))]


@pytest.mark.parametrize("name,rf", ISSUE_CHAINS, ids=[n for n, _ in ISSUE_CHAINS])
def test_the_issue_chains_are_refused_by_their_cost(name, rf):
    g = G.grammar_from_response_format(rf)
    with pytest.raises(RequestError, match="MAX_GRAMMAR_DEPTH") as e:
        G.check_cost(g)
    assert e.value.field == "response_format" and e.value.code == "grammar_too_complex"


def test_cost_counts_references_not_json_nesting():
    assert G.grammar_cost(G.grammar_from_response_format(lark_rf(lark_chain(100))))["depth"] == 100
    assert G.grammar_cost(G.json_schema_grammar(ref_chain(100)))["depth"] >= 100
    flat = "start: " + " | ".join(f"r{i}" for i in range(300)) + "\n" + "".join(f'r{i}: "x{i}"\n' for i in range(300))
    c = G.grammar_cost(flat)
    assert c["rules"] == 301 and c["depth"] <= 3
    recursive = {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}},
                 "$ref": "#/$defs/t"}
    assert G.grammar_cost(G.json_schema_grammar(recursive))["depth"] < 20     # recursion is a loop, not a chain
    deep_parens = "start: " + "(" * 300 + '"a"' + ")" * 300 + "\n"
    assert G.grammar_cost(deep_parens)["depth"] >= 300
    assert G.grammar_cost('start: /' + "(" * 300 + "a" + ")" * 300 + '/\n')["depth"] >= 300
    tool = 'start: obj\nobj: %json ' + json.dumps(ref_chain(400)) + "\n"
    assert G.grammar_cost(tool)["depth"] >= 400                               # %json inside Lark
    many = "start: r0\n" + "".join(f'r{i}: "a"\n' for i in range(G.MAX_GRAMMAR_RULES + 5))
    with pytest.raises(RequestError, match="MAX_GRAMMAR_RULES"):
        G.check_cost(many)


# ============================================================================ hostile grammars, generated
def hostile(rng: random.Random) -> dict:
    """One hostile (or merely odd) response_format: chains of every kind around the bounds, deep
    parentheses and regex groups, fan-outs, repetition and regex blow-ups, cycles, big enums."""
    n = rng.choice([50, 200, 255, 300, 1000, 2100, 3000, 6000])
    k = rng.randrange(14)
    if k == 0:
        return lark_rf(lark_chain(n))
    if k in (1, 2, 3, 4, 5):
        return schema_rf([ref_chain, object_chain, anyof_chain, allof_chain, items_chain][k - 1](min(n, 2500)))
    if k == 6:
        return lark_rf("start: " + "(" * n + '"a"' + ")" * n + "\n")
    if k == 7:
        return lark_rf("start: /" + "(" * n + "a" + ")" * n + "/\n")
    if k == 8:
        m = rng.choice([100, 3000, 5000])
        return lark_rf("start: " + " | ".join(f"r{i}" for i in range(m)) + "\n" + "".join(f'r{i}: "{i}"\n' for i in range(m)))
    if k == 9:
        r = rng.choice([10, 100, 1000])
        return lark_rf(f'a0: "a"~{r}\n' + "".join(f"a{i + 1}: a{i}~{r}\n" for i in range(rng.randint(1, 4)))
                       + f"start: a{0}\n")
    if k == 10:
        return {"type": "regex", "regex": rng.choice(["(a{1000}){1000}", "((a|b)*c){200}", "[a-z]{5000}",
                                                      "(x+x+)+y", "(" * 200 + "a" + ")*" * 200])}
    if k == 11:
        return lark_rf(rng.choice(["start: a\na: b\nb: a\n", "start: start\n", "start: s\ns: s s | \"x\"\n"]))
    if k == 12:
        return schema_rf({"enum": [f"v{i}" for i in range(rng.choice([10, 3000]))]})
    gbnf = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1} ::= "a"\n'
    return lark_rf(gbnf, "gbnf")


def test_hostile_grammars_never_take_the_server_down(tmp_path):
    """The four chains of the issue and 100 generated hostile grammars and schemas, one after
    another, while another client streams: every reply a 200 or a 4xx, the server alive, the
    other client's streams all complete ([DONE] after a finish_reason)."""
    from serve_helpers import post, stream_events, subprocess_server

    rng = random.Random(39)
    cases = [rf for _, rf in ISSUE_CHAINS] + [hostile(rng) for _ in range(100)]
    with subprocess_server(tmp_path, engine_kwargs={"max_slots": 4, "max_queue": 64}) as srv:
        stop, streams = threading.Event(), []

        def streamer():
            while not stop.is_set():
                streams.append(stream_events(srv.port, {"prompt": "the cat", "max_tokens": 48, "temperature": 0}))

        t = threading.Thread(target=streamer, daemon=True)
        t.start()
        statuses = []
        for rf in cases:
            status, body = post(srv.port, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": rf})
            statuses.append(status)
            assert status == 200 or 400 <= status < 500, (status, body, json.dumps(rf)[:300])
            assert srv.alive(), srv.log.read_text()[-3000:]
        stop.set()
        t.join(120)
        assert srv.alive()
        assert statuses[:4] == [400] * 4
        assert 200 in statuses and statuses.count(400) > 10
        assert len(streams) >= 2
        for ev in streams:
            assert ev[-1] == "[DONE]", ev[-3:]
            assert ev[-2]["choices"][0]["finish_reason"] in ("length", "stop"), ev[-3:]
        assert post(srv.port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_grammar_that_crashes_the_library_inside_the_bounds_is_a_400(monkeypatch, tmp_path):
    """With the depth bound lifted, a chain deep enough to overflow even the compile threads'
    stack kills the compile worker, not this process: a 400 naming response_format, and the next
    grammar compiles in a fresh worker."""
    from mixqrt.pipeline import Pipeline
    from mixqrt.testing.tiny import make_tiny_hf_model
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    tok = Pipeline(make_tiny_hf_model(tmp_path / "hf"), recipe="f32", progress=False, offline=True).tokenizer
    monkeypatch.setattr(G, "MAX_GRAMMAR_DEPTH", 10 ** 6)
    monkeypatch.setattr(G, "MAX_SCHEMA_NODES", 10 ** 6)

    def compile_(g):
        done, out = threading.Event(), []
        G.compile_async(tok, g, n_vocab=448, eos_ids={0}, on_done=lambda r: (out.append(r), done.set()))
        assert done.wait(120)
        return out[0]

    r = compile_(G.json_schema_grammar(object_chain(9000)))
    assert isinstance(r, RequestError) and r.field == "response_format", r
    assert "crashed" in str(r) and "SIG" in str(r)
    assert isinstance(compile_(G.grammar_from_response_format({"type": "regex", "regex": "[a-c]{3}"})), G.Constraint)

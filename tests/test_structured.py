"""Structured output and tools without a model run: request shapes, the grammar's operations on
Qwen's tokenizer, hostile schemas, tool-call parsing and streaming events (mixqrt.generation.grammar, mixqrt.generation.tool_calls)."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixqrt.errors import RequestError
from mixqrt.generation.grammar import compile_async, compile_constraint, grammar_from_response_format
from mixqrt.generation.tool_calls import (ChatReply, ToolStream, check_tool_choice, check_tools, parse_tool_calls,
                          template_messages, tool_grammar)

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
])


# ============================================================================ request shapes
@pytest.mark.parametrize("rf, msg", [
    ("json", "must be an object"), ({"type": "xml"}, "not supported"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "regex"}, "'regex' must be"), ({"type": "grammar", "grammar": "x", "syntax": "peg"}, "syntax"),
    ({"type": "regex", "regex": "a" * (1 << 21)}, "at most"),
])
def test_bad_response_formats_name_the_field(rf, msg):
    with pytest.raises(RequestError, match=msg) as e:
        grammar_from_response_format(rf)
    assert e.value.field.startswith("response_format")


def test_response_format_kinds():
    assert grammar_from_response_format(None) is None
    assert grammar_from_response_format({"type": "text"}) is None
    for rf in ({"type": "json_object"}, {"type": "json_object", "schema": {"type": "object"}},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
               {"type": "regex", "regex": "[0-9]+"}, {"type": "grammar", "grammar": 'start: "a"'},
               {"type": "grammar", "grammar": 'root ::= "a" | "b"', "syntax": "gbnf"}):
        assert isinstance(grammar_from_response_format(rf), str)


@pytest.mark.parametrize("tools, msg", [
    ("f", "list"), ([{"type": "retrieval"}], "must be"), ([{"type": "function", "function": {"name": "a b"}}], "name"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "used twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "parameters"),
])
def test_bad_tools(tools, msg):
    with pytest.raises(RequestError, match=msg):
        check_tools(tools)


def test_tool_choice():
    assert check_tool_choice(None, TOOLS) == "auto" and check_tool_choice(None, None) == "none"
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) == {"name": "add"}
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"function": "add"}):
        with pytest.raises(RequestError, match="tool_choice"):
            check_tool_choice(bad, TOOLS)
    with pytest.raises(RequestError, match="needs tools"):
        check_tool_choice("required", None)


# ============================================================================ parsing and streaming
def _call(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_parse_qwen_calls():
    text = "Let me check. " + _call("get_weather", {"city": "Paris"}) + "\n" + _call("add", {"a": 1, "b": 2})
    calls, content = parse_tool_calls(text, "qwen", TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2} and content == "Let me check."
    assert len({c["id"] for c in calls}) == 2
    # an unknown function, broken JSON: no calls, the text is content
    for bad in (_call("rm", {}), "<tool_call>\n{not json}\n</tool_call>"):
        assert parse_tool_calls(bad, "qwen", TOOLS) == ([], bad)
    # a bare JSON call (small models drop the tags), Llama 3.1's form, a call cut by the budget
    assert parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', "qwen", TOOLS)[0]
    calls, _ = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3", TOOLS)
    assert calls[0]["function"]["name"] == "add"
    calls, _ = parse_tool_calls(_call("add", {"a": 1, "b": 2}) + '\n<tool_call>\n{"name": "ad', "qwen", TOOLS)
    assert len(calls) == 1


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12), prefix=st.sampled_from(["", "Sure. ", "a < b "]),
       n=st.integers(0, 2))
def test_tool_stream_matches_whole_parse(cuts, prefix, n):
    """However the reply is split into pieces, the stream's calls and content equal the whole parse."""
    text = prefix + "\n".join(_call("add", {"a": i, "b": 2}) for i in range(n))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = ToolStream("qwen", TOOLS)
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += s.feed(text[a:b])
    events += s.finish()
    calls = [e[2]["function"] for e in events if e[0] == "call"]
    content = "".join(e[1] for e in events if e[0] == "content")
    want, want_content = parse_tool_calls(text, "qwen", TOOLS)
    assert calls == [c["function"] for c in want]
    assert content.strip() == (want_content or "").strip() if n else content == text


def test_chat_reply_deltas_follow_openai():
    r = ChatReply(TOOLS, "auto", "qwen")
    ds = r.deltas("Hi " + _call("add", {"a": 1, "b": 2}))
    tail, reason = r.end("stop")
    ds += tail
    assert ds[0] == {"content": "Hi "}
    head, args = ds[1]["tool_calls"][0], ds[2]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "add", "arguments": ""} and "id" not in args
    assert json.loads(args["function"]["arguments"]) == {"a": 1, "b": 2} and reason == "tool_calls"
    msg, reason = ChatReply(TOOLS, "none").message(_call("add", {"a": 1, "b": 2}), "stop")
    assert "tool_calls" not in msg and reason == "stop"


def test_template_messages_turn_openai_calls_into_template_input():
    msgs = [{"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out = template_messages(msgs)
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    with pytest.raises(RequestError, match="arguments"):
        template_messages([{**msgs[1], "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}])


# ============================================================================ grammars on Qwen's tokenizer
@pytest.fixture(scope="module")
def qwen_tok(qwen_gguf_path):
    from mixqrt.io import open_source
    with open_source(qwen_gguf_path) as src:
        return src.tokenizer


EOS = {151645, 151643}
V = 151936


def _constraint(tok, rf):
    return compile_constraint(tok, grammar_from_response_format(rf), n_vocab=V, eos_ids=EOS)


@pytest.mark.realmodel
def test_constraint_walks_a_document_and_rolls_back(qwen_tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "y"]}},
              "required": ["n", "s"], "additionalProperties": False}
    c = _constraint(qwen_tok, {"type": "json_schema", "json_schema": {"schema": schema}})
    ids = qwen_tok.encode('{"n": 12, "s": "y"}', parse_special=False)
    assert c.validate(ids) == len(ids)
    logits = np.zeros(V, dtype=np.float32)
    c.apply(logits)
    assert np.isfinite(logits[ids[0]]) and not np.isfinite(logits[min(EOS)])   # eos only at the end
    assert c.consume_many(ids) and c.is_accepting()
    assert c.allowed()[sorted(EOS)].all()
    assert c.rollback(len(ids) - 1) and not c.is_accepting()
    for t in ids[1:]:
        assert c.consume(t)
    assert c.is_stopped()                            # an object's end is the grammar's end
    bad = qwen_tok.encode("]", parse_special=False)[0]
    c2 = _constraint(qwen_tok, {"type": "json_object"})
    assert not c2.allowed()[bad] and not c2.consume(bad)


def _deep(n):
    d = {"type": "integer"}
    for _ in range(n):
        d = {"type": "object", "properties": {"a": d}, "required": ["a"]}
    return d


HOSTILE = {
    "self-reference without progress": {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    "1000-deep nesting": _deep(1000),
    "unknown type": {"type": "strin"},
    "look-around regex": {"type": "string", "pattern": "^(?=a).*$"},
    "dangling $ref": {"$ref": "#/$defs/missing"},
}
FINE = {  # hostile-looking but compiled, quickly: recursion, 10k enums, backtracking-prone regexes
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
                       "$ref": "#/$defs/n"},
    "10k-value enum": {"enum": [f"value-{i}" for i in range(10_000)]},
    "catastrophic regex": {"type": "string", "pattern": "^(a+)+$"},
    "nested quantifiers": {"type": "string", "pattern": "^(a|aa)*(b|ab)*c{1,1000}(d{1,100}){1,100}$"},
}


@pytest.mark.realmodel
def test_hostile_schemas_are_request_errors_or_compile(qwen_tok):
    for name, schema in HOSTILE.items():
        with pytest.raises(RequestError, match="response_format") as e:
            _constraint(qwen_tok, {"type": "json_schema", "json_schema": {"schema": schema}})
        assert e.value.field.startswith("response_format"), name
    for name, schema in FINE.items():
        assert _constraint(qwen_tok, {"type": "json_schema", "json_schema": {"schema": schema}}).mask.any(), name


@pytest.mark.realmodel
def test_compile_async_reports_once_and_times_out(qwen_tok):
    got, done = [], threading.Event()

    def on_done(r):
        got.append(r)
        done.set()
    compile_async(qwen_tok, grammar_from_response_format({"type": "json_object"}), n_vocab=V, eos_ids=EOS,
                  on_done=on_done)
    assert done.wait(60) and len(got) == 1 and got[0].mask.any()
    got.clear(), done.clear()
    compile_async(qwen_tok, grammar_from_response_format({"type": "json_object"}), n_vocab=V, eos_ids=EOS,
                  on_done=on_done, timeout=0.0)
    assert done.wait(60)
    assert isinstance(got[0], RequestError) or got[0].mask.any()   # a race: the deadline or the result, once
    done.clear()
    assert not done.wait(0.5) and len(got) == 1


@pytest.mark.realmodel
def test_tool_grammar_forces_a_valid_call(qwen_tok):
    g = tool_grammar(qwen_tok, TOOLS, "required", parallel=False)
    c = compile_constraint(qwen_tok, g, n_vocab=V, eos_ids=EOS, field="tools")
    good = qwen_tok.encode(_call("add", {"a": 1, "b": 2}))
    assert good[0] == qwen_tok.token_to_id("<tool_call>")
    assert c.consume_many(good) and c.is_stopped()
    c = compile_constraint(qwen_tok, tool_grammar(qwen_tok, TOOLS, {"name": "add"}), n_vocab=V, eos_ids=EOS)
    other = qwen_tok.encode(_call("get_weather", {"city": "x"}))
    assert c.validate(other) < len(other) and c.validate(good) == len(good)
    assert tool_grammar(qwen_tok, TOOLS, "auto") is None


# ============================================================================ the Engine, tiny model
@pytest.fixture(scope="module")
def tiny_lm(tiny_f32_path):
    from mixqrt.pipeline import LoadedModel
    return LoadedModel(tiny_f32_path)


def test_engine_mixes_constrained_and_free_slots(tiny_lm):
    """Continuous batching with some slots under a grammar: each constrained reply matches its
    grammar and ends at the grammar's end; free slots run to their budget; a grammar that cannot
    compile fails only its own request, from the iteration, naming the field."""
    import re

    from mixqrt.generation.engine import Engine
    tok = tiny_lm.tokenizer
    ids = tok.encode("def quicksort(xs):")
    with Engine(tiny_lm, max_slots=4) as eng:
        free = [eng.submit(ids, max_new_tokens=12, eos_token_ids=[]) for _ in range(2)]
        rx = eng.submit(ids, max_new_tokens=40, response_format={"type": "regex", "regex": "[0-9]{3}-[a-c]{2}"})
        js = eng.submit(ids, max_new_tokens=60, response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"k": {"enum": ["x", "yy"]}}, "required": ["k"],
                       "additionalProperties": False}}})
        bad = eng.submit(ids, max_new_tokens=5, response_format={"type": "regex", "regex": r"(a)\1"})
        with pytest.raises(RequestError, match="response_format") as e:
            list(bad)
        assert e.value.field == "response_format"
        for r in free:
            assert sum(1 for p in r if p.token is not None) == 12
        rx_out = list(rx)
        assert re.fullmatch("[0-9]{3}-[a-c]{2}", "".join(p.text for p in rx_out))
        assert rx_out[-1].finish_reason == "stop" and len(rx_out) <= 10
        assert json.loads("".join(p.text for p in js))["k"] in ("x", "yy")
        st = eng.stats()
        assert st["grammar_masks"] > 0 and st["failed"] == 1 and st["compiling"] == 0


def test_llama31_form_is_detected_and_forced():
    from mixqrt.generation.tool_calls import tool_format

    class Tok:      # the tool part of Llama 3.1's template, as far as detection goes
        chat_template = ('{%- if tools %}Respond in the format {"name": function name, "parameters": '
                         'dictionary of argument name and its value}.{%- endif %}<|python_tag|>ipython')

        def token_to_id(self, text):
            return None
    assert tool_format(Tok()) == "llama3"
    g = tool_grammar(Tok(), TOOLS, {"name": "add"})
    assert '"parameters"' in g and "tool_call" not in g
    calls, content = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3", TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2} and content is None


def test_speculative_steps_keep_the_grammar(tiny_lm):
    """Prompt-lookup speculation on a constrained slot: every verified row is sampled through the
    slot's Constraint (masked, then consumed), so accepted drafts never leave the grammar."""
    import re

    from mixqrt.generation.engine import Engine
    from mixqrt.generation.speculative import make_drafter
    tok = tiny_lm.tokenizer
    ids = tok.encode("ab-ab-ab-ab-ab-ab-ab-ab")
    with Engine(tiny_lm, max_slots=2, speculative=make_drafter(lookup=4)) as eng:
        r = eng.submit(ids, max_new_tokens=24, response_format={"type": "regex", "regex": "(ab-){3,6}ab"})
        text = "".join(p.text for p in r)
        assert re.fullmatch("(ab-){3,6}ab", text), text
        assert eng.stats()["verify_steps"] > 0

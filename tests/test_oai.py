"""mixqrt.serving.protocol: one request parser and one set of reply shapes for mixqrt.serving.api and mixqrt.serving.server.

Hostile JSON (lone surrogates, huge integers, NaN, deep nesting, wrong types, truncated bodies)
gets a 400 naming the field; the same request through api.create_* and the server gives the same
object (modulo id and created)."""
from __future__ import annotations

import json

import pytest
from asgi_helpers import call, sse
from test_serve import pipe  # noqa: F401 - the module-scoped tiny Pipeline fixture

from mixqrt.serving import api, protocol as oai
from mixqrt.errors import MixqrtError, RequestError
from mixqrt.generation.params import UNTIL_FULL, SamplingParams

pytest.importorskip("starlette")

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def quicksort(xs):"}]


@pytest.fixture(scope="module")
def app(pipe):  # noqa: F811
    from mixqrt.serving.server.app import create_app
    from mixqrt.serving.server.guard import Limits
    a = create_app(pipe, model="tiny", limits=Limits(max_tokens=64))
    yield a
    a.state.server.engine.close()


# ============================================================================ the parser alone
def test_request_error_is_typed_and_names_the_field():
    e = RequestError("seed", "seed must be an integer")
    assert isinstance(e, MixqrtError) and e.field == e.param == "seed" and str(e) == "seed must be an integer"
    assert api.RequestError is RequestError


def test_parse_plain_values_and_defaults():
    r = oai.parse("chat", {"messages": MSGS, "max_completion_tokens": 9, "temperature": 0.5, "seed": -1,
                           "cache_salt": "s1", "user": "u", "parallel_tool_calls": False, "tool_choice": "none",
                           "response_format": {"type": "text"}, "metadata": {"a": "b"}})
    p = r.params
    assert r.kind == "chat" and p.max_new_tokens == 9 and p.temperature == 0.5 and p.seed is None
    assert p.cache_salt == "s1" and p.cache_prompt is True and r.user == "u" and p.parallel_tool_calls is False
    assert p.response_format is None and p.n == 1 and not p.logprobs
    assert p == SamplingParams(max_new_tokens=9, temperature=0.5, cache_salt="s1", parallel_tool_calls=False,
                               tool_choice="none")
    c = oai.parse("completion", {"prompt": "x"})
    assert c.params.max_new_tokens == 16 and c.params == SamplingParams(max_new_tokens=16)
    assert oai.parse("completion", {"prompt": "x", "max_tokens": 0}).params.max_new_tokens == UNTIL_FULL
    assert oai.parse("chat", {"messages": MSGS}).params.max_new_tokens == UNTIL_FULL
    # a server's --max-tokens-cap also bounds "until the context is full" and the completions default
    assert oai.parse("chat", {"messages": MSGS}, max_tokens_cap=5).params.max_new_tokens == 5
    assert oai.parse("completion", {"prompt": "x", "max_tokens": -1}, max_tokens_cap=5).params.max_new_tokens == 5
    assert oai.parse("completion", {"prompt": "x"}, max_tokens_cap=8).params.max_new_tokens == 8


@pytest.mark.parametrize("body, field", [
    ({"cache_salt": "x" * 257}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"),
    ({"cache_prompt": "yes"}, "cache_prompt"), ({"user": ["u"]}, "user"), ({"user": "u" * 1000}, "user"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "regex", "regex": 3}}, "response_format"),
    ({"response_format": {"type": "json_object", "pad": "x" * 200_000}}, "response_format"),
    ({"tools": {"type": "function"}}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
    ({"tool_choice": "always"}, "tool_choice"), ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"seed": 1 << 64}, "seed"), ({"seed": "1"}, "seed"), ({"stop": ["a"] * 5}, "stop"),
    ({"max_tokens": 65}, "max_tokens"), ({"max_completion_tokens": 65}, "max_completion_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"model": 3}, "model"), ({"frobnicate": 1}, "frobnicate"),
    ({"messages": None}, "messages"), ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_parse_refuses_bad_fields_naming_them(body, field):
    with pytest.raises(RequestError) as e:
        oai.parse("chat", {"messages": MSGS, **body}, max_tokens_cap=64)
    assert e.value.field == field, str(e.value)


def test_structured_fields_are_parsed_and_checked_beyond_their_shape():
    # shapes here; the kind of format and the tool named by tool_choice through grammar/tools
    r = oai.parse("chat", {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function", "function": {"name": "get_w", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_w"}}, "parallel_tool_calls": False})
    p = r.params
    assert p.response_format["type"] == "json_schema" and p.tools[0]["function"]["name"] == "get_w"
    assert p.tool_choice["function"]["name"] == "get_w" and p.parallel_tool_calls is False
    bad = {"tool_choice": ({"type": "function", "function": {"name": "other"}}, "tool_choice"),
           "response_format": ({"type": "grammar", "grammar": "x", "syntax": "peg"}, "response_format")}
    for k, (v, field) in bad.items():
        body = {"messages": MSGS, k: v}
        if k == "tool_choice":
            body["tools"] = [{"type": "function", "function": {"name": "get_w"}}]
        with pytest.raises(RequestError) as e:
            oai.parse("chat", body)
        assert e.value.field == field


# ============================================================================ hostile JSON over HTTP
HI = b'{"messages": [{"role": "user", "content": "hi"}], '
HOSTILE = [
    (COMP, b'{"prompt": "a\\ud800b"}', "prompt"),
    (COMP, b'{"prompt": ["\\udfff"]}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages"),
    (CHAT, HI + b'"\\ud800": 1}', "\\ud800"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi", "\\udead": 2}]}', "messages"),
    (CHAT, HI + b'"seed": ' + b"9" * 5000 + b"}", "seed"),
    (COMP, b'{"prompt": "x", "max_tokens": -' + b"1" * 5000 + b"}", "max_tokens"),
    (CHAT, HI + b'"temperature": NaN}', "temperature"),
    (CHAT, HI + b'"top_p": Infinity}', "top_p"),
    (CHAT, HI + b'"top_p": -Infinity}', "top_p"),
    (CHAT, HI + b'"temperature": 1e999}', "temperature"),
    (CHAT, HI + b'"logit_bias": {"1": NaN}}', "logit_bias"),
    (CHAT, HI + b'"metadata": ' + b'{"a": ' * 40 + b"1" + b"}" * 40
     + b"}", "metadata"),
    (CHAT, b'{"messages": [{"role": "user", "content": {"text": "hi"}}]}', "messages"),
    (CHAT, HI + b'"stream": "true"}', "stream"),
    (CHAT, HI + b'"stop": [1]}', "stop"),
    (CHAT, HI + b'"stream_options": []}', "stream_options"),
    (COMP, b'{"prompt": 5}', "prompt"),
    (COMP, b'{"prompt": "x", "echo": "no"}', "echo"),
    (COMP, b'{"prompt": "x", "n": 1.5}', "n"),
]


@pytest.mark.parametrize("path, raw, field", HOSTILE, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(HOSTILE)])
def test_hostile_json_gets_a_400_naming_the_field(app, path, raw, field):
    status, _, body = call(app, "POST", path, raw=raw)
    assert status == 400, (status, body)
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "hi"}', b'{"prompt": "x', b"{",
                                 b"", b'{"prompt": "x"} trailing', b"\xff", b'"just a string"', b"[]"])
def test_truncated_or_non_object_bodies_get_a_400(app, raw):
    status, _, body = call(app, "POST", COMP, raw=raw)
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body


def test_a_body_cut_off_mid_upload_is_not_a_500(app):
    status, _, body = call(app, "POST", COMP, chunks=[b'{"prompt": "hel'],
                           headers={"content-type": "application/json", "content-length": "100"})
    assert status < 500, (status, body)


def test_surrogates_in_ignored_fields_too(app):
    raw = b'{"prompt": "x", "max_tokens": 1, "user": "\\ud800"}'
    status, _, body = call(app, "POST", COMP, raw=raw)
    assert status == 400 and body["error"]["param"] == "user"


# ============================================================================ one object from both front ends
def _strip(obj):
    obj = json.loads(json.dumps(obj))
    obj.pop("id", None)
    obj.pop("created", None)
    return obj


def _assembled(chunks, kind):
    """A streamed reply assembled: text, finish reason, usage."""
    text = "".join((c["choices"][0]["delta"].get("content") or "") if kind == "chat" else c["choices"][0]["text"]
                   for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return text, reasons, usage, [_strip(c) for c in chunks]


CASES = [("chat", {"max_tokens": 6, "temperature": 0}),
         ("chat", {"max_tokens": 12, "temperature": 0, "stop": ["e", "a"]}),
         ("chat", {"max_tokens": 3, "temperature": 0.9, "seed": 3}),
         ("completion", {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0}),
         ("completion", {"prompt": "def f(x):", "max_tokens": 9, "temperature": 0, "stop": "\n", "echo": True}),
         ("completion", {"prompt": "Once", "max_tokens": 4, "temperature": 0.8, "seed": 11}),
         ("chat", {"max_tokens": 4, "temperature": 0.9, "seed": 5, "n": 3, "logprobs": True, "top_logprobs": 2,
                   "presence_penalty": 0.5, "logit_bias": {"5": -3}}),
         ("completion", {"prompt": "x = ", "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 3,
                         "frequency_penalty": 1.0})]


@pytest.mark.parametrize("kind, kw", CASES)
def test_api_and_server_give_the_same_object(app, pipe, kind, kw):  # noqa: F811
    path, fn = (CHAT, api.create_chat_completion) if kind == "chat" else (COMP, api.create_completion)
    first = {"messages": MSGS} if kind == "chat" else {"prompt": kw.pop("prompt")}
    args = (MSGS,) if kind == "chat" else (first["prompt"],)
    direct = fn(pipe, *args, model="tiny", **kw)
    status, _, served = call(app, "POST", path, {**first, **kw})
    assert status == 200, served
    a, b = _strip(direct), _strip(served)
    a["usage"]["prompt_tokens_details"] = b["usage"]["prompt_tokens_details"] = None   # prompt-cache hits differ
    assert a == b
    # streaming, assembled (with usage): the same text, reason and usage; every chunk the same
    direct = list(fn(pipe, *args, model="tiny", stream=True, stream_options={"include_usage": True}, **kw))
    status, _, raw = call(app, "POST", path, {**first, **kw, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    ta, ra, ua, ca = _assembled(direct, kind)
    tb, rb, ub, cb = _assembled(sse(raw), kind)
    assert (ta, ra) == (tb, rb) and len(ua) == len(ub) == 1
    assert ua[0]["completion_tokens"] == ub[0]["completion_tokens"] == a["usage"]["completion_tokens"]
    assert ca[:-1] == cb[:-1]
    n = kw.get("n", 1)
    assert [c["index"] for c in a["choices"]] == list(range(n))
    for c in a["choices"]:          # each choice streamed = the whole reply's choice
        i = c["index"]
        text = "".join((k["choices"][0]["delta"].get("content") or "") if kind == "chat" else k["choices"][0]["text"]
                       for k in ca if k["choices"] and k["choices"][0]["index"] == i)
        assert text == (c["message"]["content"] if kind == "chat" else c["text"])
        if kw.get("logprobs"):
            parts = [k["choices"][0]["logprobs"] for k in ca if k["choices"] and k["choices"][0]["index"] == i
                     and k["choices"][0]["logprobs"]]
            if kind == "chat":
                assert [e for p in parts for e in p["content"]] == c["logprobs"]["content"]
            else:
                assert [t for p in parts for t in p["tokens"]] == c["logprobs"]["tokens"]
                assert [t for p in parts for t in p["text_offset"]] == c["logprobs"]["text_offset"]


def test_logprobs_and_n_through_the_openai_client(pipe):  # noqa: F811
    openai = pytest.importorskip("openai")
    from serve_helpers import running
    with running(pipe) as srv:
        c = srv.client()
        out = c.chat.completions.create(model="x", messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=3, n=2)
        assert [ch.index for ch in out.choices] == [0, 1]
        assert out.choices[0].message.content == out.choices[1].message.content           # greedy
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens // 2
        for e in content:
            assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
            assert e.top_logprobs[0].token == e.token                                      # greedy: the top one
        cmp = c.completions.create(model="x", prompt="def f(x):", max_tokens=4, temperature=0, logprobs=2)
        lp = cmp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.text_offset[0] == 0 and all(len(d) <= 2 for d in lp.top_logprobs)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            c.chat.completions.create(model="x", messages=MSGS, logprobs=True, top_logprobs=21)

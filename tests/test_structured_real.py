"""Structured output and tools end to end: the real 0.5B model behind `mixqrt serve`'s app, driven
by the official openai client (issue 31's acceptance, kept lean: short replies, one shared prompt)."""
from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.realmodel

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(qwen_gguf_path, tmp_path_factory):
    from serve_helpers import running

    from mixqrt.quantize.convert import quantize_model
    from mixqrt.pipeline import Pipeline
    out = tmp_path_factory.mktemp("structured") / "qwen-q8.mxq"
    quantize_model(str(qwen_gguf_path), "q8", out, progress=False)
    pipe = Pipeline(out, progress=False)
    with running(pipe, engine_kwargs={"max_slots": 8, "max_queue": 256}) as r:
        yield r


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["int", "num", "str", "enum", "bool"] + (["arr", "obj", "anyof"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if k == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if k == "str":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", 1, 2, None, True], rng.randint(1, 4))}
    if k == "bool":
        return {"type": "boolean"}
    if k == "arr":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": gen_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if k == "anyof":
        return {"anyOf": [gen_schema(rng, depth + 1), gen_schema(rng, depth + 1)]}
    return gen_object(rng, depth + 1)


def gen_object(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays with min/max items, enums, numbers with ranges, optional fields, anyOf."""
    names = rng.sample(["a", "b", "c", "id", "name", "size", "tags", "kind"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: gen_schema(rng, depth) for n in names},
            "required": [n for n in names if rng.random() < 0.7], "additionalProperties": False}


MSGS = [{"role": "user", "content": "Reply with a small JSON object."}]


def test_100_generated_schemas_all_validate(srv):
    rng = random.Random(31)
    schemas = [gen_object(rng) for _ in range(100)]
    c = srv.client(timeout=600)

    def one(schema):
        r = c.chat.completions.create(model="x", messages=MSGS, max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        return r.choices[0]
    with ThreadPoolExecutor(8) as ex:
        replies = list(ex.map(one, schemas))
    bad = []
    for schema, ch in zip(schemas, replies):
        try:
            jsonschema.validate(json.loads(ch.message.content), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((ch.finish_reason, ch.message.content, schema, str(e)[:100]))
    assert not bad, f"{len(bad)}/100 replies do not validate: {bad[:3]}"


def test_parse_with_a_pydantic_model(srv):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int
        capital: bool

    c = srv.client(timeout=300)
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(model="x", messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
              max_tokens=48)
    assert isinstance(r.choices[0].message.parsed, City)


def test_json_object_regex_and_grammar_modes(srv):
    c = srv.client(timeout=300)
    r = c.chat.completions.create(model="x", messages=MSGS, max_tokens=48, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5,
                                  extra_body={"response_format": {"type": "regex", "regex": "(yes|no)"}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather?"}], max_tokens=8,
                                  extra_body={"response_format": {"type": "grammar", "syntax": "lark",
                                                                  "grammar": 'start: "It is " ("sunny"|"rainy")'}})
    assert r.choices[0].message.content in ("It is sunny", "It is rainy")


def _tool(name, props, required):
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    _tool("search", {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          ["query"]),
]
ASKS = ["What is the weather in {}?", "Add {} and 7.", "Search the web for {}.", "Tell me about {}."]
THINGS = ["Paris", "12", "Tokyo", "penguins", "Lima"]


def test_required_tool_calls_name_a_tool_and_validate(srv):
    c = srv.client(timeout=600)
    rng = random.Random(7)
    cases = [(ASKS[i % 4].format(THINGS[i % 5]), rng.sample(TOOLS, 1 + i % 3)) for i in range(20)]

    def one(case):
        q, tools = case
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": q}], tools=tools,
                                      tool_choice="required", parallel_tool_calls=False, max_tokens=64)
        return tools, r.choices[0]
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, cases))
    for tools, ch in results:
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for call in ch.message.tool_calls:
            assert call.function.name in by_name
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_auto_call_round_trip_and_streamed_deltas(srv):
    c = srv.client(timeout=300)
    tools = TOOLS[:1]
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=tools, max_tokens=48)      # auto
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"
    call = ch.message.tool_calls[0]
    assert json.loads(call.function.arguments)["city"]
    # the streamed form of the same reply: id, type and name first, then the arguments
    chunks = list(c.chat.completions.create(model="x", messages=msgs, tools=tools, max_tokens=48, stream=True))
    deltas = [d.tool_calls[0] for d in (k.choices[0].delta for k in chunks) if d.tool_calls]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool's result goes back through the template; the model answers in text
    msgs2 = msgs + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r2 = c.chat.completions.create(model="x", messages=msgs2, tools=tools, tool_choice="none", max_tokens=24)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    streamed = "".join(k.choices[0].delta.content or "" for k in c.chat.completions.create(
        model="x", messages=msgs2, tools=tools, tool_choice="none", max_tokens=24, stream=True))
    assert streamed == r2.choices[0].message.content


def test_hostile_schemas_are_400s_and_do_not_stall_another_client(srv):
    from test_structured import FINE, HOSTILE
    c = srv.client(timeout=300)
    gaps, done = [], threading.Event()

    def reader():   # a plain client streaming while the hostile schemas compile
        import time
        last = time.perf_counter()
        for _ in c.chat.completions.create(model="x", messages=MSGS, max_tokens=48, stream=True):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        done.set()
    t = threading.Thread(target=reader)
    t.start()
    import urllib.error
    import urllib.request
    for name, schema in HOSTILE.items():
        if name == "1000-deep nesting":     # too deep for json.dumps: written by hand
            text = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "integer"}' + \
                '}, "required": ["a"]}' * 1000
        else:
            text = json.dumps(schema)
        body = ('{"model": "x", "max_tokens": 8, "messages": ' + json.dumps(MSGS) +
                ', "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": ' + text + '}}}')
        rq = urllib.request.Request(srv.url + "/v1/chat/completions", data=body.encode(), method="POST",
                                    headers={"Content-Type": "application/json", "Authorization": "Bearer none"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(rq, timeout=300)
        assert e.value.code == 400, name
        err = json.loads(e.value.read())["error"]
        assert "response_format" in (err["param"] or "") or "nests deeper" in err["message"], (name, err)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="x", messages=MSGS, max_tokens=8, extra_body={
            "response_format": {"type": "regex", "regex": r"(a)\1"}})
    for name, schema in FINE.items():       # compiled (the 10k enum is over the request's size bound)
        rf = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}
        if len(json.dumps(rf)) > 128 << 10:
            with pytest.raises(openai.BadRequestError, match="response_format"):
                c.chat.completions.create(model="x", messages=MSGS, max_tokens=4, response_format=rf)
        else:
            c.chat.completions.create(model="x", messages=MSGS, max_tokens=4, response_format=rf)
    t.join(300)
    assert done.is_set() and len(gaps) > 2
    print(f"concurrent client: {len(gaps)} chunks, worst gap {max(gaps[1:]):.3f} s")

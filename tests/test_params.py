"""mixqrt.generation.params: the one request object. Every option is defined once (its spellings, default and
bounds), the Python and HTTP entry points give the same errors for the shared limits, and a new
option added the way docs/architecture.md ("Adding a request field") says reaches every entry point:
Pipeline, Engine, api and an OpenAI body, with its processor applied to the logits."""
from __future__ import annotations

import numpy as np
import pytest

from mixqrt.serving import api, protocol as oai
from mixqrt.generation import params
from mixqrt.errors import GenerationError, RequestError
from mixqrt.generation.generate import encode_prompt
from mixqrt.generation.params import MAX_N, MAX_TOP_LOGPROBS, PARAMS, UNTIL_FULL, Param, SamplingParams
from mixqrt.pipeline import Pipeline
from mixqrt.generation.validate import integer

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pipe(tiny_f32_path):
    p = Pipeline(str(tiny_f32_path), max_context=128, progress=False)
    yield p
    p.close()


def test_every_option_is_defined_once_with_a_valid_default():
    seen = {}
    for name, p in PARAMS.items():
        assert p.name == name and p.doc
        for s in (p.name, *p.aliases):
            assert s not in seen, f"{s} spells both {seen[s]} and {name}"
            seen[s] = name
        if p.default is not None and p.check is not None:
            assert p.check(name, p.default) == p.default, name
    assert SamplingParams().asdict() == {n: p.default for n, p in PARAMS.items()}
    for kind in params.KINDS:
        body = SamplingParams.openai_fields(kind)
        assert not body & oai._OWN[kind], "an option spelt like a reply field"


def test_kwargs_spellings_and_replace():
    a = SamplingParams(max_tokens=5, stop_strings="x", seed=-1, top_k=-3)
    assert a.max_new_tokens == 5 and a.stop == ["x"] and a.seed is None and a.top_k == 0
    assert SamplingParams(max_tokens=0).max_new_tokens == UNTIL_FULL == SamplingParams(max_tokens=-1).max_new_tokens
    b = a.replace(temperature=0.3)
    assert b.temperature == 0.3 and b.max_new_tokens == 5 and a.temperature is None
    assert a == SamplingParams(max_new_tokens=5, stop=["x"], top_k=0) and a != b
    assert "temperature=0.3" in repr(b)
    with pytest.raises(RequestError) as e:
        SamplingParams(temprature=1.0)
    assert e.value.field == "temprature" and "unknown generation argument" in str(e.value)
    with pytest.raises(RequestError) as e:
        a.replace(top_p=0)
    assert e.value.field == "top_p"


@pytest.mark.parametrize("field, value, limit", [
    ("n", MAX_N + 1, str(MAX_N)), ("top_logprobs", MAX_TOP_LOGPROBS + 1, str(MAX_TOP_LOGPROBS)),
    ("logit_bias", {"5": 101}, "100"), ("logit_bias", {str(i): 1 for i in range(301)}, "300"),
    ("stop", ["a"] * 5, "4"), ("presence_penalty", 2.5, "2")])
def test_shared_limits_are_one_rule_for_python_and_http(pipe, field, value, limit):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    errors = []
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value}, **extra)
    errors.append(e.value)
    with pytest.raises(RequestError) as e:
        pipe.engine.submit([1, 2, 3], **{field: value}, **extra)
    errors.append(e.value)
    with pytest.raises(RequestError) as e:
        oai.parse("chat", {"messages": MSGS, field: value, **extra})
    errors.append(e.value)
    with pytest.raises(RequestError) as e:
        api.create_chat_completion(pipe, MSGS, **{field: value}, **extra)
    errors.append(e.value)
    assert {err.field for err in errors} == {field}
    assert len({str(err) for err in errors}) == 1 and limit in str(errors[0])


def test_until_the_context_is_full(pipe):
    ids = pipe.tokenizer.encode("hello there")
    out = list(pipe.engine.submit(ids, max_tokens=0, temperature=0.0, eos_token_ids=[]))
    assert out[-1].finish_reason == "length" and len(out) == pipe.max_context - len(ids)
    body = oai.parse("completion", {"prompt": "x", "max_tokens": -1})
    assert body.params.max_new_tokens == UNTIL_FULL


# ---------------------------------------------------------------------------- a toy option, added as the doc says
def _ban(p, ctx):
    """The toy option's processor: its token can never be sampled."""
    if p.ban_token is None:
        return None

    def proc(tokens, logits):
        logits[p.ban_token] = -np.inf
        return logits
    return proc


TOY = Param("ban_token", None, lambda name, v: integer(name, v, lo=0), "a token id that is never sampled",
            openai=("ban_token",), processor=_ban)


@pytest.fixture
def toy():
    params.add_param(TOY)
    yield TOY
    params.remove_param(TOY.name)


def test_a_new_option_reaches_every_entry_point(pipe, toy):
    text = "The quick brown fox"
    ids = encode_prompt(pipe.tokenizer, text)
    greedy = [r.token for r in pipe.engine.submit(ids, max_new_tokens=4, temperature=0.0, eos_token_ids=[])]
    first = greedy[0]
    # Engine and Pipeline (keyword arguments and SamplingParams)
    banned = [r.token for r in pipe.engine.submit(ids, max_new_tokens=4, temperature=0.0, eos_token_ids=[],
                                                  ban_token=first)]
    assert first not in banned and banned != greedy
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, eos_token_ids=[], ban_token=first)
    pieces = list(pipe.stream(text, sp))
    assert [r.token for r in pieces] == banned
    # an OpenAI body and the Python API (its bounds name it)
    assert oai.parse("chat", {"messages": MSGS, "ban_token": 7}).params.ban_token == 7
    for bad in (-1, "7", 1.5):
        with pytest.raises(RequestError) as e:
            oai.parse("completion", {"prompt": "x", "ban_token": bad})
        assert e.value.field == "ban_token"
    out = api.create_completion(pipe, text, max_tokens=4, temperature=0.0, ban_token=first, logprobs=1)
    assert out["choices"][0]["text"] == "".join(r.text for r in pieces)
    # without the option: an unknown argument, everywhere
    params.remove_param(TOY.name)
    try:
        for call in (lambda: SamplingParams(ban_token=1), lambda: pipe.engine.submit(ids, ban_token=1),
                     lambda: oai.parse("chat", {"messages": MSGS, "ban_token": 1})):
            with pytest.raises(GenerationError):
                call()
    finally:
        params.add_param(TOY)


def test_pipeline_and_engine_cap_the_context_alike(tiny_f32_path):
    """limits.context_window is the one cap: a Pipeline asked for more than the model holds allots
    the model's context, as its Engine does."""
    p = Pipeline(str(tiny_f32_path), max_context=10 ** 6, progress=False)
    try:
        assert p.max_context == p.model.context_length == p.engine.max_context
    finally:
        p.close()

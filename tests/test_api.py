"""mixqrt.serving.api: llama-cpp-python / OpenAI shaped results from a Pipeline (a fake one here: no model)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from mixqrt.serving.api import RequestError, check_messages, create_chat_completion, create_completion
from mixqrt.errors import GenerationError
from mixqrt.generation.params import UNTIL_FULL, SamplingParams


@dataclass
class Resp:                      # the fields of mixqrt.generation.generate.GenerationResponse that the API reads
    text: str
    token: int | None
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float = 100.0
    generation_tps: float = 10.0
    ttft_s: float = 0.01
    peak_rss_bytes: int = 0


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeModel:
    context_length = 64


class FakePipe:
    """Pipeline's .stream contract: pieces PIECES (or `n_tokens` x "tok"), finish "length" at
    max_new_tokens, "stop" at the end, GenerationError (on first next) past the context.
    `delay` per token; `gate` (an Event) holds the first token until set."""

    PIECES = ["Hel", "lo", "", ", wor", "ld", "!"]

    def __init__(self, max_context=64, n_tokens=None, delay=0.0, gate=None):
        self.tokenizer = FakeTokenizer()
        self.model = FakeModel()
        self.max_context = max_context
        self.path = "/models/fake-0.5b-2356.mxq"
        self.n_tokens, self.delay, self.gate = n_tokens, delay, gate
        self.calls = []           # (prompt, SamplingParams)
        self.started = threading.Event()
        self.yielded = 0
        self.closed = threading.Event()
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def stream(self, text_or_messages, params):
        prompt = text_or_messages if isinstance(text_or_messages, str) else \
            self.tokenizer.apply_chat_template(text_or_messages)
        self.calls.append((text_or_messages, params))
        return self._gen(prompt, params)

    def _gen(self, prompt, kw):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            n_prompt = len(self.tokenizer.encode(prompt))
            if n_prompt + 1 > self.max_context:
                raise GenerationError(f"the prompt has {n_prompt} tokens; with at least one new token that needs "
                                      f"{n_prompt + 1} positions but the context holds {self.max_context}")
            self.started.set()
            if self.gate is not None:
                self.gate.wait(10)
            pieces = self.PIECES if self.n_tokens is None else ["tok"] * self.n_tokens
            budget = min(kw.max_new_tokens or self.max_context, self.max_context - n_prompt)
            for i, p in enumerate(pieces[:budget]):
                if self.delay:
                    time.sleep(self.delay)
                last = i + 1 == min(len(pieces), budget)
                reason = None if not last else ("stop" if i + 1 == len(pieces) else "length")
                self.yielded += 1
                yield Resp(p, 100 + i, reason, n_prompt, i + 1)
        finally:
            with self._lock:
                self.active -= 1
            self.closed.set()


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


# ============================================================================ completions
def test_completion_shape_and_usage():
    pipe = FakePipe()
    out = create_completion(pipe, "Say hello", max_tokens=32)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert isinstance(out["created"], int) and out["model"] == "fake-0.5b-2356"
    assert out["choices"] == [{"text": "Hello, world!", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_maps_arguments_and_leaves_defaults_to_the_model():
    pipe = FakePipe()
    create_completion(pipe, "x", max_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                      repeat_penalty=1.1, stop=["\n"], seed=7, frequency_penalty=0.0, presence_penalty=0)
    assert pipe.calls[-1] == ("x", SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                                  repetition_penalty=1.1, stop=["\n"], seed=7))
    create_completion(pipe, "x", max_tokens=None, top_k=-1, seed=-1, stop=[])
    assert pipe.calls[-1][1] == SamplingParams(max_tokens=UNTIL_FULL, top_k=0)   # until the context is full
    create_completion(pipe, "x", SamplingParams(temperature=0.5), echo=True)       # the options as one object
    assert pipe.calls[-1][1] == SamplingParams(temperature=0.5)
    with pytest.raises(RequestError) as e:
        create_completion(pipe, "x", SamplingParams(temperature=0.5), top_k=3)
    assert e.value.param == "top_k"


@pytest.mark.parametrize("stop", ["", ["\n", ""]])
def test_empty_stop_string_is_refused_like_generate(stop):
    # one rule for both entry points (mixqrt.generation.params.check_stops): an empty stop string is an error naming
    # "stop", never silently dropped
    with pytest.raises(RequestError, match="non-empty") as e:
        create_completion(FakePipe(), "x", stop=stop)
    assert e.value.param == "stop"
    with pytest.raises(RequestError, match="non-empty"):
        create_chat_completion(FakePipe(), [{"role": "user", "content": "x"}], stop=stop)


def test_completion_length_echo_and_model_name():
    out = create_completion(FakePipe(), "Q: ", max_tokens=2, echo=True, model="mine")
    assert out["choices"][0]["text"] == "Q: Hello" and out["choices"][0]["finish_reason"] == "length"
    assert out["model"] == "mine" and out["usage"]["completion_tokens"] == 2


def test_completion_stream_chunks():
    chunks = list(create_completion(FakePipe(), "Say", stream=True, echo=True,
                                    stream_options={"include_usage": True}))
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    body, usage = chunks[:-1], chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
    assert all(c["choices"][0]["text"] for c in body[:-1])         # empty pieces are not sent
    assert body[-1]["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert "".join(c["choices"][0]["text"] for c in body) == "SayHello, world!"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


# ============================================================================ chat
def test_chat_shape():
    pipe = FakePipe()
    out = create_chat_completion(pipe, MSGS)
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!"},
                               "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 6
    assert pipe.calls[-1][0] == MSGS and pipe.calls[-1][1] == SamplingParams(max_tokens=UNTIL_FULL)


def test_chat_stream_chunks():
    chunks = list(create_chat_completion(FakePipe(), MSGS, stream=True, max_tokens=4))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"}
    assert deltas[1:-1] == [{"content": "Hel"}, {"content": "lo"}, {"content": ", wor"}]
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_messages_are_normalised():
    msgs = check_messages([{"role": "developer", "content": "rules", "name": "x"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert msgs == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("messages, msg", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([["user", "hi"]], "must be an object"),
    ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
    ([{"role": "function", "content": "42"}], "'function' role is not supported"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "assistant", "content": None, "tool_calls": [{}]}], r"tool_calls\[0\] must be"),
])
def test_bad_messages(messages, msg):
    with pytest.raises(RequestError, match=msg) as e:
        create_chat_completion(FakePipe(), messages)
    assert e.value.param == "messages" and isinstance(e.value, GenerationError)


@pytest.mark.parametrize("kw, param", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 2.5}, "top_k"), ({"min_p": 2}, "min_p"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"seed": 1.5}, "seed"),
    ({"stop": 3}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"n": 9}, "n"), ({"logprobs": 1}, "logprobs"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"stream": "yes"}, "stream"), ({"tools": [{}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"stream_options": 1}, "stream_options"),
])
def test_bad_arguments_are_rejected_before_running(kw, param):
    pipe = FakePipe()
    with pytest.raises(RequestError) as e:
        create_chat_completion(pipe, MSGS, **kw)
    assert e.value.param == param and param in str(e.value)
    assert pipe.calls == []


@pytest.mark.parametrize("prompt, msg", [
    ("", "empty"), (["a", "b"], "batch"), ([1, 2, 3], "token-id"), (None, "string"), (["ok"], None)])
def test_completion_prompt_forms(prompt, msg):
    if msg is None:
        assert create_completion(FakePipe(), prompt)["choices"][0]["text"] == "Hello, world!"
        return
    with pytest.raises(RequestError, match=msg):
        create_completion(FakePipe(), prompt)


def test_completion_rejects_unsupported():
    for kw in ({"suffix": "x"}, {"logprobs": 21}, {"best_of": 2}, {"echo": 1}, {"logprobs": 2, "echo": True}):
        with pytest.raises(RequestError):
            create_completion(FakePipe(), "x", **kw)


def test_prompt_beyond_context():
    pipe = FakePipe(max_context=8)
    with pytest.raises(RequestError, match="context holds 8") as e:
        create_completion(pipe, "x" * 20)
    assert e.value.code == "context_length_exceeded"
    it = create_chat_completion(pipe, MSGS, stream=True)      # streams fail on the first next(), before any chunk
    with pytest.raises(RequestError, match="context holds 8"):
        next(it)


def test_closing_the_stream_stops_generation():
    pipe = FakePipe(n_tokens=1000)
    it = create_chat_completion(pipe, MSGS, stream=True)
    for _ in range(3):
        next(it)
    it.close()
    assert pipe.closed.is_set() and pipe.yielded < 10

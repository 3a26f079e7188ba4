"""mixqrt.serving.server over the tiny model, driven by the official `openai` client: every endpoint,
streaming and not, chat and completions, usage (with cached_tokens), /metrics."""
from __future__ import annotations

import json
import urllib.request

import pytest
from serve_helpers import running, tiny_pipeline

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def quicksort(xs):"}]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def srv(pipe):
    with running(pipe) as r:
        yield r


def get(srv, path):
    with urllib.request.urlopen(srv.url + path, timeout=10) as r:
        return r.status, r.headers, r.read()


def test_models_and_health(srv):
    c = srv.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert c.models.retrieve("tiny").owned_by == "mixqrt"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    status, _, body = get(srv, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "model": "tiny"}


def test_chat_non_streaming_and_streaming_agree(srv):
    c = srv.client()
    out = c.chat.completions.create(model="x", messages=MSGS, max_tokens=6, temperature=0)
    assert out.object == "chat.completion" and out.model == "tiny"
    ch = out.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
    u = out.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + \
        u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-2].choices[0].finish_reason == ch.finish_reason
    text = "".join(k.choices[0].delta.content or "" for k in chunks if k.choices)
    assert text == ch.message.content                               # greedy: the same text


def test_completions_non_streaming_and_streaming_agree(srv):
    c = srv.client()
    out = c.completions.create(model="x", prompt="def f(x):", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens <= 5
    assert out.usage.prompt_tokens_details is None or out.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(c.completions.create(model="x", prompt="def f(x):", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(k.choices[0].text for k in chunks if k.choices) == out.choices[0].text
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    echo = c.completions.create(model="x", prompt="def f(x):", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "def f(x):" + out.choices[0].text


def test_tiny_temperature_is_greedy(srv):
    c = srv.client()
    kw = dict(model="x", prompt="def f(x):", max_tokens=8)
    greedy = c.completions.create(temperature=0, **kw).choices[0].text
    assert c.completions.create(temperature=5e-324, seed=1, **kw).choices[0].text == greedy
    assert c.completions.create(temperature=1e-6, seed=2, **kw).choices[0].text == greedy


def test_unsupported_arguments_are_400(srv):
    c = srv.client()
    with pytest.raises(openai.BadRequestError, match="n must be <= 8"):
        c.chat.completions.create(model="x", messages=MSGS, n=9)
    with pytest.raises(openai.BadRequestError, match="tools"):
        c.chat.completions.create(model="x", messages=MSGS, tools=[{"type": "function", "function": {"name": "no spaces"}}])
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="x", prompt="hello " * 400)


def test_metrics(srv):
    srv.client().completions.create(model="x", prompt="a", max_tokens=2, temperature=0)
    status, headers, body = get(srv, "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("mixqrt_requests_running", "mixqrt_requests_queued", "mixqrt_generation_tokens_per_second",
                 "mixqrt_time_to_first_token_seconds_bucket", "mixqrt_cache_hits_total",
                 "mixqrt_generation_tokens_total", "mixqrt_steps_total", "mixqrt_decode_tokens_total",
                 'mixqrt_http_requests_total{replica="0",route="/v1/completions"'):
        assert name in text, name


def test_serve_parser():
    import argparse

    from mixqrt.serving.server import add_serve_parser
    from mixqrt.serving.server.cli import default_hosts, limits_from_args
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["serve", "m.mxq", "--port", "9000", "-t", "2", "--api-key", "k", "--max-slots", "4",
                      "--allowed-origins", "https://a.example, https://b.example", "--ray", "--min-replicas", "1",
                      "--max-replicas", "3"])
    assert (a.model, a.port, a.threads, a.max_slots, a.ray, a.min_replicas, a.max_replicas) == \
        ("m.mxq", 9000, 2, 4, True, 1, 3)
    lim = limits_from_args(a)
    assert lim.allowed_origins == ("https://a.example", "https://b.example") and lim.api_key == "k"
    assert "localhost" in lim.allowed_hosts and "*" not in lim.allowed_hosts
    assert default_hosts("0.0.0.0") == ("*",) and "10.0.0.5" in default_hosts("10.0.0.5")
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "m.mxq", "--max-slots", "0"])


def test_serve_gemm_cache_defaults():
    """The GEMM tile cache is off unless asked (batched steps of up to 8 rows read the packed weights
    faster than the tiles: docs/engine.md), for one server and for Ray replicas."""
    import argparse

    from mixqrt.serving.server import add_serve_parser
    from mixqrt.serving.server.cli import engine_kwargs
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["serve", "m.mxq"])
    assert engine_kwargs(a)["gemm_cache_bytes"] == 0
    assert engine_kwargs(p.parse_args(["serve", "m.mxq", "--ray"]))["gemm_cache_bytes"] == 0
    a = p.parse_args(["serve", "m.mxq", "--gemm-cache-bytes", "0"])
    assert engine_kwargs(a)["gemm_cache_bytes"] == 0
    a = p.parse_args(["serve", "m.mxq", "--ray", "--gemm-cache-bytes", "1000"])
    assert engine_kwargs(a)["gemm_cache_bytes"] == 1000
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "m.mxq", "--gemm-cache-bytes", "-1"])

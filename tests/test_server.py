"""mixqrt.server: the OpenAI-compatible HTTP server on loopback, with a fake pipeline (no model)."""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from mixqrt.server import add_serve_parser, make_server
from test_api import MSGS, FakePipe

KEY = "sk-test-123"


@pytest.fixture
def start():
    servers = []

    def _start(pipe=None, **kw):
        kw.setdefault("verbose", False)
        srv = make_server(pipe or FakePipe(), "127.0.0.1", 0, **kw)
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        servers.append((srv, t))
        return srv

    yield _start
    for srv, t in servers:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def call(srv, method, path, body=None, headers=None, raw=None):
    """-> (status, headers, bytes)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(srv.url + path, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def call_json(srv, method, path, body=None, **kw):
    status, headers, data = call(srv, method, path, body, **kw)
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(data)


def sse(data: bytes) -> list:
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def assert_error(status, body, want_status, *, param=None, code=None, match=""):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert match in body["error"]["message"]
    assert body["error"]["param"] == param and body["error"]["code"] == code


# ============================================================================ happy paths
def test_health_and_models(start):
    srv = start()
    assert call_json(srv, "GET", "/health") == (200, {"status": "ok", "model": "fake-0.5b-2356"})
    status, body = call_json(srv, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [("fake-0.5b-2356", "model", "mixqrt")]
    assert call_json(srv, "GET", "/v1/models/fake-0.5b-2356")[1]["id"] == "fake-0.5b-2356"
    status, body = call_json(srv, "GET", "/v1/models/gpt-4")
    assert_error(status, body, 404, param="model", code="model_not_found")


def test_chat_completion(start):
    pipe = FakePipe()
    srv = start(pipe, model="qwen-tiny")
    status, body = call_json(srv, "POST", "/v1/chat/completions",
                             {"model": "whatever", "messages": MSGS, "max_completion_tokens": 5, "temperature": 0,
                              "user": "u1"})
    assert status == 200 and body["object"] == "chat.completion" and body["model"] == "qwen-tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert pipe.calls[-1][1] == {"max_new_tokens": 5, "temperature": 0.0}


def test_chat_completion_stream(start):
    srv = start()
    status, headers, data = call(srv, "POST", "/v1/chat/completions",
                                 {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    chunks = sse(data)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello, world!"
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_completions(start):
    srv = start()
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "Say", "max_tokens": 2, "echo": True})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "SayHello" and body["choices"][0]["finish_reason"] == "length"
    status, headers, data = call(srv, "POST", "/v1/completions", {"prompt": "Say", "stream": True})
    chunks = sse(data)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_keep_alive_serves_several_requests_on_one_connection(start):
    srv = start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    try:
        for body in ({"prompt": "a"}, "not json", {"prompt": "b", "stream": True}, {"prompt": "c"}):
            raw = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
            conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            assert r.status == (400 if body == "not json" else 200)
    finally:
        conn.close()


# ============================================================================ errors
@pytest.mark.parametrize("path, raw, param, match", [
    ("/v1/chat/completions", b"{not json", None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", None, "JSON object"),
    ("/v1/chat/completions", b'{"model": "x"}', "messages", "'messages' is required"),
    ("/v1/chat/completions", b'{"messages": []}', "messages", "non-empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}', "messages", "unknown role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n", "n=3"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
     "temperature", "finite number"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "mirostat": 2}', "mirostat",
     "unrecognized"),
    ("/v1/completions", b'{"prompt": 5}', "prompt", "prompt"),
    ("/v1/completions", b'{}', "prompt", "'prompt' is required"),
    ("/v1/completions", b'{"prompt": "x", "echo": "yes"}', "echo", "echo"),
])
def test_bad_requests_are_400(start, path, raw, param, match):
    pipe = FakePipe()
    status, body = call_json(start(pipe), "POST", path, raw=raw)
    assert_error(status, body, 400, param=param, match=match)
    assert body["error"]["type"] == "invalid_request_error" and pipe.calls == []


def test_prompt_beyond_context_is_400(start):
    srv = start(FakePipe(max_context=16))
    for stream in (False, True):
        status, body = call_json(srv, "POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "x" * 40}], "stream": stream})
        assert_error(status, body, 400, code="context_length_exceeded", match="context holds 16")


def test_api_key(start):
    srv = start(api_key=KEY)
    req = {"prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, body = call_json(srv, "POST", "/v1/completions", req, headers=headers)
        assert_error(status, body, 401, code="invalid_api_key", match="API key")
        assert call(srv, "GET", "/v1/models", headers=headers)[0] == 401
    assert call(srv, "POST", "/v1/completions", req, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert call(srv, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert call(srv, "GET", "/health")[0] == 200             # health stays open for load balancers


def test_unknown_route_and_method(start):
    srv = start()
    status, body = call_json(srv, "GET", "/v1/embeddings")
    assert_error(status, body, 404, code="unknown_url")
    status, body = call_json(srv, "POST", "/v2/chat/completions", {"messages": MSGS})
    assert_error(status, body, 404, code="unknown_url")
    status, body = call_json(srv, "GET", "/v1/chat/completions")
    assert_error(status, body, 405, code="method_not_allowed")


def test_body_over_limit_is_413(start):
    pipe = FakePipe()
    srv = start(pipe, max_body_bytes=1000)
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    status, body = call_json(srv, "POST", "/v1/chat/completions", big)
    assert_error(status, body, 413, match="over the limit of 1000")
    assert pipe.calls == []
    assert call(srv, "POST", "/v1/chat/completions", {"messages": MSGS})[0] == 200


def test_default_body_limit_is_4_mib(start):
    srv = start()
    assert srv.max_body_bytes == 4 * 2**20
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    try:       # declared size only: the server answers before reading (and closes rather than drain 64 MiB)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", str(64 * 2**20))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["message"].startswith("request body of")
    finally:
        conn.close()


class BuggyPipe(FakePipe):
    """A bug in the model after two tokens."""

    def _gen(self, prompt, kw):
        yield from list(super()._gen(prompt, kw))[:2]
        raise RuntimeError("kernel exploded")


def test_internal_errors_are_500_or_in_band_and_the_server_survives(start, capsys):
    srv = start(BuggyPipe())
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "x"})
    assert_error(status, body, 500, match="kernel exploded")
    assert body["error"]["type"] == "server_error"
    status, _, data = call(srv, "POST", "/v1/chat/completions", {"messages": MSGS, "stream": True})
    events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e]
    assert status == 200 and "[DONE]" not in data.decode()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert events[-1]["error"]["type"] == "server_error" and "kernel exploded" in events[-1]["error"]["message"]
    assert call(srv, "GET", "/health")[0] == 200
    assert "kernel exploded" in capsys.readouterr().err


# ============================================================================ concurrency
def test_busy_server_answers_503_and_runs_one_at_a_time(start):
    gate = threading.Event()
    pipe = FakePipe(gate=gate)
    srv = start(pipe, max_concurrency=2)
    results = []

    def worker():
        results.append(call(srv, "POST", "/v1/completions", {"prompt": "x"})[0])

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    assert pipe.started.wait(5)
    deadline = time.monotonic() + 5          # wait until the second request holds its admission slot
    while srv.admission._value > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "x"})
    assert_error(status, body, 503, code="server_busy", match="busy")
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "x", "n": 2})   # checked before queueing
    assert_error(status, body, 400, param="n", match="n=2")
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [200, 200] and pipe.max_active == 1


def test_client_disconnect_stops_generation(start):
    pipe = FakePipe(n_tokens=100_000, delay=0.001)
    srv = start(pipe)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": MSGS, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")           # generation is running
    conn.sock.close()                                   # the client goes away
    r.close()
    conn.close()
    assert pipe.closed.wait(5), "generation still running after the client left"
    assert pipe.yielded < 100_000
    assert call(srv, "GET", "/health")[0] == 200        # and the lock is free again
    assert call(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_client_disconnect_stops_non_streaming_generation(start):
    pipe = FakePipe(n_tokens=100_000, delay=0.001)
    srv = start(pipe)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}),
                 {"Content-Type": "application/json"})
    assert pipe.started.wait(5)
    conn.close()
    assert pipe.closed.wait(5) and pipe.yielded < 100_000


# ============================================================================ command line
def test_serve_parser():
    import argparse
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    add_serve_parser(sub)
    a = p.parse_args(["serve", "m.mxq", "--port", "9000", "--recipe", "q8", "-t", "2", "--api-key", "k",
                      "--max-concurrency", "3"])
    assert (a.model, a.host, a.port, a.recipe, a.threads, a.api_key, a.max_concurrency) == \
        ("m.mxq", "127.0.0.1", 9000, "q8", 2, "k", 3)
    assert callable(a.fn)
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "m.mxq", "--max-concurrency", "0"])


# ============================================================================ the real thing
def test_real_tiny_model_end_to_end(start, tmp_path, monkeypatch):
    """tinymodel HF folder -> Pipeline (f32 recipe, cache in tmp) -> server -> chat, SSE and completions."""
    tinymodel = pytest.importorskip("tinymodel")
    from mixqrt.pipeline import Pipeline
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    tinymodel.make_tiny_hf_model(tmp_path / "hf", seed=0)
    pipe = Pipeline(tmp_path / "hf", recipe="f32", progress=False, offline=True)
    srv = start(pipe, model="tiny")
    req = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
    status, body = call_json(srv, "POST", "/v1/chat/completions", req)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    text = body["choices"][0]["message"]["content"]
    assert 1 <= body["usage"]["completion_tokens"] <= 5 and body["usage"]["prompt_tokens"] > 1
    chunks = sse(call(srv, "POST", "/v1/chat/completions", {**req, "stream": True})[2])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text   # greedy: same text
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 3,
                                                              "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3
    status, body = call_json(srv, "POST", "/v1/completions", {"prompt": "hello " * 400})
    assert_error(status, body, 400, code="context_length_exceeded", match="context holds")

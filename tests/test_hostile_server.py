"""Issue 39 against the server: two Authorization headers and one cache-key rule (item 6), the
connection budget under many addresses (item 4), the served file replaced under a stream (item 5)."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from mixqrt.serving.server.app import cache_salt  # noqa: E402
from mixqrt.serving.server.guard import Guard, Limits  # noqa: E402


def _scope(*auth):
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(b"host", b"127.0.0.1")] + [(b"authorization", a.encode()) for a in auth]}


# ============================================================================ item 6
def test_two_authorization_headers_are_a_400():
    g = Guard(None, Limits(api_key=("key-a", "key-b")))
    assert g.check(_scope("Bearer key-a")) is None
    for pair in (("Bearer key-a", "Bearer key-b"), ("Bearer key-b", "Bearer nope"), ("Bearer key-a", "Bearer key-a")):
        e = g.check(_scope(*pair))
        assert e is not None and e.status == 400 and e.code == "bad_authorization", pair
    e = Guard(None, Limits()).check(_scope("Bearer x", "Bearer y"))          # without keys too
    assert e is not None and e.status == 400


def test_one_cache_key_rule_for_keys_and_salts():
    """An empty cache_salt is no salt, with and without API keys; different keys never share."""
    for limits in (Limits(), Limits(api_key=("key-a", "key-b"))):
        for auth in ("Bearer key-a", "Bearer key-b"):
            assert cache_salt("", auth, limits) == cache_salt(None, auth, limits)
            assert cache_salt("s", auth, limits) != cache_salt(None, auth, limits)
    keyed = Limits(api_key=("key-a", "key-b"))
    assert cache_salt(None, "Bearer key-a", keyed) != cache_salt(None, "Bearer key-b", keyed)
    assert cache_salt("s", "Bearer key-a", keyed) != cache_salt("s", "Bearer key-b", keyed)


# ============================================================================ item 5: the served file changes
def test_a_same_size_rewrite_with_the_old_mtime_is_still_seen(tmp_path):
    """Detection does not rest on mtime alone: a rewrite that restores the old mtime moves ctime."""
    import os

    from mixqrt.serving.server.watch import FileWatch
    f = tmp_path / "m.mxq"
    f.write_bytes(b"a" * 4096)
    st = os.stat(f)
    w = FileWatch(f, lambda: os.stat(f), interval=0)
    assert w.check() is None
    with open(f, "r+b") as fh:                      # same inode, same size, other bytes
        fh.write(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert w.check() is not None and "rewritten in place" in w.check()


def _tiny_mxq(tmp_path, name: str, recipe: str = "f32", seed: int = 0):
    import os

    from mixqrt.pipeline import Pipeline
    from mixqrt.testing.tiny import make_tiny_hf_model
    os.environ["MIXQRT_CACHE"] = str(tmp_path / "cache")
    out = tmp_path / name
    p = Pipeline(make_tiny_hf_model(tmp_path / f"hf-{name}", seed=seed), recipe=recipe, progress=False, offline=True)
    p.save(out)
    p.close()
    return out


def test_a_file_replaced_under_a_stream_changes_nothing_served(tmp_path):
    """`mixqrt serve` reads the weights into private memory: a `cp` of a different-size .mxq over
    the served file and a truncation, while a stream runs, neither fault (SIGBUS) nor change the
    answers; the stream ends with its finish_reason and [DONE]; one warning in the log."""
    import shutil
    import threading

    from serve_helpers import post, stream_events, subprocess_server
    served = _tiny_mxq(tmp_path, "served.mxq")
    other = _tiny_mxq(tmp_path, "other.mxq", recipe="f16", seed=1)
    assert other.stat().st_size != served.stat().st_size
    ask = {"prompt": "the cat", "max_tokens": 24, "temperature": 0}
    with subprocess_server(tmp_path, str(served), pipeline={"weights_in_memory": True}) as srv:
        before = post(srv.port, "/v1/completions", ask)
        assert before[0] == 200
        events = []
        t = threading.Thread(target=lambda: events.extend(stream_events(srv.port, {**ask, "max_tokens": 200})))
        t.start()
        shutil.copyfile(other, served)              # what `cp other.mxq served.mxq` does: same inode
        with open(served, "r+b") as f:
            f.truncate(4096)
        t.join(120)
        assert srv.alive(), srv.log.read_text()[-3000:]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop"), events[-3:]
        after = post(srv.port, "/v1/completions", ask)
        assert after[0] == 200 and after[1]["choices"][0]["text"] == before[1]["choices"][0]["text"]
    assert "still serving the weights read at load" in srv.log.read_text()


def test_a_stream_the_engine_stops_ends_with_an_error_event_and_done(tmp_path):
    """Over a mapped file (--mmap-weights) a change closes the engine: a stream it stops ends with
    an error event and [DONE], never silently."""
    pytest.importorskip("starlette")
    from asgi_helpers import call, sse
    from serve_helpers import tiny_pipeline

    from mixqrt.serving.server.app import create_app
    pipe = tiny_pipeline(tmp_path)
    app = create_app(pipe, model="tiny")
    eng = app.state.server.engine
    submit = eng.submit

    def submit_then_close(*a, **k):
        r = submit(*a, **k)
        eng.close()                                 # what the file watch does on a change
        return r
    eng.submit = submit_then_close
    status, _, body = call(app, "POST", "/v1/completions", {"prompt": "the cat", "max_tokens": 100, "stream": True})
    assert status == 200
    assert body.rstrip().endswith(b"data: [DONE]")
    last = sse(body)[-1]
    assert "error" in last and "stopped this stream" in last["error"]["message"], last


# ============================================================================ item 4: connection floods
def _loopback_ok():
    import socket
    try:
        socket.create_connection(("127.0.0.2", 9), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return True


@pytest.mark.parametrize("budget", [None, 128])
def test_a_new_address_is_served_while_500_half_sent_requests_keep_reopening(budget, tmp_path):
    """500 half-sent requests from 10 addresses (50 each, under the per-address cap) keep
    reopening; real requests from new addresses all get their 200. With the default budget (512)
    they all fit; with a budget of 128 the oldest half-open ones are shed to make room."""
    if not _loopback_ok():
        pytest.skip("no 127.0.0.2 on this machine's loopback")
    from serve_helpers import running, tiny_pipeline

    from mixqrt.testing.flood import Flood, loopback, real_request
    pipe = tiny_pipeline(tmp_path)
    limits = Limits(header_timeout=5, body_timeout=5, **({"max_connections": budget} if budget else {}))
    with running(pipe, limits) as s:
        with Flood(s.port, n=500, addresses=10) as f:
            assert f.opened >= 450, (f.opened, f.failed)
            results = [real_request(s.port, loopback(20 + i), timeout=30) for i in range(8)]
        assert [st for st, _ in results] == [200] * 8, results
        if budget:
            assert f.closed_by_server > 100              # shed, oldest first, and reopened

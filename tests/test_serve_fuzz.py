"""HTTP fuzz of every route of the server, in-process (ASGI calls, the tiny model): random JSON,
wrong types, lone surrogates, huge and non-finite numbers, truncated bodies, random headers and
methods. No response may be >= 500.

MIXQRT_HTTP_FUZZ=N sets the number of cases (default 300 for CI); by hand:
    MIXQRT_HTTP_FUZZ=10000 PYTHONPATH=$PWD python -m pytest tests/test_serve_fuzz.py -q -s
(the count, time and outcome are printed; docs/server.md records a run)."""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
from asgi_helpers import call

pytest.importorskip("starlette")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mixqrt.serving import protocol as oai  # noqa: E402

CASES = int(os.environ.get("MIXQRT_HTTP_FUZZ", "300"))
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/models/tiny"), ("GET", "/health"), ("GET", "/metrics")]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
BIG = "\"\\u0000BIG\""                 # placeholders replaced in the serialized body
BIG_TEXT = {"\"\\u0000BIG\"": "9" * 5000}

text = st.text(alphabet=st.characters(codec=None, categories=["L", "N", "P", "S", "Z", "Cc", "Cs"]), max_size=12)
scalar = (st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30) | st.floats() | text
          | st.sampled_from([0, 1, -1, 2 ** 63, 2 ** 64, 1e308, -0.0, "", "none", "auto", "text", "json_object",
                             "user", "system", "assistant", "tool", float("nan"), float("inf"), "\0BIG"]))
value = st.recursive(scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
                     max_leaves=12)
FIELDS = sorted(oai.fields("chat") | oai.fields("completion") | oai.IGNORED)
good_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
                                  "content": text | value})
field_value = {
    "messages": st.lists(good_msg | value, max_size=3) | value,
    "prompt": text | st.lists(text, max_size=2) | value,
    "max_tokens": st.integers(-2, 10) | value, "max_completion_tokens": st.integers(-2, 10) | value,
    "stream": st.booleans() | value, "n": st.integers(-1, 10) | value,
    "logprobs": st.booleans() | st.integers(-1, 25) | value, "top_logprobs": st.integers(-1, 25) | value,
    "logit_bias": st.dictionaries(st.integers(-5, 300).map(str) | text, st.floats(-200, 200) | value, max_size=4),
    "stop": text | st.lists(text, max_size=6) | value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | value}) | value,
}


@st.composite
def bodies(draw, path):
    kind = draw(st.sampled_from(["fields", "fields", "fields", "json", "truncated", "bytes"]))
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    base["max_tokens"] = 2
    if kind in ("fields", "truncated"):
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(FIELDS) | text, min_size=1, max_size=5)):
            body[name] = draw(field_value.get(name, value))
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(body, key=ascii))), None)
        raw = json.dumps(body, ensure_ascii=True).encode()          # NaN / Infinity stay (allow_nan)
        for k, v in BIG_TEXT.items():
            raw = raw.replace(k.encode(), v.encode())
        if kind == "truncated":
            raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
        return raw
    if kind == "json":
        return json.dumps(draw(value)).encode().replace(BIG.encode(), b"9" * 5000)
    return draw(st.binary(max_size=64))


token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@st.composite
def requests(draw):
    if draw(st.integers(0, 9)) < 8:
        method, path = draw(st.sampled_from(ROUTES))
        if draw(st.integers(0, 9)) == 0:
            method = draw(st.sampled_from(METHODS))
    else:
        method = draw(st.sampled_from(METHODS))
        path = "/" + draw(st.text(alphabet=st.characters(codec="latin-1", exclude_characters="?#"), max_size=20))
    ctype = "application/json" if draw(st.integers(0, 9)) < 8 else \
        draw(st.sampled_from(["application/json; charset=utf-8", "text/plain", "", "APPLICATION/JSON"]))
    headers = {"content-type": ctype}
    for k, v in draw(st.dictionaries(token, st.text(alphabet=st.characters(codec="latin-1", exclude_characters="\r\n"),
                                                    max_size=20), max_size=3)).items():
        if k not in ("host", "content-length", "transfer-encoding"):
            headers[k] = v
    if draw(st.integers(0, 19)) == 0:
        headers["content-length"] = draw(st.sampled_from(["abc", "-1", "99999999999", "0", "5"]))
    body = draw(bodies(path)) if method == "POST" or draw(st.integers(0, 9)) == 0 else b""
    return method, path, headers, body


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from serve_helpers import tiny_pipeline

    from mixqrt.serving.server.app import create_app
    from mixqrt.serving.server.guard import Limits
    pipe = tiny_pipeline(tmp_path_factory.mktemp("fuzz"), max_context=24)
    a = create_app(pipe, model="tiny", limits=Limits(max_tokens=8))
    yield a
    a.state.server.engine.close()


def test_no_route_answers_5xx(app):
    seen, worst = Counter(), []
    t0 = time.perf_counter()

    @settings(max_examples=CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(requests())
    def one(req):
        method, path, headers, body = req
        status, _, out = call(app, method, path, raw=body, headers=headers)
        seen[status] += 1
        if method == "POST" and path.startswith("/v1/") and "completions" in path:
            seen[f"POST {path} {status}"] += 1
        if status >= 500:
            worst.append((method, path, headers, body[:200], out))
        assert status < 500, (method, path, headers, body[:300], out)

    one()
    dt = time.perf_counter() - t0
    cases = sum(v for k, v in seen.items() if isinstance(k, int))
    print(f"\nHTTP fuzz: {cases} cases in {dt:.1f} s, statuses {dict(sorted(seen.items(), key=str))}")
    assert not worst and cases >= min(CASES, 50)
    assert seen[200] > 0 and seen[400] > 0          # the fuzz reaches the engine and the checks

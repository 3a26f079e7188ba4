"""Prompt-cache isolation through the server (issue 33.1): user B guesses the digits of a PIN in
user A's system prompt and reads `usage.prompt_tokens_details.cached_tokens`. With the same salt
(the default: no salt, no API keys) the guess that is right gets one more cached token and the
PIN comes out; with a different `cache_salt`, or a different API key, it never does. Also: the
`cache_prompt` and `cache_salt` fields, /metrics behind the API key, `--kv-cache-bytes 0` and
sizes. Timing is measured (not asserted) by benchmarks/cache_isolation.py."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

import pytest
from serve_helpers import running
from test_serve import pipe  # noqa: F401  (the tiny model's Pipeline)

from mixqrt.serving.server.guard import Limits

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

PIN = "4721"
SECRET = f"The vault code is {PIN}. Never tell it."


def ask(client, system: str, salt: str | None = None, **extra) -> int:
    body = {"cache_salt": salt} if salt is not None else {}
    out = client.chat.completions.create(
        model="x", messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        max_tokens=2, temperature=0, extra_body={**body, **extra})
    return out.usage.prompt_tokens_details.cached_tokens


def attack(client, salt=None) -> tuple[str, list]:
    """B's digit-by-digit guess from cached_tokens -> (what B recovers, [(right digit's count,
    best wrong digit's count) per position]). B is given the true digits so far (the strongest
    attacker): a position leaks when the right digit stands out."""
    found, margins = "", []
    for i in range(len(PIN)):
        scores = {d: ask(client, f"The vault code is {PIN[:i]}{d}?", salt) for d in "0123456789"}
        best = max(scores.values())
        winners = [d for d, v in scores.items() if v == best]
        found += winners[0] if len(winners) == 1 else "?"
        margins.append((scores[PIN[i]], max(v for d, v in scores.items() if d != PIN[i])))
    return found, margins


def test_same_salt_leaks_a_different_salt_does_not(pipe):  # noqa: F811
    with running(pipe) as s:
        c = s.client()
        ask(c, SECRET)                                       # user A, no salt
        assert attack(c)[0] == PIN                           # the shared default cache: the PIN comes out
        ask(c, SECRET, salt="alice")
        found, margins = attack(c, salt="bob")
        assert found != PIN and all(right <= wrong for right, wrong in margins), margins
        # the same salt still hits: A's second turn reuses A's first
        assert ask(c, SECRET, salt="alice") > 10


def test_different_api_keys_never_share(pipe):  # noqa: F811
    with running(pipe, Limits(api_key=("key-a", "key-b"))) as s:
        a, b = s.client(api_key="key-a"), s.client(api_key="key-b")
        ask(a, SECRET)
        found, margins = attack(b)
        assert found != PIN and all(right <= wrong for right, wrong in margins), margins
        ask(a, SECRET, salt="x")
        assert attack(b, salt="x")[0] != PIN                # the same cache_salt under another key: no
        assert ask(a, SECRET) > 10                           # key A's own cache still hits
        assert s.app.state.server.engine.stats()["cache_salts"] == 4   # (key, salt) pairs


def post(s, body: dict, headers=None):
    req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cache_fields_and_metrics_behind_the_key(pipe):  # noqa: F811
    auth = {"Authorization": "Bearer k1"}
    with running(pipe, Limits(api_key="k1")) as s:
        prompt = {"prompt": SECRET, "max_tokens": 2, "temperature": 0}
        assert post(s, {**prompt, "cache_prompt": False}, auth)[0] == 200
        st, out = post(s, prompt, auth)
        assert st == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # nothing was stored
        st, out = post(s, {**prompt, "cache_prompt": False}, auth)
        assert st == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # nor read
        assert post(s, prompt, auth)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 10
        for bad, param in (({"cache_salt": 5}, "cache_salt"), ({"cache_salt": "x" * 257}, "cache_salt"),
                           ({"cache_prompt": "no"}, "cache_prompt")):
            st, out = post(s, {**prompt, **bad}, auth)
            assert st == 400 and out["error"]["param"] == param
        req = urllib.request.Request(s.url + "/metrics")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        req.add_header("Authorization", "Bearer k1")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert b"mixqrt_cache_hits_total" in r.read()
        with urllib.request.urlopen(s.url + "/health", timeout=10) as r:
            assert r.status == 200


def test_cli_cache_bytes_and_keys(tmp_path, monkeypatch):
    from mixqrt.errors import MixqrtError
    from mixqrt.serving.server import add_serve_parser
    from mixqrt.serving.server.cli import engine_kwargs, limits_from_args
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="cmd"))
    monkeypatch.delenv("MIXQRT_API_KEY", raising=False)
    assert engine_kwargs(p.parse_args(["serve", "m", "--kv-cache-bytes", "0"]))["kv_cache_bytes"] == 0
    assert engine_kwargs(p.parse_args(["serve", "m", "--kv-cache-bytes", "50MiB"]))["kv_cache_bytes"] == 50 << 20
    assert engine_kwargs(p.parse_args(["serve", "m", "--kv-cache-bytes", "2GB"]))["kv_cache_bytes"] == 2 * 10 ** 9
    for bad in ("-1", "5 parsecs", "MiB"):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "m", "--kv-cache-bytes", bad])
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk2\n\nk3\n")
    a = p.parse_args(["serve", "m", "--api-key", "k1", "--api-key-file", str(keys)])
    assert limits_from_args(a).api_key == ("k1", "k2", "k3")
    assert limits_from_args(p.parse_args(["serve", "m"])).api_key is None
    monkeypatch.setenv("MIXQRT_API_KEY", "env")
    assert limits_from_args(p.parse_args(["serve", "m"])).api_key == "env"
    assert limits_from_args(p.parse_args(["serve", "m", "--api-key", "k1"])).api_key == "k1"
    keys.write_text("# none\n")
    monkeypatch.delenv("MIXQRT_API_KEY")
    with pytest.raises(MixqrtError, match="no key"):
        limits_from_args(p.parse_args(["serve", "m", "--api-key-file", str(keys)]))

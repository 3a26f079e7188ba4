"""The server under the KV byte bound (issue 41): a prompt whose K/V cannot fit gets a 400 naming
the sizes, param "prompt"; a prompt that fits is answered. --kv-type reaches the engine."""
from __future__ import annotations

import pytest
from serve_helpers import running
from test_serve import pipe  # noqa: F401  (the tiny model's Pipeline)
from test_serve_cache import post

pytest.importorskip("starlette")


def test_prompt_over_the_kv_bound_is_a_400(pipe):  # noqa: F811
    with running(pipe, engine_kwargs={"kv_cache_bytes": 32 << 10, "kv_type": "f16"}) as s:
        eng = s.app.state.server.engine
        assert eng.kv_type == "f16"
        rows = eng._cache.max_rows()
        assert rows < eng.max_context
        text = "def quicksort(xs): return xs "
        n = len(pipe.tokenizer.encode(text, add_special_tokens=False))
        code, body = post(s, {"prompt": text * (rows // n + 2), "max_tokens": 4})
        assert code == 400 and body["error"]["param"] == "prompt"
        assert "kv_cache_bytes" in body["error"]["message"] and f"{rows} tokens" in body["error"]["message"]
        code, body = post(s, {"prompt": text * max(1, rows // (2 * n)), "max_tokens": 4, "temperature": 0})
        assert code == 200 and body["usage"]["completion_tokens"] >= 1


def test_serve_cli_kv_type():
    from mixqrt.cli import build_parser
    from mixqrt.serving.server.cli import engine_kwargs
    a = build_parser().parse_args(["serve", "--kv-type", "f16", "--kv-cache-bytes", "1GiB"])
    kw = engine_kwargs(a)
    assert kw["kv_type"] == "f16" and kw["kv_cache_bytes"] == 1 << 30

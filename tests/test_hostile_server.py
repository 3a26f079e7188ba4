"""Issue 39 against the server: two Authorization headers and one cache-key rule (item 6), the
connection budget under many addresses (item 4), the served file replaced under a stream (item 5)."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from mixqrt.serve.app import cache_salt  # noqa: E402
from mixqrt.serve.guard import Guard, Limits  # noqa: E402


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

"""What stands between a socket and the engine: body and JSON limits, Host/Origin/API-key checks,
request limits (stop strings, max_tokens), and a request log with control characters escaped."""
from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger("mixqrt.serve")

MAX_BODY_BYTES = 1 << 20            # a 32k-token chat is ~150 KB of JSON
MAX_JSON_DEPTH = 32                 # OpenAI bodies nest 5 deep (messages -> content parts)
MAX_STOP = 4                        # OpenAI's limits on stop strings
MAX_STOP_BYTES = 256
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


class HTTPError(Exception):
    """An OpenAI-shaped error reply: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    api_key: str | tuple | None = None      # one key, or several (each with its own prompt cache)
    allowed_hosts: tuple = ("*",)
    allowed_origins: tuple = ()             # "*" or exact origins ("https://app.example.com")
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    max_tokens: int | None = None           # cap on max_tokens (None: the context)
    write_timeout: float = 10.0             # a stream whose client reads nothing for this long is cancelled
    stats: dict = field(default_factory=dict)


# ============================================================================ logs
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}


def escape(text) -> str:
    """Control characters as \\xNN: a request path cannot forge log lines or terminal escapes."""
    return str(text).translate(_ESCAPES)


def log_request(scope, status: int, t0: float, extra: str = "") -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client") or ("-", 0)
    log.info("%s %s %s %d %.3fs%s", escape(client[0]), escape(scope.get("method", "")),
             escape(scope.get("path", "")), status, time.perf_counter() - t0, extra and " " + escape(extra))


# ============================================================================ body
async def read_json(request, limits: Limits) -> dict:
    """The request body as a JSON object; 4xx (never 500) for anything else."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        # also what stops a cross-site form / text/plain POST from a browser (no CORS preflight)
        raise HTTPError(415, f"Content-Type must be application/json, got {escape(ctype) or 'none'!r}")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HTTPError(400, "bad Content-Length")
        if int(length) > limits.max_body_bytes:
            raise HTTPError(413, f"request body of {int(length)} bytes is over the limit of {limits.max_body_bytes}")
    chunks, n = [], 0
    async for chunk in request.stream():           # chunked bodies: counted as they arrive
        n += len(chunk)
        if n > limits.max_body_bytes:
            raise HTTPError(413, f"request body is over the limit of {limits.max_body_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, f"request body nests deeper than {limits.max_json_depth} levels") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    if _depth(body, limits.max_json_depth) > limits.max_json_depth:
        raise HTTPError(400, f"request body nests deeper than {limits.max_json_depth} levels")
    return body


def _depth(obj, limit: int) -> int:
    """Nesting depth of a parsed JSON value, iteratively (stops counting past `limit`)."""
    stack, deepest = [(obj, 1)], 0
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > limit:
            return d
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return deepest


# ============================================================================ request limits
def check_limits(body: dict, limits: Limits) -> None:
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if isinstance(stops, list):
            if len(stops) > MAX_STOP:
                raise HTTPError(400, f"at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
            for s in stops:
                if isinstance(s, str) and len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
                    raise HTTPError(400, f"a stop string is at most {MAX_STOP_BYTES} bytes", param="stop")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if limits.max_tokens is not None and isinstance(v, int) and not isinstance(v, bool) \
                and v > limits.max_tokens:
            raise HTTPError(400, f"{key}={v} is over this server's limit of {limits.max_tokens}", param=key)


# ============================================================================ who may call
def _host_name(host: str) -> str:
    host = host.lower()
    if host.startswith("["):                       # [::1]:8000
        end = host.find("]")
        return host[:end + 1] if end > 0 else host
    return host.rsplit(":", 1)[0]


def _host_ok(host: str, allowed) -> bool:
    if "*" in allowed:
        return True
    name = _host_name(host)
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


def api_keys(limits: Limits) -> tuple:
    """The API keys configured (none: no key needed)."""
    k = limits.api_key
    return tuple(x for x in ((k,) if isinstance(k, str) else (k or ())) if x)


def key_ok(token: str, keys: tuple) -> bool:
    """Whether token is one of keys, comparing with every key in constant time."""
    t = token.encode("latin-1", "replace")
    return sum(hmac.compare_digest(t, k.encode("utf-8", "surrogatepass")) for k in keys) > 0


class Guard:
    """ASGI middleware: Host allow-list, foreign Origin refused, API key on /v1/*, replica header,
    request log. Runs before any body is read."""

    def __init__(self, app, limits: Limits, replica: str | None = None):
        self.app, self.limits, self.replica = app, limits, replica

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]
        extra = [(b"x-mixqrt-replica", self.replica.encode())] if self.replica else []

        async def send_wrapped(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                if extra:
                    msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            await send(msg)

        try:
            err = self.check(scope)
            if err is not None:
                await _send_error(send_wrapped, err)
                return
            await self.app(scope, receive, send_wrapped)
        finally:
            log_request(scope, status[0], t0)

    def check(self, scope) -> HTTPError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if not _host_ok(host, self.limits.allowed_hosts):
            return HTTPError(421, f"Host {escape(host)!r} is not served here (see --allowed-hosts)",
                             code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return HTTPError(403, f"Origin {escape(origin)!r} is not allowed (see --allowed-origins)",
                             code="origin_not_allowed")
        path = scope.get("path", "")
        keys = api_keys(self.limits)
        if keys and (path.startswith("/v1/") or path == "/metrics") and scope.get("method") != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key_ok(token.strip(), keys):
                return HTTPError(401, "invalid API key: send 'Authorization: Bearer <key>' with one of the "
                                      "server's --api-key", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
        return None

    def _origin_ok(self, origin: str, host: str) -> bool:
        allowed = self.limits.allowed_origins
        if "*" in allowed or origin in allowed:
            return True
        return urlsplit(origin).netloc.lower() == host.lower() and host != ""   # same origin


async def _send_error(send, e: HTTPError):
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

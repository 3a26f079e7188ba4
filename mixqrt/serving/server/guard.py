"""What stands between a socket and the engine: connection limits and read deadlines, body and JSON
limits, Host/Origin/API-key checks, and a request log with control, bidi and line-separator
characters escaped. Request fields are checked by mixqrt.serving.protocol."""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


from mixqrt.errors import RequestError
from mixqrt.serving.protocol import MAX_JSON_DEPTH, error_body, loads

log = logging.getLogger("mixqrt.serving.server")

MAX_BODY_BYTES = 1 << 20            # a 32k-token chat is ~150 KB of JSON
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
HEADER_TIMEOUT = 10.0               # seconds for a request's headers (slowloris)
BODY_TIMEOUT = 30.0                 # seconds for its whole body after the headers (1 MiB at ~35 KB/s)
MAX_CLIENT_CONNECTIONS = 64         # per peer address: one peer cannot take all
MAX_CONNECTIONS = 512               # server-wide budget, above the per-address cap (uvicorn's limit sits above it)


class HTTPError(Exception):
    """An OpenAI-shaped error reply: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.param, self.code, self.type)


@dataclass
class Limits:
    api_key: str | tuple | None = None      # one key, or several (each with its own prompt cache)
    allowed_hosts: tuple = ("*",)
    allowed_origins: tuple = ()             # "*" or exact origins ("https://app.example.com")
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    max_tokens: int | None = None           # cap on max_tokens (None: the context)
    write_timeout: float = 10.0             # a stream whose client reads nothing for this long is cancelled
    header_timeout: float = HEADER_TIMEOUT  # a connection's request headers must arrive within this
    body_timeout: float = BODY_TIMEOUT      # ... and the whole body within this of the headers
    max_client_connections: int = MAX_CLIENT_CONNECTIONS   # open connections per peer address (0: no limit)
    max_connections: int = MAX_CONNECTIONS  # open connections in all; at it, the oldest half-open one is shed
    stats: dict = field(default_factory=dict)


# ============================================================================ logs
def _escape_char(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escape(text) -> str:
    """Every non-printable character as \\xNN / \\uNNNN: C0/C1 controls, bidi controls (U+202E...),
    line and paragraph separators (U+2028/9), zero-width and format characters, unusual spaces,
    lone surrogates, unassigned code points. A request path or header cannot forge log lines,
    reorder what a terminal shows, or send terminal escapes."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def log_request(scope, status: int, t0: float, extra: str = "") -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client") or ("-", 0)
    log.info("%s %s %s %d %.3fs%s", escape(client[0]), escape(scope.get("method", "")),
             escape(scope.get("path", "")), status, time.perf_counter() - t0, extra and " " + escape(extra))


# ============================================================================ body
async def read_json(request, limits: Limits) -> dict:
    """The request body as a JSON object; 4xx (never 500) for anything else (mixqrt.serving.protocol.loads: a
    lone surrogate, NaN, a huge integer, too deep... is a 400 naming the field)."""
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
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect
    chunks, n = [], 0
    try:
        async for chunk in request.stream():       # chunked bodies: counted as they arrive
            n += len(chunk)
            if n > limits.max_body_bytes:
                raise HTTPError(413, f"request body is over the limit of {limits.max_body_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:                       # nobody to answer: one log line (499), no traceback
        raise HTTPError(499, f"client closed the connection after {n} bytes of the body",
                        code="client_closed") from None
    try:       # off the event loop: a 1 MiB body of small values takes a while to parse and check
        return await run_in_threadpool(loads, b"".join(chunks), limits.max_json_depth)
    except RequestError as e:
        raise HTTPError(400, str(e), param=e.field) from None


# ============================================================================ who may call
_REG_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


def host_name(host: str) -> str | None:
    """The name part of a Host header value (lower case, IPv6 in brackets), or None when the value
    is not `name[:port]`: a DNS name or IPv4 address, or a bracketed IPv6 address followed by
    nothing or ":port" ("[::1]evil.example" is refused, not read as "[::1]")."""
    host = host.lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return None
        name, rest = host[:end + 1], host[end + 1:]
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    else:
        name, sep, port = host.partition(":")
        rest = sep + port
        if not _REG_NAME.fullmatch(name):
            return None
    if rest and not (rest[0] == ":" and (rest == ":" or _PORT.fullmatch(rest[1:]))):
        return None
    return name


def _host_ok(host: str, allowed) -> bool:
    name = host_name(host)
    if name is None:
        return False
    if "*" in allowed:
        return True
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


def api_keys(limits: Limits) -> tuple:
    """The API keys configured (none: no key needed)."""
    k = limits.api_key
    return tuple(x for x in ((k,) if isinstance(k, str) else (k or ())) if x)


def key_ok(token: str, keys: tuple) -> bool:
    """Whether token is one of keys, comparing with every key in constant time."""
    t = token.encode("latin-1", "replace")
    return sum(hmac.compare_digest(t, k.encode("utf-8", "surrogatepass")) for k in keys) > 0


# routes outside /v1/ that need the API key too (llama.cpp's /infill; /health stays open)
KEYED_PATHS = ("/metrics", "/infill")


class Guard:
    """ASGI middleware: Host allow-list, foreign Origin refused, API key on /v1/*, replica header,
    request log, and the body deadline. Runs before any body is read."""

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
            await self.app(scope, _body_deadline(receive, self.limits.body_timeout), send_wrapped)
        finally:
            log_request(scope, status[0], t0)

    def check(self, scope) -> HTTPError | None:
        headers, hosts, auths = {}, 0, 0
        for k, v in scope.get("headers", []):
            k = k.decode("latin-1").lower()
            hosts += k == "host"
            auths += k == "authorization"
            headers[k] = v.decode("latin-1")
        if hosts > 1:                                   # RFC 9112 3.2: a server must answer 400
            return HTTPError(400, f"{hosts} Host headers; a request carries exactly one", code="bad_host")
        if auths > 1:       # which one was checked and which one picks the prompt cache must not differ
            return HTTPError(400, f"{auths} Authorization headers; a request carries at most one",
                             code="bad_authorization")
        host = headers.get("host", "")
        if host and host_name(host) is None:
            return HTTPError(400, f"Host {escape(host)!r} is not a host name with an optional :port",
                             code="bad_host")
        if not (host == "" and "*" in self.limits.allowed_hosts) and not _host_ok(host, self.limits.allowed_hosts):
            return HTTPError(421, f"Host {escape(host)!r} is not served here (see --allowed-hosts)",
                             code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return HTTPError(403, f"Origin {escape(origin)!r} is not allowed (see --allowed-origins)",
                             code="origin_not_allowed")
        path = scope.get("path", "")
        keys = api_keys(self.limits)
        if keys and (path.startswith("/v1/") or path in KEYED_PATHS) and scope.get("method") != "OPTIONS":
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


def _body_deadline(receive, timeout: float):
    """`receive` with a deadline on the request body: until the last body chunk has arrived, each
    call waits at most until `timeout` seconds after the first; past that it raises a 408
    HTTPError (Connection: close, so the server drops the socket after answering). Once the body
    is complete, calls pass through untimed (a streaming reply waits on receive() for the disconnect)."""
    import asyncio
    loop = asyncio.get_running_loop()
    deadline = [None]
    done = [False]

    async def wrapped():
        if done[0]:
            return await receive()
        if deadline[0] is None:
            deadline[0] = loop.time() + timeout
        try:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline[0] - loop.time()))
        except asyncio.TimeoutError:
            done[0] = True
            raise HTTPError(408, f"request body not received within {timeout:g} s (see --body-timeout)",
                            code="body_timeout", headers={"Connection": "close"}) from None
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            done[0] = True
        return msg

    return wrapped


async def _send_error(send, e: HTTPError):
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ============================================================================ connections
def _canned(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(HTTPError(status, message, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: 1\r\nconnection: close\r\n\r\n").encode() + body


def protocol_class(limits: Limits):
    """uvicorn's HTTP protocol (httptools, else h11) with what uvicorn itself lacks: a deadline on
    each request's headers (from the connection's first byte, or its opening for the first
    request) and a limit on the connections open from one peer address. A connection over the
    limit gets a 503 and is closed before anything is read from it; one whose headers are late
    gets a 408 and is closed. Either way it stops counting against uvicorn's limit_concurrency,
    which counts every open connection. The body's deadline is _body_deadline's (the ASGI side).

    And a server-wide budget (limits.max_connections, above the per-address cap): at it, a new
    connection sheds the oldest connection that has no request in progress (none yet, a body still
    arriving, or idle between requests) with a 503, so that a few addresses reopening half-sent
    requests cannot keep a new client out; only when every open connection is serving a request is
    the new one refused. uvicorn's limit_concurrency sits above the budget (serve.cli)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    header_timeout, per_client = float(limits.header_timeout), int(limits.max_client_connections)
    budget = int(limits.max_connections)
    if budget and per_client and budget <= per_client:
        budget = per_client + 1                 # the budget sits above the per-address cap, always
    busy = _canned(503, "Service Unavailable", f"too many connections from this address (at most {per_client})",
                   "too_many_connections")
    full = _canned(503, "Service Unavailable", f"the server is at its connection budget ({budget}) and every "
                   "connection is serving a request", "too_many_connections")
    shed = _canned(503, "Service Unavailable", f"connection shed: the server is at its connection budget "
                   f"({budget}) and this was its oldest connection without a request in progress",
                   "connection_shed")
    late = _canned(408, "Request Timeout", f"request headers not received within {header_timeout:g} s",
                   "header_timeout")
    open_from: dict[str, int] = {}              # peer address -> open connections (one event loop: no lock)
    open_all: dict = {}                         # every counted connection, oldest first (insertion order)
    refused = {"at": -1e9, "quiet": 0}          # the refusal log: one line a second at most

    def log_refusal(msg: str, *args) -> None:
        now = time.monotonic()
        if now - refused["at"] >= 1.0:
            more = f" (and {refused['quiet']} more in the last second)" if refused["quiet"] else ""
            log.warning(msg + "%s", *args, more)
            refused["at"], refused["quiet"] = now, 0
        else:
            refused["quiet"] += 1

    def half_open(p) -> bool:
        """No request in progress: none yet, its body still arriving, or an idle kept-alive one."""
        c = p.cycle
        return c is None or getattr(c, "more_body", False) or getattr(c, "response_complete", False)

    def shed_oldest() -> bool:
        for p in open_all:
            if half_open(p) and not p.transport.is_closing():
                log_refusal("%s: oldest half-open connection shed, %d open (connection budget %d, "
                            "--max-connections)", escape(p._peer), len(open_all), budget)
                p.transport.write(shed)
                p.transport.close()
                p._uncount()
                return True
        return False

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        _peer = None            # counted in open_from / open_all while set
        _refused = False
        _timer = None           # the header deadline, while armed
        _waiting = None         # the request cycle in place when it was armed

        def connection_made(self, transport):
            super().connection_made(transport)
            peer = str((self.client or ("unknown",))[0])
            n = open_from.get(peer, 0)
            over = per_client and n >= per_client
            if over or (budget and len(open_all) >= budget and not shed_oldest()):
                self._refused = True
                if over:
                    log_refusal("%s: connection refused, %d already open from this address "
                                "(--max-client-connections)", escape(peer), n)
                else:
                    log_refusal("%s: connection refused, %d open and all serving requests (--max-connections)",
                                escape(peer), len(open_all))
                transport.write(busy if over else full)
                transport.close()
                return
            open_from[peer] = n + 1
            open_all[self] = None
            self._peer = peer
            self._arm()

        def _uncount(self):
            if self._peer is not None:
                left = open_from.get(self._peer, 1) - 1
                if left > 0:
                    open_from[self._peer] = left
                else:
                    open_from.pop(self._peer, None)
                open_all.pop(self, None)
                self._peer = None

        def _arm(self):
            self._waiting = self.cycle
            self._timer = self.loop.call_later(header_timeout, self._late)

        def _late(self):
            self._timer = None
            if self.cycle is self._waiting and not self.transport.is_closing():
                log.info("%s: connection closed, no complete request headers within %g s (--header-timeout)",
                         escape(self._peer), header_timeout)
                self.transport.write(late)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()                     # the next request on a kept-alive connection
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._waiting:
                self._timer.cancel()            # its headers are complete: the body deadline takes over
                self._timer = None

        def connection_lost(self, exc):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._uncount()
            super().connection_lost(exc)

    GuardedHTTPProtocol.open_from = open_from
    GuardedHTTPProtocol.open_all = open_all
    return GuardedHTTPProtocol

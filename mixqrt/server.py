"""An OpenAI-compatible HTTP server for one model, standard library only.

    POST /v1/chat/completions   (stream: true -> text/event-stream, `data: {chunk}` ... `data: [DONE]`)
    POST /v1/completions
    GET  /v1/models, /v1/models/{id}
    GET  /health

    server = make_server(pipe, "127.0.0.1", 0)      # port 0: any free port (tests)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ...; server.shutdown(); server.server_close()

One CPU model computes one request at a time: requests take a lock in arrival order, at most
`max_concurrency` are admitted (running + waiting) and the rest get 503 at once. A client that
goes away (closed socket) stops its generation within a token.
"""
from __future__ import annotations

import argparse
import hmac
import inspect
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mixqrt.api import RequestError, Stats, create_chat_completion, create_completion, model_name
from mixqrt.errors import MixqrtError

MAX_BODY_BYTES = 4 * 2**20
_DRAIN_LIMIT = 16 * 2**20          # unread bodies up to this size are drained after an error reply
DEFAULT_MAX_CONCURRENCY = 4

# request fields clients send that change nothing here (one model per server, no accounts)
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_prompt"}
# body key -> keyword of create_*: OpenAI's newer name for max_tokens in chat
_ALIASES = {"max_completion_tokens": "max_tokens"}
_INTERNAL = {"pipe", "prompt", "messages", "model", "stats"}


def _params(fn) -> set[str]:
    return {p for p in inspect.signature(fn).parameters if p not in _INTERNAL}


_ROUTES = {"/v1/chat/completions": (create_chat_completion, "messages", _params(create_chat_completion)),
           "/v1/completions": (create_completion, "prompt", _params(create_completion))}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message, type_="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _ClientGone(Exception):
    pass


class MixqrtServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, pipe, *, api_key=None, max_concurrency=DEFAULT_MAX_CONCURRENCY, model=None,
                 max_body_bytes=MAX_BODY_BYTES, verbose=True):
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self.pipe = pipe
        self.api_key = api_key or None
        self.model_name = model or model_name(pipe)
        self.created = int(time.time())
        self.max_body_bytes = int(max_body_bytes)
        self.verbose = verbose
        self.generation_lock = threading.Lock()          # the model runs one request at a time
        self.admission = threading.BoundedSemaphore(max_concurrency)
        super().__init__(addr, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mixqrt"
    timeout = 120                      # idle/slow clients do not hold a thread forever
    server: MixqrtServer

    # ------------------------------------------------------------------ plumbing
    def log_message(self, fmt, *args):
        if self.server.verbose:
            sys.stderr.write(f"mixqrt serve: {self.address_string()} {fmt % args}\n")

    def _send_json(self, status: int, obj, headers=()):
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, e: HTTPError, headers=()):
        self._send_json(e.status, error_body(e.message, e.type, e.param, e.code), headers)

    def _check_auth(self):
        key = self.server.api_key
        if key is None:
            return
        got = self.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise HTTPError(401, "invalid API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                            "invalid_request_error", None, "invalid_api_key")

    def _client_gone(self) -> bool:
        """True once the peer has closed its end (readable with nothing to read)."""
        sock = self.connection
        try:
            r, _, _ = select.select([sock], [], [], 0)
            if not r:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _discard_body(self):
        """Read and drop an unread request body (so the client reads our error instead of a reset);
        close the connection when that is not possible or too much."""
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            n = -1
        if n < 0 or n > _DRAIN_LIMIT or "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            return
        try:
            while n > 0:
                got = self.rfile.read(min(n, 1 << 16))
                if not got:
                    break
                n -= len(got)
        except OSError:
            pass
        self.close_connection = self.close_connection or n > 0
        self._body_read = True

    def _read_json(self) -> dict:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise HTTPError(411, "chunked request bodies are not supported: send Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise HTTPError(411, "a request body with Content-Length is required")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise HTTPError(400, f"bad Content-Length {length!r}") from None
        if n > self.server.max_body_bytes:
            raise HTTPError(413, f"request body of {n} bytes is over the limit of {self.server.max_body_bytes}")
        raw = self.rfile.read(n)
        self._body_read = True
        if len(raw) != n:
            self.close_connection = True
            raise HTTPError(400, "request body shorter than Content-Length")
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    # ------------------------------------------------------------------ dispatch
    def _route(self, method: str):
        self._body_read = False
        path = self.path.split("?", 1)[0]
        if len(path) > 1:
            path = path.rstrip("/")
        try:
            if path == "/health" and method in ("GET", "HEAD"):
                self._send_json(200, {"status": "ok", "model": self.server.model_name})
                return
            known = path in _ROUTES or path in ("/health", "/v1/models") or path.startswith("/v1/models/")
            if not known:
                raise HTTPError(404, f"unknown route {method} {path}", "invalid_request_error", None,
                                "unknown_url")
            want = "POST" if path in _ROUTES else "GET"
            if method != want and not (want == "GET" and method == "HEAD"):
                raise HTTPError(405, f"{path} takes {want}, not {method}", "invalid_request_error", None,
                                "method_not_allowed")
            self._check_auth()
            if path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self._model_card()]})
            elif path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                if name != self.server.model_name:
                    raise HTTPError(404, f"model {name!r} is not served here (this server has "
                                         f"{self.server.model_name!r})", "invalid_request_error", "model",
                                    "model_not_found")
                self._send_json(200, self._model_card())
            else:
                self._generate(path, self._read_json())
        except HTTPError as e:
            if method in ("POST", "PUT", "DELETE") and not self._body_read:
                self._discard_body()
            headers = [("Retry-After", "1")] if e.status == 503 else []
            if e.status == 401:
                headers.append(("WWW-Authenticate", "Bearer"))
            self._send_error(e, headers)
        except (BrokenPipeError, ConnectionResetError, _ClientGone):
            self.close_connection = True
        except Exception as e:       # noqa: BLE001 - the server must answer and keep running
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            try:
                self._send_error(HTTPError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
            except OSError:
                pass

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    def do_DELETE(self):
        self._route("DELETE")

    def _model_card(self) -> dict:
        return {"id": self.server.model_name, "object": "model", "created": self.server.created,
                "owned_by": "mixqrt"}

    # ------------------------------------------------------------------ generation
    def _generate(self, path: str, body: dict):
        fn, first_key, allowed = _ROUTES[path]
        if first_key not in body:
            raise HTTPError(400, f"'{first_key}' is required", "invalid_request_error", first_key)
        kwargs = {}
        for k, v in body.items():
            if k == first_key or k in _IGNORED:
                continue
            name = _ALIASES.get(k, k)
            if name not in allowed:
                raise HTTPError(400, f"unrecognized request argument: {k}", "invalid_request_error", k)
            kwargs[name] = v
        stream = kwargs.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, f"stream must be true or false, got {stream!r}", "invalid_request_error", "stream")
        try:     # check the arguments now (a lazy stream runs nothing) rather than after the queue
            fn(self.server.pipe, body[first_key], model=self.server.model_name, **{**kwargs, "stream": True}).close()
        except RequestError as e:
            raise HTTPError(400, str(e), "invalid_request_error", e.param, e.code) from None
        stats = Stats()
        if not self.server.admission.acquire(blocking=False):
            raise HTTPError(503, "server busy: too many requests waiting for the model; retry later",
                            "server_error", None, "server_busy")
        try:
            t0 = time.perf_counter()
            with self.server.generation_lock:
                try:
                    pipe = _Watched(self.server.pipe, self._client_gone)
                    result = fn(pipe, body[first_key], model=self.server.model_name, stats=stats, **kwargs)
                    if stream is True:
                        self._stream(result)
                    else:
                        self._send_json(200, result)
                except RequestError as e:
                    raise HTTPError(400, str(e), "invalid_request_error", e.param, e.code) from None
                except MixqrtError as e:
                    raise HTTPError(400, str(e), "invalid_request_error") from None
            self._log_stats(stats, time.perf_counter() - t0)
        finally:
            self.server.admission.release()

    def _stream(self, chunks):
        """SSE over chunked transfer encoding; the first chunk (after prefill) is pulled before the
        headers go out, so a bad request still gets a plain 400."""
        it = iter(chunks)
        try:
            first = next(it, None)           # RequestError here -> 400 above
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("X-Accel-Buffering", "no")
            self.end_headers()
            try:
                if first is not None:
                    self._event(first)
                for c in it:
                    self._event(c)
                self._write_chunk(b"data: [DONE]\n\n")
            except (_ClientGone, OSError):
                raise
            except MixqrtError as e:
                # headers are out: report in-band, as OpenAI does, then end the stream
                self._event(error_body(str(e), "invalid_request_error", getattr(e, "param", None),
                                       getattr(e, "code", None)))
            except Exception as e:      # noqa: BLE001 - a bug mid-stream: no second status line
                traceback.print_exc(file=sys.stderr)
                self.close_connection = True
                self._event(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
            self._write_chunk(b"")
            self.wfile.flush()
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()                       # stops generation (client gone or error)

    def _event(self, obj):
        self._write_chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _write_chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _log_stats(self, stats: Stats, seconds: float):
        r = stats.last
        if r is None or not self.server.verbose:
            return
        sys.stderr.write(f"mixqrt serve: prompt {r.prompt_tokens} tok {r.prompt_tps:.1f} tok/s | generated "
                         f"{r.generation_tokens} tok {r.generation_tps:.1f} tok/s | TTFT {r.ttft_s:.3f} s | "
                         f"{r.finish_reason} | {seconds:.2f} s\n")


class _Watched:
    """The pipeline, with a check between tokens that the client is still there."""

    def __init__(self, pipe, gone):
        self._pipe, self._gone = pipe, gone

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def stream(self, *args, **kwargs):
        if self._gone():                       # left while queued: skip the prefill
            raise _ClientGone()
        it = self._pipe.stream(*args, **kwargs)
        try:
            for r in it:
                if self._gone():
                    raise _ClientGone()
                yield r
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def make_server(pipe, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
                max_concurrency: int = DEFAULT_MAX_CONCURRENCY, model: str | None = None,
                max_body_bytes: int = MAX_BODY_BYTES, verbose: bool = True) -> MixqrtServer:
    """A bound, not yet serving server (call .serve_forever()); port 0 picks a free port (.server_address)."""
    return MixqrtServer((host, port), pipe, api_key=api_key, max_concurrency=max_concurrency, model=model,
                        max_body_bytes=max_body_bytes, verbose=verbose)


def serve(pipe, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_concurrency: int = DEFAULT_MAX_CONCURRENCY, *, model: str | None = None, verbose: bool = True):
    """Serve until Ctrl-C."""
    server = make_server(pipe, host, port, api_key=api_key, max_concurrency=max_concurrency, model=model,
                         verbose=verbose)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"mixqrt serve: warning: listening on {host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr)
    print(f"mixqrt serve: {server.model_name} at {server.url}/v1 (max {max_concurrency} requests admitted, "
          "one generating at a time; Ctrl-C to stop)", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ============================================================================ command line
def cmd_serve(a):
    from mixqrt.pipeline import Pipeline
    pipe = Pipeline(a.model, recipe=a.recipe, threads=a.threads, progress=not a.quiet,
                    offline=True if a.offline else None, max_context=a.ctx)
    try:
        serve(pipe, a.host, a.port, api_key=a.api_key, max_concurrency=a.max_concurrency,
              model=a.model_alias or _model_id(a.model) or model_name(pipe), verbose=not a.quiet)
    except OSError as e:       # port taken, address not local...: one line, not a traceback
        raise MixqrtError(f"cannot serve on {a.host}:{a.port}: {e.strerror or e}") from None


def _model_id(model: str | None) -> str | None:
    """The id /v1/models reports: an alias or hub id as given, a local path by its file/folder name."""
    if not model or not os.path.exists(model):
        return model
    name = os.path.basename(os.path.normpath(model))
    for ext in (".mxq", ".gguf"):
        if name.lower().endswith(ext):
            return name[:-len(ext)]
    return name


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """`mixqrt serve MODEL [--host H] [--port P] [--recipe R] [-t N] [--api-key KEY] [--max-concurrency N]`."""
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, SSE)")
    s.add_argument("model", nargs="?", default=None,
                   help="a .mxq, a .gguf, a Hugging Face folder, a hub id or alias (default: the demo model)")
    s.add_argument("--recipe", default=None, help="quantization recipe (default 2356, or the name's suffix)")
    s.add_argument("-t", "--threads", type=int, default=None, help="kernel threads (default: usable cores)")
    s.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, capped at 4096)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("MIXQRT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (default: $MIXQRT_API_KEY, else no key)")
    s.add_argument("--max-concurrency", type=_positive, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"requests admitted at once, running + queued; more get 503 (default "
                        f"{DEFAULT_MAX_CONCURRENCY})")
    s.add_argument("--model-alias", default=None, help="model id reported by /v1/models (default: MODEL)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars or request log")
    s.add_argument("--offline", action="store_true", help="never touch the network (like HF_HUB_OFFLINE=1)")
    s.set_defaults(fn=cmd_serve)
    return s


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n

"""Call an ASGI app in-process (no socket, no httpx): one request -> (status, headers, body)."""
from __future__ import annotations

import asyncio
import json


async def acall(app, method: str, path: str, body: bytes = b"", headers=None, chunks=None, timeout: float = 60):
    """-> (status, {header: value}, body bytes). `chunks`: send the body in these pieces instead
    (a truncated upload: the client then disconnects)."""
    pieces = list(chunks) if chunks is not None else [body]
    hdrs = [(b"host", b"127.0.0.1")]
    headers = headers or {"content-type": "application/json"}        # a dict, or [(name, value)] pairs
    hdrs += [(k.lower().encode("latin-1"), v.encode("latin-1"))
             for k, v in (headers.items() if isinstance(headers, dict) else headers)]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "method": method, "path": path,
             "raw_path": path.encode("latin-1", "replace"), "query_string": b"", "root_path": "", "scheme": "http",
             "http_version": "1.1", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "headers": hdrs}
    queue = [{"type": "http.request", "body": p, "more_body": i + 1 < len(pieces)} for i, p in enumerate(pieces)]
    if chunks is not None:
        queue.append({"type": "http.disconnect"})
    sent, done = [], asyncio.Event()

    async def receive():
        if queue:
            return queue.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)
        if msg["type"] == "http.response.body" and not msg.get("more_body", False):
            done.set()

    await asyncio.wait_for(app(scope, receive, send), timeout)
    done.set()
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start.get("headers", [])}, out


def call(app, method, path, body=None, raw=None, headers=None, chunks=None):
    """Blocking acall; `body` is JSON-encoded unless `raw` bytes are given. -> (status, headers, parsed or bytes)."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    status, h, out = asyncio.run(acall(app, method, path, data, headers, chunks))
    try:
        out = json.loads(out)
    except ValueError:
        pass
    return status, h, out


def sse(body: bytes) -> list:
    """The data: objects of an SSE stream, without [DONE]."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out

"""A real uvicorn server on 127.0.0.1 (port 0) in a thread, over the tiny model, for the serve tests."""
from __future__ import annotations

import contextlib
import threading
import time

from mixqrt.serving.server.app import create_app
from mixqrt.serving.server.cli import uvicorn_config
from mixqrt.serving.server.guard import Limits


class Running:
    def __init__(self, app, **kw):
        import uvicorn
        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, **kw))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.app.state.server.engine.close()


def tiny_pipeline(d, max_context: int = 256):
    """A Pipeline over the tiny model (f32) built in folder `d`, its cache there too."""
    import os

    from tinymodel import make_tiny_hf_model

    from mixqrt.pipeline import Pipeline
    old = os.environ.get("MIXQRT_CACHE")
    os.environ["MIXQRT_CACHE"] = str(d / "cache")
    try:
        return Pipeline(make_tiny_hf_model(d / "hf"), recipe="f32", progress=False, offline=True,
                        max_context=max_context)
    finally:
        if old is None:
            os.environ.pop("MIXQRT_CACHE")
        else:
            os.environ["MIXQRT_CACHE"] = old


@contextlib.contextmanager
def running(pipe, limits: Limits | None = None, engine_kwargs=None, **kw):
    app = create_app(pipe, model="tiny", limits=limits or Limits(), engine_kwargs=engine_kwargs)
    r = Running(app, **{k: v for k, v in (engine_kwargs or {}).items() if k in ("max_slots", "max_queue")}, **kw)
    try:
        yield r
    finally:
        r.stop()


# ============================================================================ a server in another process
_SERVE_SCRIPT = r"""
import json, os, sys
sys.path[:0] = sys.argv[1:3]
from mixqrt.pipeline import Pipeline
from mixqrt.serving.server.guard import Limits
from serve_helpers import running
from tinymodel import make_tiny_hf_model
tmp, model, opts = sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
os.environ["MIXQRT_CACHE"] = os.path.join(tmp, "cache")
if not model:
    model = str(make_tiny_hf_model(os.path.join(tmp, "hf")))
pipe = Pipeline(model, recipe=None if model.endswith(".mxq") else "f32", progress=False, offline=True,
                max_context=opts.pop("max_context", 256), **opts.pop("pipeline", {}))
with running(pipe, Limits(**opts.pop("limits", {})), engine_kwargs=opts.pop("engine_kwargs", None)) as s:
    print("PORT", s.port, flush=True)
    sys.stdin.read()                                    # until the test closes our stdin
"""


class Subprocess:
    """`mixqrt serve`'s app over the tiny model (or `model`, an .mxq) in a child process, so that a
    crash of the server is seen as one (returncode) instead of taking the tests down."""

    def __init__(self, tmp, model: str = "", **opts):
        import json
        import subprocess
        import sys
        from pathlib import Path

        import mixqrt
        tests = Path(__file__).resolve().parent
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE_SCRIPT, str(Path(mixqrt.__file__).parent.parent),
                                      str(tests), str(tmp), str(model), json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(Path(tmp) / "server.log", "w"),
                                     text=True)
        self.log = Path(tmp) / "server.log"
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r} {self.log.read_text()[-3000:]}")
        self.port = int(line.split()[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """Close the server; its returncode (None if it had to be killed)."""
        import subprocess
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


@contextlib.contextmanager
def subprocess_server(tmp, model: str = "", **opts):
    s = Subprocess(tmp, model, **opts)
    try:
        yield s
    finally:
        s.stop()


def post(port: int, path: str, body, timeout: float = 60, headers=None, source: str = "127.0.0.1"):
    """(status, parsed JSON or raw bytes) of one POST over a fresh connection."""
    import http.client
    import json
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        c.request("POST", path, body=json.dumps(body) if not isinstance(body, bytes) else body,
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data
    finally:
        c.close()


def stream_events(port: int, body: dict, timeout: float = 60) -> list:
    """The `data:` payloads of one streamed completion, "[DONE]" included, as they came."""
    import http.client
    import json
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return [("status", r.status, r.read())]
        out = []
        for line in r:
            line = line.strip()
            if line.startswith(b"data: "):
                d = line[6:].decode()
                out.append(d if d == "[DONE]" else json.loads(d))
        return out
    finally:
        c.close()

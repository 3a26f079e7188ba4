"""A real uvicorn server on 127.0.0.1 (port 0) in a thread, over the tiny model, for the serve tests."""
from __future__ import annotations

import contextlib
import threading
import time

from mixqrt.serve.app import create_app
from mixqrt.serve.cli import uvicorn_config
from mixqrt.serve.guard import Limits


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

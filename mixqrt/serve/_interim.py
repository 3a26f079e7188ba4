"""INTERIM stand-in for mixqrt.engine (one request at a time); deleted once the Engine lands."""
from __future__ import annotations

import asyncio
import queue
import threading

from mixqrt.errors import GenerationError


class EngineBusy(GenerationError):
    pass


class _Req:
    def __init__(self, ids, kw, buffer):
        self.ids, self.kw = ids, kw
        self.q = queue.Queue(maxsize=buffer)
        self.cancelled = threading.Event()
        self.loop = None

    def cancel(self):
        self.cancelled.set()

    def __iter__(self):
        while True:
            r = self.q.get()
            if isinstance(r, Exception):
                raise r
            if r is None:
                return
            yield r

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        while True:
            try:
                r = self.q.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.005)
                continue
            if isinstance(r, Exception):
                raise r
            if r is None:
                return
            yield r


class Engine:
    def __init__(self, pipe, *, max_slots=8, max_queue=64, stall_timeout=30.0, **_):
        self.pipe, self.max_queue, self.stall = pipe, max_queue, stall_timeout
        self.q = queue.Queue()
        self.n_tokens = 0
        self.running = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, prompt_ids, *, buffer=64, eos_token_ids=None, **kw):
        if self.q.qsize() >= self.max_queue:
            raise EngineBusy("queue full")
        if len(prompt_ids) + 1 > self.pipe.max_context:
            raise GenerationError("the prompt does not fit: the context holds %d" % self.pipe.max_context)
        r = _Req(list(prompt_ids), kw, buffer)
        self.q.put(r)
        return r

    def _loop(self):
        from mixqrt.generate import stream_generate
        while True:
            r = self.q.get()
            if r.cancelled.is_set():
                continue
            self.running = 1
            try:
                for g in stream_generate(self.pipe.model, self.pipe.tokenizer, r.ids,
                                         max_context=self.pipe.max_context, **r.kw):
                    self.n_tokens += 1
                    g.cached_tokens = 0
                    if r.cancelled.is_set():
                        break
                    try:
                        r.q.put(g, timeout=self.stall)
                    except queue.Full:
                        break
                r.q.put(None)
            except Exception as e:  # noqa: BLE001
                r.q.put(e)
            finally:
                self.running = 0

    def stats(self):
        return {"running": self.running, "queued": self.q.qsize(), "tokens_generated": self.n_tokens,
                "cached_tokens": 0, "cache_hits": 0}

    def close(self):
        pass

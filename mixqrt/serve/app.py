"""The OpenAI-compatible ASGI app (Starlette) over one Engine.

    app = create_app(pipe)                     # builds Engine(pipe); or create_app(pipe, engine=eng)
    uvicorn.run(app, ...)                      # mixqrt.serve.run() sets the limits that matter

Requests are checked (Host, Origin, API key, body size, JSON depth, arguments, stop strings,
max_tokens) before they reach the engine; engine.submit() is the bounded admission (EngineBusy ->
503 with Retry-After). Each stream pulls from its own bounded engine buffer and writes to its
socket here, never while holding the engine; a client that reads nothing for `write_timeout`
seconds, or goes away, has its request cancelled. Response objects are OpenAI's (mixqrt.api).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mixqrt import api
from mixqrt.errors import GenerationError, MixqrtError
from mixqrt.serve.guard import Guard, HTTPError, Limits, check_limits, read_json
from mixqrt.serve.metrics import CONTENT_TYPE, Metrics
from mixqrt.serve.watch import watch_pipeline

from mixqrt.engine import Engine, EngineBusy

# request fields clients send that change nothing here (one model per server, no accounts)
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "cache_prompt"}
_ALIASES = {"max_completion_tokens": "max_tokens"}      # OpenAI's newer name in chat
_INTERNAL = {"pipe", "prompt", "messages", "model", "stats"}
_GEN_ARGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "stop", "seed",
             "frequency_penalty", "presence_penalty", "n", "logit_bias")


def _params(fn) -> set[str]:
    import inspect
    return {p for p in inspect.signature(fn).parameters if p not in _INTERNAL}


_ROUTES = {"chat": (api.create_chat_completion, "messages", _params(api.create_chat_completion)),
           "completion": (api.create_completion, "prompt", _params(api.create_completion))}


def error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _ArgsOnly:
    """What api.create_* see while they check arguments: a context length and no model to run."""

    def __init__(self, max_context):
        self.max_context = max_context

    def stream(self, *a, **k):
        raise RuntimeError("argument check only")


class Server:
    def __init__(self, pipe, engine, *, model: str, limits: Limits, replica: str | None):
        self.pipe, self.engine, self.model, self.limits = pipe, engine, model, limits
        self.tokenizer = pipe.tokenizer
        self.context = int(getattr(pipe, "max_context", None) or pipe.model.context_length)
        self.metrics = Metrics(engine, replica)
        self.created = int(time.time())
        self.extra_health = {}
        self.watch = None           # serve.watch.FileWatch on the mapped .mxq (create_app)

    # ------------------------------------------------------------------ request -> engine
    def prepare(self, kind: str, body: dict):
        """Check a request body -> (prompt ids, engine kwargs, Shape); HTTPError for bad ones."""
        fn, key, allowed = _ROUTES[kind]
        if key not in body:
            raise HTTPError(400, f"'{key}' is required", param=key)
        check_limits(body, self.limits)
        kwargs = {}
        for k, v in body.items():
            if k == key or k in _IGNORED:
                continue
            name = _ALIASES.get(k, k)
            if name not in allowed:
                raise HTTPError(400, f"unrecognized request argument: {k}", param=k)
            kwargs[name] = v
        try:
            fn(_ArgsOnly(self.context), body[key], model=self.model, **{**kwargs, "stream": True}).close()
            defaults = {"max_tokens": 16} if kind == "completion" else {}
            gen = api._gen_kwargs(context=self.context, **{a: kwargs.get(a, defaults.get(a)) for a in _GEN_ARGS})
            reply = None
            if kind == "chat":
                ids, skw, reply = self._structured(body[key], kwargs)
                gen.update(skw)
                text = None
            else:
                text = api._prompt_text(body[key])
                ids = self.tokenizer.encode(text)
                bos = self.tokenizer.bos_token_id
                if self.tokenizer.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                    ids.insert(0, int(bos))
        except api.RequestError as e:
            raise HTTPError(400, str(e), param=e.param, code=e.code) from None
        except MixqrtError as e:                    # template refused the messages, ...
            raise HTTPError(400, str(e)) from None
        if not ids:
            raise HTTPError(400, "the prompt is empty", param=key)
        if len(ids) + 1 > self.context:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens; with at least one new token that needs "
                                 f"{len(ids) + 1} positions but the context holds {self.context}",
                            param=key, code="context_length_exceeded")
        gen["max_new_tokens"] = min(gen["max_new_tokens"], self.context - len(ids))
        # no temperature: the engine's generate.resolve_sampling applies the greedy default
        echo = text if kind == "completion" and kwargs.get("echo") else None
        shape = Shape(kind, api._head("chatcmpl" if kind == "chat" else "cmpl",
                                      "chat.completion" if kind == "chat" else "text_completion", self.model, None),
                      api._include_usage(kwargs.get("stream_options")), echo, reply)
        return ids, gen, shape, kwargs.get("stream", False)

    def _structured(self, messages, kwargs):
        """Chat: prompt ids with the tools rendered, the engine's structured-output arguments
        (response_format, tools, tool_choice, parallel_tool_calls) and the tool-aware reply shape."""
        from mixqrt.tools import chat_ids
        skw = api.structured_kwargs(kwargs.get("response_format"), kwargs.get("tools"), kwargs.get("tool_choice"),
                                    kwargs.get("parallel_tool_calls"))
        ids = chat_ids(self.tokenizer, api.check_messages(messages), skw.get("tools"), skw.get("tool_choice"))
        return ids, skw, api.chat_reply(self.tokenizer, skw)

    async def generate(self, request, kind: str):
        route = request.url.path
        try:
            self.check_file()
            body = await read_json(request, self.limits)
            ids, gen, shape, stream = await run_in_threadpool(self.prepare, kind, body)
            try:
                req = self.engine.submit(ids, **gen)
            except EngineBusy as e:
                raise HTTPError(503, f"server busy: {e}; retry later", "server_error", code="server_busy",
                                headers={"Retry-After": "1"}) from None
            except GenerationError as e:
                raise HTTPError(400, str(e), param=getattr(e, "param", None)) from None
        except HTTPError as e:
            self.metrics.request(route, e.status)
            return error_response(e)
        return _Run(self, req, shape, stream, route)

    # ------------------------------------------------------------------ routes
    async def chat(self, request):
        return await self.generate(request, "chat")

    async def completion(self, request):
        return await self.generate(request, "completion")

    def card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "mixqrt"}

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model_card(self, request):
        name = request.path_params["name"]
        if name != self.model:
            return error_response(HTTPError(404, f"model {name!r} is not served here (this server has "
                                                  f"{self.model!r})", param="model", code="model_not_found"))
        return JSONResponse(self.card())

    def check_file(self) -> None:
        """503 once the served .mxq changed under us (serve.watch)."""
        why = self.watch.check() if self.watch is not None else None
        if why is not None:
            raise HTTPError(503, f"the model file changed while being served ({why}); restart the server",
                            "server_error", code="model_file_changed")

    async def health(self, request):
        try:
            self.check_file()
        except HTTPError as e:
            return JSONResponse({"status": "error", "model": self.model, "error": e.message, **self.extra_health},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": self.model, **self.extra_health})

    async def metrics_route(self, request):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


class Shape:
    """OpenAI's objects for one request (the same fields api.create_* return)."""

    def __init__(self, kind, head, include_usage, echo, reply=None):
        from mixqrt.tools import ChatReply
        self.kind, self.head, self.include_usage, self.echo = kind, head, include_usage, echo
        self.reply = reply or ChatReply()       # tool calls parsed out of a chat reply

    @staticmethod
    def usage(last) -> dict:
        u = api._usage(last)
        u["prompt_tokens_details"] = {"cached_tokens": int(getattr(last, "cached_tokens", 0) or 0)}
        return u

    @staticmethod
    def reason(last) -> str:
        r = getattr(last, "finish_reason", None)
        return r if r in ("stop", "length") else "stop"

    def whole(self, text: str, last) -> dict:
        if self.kind == "chat":
            message, reason = self.reply.message(text, self.reason(last))
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"text": (self.echo or "") + text, "index": 0, "logprobs": None,
                      "finish_reason": self.reason(last)}
        return {**self.head, "choices": [choice], "usage": self.usage(last)}

    def _chunk(self, payload, reason=None) -> dict:
        if self.kind == "chat":
            return {**self.head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": payload, "logprobs": None, "finish_reason": reason}]}
        return {**self.head, "choices": [{"text": payload, "index": 0, "logprobs": None, "finish_reason": reason}]}

    def start(self) -> list:
        if self.kind == "chat":
            return [self._chunk({"role": "assistant"})]
        return [self._chunk(self.echo)] if self.echo else []

    def piece(self, text: str) -> list:
        if not text:
            return []
        if self.kind == "chat":
            return [self._chunk(d) for d in self.reply.deltas(text)]
        return [self._chunk(text)]

    def end(self, last) -> list:
        if self.kind == "chat":
            tail, reason = self.reply.end(self.reason(last))
            out = [self._chunk(d) for d in tail] + [self._chunk({}, reason)]
        else:
            out = [self._chunk("", self.reason(last))]
        if self.include_usage:
            out.append({**self.head, "object": "chat.completion.chunk" if self.kind == "chat" else self.head["object"],
                        "choices": [], "usage": self.usage(last)})
        return out


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _Run(Response):
    """One admitted request: a JSON reply or an SSE stream, cancelled when the client leaves or
    stops reading."""

    def __init__(self, srv: Server, req, shape: Shape, stream: bool, route: str):
        self.srv, self.req, self.shape, self.stream, self.route = srv, req, shape, stream, route
        self.background = None
        self.first, self.last, self.t0 = True, None, time.perf_counter()

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.req.cancel()

        self.scope = scope
        watcher = asyncio.ensure_future(watch())
        status = 200
        try:
            status = await (self._sse(send) if self.stream else self._json(send))
        finally:
            watcher.cancel()
            self.req.cancel()                          # no-op once finished
            self.srv.metrics.request(self.route, status)
            last = self.last
            if last is not None:
                self.srv.metrics.finished(int(getattr(last, "prompt_tokens", 0) or 0), self._ttft)

    def _seen(self, r):
        if self.first:
            self.first = False
            self._ttft = getattr(r, "ttft_s", None) or (time.perf_counter() - self.t0)
        if getattr(r, "token", None) is not None:
            self.srv.metrics.token()
        self.last = r

    _ttft = None

    async def _json(self, send) -> int:
        pieces = []
        try:
            async for r in self.req:
                self._seen(r)
                pieces.append(r.text)
        except GenerationError as e:
            await error_response(HTTPError(400, str(e), param=getattr(e, "param", None)))(self.scope, None, send)
            return 400
        await JSONResponse(self.shape.whole("".join(pieces), self.last))(self.scope, None, send)
        return 200

    async def _sse(self, send) -> int:
        it = self.req.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except GenerationError as e:                   # before any byte: a plain 400
            await error_response(HTTPError(400, str(e), param=getattr(e, "param", None)))(self.scope, None, send)
            return 400
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        timeout = self.srv.limits.write_timeout

        async def out(chunks):
            for c in chunks:
                await asyncio.wait_for(send({"type": "http.response.body", "body": _sse(c), "more_body": True}),
                                       timeout)

        try:
            await out(self.shape.start())
            if first is not None:
                self._seen(first)
                await out(self.shape.piece(first.text))
                async for r in it:
                    self._seen(r)
                    await out(self.shape.piece(r.text))
            await out(self.shape.end(self.last))
            await asyncio.wait_for(send({"type": "http.response.body", "body": b"data: [DONE]\n\n"}), timeout)
        except (asyncio.TimeoutError, OSError):
            self.req.cancel()                          # the client stopped reading: free the slot
            return 499
        except MixqrtError as e:                       # headers are out: in-band, as OpenAI does
            body = HTTPError(400, str(e)).body()
            await send({"type": "http.response.body", "body": _sse(body) + b"data: [DONE]\n\n"})
        return 200


async def _not_found(request, exc):
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return error_response(HTTPError(405, f"{request.url.path} does not take {request.method}",
                                        code="method_not_allowed"))
    return error_response(HTTPError(status, f"unknown route {request.method} {request.url.path}",
                                    code="unknown_url"))


async def _internal(request, exc):
    return error_response(HTTPError(500, f"internal error: {type(exc).__name__}", "server_error"))


def create_app(pipe, *, engine=None, model: str | None = None, limits: Limits | None = None,
               replica: str | None = None, engine_kwargs: dict | None = None) -> Starlette:
    """The ASGI app serving `pipe` (a Pipeline) through `engine` (default: Engine(pipe, **engine_kwargs))."""
    limits = limits or Limits()
    if engine is None:          # the Pipeline's own engine when it has one: one engine per model
        configure = getattr(pipe, "configure_engine", None)
        engine = configure(**(engine_kwargs or {})) if configure else Engine(pipe, **(engine_kwargs or {}))
    srv = Server(pipe, engine, model=model or api.model_name(pipe), limits=limits, replica=replica)
    srv.watch = watch_pipeline(pipe, on_change=lambda why: threading.Thread(target=engine.close, daemon=True).start())
    routes = [Route("/v1/chat/completions", srv.chat, methods=["POST"]),
              Route("/v1/completions", srv.completion, methods=["POST"]),
              Route("/v1/models", srv.models, methods=["GET"]),
              Route("/v1/models/{name:path}", srv.model_card, methods=["GET"]),
              Route("/health", srv.health, methods=["GET"]),
              Route("/metrics", srv.metrics_route, methods=["GET"])]
    middleware = []
    if limits.allowed_origins:                          # CORS only when asked for
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    middleware.append(Middleware(Guard, limits=limits, replica=replica))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _not_found, Exception: _internal})
    app.state.server = srv
    return app

"""The OpenAI-compatible ASGI app (Starlette) over one Engine.

    app = create_app(pipe)                     # builds Engine(pipe); or create_app(pipe, engine=eng)
    uvicorn.run(app, ...)                      # mixqrt.serving.server.run() sets the limits that matter

Requests are checked (Host, Origin, API key, body size, JSON depth, arguments, stop strings,
max_tokens) before they reach the engine; engine.submit() is the bounded admission (EngineBusy ->
503 with Retry-After). Each stream pulls from its own bounded engine buffer and writes to its
socket here, never while holding the engine; a client that reads nothing for `write_timeout`
seconds, or goes away, has its request cancelled. Response objects are OpenAI's (mixqrt.serving.api).
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

from mixqrt.serving import api, protocol as oai
from mixqrt.errors import GenerationError, MixqrtError, RequestError
from mixqrt.generation.fim import build_infill
from mixqrt.generation.fim import stop_ids as fim_stop_ids
from mixqrt.generation.generate import encode_prompt
from mixqrt.generation.tool_calls import chat_ids
from mixqrt.serving.server.guard import Guard, HTTPError, Limits, read_json
from mixqrt.serving.server.replies import SafeJSONResponse, cache_salt, error_response  # noqa: F401  (re-exported)
from mixqrt.serving.server.replies import bad_request as _bad_request
from mixqrt.serving.server.replies import submission_errors
from mixqrt.serving.server.replies import engine_error as _engine_error  # noqa: F401
from mixqrt.serving.server.metrics import CONTENT_TYPE, Metrics
from mixqrt.serving.server.watch import watch_pipeline

from mixqrt.generation.engine import Engine


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
        """Check a request body -> (prompt ids, oai.Request); HTTPError for bad ones."""
        try:
            req = oai.parse(kind, body, max_tokens_cap=self.limits.max_tokens, max_depth=self.limits.max_json_depth)
            if kind == "chat":      # the tools rendered by the model's template (mixqrt.generation.tool_calls)
                ids = chat_ids(self.tokenizer, req.messages, req.params.tools, req.params.tool_choice)
            elif req.suffix is not None:            # fill-in-the-middle: the prompt is the prefix (mixqrt.generation.fim)
                mnt = req.params.max_new_tokens
                ids = build_infill(self.tokenizer, req.prompt, req.suffix, n_ctx=self.context,
                                   n_predict=mnt if mnt > 0 else -1)
                req.params = req.params.replace(eos_token_ids=list(fim_stop_ids(self.tokenizer, self.pipe.model)))
            else:
                ids = encode_prompt(self.tokenizer, req.prompt)
        except RequestError as e:
            raise _bad_request(e) from None
        except MixqrtError as e:                    # template refused the messages, ...
            raise HTTPError(400, oai.safe_message(e)) from None
        key = "messages" if kind == "chat" else "prompt"
        if not ids:
            raise HTTPError(400, "the prompt is empty", param=key)
        if len(ids) + 1 > self.context:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens; with at least one new token that needs "
                                 f"{len(ids) + 1} positions but the context holds {self.context}",
                            param=key, code="context_length_exceeded")
        # no temperature: the engine's generate.resolve_sampling applies the greedy default
        return ids, req

    async def generate(self, request, kind: str):
        route = request.url.path
        try:
            self.check_file()
            body = await read_json(request, self.limits)
            ids, parsed = await run_in_threadpool(self.prepare, kind, body)
            salt = cache_salt(parsed.params.cache_salt, request.headers.get("authorization"), self.limits)
            with submission_errors(GenerationError):
                req = self.engine.submit(ids, parsed.params.replace(cache_salt=salt))
        except HTTPError as e:
            self.metrics.request(route, e.status)
            return error_response(e)
        return _Run(self, req, oai.Assembler(parsed, oai.Reply(parsed, self.model), self.tokenizer), parsed.stream,
                    route)

    # ------------------------------------------------------------------ routes
    async def chat(self, request):
        return await self.generate(request, "chat")

    async def completion(self, request):
        return await self.generate(request, "completion")

    def card(self) -> dict:
        return oai.model_card(self.model, self.created)

    async def models(self, request):
        return JSONResponse(oai.model_list([self.card()]))

    async def model_card(self, request):
        name = request.path_params["name"]
        if name != self.model:
            return error_response(HTTPError(404, f"model {name!r} is not served here (this server has "
                                                  f"{self.model!r})", param="model", code="model_not_found"))
        return JSONResponse(self.card())

    def stopped_why(self) -> str:
        """Why the engine stopped a request that nobody cancelled."""
        why = self.watch.check() if self.watch is not None else None
        return (f"the model file changed while being served ({why}); this stream cannot continue" if why else
                "the server stopped this stream (the engine closed); retry")

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


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=True, allow_nan=False).encode("ascii") + b"\n\n"


class _Run(Response):
    """One admitted request: a JSON reply or an SSE stream, cancelled when the client leaves or
    stops reading."""

    def __init__(self, srv: Server, req, out: oai.Assembler, stream: bool, route: str):
        self.srv, self.req, self.out, self.stream, self.route = srv, req, out, stream, route
        self.background = None
        self.first, self.last, self.t0 = True, None, time.perf_counter()

    client_gone = False

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.client_gone = True
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
        try:
            async for r in self.req:
                self._seen(r)
                self.out.feed(r)
        except GenerationError as e:            # e.g. a grammar the engine could not compile
            await error_response(_engine_error(e))(self.scope, None, send)
            return 400
        await SafeJSONResponse(self.out.whole())(self.scope, None, send)
        return 200

    async def _sse(self, send) -> int:
        it = self.req.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except GenerationError as e:                   # before any byte: a plain 400
            await error_response(_engine_error(e))(self.scope, None, send)
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
            await out(self.out.start())
            if first is not None:
                self._seen(first)
                await out(self.out.feed(first))
                async for r in it:
                    self._seen(r)
                    await out(self.out.feed(r))
            if getattr(self.req, "finish_reason", None) == "cancelled" and not self.client_gone:
                # the engine closed under the stream (the served file changed, a shutdown): say so
                raise GenerationError(self.srv.stopped_why())
            await out(self.out.finish())
            await asyncio.wait_for(send({"type": "http.response.body", "body": b"data: [DONE]\n\n"}), timeout)
        except (asyncio.TimeoutError, OSError):
            self.req.cancel()                          # the client stopped reading: free the slot
            return 499
        except MixqrtError as e:                       # headers are out: in-band, as OpenAI does
            body = HTTPError(400, oai.safe_message(e)).body()
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


def infill_route(srv):
    from mixqrt.serving.server.infill import handle

    async def infill(request):
        return await handle(srv, request)
    return infill


def embeddings_route(srv):
    from mixqrt.serving.server.embeddings import handle

    async def embeddings(request):
        return await handle(srv, request)
    return embeddings


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
              Route("/infill", infill_route(srv), methods=["POST"]),
              Route("/v1/embeddings", embeddings_route(srv), methods=["POST"]),
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

"""POST /infill: llama.cpp server's fill-in-the-middle endpoint (what llama.vim / llama.vscode call).

Request (llama.cpp's names): ``input_prefix`` and ``input_suffix`` (required strings), ``input_extra``
([{"filename", "text"}], other files of the repository), ``prompt`` (text typed after the prefix),
and the options ``n_predict``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``,
``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``, ``stream``, ``cache_prompt``,
``n_indent`` (stop at a new line indented less than this, the line cut, as llama.cpp), ``t_max_predict_ms``
(once a new line was generated, stop at the next one past this time), ``response_fields`` (only
these fields, "timings/prompt_n" paths allowed). Accepted and without effect here: ``id_slot`` (one
engine serves every request), ``t_max_prompt_ms`` (llama.cpp's own TODO), ``samplers`` naming only
top_k / top_p / min_p / temperature / infill (the order is mixqrt's; "infill" is llama.cpp's
FIM-specific sampler, not applied). Anything else is refused by name.

The prompt is mixqrt.generation.fim.build_infill's (the model's FIM tokens, llama.cpp's order and trimming);
a model without FIM tokens is a 400 naming them. Replies are llama.cpp's (not OpenAI's): ``content``,
``stop``, ``stop_type`` (eos / limit / word), ``tokens_predicted``, ``tokens_evaluated``,
``tokens_cached``, ``has_new_line``, ``timings``; with ``stream`` one SSE event per piece
(``{"content", "stop": false}``) and a last one with ``stop: true`` and the rest.
"""
from __future__ import annotations

import json
import time

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from mixqrt.serving import protocol as oai
from mixqrt.errors import GenerationError, RequestError
from mixqrt.generation.fim import build_infill, stop_ids
from mixqrt.generation.params import UNTIL_FULL
from mixqrt.serving.server.guard import HTTPError, read_json
from mixqrt.generation.validate import integer

IGNORED = {"id_slot", "t_max_prompt_ms", "model"}
SAMPLERS = {"top_k", "top_p", "min_p", "temperature", "infill", "penalties"}
FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "temperature", "top_k", "top_p",
          "min_p", "seed", "stop", "repeat_penalty", "presence_penalty", "frequency_penalty", "stream",
          "cache_prompt", "n_indent", "t_max_predict_ms", "response_fields", "samplers"} | IGNORED
MAX_RESPONSE_FIELDS = 64


def _parse(srv, body: dict):
    """-> (prompt ids, SamplingParams, oai.Request, options dict); RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError(None, "request body must be a JSON object")
    oai.check_values(body, srv.limits.max_json_depth)
    for k in body:
        if k not in FIELDS:
            raise RequestError(oai._safe(k), f"unrecognized /infill argument: {oai._safe(k)}")
    for k in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(k), str):
            raise RequestError(k, f'"{k}" is required and must be a string')
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise RequestError("prompt", '"prompt" must be a string')
    samplers = body.get("samplers")
    if samplers is not None and (not isinstance(samplers, list) or len(samplers) > 16 or not all(
            isinstance(x, str) and x in SAMPLERS for x in samplers)):
        raise RequestError("samplers", f"samplers must be a list of {', '.join(sorted(SAMPLERS))}")
    # the OpenAI completion parser checks the sampling fields with the same bounds
    comp = {"prompt": "x", "max_tokens": body.get("n_predict"), "temperature": body.get("temperature"),
            "top_k": body.get("top_k"), "top_p": body.get("top_p"), "min_p": body.get("min_p"),
            "seed": body.get("seed"), "stop": body.get("stop") or None, "repeat_penalty": body.get("repeat_penalty"),
            "presence_penalty": body.get("presence_penalty"), "frequency_penalty": body.get("frequency_penalty"),
            "stream": body.get("stream"), "cache_prompt": body.get("cache_prompt")}
    try:
        req = oai.parse("completion", comp, max_tokens_cap=srv.limits.max_tokens,
                        max_depth=srv.limits.max_json_depth)
    except RequestError as e:               # name llama.cpp's field, not the OpenAI one
        raise RequestError("n_predict" if e.field == "max_tokens" else e.field, str(e).replace("max_tokens", "n_predict"))
    n_predict = body.get("n_predict")
    if n_predict is None or (isinstance(n_predict, int) and n_predict < 0):
        # llama.cpp: -1 is "until the context ends" (the server's cap, when it has one)
        cap = srv.limits.max_tokens
        req.params = req.params.replace(max_tokens=cap if cap is not None else UNTIL_FULL)
    opts = {}
    for k in ("n_indent", "t_max_predict_ms"):
        v = body.get(k)
        opts[k] = integer(k, v, lo=0, hi=1 << 30) if v is not None else 0
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or len(fields) > MAX_RESPONSE_FIELDS
                               or not all(isinstance(f, str) and 0 < len(f) <= 64 for f in fields)):
        raise RequestError("response_fields", f"response_fields must be a list of at most {MAX_RESPONSE_FIELDS} "
                                              "field names")
    opts["response_fields"] = fields
    mnt = req.params.max_new_tokens
    ids = build_infill(srv.tokenizer, body["input_prefix"], body["input_suffix"], body.get("input_extra"), prompt,
                       n_ctx=srv.context, n_predict=mnt if mnt > 0 else -1)
    params = req.params.replace(eos_token_ids=list(stop_ids(srv.tokenizer, srv.pipe.model)))
    return ids, params, req, opts


def _pick(obj: dict, fields) -> dict:
    """llama.cpp's response_fields: keep these fields ("a/b" reaches into an object), named by path."""
    if not fields:
        return obj
    out = {}
    for f in fields:
        cur = obj
        for part in f.split("/"):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            out[f] = cur
    return out


class _State:
    """The reply being built, with llama.cpp's n_indent / t_max_predict_ms stops."""

    def __init__(self, srv, req, ids, opts, t0):
        self.srv, self.req, self.ids, self.opts, self.t0 = srv, req, ids, opts, t0
        self.text, self.n, self.reason, self.last = "", 0, None, None
        self.t_first = None
        self.has_new_line = False
        self.nl = 0                      # where the current line starts in text (after a newline)

    def feed(self, r) -> str:
        """One engine piece -> the text to send (may end the request)."""
        self.last = r
        if r.token is not None:
            self.n += 1
            if self.t_first is None:
                self.t_first = time.perf_counter()
        piece = r.text
        start = len(self.text)
        self.text += piece
        if r.finish_reason is not None:
            self.reason = r.finish_reason
        n_indent = self.opts["n_indent"]
        if n_indent and self.has_new_line:
            pos = self.nl
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos < len(self.text) and pos - self.nl < n_indent and self.nl > 0:
                self.text = self.text[:pos]
                self.reason = "limit"
                self.req.cancel()
                return self.text[start:] if pos > start else ""
        i = self.text.rfind("\n", start)
        if i >= 0:
            if self.has_new_line and self.opts["t_max_predict_ms"] and self.t_first is not None and \
                    (time.perf_counter() - self.t_first) * 1000 > self.opts["t_max_predict_ms"]:
                self.reason = "limit"
                self.req.cancel()
            self.has_new_line = True
            self.nl = i + 1
        return piece

    def final(self) -> dict:
        last = self.last
        now = time.perf_counter()
        prompt_n = len(self.ids) - int(getattr(last, "cached_tokens", 0) or 0)
        ttft = float(getattr(last, "ttft_s", 0.0) or 0.0)
        gen_ms = (now - self.t_first) * 1000 if self.t_first else 0.0
        stop_type = "limit" if self.reason in ("length", "limit") else "eos"
        timings = {"cache_n": int(getattr(last, "cached_tokens", 0) or 0), "prompt_n": prompt_n,
                   "prompt_ms": ttft * 1000, "prompt_per_token_ms": ttft * 1000 / max(1, prompt_n),
                   "prompt_per_second": prompt_n / ttft if ttft > 0 else 0.0, "predicted_n": self.n,
                   "predicted_ms": gen_ms, "predicted_per_token_ms": gen_ms / max(1, self.n),
                   "predicted_per_second": self.n * 1000 / gen_ms if gen_ms > 0 else 0.0}
        return {"content": self.text, "id_slot": 0, "stop": True, "model": self.srv.model,
                "tokens_predicted": self.n, "tokens_evaluated": len(self.ids), "tokens_cached": timings["cache_n"],
                "has_new_line": self.has_new_line, "truncated": False, "stop_type": stop_type,
                "stopping_word": "", "timings": timings}


async def handle(srv, request):
    from mixqrt.serving.server.replies import SafeJSONResponse, cache_salt, error_response
    from mixqrt.serving.server.replies import engine_error as _engine_error
    from mixqrt.serving.server.replies import submission_errors
    route = request.url.path
    t0 = time.perf_counter()
    try:
        srv.check_file()
        body = await read_json(request, srv.limits)
        with submission_errors():
            ids, params, parsed, opts = await run_in_threadpool(_parse, srv, body)
            salt = cache_salt(None, request.headers.get("authorization"), srv.limits)
            req = srv.engine.submit(ids, params.replace(cache_salt=salt))
    except HTTPError as e:
        srv.metrics.request(route, e.status)
        return error_response(e)
    st = _State(srv, req, ids, opts, t0)
    fields = opts["response_fields"]

    if not parsed.stream:
        try:
            async for r in req:
                st.feed(r)
        except GenerationError as e:
            srv.metrics.request(route, 400)
            return error_response(_engine_error(e))
        finally:
            req.cancel()
        srv.metrics.request(route, 200)
        return SafeJSONResponse(_pick(st.final(), fields))

    async def events():
        try:
            async for r in req:
                piece = st.feed(r)
                if piece:
                    yield _sse({"content": piece, "stop": False, "tokens": [] if r.token is None else [int(r.token)]})
                if st.reason == "limit":
                    break
            yield _sse(_pick(st.final(), fields))
        except GenerationError as e:
            yield _sse(HTTPError(400, oai.safe_message(e)).body())
        finally:
            req.cancel()
            srv.metrics.request(route, 200)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=True, allow_nan=False).encode("ascii") + b"\n\n"


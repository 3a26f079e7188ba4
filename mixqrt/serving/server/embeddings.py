"""POST /v1/embeddings: OpenAI's embeddings endpoint (what LangChain's and LlamaIndex's OpenAI
embedding classes and the `openai` client call) over the server's engine.

The body is checked (oai.parse_embeddings), the inputs are encoded on a worker thread with their
bounds (mixqrt.generation.embed.encode_inputs: at most 2048 inputs, 300k tokens, each within the context, ids
inside the vocabulary, a string refused before tokenizing when it is longer than 64 characters per
context token), and the forwards run on the engine thread between decode steps (Engine.embed), so
running streams keep their pace. Pooling "none" (one vector per token) is not OpenAI's shape: 400,
as llama.cpp answers.
"""
from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from mixqrt.serving import protocol as oai
from mixqrt.generation.embed import check_dimensions, encode_inputs, truncate
from mixqrt.errors import GenerationError, RequestError
from mixqrt.serving.server.guard import HTTPError, read_json


def _embedder(srv):
    emb = getattr(srv, "_embedder", None)
    if emb is None:
        loaded = getattr(srv.pipe, "loaded", srv.pipe)
        emb = srv._embedder = loaded.embedder()
    return emb


def _prepare(srv, body):
    req = oai.parse_embeddings(body, max_depth=srv.limits.max_json_depth)
    emb = _embedder(srv)
    if emb.pooling == "none":
        raise RequestError(None, "this model's pooling is 'none' (one vector per token), which is not "
                                 "OpenAI's embeddings shape")
    dims = check_dimensions(emb, req.dimensions)
    seqs = encode_inputs(srv.tokenizer, req.input, max_tokens=srv.context)
    return req, emb, dims, seqs


async def handle(srv, request):
    from mixqrt.serving.server.replies import SafeJSONResponse, error_response
    from mixqrt.serving.server.replies import submission_errors
    route = request.url.path
    try:
        srv.check_file()
        body = await read_json(request, srv.limits)
        with submission_errors():
            req, emb, dims, seqs = await run_in_threadpool(_prepare, srv, body)
            fut = srv.engine.embed(seqs, emb)
        try:
            vecs = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except GenerationError as e:
            raise HTTPError(400, oai.safe_message(e)) from None
        if dims is not None:
            vecs = truncate(vecs, dims, emb.normalize)
        reply = await run_in_threadpool(oai.embeddings_reply, vecs, srv.model, sum(map(len, seqs)),
                                        req.encoding_format)
    except HTTPError as e:
        srv.metrics.request(route, e.status)
        return error_response(e)
    srv.metrics.request(route, 200)
    return SafeJSONResponse(reply)

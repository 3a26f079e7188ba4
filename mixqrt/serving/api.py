"""llama-cpp-python-shaped completions on top of a Pipeline (OpenAI's response objects).

    from mixqrt.serving.api import create_completion, create_chat_completion
    out = create_completion(pipe, "def quicksort(xs):", max_tokens=32)
    out["choices"][0]["text"]
    out = create_chat_completion(pipe, [{"role": "user", "content": "hi"}])
    out["choices"][0]["message"]["content"]
    for chunk in create_chat_completion(pipe, messages, stream=True):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")

Only `pipe.stream(text_or_messages, params)` (params a mixqrt.generation.params.SamplingParams;
GenerationResponse pieces) and, for the model name, `pipe.model_name` or `pipe.path` are used, so
any object with that shape works.

Sampling arguments left at None fall back to the model's generation_config.json like transformers
(greedy when it does not ask for sampling), not to llama-cpp-python's fixed 0.8/0.95/40 defaults.
Arguments are parsed, and replies rendered, by mixqrt.serving.protocol (the server uses the same module, so
both give the same objects). Arguments that cannot be honoured raise a RequestError naming the
argument instead of being silently ignored.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from mixqrt.serving import protocol as oai
from mixqrt.errors import GenerationError, RequestError
from mixqrt.serving.protocol import ROLES, check_messages  # noqa: F401 - part of this module's API
from mixqrt.generation.params import SamplingParams

__all__ = ["create_completion", "create_chat_completion", "create_embedding", "check_messages", "RequestError", "Stats",
           "model_name", "SamplingParams"]


def model_name(pipe) -> str:
    name = getattr(pipe, "model_name", None)
    if name:
        return str(name)
    path = getattr(pipe, "path", None)
    return Path(str(path)).stem if path else "mixqrt"


# ============================================================================ running
def _responses(pipe, prompt, params, suffix=None) -> Iterator:
    """pipe.stream(prompt, params) (pipe.stream_infill(prompt, suffix, params=params) with a suffix)
    with a "context_length_exceeded" code on the too-long-prompt error."""
    if suffix is not None and not hasattr(pipe, "stream_infill"):
        raise RequestError("suffix", "suffix (fill-in-the-middle) needs a Pipeline (its stream_infill)")
    it = iter(pipe.stream(prompt, params) if suffix is None else pipe.stream_infill(prompt, suffix, params=params))
    try:
        while True:
            try:
                r = next(it)
            except StopIteration:
                return
            except RequestError:
                raise
            except GenerationError as e:
                msg = str(e)
                code = "context_length_exceeded" if "context" in msg and "prompt" in msg else None
                raise RequestError(None, msg, code) from e
            yield r
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class Stats:
    """The last GenerationResponse of a run (tokens/s, TTFT), for logging; None until it ends."""
    last = None


def _run(pipe, req: oai.Request, model, stats):
    """One parsed request on `pipe` -> the reply dict, or an iterator of chunk dicts."""
    prompt = req.messages if req.kind == "chat" else req.prompt
    params = req.params
    out = oai.Assembler(req, oai.Reply(req, model if model is not None else model_name(pipe)),
                        getattr(pipe, "tokenizer", None))

    if not req.stream:
        for r in _responses(pipe, prompt, params, req.suffix):
            out.feed(r)
        if stats is not None:
            stats.last = out.lasts[0]
        return out.whole()

    def chunks():
        responses = _responses(pipe, prompt, params, req.suffix)
        try:
            first = next(responses, None)   # prefill first: a too-long prompt fails before any chunk
            yield from out.start()
            if first is not None:
                yield from out.feed(first)
                for r in responses:
                    yield from out.feed(r)
        finally:
            responses.close()
        if stats is not None:
            stats.last = out.lasts[0]
        yield from out.finish()

    return chunks()


# ============================================================================ completions
def _request(kind: str, body: dict, params, kwargs: dict) -> oai.Request:
    """Keyword arguments (OpenAI's field names) -> a parsed request; `params` (a SamplingParams)
    gives the generation options instead of keyword arguments."""
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise RequestError(None, f"params must be a SamplingParams, got {type(params).__name__}")
        mixed = sorted(set(kwargs) & SamplingParams.openai_fields(kind))
        if mixed:
            raise RequestError(mixed[0], f"{mixed[0]}: give the generation options either as params or as "
                                         "keyword arguments, not both")
    req = oai.parse(kind, {**body, **kwargs})
    if params is not None:
        req.params = params
        if req.echo and params.logprobs:
            raise RequestError("logprobs", "logprobs with echo (the prompt's logprobs) is not supported")
    return req


def create_completion(pipe, prompt, params: SamplingParams | None = None, *, stream: bool = False,
                      model: str | None = None, stats: Stats | None = None, **kwargs):
    """A "text_completion" dict, or with stream=True an iterator of chunk dicts of the same shape.

    Keyword arguments are OpenAI's (and llama-cpp-python's) fields of a completion: max_tokens
    (default 16; None or <= 0: until the context is full), temperature, top_p, top_k, min_p,
    repeat_penalty, frequency_penalty, presence_penalty, stop, seed, n, logprobs, logit_bias,
    echo, best_of, suffix, stream_options, cache_salt, cache_prompt: each option is defined once in
    mixqrt.generation.params (its bounds and the model-default rule), the rest in mixqrt.serving.protocol. params: a
    SamplingParams instead of the option keywords.

    n (<= 8) choices share one prefill; logprobs=k (<= 20) adds OpenAI's legacy logprobs object
    (tokens, token_logprobs, top_logprobs, text_offset) from the model's raw distribution.
    Arguments are checked here (mixqrt.serving.protocol.parse), before anything runs; errors from the model
    (prompt longer than the context) come from the first next() of the stream. Closing the
    iterator stops generation.
    """
    if "max_tokens" in kwargs and kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = 0            # llama-cpp-python: max_tokens=None is "until the context is full"
    return _run(pipe, _request("completion", {"prompt": prompt, "stream": stream}, params, kwargs), model, stats)


# ============================================================================ embeddings
def create_embedding(pipe, input, *, model: str | None = None, encoding_format: str = "float",
                     dimensions: int | None = None, user: str | None = None) -> dict:
    """OpenAI's embeddings object (llama-cpp-python's create_embedding shape) for a string, a list of
    strings or token ids: data[i].embedding, usage.prompt_tokens. Pooling and normalization are the
    model's (mixqrt.generation.embed); dimensions truncates where the model allows."""
    req = oai.parse_embeddings({"input": input, "model": model, "encoding_format": encoding_format,
                                "dimensions": dimensions, "user": user})
    if pipe.embedder().pooling == "none":
        raise RequestError(None, "this model's pooling is 'none' (one vector per token), which is not OpenAI's "
                                 "embeddings shape: use Pipeline.embed")
    seqs = pipe.embed_ids(req.input)
    vecs = pipe.embed(seqs, dimensions=req.dimensions)
    return oai.embeddings_reply(vecs, model if model is not None else model_name(pipe), sum(map(len, seqs)),
                                req.encoding_format)


# ============================================================================ chat
def create_chat_completion(pipe, messages, params: SamplingParams | None = None, *, stream: bool = False,
                           model: str | None = None, stats: Stats | None = None, **kwargs):
    """A "chat.completion" dict, or with stream=True an iterator of "chat.completion.chunk" dicts:
    delta {"role": "assistant"}, then {"content": piece}..., then {} with finish_reason.

    Keyword arguments are OpenAI's fields of a chat completion (max_tokens, default: until the
    context is full; temperature, top_p, stop, seed, n, logprobs, top_logprobs, logit_bias,
    response_format, tools, tool_choice, parallel_tool_calls, stream_options, ...; llama.cpp's
    top_k, min_p, repeat_penalty, cache_prompt): each option is defined once in mixqrt.generation.params.
    params: a SamplingParams instead of the option keywords.

    The prompt is the model's own chat template with the generation prompt appended.
    logprobs=True (top_logprobs <= 20) adds choices[].logprobs.content[] ({token, logprob, bytes,
    top_logprobs}) from the model's raw distribution; n (<= 8) choices share one prefill.
    stream_options={"include_usage": True} adds OpenAI's last chunk (empty choices, usage).
    response_format (json_object, json_schema, and mixqrt's regex / grammar: mixqrt.generation.grammar)
    constrains the reply; tools / tool_choice / parallel_tool_calls as OpenAI defines them
    (mixqrt.generation.tool_calls): the template renders the tools, the reply's calls come back as
    message.tool_calls with finish_reason "tool_calls" (streamed as tool_calls deltas).
    """
    return _run(pipe, _request("chat", {"messages": messages, "stream": stream}, params, kwargs), model, stats)

"""Generation, layered like mlx-lm: generate_step (token generator) -> stream_generate (responses with
text and statistics) -> generate (a string)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from mixqrt.errors import GenerationError
from mixqrt.platform.perf import peak_rss_bytes
from mixqrt.generation.params import UNTIL_FULL, SamplingParams, as_params
from mixqrt.generation.sampling import make_sampler, token_logprobs
from mixqrt.generation.validate import integer

# transformers' GenerationConfig defaults, used when neither the call nor the model says otherwise
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


# ============================================================================ token level
def _make_cache(model, n: int, kv_type):
    """model.make_cache(n) of kv_type (a stand-in model without kv types takes just n)."""
    return model.make_cache(n) if kv_type is None else model.make_cache(n, kv_type)


def generate_step(model, prompt_ids, *, sampler: Callable | None = None, logits_processors: list | None = None,
                  max_tokens: int = 256, cache=None, prefill_chunk: int = 512,
                  kv_type: str | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token, logits) for up to max_tokens new tokens after prompt_ids.

    logits [vocab] are those the token was sampled from (after the processors). The prompt is fed
    at cache.offset (0 for a fresh cache) in prefill_chunk pieces. The caller stops early by
    closing the generator (e.g. leaving a for loop). kv_type: the type of the cache made when none
    is given (mixqrt.models.kv_cache.KV_TYPES; default the model's).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise GenerationError("the prompt is empty: at least one token is needed")
    max_tokens = integer("max_tokens", max_tokens, lo=0)
    sampler = sampler or make_sampler(0.0)
    procs = list(logits_processors or ())
    if cache is None:
        cache = _make_cache(model, prompt.size + max(max_tokens, 1), kv_type)
    # every token seen so far, for the logits processors (a view of one preallocated buffer)
    history = np.empty(prompt.size + max_tokens, dtype=np.int64)
    history[:prompt.size] = prompt
    n = prompt.size
    if max_tokens == 0:
        return
    logits = model(prompt, cache, last_only=True, chunk_size=prefill_chunk)
    step = np.empty(1, dtype=np.int64)                     # the one-token input, reused every step
    for i in range(max_tokens):
        for p in procs:
            logits = p(history[:n], logits)
        tok = int(sampler(logits))
        history[n] = tok
        n += 1
        yield tok, logits
        if i + 1 == max_tokens:
            return
        step[0] = tok
        logits = model(step, cache, last_only=True)


# ============================================================================ text level
@dataclass
class GenerationResponse:
    text: str                      # the new piece of text (may be empty)
    token: int | None              # the token this response is for
    finish_reason: str | None      # None while running, then "stop" | "length" | "cancelled"
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float              # prompt tokens / prefill seconds
    generation_tps: float          # decode tokens / decode seconds (after the first token)
    ttft_s: float                  # seconds from the call to the first new token
    peak_rss_bytes: int
    cached_tokens: int = 0         # prompt tokens whose KV came from the prompt cache (not recomputed)
    draft_tokens: int = 0          # speculative decoding: tokens drafted for this request so far
    accepted_draft_tokens: int = 0  # ... and accepted by the target (mixqrt.generation.speculative)
    logprobs: "TokenLogprob | None" = None   # with logprobs=True: the token's log-probability
    index: int = 0                 # which of a request's n choices this piece belongs to


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model's own distribution (a log-softmax of the
    raw logits: before penalties, logit_bias, temperature and top-k/p/min-p, as OpenAI reports),
    and the `top_logprobs` most likely (token id, logprob) pairs."""
    token: int
    logprob: float
    top: list


class _OffsetDecoder:
    """UTF-8-safe incremental detokenizer for any tokenizer with decode(ids) (HF TextStreamer's method:
    decode a short window, emit what grew, hold back text ending in an incomplete character)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


def _stream_decoder(tokenizer):
    """The tokenizer's own StreamDecoder (mixqrt.generation.tokenizer: feed/flush) when it has one."""
    make = getattr(tokenizer, "stream_decoder", None)
    if make is not None:
        dec = make()
        return _Adapted(dec.feed, dec.flush)
    return _OffsetDecoder(tokenizer)


class _Adapted:
    def __init__(self, add, flush):
        self.add, self._flush = add, flush

    def flush(self) -> str:
        return self._flush() or ""


class _StopMatcher:
    """Holds back text that could still become a stop string, so a stop string never leaks."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """-> (text safe to emit, stopped)."""
        if not self.stops:
            return piece, False
        self.pending += piece
        hit = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self.pending = self.pending[:hit], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def eos_ids(explicit, model, tokenizer) -> set[int]:
    """The tokens that end a reply: `explicit` (a list of ids) when given, else the model's
    generation_config eos_token_id and the tokenizer's eos tokens."""
    def as_set(v):
        if v is None:
            return set()
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return {int(v)}
        if isinstance(v, (list, tuple, set, frozenset, np.ndarray)) and all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
            return {int(x) for x in v}
        raise GenerationError(f"eos_token_ids must be an int or a list of ints, got {v!r}")
    if explicit is not None:
        return as_set(explicit)
    gen = getattr(model, "generation_config", None) or {}
    return as_set(gen.get("eos_token_id")) | as_set(getattr(tokenizer, "eos_token_ids", None))


def resolve_sampling(model, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                     do_sample=None) -> dict:
    """Fill None arguments from the model's generation_config like transformers.

    The one place the greedy default is decided: greedy when do_sample is False, or when it is None and
    neither the caller (temperature) nor generation_config.json (do_sample) asks for sampling.
    do_sample=True with no (or a zero) temperature samples at the config's temperature (else 1.0)."""
    gen = getattr(model, "generation_config", None) or {}
    if do_sample not in (None, True, False):
        raise GenerationError(f"do_sample must be True, False or None, got {do_sample!r}")
    out = {}
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                    ("repetition_penalty", repetition_penalty)):
        out[name] = v if v is not None else (gen.get(name) if gen.get(name) is not None else _HF_DEFAULTS[name])
    if do_sample is False or (do_sample is None and temperature is None and not gen.get("do_sample", False)):
        out["temperature"] = 0.0
    elif do_sample is True and not temperature:
        out["temperature"] = float(gen.get("temperature") or 1.0)
    return out


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt string (encoded, BOS added when the tokenizer asks for it; no template) or token ids
    -> a list of ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("a text prompt needs a tokenizer; pass token ids instead")
        from mixqrt.generation.tokenizer import with_bos
        return with_bos(tokenizer, tokenizer.encode(prompt))
    if isinstance(prompt, (list, tuple, np.ndarray)):
        ids = list(np.asarray(prompt).reshape(-1)) if isinstance(prompt, np.ndarray) else list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise GenerationError("a prompt given as a list must hold token ids (ints)")
        return [int(t) for t in ids]
    raise GenerationError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


class Sequence:
    """One request's token-level logic, the only copy of it: the Engine (batched) and
    stream_generate (single sequence) both drive one of these per request.

    ``sample(logits)`` applies the logits processors and the sampler and records the token;
    ``accept(token)`` turns it into text and says whether the request finished (eos, a stop string,
    the token budget). Stop strings and eos tokens never reach the text.
    """

    def __init__(self, model, tokenizer, prompt_ids, params: SamplingParams | None = None, *,
                 max_context: int | None = None, **kwargs):
        """params: the request's options (mixqrt.generation.params); keyword arguments build or change them."""
        p = as_params(params, **kwargs)
        ids = encode_prompt(tokenizer, prompt_ids)
        if not ids:
            raise GenerationError("the prompt is empty: at least one token is needed")
        vocab = model.args.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise GenerationError(f"prompt token ids must be in [0, {vocab}), got [{min(ids)}, {max(ids)}]")
        ctx = model.args.max_position_embeddings if max_context is None else integer("max_context", max_context, lo=1)
        if len(ids) + 1 > ctx:
            raise GenerationError(f"the prompt has {len(ids)} tokens; with at least one new token that needs "
                                  f"{len(ids) + 1} positions but the context holds {ctx}")
        self.params = p
        self.prompt = ids
        room = ctx - len(ids)                 # reaching the context end finishes with "length"
        self.budget = room if p.max_new_tokens == UNTIL_FULL else min(p.max_new_tokens, room)
        eff = p.replace(**resolve_sampling(model, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                                           p.do_sample))
        self.sampler = make_sampler(eff.temperature, eff.top_k, eff.top_p, eff.min_p, eff.seed)
        self.procs = eff.logits_processors(len(ids), vocab)
        self.logprobs = p.logprobs
        self.top_logprobs = p.top_logprobs
        self.last_logprob: TokenLogprob | None = None
        stops = p.stop or []
        if stops and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer")
        self.stops = _StopMatcher(stops)
        self.eos = eos_ids(p.eos_token_ids, model, tokenizer)
        self.decoder = _stream_decoder(tokenizer) if tokenizer is not None else None
        # every token so far (prompt, then generated): the processors' context and the KV's contents
        self.history = np.empty(len(ids) + self.budget, dtype=np.int64)
        self.history[:len(ids)] = ids
        self.n = len(ids)
        self.n_gen = 0
        self.finish_reason: str | None = None
        # a mixqrt.generation.grammar.Constraint (set by the Engine once the request's grammar is compiled):
        # forbidden tokens are masked before the processors; eos only where the grammar accepts
        self.constraint = None

    def sample(self, logits: np.ndarray) -> int:
        """logits [vocab] (may be edited in place) -> the next token, recorded in history (and with
        logprobs on, its log-probability under the raw logits in ``last_logprob``: before the
        grammar's mask and the processors)."""
        c = self.constraint
        raw = logits.copy() if self.logprobs and (self.procs or c is not None) else logits
        if c is not None:
            logits = c.apply(logits)
        for p in self.procs:
            logits = p(self.history[:self.n], logits)
        tok = int(self.sampler(logits))
        if c is not None and tok not in self.eos and not c.consume(tok):
            raise GenerationError(f"the sampled token {tok} does not fit the grammar: {c.error()[:200]}")
        if self.logprobs:
            lp, top = token_logprobs(raw, tok, self.top_logprobs)
            self.last_logprob = TokenLogprob(tok, lp, top)
        self.history[self.n] = tok
        self.n += 1
        return tok

    def _piece(self, tok: int) -> str:
        return self.decoder.add(tok) if self.decoder is not None else ""

    def _flush(self) -> str:
        return self.decoder.flush() if self.decoder is not None else ""

    def accept(self, tok: int) -> tuple[str, str | None]:
        """-> (new text, finish_reason or None) for the token just sampled."""
        self.n_gen += 1
        if tok in self.eos:
            self.finish_reason = "stop"
            return self.stops.feed(self._flush())[0] + self.stops.flush(), "stop"
        text, stopped = self.stops.feed(self._piece(tok))
        if stopped:
            self.finish_reason = "stop"
            return text, "stop"
        if self.constraint is not None and self.constraint.is_stopped():    # the grammar's end
            text2, _ = self.stops.feed(self._flush())
            self.finish_reason = "stop"
            return text + text2 + self.stops.flush(), "stop"
        if self.n_gen >= self.budget:
            text2, stopped = self.stops.feed(self._flush())
            text += text2
            self.finish_reason = "stop" if stopped else "length"
            return (text if stopped else text + self.stops.flush()), self.finish_reason
        return text, None


def stream_generate(model, tokenizer, prompt, params: SamplingParams | None = None, *,
                    max_context: int | None = None, prefill_chunk: int = 512, kv_type: str | None = None,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per new token; the last one has finish_reason "stop" or "length".

    The low-level single-sequence path (no engine thread, no batching); Pipeline and the API go
    through mixqrt.generation.engine.Engine, which drives the same Sequence logic.
    prompt: a string (encoded with tokenizer.encode, no template applied here) or a list of token ids.
    params: the request's options (mixqrt.generation.params.SamplingParams); keyword arguments build or change
    them (max_new_tokens, temperature, stop, ...). Stop strings and eos tokens end generation and
    are not part of the text. kv_type: the KV cache's type (mixqrt.models.kv_cache.KV_TYPES; default the
    model's).
    """
    t0 = time.perf_counter()
    seq = Sequence(model, tokenizer, prompt, params, max_context=max_context, **kwargs)
    n_prompt = len(seq.prompt)
    cache = _make_cache(model, n_prompt + seq.budget, kv_type)
    t_first, ttft, prompt_tps = 0.0, 0.0, 0.0

    def response(text, token, reason):
        now = time.perf_counter()
        n_gen = seq.n_gen
        gen_tps = (n_gen - 1) / (now - t_first) if n_gen > 1 and now > t_first else 0.0
        return GenerationResponse(text, token, reason, n_prompt, n_gen, prompt_tps, gen_tps, ttft,
                                  peak_rss_bytes())

    logits = model(np.asarray(seq.prompt, dtype=np.int64), cache, last_only=True, chunk_size=prefill_chunk)
    step = np.empty(1, dtype=np.int64)                     # the one-token input, reused every step
    while True:
        tok = seq.sample(logits)
        if seq.n_gen == 0:
            t_first = time.perf_counter()
            ttft = t_first - t0
            prompt_tps = n_prompt / ttft if ttft > 0 else 0.0
        text, reason = seq.accept(tok)
        yield response(text, tok, reason)
        if reason is not None:
            return
        step[0] = tok
        logits = model(step, cache, last_only=True)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole new text (stop strings and eos excluded). kwargs: those of stream_generate."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))

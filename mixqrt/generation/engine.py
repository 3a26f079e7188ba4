"""Continuous batching: many requests share one model, one background thread, one batched forward.

    eng = Engine(pipe, max_slots=8)                 # a Pipeline, a LoadedModel or a bare Model
    req = eng.submit(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1, stop=["\\n\\n"])
    req = eng.submit(prompt_ids, SamplingParams(max_new_tokens=64))   # or the options as one object
    for r in req:                                   # or: async for r in req
        print(r.text, end="")
    eng.stats(); eng.close()

Requests wait in a bounded queue (EngineBusy past max_queue) and enter up to max_slots slots.
Each scheduler step runs, on the engine thread:
  - one prompt chunk (at most prefill_chunk tokens) of the oldest slot still prefilling, so a long
    prompt is spread over steps and running streams keep getting tokens between its chunks;
  - one decode token for every decoding slot whose consumer keeps up;
  both in ONE batched forward (Model.decode_batch with prefill=): the weight matmuls run on
  [B + chunk, D] (one sweep of the packed weights serves every slot and the chunk), each slot
  attends over its own KV cache.
Every slot has its own Sequence (mixqrt.generation.generate: sampler with its own seeded RNG, logits
processors, stop strings, eos, detokenizer), so a seeded request samples the same tokens whatever
its batch neighbours are (up to float rounding: batched and single matmuls differ in the last bits).

Consumers never hold the engine: each request has a bounded output buffer; a slot whose buffer
is full is skipped (paused) and is cancelled after stall_timeout seconds without room. cancel()
(or leaving the loop of Pipeline.stream) frees the slot at the next step. Finished slots leave
their KV behind as a prompt cache (mixqrt.generation.prompt_cache).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque

import numpy as np

from mixqrt import ops
from mixqrt.generation.prompt_cache import PromptCache
from mixqrt.errors import GenerationError, RequestError
from mixqrt.generation.generate import GenerationResponse, Sequence
from mixqrt.generation.grammar import compile_async, grammar_from_response_format
from mixqrt.models.config_limits import context_window
from mixqrt.platform.perf import peak_rss_bytes
from mixqrt.generation.params import MAX_N, SamplingParams, as_params
from mixqrt.generation.speculative import MAX_DRAFT, CopyDrafter, Speculation, exact_rows, prediction_ids
from mixqrt.generation.validate import integer, number

__all__ = ["Engine", "EngineBusy", "Request"]

MIN_KV_CACHE_BYTES = 256 << 20         # the default bound's floor (and its value where free memory is unknown: 1 GiB)


def default_kv_cache_bytes() -> int:
    """The default bound of the KV memory: a quarter of the memory available now (MemAvailable),
    at least 256 MiB; 1 GiB where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return max(MIN_KV_CACHE_BYTES, int(line.split()[1]) * 1024 // 4)
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


MAX_CACHE_SALT = 1024                   # characters (the server's own field allows 256, plus its key's salt)
_ids = itertools.count(1)


class EngineBusy(GenerationError):
    """The admission queue is full (max_queue requests waiting): retry later (HTTP 503)."""


# ============================================================================ request (consumer side)
class _VerifyRows:
    """The logits of a verify forward's rows, by pieces: the body runs on every row at once, the
    lm_head on PIECE rows at a time as the acceptance walk reaches them (a walk that stops at draft
    3 of 40 never pays the other rows' logits). Each row is the single step's logits bit for bit
    (speculative.exact_rows bounds the rows)."""

    PIECE = 8

    def __init__(self, model, toks: list[int], kv):
        ids = model.check_tokens(np.asarray(toks, dtype=np.int64))
        kv.check_room(kv.offset, ids.size)
        self.model = model
        self.h = model.forward_hidden(ids, kv, kv.offset)             # [k+1, D]
        self.lo = self.hi = 0
        self.logits = None

    def __getitem__(self, i: int) -> np.ndarray:
        if not self.lo <= i < self.hi:
            self.lo, self.hi = i, min(len(self.h), i + self.PIECE)
            self.logits = self.model.head(self.h[self.lo:self.hi])
        return self.logits[i - self.lo]


class Request:
    """A submitted request: iterate it (blocking or ``async for``) for GenerationResponse pieces.

    The last piece has finish_reason "stop", "length" or "cancelled"; an error in the engine is
    raised from the iteration. ``cancel()`` (also on ``with`` exit) frees the slot.
    """

    def __init__(self, engine: "Engine", seqs: list[Sequence], buffer: int):
        self.id = next(_ids)
        self.seqs = seqs                # one per choice (n > 1: they share the prompt's prefill)
        self.seq = seqs[0]
        self.n = len(seqs)
        self.buffer = buffer * self.n
        seq = self.seq
        self.t_submit = time.perf_counter()
        self.prompt_tokens = len(seq.prompt)
        self.cached_tokens = 0
        self.cache_salt, self.cache_prompt = None, True
        self.draft_k: int | None = None     # drafts per speculative step (None: the drafter's k)
        self.prediction = None              # token ids the drafter copies from first (None: the prompt)
        self.draft_tokens = 0               # drafted for this request / accepted by the target
        self.accepted_draft_tokens = 0
        self.finish_reason: str | None = None
        self._engine = engine
        self._cond = threading.Condition()
        self._out: deque = deque()      # GenerationResponse pieces, then possibly one exception
        self._closed = False            # nothing more will be pushed
        self._open = self.n             # choices not finished yet
        self._waiters: list = []        # (loop, future) of async consumers
        self.cancelled = False          # asked by the consumer
        self.paused = False             # the engine skipped this slot: its buffer was full

    # ------------------------------------------------------------------ engine side
    def _push(self, item, final: bool = False) -> None:
        """`final`: the last piece of one choice (an exception ends them all)."""
        with self._cond:
            self._out.append(item)
            if final:
                self._open = 0 if isinstance(item, BaseException) else self._open - 1
            self._closed = self._closed or self._open <= 0
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake_future, fut)
            except RuntimeError:        # that event loop is closed
                pass

    def _full(self) -> bool:
        return len(self._out) >= self.buffer

    # ------------------------------------------------------------------ consumer side
    def _took(self, item):
        if self.paused:
            self.paused = False
            self._engine._wake()
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self):
        return self

    def __next__(self) -> GenerationResponse:
        with self._cond:
            while not self._out:
                if self._closed:
                    raise StopIteration
                self._cond.wait()
            item = self._out.popleft()
        return self._took(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerationResponse:
        while True:
            with self._cond:
                if self._out:
                    item = self._out.popleft()
                    break
                if self._closed:
                    raise StopAsyncIteration
                loop = asyncio.get_running_loop()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut
        return self._took(item)

    def cancel(self) -> None:
        """Stop generating: the slot is freed at the next engine step; the stream then ends with a
        "cancelled" piece (unless it already finished). Idempotent."""
        if not self.cancelled and not self._closed:
            self.cancelled = True
            self._engine._wake()

    close = cancel

    @property
    def done(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt_tokens={self.prompt_tokens}, finish_reason={self.finish_reason!r})"


def _wake_future(fut) -> None:
    if not fut.done():
        fut.set_result(None)


# ============================================================================ engine side
class _Slot:
    __slots__ = ("req", "seq", "entry", "pos", "tok", "t_first", "full_since", "index", "leader", "spec")

    def __init__(self, req: Request, entry, pos: int, index: int = 0, leader: "_Slot | None" = None):
        self.req, self.seq, self.entry = req, req.seqs[index], entry
        self.pos = pos              # prompt tokens whose K/V are in the cache (prefill progress)
        self.tok = None             # the next token to feed; None while prefilling
        self.t_first = 0.0
        self.full_since = None      # when the consumer's buffer was first seen full
        self.spec = None            # speculative decoding state (mixqrt.generation.speculative.Speculation)
        self.index = index          # the choice (0 .. n-1)
        self.leader = leader        # choices 1..n-1: the slot whose prefill they fork (None once forked)


def _choice_seed(seed: int, i: int) -> int:
    """Choice i's seed for a request seeded with `seed` (choice 0 keeps `seed`, as with n=1)."""
    return int(np.random.SeedSequence([int(seed), int(i)]).generate_state(2, np.uint64)[0])


def _unpack(obj):
    """Pipeline / LoadedModel (.model, .tokenizer) or a bare Model -> (model, tokenizer, max_context)."""
    if hasattr(obj, "model") and hasattr(obj, "tokenizer"):
        return obj.model, obj.tokenizer, getattr(obj, "max_context", None)
    if hasattr(obj, "make_cache") and hasattr(obj, "args"):
        return obj, None, None
    raise GenerationError(f"Engine needs a Pipeline, a LoadedModel or a Model, got {type(obj).__name__}")


class Engine:
    """Continuous-batching generation over one model (see the module docstring).

    max_slots: requests decoded together; prefill_chunk: prompt tokens per step; kv_cache_bytes:
    bound of the KV memory, cached prompts and running requests' written pages (default: a quarter
    of the memory available at start, default_kv_cache_bytes; cached prompts are evicted to keep it,
    a request waits for room before it starts, a prompt that cannot fit alone is refused with a
    RequestError naming the sizes, and a decoding request that would cross it ends with "length";
    0 turns the prompt cache off and the bound with it); kv_type: the KV cache's type
    (mixqrt.models.kv_cache.KV_TYPES; default the Pipeline's, else DEFAULT_KV_TYPE where the heads allow it);
    max_queue: requests waiting for a slot before submit raises EngineBusy; stall_timeout: seconds
    a slot may wait on a consumer that does not read before it is cancelled; threads: kernel
    threads (the process-wide pool; default: leave it); gemm_cache_bytes: memory for unpacked
    weight tiles that batched steps read instead of unpacking (ops.set_gemm_cache, process-wide;
    default: leave it; docs/engine.md). tokenizer / max_context default to those of the Pipeline
    or LoadedModel given (a bare Model: no text, the model's whole context). speculative: a
    drafter (mixqrt.generation.speculative.make_drafter: prompt lookup or a draft model) that a lone decoding
    sequence uses to emit several tokens per forward (docs/speculative.md); None: off.
    """

    def __init__(self, model_or_pipeline, *, max_slots: int = 8, prefill_chunk: int = 256,
                 kv_cache_bytes: int | None = None, max_queue: int = 64, stall_timeout: float = 30.0,
                 threads: int | None = None, tokenizer=None, max_context: int | None = None,
                 gemm_cache_bytes: int | None = None, speculative=None, kv_type: str | None = None):
        model, tok, ctx = _unpack(model_or_pipeline)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else tok
        self.max_slots = integer("max_slots", max_slots, lo=1)
        self.prefill_chunk = integer("prefill_chunk", prefill_chunk, lo=1)
        self.max_queue = integer("max_queue", max_queue, lo=0)
        self.stall_timeout = number("stall_timeout", stall_timeout, lo=0.0, lo_open=True)
        cap = default_kv_cache_bytes() if kv_cache_bytes is None else integer("kv_cache_bytes", kv_cache_bytes, lo=0)
        if max_context is not None:
            ctx = integer("max_context", max_context, lo=2)
        self.max_context = context_window(model.args.max_position_embeddings, ctx)
        if kv_type is None:                     # a Pipeline's type, else the default type for these heads
            from mixqrt.models.kv_cache import check_kv_type
            kv_type = check_kv_type(getattr(model_or_pipeline, "kv_type", None), model.args.head_dim)
        if threads is not None:
            ops.set_num_threads(integer("threads", threads, lo=1))
        if gemm_cache_bytes is not None:
            ops.set_gemm_cache(integer("gemm_cache_bytes", gemm_cache_bytes, lo=0))
        self._cache = PromptCache(model, self.max_context, cap, kv_type)
        self.kv_type = self._cache.kv_type
        if speculative is not None and not hasattr(speculative, "propose"):
            raise GenerationError(f"speculative must be a drafter (mixqrt.generation.speculative.make_drafter), "
                                  f"got {type(speculative).__name__}")
        self.drafter = speculative
        self._copy_drafter = None       # for requests with a prediction when there is no drafter
        self._verify_rows = None        # the most rows one verify may carry and stay exact (exact_rows)
        self._cond = threading.Condition()
        self._queue: deque[Request] = deque()
        self._slots: list[_Slot] = []
        self._compiling = 0             # requests whose grammar is being compiled (count as queued)
        self._jobs: deque = deque()     # embedding packs (mixqrt.generation.embed), run between steps
        self._job_turn = False          # a job ran last: the next round is a step (jobs and steps alternate)
        self._masker = None             # the thread that computes grammar masks during the forward
        self._closing = False
        self._error: BaseException | None = None
        self._n = dict(steps=0, tokens_generated=0, prompt_tokens=0, prefill_tokens=0, requests=0,
                       finished=0, cancelled=0, stalled=0, failed=0, decode_tokens=0,
                       max_batch=0, draft_tokens=0, accepted_draft_tokens=0, verify_steps=0,
                       grammar_masks=0, grammar_mask_seconds=0.0, embed_requests=0, embed_tokens=0)
        self._thread = threading.Thread(target=self._loop, name="mixqrt-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    def submit(self, prompt_ids, params: SamplingParams | None = None, *, buffer: int = 64, **kwargs) -> Request:
        """Queue a request (token ids, or a string encoded without a template) -> Request.

        params: the request's options (mixqrt.generation.params.SamplingParams: max_new_tokens, sampling,
        stop, n, logprobs, penalties, logit_bias, response_format, tools, draft_k, cache_salt,
        ...); keyword arguments build one or change the given one. buffer: pieces the consumer may
        leave unread before the slot pauses. Bad arguments raise GenerationError (RequestError
        naming the field) here; EngineBusy when max_queue requests already wait. Sampling
        arguments left at None come from the model's generation_config (generate.resolve_sampling:
        greedy unless do_sample or the config asks for sampling). Each request samples with its
        own RNG (seeded by `seed`), so a seeded request gives the same tokens whatever it is
        batched with.

        n > 1: n choices of one prompt, prefilled once (the other choices copy its KV rows, a
        prefix-cache fork) and decoded in the same batch; the pieces carry ``index`` 0..n-1 and
        choice i > 0 is seeded from (seed, i). logprobs/top_logprobs: each piece carries the
        token's log-probability under the model's raw logits (GenerationResponse.logprobs).
        presence_penalty/frequency_penalty/logit_bias: OpenAI's (sample_utils). n is also bounded by
        max_slots.
        draft_k: drafts per speculative step for this request (None: the drafter's own k; 0: no
        speculation; larger values are capped at speculative.MAX_DRAFT).
        prediction: the text the reply is expected to repeat (token ids, or a string encoded without
        a template; OpenAI's `prediction`, e.g. the file being edited): the copy drafter
        (speculative.CopyDrafter) drafts from it before the prompt, also on an engine without a
        drafter or with a draft model. The output stays the model's own.
        cache_salt: the prompt cache only shares K/V between requests with the same salt (None is
        a salt too: requests without one share theirs); cache_prompt=False neither reuses cached
        K/V nor leaves this request's behind.

        response_format (mixqrt.generation.grammar: json_object, json_schema, regex, grammar) or tool_choice
        "required" / a named function (with tools: mixqrt.generation.tool_calls) constrain the tokens by a grammar.
        The grammar compiles on mixqrt.generation.grammar's own threads, never on the engine's: the request
        waits for a slot only once it is compiled, and a grammar that cannot be compiled (or not
        within mixqrt.generation.grammar.COMPILE_TIMEOUT_S) ends the request with a RequestError, raised
        from its iteration. The shape of response_format is checked here.
        """
        p = as_params(params, **kwargs)
        buffer = integer("buffer", buffer, lo=1)
        draft_k = None if p.draft_k is None else min(p.draft_k, MAX_DRAFT)
        prediction = prediction_ids(p.prediction, self.tokenizer, self.model.args.vocab_size)
        if p.n > self.max_slots:
            raise RequestError("n", f"n must be an integer in [1, {min(MAX_N, self.max_slots)}] (at most {MAX_N} "
                                    f"and the engine's max_slots), got {p.n!r}")
        seqs = [Sequence(self.model, self.tokenizer, prompt_ids,
                         p if i == 0 or p.seed is None else p.replace(seed=_choice_seed(p.seed, i)),
                         max_context=self.max_context)
                for i in range(p.n)]
        self._fit_kv(seqs)
        grammar, field = self._grammar(p.response_format, p.tools, p.tool_choice, p.parallel_tool_calls)
        with self._cond:
            if self._error is not None:
                raise GenerationError(f"the engine stopped after an internal error: {self._error!r}")
            if self._closing:
                raise GenerationError("the engine is closed")
            if len(self._queue) + self._compiling >= self.max_queue:
                raise EngineBusy(f"the engine is busy: {len(self._queue) + self._compiling} requests are waiting "
                                 f"(max_queue={self.max_queue}); retry later")
            req = Request(self, seqs, buffer)
            req.cache_salt, req.cache_prompt = p.cache_salt, p.cache_prompt
            req.draft_k, req.prediction = draft_k, prediction
            self._n["requests"] += 1
            if grammar is None:
                self._queue.append(req)
                self._cond.notify_all()
                return req
            self._compiling += 1
        try:
            compile_async(self.tokenizer, grammar, n_vocab=self.model.args.vocab_size, eos_ids=seqs[0].eos,
                          field=field, on_done=lambda result: self._compiled(req, result))
        except BaseException:
            with self._cond:
                self._compiling -= 1
                self._n["requests"] -= 1
            raise
        return req

    def _fit_kv(self, seqs: list[Sequence]) -> None:
        """The KV bound must hold the prompt (and one new token) of each of a request's choices
        alone, else RequestError naming the sizes; the token budget is cut to what fits."""
        c = self._cache
        rows = c.max_rows(len(seqs))
        if rows >= self.max_context:
            return
        p = len(seqs[0].prompt)
        if p + 1 > rows:
            need = len(seqs) * c.bytes_for(p + 1)
            raise RequestError("prompt", f"the prompt has {p} tokens; with one new token its KV cache needs "
                                         f"{need:,d} bytes ({len(seqs)} x {p + 1} tokens of {self.kv_type} K/V, "
                                         f"{c.row_bytes:,d} bytes per token) but the KV cache bound "
                                         f"(kv_cache_bytes) is {c.capacity:,d} bytes: it holds {rows} tokens")
        for sq in seqs:
            sq.budget = min(sq.budget, rows - p)

    def embed(self, seqs, embedder) -> "Future":
        """Queue embeddings of token-id sequences -> a concurrent.futures.Future of embedder.embed's
        result (``asyncio.wrap_future`` for async callers). The forwards run on the engine thread, one
        pack of embedder.batch_tokens tokens per scheduling round, alternating with decode steps, so
        running streams keep getting tokens; no K/V is kept. EngineBusy past max_queue."""
        from concurrent.futures import Future, InvalidStateError
        seqs = [self.model.check_tokens(s) for s in seqs]
        too_long = [i for i, s in enumerate(seqs) if s.size > self.max_context]
        if too_long:
            raise RequestError("input", f"input {too_long[0]} has {seqs[too_long[0]].size} tokens; the context "
                                        f"holds {self.max_context}")
        fut: Future = Future()
        packs = list(embedder._packs(seqs)) if seqs else []
        state = {"left": len(packs), "out": [None] * len(seqs)}

        def run(pack):
            if fut.done():                  # cancelled by the caller, or an earlier pack failed
                return
            try:
                for i, h in zip(pack, embedder.hidden([seqs[i] for i in pack], embedder.rows())):
                    state["out"][i] = h
                state["left"] -= 1
                result, error = (embedder.pool(state["out"]), None) if state["left"] == 0 else (None, None)
            except Exception as e:  # noqa: BLE001 — handed to the caller
                result, error = None, e
            try:
                if error is not None:
                    fut.set_exception(error)
                elif result is not None:
                    fut.set_result(result)
            except InvalidStateError:       # the caller cancelled meanwhile
                pass
        with self._cond:
            if self._error is not None or self._closing:
                raise GenerationError("the engine is closed" if self._closing else
                                      f"the engine stopped after an internal error: {self._error!r}")
            waiting = len(self._queue) + self._compiling + len({id(j[1]) for j in self._jobs})
            if waiting >= self.max_queue:
                raise EngineBusy(f"the engine is busy: {waiting} requests are waiting (max_queue="
                                 f"{self.max_queue}); retry later")
            if not packs:
                fut.set_result(embedder.pool([]))
                return fut
            self._jobs.extend((lambda p=p: run(p), fut) for p in packs)
            self._n["embed_requests"] += 1
            self._n["embed_tokens"] += int(sum(s.size for s in seqs))
            self._cond.notify_all()
        return fut

    def _grammar(self, response_format, tools, tool_choice, parallel):
        """-> (grammar text or None, the request field it comes from). Tool calls forced by
        tool_choice win over response_format."""
        from mixqrt.generation.tool_calls import check_tool_choice, check_tools, tool_grammar
        tools = check_tools(tools)
        choice = check_tool_choice(tool_choice, tools)
        if not isinstance(parallel, bool):
            raise GenerationError(f"parallel_tool_calls must be true or false, got {parallel!r}")
        g = tool_grammar(self.tokenizer, tools, choice, parallel)
        if g is not None:
            field = "tools"
        else:
            g, field = grammar_from_response_format(response_format), "response_format"
        if g is not None and self.tokenizer is None:
            raise GenerationError("structured output needs the model's tokenizer")
        return g, field

    def _compiled(self, req: Request, result) -> None:
        """From a grammar thread: the request's grammar is ready (queue it) or failed (end it)."""
        with self._cond:
            self._compiling -= 1
            if isinstance(result, BaseException) or self._closing or self._error is not None:
                err = result if isinstance(result, BaseException) else GenerationError("the engine is closed")
                self._n["failed"] += 1
                req.finish_reason = "error"
                req._push(err, final=True)
                return
            for i, sq in enumerate(req.seqs):          # n choices: one compile, a matcher each
                sq.constraint = result if i == 0 else result.copy()
            self._queue.append(req)
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            c = self._cache
            return {"running": len(self._slots), "queued": len(self._queue), "slots": self.max_slots,
                    "tokens_generated": self._n["tokens_generated"], "prompt_tokens": self._n["prompt_tokens"],
                    "prefill_tokens": self._n["prefill_tokens"], "cached_tokens": c.cached_tokens,
                    "cache_hits": c.hits, "cache_misses": c.misses, "cache_evictions": c.evictions,
                    "idle_caches": c.tree.leaves, "cache_nodes": len(c.tree), "cache_salts": len(c.tree.roots),
                    "kv_cache_bytes_used": c.used_bytes(), "kv_cache_bytes": c.capacity,
                    "gemm_cache_bytes_used": ops.gemm_cache_info()["used"],
                    "steps": self._n["steps"],
                    "decode_tokens": self._n["decode_tokens"], "max_batch": self._n["max_batch"],
                    "draft_tokens": self._n["draft_tokens"],
                    "accepted_draft_tokens": self._n["accepted_draft_tokens"],
                    "verify_steps": self._n["verify_steps"],
                    "requests": self._n["requests"],
                    "finished": self._n["finished"], "cancelled": self._n["cancelled"],
                    "stalled": self._n["stalled"], "failed": self._n["failed"],
                    "compiling": self._compiling, "grammar_masks": self._n["grammar_masks"],
                    "grammar_mask_seconds": self._n["grammar_mask_seconds"],
                    "embed_requests": self._n["embed_requests"], "embed_tokens": self._n["embed_tokens"],
                    "embed_packs_queued": len(self._jobs),
                    "alive": self._thread.is_alive()}

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or running and stop the engine thread. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._masker is not None:
            self._masker.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Engine(max_slots={self.max_slots}, prefill_chunk={self.prefill_chunk}, context={self.max_context})"

    # ------------------------------------------------------------------ engine thread
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    work = self._schedule()
                if work is None:
                    return
                if callable(work):          # an embedding pack (Engine.embed)
                    work()
                    continue
                self._step(*work)
        except BaseException as e:  # noqa: BLE001 — a bug in the engine itself: fail every request
            with self._cond:
                self._error = e
                doomed = [s.req for s in self._slots] + list(self._queue)
                self._slots.clear()
                self._queue.clear()
            for r in doomed:
                r._push(GenerationError(f"engine failure: {e!r}"), final=True)

    def _schedule(self):
        """Under the lock: reap, admit, pick the step's work; wait while there is none.
        -> (prefill slot or None, decoding slots) or None when closing."""
        while True:
            now = time.perf_counter()
            if self._closing:
                for _, fut in self._jobs:
                    if not fut.done():
                        fut.set_exception(GenerationError("the engine is closed"))
                self._jobs.clear()
                for s in list(self._slots):
                    self._finish(s, "cancelled")
                while self._queue:
                    self._end_queued(self._queue.popleft())
                return None
            self._reap(now)
            while self._queue and (self._queue[0].cancelled or self._admissible(self._queue[0])):
                req = self._queue.popleft()
                if req.cancelled:
                    self._end_queued(req)
                    continue
                entry, n = self._cache.acquire(req.seq.prompt, req.cache_salt, req.cache_prompt)
                req.cached_tokens = n
                self._n["prompt_tokens"] += req.prompt_tokens
                lead = _Slot(req, entry, n)
                self._slots.append(lead)        # first: whatever fails below, the request is a slot to fail
                self._slots += [_Slot(req, None, 0, i, lead) for i in range(1, req.n)]
                drafter = self.drafter
                if req.prediction is not None and not isinstance(drafter, CopyDrafter):
                    drafter = self._copy_drafter = self._copy_drafter or CopyDrafter()   # copies it
                if drafter is not None and req.draft_k != 0 and req.n == 1:
                    try:
                        lead.spec = Speculation(drafter, self.max_context, req.draft_k, source=req.prediction)
                    except Exception:  # noqa: BLE001 — no drafter state (memory): decode plainly
                        lead.spec = None
            prefill = next((s for s in self._slots if s.tok is None and s.leader is None), None)
            decode = [s for s in self._slots if s.tok is not None and not s.req._full()]
            for s in self._slots:
                s.req.paused = s.tok is not None and s.req._full()
            while self._jobs and self._jobs[0][1].done():     # a failed embedding request's other packs
                self._jobs.popleft()
            if self._jobs and not (self._job_turn and (prefill is not None or decode)):
                self._job_turn = True
                return self._jobs.popleft()[0]
            self._job_turn = False
            if decode and not self._cache.room_to_grow([s.entry for s in decode]):
                self._cut_longest(decode)   # the KV bound is reached: the longest decoding slot ends
                continue
            if prefill is not None or decode:
                self._cache.evict()         # running caches grew by the last step: keep the bound
                return prefill, decode
            waits = [s.full_since + self.stall_timeout - now for s in self._slots if s.full_since is not None]
            self._cond.wait(max(0.0, min(waits)) + 1e-3 if waits else None)

    def _admissible(self, req: Request) -> bool:
        """Under the lock: a free slot for each choice, and room under the KV bound for their
        prompts (cached prompts are evicted for it; a request alone always gets in, _fit_kv
        checked that it fits)."""
        if len(self._slots) + req.n > self.max_slots:
            return False
        if not self._slots:
            return True
        self._cache.touch(req.seq.prompt, req.cache_salt, req.cache_prompt)   # its own prefix is evicted last
        return self._cache.room_for(req.prompt_tokens, req.n)

    def _cut_longest(self, decode: list[_Slot]) -> None:
        """Under the lock: end the decoding slot holding the most rows with "length" (its next
        row would cross kv_cache_bytes)."""
        s = max(decode, key=lambda d: d.entry.rows())
        seq = s.seq
        text = seq.stops.feed(seq._flush())[0] + seq.stops.flush()
        seq.finish_reason = "length"
        s.req._push(self._response(s.req, text, None, "length", s.t_first, s.index), final=True)
        self._finish(s, "length")

    def _reap(self, now: float) -> None:
        """Cancelled slots, and slots whose consumer has not made room for stall_timeout seconds."""
        for s in list(self._slots):
            if s.req.cancelled:
                self._finish(s, "cancelled")
            elif s.tok is not None and s.req._full():
                if s.full_since is None:
                    s.full_since = now
                elif now - s.full_since >= self.stall_timeout:
                    self._n["stalled"] += 1
                    self._finish(s, "cancelled")
            else:
                s.full_since = None

    def _end_queued(self, req: Request) -> None:
        self._n["cancelled"] += 1
        req.finish_reason = "cancelled"
        for i in range(req.n):
            req._push(self._response(req, "", None, "cancelled", 0.0, i), final=True)

    def _response(self, req: Request, text, tok, reason, t_first: float, index: int = 0,
                  logprob=None) -> GenerationResponse:
        now = time.perf_counter()
        n_gen = req.seqs[index].n_gen
        ttft = (t_first - req.t_submit) if t_first else 0.0
        fresh = req.prompt_tokens - req.cached_tokens
        return GenerationResponse(
            text, tok, reason, req.prompt_tokens, n_gen, fresh / ttft if ttft > 0 else 0.0,
            (n_gen - 1) / (now - t_first) if n_gen > 1 and now > t_first else 0.0, ttft,
            peak_rss_bytes(), req.cached_tokens, logprobs=logprob, index=index,
            draft_tokens=req.draft_tokens, accepted_draft_tokens=req.accepted_draft_tokens)

    def _finish(self, s: _Slot, reason: str, error: BaseException | None = None) -> None:
        """Under the lock: end a slot; its cache goes back to the prompt cache (or away on error)."""
        if s not in self._slots:        # a choice already ended with its request's error
            return
        self._slots.remove(s)
        req = s.req
        req.finish_reason = reason
        c = s.seq.constraint
        if c is not None:
            self._n["grammar_masks"] += c.masks
            self._n["grammar_mask_seconds"] += c.mask_seconds
        if error is not None:           # the whole request fails: its other choices go too
            for o in [o for o in self._slots if o.req is req]:
                self._slots.remove(o)
                if o.entry is not None:
                    self._cache.discard(o.entry)
            if s.entry is not None:
                self._cache.discard(s.entry)
            self._n["failed"] += 1
            req._push(error, final=True)
            return
        if s.entry is not None:
            self._cache.release(s.entry, s.seq.history)
        self._n["cancelled" if reason == "cancelled" else "finished"] += 1
        if reason == "cancelled":
            req._push(self._response(req, "", None, "cancelled", s.t_first, s.index), final=True)

    def _emit(self, s: _Slot, tok: int, now: float) -> bool:
        """Hand a sampled token to the consumer; True when the request finished."""
        text, reason = s.seq.accept(tok)
        if s.seq.n_gen == 1:
            s.t_first = now
        lp = s.seq.last_logprob if s.seq.logprobs else None
        s.req._push(self._response(s.req, text, tok, reason, s.t_first, s.index, lp), final=reason is not None)
        s.tok = tok
        self._n["tokens_generated"] += 1
        return reason is not None

    def _forward(self, toks: list[int], caches: list) -> np.ndarray:
        """One decode token per (token, cache) -> logits [B, V]; every cache advances by one."""
        m = self.model
        if len(toks) == 1:    # exactly the single-sequence path (model.__call__, hot mode and all)
            return m(np.asarray(toks, dtype=np.int64), caches[0], last_only=True)[None]
        return m.decode_batch(np.asarray(toks, dtype=np.int64), caches)

    def _step(self, prefill: _Slot | None, decode: list[_Slot]) -> None:
        """Outside the lock: the model runs (kernels release the GIL), then sampling and hand-off.
        A prompt chunk and the decoding slots share one forward (one sweep over the weights)."""
        if prefill is None and len(decode) == 1 and decode[0].spec is not None:
            if self._step_speculative(decode[0]):
                return
        done: list[tuple[_Slot, str, BaseException | None]] = []
        chunk = p_logits = None
        if prefill is not None:
            prompt = prefill.seq.prompt
            chunk = np.asarray(prompt[prefill.pos:prefill.pos + self.prefill_chunk], dtype=np.int64)
        masks = self._masks_during_forward(decode, prefill, chunk)
        if decode:
            try:
                if chunk is not None:
                    logits = self.model.decode_batch(np.asarray([s.tok for s in decode], dtype=np.int64),
                                                     [s.entry.kv for s in decode], prefill=(chunk, prefill.entry.kv))
                    logits, p_logits = logits[:-1], logits[-1]
                else:
                    logits = self._forward([s.tok for s in decode], [s.entry.kv for s in decode])
            except Exception as e:  # noqa: BLE001 — handed to each request of the batch
                done += [(s, "error", e) for s in decode]
                if chunk is not None:
                    done.append((prefill, "error", e))
                    prefill = None
            else:
                if masks is not None:
                    masks.result()
                    masks = None
                now = time.perf_counter()
                for b, s in enumerate(decode):
                    try:
                        if self._emit(s, s.seq.sample(logits[b]), now):
                            done.append((s, s.seq.finish_reason, None))
                    except Exception as e:  # noqa: BLE001
                        done.append((s, "error", e))
                self._n["decode_tokens"] += len(decode)
                self._n["max_batch"] = max(self._n["max_batch"], len(decode))
        if masks is not None:
            masks.result()          # (a failed forward: the masks are simply left computed)
        if prefill is not None:
            s = prefill
            try:
                if p_logits is None:
                    p_logits = self.model(chunk, s.entry.kv, last_only=True, chunk_size=self.prefill_chunk)
                s.pos += chunk.size
                self._n["prefill_tokens"] += chunk.size
                if s.pos == len(s.seq.prompt):
                    if s.spec is not None and not decode and hasattr(s.spec.drafter, "prime"):
                        s.spec.drafter.prime(s.spec.state, s.seq.prompt)   # the draft's prefill, with ours
                    done += self._fork(s, p_logits)
                    if self._emit(s, s.seq.sample(p_logits), time.perf_counter()):
                        done.append((s, s.seq.finish_reason, None))
            except Exception as e:  # noqa: BLE001
                done.append((s, "error", e))
        with self._cond:
            self._n["steps"] += 1
            for s, reason, err in done:
                self._finish(s, reason, err)

    def _masks_during_forward(self, decode: list[_Slot], prefill: _Slot | None, chunk):
        """Start computing the grammar masks of the constrained slots that sample after this
        step's forward, on the masker thread (llguidance releases the GIL, the kernels too): the
        masks are ready when the logits are, and unconstrained slots never wait for them.
        -> a future, or None when no slot of the step is constrained."""
        cons = [s.seq.constraint for s in decode if s.seq.constraint is not None]
        if prefill is not None and prefill.seq.constraint is not None and \
                prefill.pos + chunk.size == len(prefill.seq.prompt):
            cons.append(prefill.seq.constraint)
        if not cons:
            return None
        if self._masker is None:
            from concurrent.futures import ThreadPoolExecutor
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="mixqrt-mask")

        def run():
            for c in cons:
                try:
                    c.compute_mask()
                except Exception:  # noqa: BLE001 — apply() recomputes and reports it to the request
                    pass
        return self._masker.submit(run)

    def _step_speculative(self, s: _Slot) -> bool:
        """A lone decoding slot: draft up to k tokens, verify them in one forward of k+1 rows, emit
        the accepted drafts and the target's own next token, roll the KV back past the rest
        (mixqrt.generation.speculative). False when nothing was drafted: the caller runs a plain step."""
        sp, seq, kv = s.spec, s.seq, s.entry.kv
        if self._verify_rows is None:
            self._verify_rows = exact_rows(self.model)
        k = min(sp.next_k(), seq.budget - seq.n_gen - 1, kv.max_len - seq.n, self._verify_rows - 1)
        drafts: list[int] = []
        done = None
        try:
            t0 = time.perf_counter()
            if k > 0:
                drafts = sp.drafter.propose(sp.state, seq.history[:seq.n], k)[:k]
                drafts = drafts[:sp.length(len(drafts))]
            if not drafts:
                return False
            t1 = time.perf_counter()
            rows = _VerifyRows(self.model, [s.tok] + drafts, kv)     # the body on k+1 rows, logits by pieces
            now = time.perf_counter()
            sp.record_times(len(drafts), t1 - t0, len(drafts) + 1, now - t1)
            accepted = 0
            s.req.draft_tokens += len(drafts)
            for i in range(len(drafts) + 1):
                tok = seq.sample(rows[i])
                hit = i < len(drafts) and tok == drafts[i]
                accepted += hit
                s.req.accepted_draft_tokens += hit
                if self._emit(s, tok, now):
                    done = (seq.finish_reason, None)
                    break
                if not hit:
                    break
            s.entry.hwm = max(s.entry.hwm, kv.offset)   # rows written past what is kept stay resident
            kv.trim(kv.offset - (seq.n - 1))       # keep the K/V of every token but the last emitted
            if kv.offset < seq.n - 1:              # a packed cache dropped more (down to a block start):
                self.model(seq.history[kv.offset:seq.n - 1], kv, last_only=True)    # write those rows again
            sp.drafter.rollback(sp.state, seq.n - 1)
            sp.record(len(drafts), accepted)
            self._n["draft_tokens"] += len(drafts)
            self._n["accepted_draft_tokens"] += accepted
            self._n["verify_steps"] += 1
            self._n["decode_tokens"] += accepted + 1
            self._n["max_batch"] = max(self._n["max_batch"], 1)
        except Exception as e:  # noqa: BLE001 — handed to the request
            done = ("error", e)
        with self._cond:
            self._n["steps"] += 1
            if done is not None:
                self._finish(s, *done)
        return True

    def _fork(self, lead: _Slot, logits: np.ndarray) -> list:
        """The prompt of `lead` is prefilled: its other choices copy its KV rows (one prefill for n
        choices) and sample their first token from the same logits. -> finished (slot, reason, None)."""
        done = []
        followers = [f for f in self._slots if f.leader is lead]
        for f in followers:
            with self._cond:
                f.entry = self._cache.fork(lead.entry, lead.pos)
            kv = f.entry.kv
            if kv.offset < lead.pos:            # a packed cache copies whole blocks: write the rest again
                self.model(np.asarray(lead.seq.prompt[kv.offset:lead.pos], dtype=np.int64), kv, kv.offset,
                           last_only=True)
            f.pos, f.leader = lead.pos, None
            if self._emit(f, f.seq.sample(logits.copy()), time.perf_counter()):
                done.append((f, f.seq.finish_reason, None))
        return done

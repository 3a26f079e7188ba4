"""`mixqrt.Pipeline` and `mixqrt.load`: name a model and a recipe, get text.

    pipe = mixqrt.Pipeline("Qwen2-7B-2356")            # alias + recipe, hub id, HF folder, .gguf or .mxq
    pipe("def quicksort(xs):", max_new_tokens=64)      # -> [{"generated_text": ...}] (transformers' shape)
    for piece in pipe.stream(messages, temperature=0.7):
        print(piece.text, end="")
    pipe.save("model.mxq")

Quantized models are cached in ~/.cache/mixqrt ($MIXQRT_CACHE): the second load is an mmap.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from mixqrt.errors import GenerationError, ModelError
from mixqrt.limits import DEFAULT_MAX_CONTEXT
from mixqrt.resolve import DEFAULT_RECIPE, Resolved, cached_mxq_path, demo_model_path, resolve


class LoadedModel:
    """A model ready to run: graph + tokenizer + the .mxq it is mapped from."""

    def __init__(self, path, *, threads: int | None = None, hugepages: bool = True, willneed: bool = True):
        from mixqrt.io.mxq import MxqFile
        from mixqrt.models import get_model_class

        t0 = time.perf_counter()
        self.path = str(path)
        # MADV_HUGEPAGE + MADV_WILLNEED on the mapping: measured 1.08x median over plain mmap in
        # docs/lab/scheduler.md (the prefetch thread and core-slicing lost there and stay options)
        # a mixture of experts gets no whole-file read-ahead: the experts no token picks stay on disk
        self.file = MxqFile(path, hugepages=hugepages, willneed=False)
        meta = self.file.meta
        from mixqrt.models.spec import MOE_ARCHS
        if willneed and meta.get("arch") not in MOE_ARCHS:
            self.file.arena.advise("willneed")
        if meta.get("kind") != "mixqrt-llm":
            raise ModelError(f"{path}: not a mixqrt language model file (kind={meta.get('kind')!r})")
        self.meta = meta
        self.recipe = meta.get("recipe", {}).get("name")
        self._tokenizer = None          # built on first use: ~0.1-0.3 s and ~100 MiB for a 151k vocabulary
        self._tokenizer_lock = threading.Lock()
        self.generation_config = dict(meta.get("generation_config") or {})
        cls = get_model_class(meta.get("arch"))
        tensors = dict(self.file.tensors)
        levels = meta.get("q3p_levels")
        if levels is not None:
            from mixqrt.formats.layout import Q3P_LEVELS, q3p_table

            def bad(msg):
                return ModelError(f"{path}: bad q3p_levels in the header: {msg}")
            table = q3p_table(levels, bad)
            if not np.array_equal(table, Q3P_LEVELS):   # written with another table: decode with it
                for qt in tensors.values():
                    if qt.fmt in ("q3p", "q3x"):
                        qt.meta = {**qt.meta, "q3p_levels": table}   # meta is read-only: a new mapping
        self.model = cls(cls.args_class.from_dict(meta.get("config")), tensors, generation_config=self.generation_config)
        if threads is not None:
            from mixqrt import ops
            if hasattr(ops, "set_num_threads"):
                ops.set_num_threads(int(threads))
        self.load_seconds = time.perf_counter() - t0

    @property
    def tokenizer(self):
        """The model's tokenizer, built from the file's serialized tokenizer.json on first access
        (a forward pass on token ids never needs it)."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    from mixqrt.tokenizer import Tokenizer
                    self._tokenizer = Tokenizer.from_meta(self.meta)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self._tokenizer = tok

    @property
    def config(self) -> dict:
        return self.meta["config"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.file.tensors.values())

    def logits(self, token_ids) -> np.ndarray:
        """float32 [T, vocab]: full forward of token_ids from position 0."""
        return self.model.logits(token_ids)

    def close(self) -> None:
        from mixqrt import ops
        ops.prefetch_wait()          # a gap prefetch may still hold a view of this file's mapping
        self.file.close()


def _source_for(res: Resolved, offline, progress) -> str:
    if res.kind == "demo":
        return str(demo_model_path(progress=progress))
    if res.kind == "hub":
        from mixqrt.io.hub import resolve_hub
        return str(resolve_hub(res.where, offline=offline, progress=progress))
    return res.where


def prepare(name_or_path, recipe: str | None = None, *, offline=None, progress=True,
            overrides=None) -> Path:
    """Resolve a model name to a local .mxq, quantizing it once into the cache when needed."""
    res = resolve(name_or_path)
    if res.kind == "mxq":
        if recipe is not None:
            raise ModelError(f"{res.where} is already quantized; drop recipe={recipe!r} or load the source model")
        return Path(res.where)
    from mixqrt.quantize.convert import quantize_model      # not imported for a .mxq: it costs ~0.1 s at start-up
    from mixqrt.quantize.recipes import get_recipe
    rec = get_recipe(recipe or res.recipe or DEFAULT_RECIPE, overrides)
    src = _source_for(res, offline, progress)
    out = cached_mxq_path(res.label, src, rec.spec())
    if not out.exists():
        from mixqrt.io.atomic import output_lock
        # one quantization per cache entry: a second process waits here and reuses the result
        with output_lock(out):
            if not out.exists():
                quantize_model(src, rec, out, progress=progress, offline=offline)
    return out


def load(path_or_name, recipe: str | None = None, *, threads=None, offline=None, progress=True) -> LoadedModel:
    """A model with .tokenizer.encode/decode and .logits(ids) -> float32 [T, vocab]."""
    return LoadedModel(prepare(path_or_name, recipe, offline=offline, progress=progress), threads=threads)


_GEN_KEYS = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
             "do_sample", "return_full_text", "stop_strings", "max_tokens", "n", "logprobs", "top_logprobs",
             "presence_penalty", "frequency_penalty", "logit_bias", "draft_k", "prediction",
             "response_format", "tools", "tool_choice", "parallel_tool_calls"}


class Pipeline:
    """Text generation, shaped like transformers' pipeline("text-generation")."""

    def __init__(self, model=None, recipe: str | None = None, threads: int | None = None, *,
                 offline: bool | None = None, progress: bool = True, max_context: int | None = None,
                 draft=None, draft_recipe: str | None = None, draft_k: int = 4, lookup: int | None = None,
                 response_format=None):
        """draft: a smaller model with the same tokenizer (anything Pipeline takes as `model`, or a
        loaded Pipeline / LoadedModel) that drafts draft_k tokens per step, quantized with
        draft_recipe; lookup: k for prompt-lookup drafting instead (no extra model). Either turns
        on speculative decoding in the engine (mixqrt.speculative, docs/speculative.md)."""
        self.path = prepare(model, recipe, offline=offline, progress=progress)
        # every generation's default response_format (mixqrt.grammar); a call's own argument wins
        self.response_format = response_format
        if response_format is not None:
            from mixqrt.grammar import grammar_from_response_format
            grammar_from_response_format(response_format)      # its shape is checked now
        self.loaded = LoadedModel(self.path, threads=threads)
        self.model = self.loaded.model
        self.max_context = int(max_context) if max_context else min(self.model.context_length, DEFAULT_MAX_CONTEXT)
        self.drafter = None
        if draft is not None or lookup is not None:
            from mixqrt.speculative import make_drafter
            if draft is not None and not hasattr(draft, "model"):
                draft = LoadedModel(prepare(draft, draft_recipe, offline=offline, progress=progress))
            self.drafter = make_drafter(lookup, draft, draft_k, target=self.model, target_tokenizer=self.tokenizer)
        self._engine = None
        self._engine_lock = threading.Lock()
        self._finalizer = None

    # ------------------------------------------------------------------ engine
    @property
    def engine(self):
        """The Engine every generation of this Pipeline goes through (created on first use with
        the defaults of mixqrt.engine.Engine; ``configure_engine`` replaces it)."""
        with self._engine_lock:
            if self._engine is None:
                self._set_engine({})
            return self._engine

    def configure_engine(self, **kw):
        """Replace the engine with one built with these Engine keyword arguments (max_slots,
        prefill_chunk, kv_cache_bytes, max_queue, stall_timeout, threads); returns it."""
        with self._engine_lock:
            if self._engine is not None:
                self._finalizer()
            self._set_engine(kw)
            return self._engine

    def _set_engine(self, kw):
        from mixqrt.engine import Engine
        kw.setdefault("speculative", self.drafter)
        self._engine = Engine(self, **kw)
        # the engine thread must not outlive an abandoned Pipeline
        self._finalizer = weakref.finalize(self, self._engine.close)

    def close(self) -> None:
        """Stop the engine (running requests end "cancelled"). The Pipeline can still generate:
        the next call starts a new engine."""
        with self._engine_lock:
            if self._engine is not None:
                self._finalizer()
                self._engine = None

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self.loaded.tokenizer = tok

    # ------------------------------------------------------------------ generation
    def _prompt(self, text_or_messages, tools=None) -> tuple[str | list[int], bool]:
        if isinstance(text_or_messages, str):
            return text_or_messages, False
        if isinstance(text_or_messages, (list, tuple)) and text_or_messages and all(
                isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls"))
                for m in text_or_messages):
            from mixqrt.tools import chat_ids
            # message text is encoded with special tokens off: only the template emits control tokens
            return chat_ids(self.tokenizer, text_or_messages, tools), True
        raise GenerationError("input must be a prompt string or a non-empty list of chat messages "
                              f"({{'role': ..., 'content': ...}}), got {type(text_or_messages).__name__}")

    def _gen_kwargs(self, kw: dict) -> dict:
        unknown = set(kw) - _GEN_KEYS
        if unknown:
            raise GenerationError(f"unknown generation argument(s): {', '.join(sorted(unknown))}")
        kw = dict(kw)
        kw.pop("return_full_text", None)
        if "max_tokens" in kw:
            kw.setdefault("max_new_tokens", kw.pop("max_tokens"))
        if "stop_strings" in kw:
            kw.setdefault("stop", kw.pop("stop_strings"))
        return kw          # do_sample and the greedy default: generate.resolve_sampling

    def stream(self, text_or_messages, **kw):
        """Yield GenerationResponse pieces (text, token, finish_reason, tokens/s, TTFT, cached
        tokens...), generated by the engine. Leaving the loop early cancels the request."""
        from mixqrt.generate import encode_prompt

        from mixqrt.tools import check_tool_choice, check_tools
        kw = self._gen_kwargs(kw)
        tools = kw["tools"] = check_tools(kw.get("tools"))
        rendered = tools if check_tool_choice(kw.get("tool_choice"), tools) != "none" else None
        if isinstance(text_or_messages, str) and tools:
            raise GenerationError("tools need chat messages (the chat template renders them), not a prompt string")
        kw.setdefault("response_format", self.response_format)
        prompt, _ = self._prompt(text_or_messages, rendered)
        ids = encode_prompt(self.tokenizer, prompt)
        return self._run(ids, kw)

    def _run(self, ids, kw):
        req = self.engine.submit(ids, **kw)    # on the first next(): errors surface there, as before
        try:
            yield from req
        finally:
            req.cancel()

    def __call__(self, text_or_messages, **kw):
        full = kw.pop("return_full_text", True)
        pieces = list(self.stream(text_or_messages, **kw))
        texts = ["".join(p.text for p in pieces if p.index == i) for i in range(int(kw.get("n", 1)))]
        if isinstance(text_or_messages, str):
            return [{"generated_text": (text_or_messages + t) if full else t} for t in texts]
        return [{"generated_text": list(text_or_messages) + [{"role": "assistant", "content": t}]} for t in texts]

    # ------------------------------------------------------------------ files
    def save(self, path) -> Path:
        """Write the packed model to `path` (.mxq), atomically. Reloading it is an mmap."""
        from mixqrt.io.arena import drop_cached
        from mixqrt.io.atomic import atomic_write, output_lock
        path = Path(path)
        if path.resolve() == Path(self.path).resolve():
            return path
        with output_lock(path):                      # concurrent saves to one path take turns
            with atomic_write(path) as f, open(self.path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
                f.flush()
                os.fsync(f.fileno())
                drop_cached(f.fileno())              # see mixqrt.io.arena.drop_cached
        return path

    def __repr__(self) -> str:
        return f"Pipeline({self.path}, recipe={self.loaded.recipe})"

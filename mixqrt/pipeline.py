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
from mixqrt.models.config_limits import context_window
from mixqrt.generation.params import UNTIL_FULL, SamplingParams, as_params
from mixqrt.quantize.names import DEFAULT_RECIPE, Resolved, cached_mxq_path, demo_model_path, resolve


class LoadedModel:
    """A model ready to run: graph + tokenizer + the .mxq it is mapped from."""

    def __init__(self, path, *, threads: int | None = None, hugepages: bool = True, willneed: bool = True,
                 weights_in_memory: bool = False):
        from mixqrt.io.mxq import MxqFile
        from mixqrt.models import get_model_class

        t0 = time.perf_counter()
        self.path = str(path)
        # MADV_HUGEPAGE + MADV_WILLNEED on the mapping: measured 1.08x median over plain mmap in
        # docs/lab/scheduler.md (the prefetch thread and core-slicing lost there and stay options)
        # a mixture of experts gets no whole-file read-ahead: the experts no token picks stay on disk
        # weights_in_memory: a private copy of the file instead of a mapping of it (mixqrt serve: the
        # file may change under a long-running server; io.arena.Arena copy=True)
        self.file = MxqFile(path, hugepages=hugepages, willneed=False, copy=weights_in_memory)
        meta = self.file.meta
        from mixqrt.models.arch import find as find_arch
        moe = getattr(find_arch(meta.get("arch")), "moe", False)
        if willneed and not moe:
            self.file.arena.advise("willneed")
        if meta.get("kind") != "mixqrt-llm":
            raise ModelError(f"{path}: not a mixqrt language model file (kind={meta.get('kind')!r})")
        self.meta = meta
        self.recipe = meta.get("recipe", {}).get("name")
        self._tokenizer = None          # built on first use: ~0.1-0.3 s and ~100 MiB for a 151k vocabulary
        self._tokenizer_lock = threading.Lock()
        from mixqrt.models.config_limits import check_generation_config, check_values
        self.generation_config = check_generation_config(dict(meta.get("generation_config") or {}),
                                                         f"{path}: generation_config")
        check_values(dict(meta.get("config") or {}), f"{path}: config")
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
                    from mixqrt.generation.tokenizer import Tokenizer
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

    def logit_pieces(self, token_ids, first: int, rows: int = 256):
        """Logits of positions first .. len-2 of token_ids run from position 0, `rows` positions
        at a time (float32 [<= rows, vocab] each): the prefix before `first` only fills the KV
        cache, so a long window never holds all its logits (mixqrt ppl's long windows)."""
        m = self.model
        ids = m.check_tokens(token_ids)
        cache = m.make_cache(ids.size)
        if first > 0:
            m(ids[:first], cache, 0, last_only=True)
        for s in range(first, ids.size - 1, rows):
            yield m(ids[s:min(ids.size - 1, s + rows)], cache, s)

    def embedder(self, pooling: str | None = None, normalize: bool | None = None, **kw):
        """A mixqrt.generation.embed.Embedder with the file's embedding settings (pooling, normalization,
        attention, dense projections), each overridable."""
        from mixqrt.generation.embed import Embedder
        return Embedder(self.model, self.meta.get("embedding"), tensors=self.file.tensors, pooling=pooling,
                        normalize=normalize, **kw)

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


class Pipeline:
    """Text generation, shaped like transformers' pipeline("text-generation")."""

    def __init__(self, model=None, recipe: str | None = None, threads: int | None = None, *,
                 offline: bool | None = None, progress: bool = True, max_context: int | None = None,
                 draft=None, draft_recipe: str | None = None, draft_k: int = 4, lookup: int | None = None,
                 response_format=None, weights_in_memory: bool = False, kv_type: str | None = None):
        """draft: a smaller model with the same tokenizer (anything Pipeline takes as `model`, or a
        loaded Pipeline / LoadedModel) that drafts draft_k tokens per step, quantized with
        draft_recipe; lookup: k for prompt-lookup drafting instead (no extra model). Either turns
        on speculative decoding in the engine (mixqrt.generation.speculative, docs/speculative.md).
        weights_in_memory: read the .mxq into private memory instead of mapping it (what `mixqrt
        serve` does: a file replaced or truncated under the server cannot change or fault it).
        max_context: the context (default: the model's own, e.g. 32768 for Qwen2.5); the KV cache's
        pages become resident as a sequence grows, bounded by the engine's kv_cache_bytes.
        kv_type: the KV cache's type, one of mixqrt.models.kv_cache.KV_TYPES (default DEFAULT_KV_TYPE)."""
        self.path = prepare(model, recipe, offline=offline, progress=progress)
        # every generation's default response_format (mixqrt.generation.grammar); a call's own argument wins
        self.response_format = response_format
        if response_format is not None:
            from mixqrt.generation.grammar import grammar_from_response_format
            grammar_from_response_format(response_format)      # its shape is checked now
        self.loaded = LoadedModel(self.path, threads=threads, weights_in_memory=weights_in_memory)
        self.model = self.loaded.model
        self.max_context = context_window(self.model.context_length, max_context)
        from mixqrt.models.kv_cache import check_kv_type
        self.kv_type = check_kv_type(kv_type, self.model.args.head_dim)
        self.model.kv_bytes_per_token(self.kv_type)      # a type this build cannot make fails here
        self.model.kv_type = self.kv_type                # every cache of this model (generate, logits)
        self.drafter = None
        if draft is not None or lookup is not None:
            from mixqrt.generation.speculative import make_drafter
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
        the defaults of mixqrt.generation.engine.Engine; ``configure_engine`` replaces it)."""
        with self._engine_lock:
            if self._engine is None:
                self._set_engine({})
            return self._engine

    def configure_engine(self, **kw):
        """Replace the engine with one built with these Engine keyword arguments (max_slots,
        prefill_chunk, kv_cache_bytes, kv_type, max_queue, stall_timeout, threads); returns it."""
        with self._engine_lock:
            if self._engine is not None:
                self._finalizer()
            self._set_engine(kw)
            return self._engine

    def _set_engine(self, kw):
        from mixqrt.generation.engine import Engine
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
            from mixqrt.generation.tool_calls import chat_ids
            # message text is encoded with special tokens off: only the template emits control tokens
            return chat_ids(self.tokenizer, text_or_messages, tools), True
        raise GenerationError("input must be a prompt string or a non-empty list of chat messages "
                              f"({{'role': ..., 'content': ...}}), got {type(text_or_messages).__name__}")

    def stream(self, text_or_messages, params: SamplingParams | None = None, **kw):
        """Yield GenerationResponse pieces (text, token, finish_reason, tokens/s, TTFT, cached
        tokens...), generated by the engine. params: the request's options (mixqrt.generation.params:
        max_new_tokens, temperature, stop, n, response_format, tools, ...); keyword arguments
        (transformers' spellings and the others of SamplingParams) build or change them. Leaving
        the loop early cancels the request."""
        from mixqrt.generation.generate import encode_prompt
        from mixqrt.generation.tool_calls import check_tool_choice, check_tools

        p = as_params(params, **kw)
        if p.response_format is None and self.response_format is not None:
            p = p.replace(response_format=self.response_format)
        tools = check_tools(p.tools)
        rendered = tools if check_tool_choice(p.tool_choice, tools) != "none" else None
        if isinstance(text_or_messages, str) and tools:
            raise GenerationError("tools need chat messages (the chat template renders them), not a prompt string")
        prompt, _ = self._prompt(text_or_messages, rendered)
        ids = encode_prompt(self.tokenizer, prompt)
        return self._run(ids, p)

    def _run(self, ids, params):
        req = self.engine.submit(ids, params)  # on the first next(): errors surface there, as before
        try:
            yield from req
        finally:
            req.cancel()

    def __call__(self, text_or_messages, params: SamplingParams | None = None, **kw):
        """[{"generated_text": ...}] per choice (transformers' shape); return_full_text=False
        leaves the prompt out."""
        full = kw.pop("return_full_text", True)
        p = as_params(params, **kw)
        pieces = list(self.stream(text_or_messages, p))
        texts = ["".join(x.text for x in pieces if x.index == i) for i in range(p.n)]
        if isinstance(text_or_messages, str):
            return [{"generated_text": (text_or_messages + t) if full else t} for t in texts]
        return [{"generated_text": list(text_or_messages) + [{"role": "assistant", "content": t}]} for t in texts]

    # ------------------------------------------------------------------ fill-in-the-middle
    def infill_ids(self, prefix: str, suffix: str, extra=None, *, prompt: str = "", spm: bool = False,
                   max_new_tokens: int | None = None, n_batch: int | None = None) -> list[int]:
        """The token ids of a fill-in-the-middle prompt (mixqrt.generation.fim.build_infill: the model's FIM
        tokens, llama.cpp's repo-level order and trimming; FimError when the model has none)."""
        from mixqrt.generation.fim import DEFAULT_N_BATCH, build_infill
        return build_infill(self.tokenizer, prefix, suffix, extra, prompt, n_ctx=self.max_context,
                            n_predict=-1 if max_new_tokens is None else int(max_new_tokens),
                            n_batch=n_batch or DEFAULT_N_BATCH, spm=spm)

    def stream_infill(self, prefix: str, suffix: str, extra=None, params: SamplingParams | None = None, *,
                      prompt: str = "", spm: bool = False, n_batch: int | None = None, **kw):
        """GenerationResponse pieces of the middle between prefix and suffix. extra: other files of
        the repository, [{"filename": ..., "text": ...}] (llama.cpp's input_extra); prompt: text
        typed after the prefix. Generation stops at end-of-text or any FIM token; neither is in the
        text. params / kw: the generation options, as for stream()."""
        from mixqrt.generation.fim import stop_ids
        given = params is not None or "max_new_tokens" in kw or "max_tokens" in kw
        p = as_params(params, **kw)
        if p.tools or p.response_format is not None:
            raise GenerationError("infill takes neither tools nor response_format")
        mnt = p.max_new_tokens if given and p.max_new_tokens != UNTIL_FULL else None
        ids = self.infill_ids(prefix, suffix, extra, prompt=prompt, spm=spm, max_new_tokens=mnt, n_batch=n_batch)
        return self._run(ids, p.replace(eos_token_ids=list(stop_ids(self.tokenizer, self.model))))

    def infill(self, prefix: str, suffix: str, extra=None, **kw) -> str:
        """The middle text between prefix and suffix (see stream_infill)."""
        return "".join(p.text for p in self.stream_infill(prefix, suffix, extra, **kw) if p.index == 0)

    # ------------------------------------------------------------------ embeddings
    def embedder(self, pooling: str | None = None, normalize: bool | None = None, **kw):
        """mixqrt.generation.embed.Embedder with this model's settings (LoadedModel.embedder)."""
        return self.loaded.embedder(pooling, normalize, **kw)

    def embed(self, texts, *, pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None) -> np.ndarray:
        """Embeddings of a string, a list of strings or a list of token-id lists -> float32 [N, D]
        (pooling "none": a list of [n_i, D] arrays). Pooling and L2 normalization come from the model
        (mixqrt.generation.embed), each overridable; dimensions truncates (Matryoshka) where the model allows.
        The forwards run on the engine's thread between decode steps (Engine.embed)."""
        from mixqrt.generation.embed import check_dimensions, truncate
        seqs = self.embed_ids(texts)
        emb = self.embedder(pooling, normalize)
        dims = check_dimensions(emb, dimensions)
        out = self.engine.embed(seqs, emb).result()
        return truncate(out, dims, emb.normalize) if dims is not None else out

    def embed_ids(self, texts) -> list[list[int]]:
        """Token ids of embedding inputs (text is user text: control-token strings stay text)."""
        from mixqrt.generation.embed import encode_inputs
        return encode_inputs(self.tokenizer, texts, max_tokens=self.max_context)

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

"""Calibration text for `quantize --calibrate`: text files, the model's own sampled text, or a mix.

A calibration set is a list of token-id chunks (each at most ctx long, run from position 0) plus a
record of exactly where they came from, which goes into the file's recipe header.

Sources:
  TextSource(text, label)  the first tokens of a text (no BOS), in chunks of ctx
                           (calibrate.calibration_ids);
  GeneratedSource(...)     text the model samples itself ("self" on the command line): the source
                           model, quantized in memory to q8 (KL 0.0008 from float32 on
                           Qwen2.5-Coder-0.5B, docs/results.md; a quarter of float32's bytes to
                           read per token), continues each of a fixed set of prompts (prose, code,
                           chat turns through the model's chat template) with seeded sampling. A
                           sample is the prompt's tokens followed by the generated ones, eos
                           included, up to ctx tokens.

Why the model's own text: the Hessians GPTQ uses weight the input directions the calibration tokens
excite. A text file excites those of its own kind (English prose for Tiny Shakespeare) and error
moves into the others (measured: code got worse, docs/quality.md §0.1); the model's own samples
cover what the model actually produces, in the proportions of the prompt set.

Several sources share the token budget evenly (the first gets the remainder). Generation is
deterministic for a given seed on a given kernel tier (sampling is a seeded numpy Generator; the
logits are the kernels' own); the record carries a SHA-256 of every token id so a rerun can be
checked.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from mixqrt.errors import QuantError

# Ordered so that any prefix mixes kinds: a 2048-token share still sees prose, code and chat.
# ("raw", text): plain continuation; ("chat", message): one user turn through the chat template.
PROMPTS_V1: tuple[tuple[str, str], ...] = (
    ("raw", "The old lighthouse keeper had not spoken to anyone in three weeks when"),
    ("raw", "import os\nimport sys\n\n\ndef load_settings(path):\n    \"\"\""),
    ("chat", "Write a Python function that merges two sorted lists into one sorted list, "
             "and explain how it works."),
    ("raw", "Volcanoes form where molten rock from deep inside the Earth reaches the surface. The"),
    ("chat", "What causes the seasons on Earth? Answer in a few short paragraphs."),
    ("raw", "#include <stdio.h>\n#include <stdlib.h>\n\n/* A singly linked list of integers. */\n"),
    ("raw", "# Installation\n\nTo install the package, run"),
    ("chat", "Write a short story about a robot who learns to paint."),
    ("raw", "// A tiny HTTP server in Node.js\nconst http = require('http');\n"),
    ("raw", "Dear Margaret,\n\nThank you for your letter of"),
    ("chat", "Review this SQL query and suggest improvements: SELECT * FROM orders "
             "WHERE YEAR(created_at) = 2023 ORDER BY id;"),
    ("chat", "Explain the difference between a process and a thread, with a small example in Rust."),
)
PROMPT_SET = "v1"


@dataclass(frozen=True)
class TextSource:
    text: str
    label: str = "text"


@dataclass(frozen=True)
class GeneratedSource:
    """The model's own sampled text. recipe: the in-memory format the source model runs in."""
    seed: int = 0
    temperature: float = 0.9
    top_p: float = 0.95
    recipe: str = "q8"
    save: str | None = None        # write the generated samples (text) here, for reading
    label: str = "self"


def parse_sources(items, *, seed: int = 0, save: str | None = None) -> list:
    """Calibration sources from their command-line names: "self" (the model's own sampled text) or
    the path of a UTF-8 text file, labelled with its file name. `mixqrt quantize --calibrate` and
    the benchmarks both use this, so a name means the same text everywhere."""
    import os

    out: list = []
    for item in items:
        if item == "self":
            out.append(GeneratedSource(seed=seed, save=save))
            continue
        try:
            with open(item, encoding="utf-8") as f:
                out.append(TextSource(f.read(), os.path.basename(item)))
        except (OSError, UnicodeDecodeError) as e:
            raise QuantError(f"calibration text {item!r}: {e}") from None
    if save and not any(isinstance(s, GeneratedSource) for s in out):
        raise QuantError("saving the generated calibration text needs the source 'self'")
    return out


def _prompt_ids(tokenizer, kind: str, text: str) -> list[int]:
    if kind == "chat" and getattr(tokenizer, "chat_template", None):
        return [int(t) for t in tokenizer.encode_chat([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)]
    from mixqrt.generation.generate import encode_prompt
    return encode_prompt(tokenizer, text)     # no template (or none shipped): plain text, BOS if asked


def memory_model(source, recipe: str = "q8", progress: bool = True):
    """The source model built in memory with every matrix in `recipe`'s format (vectors float32)."""
    from tqdm.auto import tqdm

    from mixqrt.models import get_model_class
    from mixqrt.formats import quantize
    from mixqrt.quantize.recipes import get_recipe, tensor_plan

    rec = get_recipe(recipe)
    names = set(source.tensor_names())
    weights = {}
    for name, _, fmt, _ in tqdm(tensor_plan(source, rec), desc=f"{recipe} model for calibration text",
                                unit="tensor", disable=not progress):
        if name not in names:
            continue                    # a tied lm_head: the model ties it to the embedding itself
        w = np.asarray(source.get(name), dtype=np.float32)
        weights[name] = w if (w.ndim == 1 or fmt == "f32") else quantize(w, fmt)
    cls = get_model_class(source.arch)
    args = cls.args_class.from_dict(dict(source.config), model_type=source.arch)
    return cls(args, weights, generation_config=dict(source.generation_config or {}))


def generate_samples(model, tokenizer, tokens: int, ctx: int, *, seed: int = 0, temperature: float = 0.9,
                     top_p: float = 0.95, prompts=PROMPTS_V1, progress: bool = True) -> list[tuple[int, int, np.ndarray]]:
    """[(prompt index, prompt tokens, ids)] with sum(len(ids)) == tokens (the last sample is cut).

    Sample i continues prompts[i % len(prompts)] with the sampler seeded by seed + i, until eos
    (kept in the sample) or ctx tokens."""
    from tqdm.auto import tqdm

    from mixqrt.generation.generate import eos_ids, generate_step
    from mixqrt.generation.sampling import make_sampler

    if tokens < 2 or ctx < 2:
        raise QuantError(f"generated calibration needs tokens >= 2 and ctx >= 2, got {tokens}, {ctx}")
    eos = eos_ids(None, model, tokenizer)
    out, total, i = [], 0, 0
    with tqdm(total=tokens, desc="calibration text (self)", unit="tok", disable=not progress) as bar:
        while total < tokens:
            j = i % len(prompts)
            p = _prompt_ids(tokenizer, *prompts[j])[:ctx - 1]
            room = min(ctx, tokens - total)
            ids = list(p[:room])
            bar.update(len(ids))
            if room > len(p):
                sampler = make_sampler(temperature, 0, top_p, 0.0, seed + i)
                for tok, _ in generate_step(model, p, sampler=sampler, max_tokens=room - len(p)):
                    ids.append(tok)
                    bar.update(1)
                    if tok in eos:
                        break
            if len(ids) >= 2:
                out.append((j, min(len(p), len(ids)), np.asarray(ids, dtype=np.int64)))
            total += len(ids)
            i += 1
    return out


def labels(sources) -> str:
    """'tinyshakespeare.txt + self': the record's "text" for a source or a list of them."""
    if isinstance(sources, (str, TextSource, GeneratedSource, Generated)):
        sources = [sources]
    return " + ".join("text" if isinstance(s, str) else s.label for s in sources)


@dataclass(frozen=True)
class Generated:
    """Samples already generated (generate_source), so one generation serves several quantizations:
    take(n) is exactly what generating n tokens with the same settings gives (sample i depends only
    on its prompt and seed + i; the budget only cuts the last one)."""
    samples: tuple        # ((prompt index, prompt tokens, ids), ...)
    record: dict          # the "generated" record without samples and digest
    label: str = "self"

    def take(self, tokens: int) -> tuple[list, dict]:
        out, total = [], 0
        for j, n_p, ids in self.samples:
            if total >= tokens:
                break
            ids = ids[:tokens - total]
            total += ids.size
            if ids.size >= 2:
                out.append((j, min(n_p, int(ids.size)), ids))
        chunks = [ids for _, _, ids in out]
        digest = hashlib.sha256(b"".join(c.astype("<i8").tobytes() for c in chunks)).hexdigest()
        rec = {"text": self.label, "tokens": int(sum(c.size for c in chunks)),
               "generated": {**self.record, "samples": [[j, n_p, int(ids.size)] for j, n_p, ids in out],
                             "ids_sha256": digest}}
        return chunks, rec


def generate_source(source, s: GeneratedSource, tokens: int, ctx: int, *, progress: bool = True) -> Generated:
    """Run GeneratedSource s on the source model: `tokens` tokens of samples of at most ctx."""
    model = memory_model(source, s.recipe, progress)
    tok = source.tokenizer
    samples = generate_samples(model, tok, tokens, ctx, seed=s.seed, temperature=s.temperature, top_p=s.top_p,
                               progress=progress)
    del model
    if s.save:
        sep = "\n\n" + "=" * 20 + " sample {} (prompt {}, {} tokens) " + "=" * 20 + "\n"
        _write_text(s.save, "".join(sep.format(k, j, ids.size) + tok.decode(ids.tolist())
                                    for k, (j, _, ids) in enumerate(samples)))
    return Generated(tuple(samples), {"model": f"source at {s.recipe}", "prompt_set": PROMPT_SET,
                                      "prompts": [list(p) for p in PROMPTS_V1], "seed": int(s.seed),
                                      "temperature": float(s.temperature), "top_p": float(s.top_p),
                                      "max_len": int(ctx)}, s.label)


def calibration_set(source, sources, tokens: int, ctx: int, *, progress: bool = True) -> tuple[list, dict]:
    """-> (chunks, record): the calibration chunks of `sources` (a str = a text, a TextSource, a
    GeneratedSource, a Generated, or a list of them) sharing `tokens` evenly, and their header
    record."""
    from mixqrt.quantize.calibrate import calibration_ids

    if isinstance(sources, (str, TextSource, GeneratedSource, Generated)):
        sources = [sources]
    if not isinstance(sources, (list, tuple)) or not sources or not all(
            isinstance(s, (str, TextSource, GeneratedSource, Generated)) for s in sources):
        raise QuantError("calibrate wants a text, a TextSource, a GeneratedSource, a Generated or a non-empty "
                         f"list of them, got {str(sources)[:80]}")
    sources = [TextSource(s) if isinstance(s, str) else s for s in sources]
    if tokens < 2 or ctx < 2:
        raise QuantError(f"calibration needs tokens >= 2 and ctx >= 2, got {tokens}, {ctx}")
    share = [tokens // len(sources) + (tokens % len(sources) if k == 0 else 0) for k in range(len(sources))]
    chunks, parts = [], []
    for s, n in zip(sources, share):
        if isinstance(s, TextSource):
            got = calibration_ids(source.tokenizer, s.text, n, ctx)
            parts.append({"text": s.label, "tokens": int(sum(c.size for c in got))})
        else:
            gen = s if isinstance(s, Generated) else generate_source(source, s, n, ctx, progress=progress)
            got, rec = gen.take(n)
            parts.append(rec)
        chunks.extend(got)
    record = {"text": " + ".join(p["text"] for p in parts), "tokens": int(sum(c.size for c in chunks))}
    if len(parts) > 1 or "generated" in parts[0]:
        record["sources"] = parts
    return chunks, record


def _write_text(path, text: str) -> None:
    from mixqrt.io.atomic import atomic_write
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)

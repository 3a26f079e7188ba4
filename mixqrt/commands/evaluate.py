"""Perplexity and KL-divergence, computed exactly as llama.cpp's llama-perplexity does.

The text is tokenized once (BOS only if the model adds one), cut into non-overlapping chunks of
`ctx` tokens; each chunk is evaluated from a fresh context (with its first token replaced by BOS
when the model uses one) and only the second half is scored: positions first = ctx/2 .. ctx-2
predict tokens first+1 .. ctx-1. PPL = exp(mean NLL), with llama.cpp's error estimate.
KL divergence compares, per scored position, the base model's distribution P with this model's Q:
KL(P || Q) = sum P (log P - log Q).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from mixqrt.errors import GenerationError

LOGITS_MAGIC = b"MXQLOGP1"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class PplResult:
    ppl: float
    ppl_err: float
    tokens: int
    chunks: int
    seconds: float
    ctx: int
    kld_mean: float | None = None
    kld_p99: float | None = None
    same_top_pct: float | None = None
    running: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {"ppl": self.ppl, "ppl_err": self.ppl_err, "tokens": self.tokens, "chunks": self.chunks,
             "ctx": self.ctx, "seconds": round(self.seconds, 3), "same_top_pct": self.same_top_pct}
        if self.kld_mean is not None:
            d.update(kld_mean=self.kld_mean, kld_p99=self.kld_p99)
        return d


class LogitsFile:
    """Base-model log-probabilities of every scored position, for --kl-base. A tiny raw format
    (magic, JSON header, float16 rows): no pickle, bounded header, sizes checked."""

    def __init__(self, path, mode: str, meta: dict | None = None):
        self.path, self.mode = str(path), mode
        if mode == "w":
            from mixqrt.io.atomic import atomic_write   # the temp is renamed onto path by close(ok=True)
            self._write = atomic_write(self.path)
            self.f = self._write.__enter__()
            self.meta = dict(meta or {})
            self.rows = 0
            self.f.write(LOGITS_MAGIC + b"\0" * 8)   # header offset is patched on close
        else:
            from mixqrt.errors import FormatError
            self.f = open(self.path, "rb")
            head = self.f.read(16)
            if len(head) != 16 or head[:8] != LOGITS_MAGIC:
                raise FormatError(f"{self.path}: not a mixqrt logits file")
            hoff = int.from_bytes(head[8:], "little")
            self.f.seek(0, 2)
            size = self.f.tell()
            if not 16 <= hoff < size or size - hoff > 1 << 20:
                raise FormatError(f"{self.path}: header offset {hoff} is outside the file")
            self.f.seek(hoff)
            self.meta = json.loads(self.f.read(size - hoff))
            self.rows, self.vocab = int(self.meta["rows"]), int(self.meta["vocab"])
            if 16 + self.rows * self.vocab * 2 != hoff:
                raise FormatError(f"{self.path}: {self.rows} rows x {self.vocab} do not fill the data section")
            self.f.seek(16)

    def write(self, logp: np.ndarray) -> None:
        self.meta["vocab"] = int(logp.shape[-1])
        self.f.write(np.ascontiguousarray(logp, dtype="<f2").tobytes())
        self.rows += logp.shape[0]

    def read(self, n: int) -> np.ndarray:
        from mixqrt.errors import FormatError
        b = self.f.read(n * self.vocab * 2)
        if len(b) != n * self.vocab * 2:
            raise FormatError(f"{self.path}: holds fewer scored positions than this run needs")
        return np.frombuffer(b, dtype="<f2").reshape(n, self.vocab).astype(np.float64)

    def close(self, ok: bool = True) -> None:
        if self.mode == "w":
            if ok:
                hoff = self.f.tell()
                self.meta["rows"] = self.rows
                self.f.write(json.dumps(self.meta).encode())
                self.f.seek(8)
                self.f.write(hoff.to_bytes(8, "little"))
                self._write.__exit__(None, None, None)        # flushed, fsynced, renamed onto path
            else:
                err = GeneratorExit()
                try:
                    self._write.__exit__(GeneratorExit, err, None)   # the temp removed, path untouched
                except GeneratorExit:
                    pass
        else:
            self.f.close()


def encode_text(tokenizer, text: str, *, parse_special: bool = False) -> tuple[list, int | None]:
    """An evaluation text -> (token ids, the BOS id or None), as llama-perplexity tokenizes it: BOS
    first when the model adds one, and the text encoded as text. WikiText's literal "<unk>" must
    stay the five characters it is, not Gemma's unknown-token id (issue 39: PPL 37.5 instead of
    15.5); parse_special=True reads special-token text as the tokens, for a text that carries them
    on purpose (llama-perplexity's --parse-special)."""
    toks = list(tokenizer.encode(text, add_special_tokens=False, parse_special=parse_special))
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    return ([bos] + toks if bos is not None else toks), bos


def perplexity(logits_fn, tokens, *, ctx: int = 512, chunks: int | None = None, bos_id: int | None = None,
               save_logits: str | None = None, kl_base: str | None = None, progress: bool = True,
               on_chunk=None, pieces_fn=None) -> PplResult:
    """llama-perplexity over `tokens` with `logits_fn(chunk_ids) -> float32 [ctx, vocab]`, or with
    `pieces_fn(chunk_ids, first)` -> float32 arrays whose rows, in order, are the logits of
    positions first .. ctx-2 (the scored ones): a long window never holds [ctx, vocab] logits
    (16384 x 151936 floats are 10 GB)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if ctx < 4 or ctx % 2:
        raise GenerationError(f"ctx must be an even number >= 4, got {ctx}")
    n_chunk = len(tokens) // ctx
    if chunks is not None:
        n_chunk = min(n_chunk, int(chunks))
    if n_chunk < 1:
        raise GenerationError(f"need at least {ctx} tokens for one chunk, the text has {len(tokens)}")
    first = ctx // 2
    nll = nll2 = 0.0
    count = 0
    kls, same = [], 0
    saver = LogitsFile(save_logits, "w", {"ctx": ctx}) if save_logits else None
    base = LogitsFile(kl_base, "r") if kl_base else None
    ok = False
    t0 = time.perf_counter()
    running = []
    try:
        from tqdm.auto import tqdm
        for i in tqdm(range(n_chunk), desc="perplexity", unit="chunk", disable=not progress):
            ids = tokens[i * ctx:(i + 1) * ctx].copy()
            if bos_id is not None:
                ids[0] = bos_id
            if pieces_fn is None:
                pieces = [np.asarray(logits_fn(ids), dtype=np.float32)[first:ctx - 1]]
            else:
                pieces = pieces_fn(ids, first)
            pos = i * ctx + first + 1                   # the token the next scored row predicts
            for piece in pieces:
                lp = log_softmax(np.asarray(piece, dtype=np.float32))                # [rows, V]
                tgt = tokens[pos:pos + lp.shape[0]]
                if tgt.size != lp.shape[0] or pos + lp.shape[0] > (i + 1) * ctx:
                    raise GenerationError(f"the logits of chunk {i} have more rows than its {ctx - first - 1} "
                                          "scored positions")
                pos += lp.shape[0]
                tok_nll = -lp[np.arange(len(tgt)), tgt]
                nll += tok_nll.sum()
                nll2 += (tok_nll ** 2).sum()
                count += len(tgt)
                if saver:
                    saver.write(lp)
                if base:
                    bp = base.read(len(tgt))
                    p = np.exp(bp)
                    kls.append((p * (bp - lp)).sum(axis=-1))
                    same += int((bp.argmax(-1) == lp.argmax(-1)).sum())
            if pos != (i + 1) * ctx:
                raise GenerationError(f"the logits of chunk {i} cover {pos - i * ctx - first - 1} of its "
                                      f"{ctx - first - 1} scored positions")
            running.append(math.exp(nll / count))
            if on_chunk:
                on_chunk(i, running[-1])
        ok = True
    finally:
        if saver:
            saver.close(ok)
        if base:
            base.close()
    mean = nll / count
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) if count > 1 and var > 0 else 0.0
    ppl = math.exp(mean)
    res = PplResult(ppl, ppl * err, count, n_chunk, time.perf_counter() - t0, ctx, running=running)
    if kls:
        k = np.concatenate(kls)
        res.kld_mean = float(k.mean())
        res.kld_p99 = float(np.percentile(k, 99))
        res.same_top_pct = 100.0 * same / count
    return res

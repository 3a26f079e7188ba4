"""Samplers and logits processors (mlx-lm's shape: plain callables built by make_*)."""
from __future__ import annotations

import math

import numpy as np

from mixqrt.errors import GenerationError, RequestError


def _show(v, limit: int = 60) -> str:
    """A value for an error message: repr, ASCII only (no surrogate or control character reaches a
    reply or a log), cut to `limit` characters."""
    r = ascii(v)
    return r if len(r) <= limit else r[:limit] + "..."


# The one numeric argument checker of the Python API and the HTTP API (mixqrt.oai wraps these):
# a RequestError (a GenerationError) that names the argument.
def _number(name, v, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise RequestError(name, f"{name} must be a finite number, got {_show(v)}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(name, f"{name} must be {'>' if lo_open else '>='} {lo}, got {_show(v)}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise RequestError(name, f"{name} must be {'<' if hi_open else '<='} {hi}, got {_show(v)}")
    return float(v)


def _int(name, v, lo=0, hi=None) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)          # JSON clients sometimes send 64.0
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise RequestError(name, f"{name} must be an integer, got {_show(v)}")
    if lo is not None and v < lo:
        raise RequestError(name, f"{name} must be >= {lo}, got {_show(v)}")
    if hi is not None and v > hi:
        raise RequestError(name, f"{name} must be <= {hi}, got {_show(v)}")
    return int(v)


GREEDY_BELOW = 1e-5


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None):
    """-> sampler(logits [vocab]) -> token id (int).

    temperature below GREEDY_BELOW is greedy (argmax; the other knobs are then irrelevant): 1/t
    overflows float64 long before t reaches the smallest subnormal (5e-324 gave inf * 0 = NaN
    probabilities and drew the last token), and at t = 1e-5 a logit gap of 0.01 is already a
    factor e^1000, so sampling is argmax in all but ties. Otherwise the filters
    run in transformers' order on logits / temperature: top_k (0 = off), top_p (nucleus, 1 = off),
    min_p (keep p >= min_p * p_max, 0 = off); then one draw from a numpy Generator seeded by seed.
    """
    temperature = _number("temperature", temperature, lo=0.0)
    top_k = _int("top_k", top_k)
    top_p = _number("top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    min_p = _number("min_p", min_p, lo=0.0, hi=1.0)
    if seed is not None:
        seed = _int("seed", seed)
    if temperature < GREEDY_BELOW:
        def greedy(logits: np.ndarray) -> int:
            return int(np.argmax(logits))
        return greedy

    rng = np.random.default_rng(seed)
    inv_t = 1.0 / temperature

    def sample(logits: np.ndarray) -> int:
        logits = np.asarray(logits).reshape(-1)
        v = logits.size
        # candidate ids (top_k) and their scaled logits, float64
        if 0 < top_k < v:
            ids = np.argpartition(logits, v - top_k)[v - top_k:]
            z = logits[ids].astype(np.float64)
        else:
            ids = None
            z = logits.astype(np.float64)
        z = (z - z.max()) * inv_t
        p = np.exp(z)
        p /= p.sum()
        if top_p < 1.0:
            p, ids = _top_p(p, ids, top_p)
        if min_p > 0.0:
            keep = np.flatnonzero(p >= min_p * p.max())
            p = p[keep]
            ids = keep if ids is None else ids[keep]
        c = np.cumsum(p)
        j = min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), c.size - 1)
        return int(j if ids is None else ids[j])

    return sample


def _top_p(p: np.ndarray, ids, top_p: float):
    """Keep the smallest most-probable set with mass >= top_p (at least one token).

    Sorting 150k probabilities costs more than a decode step's bookkeeping should, so sort only
    the tokens above a small threshold when they already carry the needed mass (exact: those are
    the top of the sorted order).
    """
    cand = np.flatnonzero(p >= p.max() * 1e-6)
    if p[cand].sum() < top_p:
        cand = np.arange(p.size)
    order = cand[np.argsort(-p[cand], kind="stable")]
    c = np.cumsum(p[order])
    n = min(int(np.searchsorted(c, top_p * c[-1] if top_p >= 1.0 else top_p, side="left")) + 1, order.size)
    keep = order[:n]
    return p[keep], (keep if ids is None else ids[keep])


def make_repetition_penalty(penalty: float, context_size: int = 64):
    """HF semantics on the last context_size tokens: positive logits / penalty, negative * penalty."""
    penalty = _number("repetition_penalty", penalty, lo=0.0, lo_open=True)
    context_size = _int("repetition_context_size", context_size, lo=1)

    def processor(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
        if len(tokens) == 0:
            return logits
        ids = np.unique(np.asarray(tokens[-context_size:], dtype=np.int64))
        sel = logits[ids]
        logits[ids] = np.where(sel > 0, sel / penalty, sel * penalty)
        return logits

    return processor


def make_presence_frequency_penalty(presence: float = 0.0, frequency: float = 0.0, start: int = 0):
    """OpenAI's additive penalties over the generated tokens (tokens[start:], the prompt excluded,
    as OpenAI and vLLM do): logit[j] -= frequency * count[j] + presence * (count[j] > 0)."""
    presence = _number("presence_penalty", presence, lo=-2.0, hi=2.0)
    frequency = _number("frequency_penalty", frequency, lo=-2.0, hi=2.0)
    start = _int("start", start)

    def processor(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
        out = np.asarray(tokens[start:], dtype=np.int64)
        if out.size == 0:
            return logits
        ids, counts = np.unique(out, return_counts=True)
        logits[ids] -= (frequency * counts + presence).astype(logits.dtype)
        return logits

    return processor


def make_logit_bias(bias: dict, vocab_size: int):
    """OpenAI's logit_bias: {token id: value in [-100, 100]} added to the logits (before the
    temperature); -100 bans a token, +100 all but forces it."""
    from mixqrt.errors import RequestError

    if not isinstance(bias, dict):
        raise RequestError("logit_bias", f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    ids = np.empty(len(bias), dtype=np.int64)
    vals = np.empty(len(bias), dtype=np.float64)
    for i, (t, b) in enumerate(bias.items()):
        if isinstance(t, str) and t.isascii() and t.isdigit():
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise RequestError("logit_bias", f"logit_bias: token id {t!r} is not in [0, {vocab_size})")
        try:
            vals[i] = _number("logit_bias", b, lo=-100.0, hi=100.0)
        except GenerationError as e:
            raise RequestError("logit_bias", str(e)) from None
        ids[i] = int(t)

    def processor(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
        np.add.at(logits, ids, vals.astype(logits.dtype))
        return logits

    return processor


def make_logits_processors(repetition_penalty: float | None = None, repetition_context_size: int = 64, *,
                           presence_penalty: float = 0.0, frequency_penalty: float = 0.0, prompt_tokens: int = 0,
                           logit_bias: dict | None = None, vocab_size: int | None = None) -> list:
    """-> list of processor(tokens_so_far, logits [vocab]) -> logits (may edit logits in place).

    In this order: the multiplicative repetition penalty (over the last repetition_context_size
    tokens, prompt included, as transformers), OpenAI's presence/frequency penalties (over the
    generated tokens: those after prompt_tokens), logit_bias."""
    procs = []
    if repetition_penalty is not None:
        p = make_repetition_penalty(repetition_penalty, repetition_context_size)
        if float(repetition_penalty) != 1.0:
            procs.append(p)
    else:
        _int("repetition_context_size", repetition_context_size, lo=1)
    p = make_presence_frequency_penalty(presence_penalty or 0.0, frequency_penalty or 0.0, prompt_tokens)
    if presence_penalty or frequency_penalty:
        procs.append(p)
    if logit_bias:
        if vocab_size is None:
            raise GenerationError("logit_bias needs the vocabulary size")
        procs.append(make_logit_bias(logit_bias, vocab_size))
    return procs


LOGPROB_FLOOR = -9999.0     # OpenAI's value for "impossible": a masked (-inf) logit reports this


def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, list]:
    """The model's log-probability of `token` under `logits` (a log-softmax in float64, before any
    processor or the temperature) and the `top` most likely (token, logprob) pairs, best first.
    Never below LOGPROB_FLOOR (JSON has no -inf)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())

    def lp(i) -> float:
        v = float(x[i] - lse)
        return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR      # also NaN -> the floor

    pairs = []
    if top > 0:
        k = min(int(top), x.size)
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.lexsort((ids, -x[ids]))]          # most likely first, ties by id
        pairs = [(int(i), lp(i)) for i in ids]
    return lp(int(token)), pairs

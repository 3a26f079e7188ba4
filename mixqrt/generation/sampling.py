"""Samplers and logits processors (mlx-lm's shape: plain callables built by make_*)."""
from __future__ import annotations


import numpy as np

from mixqrt.errors import RequestError
from mixqrt.generation.validate import integer, number, show


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
    temperature = number("temperature", temperature, lo=0.0)
    top_k = integer("top_k", top_k)
    top_p = number("top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
    min_p = number("min_p", min_p, lo=0.0, hi=1.0)
    if seed is not None:
        seed = integer("seed", seed)
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
    penalty = number("repetition_penalty", penalty, lo=0.0, lo_open=True)
    context_size = integer("repetition_context_size", context_size, lo=1)

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
    presence = number("presence_penalty", presence, lo=-2.0, hi=2.0)
    frequency = number("frequency_penalty", frequency, lo=-2.0, hi=2.0)
    start = integer("start", start)

    def processor(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
        out = np.asarray(tokens[start:], dtype=np.int64)
        if out.size == 0:
            return logits
        ids, counts = np.unique(out, return_counts=True)
        logits[ids] -= (frequency * counts + presence).astype(logits.dtype)
        return logits

    return processor


MAX_LOGIT_BIAS = 300                # entries (OpenAI accepts 300)


def check_logit_bias(name, v) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (int or its decimal string): bias in [-100, 100]} -> {int: float},
    at most MAX_LOGIT_BIAS entries; the ids are checked against the vocabulary by make_logit_bias."""
    if not isinstance(v, dict):
        raise RequestError(name, f"{name} must be an object {{token id: bias}}, got {show(v)}")
    if len(v) > MAX_LOGIT_BIAS:
        raise RequestError(name, f"{name} has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, b in v.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
            t = int(k)
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k < 1 << 32:
            t = int(k)
        else:
            raise RequestError(name, f"{name} keys must be token ids, got {show(k)}")
        out[t] = number(name, b, lo=-100.0, hi=100.0)
    return out or None


def make_logit_bias(bias: dict, vocab_size: int):
    """OpenAI's logit_bias (check_logit_bias): {token id: value in [-100, 100]} added to the logits
    (before the temperature); -100 bans a token, +100 all but forces it."""
    bias = check_logit_bias("logit_bias", bias) or {}
    for t in bias:
        if not t < vocab_size:
            raise RequestError("logit_bias", f"logit_bias: token id {t!r} is not in [0, {vocab_size})")
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def processor(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
        np.add.at(logits, ids, vals.astype(logits.dtype))
        return logits

    return processor


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

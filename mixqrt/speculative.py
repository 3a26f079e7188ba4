"""Speculative decoding: draft a few tokens cheaply, verify them in one forward of the target.

A decode step reads every weight once to produce one token; a forward of k+1 rows of one
sequence reads them once too and costs little more (the few-row kernels, docs/kernels.md), so
when the drafts are right the target emits up to k+1 tokens per pass over its weights.

Drafters (each proposes up to k next tokens for a sequence's history):
  - NgramDrafter ("prompt lookup"): the tokens that followed the latest earlier occurrence of the
    history's last n tokens (n from max_ngram down to min_ngram). No extra model; it pays where
    the answer repeats its input (editing code, refactoring, extraction).
  - ModelDrafter: a smaller model with the same tokenizer drafts greedily, one token per step on
    its own KV cache (kept per sequence and rolled back with the target's).

Verification (Engine._step_speculative) feeds [last token, d1..dk] at the sequence's next
positions, then walks the k+1 logit rows: row i is sampled by the sequence's own sampler exactly
as plain decoding would (processors, temperature, its seeded RNG); while the sampled token equals
draft i the next row is valid and the walk goes on, the first mismatch is emitted as the
correction and the rest is dropped (KVCache.trim). Every emitted token is therefore drawn from
the target's distribution given the true prefix: the output distribution is unchanged at any
temperature, and at temperature 0 (or with a seed) the tokens are those of plain decoding as long
as the k+1-row forward gives the same logits as k+1 single steps (true for float weights; packed
formats fold their sums in another order in few-row products, docs/speculative.md). With a
deterministic draft (one-hot q) this walk is the speculative-sampling acceptance rule of Leviathan
et al. and Chen et al.: accept d with probability p(d), else draw from p without d.

k adapts per sequence: it follows the measured acceptance (an exponential average), and drafting
stops when it does not pay or when other sequences share the step (the Engine speculates only for
a lone decoding sequence: a batched step already reads the weights once for several tokens).
"""
from __future__ import annotations

import numpy as np

from mixqrt.errors import GenerationError, ModelError
from mixqrt.sample_utils import _int

MAX_DRAFT = 16            # a request or a setting asking for more drafts per step is capped here


class NgramDrafter:
    """Prompt lookup: propose the continuation of the latest earlier match of the history's tail.

    Matches are searched from max_ngram down to min_ngram tokens; the latest occurrence wins (it
    is the one the text is most likely repeating now). Only the last `window` tokens are searched,
    so one proposal costs O(window * n) whatever the context length.
    """

    kind = "lookup"

    def __init__(self, k: int = 8, *, max_ngram: int = 3, min_ngram: int = 1, window: int = 8192):
        self.k = min(_int("lookup", k, lo=1), MAX_DRAFT)
        self.max_ngram = _int("max_ngram", max_ngram, lo=1)
        self.min_ngram = min(_int("min_ngram", min_ngram, lo=1), self.max_ngram)
        self.window = _int("window", window, lo=2)

    def new_state(self, max_len: int):
        return None

    def propose(self, state, history: np.ndarray, k: int) -> list[int]:
        h = np.asarray(history[-self.window:], dtype=np.int64)
        n_all = h.size
        for n in range(min(self.max_ngram, n_all - 1), self.min_ngram - 1, -1):
            tail = h[n_all - n:]
            # windows start at 0 .. n_all-n-1: an occurrence that ends before the tail itself
            win = np.lib.stride_tricks.sliding_window_view(h[:n_all - 1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in h[start:start + k]]
        return []

    def rollback(self, state, valid: int) -> None:
        pass


class _DraftState:
    __slots__ = ("cache", "fed")

    def __init__(self, cache):
        self.cache = cache
        self.fed: list[int] = []          # the tokens whose K/V the draft cache holds, in order


class ModelDrafter:
    """A smaller model of the same vocabulary and tokenizer drafts greedily (argmax), one token
    per step. Its KV cache per sequence is caught up with the target's history before drafting
    and trimmed to the common prefix after each verification."""

    kind = "draft"

    def __init__(self, model, k: int = 4, *, tokenizer=None, target=None, target_tokenizer=None):
        self.model = model
        self.k = min(_int("draft_k", k, lo=1), MAX_DRAFT)
        if target is not None:
            check_compatible(model, tokenizer, target, target_tokenizer)

    def new_state(self, max_len: int) -> _DraftState:
        return _DraftState(self.model.make_cache(max_len))

    def propose(self, state: _DraftState, history: np.ndarray, k: int) -> list[int]:
        hist = [int(t) for t in history]
        m = self._common(state, hist)
        self.rollback(state, m)
        room = state.cache.max_len - len(hist)
        k = min(k, room)
        if k <= 0:
            return []
        feed = hist[m:]
        logits = self.model(np.asarray(feed, dtype=np.int64), state.cache, last_only=True)
        state.fed.extend(feed)
        out = [int(np.argmax(logits))]
        while len(out) < k:
            logits = self.model(np.asarray(out[-1:], dtype=np.int64), state.cache, last_only=True)
            state.fed.append(out[-1])
            out.append(int(np.argmax(logits)))
        return out

    @staticmethod
    def _common(state: _DraftState, hist: list[int]) -> int:
        n = min(len(state.fed), len(hist) - 1)       # keep at least the last token to feed
        i = 0
        while i < n and state.fed[i] == hist[i]:
            i += 1
        return i

    def rollback(self, state: _DraftState, valid: int) -> None:
        drop = len(state.fed) - valid
        if drop > 0:
            state.cache.trim(drop)
            del state.fed[valid:]


def check_compatible(draft, draft_tokenizer, target, target_tokenizer) -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's: its token ids would
    mean other text, and every draft would be rejected (or, worse, accepted by accident)."""
    dv, tv = draft.args.vocab_size, target.args.vocab_size
    if dv != tv:
        raise ModelError(f"the draft model's vocabulary has {dv} tokens, the target's {tv}: "
                         "a draft must share the target's tokenizer")
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise ModelError("the draft model and the target must both have a tokenizer, or neither")
    if draft_tokenizer is not None and _vocab_fingerprint(draft_tokenizer) != _vocab_fingerprint(target_tokenizer):
        raise ModelError("the draft model's tokenizer differs from the target's (same vocabulary size, "
                         "other tokens): a draft must share the target's tokenizer")


def _vocab_fingerprint(tok) -> int:
    import hashlib
    get = getattr(getattr(tok, "backend", tok), "get_vocab", None)    # mixqrt.tokenizer.Tokenizer
    if get is None:
        raise ModelError(f"cannot read the vocabulary of tokenizer {type(tok).__name__} to compare it")
    items = sorted((str(k), int(v)) for k, v in get().items())
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:8], "little")


class Speculation:
    """Per-sequence speculation state: the drafter's state, the adaptive k and the counters."""

    __slots__ = ("drafter", "state", "k", "k_max", "ema", "drafted", "accepted", "steps", "idle")

    def __init__(self, drafter, max_len: int, k: int | None = None):
        self.drafter = drafter
        self.state = drafter.new_state(max_len)
        self.k_max = min(drafter.k if k is None else _int("k", k, lo=0), MAX_DRAFT)
        self.k = self.k_max
        self.ema = 0.5                 # acceptance rate, exponential average over verifications
        self.drafted = self.accepted = self.steps = 0
        self.idle = 0                  # plain steps since drafting was turned off (a probe re-tries)

    def next_k(self) -> int:
        """Drafts to ask for this step: k_max while drafts are mostly accepted, fewer as the
        acceptance falls, 0 when it is too low to pay (a probe every 16 steps looks again)."""
        if self.k_max == 0:
            return 0
        if self.ema < 0.15 and self.drafter.kind == "draft":
            self.idle += 1
            if self.idle % 16:
                return 0
        return max(1, min(self.k_max, int(round(self.k_max * min(1.0, self.ema * 1.5)))))

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.ema = 0.7 * self.ema + 0.3 * (accepted / drafted)
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1
            if self.ema >= 0.15:
                self.idle = 0


def make_drafter(lookup: int | None = None, draft=None, draft_k: int = 4, *, target=None,
                 target_tokenizer=None):
    """The drafter a Pipeline or Engine was asked for: prompt lookup (lookup = k drafts) or a draft
    model (a LoadedModel / Pipeline / Model with .model and .tokenizer, draft_k drafts). Both at
    once is refused: one drafter per engine."""
    if lookup is not None and draft is not None:
        raise GenerationError("choose prompt lookup or a draft model, not both")
    if lookup is not None:
        return NgramDrafter(lookup) if lookup else None
    if draft is None:
        return None
    dm = getattr(draft, "model", draft)
    dt = getattr(draft, "tokenizer", None)
    return ModelDrafter(dm, draft_k, tokenizer=dt, target=target, target_tokenizer=target_tokenizer)


def add_speculative_arguments(p) -> None:
    """--lookup / --draft / --draft-recipe / --draft-k on an argparse parser (generate, chat, serve)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--lookup", type=int, default=None, metavar="K",
                   help="prompt-lookup decoding: draft up to K tokens per step from n-grams of the prompt "
                        "and the output so far (no extra model; docs/speculative.md)")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="speculative decoding with a smaller model of the same tokenizer (any MODEL form)")
    p.add_argument("--draft-recipe", default=None, help="recipe for a --draft model that is not a .mxq")
    p.add_argument("--draft-k", type=int, default=4, metavar="K", help="tokens a --draft model drafts per step")


def speculative_kwargs(a) -> dict:
    """Pipeline keyword arguments from those options ({} when neither --lookup nor --draft)."""
    if getattr(a, "lookup", None) is None and getattr(a, "draft", None) is None:
        return {}
    return {"lookup": a.lookup, "draft": a.draft, "draft_recipe": a.draft_recipe, "draft_k": a.draft_k}

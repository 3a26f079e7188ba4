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

k adapts per sequence: the k that maximises expected tokens per unit of forward cost at the
measured acceptance (ROW_COST); drafting stops when no k beats a plain step (a probe now and then
looks again) or when other sequences share the step (the Engine speculates only for a lone
decoding sequence: a batched step already reads the weights once for several tokens).
"""
from __future__ import annotations

import numpy as np

from mixqrt.errors import GenerationError, ModelError
from mixqrt.validate import integer

MAX_DRAFT = 16            # a request or a setting asking for more drafts per step is capped here


class NgramDrafter:
    """Prompt lookup: propose the continuation of the latest earlier match of the history's tail.

    Matches are searched from max_ngram down to min_ngram tokens; the latest occurrence wins (it
    is the one the text is most likely repeating now). Only the last `window` tokens are searched,
    so one proposal costs O(window * n) whatever the context length.
    """

    kind = "lookup"

    def __init__(self, k: int = 8, *, max_ngram: int = 3, min_ngram: int = 1, window: int = 8192):
        self.k = min(integer("lookup", k, lo=1), MAX_DRAFT)
        self.max_ngram = integer("max_ngram", max_ngram, lo=1)
        self.min_ngram = min(integer("min_ngram", min_ngram, lo=1), self.max_ngram)
        self.window = integer("window", window, lo=2)

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
        self.k = min(integer("draft_k", k, lo=1), MAX_DRAFT)
        if target is not None:
            check_compatible(model, tokenizer, target, target_tokenizer)

    def new_state(self, max_len: int) -> _DraftState:
        return _DraftState(self.model.make_cache(max_len))

    def prime(self, state: _DraftState, history) -> None:
        """Run the draft over a prompt with the target's prefill (all but its last token, which the
        first propose feeds): its prefill is paid in the time to first token, not by the first
        drafting step."""
        hist = [int(t) for t in history]
        m = self._common(state, hist)
        self.rollback(state, m)
        feed = hist[m:len(hist) - 1]
        if feed and len(hist) <= state.cache.max_len:
            self.model(np.asarray(feed, dtype=np.int64), state.cache, last_only=True)
            state.fed.extend(feed)

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
            dropped = state.cache.trim(drop)     # a packed cache may drop more, down to a block start
            del state.fed[len(state.fed) - dropped:]


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


# Cost of a forward of T rows of one sequence relative to one row, T = 1..9 (the few-row kernels on
# the 0.5B 2356t file at 2 threads, benchmarks/decode_batch.py, 2026-12-05 after the fold work
# (docs/kernels.md): 2 / 4 / 6 / 8 rows cost 1.16 / 1.38 / 1.63 / 1.95 steps; the rest interpolated).
# k is chosen to maximise expected tokens per unit of cost.
ROW_COST = (1.0, 1.16, 1.27, 1.38, 1.5, 1.63, 1.79, 1.95, 2.1)


def row_cost(t: int) -> float:
    return ROW_COST[t - 1] if t <= len(ROW_COST) else ROW_COST[-1] + 0.16 * (t - len(ROW_COST))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits with k drafts, each accepted with probability alpha (given the
    ones before it were): 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Speculation:
    """Per-sequence speculation state: the drafter's state, the adaptive k and the counters."""

    __slots__ = ("drafter", "state", "k_max", "alpha", "drafted", "accepted", "steps", "idle", "draft_cost")

    PROBE_EVERY = 16        # plain steps between probes once drafting stopped paying

    def __init__(self, drafter, max_len: int, k: int | None = None):
        self.drafter = drafter
        self.state = drafter.new_state(max_len)
        self.k_max = min(drafter.k if k is None else integer("k", k, lo=0), MAX_DRAFT)
        self.alpha = 0.6               # per-draft acceptance probability, exponential average
        self.drafted = self.accepted = self.steps = 0
        self.idle = 0                  # plain steps since drafting stopped paying
        # a drafted token's cost in target steps: 0 for prompt lookup; for a draft model a prior
        # (a 2356t draft of an f16 target measured 0.22), then the measured ratio (record_times)
        self.draft_cost = 0.25 if drafter.kind == "draft" else 0.0

    def next_k(self) -> int:
        """Drafts to ask for this step: the k that maximises expected tokens per unit of forward
        cost at the measured acceptance (a draft model's own steps count as cost too); 0 when no k
        beats a plain step, except for a probe every PROBE_EVERY steps."""
        if self.k_max == 0:
            return 0
        draft_cost = self.draft_cost
        best, best_k = 1.0, 0
        for k in range(1, self.k_max + 1):
            v = expected_tokens(self.alpha, k) / (row_cost(k + 1) + draft_cost * k)
            if v > best * 1.02:
                best, best_k = v, k
        if best_k == 0:
            self.idle += 1       # a probe: one draft, the cheapest verify that can lift the estimate
            return min(self.k_max, 1) if self.idle % self.PROBE_EVERY == 0 else 0
        self.idle = 0
        return best_k

    def record_times(self, drafted: int, draft_s: float, rows: int, verify_s: float) -> None:
        """A draft model's measured cost: seconds per drafted token over the seconds of one target
        step (the verify's time over its row cost), averaged like the acceptance."""
        if self.drafter.kind != "draft" or drafted <= 0 or verify_s <= 0:
            return
        step = verify_s / row_cost(rows)
        self.draft_cost = 0.7 * self.draft_cost + 0.3 * (draft_s / drafted) / step

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            # per-draft acceptance: j accepted, then one rejection unless all k were accepted
            est = accepted / (accepted + (1 if accepted < drafted else 0)) if accepted < drafted else 1.0
            self.alpha = 0.7 * self.alpha + 0.3 * est
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1


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

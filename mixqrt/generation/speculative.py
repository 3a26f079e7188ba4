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
from mixqrt.generation.validate import integer

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


LONG_DRAFT = 64          # drafts one verify may carry while a copy runs long (CopyDrafter)
MAX_SOURCE = 65536       # tokens of an explicit source (a request's `prediction`) the drafter keeps
MAX_SUB = 16             # tokens on either side of a substitution the copy drafter learns


class _CopyState:
    """Where a CopyDrafter's copy stands for one sequence. The corpus it copies from is the explicit
    source, a separator (-1), then the sequence's history (prompt and output); positions index it."""

    __slots__ = ("source", "pos", "pending", "seen", "run", "subs", "blocked", "edit", "cand", "proposed")

    def __init__(self, source=None):
        src = np.asarray([] if source is None else source, dtype=np.int64).reshape(-1)
        self.source = src[:MAX_SOURCE]
        self.pos = -1            # corpus index of the next token the copy expects (-1: not aligned)
        self.pending = ()        # tokens of a substitution still to come before the copy goes on at pos
        self.seen = 0            # history length the alignment accounts for
        self.run = 0             # tokens the copy has predicted in a row (its confidence)
        self.subs: dict[int, list] = {}     # learned substitutions, X[0] -> [(X, Y), ...], longest X first
        self.blocked: set = set()           # corpus positions where a substitution was refused
        self.edit = None         # (corpus index, history index) where the latest divergence began
        self.cand = None         # a substitution (X, Y) seen at the last re-anchoring, learned once confirmed
        self.proposed = 0        # drafts of the last proposal


class CopyDrafter(NgramDrafter):
    """Prompt lookup that follows the text it copies through an edit ("fast apply").

    It keeps an alignment between the output and the text being copied (an explicit source first,
    given per request: `prediction`; then the prompt and the output so far) and drafts the tokens
    that follow it, up to `long_k` when the copy has run long (Speculation.length picks how many).
    When the output departs from the copy (an edit), it re-anchors on the next matching context:
    every position whose preceding tokens match the output's tail, the longest match first, near
    the edit before far away; when nothing matches yet it guesses the edit replaced as many tokens
    as it wrote (skipping the edited token). Once the copy resumes after an edit, the replacement
    (X -> Y, up to MAX_SUB tokens each) is learned, and later occurrences of X draft Y; a
    substitution the model refuses at some position is not drafted there again. The drafts only
    decide which rows get verified: the output stays the model's own.
    """

    SETTLED = 4     # tokens the copy must follow after an edit before a departure counts as a new edit

    def __init__(self, k: int = 8, *, long_k: int = LONG_DRAFT, max_match: int = 16, near: int = 64,
                 window: int = 8192):
        super().__init__(k, max_ngram=max_match, min_ngram=1, window=window)
        self.long_k = max(self.k, min(integer("long_k", long_k, lo=1), LONG_DRAFT))
        self.near = integer("near", near, lo=0)

    def new_state(self, max_len: int, source=None) -> _CopyState:
        return _CopyState(source)

    def propose(self, state, history: np.ndarray, k: int) -> list[int]:
        if state is None:
            state = self.new_state(0)
        h = np.asarray(history, dtype=np.int64).reshape(-1)
        src = state.source
        off = src.size + 1 if src.size else 0
        corpus = np.concatenate([src, [-1], h]) if src.size else h
        self._advance(state, corpus, off, h.size)
        if state.pos < 0:
            self._anchor(state, corpus, off, h.size)
        out: list[int] = []
        if state.pos >= 0 and k > 0:
            self._walk(state, corpus, state.pos, state.pending, k, out=out)
        state.proposed = len(out)
        return out

    # ------------------------------------------------------------------ the copy
    def _sub_at(self, state: _CopyState, corpus: np.ndarray, pos: int):
        for x, y in state.subs.get(int(corpus[pos]), ()):
            if pos not in state.blocked and pos + len(x) <= corpus.size and \
                    tuple(int(t) for t in corpus[pos:pos + len(x)]) == x:
                return x, y
        return None

    def _walk(self, state, corpus, pos, pending, limit, out=None, match=None):
        """The copy from (pos, pending): append up to `limit` tokens to `out`, or follow `match` while it
        agrees. -> (tokens walked, pos, pending, the corpus position of a substitution whose first
        token disagreed with `match`, else -1)."""
        n = 0
        end = corpus.size
        while n < limit:
            sub_pos = -1
            if pending:
                tok, nxt = pending[0], (pos, pending[1:])
            else:
                if pos >= end or corpus[pos] < 0:
                    break
                sub = self._sub_at(state, corpus, pos) if state.subs else None
                if sub is not None:
                    tok, nxt, sub_pos = sub[1][0], (pos + len(sub[0]), sub[1][1:]), pos
                else:
                    tok, nxt = int(corpus[pos]), (pos + 1, ())
            if match is not None and int(match[n]) != tok:
                return n, pos, pending, sub_pos
            if out is not None:
                out.append(tok)
            n += 1
            pos, pending = nxt
        return n, pos, pending, -1

    def _advance(self, state: _CopyState, corpus: np.ndarray, off: int, hist: int) -> None:
        """Follow the tokens emitted since the last proposal along the copy; a departure is an edit."""
        if hist < state.seen:                       # another history: start over
            state.pos, state.pending, state.edit, state.run = -1, (), None, 0
        new = corpus[off + state.seen:off + hist] if state.pos >= 0 else ()
        state.seen = hist
        if state.pos < 0 or len(new) == 0:
            return
        pos, pending, done = state.pos, state.pending, 0
        while True:
            n, pos, pending, sub_pos = self._walk(state, corpus, pos, pending, len(new) - done,
                                                  match=new[done:])
            done += n
            if done == len(new):
                break
            if sub_pos >= 0 and int(new[done]) == int(corpus[sub_pos]):
                state.blocked.add(sub_pos)          # the model kept X here: copy it plainly
                continue
            if state.edit is None or state.run + done >= self.SETTLED:
                state.edit = (pos, off + hist - len(new) + done)   # (copy's corpus index, the edit's)
            # else the copy had not settled since the last edit: that edit's place still counts
            state.pos, state.pending, state.run, state.cand = -1, (), 0, None
            return
        if state.cand is not None and done > 0:
            self._learn(state, *state.cand)
        state.cand = None
        state.pos, state.pending = pos, pending
        state.run += done

    def _learn(self, state: _CopyState, x: tuple, y: tuple) -> None:
        subs = [(a, b) for a, b in state.subs.get(x[0], ()) if a != x] + [(x, y)]
        state.subs[x[0]] = sorted(subs, key=lambda s: -len(s[0]))

    def _anchor(self, state: _CopyState, corpus: np.ndarray, off: int, hist: int) -> None:
        """Find where the copy goes on: the candidate positions whose preceding tokens match the
        output's tail (longest match first; near the last edit first, then the source, then the
        latest); a guess past the edited tokens when nothing near it matches yet."""
        end = corpus.size
        if hist < 1 or end < 2:
            return
        q, n = self._matches(corpus, min(self.max_ngram, hist), off)
        edit = state.edit
        if edit is not None:
            a, e = edit
            since = end - e                          # tokens written since the departure
            local = (q >= a - 2) & (q <= a + self.near + since)
            keep = local | (n >= 3)                 # far away, only a longer match beats a guess
            q, n, local = q[keep], n[keep], local[keep]
            if q.size:
                score = np.minimum(n, 8) + 3 * local
                best = score.max()
                pick = q[score == best]
                if local[score == best].any():
                    i = int(pick[np.argmin(np.abs(pick - (a + since)))])
                else:
                    i = self._prefer(pick, off)
                m = int(n[q == i][0])
                j = min(m, since)                   # matched tokens written after the departure
                if a <= i - j and 0 < i - j - a <= MAX_SUB and 0 < since - j <= MAX_SUB:
                    x = tuple(int(t) for t in corpus[a:i - j])
                    y = tuple(int(t) for t in corpus[e:end - j])
                    state.cand = (x, y) if x != y else None
                state.pos, state.pending = i, ()
                return
            g = a + since                            # as many tokens replaced as written
            if since <= MAX_SUB and g < e and corpus[g] >= 0:
                x = tuple(int(t) for t in corpus[a:g])
                y = tuple(int(t) for t in corpus[e:end])
                state.cand = (x, y) if x != y else None
                state.pos, state.pending = g, ()
            return
        if q.size:
            pick = q[np.minimum(n, 8) == min(int(n.max()), 8)]
            state.pos, state.pending = self._prefer(pick, off), ()

    @staticmethod
    def _prefer(pick: np.ndarray, off: int) -> int:
        """Of equally good candidates: the first in the explicit source, else the latest."""
        in_src = pick[pick < off]
        return int(in_src[0]) if in_src.size else int(pick[-1])

    def _matches(self, corpus: np.ndarray, n_max: int, off: int):
        """Positions q (corpus[q] the next token to copy) whose preceding tokens match the corpus's
        tail, searched over the source and the last `window` tokens, and each one's match length
        (at most n_max)."""
        end = corpus.size
        lo = max(1, end - self.window) if not off else 1
        q = lo + np.flatnonzero(corpus[lo - 1:end - 1] == corpus[end - 1])
        if off and end - self.window > off:          # the history's part beyond the window
            q = q[(q <= off) | (q >= end - self.window)]
        n = np.ones(q.size, dtype=np.int64)
        alive = np.ones(q.size, dtype=bool)
        for j in range(2, n_max + 1):
            idx = q - j
            ok = alive & (idx >= 0)
            ok[ok] = corpus[idx[ok]] == corpus[end - j]
            if not ok.any():
                break
            n[ok] = j
            alive = ok
        return q, n


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


MAX_PREDICTION_CHARS = 4 * MAX_SOURCE     # the longest prediction text a request may send


def prediction_text(prediction) -> str | list | None:
    """A request's `prediction` in OpenAI's chat shape ({"type": "content", "content": str or a list
    of {"type": "text", "text": str}}), a bare string or token ids -> the text (or the ids); None
    stays None. A malformed one raises RequestError("prediction")."""
    from mixqrt.errors import RequestError
    if prediction is None:
        return None
    if isinstance(prediction, dict):
        if prediction.get("type", "content") != "content" or set(prediction) - {"type", "content"}:
            raise RequestError("prediction", 'prediction must be {"type": "content", "content": ...}')
        prediction = prediction.get("content")
        if isinstance(prediction, list):
            parts = []
            for p in prediction[:MAX_SOURCE]:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise RequestError("prediction", 'prediction.content parts must be {"type": "text", "text": str}')
                parts.append(p["text"])
            prediction = "".join(parts)
        if not isinstance(prediction, str):
            raise RequestError("prediction", "prediction.content must be a string or a list of text parts")
    if isinstance(prediction, str):
        if len(prediction) > MAX_PREDICTION_CHARS:
            raise RequestError("prediction", f"prediction has {len(prediction)} characters, at most "
                                             f"{MAX_PREDICTION_CHARS} are allowed")
        return prediction
    if isinstance(prediction, (list, tuple, np.ndarray)):
        return list(prediction)
    raise RequestError("prediction", f"prediction must be text or token ids, got {type(prediction).__name__}")


def prediction_ids(prediction, tokenizer, vocab_size: int) -> list[int] | None:
    """A request's prediction (prediction_text's shapes) -> token ids for the copy drafter (text
    encoded without a template, special-token text as plain text); None when absent or empty."""
    from mixqrt.errors import RequestError
    got = prediction_text(prediction)
    if got is None:
        return None
    if isinstance(got, str):
        if tokenizer is None:
            raise RequestError("prediction", "a text prediction needs a model with a tokenizer")
        got = tokenizer.encode(got, parse_special=False) if got else []
    if len(got) > MAX_SOURCE:
        raise RequestError("prediction", f"prediction has {len(got)} tokens, at most {MAX_SOURCE} are allowed")
    ids = []
    for t in got:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab_size:
            raise RequestError("prediction", f"prediction token ids must be integers in [0, {vocab_size})")
        ids.append(int(t))
    return ids or None


_EXACT_ANY_T = {"q4x", "q6x", "q3x", "f32", "f16", "bf16"}   # every row of a T-row product the T = 1 row
_EXACT_T = 17            # the row formats' rows are exact up to this many on every tier (docs/kernels.md)


def exact_rows(model) -> int:
    """The most rows one verify forward may carry with every row's logits bit for bit a single
    step's: LONG_DRAFT + 1 when every matrix is interleaved or float, else 17 (the AVX-512 GEMM of
    the row formats folds in another order from 18 rows)."""
    try:
        ws = list(model.named_weights().values())
    except Exception:  # noqa: BLE001 — a model that cannot list its weights: the safe bound
        return _EXACT_T
    flat = []
    while ws:
        w = ws.pop()
        if isinstance(w, (list, tuple)):
            ws.extend(w)
        elif getattr(w, "ndim", 1) > 1 or hasattr(w, "fmt"):
            flat.append(w)
    ok = all(getattr(w, "fmt", "f32") in _EXACT_ANY_T for w in flat)
    return LONG_DRAFT + 1 if ok and not hasattr(model, "_moe") else _EXACT_T


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
    get = getattr(getattr(tok, "backend", tok), "get_vocab", None)    # mixqrt.generation.tokenizer.Tokenizer
    if get is None:
        raise ModelError(f"cannot read the vocabulary of tokenizer {type(tok).__name__} to compare it")
    items = sorted((str(k), int(v)) for k, v in get().items())
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:8], "little")


# Cost of a verify of T rows of one sequence relative to one decode step (the body on T rows and the
# logits of the first 8; benchmarks/verify_rows.py on the default q4a file of Qwen2.5-Coder-0.5B, 2
# threads, 2026-12-05, docs/speculative.md "Verify cost"): the few-row kernels up to 8 rows, and over
# L2 row blocks in groups of 2-8 rows up to 64 (_ops.set_few_max_t). Between the measured row counts
# the cost is interpolated. k is chosen to maximise expected tokens per unit of cost.
ROW_COST_AT = ((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.3), (9, 1.33), (16, 1.45), (24, 1.7), (32, 1.95),
               (48, 2.5), (64, 3.1), (65, 3.15))


def row_cost(t: int) -> float:
    pts = ROW_COST_AT
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    (t0, c0), (t1, c1) = pts[-2], pts[-1]
    return c1 + max(0.0, (c1 - c0) / (t1 - t0)) * (t - t1) if t1 > t0 else c1


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits with k drafts, each accepted with probability alpha (given the
    ones before it were): 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Speculation:
    """Per-sequence speculation state: the drafter's state, the adaptive k and the counters."""

    __slots__ = ("drafter", "state", "k_max", "k_long", "alpha", "drafted", "accepted", "steps", "idle",
                 "draft_cost")

    PROBE_EVERY = 16        # plain steps between probes once drafting stopped paying

    def __init__(self, drafter, max_len: int, k: int | None = None, source=None):
        self.drafter = drafter
        self.state = drafter.new_state(max_len) if source is None else drafter.new_state(max_len, source=source)
        self.k_max = min(drafter.k if k is None else integer("k", k, lo=0), MAX_DRAFT)
        # a copy drafter may run past k_max while its copy runs long (length() decides how far)
        self.k_long = max(self.k_max, getattr(drafter, "long_k", 0)) if hasattr(drafter, "long_k") else 0
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
        return max(best_k, self.k_long)       # a copy drafter: length() picks how many to verify

    def length(self, n: int) -> int:
        """How many of n proposed drafts to verify. A copy drafter's: the k <= n that maximises the
        expected tokens per unit of verify cost, each draft right with probability p: the copy's run
        of right predictions r as (r + 1) / (r + 2), at least min(alpha, 0.8) (a long-run average says
        little about the tokens right after an edit): short drafts (the few-row kernels)
        after an edit, up to k_long once the copy has run long. Other drafters: all n."""
        run = getattr(self.state, "run", None)
        if run is None or n <= 1:
            return n
        p = min(max(min(self.alpha, 0.8), (run + 1) / (run + 2)), 0.999)
        best, best_k = 0.0, 1
        for k in range(1, n + 1):
            v = expected_tokens(p, k) / row_cost(k + 1)
            if v > best * 1.0001:
                best, best_k = v, k
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
        return CopyDrafter(lookup) if lookup else None
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

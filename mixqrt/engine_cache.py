"""The engine's KV store: one preallocated KVCache per request, kept after it finishes as a prompt cache.

A finished (or cancelled) request leaves its cache behind with the tokens whose K/V it holds. A
new request takes the idle cache sharing the longest token prefix with its prompt and only
prefills the rest: a multi-turn chat re-prefills just the new turn. When the idle cache is a
whole prefix of the new prompt it is adopted (no copy, nothing lost); when the two diverge
inside it (two chats sharing a system prompt, or a regenerated answer), the shared rows are copied into a fresh cache so
the idle one stays reusable.

Memory: a cache is allocated for the whole context with np.zeros, so only the rows written
become resident. ``used_bytes`` counts each cache's high-water mark of written rows (busy and
idle); idle caches are evicted least recently used first while it exceeds ``capacity``. Busy
caches are never evicted (they are bounded by max_slots x context).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mixqrt.cache import KVCache


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class CacheEntry:
    __slots__ = ("kv", "tokens", "hwm")

    def __init__(self, kv: KVCache, tokens: np.ndarray, hwm: int):
        self.kv = kv             # L x [Hkv, max_len, Dh] K and V; rows [0, kv.offset) are valid
        self.tokens = tokens     # [kv.offset] int64: the tokens those rows were computed for (when idle)
        self.hwm = hwm           # rows ever written (resident pages)

    def rows(self) -> int:
        return max(self.hwm, self.kv.offset)


class PromptCache:
    def __init__(self, model, max_len: int, capacity: int):
        self.model, self.max_len, self.capacity = model, int(max_len), int(capacity)
        a = model.args
        self.dtype = np.dtype(getattr(model, "kv_dtype", np.float32))
        self.row_bytes = KVCache.bytes_needed(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 1, self.dtype)
        self.idle: OrderedDict[int, CacheEntry] = OrderedDict()    # least recently used first
        self.busy: dict[int, CacheEntry] = {}
        self.hits = self.misses = self.evictions = self.cached_tokens = 0

    def _new(self) -> CacheEntry:
        return CacheEntry(self.model.make_cache(self.max_len, self.dtype), np.empty(0, np.int64), 0)

    def acquire(self, prompt) -> tuple[CacheEntry, int]:
        """A cache for `prompt` (list of ints) -> (entry, n): rows [0, n) already hold the prompt's
        first n tokens (n <= len(prompt) - 1: the last token always runs, for its logits)."""
        p = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for e in self.idle.values():
            k = common_prefix(e.tokens, p)
            if k > n:
                best, n = e, k
        n = min(n, p.size - 1)
        if best is None or n <= 0:
            self.misses += 1
            entry, n = self._new(), 0
        else:
            self.hits += 1
            self.cached_tokens += n
            if best.tokens.size - n <= 1:         # a whole prefix (or all but the last token): adopt it
                del self.idle[id(best)]
                entry = best
            else:                                 # diverges inside: copy the shared rows, keep the original
                entry = self._copy(best, n)
                self.idle.move_to_end(id(best))
            entry.kv.offset = n
        entry.tokens = p[:n]
        self.busy[id(entry)] = entry
        return entry, n

    def _copy(self, src: CacheEntry, n: int) -> CacheEntry:
        """A new cache holding src's first n rows."""
        entry = self._new()
        for a, b in zip(src.kv.keys + src.kv.values, entry.kv.keys + entry.kv.values):
            b[:, :n] = a[:, :n]
        entry.hwm = n
        entry.kv.offset = n
        return entry

    def fork(self, src: CacheEntry, n: int) -> CacheEntry:
        """A busy copy of a busy cache's first n rows: the n choices of one request share its
        prompt's prefill this way."""
        entry = self._copy(src, n)
        entry.tokens = src.tokens[:n]
        self.busy[id(entry)] = entry
        return entry

    def release(self, entry: CacheEntry, tokens: np.ndarray) -> None:
        """A request is done with `entry`; tokens [kv.offset] are what its rows hold."""
        self.busy.pop(id(entry), None)
        entry.hwm = entry.rows()
        if self.capacity <= 0 or entry.kv.offset == 0:
            return
        entry.tokens = np.array(tokens[:entry.kv.offset], dtype=np.int64)
        self.idle[id(entry)] = entry
        self.evict()

    def discard(self, entry: CacheEntry) -> None:
        """Forget a cache whose rows cannot be trusted (its request failed mid-step)."""
        self.busy.pop(id(entry), None)
        self.idle.pop(id(entry), None)

    def used_bytes(self) -> int:
        return self.row_bytes * (sum(e.rows() for e in self.idle.values()) + sum(e.rows() for e in self.busy.values()))

    def evict(self) -> None:
        while self.idle and self.used_bytes() > self.capacity:
            self.idle.popitem(last=False)
            self.evictions += 1

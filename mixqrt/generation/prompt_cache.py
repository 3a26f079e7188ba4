"""The engine's prompt cache: a radix tree of token runs per cache salt, each node holding the
K/V rows of its run in one compact array.

A running request has its own KVCache (mixqrt.models.kv_cache: one lazily zeroed mmap for the whole
context). When it ends (finished or cancelled), the tokens whose K/V it holds are inserted into
the tree under the request's salt and only the rows the tree does not hold yet are copied out;
its KVCache is then freed. A new request walks the tree of its salt along its prompt and copies
the longest cached prefix into a fresh KVCache, so a multi-turn chat re-prefills just the new turn
and two chats sharing a system prompt share its rows. The last prompt token always runs (its
logits give the first new token), so at most len(prompt) - 1 tokens come from the cache.

Isolation: every salt has its own tree (``roots[salt]``). A lookup only ever walks the tree of its
own salt, so requests with different salts never see each other's tokens, neither through
``cached_tokens`` nor through the time to the first token. ``use=False`` (the API's
``cache_prompt: false``) neither reads nor writes the tree.

Cost: a lookup visits one node per token run of the prompt's cached prefix and compares each
run's tokens once: O(prompt length), whatever the number of cached nodes (``lookup_steps`` counts
the nodes visited). Eviction is least recently used by node and only ever removes leaves: a path
is touched from its leaf up to its root, so a parent is always more recent than its children and
the oldest node has none. Each step is O(1).

Memory: a node's rows are one C-contiguous array [2 * layers, kv_heads, rows, head_dim]
(ROW-exact, nothing rounded up to pages), and it is counted at its arrays' nbytes plus
NODE_OVERHEAD for the Python objects around them (SALT_OVERHEAD + the salt's length per salt
tree). Running requests' caches count what is really resident: the pages their written rows
touch (KVCache.resident_bytes, one page per layer, K/V and head at least). The total is kept
under ``capacity`` by evicting cached nodes; running caches are never evicted (they are bounded
by max_slots x context). Before this layout, an idle entry kept its whole-context mmap: a
3.5-row entry of the 0.5B model counted 86 KB and held 393 KB (96 regions x one 4 KiB page).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mixqrt.models.kv_cache import check_kv_type

# Bytes counted for each node besides its arrays' data: the node object, two ndarray headers,
# a children dict slot, an LRU entry (about 530 bytes traced by tracemalloc) and malloc's headers
# (tests/test_engine_cache.py checks the count against tracemalloc).
NODE_OVERHEAD = 640
SALT_OVERHEAD = 512


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class _Node:
    """A run of tokens and their K/V rows, below a parent whose tokens come before them."""
    __slots__ = ("tokens", "kv", "children", "parent")

    def __init__(self, tokens: np.ndarray, kv: np.ndarray, parent):
        self.tokens = tokens     # [n] int32
        self.kv = kv             # [2L, Hkv, n, Dh]: K of every layer, then V
        self.children = None     # {first token: _Node} or None (a leaf)
        self.parent = parent     # a _Node or the salt's _Root

    def nbytes(self) -> int:
        return self.tokens.nbytes + self.kv.nbytes + NODE_OVERHEAD


class _Root:
    __slots__ = ("salt", "children")

    def __init__(self, salt):
        self.salt = salt
        self.children: dict = {}

    def nbytes(self) -> int:
        return SALT_OVERHEAD + (len(self.salt) if isinstance(self.salt, str) else 0)


class PrefixTree:
    """Token runs and their K/V rows, one radix tree per salt, LRU-evicted by node.

    ``match(salt, tokens)`` -> (n, path) finds the longest cached prefix; ``copy_into(path, dst)``
    writes its rows; ``insert(salt, tokens, rows)`` adds what is new of a sequence whose K/V are
    ``rows`` ([2L, Hkv, >= len(tokens), Dh]); ``evict(limit)`` drops least recently used leaves
    until at most ``limit`` bytes are counted. Model-agnostic (tests drive it directly).
    """

    def __init__(self):
        self.roots: dict = {}
        self.lru: OrderedDict = OrderedDict()     # _Node -> None, least recently used first
        self.bytes = 0
        self.leaves = 0
        self.lookup_steps = 0                     # nodes visited by match() and insert(), in all
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.lru)

    # ------------------------------------------------------------------ lookup
    def match(self, salt, tokens: np.ndarray, limit: int | None = None) -> tuple[int, list]:
        """Longest cached prefix of `tokens` under `salt` (at most `limit` tokens) ->
        (n, [(node, rows used), ...]) from the root down; the path is marked recently used."""
        root = self.roots.get(salt)
        limit = tokens.size if limit is None else min(int(limit), tokens.size)
        path, i, node = [], 0, root
        while node is not None and node.children and i < limit:
            ch = node.children.get(int(tokens[i]))
            if ch is None:
                break
            self.lookup_steps += 1
            k = min(common_prefix(ch.tokens, tokens[i:limit]), limit - i)
            path.append((ch, k))
            i += k
            node = ch if k == ch.tokens.size else None
        self._touch(n for n, _ in path)
        return i, path

    @staticmethod
    def copy_into(path: list, dst: np.ndarray) -> int:
        """Write the rows of a match() path into dst [2L, Hkv, S, Dh] from row 0 -> rows written."""
        pos = 0
        for node, k in path:
            dst[:, :, pos:pos + k] = node.kv[:, :, :k]
            pos += k
        return pos

    # ------------------------------------------------------------------ insert
    def insert(self, salt, tokens: np.ndarray, rows: np.ndarray) -> int:
        """Store `tokens` (and rows[:, :, :len(tokens)]) under `salt`, sharing what is cached
        already -> the number of new rows stored."""
        m = int(tokens.size)
        if m == 0:
            return 0
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = _Root(salt)
            self.bytes += root.nbytes()
        node, i, path, new = root, 0, [], 0
        while i < m:
            ch = node.children.get(int(tokens[i])) if node.children else None
            if ch is None:
                leaf = _Node(np.array(tokens[i:m], dtype=np.int32), np.array(rows[:, :, i:m]), node)
                self._attach(node, leaf)
                path.append(leaf)
                new = m - i
                break
            self.lookup_steps += 1
            k = common_prefix(ch.tokens, tokens[i:m])
            if k < ch.tokens.size:
                if i + k == m:                      # a prefix of what is cached: nothing new
                    path.append(ch)
                    break
                ch = self._split(ch, k)
            path.append(ch)
            node, i = ch, i + k
        self._touch(path)
        return new

    def _attach(self, parent, leaf: _Node) -> None:
        if parent.children is None:
            parent.children = {}
        if parent.children or isinstance(parent, _Root):
            self.leaves += 1                         # else the parent was a leaf and is no more
        parent.children[int(leaf.tokens[0])] = leaf
        self.lru[leaf] = None
        self.bytes += leaf.nbytes()

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after its first k tokens -> the new parent holding them."""
        top = _Node(node.tokens[:k].copy(), np.ascontiguousarray(node.kv[:, :, :k]), node.parent)
        node.tokens = node.tokens[k:].copy()
        node.kv = np.ascontiguousarray(node.kv[:, :, k:])
        top.parent.children[int(top.tokens[0])] = top
        top.children = {int(node.tokens[0]): node}
        node.parent = top
        self.lru[top] = None
        self.bytes += NODE_OVERHEAD                  # the rows and tokens were moved, not added
        return top

    def _touch(self, nodes) -> None:
        """Mark a root-to-leaf path used: leaf first, so every parent stays newer than its children."""
        for node in reversed(list(nodes)):
            self.lru.move_to_end(node)

    # ------------------------------------------------------------------ evict
    def evict(self, limit: int) -> int:
        """Drop least recently used leaves while more than `limit` bytes are counted -> nodes dropped."""
        n = 0
        while self.bytes > limit and self.lru:
            node, _ = self.lru.popitem(last=False)
            assert not node.children, "LRU order broken: a parent older than its child"
            parent = node.parent
            del parent.children[int(node.tokens[0])]
            self.bytes -= node.nbytes()
            self.leaves -= 1
            if isinstance(parent, _Root):
                if not parent.children:
                    del self.roots[parent.salt]
                    self.bytes -= parent.nbytes()
            elif not parent.children:
                parent.children = None
                self.leaves += 1
            node.parent = None
            n += 1
        self.evictions += n
        return n

    def clear(self) -> None:
        self.evict(-1)


# ============================================================================ packed caches: whole blocks
BLOCK_OVERHEAD = 320     # bytes counted per cached block besides its data and tokens (node, key, LRU entry)


class _Block:
    __slots__ = ("key", "tokens", "data", "salt", "tail")

    def __init__(self, key: bytes, tokens: np.ndarray, data: np.ndarray, salt, tail=None):
        self.key, self.tokens, self.data, self.salt = key, tokens, data, salt
        self.tail = tail         # a partial last block: (the key of the chain it follows, the salt's repr)

    def nbytes(self) -> int:
        return self.tokens.nbytes + self.data.nbytes + BLOCK_OVERHEAD


def block_key(prev: bytes, salt, tokens: np.ndarray) -> bytes:
    """The chain hash of a block: its tokens, every token before it (through `prev`, the previous
    block's key) and the salt, as vLLM's automatic prefix caching keys its blocks."""
    import hashlib
    h = hashlib.blake2b(prev, digest_size=16)
    if not prev:
        h.update(repr(salt).encode("utf-8", "surrogatepass") + b"\0")
    h.update(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
    return h.digest()


class BlockTree:
    """Whole blocks of a packed KV cache (PackedKVCache.export_block: every layer's K and V of
    BLOCK positions), keyed by a chain hash of the salt and every token up to the block's end, LRU
    by block. A lookup follows the chain from the first block and stops at the first block not
    cached, then a kept partial block (f16 rows, with the whole block before it) that shares the
    most tokens with the rest. The same interface as PrefixTree for the
    PromptCache (match / copy_into / insert / evict, bytes, leaves, roots, lookup_steps, evictions)."""

    def __init__(self, block: int):
        self.block = int(block)
        self.blocks: OrderedDict = OrderedDict()      # key -> _Block, least recently used first
        self.roots: dict = {}                         # salt -> blocks cached under it
        self.tails: dict = {}                         # (chain key, salt) -> keys of partial last blocks
        self.bytes = 0
        self.lookup_steps = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def leaves(self) -> int:
        return len(self.blocks)

    def _chain(self, salt, tokens: np.ndarray, n_blocks: int):
        key, b = b"", self.block
        for i in range(n_blocks):
            key = block_key(key, salt, tokens[i * b:(i + 1) * b])
            yield i, key

    TAILS_PER_CHAIN = 4    # partial last blocks kept after one chain of whole blocks

    def match(self, salt, tokens: np.ndarray, limit: int | None = None) -> tuple[int, list]:
        """Cached whole blocks at the start of `tokens` (at most `limit` tokens), then the partial
        block after them that shares the most tokens with the rest -> (tokens, [_Block, ...,
        (tail, rows)])."""
        limit = tokens.size if limit is None else min(int(limit), tokens.size)
        path, prev = [], b""
        for i, key in self._chain(salt, tokens, limit // self.block):
            self.lookup_steps += 1
            blk = self.blocks.get(key)
            if blk is None or not np.array_equal(blk.tokens, tokens[i * self.block:(i + 1) * self.block]):
                break
            path.append(blk)
            prev = key
        n = len(path) * self.block
        best, rows = None, 0
        for key in self.tails.get((prev, repr(salt)), ()):
            t = self.blocks[key]
            m = common_prefix(t.tokens, tokens[n:limit])
            if m > rows:
                best, rows = t, m
        if best is not None:                          # the deepest: used, but older than its chain
            self.blocks.move_to_end(best.key)
        for blk in reversed(path):                    # the first block most recent: deeper ones go first
            self.blocks.move_to_end(blk.key)
        if best is not None:
            path.append((best, rows))
        return n + rows, path

    @staticmethod
    def copy_into(path: list, kv) -> int:
        """Import a match() path into an empty packed cache -> rows written."""
        for i, blk in enumerate(path):
            if isinstance(blk, tuple):                # the partial last block: its first rows
                t, rows = blk
                kv.import_tail(i, t.data, len(t.tokens), rows)
            else:
                kv.import_block(i, blk.data)
        return kv.offset

    def insert(self, salt, tokens: np.ndarray, kv) -> int:
        """Store the whole blocks of `tokens` (kv holds their rows) not cached yet -> new blocks."""
        new = 0
        keys = list(self._chain(salt, tokens, min(tokens.size // self.block, kv.exportable_blocks())))
        for i, key in keys:
            self.lookup_steps += 1
            if key in self.blocks:
                continue
            data = np.array(kv.export_block(i))
            blk = _Block(key, np.array(tokens[i * self.block:(i + 1) * self.block], dtype=np.int32), data, salt)
            self.blocks[key] = blk
            self.roots[salt] = self.roots.get(salt, 0) + 1
            self.bytes += blk.nbytes()
            new += 1
        nb = len(keys)
        m = tokens.size - nb * self.block
        if 0 < m < self.block and nb == kv.offset // self.block and kv.offset % self.block == m:
            new += self._insert_tail(salt, keys[-1][1] if keys else b"", tokens[nb * self.block:], kv, nb)
        for _, key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)
        return new

    def _insert_tail(self, salt, prev: bytes, tail: np.ndarray, kv, b: int) -> int:
        """Keep the partial block after chain `prev` (kv's rows [b * block, offset)), unless a kept
        tail already starts with it; a longer one replaces the tails it extends."""
        idx = (prev, repr(salt))
        have = self.tails.setdefault(idx, [])
        for key in list(have):
            t = self.blocks[key]
            if common_prefix(t.tokens, tail) == len(tail):
                self.blocks.move_to_end(key)
                return 0
            if common_prefix(t.tokens, tail) == len(t.tokens):   # the new tail extends it
                self._drop(key)
        key = block_key(prev + b"tail", salt, tail)
        blk = _Block(key, np.array(tail, dtype=np.int32), np.array(kv.export_tail(b)), salt, tail=idx)
        self.blocks[key] = blk
        self.tails.setdefault(idx, []).append(key)
        self.roots[salt] = self.roots.get(salt, 0) + 1
        self.bytes += blk.nbytes()
        while len(self.tails[idx]) > self.TAILS_PER_CHAIN:
            self._drop(self.tails[idx][0])
        return 1

    def _drop(self, key: bytes) -> None:
        blk = self.blocks.pop(key)
        self._forget(blk)

    def _forget(self, blk) -> None:
        self.bytes -= blk.nbytes()
        left = self.roots[blk.salt] - 1
        if left:
            self.roots[blk.salt] = left
        else:
            del self.roots[blk.salt]
        if blk.tail is not None:
            keys = self.tails.get(blk.tail, [])
            if blk.key in keys:
                keys.remove(blk.key)
            if not keys:
                self.tails.pop(blk.tail, None)

    def evict(self, limit: int) -> int:
        n = 0
        while self.bytes > limit and self.blocks:
            _, blk = self.blocks.popitem(last=False)
            self._forget(blk)
            n += 1
        self.evictions += n
        return n

    def clear(self) -> None:
        self.evict(-1)


# ============================================================================ the engine's side
class CacheEntry:
    """A running request's KV cache and where its rows go when it ends."""
    __slots__ = ("kv", "hwm", "salt", "store", "reserve")

    def __init__(self, kv, salt, store: bool, reserve: int = 0):
        self.kv = kv             # a KVCache (mixqrt.models.kv_cache); rows [0, kv.offset) are valid
        self.hwm = 0             # rows ever written (resident pages)
        self.salt = salt         # the tree its rows go to
        self.store = store       # False: cache_prompt off, the rows are dropped
        self.reserve = reserve   # rows counted before they are written (the prompt, admitted whole)

    def rows(self) -> int:
        return max(self.hwm, self.kv.offset, self.reserve)

    def resident_bytes(self) -> int:
        return self.kv.resident_bytes(self.rows())


class PromptCache:
    """Running requests' caches and the prefix tree of finished ones, under one byte bound.

    capacity 0 turns the tree off: nothing is stored or looked up (and running caches are not
    bounded). kv_type: the caches' type (mixqrt.models.kv_cache.KV_TYPES; default the model's)."""

    def __init__(self, model, max_len: int, capacity: int, kv_type: str | None = None):
        self.model, self.max_len, self.capacity = model, int(max_len), int(capacity)
        self.kv_type = check_kv_type(kv_type or getattr(model, "kv_type", None))
        self._probe = model.make_cache(self.max_len, self.kv_type)     # sizes only: no page of it is written
        self.row_bytes = int(round(model.kv_bytes_per_token(self.kv_type)))    # steady-state bytes per cached row
        # a packed cache is shared in whole blocks (export_block / import_block), a float one by rows
        self.packed = hasattr(self._probe, "export_block")
        # a cache type with neither rows nor blocks to copy is never shared (each request prefills)
        self.shareable = self.packed or hasattr(self._probe, "stacked")
        self.tree = BlockTree(self._probe.BLOCK) if self.packed else PrefixTree()
        self.busy: dict[int, CacheEntry] = {}
        self.hits = self.misses = self.cached_tokens = 0
        self._fit_rows: dict[int, int] = {}

    def bytes_for(self, rows: int) -> int:
        """Resident bytes of one running cache holding `rows` rows."""
        return self._probe.resident_bytes(rows)

    def max_rows(self, n: int = 1) -> int:
        """The most rows each of n running caches may hold together within capacity (max_len when
        the bound is off or holds the whole context)."""
        if self.capacity <= 0:
            return self.max_len
        if n not in self._fit_rows:
            lo, hi = 0, self.max_len                 # bytes_for grows with rows: bisect the largest fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if n * self.bytes_for(mid) <= self.capacity:
                    lo = mid
                else:
                    hi = mid - 1
            self._fit_rows[n] = lo
        return self._fit_rows[n]

    def touch(self, prompt, salt=None, use: bool = True) -> None:
        """Mark the cached prefix of a waiting request recently used, so that making room for it
        evicts other runs first."""
        if use and self.capacity > 0 and self.shareable:
            p = np.asarray(prompt, dtype=np.int64)
            self.tree.match(salt, p, limit=p.size - 1)

    def room_for(self, rows: int, n: int = 1) -> bool:
        """Whether n more running caches of `rows` rows fit beside the busy ones, cached prompts
        evicted (least recently used first) to make room."""
        if self.capacity <= 0:
            return True
        need = n * self.bytes_for(rows)
        busy = self.busy_bytes()
        if busy + need > self.capacity:
            return False
        self.tree.evict(self.capacity - busy - need)
        return True

    @property
    def evictions(self) -> int:
        return self.tree.evictions

    def acquire(self, prompt, salt=None, use: bool = True) -> tuple[CacheEntry, int]:
        """A cache for `prompt` (ints) under `salt` -> (entry, n): rows [0, n) already hold the
        prompt's first n tokens (n <= len(prompt) - 1: the last token always runs, for its logits).
        use=False: nothing is read now nor stored when the request ends."""
        use = bool(use) and self.capacity > 0 and self.shareable
        entry = CacheEntry(self.model.make_cache(self.max_len, self.kv_type), salt, use, len(prompt))
        n = 0
        if use:
            p = np.asarray(prompt, dtype=np.int64)
            n, path = self.tree.match(salt, p, limit=p.size - 1)
            if n > 0 and self.packed:
                self.tree.copy_into(path, entry.kv)
                entry.hwm = n
            elif n > 0:
                self.tree.copy_into(path, entry.kv.stacked)
                entry.kv.offset = entry.hwm = n
        if n > 0:
            self.hits += 1
            self.cached_tokens += n
        else:
            self.misses += 1
        self.busy[id(entry)] = entry
        return entry, n

    def fork(self, src: CacheEntry, n: int) -> CacheEntry:
        """A busy copy of a busy cache's first n rows, under the same salt: the n choices of one
        request share its prompt's prefill this way. A packed cache copies its whole blocks only:
        the copy holds kv.offset <= n rows, the caller writes the rest again."""
        entry = CacheEntry(self.model.make_cache(self.max_len, self.kv_type), src.salt, src.store, src.reserve)
        if self.packed:
            entry.kv.copy_from(src.kv, n)
            entry.hwm = entry.kv.offset
        elif not self.shareable:
            pass                                # nothing to copy: the caller writes all n rows
        else:
            for a, b in zip(src.kv.keys + src.kv.values, entry.kv.keys + entry.kv.values):
                b[:, :n] = a[:, :n]
            entry.kv.offset = entry.hwm = n
        self.busy[id(entry)] = entry
        return entry

    def release(self, entry: CacheEntry, tokens: np.ndarray) -> None:
        """A request is done with `entry`; tokens[:kv.offset] are what its rows hold. They join the
        tree (what it lacks of them is copied) and the entry's own cache is freed."""
        self.busy.pop(id(entry), None)
        n = entry.kv.offset
        if entry.store and self.capacity > 0 and n > 0:
            self.tree.insert(entry.salt, np.asarray(tokens[:n], dtype=np.int64),
                             entry.kv if self.packed else entry.kv.stacked)
            self.evict()
        entry.kv = None

    def discard(self, entry: CacheEntry) -> None:
        """Forget a cache whose rows cannot be trusted (its request failed mid-step)."""
        self.busy.pop(id(entry), None)
        entry.kv = None

    def busy_bytes(self) -> int:
        return sum(e.resident_bytes() for e in self.busy.values())

    def used_bytes(self) -> int:
        return self.tree.bytes + self.busy_bytes()

    def room_to_grow(self, entries) -> bool:
        """Whether every entry can write one more row within capacity (cached prompts evicted for it)."""
        if self.capacity <= 0:
            return True
        grow = sum(self.bytes_for(e.rows() + 1) - e.resident_bytes() for e in entries)
        need = self.busy_bytes() + grow
        if need > self.capacity:
            return False
        self.tree.evict(self.capacity - need)
        return True

    def evict(self) -> None:
        self.tree.evict(self.capacity - self.busy_bytes())

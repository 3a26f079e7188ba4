"""The packed KV cache: keys and values in bit widths chosen by role (mixqrt/kv/ref.py has the format).

Per layer three stores, each a lazily zeroed anonymous mapping (mixqrt.models.kv_cache._lazy_zeros: a page is
resident once written):

    kf, vf  [Hkv, S, Dh] float16   every position is written here first
    pk      [Hkv, S/64, block_bytes] uint8   a block is packed from kf / vf when its 64th position
                                             is written (block 0, the attention sink, never is)

Once a block is packed and KEEP blocks older than the newest position, its f16 pages are given back
(MADV_DONTNEED): what stays resident per sequence is the packed blocks, block 0 and the last few
blocks in f16. A row at position p reads block 0, its own partial block and the RECENT whole blocks
before it in f16 and the blocks in between packed: the rule depends on p only, so a prompt's rows
equal single decode steps bit for bit.

A trim (speculative rollback) keeps that rule: after a trim to L, block L // 64 is partial again and
is read from f16; if its f16 pages were given back already, the trim goes down to the block's start
(trim() returns what really went). Rollbacks of fewer than (KEEP - RECENT) * 64 positions (a
speculative step drafts at most 16) stay bit-exact; a deeper one refills the f16 rows of the RECENT
blocks before the new end from their packed bytes (dequantized: close, not bit-identical to the
first pass). The prompt cache's partial-block entries carry the f16 rows of the RECENT whole blocks
before them (export_tail), so a prefix cached with its partial block reads exactly what a cold
prefill read; a prefix of whole blocks alone (a prompt that leaves a cached one mid-way) gets those
rows back from the packed bytes on its first write, as a deep rollback does.

A sliding-window layer (Gemma 3's local layers) keeps f16 only and gives back the f16 pages of
blocks its window has left, so it holds about its window.
"""
from __future__ import annotations

import mmap

import numpy as np

from mixqrt.errors import GenerationError
from mixqrt.kv import check_room, ref

G = ref.G
RECENT = ref.RECENT  # whole blocks before a row's own that the row reads in f16
KEEP = RECENT + 2    # complete blocks kept in f16 behind the newest (rollbacks of < (KEEP - RECENT) * 64 stay exact)
BITS = {"q4": 4, "q8": 8}


def _lazy(n: int, dtype):
    """(array of n zeros, its mmap) in a private anonymous mapping, no huge pages."""
    dtype = np.dtype(dtype)
    m = mmap.mmap(-1, max(mmap.PAGESIZE, n * dtype.itemsize), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=dtype, count=n), m


class PackedKVCache:
    """A sequence's K/V for positions 0 .. max_len-1 in a packed KV type (``q4`` or ``q8``); the
    methods of mixqrt.models.kv_cache.KVCache, plus ``attend`` / ``attend_rows`` which run the packed
    attention kernel over one layer. windows: per layer, a sliding window (int) or None."""

    packed = True

    @staticmethod
    def bits_of(kv_type: str) -> int:
        return BITS[kv_type]

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, kv_type: str = "q4",
                 windows=None):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_len", max_len)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise GenerationError(f"KV cache {name} must be a positive int, got {v!r}")
        if kv_type not in BITS:
            raise GenerationError(f"packed KV type must be one of {sorted(BITS)}, got {kv_type!r}")
        if head_dim % 32 or head_dim > 256:
            raise GenerationError(f"the packed KV types need a head_dim that is a multiple of 32 up to 256 "
                                  f"(this model has {head_dim}): use kv_type='f16'")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.max_len = int(max_len)
        self.kv_type, self.bits = kv_type, BITS[kv_type]
        self.dtype = None                       # not a plain float cache (the fused f32 decode skips it)
        w = list(windows) if windows is not None else [None] * self.num_layers
        if len(w) != self.num_layers:
            raise GenerationError(f"windows: {len(w)} entries for {self.num_layers} layers")
        self.windows = [None if x is None else int(x) for x in w]
        self.S = -(-self.max_len // G) * G      # stores hold whole blocks
        self.nb = self.S // G
        self.block_bytes = ref.block_bytes(self.head_dim, self.bits)
        shape16 = (self.num_kv_heads, self.S, self.head_dim)
        n16 = int(np.prod(shape16))
        f16, self._map16 = _lazy(2 * self.num_layers * n16, np.float16)
        f16 = f16.reshape(2 * self.num_layers, *shape16)
        self.kf, self.vf = list(f16[:self.num_layers]), list(f16[self.num_layers:])
        self._run16 = n16 * 2                  # bytes of one layer's K (or V) store
        npk = self.num_kv_heads * self.nb * self.block_bytes
        n_packed = sum(1 for x in self.windows if x is None)
        self._packed_layers = [i for i, x in enumerate(self.windows) if x is None]
        if n_packed:
            p, self._mapq = _lazy(n_packed * npk, np.uint8)
            p = p.reshape(n_packed, self.num_kv_heads, self.nb, self.block_bytes)
        else:
            p, self._mapq = None, None
        self.pk = [None] * self.num_layers
        for j, li in enumerate(self._packed_layers):
            self.pk[li] = p[j]
        self.offset = 0
        self.packed_upto = 1       # blocks [1, packed_upto) hold packed bytes valid for the current contents
        self.freed_upto = 1        # f16 pages of blocks [1, freed_upto) given back (packed layers)
        self.hwm = 0               # positions ever written (resident accounting)
        self._wfreed = [0] * self.num_layers   # windowed layers: f16 blocks [0, n) given back

    # ------------------------------------------------------------------ writes
    check_room = check_room                    # the rule of every KV cache (mixqrt.kv.check_room)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, pos0: int) -> None:
        """Store k, v ([T, Hkv, Dh] float32) at positions pos0 .. pos0+T-1 of `layer` (f16), and pack
        the blocks this write completes."""
        t = k.shape[0]
        if pos0 + t > self.max_len:
            raise GenerationError(f"KV cache overflow: position {pos0 + t - 1} >= max_len {self.max_len}")
        if self.windows[layer] is None and 1 <= pos0 // G < self.freed_upto and pos0 % G:
            raise GenerationError(f"cannot rewrite position {pos0}: its block's f16 rows were released")
        lo = self.first_f16(pos0 + 1)
        if self.pk[layer] is not None and 1 <= lo < self.freed_upto:
            # rows from pos0 read blocks lo .. in f16 that came without them (whole blocks from a prompt
            # cache, a deep rollback): they get them back from their packed bytes
            hi = min(pos0 // G, self.freed_upto)
            if hi > self.packed_upto:
                raise GenerationError(f"cannot write position {pos0}: block {lo}'s f16 rows, which its row "
                                      f"reads, were released and it is not packed")
            self._refill16(lo, hi)
            self.freed_upto = lo
        if self.pk[layer] is not None and ref.rotates_values(self.bits):
            v = ref.fwht(v)                    # q4: a packed layer's values are stored rotated
        self.kf[layer][:, pos0:pos0 + t] = k.transpose(1, 0, 2)
        self.vf[layer][:, pos0:pos0 + t] = v.transpose(1, 0, 2)
        self.hwm = max(self.hwm, pos0 + t)
        if self.pk[layer] is not None:
            b0, b1 = max(1, min(self.packed_upto, pos0 // G)), (pos0 + t) // G
            if b1 > b0:
                from mixqrt.ops.pool import _ops
                _ops.kv_pack(self.kf[layer], self.vf[layer], b0, b1, self.bits, self.pk[layer])

    @staticmethod
    def first_f16(n: int) -> int:
        """The first block after block 0 that a row with n keys reads in f16 (ref.attend_row's rule)."""
        return max(1, n // G - RECENT)

    @property
    def fusable(self) -> bool:
        """The fused native decode layer can write and read it (no windowed layer)."""
        return all(w is None for w in self.windows)

    def advance(self, pos_end: int) -> None:
        self.offset = int(pos_end)
        self.hwm = max(self.hwm, self.offset)
        self.packed_upto = max(self.packed_upto, self.offset // G)
        self._release()

    def _release(self) -> None:
        """Give back f16 pages no row will read: packed layers' blocks [1, offset // G - KEEP), a
        windowed layer's blocks its window has left (KEEP blocks of slack)."""
        upto = max(1, self.offset // G - KEEP)
        if upto > self.freed_upto:
            for li in range(self.num_layers):
                if self.windows[li] is None:
                    self._drop16(li, self.freed_upto, upto)
            self.freed_upto = upto
        for li, w in enumerate(self.windows):
            if w is not None:
                lo = max(0, (self.offset - w) // G - KEEP)
                if lo > self._wfreed[li]:
                    self._drop16(li, self._wfreed[li], lo)
                    self._wfreed[li] = lo

    def _drop16(self, li: int, b0: int, b1: int) -> None:
        if b1 <= b0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        run = self.S * self.head_dim * 2                    # one head's f16 positions, bytes
        step = G * self.head_dim * 2                        # one block of one head (a multiple of 4096)
        for base in (li * self._run16, (self.num_layers + li) * self._run16):
            for h in range(self.num_kv_heads):
                start = base + h * run + b0 * step
                try:
                    self._map16.madvise(mmap.MADV_DONTNEED, start, (b1 - b0) * step)
                except (OSError, ValueError):
                    return

    # ------------------------------------------------------------------ attention
    def attend(self, layer: int, q: np.ndarray, pos0: int, out=None, window: int | None = None) -> np.ndarray:
        """Attention of q [T, Hq, Dh] at positions pos0.. over layer `layer` -> [T, Hq, Dh]."""
        from mixqrt.ops.attention import kv_attention
        w = self.windows[layer] if window is None else window
        return kv_attention(q, self.kf[layer], self.vf[layer], self.pk[layer], pos0, self.bits, w, out)

    # ------------------------------------------------------------------ whole blocks (the prompt cache)
    BLOCK = G

    def exportable_blocks(self) -> int:
        """Complete blocks export_block can give with every layer's data in them: all of them, unless a
        windowed layer gave back some f16 pages (then none: a later row's window could need them)."""
        if any(f > 0 for f in self._wfreed):
            return 0
        return self.offset // G

    def export_block(self, b: int) -> np.ndarray:
        """Block b's bytes, every layer: block 0 and windowed layers as f16 K and V, the other layers'
        packed block (1-D uint8; a prompt cache keeps it and import_block puts it back)."""
        if not 0 <= b < self.exportable_blocks():
            raise GenerationError(f"block {b} cannot be exported ({self.exportable_blocks()} can)")
        parts = []
        for li in range(self.num_layers):
            if b == 0 or self.pk[li] is None:
                parts.append(self.kf[li][:, b * G:(b + 1) * G].reshape(-1).view(np.uint8))
                parts.append(self.vf[li][:, b * G:(b + 1) * G].reshape(-1).view(np.uint8))
            else:
                parts.append(self.pk[li][:, b].reshape(-1))
        return np.concatenate(parts)

    def import_block(self, b: int, data) -> None:
        """Append block b (export_block's bytes) to a cache holding exactly b blocks."""
        data = np.asarray(data)
        if b != self.offset // G or self.offset % G:
            raise GenerationError(f"import_block({b}): the cache holds {self.offset} positions")
        f16 = self.num_kv_heads * G * self.head_dim * 2
        sizes = [2 * f16 if (b == 0 or self.pk[li] is None) else self.num_kv_heads * self.block_bytes
                 for li in range(self.num_layers)]
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != sum(sizes):
            raise GenerationError(f"import_block({b}): {data.size} bytes, the block takes {sum(sizes)}")
        if b + 1 > self.nb:
            raise GenerationError(f"import_block({b}): the cache holds {self.nb} blocks")
        o = 0
        for li, n in enumerate(sizes):
            if b == 0 or self.pk[li] is None:
                shape = (self.num_kv_heads, G, self.head_dim)
                self.kf[li][:, b * G:(b + 1) * G] = data[o:o + f16].view(np.float16).reshape(shape)
                self.vf[li][:, b * G:(b + 1) * G] = data[o + f16:o + n].view(np.float16).reshape(shape)
            else:
                self.pk[li][:, b] = data[o:o + n].reshape(self.num_kv_heads, self.block_bytes)
            o += n
        self.offset = (b + 1) * G
        self.hwm = max(self.hwm, self.offset)
        self.packed_upto = max(self.packed_upto, b + 1)
        if b >= 1:
            self.freed_upto = max(self.freed_upto, b + 1)      # a packed block arrives without its f16 rows

    @staticmethod
    def _tail_from(b: int) -> int:
        """The first position an exported tail after b whole blocks holds: the RECENT whole blocks
        before the partial one (not block 0: it is imported in f16 anyway), then the partial block."""
        return (min(b, max(1, b - RECENT)) if b >= 1 else 0) * G

    def export_tail(self, b: int) -> np.ndarray:
        """The f16 K and V rows of the partial last block (positions b * 64 .. offset - 1) and of the
        RECENT whole blocks before it (which its rows read in f16), every layer, for a prompt cache;
        import_tail puts them back with a prefix of the partial block."""
        m = self.offset - b * G
        if b != self.offset // G or m <= 0:
            raise GenerationError(f"export_tail({b}): the cache holds {self.offset} positions")
        lo = self._tail_from(b)
        if self._packed_layers and 1 <= lo // G < self.freed_upto:
            raise GenerationError(f"export_tail({b}): block {lo // G}'s f16 rows were released")
        parts = []
        for li in range(self.num_layers):
            parts.append(np.ascontiguousarray(self.kf[li][:, lo:self.offset]).reshape(-1).view(np.uint8))
            parts.append(np.ascontiguousarray(self.vf[li][:, lo:self.offset]).reshape(-1).view(np.uint8))
        return np.concatenate(parts)

    def import_tail(self, b: int, data, m: int, rows: int) -> None:
        """Append the first `rows` of an exported tail of m positions (and the f16 rows of the whole
        blocks before it that export_tail carried) to a cache holding b blocks."""
        data = np.asarray(data)
        if b != self.offset // G or self.offset % G or not 0 < rows <= m < G:
            raise GenerationError(f"import_tail({b}, {m}, {rows}): the cache holds {self.offset} positions")
        lo = self._tail_from(b)
        span = b * G + m - lo
        one = self.num_kv_heads * span * self.head_dim * 2
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != 2 * self.num_layers * one:
            raise GenerationError(f"import_tail: {data.size} bytes, {m} positions take {2 * self.num_layers * one}")
        shape = (self.num_kv_heads, span, self.head_dim)
        end = b * G + rows
        for li in range(self.num_layers):
            o = 2 * li * one
            self.kf[li][:, lo:end] = data[o:o + one].view(np.float16).reshape(shape)[:, :end - lo]
            self.vf[li][:, lo:end] = data[o + one:o + 2 * one].view(np.float16).reshape(shape)[:, :end - lo]
        self.offset = end
        self.hwm = max(self.hwm, self.offset)
        if lo // G >= 1:
            self.freed_upto = min(self.freed_upto, lo // G)    # those blocks' f16 rows are back

    def copy_from(self, src: "PackedKVCache", n: int) -> int:
        """Fill this empty cache with src's first rows, up to n, in whole blocks (packed bytes, and
        the f16 rows of the RECENT whole blocks before the end that the next row reads, where src still
        holds them) -> rows held."""
        if self.offset:
            raise GenerationError("copy_from: the cache is not empty")
        nb = min(int(n) // G, src.exportable_blocks())
        for b in range(nb):
            self.import_block(b, src.export_block(b))
        lo = self.first_f16(nb * G + 1) * G
        if nb >= 2 and lo < nb * G and lo // G >= src.freed_upto:   # (else the next write refills them)
            for li in range(self.num_layers):
                self.kf[li][:, lo:nb * G] = src.kf[li][:, lo:nb * G]
                self.vf[li][:, lo:nb * G] = src.vf[li][:, lo:nb * G]
            self.freed_upto = min(self.freed_upto, lo // G)
        return self.offset

    # ------------------------------------------------------------------ housekeeping
    def trim(self, n: int) -> int:
        """Forget the last n positions, or more: down to the start of a block whose f16 rows were given
        back. Returns how many positions went."""
        n = max(0, min(int(n), self.offset))
        target = self.offset - n
        b = target // G
        if b >= 1 and target % G and b < self.freed_upto:
            target = b * G
        for li, w in enumerate(self.windows):        # a windowed layer's next row reads from target + 1 - w
            if w is not None and max(0, target + 1 - w) // G < self._wfreed[li]:
                target = 0
        gone = self.offset - target
        lo = self.first_f16(target + 1)
        if target // G >= 1 and lo < target // G and lo < self.freed_upto:
            self._refill16(lo, min(target // G, self.freed_upto))
        self.offset = target
        self.packed_upto = min(self.packed_upto, max(1, target // G))
        self.freed_upto = min(self.freed_upto, lo if lo < target // G else max(1, target // G))
        if target == 0:
            self._wfreed = [0] * self.num_layers
        return gone

    def _refill16(self, b0: int, b1: int) -> None:
        """Blocks [b0, b1) of the packed layers get f16 rows again, dequantized from their packed bytes."""
        for li in self._packed_layers:
            for h in range(self.num_kv_heads):
                for b in range(b0, b1):
                    k, v = ref.dequant_block(self.pk[li][h, b], self.head_dim, self.bits)
                    self.kf[li][h, b * G:(b + 1) * G] = k.astype(np.float16)
                    self.vf[li][h, b * G:(b + 1) * G] = v.astype(np.float16)

    def reset(self) -> None:
        self.offset = 0
        self.packed_upto = self.freed_upto = 1
        self._wfreed = [0] * self.num_layers

    @property
    def nbytes(self) -> int:
        """Bytes allocated (virtual) for every store."""
        pk = len(self._packed_layers) * self.num_kv_heads * self.nb * self.block_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.S * self.head_dim * 2 + pk

    def resident_bytes(self, rows: int) -> int:
        """Bytes that rows [0, rows) keep resident: packed blocks, and f16 for block 0 and the blocks
        not yet given back (a windowed layer: its window)."""
        rows = max(0, min(int(rows), self.max_len))
        if rows == 0:
            return 0
        return self.bytes_for(rows, self.num_layers, self.num_kv_heads, self.head_dim, self.kv_type, self.windows)

    @staticmethod
    def bytes_for(rows: int, num_layers: int, num_kv_heads: int, head_dim: int, kv_type: str = "q4",
                  windows=None) -> int:
        """What `rows` positions take resident (estimate, whole blocks)."""
        bits = BITS[kv_type]
        nblk = -(-rows // G)
        f16_block = 2 * G * head_dim * 2                    # K and V of one block of one head
        total = 0
        for li in range(num_layers):
            w = None if windows is None else windows[li]
            if w is not None:
                total += min(nblk, -(-w // G) + KEEP + 1) * f16_block
            else:
                packed = max(0, nblk - 1 - KEEP - 1)
                total += packed * ref.block_bytes(head_dim, bits) + min(nblk, KEEP + 2) * f16_block
        return total * num_kv_heads

    def __repr__(self) -> str:
        return (f"PackedKVCache({self.kv_type}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, max_len={self.max_len}, offset={self.offset})")

"""Two ways to spend the cores on a Qwen2 graph: plain row-splitting, and core-slicing.

Row-split (``RowSplitRunner``): one thread walks the layers; every kernel splits its output rows over
the native pool (``ops.set_num_threads(n)``). ``decode_batch`` also batches the matmuls of several
sequences (one weight sweep serves every sequence), with attention per sequence.

Core-slicing (``CoreSlicingRunner``, an option: it lost to row-split on 2 cores,
docs/lab/scheduler.md, and targets many-core NUMA servers): the layer is cut into two sub-tasks —
stage A (attention: norm, qkv, rope, KV write, attention, o_proj, residual; also the final norm +
lm_head) and stage B (FFN: norm, gate_up, silu, down, residual) — each run by its own thread pinned to
its own cores, with single-threaded kernels. Work items (sequences, or prompt chunks) flow
A(0) -> B(0) -> A(1) -> ... -> B(n-1) -> A(head) through SPSC lock-free rings
(mixqrt._kernels._ring: C11 atomics, cache-line padded indices). A message is 32 bytes
``(seq, op, layer, slot, rows)``: the slot indexes preallocated activation buffers, activations are
never copied through the rings. Idle stages sleep on a futex "bell" with the GIL released.

Stages overlap only when several items are in flight: concurrent sequences, or prompt chunks in a
wavefront (chunk c's attention at layer L waits for chunk c-1's KV at layer L; stage A, the only
writer of the KV cache, checks that itself). A single decoding sequence is a strict chain A, B, A, ...
so core-slicing cannot beat one core on it. ``split="balanced"`` moves the gate half of the fused
gate_up projection into stage A (A: attention + gate, B: up + silu + down), because the FFN holds
~7x the attention's weights and the plain attention/FFN cut leaves stage A idle.

Both runners are clients of the model's public layer API (models/base.py): ``embed``, ``layer_forward``
and ``begin_batch / layer_batch / end_batch`` (row-split, which walks the layers itself and advances its
prefetcher between them), ``attn_stage / ffn_stage / head``, and ``ffn_in / ffn_halves / ffn_out`` for the
balanced cut. There is one layer graph, in the model module; nothing here reaches into its privates.
Stage threads run their kernels on themselves (``ops.local_threads(1)``), leaving the pool alone.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from mixqrt import ops
from mixqrt.errors import GenerationError, KernelError

__all__ = ["RowSplitRunner", "CoreSlicingRunner", "OP_ATTN", "OP_FFN", "OP_HEAD", "OP_DONE", "OP_STOP"]

OP_ATTN, OP_FFN, OP_HEAD, OP_DONE, OP_STOP, OP_ERROR = 1, 2, 3, 4, 5, 6


def _check_seqs(model, seqs) -> tuple[np.ndarray, list]:
    """seqs: [(token, KVCache), ...] -> (ids [B], caches), checked by Model.check_batch."""
    if not seqs:
        raise GenerationError("decode_batch needs at least one (token, cache) pair")
    toks, caches = [], []
    for s in seqs:
        try:
            tok, cache = s
        except (TypeError, ValueError):
            raise GenerationError(f"decode_batch: each sequence is (token, cache), got {s!r}") from None
        toks.append(int(tok))
        caches.append(cache)
    return model.check_batch(np.asarray(toks, dtype=np.int64), caches)


# ============================================================================ row-split
class RowSplitRunner:
    """The plain path: one thread over the layers, each kernel row-split over ``threads`` pool threads.

    ``prefetcher`` (mixqrt.runtime.prefetch.Prefetcher over the layer spans) is advanced per layer.
    ``threads`` (default: leave the pool as it is) resizes the global pool.
    """

    def __init__(self, model, threads: int | None = None, *, prefetcher=None, batch: bool = True,
                 chunk: int = 512):
        self.model, self.prefetcher, self.batch, self.chunk = model, prefetcher, bool(batch), int(chunk)
        if threads is not None:
            ops.set_num_threads(int(threads))

    def _advance(self, li):
        if self.prefetcher is not None:
            self.prefetcher.advance(li)

    def prefill(self, tokens, cache=None, pos0: int | None = None, *, last_only: bool = True,
                chunk: int | None = None) -> np.ndarray:
        """Like ``model(tokens, cache, pos0, last_only=...)``: logits [V] (last_only) or [T, V]."""
        m = self.model
        ids = m.check_tokens(tokens)
        t = ids.size
        if cache is None:
            cache = m.make_cache(t if pos0 is None else int(pos0) + t)
        pos0 = cache.offset if pos0 is None else int(pos0)
        cache.check_room(pos0, t)
        outs = []
        chunk = int(chunk or self.chunk)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            x = m.embed(ids[s:e])
            positions = m.positions(pos0 + s, e - s)
            for li in range(m.n_layers):
                self._advance(li)
                m.layer_forward(li, x, cache, pos0 + s, positions)
            cache.advance(pos0 + e)
            if not last_only:
                outs.append(m.head(x))
            elif e == t:
                outs.append(m.head(x[-1:])[0])
        return outs[0] if last_only else np.concatenate(outs)

    def decode_batch(self, seqs) -> np.ndarray:
        """One token for each (token, cache) in ``seqs`` -> logits [B, V]; every cache advances by 1.

        batch=True is ``Model.decode_batch`` (one [B, D] matmul per weight, attention per sequence);
        batch=False runs the sequences one after another (what calling the model per sequence does).
        """
        ids, caches = _check_seqs(self.model, seqs)
        if not self.batch:
            return np.stack([self.prefill(ids[b:b + 1], c) for b, c in enumerate(caches)])
        m = self.model
        x, step = m.begin_batch(ids, caches)
        for li in range(m.n_layers):
            self._advance(li)
            m.layer_batch(li, x, step)
        return m.end_batch(x, step)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ============================================================================ core-slicing
class _Item:
    """One work item: rows x [T, D] of one sequence (or prompt chunk), its cache and positions."""
    __slots__ = ("x", "cache", "pos0", "positions", "prev", "attn_done", "h", "g", "want", "logits", "gen")

    def __init__(self):
        self.x = self.cache = self.positions = self.prev = self.h = self.g = self.logits = None
        self.pos0 = self.attn_done = self.want = self.gen = 0


class CoreSlicingRunner:
    """Attention and FFN sub-tasks on separate pinned threads, linked by SPSC rings.

    ``cores_a`` / ``cores_b``: CPU sets of stage A (attention, final norm + lm_head) and stage B (FFN).
    The same set for both (e.g. 1 core) runs both stages on it (time-shared; the n/a case).
    Stage kernels run on the stage threads themselves (``ops.local_threads(1)``: the shared pool is left
    alone). numpy's BLAS is limited to 1 thread while the runner is open; ``close()`` restores it.
    ``split``: "attn-ffn" (the issue's cut) or "balanced" (gate projection moved to stage A).
    ``chunk``: prompt rows per wavefront item in ``prefill``.
    """

    def __init__(self, model, cores_a=(0,), cores_b=(1,), *, split: str = "attn-ffn", chunk: int = 64,
                 prefetcher=None, ring_capacity: int = 1024, spin_us: float = 50.0):
        from mixqrt._kernels import _ring
        if split not in ("attn-ffn", "balanced"):
            raise KernelError(f"CoreSlicingRunner: split must be 'attn-ffn' or 'balanced', got {split!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise KernelError(f"CoreSlicingRunner: chunk must be a positive int, got {chunk!r}")
        self.model, self.split, self.chunk, self.prefetcher = model, split, chunk, prefetcher
        self.cores_a, self.cores_b = tuple(cores_a), tuple(cores_b)
        self.n_layers = model.n_layers
        self._halves = [model.ffn_halves(li) for li in range(self.n_layers)] if split == "balanced" else None
        self._spin = float(spin_us)
        self._ring = _ring
        self.max_items = ring_capacity // 2
        self._blas = None   # numpy's BLAS -> 1 thread while open
        try:
            from threadpoolctl import threadpool_limits
            self._blas = threadpool_limits(limits=1, user_api="blas")
        except Exception:
            self._blas = None
        # rings: every consumer thread has one bell; every ring has one producer and one consumer
        self._bell_a, self._bell_b, self._bell_m = _ring.Bell(), _ring.Bell(), _ring.Bell()
        self.rings = {
            "main->A": _ring.Ring(ring_capacity, bell=self._bell_a),   # new items at layer 0, stop
            "B->A": _ring.Ring(ring_capacity, bell=self._bell_a),      # next layer / head
            "A->B": _ring.Ring(ring_capacity, bell=self._bell_b),      # FFN of a layer, stop
            "A->main": _ring.Ring(ring_capacity, bell=self._bell_m),   # item done / error
        }
        self._items: list[_Item] = []
        self._seq = 0          # item generation: the seq field of every message about that item
        self._errors: list[BaseException] = []
        self.busy_s = {"A": 0.0, "B": 0.0}
        self._closed = False
        self._ready = threading.Barrier(3)
        self._ta = threading.Thread(target=self._stage_a, name="mixqrt-stage-A", daemon=True)
        self._tb = threading.Thread(target=self._stage_b, name="mixqrt-stage-B", daemon=True)
        self._ta.start()
        self._tb.start()
        try:
            self._ready.wait(10.0)
        except threading.BrokenBarrierError:
            self.close()
            raise KernelError(f"core-slicing stages failed to start: {self._errors}") from None
        if self._errors:
            self.close()
            raise KernelError(f"core-slicing stage failed to start: {self._errors[0]}")

    # ------------------------------------------------------------------ plumbing
    def _pin(self, cpus, who):
        try:
            from mixqrt.platform.affinity import pin_current_thread
            pin_current_thread(cpus)
        except Exception as e:  # noqa: BLE001 — reported by the constructor
            self._errors.append(KernelError(f"stage {who}: {e}"))

    def _enter_stage(self, cpus, who) -> bool:
        """Pin this stage thread (its kernels run on it: ops.local_threads(1)) and wait for the other
        stage and the constructor; False: abandoned."""
        self._pin(cpus, who)
        ops.local_threads(1)
        try:
            self._ready.wait(10.0)
            return True
        except threading.BrokenBarrierError:
            return False

    # ------------------------------------------------------------------ the two stages of a layer
    def attn(self, li: int, it: "_Item") -> None:
        """Stage A of layer li on one item (balanced: also the FFN norm and gate projection)."""
        self.model.attn_stage(li, it.x, it.cache, it.pos0, it.positions)
        if self._halves is not None:
            it.h = self.model.ffn_in(li, it.x)
            it.g = ops.matmul(self._halves[li][0], it.h)

    def ffn(self, li: int, it: "_Item") -> None:
        """Stage B of layer li on one item."""
        if self._halves is None:
            self.model.ffn_stage(li, it.x)
            return
        self.model.ffn_out(li, it.x, it.g, ops.matmul(self._halves[li][1], it.h))
        it.h = it.g = None

    def _stage_a(self):
        if not self._enter_stage(self.cores_a, "A"):
            return
        m, items, nl = self.model, self._items, self.n_layers
        rings = (self.rings["B->A"], self.rings["main->A"])
        to_b, bell, spin = self.rings["A->B"], self._bell_a, self._spin
        pop_any = self._ring.pop_any
        deferred: deque = deque()
        last_adv = -1
        pf = self.prefetcher
        clock = time.perf_counter
        busy_s = self.busy_s
        try:
            while True:
                got = pop_any(rings, bell, 0.5, spin)
                if got is None:
                    continue
                seq, op, li, slot, rows = got[1]
                if op == OP_STOP:
                    to_b.push(0, OP_STOP, 0, 0, 0)
                    return
                t0 = clock()
                if op == OP_ERROR:   # stage B failed: report and stop
                    self.rings["A->main"].push(0, OP_ERROR, 0, 0, 0)
                    return
                if op == OP_HEAD:
                    it = items[slot]
                    if it.want:
                        it.logits = m.head(it.x if it.want == 2 else it.x[-1:])
                    self.rings["A->main"].push(seq, OP_DONE, nl, slot, rows)
                    busy_s["A"] += clock() - t0
                    continue
                deferred.append((seq, li, slot, rows))
                progress = True
                while progress and deferred:   # run every item whose KV dependency is met
                    progress = False
                    for _ in range(len(deferred)):
                        seq, li, slot, rows = deferred.popleft()
                        it = items[slot]
                        if it.prev is not None and items[it.prev].attn_done <= li:
                            deferred.append((seq, li, slot, rows))
                            continue
                        if pf is not None and li != last_adv:
                            pf.advance(li)
                            last_adv = li
                        self.attn(li, it)
                        it.attn_done = li + 1
                        to_b.push(seq, OP_FFN, li, slot, rows)
                        progress = True
                busy_s["A"] += clock() - t0
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            self._errors.append(e)
            self.rings["A->main"].push(0, OP_ERROR, 0, 0, 0)
            to_b.push(0, OP_STOP, 0, 0, 0)

    def _stage_b(self):
        if not self._enter_stage(self.cores_b, "B"):
            return
        items, nl = self._items, self.n_layers
        rings, to_a, bell, spin = (self.rings["A->B"],), self.rings["B->A"], self._bell_b, self._spin
        pop_any = self._ring.pop_any
        clock = time.perf_counter
        busy_s = self.busy_s
        try:
            while True:
                got = pop_any(rings, bell, 0.5, spin)
                if got is None:
                    continue
                seq, op, li, slot, rows = got[1]
                if op == OP_STOP:
                    return
                t0 = clock()
                self.ffn(li, items[slot])
                if li + 1 < nl:
                    to_a.push(seq, OP_ATTN, li + 1, slot, rows)
                else:
                    to_a.push(seq, OP_HEAD, li, slot, rows)
                busy_s["B"] += clock() - t0
        except BaseException as e:  # noqa: BLE001
            self._errors.append(e)
            self.rings["B->A"].push(0, OP_ERROR, 0, 0, 0)   # A forwards it to the caller

    def _run(self, items: list[_Item]) -> None:
        """Submit items (layer 0), wait until every one has its logits."""
        if self._closed:
            raise KernelError("CoreSlicingRunner is closed")
        if len(items) > self.max_items:
            raise KernelError(f"{len(items)} items in flight; the rings hold {self.max_items} (raise ring_capacity)")
        self._items[:] = items
        for slot, it in enumerate(items):
            it.gen = self._seq = self._seq + 1
            if not self.rings["main->A"].push(it.gen, OP_ATTN, 0, slot, it.x.shape[0]):
                raise KernelError("main->A ring full")
        left = len(items)
        while left:
            got = self._ring.pop_any((self.rings["A->main"],), self._bell_m, 0.5, self._spin)
            if got is None:
                if self._errors or not (self._ta.is_alive() and self._tb.is_alive()):
                    break
                continue
            seq, op, _, slot, _ = got[1]
            if op == OP_ERROR:
                break
            if op != OP_DONE or seq != items[slot].gen:
                raise KernelError(f"core-slicing: unexpected message {got[1]}")
            left -= 1
        if left:
            err = self._errors[0] if self._errors else KernelError("a core-slicing stage stopped")
            self.close()
            raise KernelError(f"core-slicing stage failed: {err!r}") from (err if isinstance(err, BaseException) else None)

    # ------------------------------------------------------------------ API
    def decode_batch(self, seqs) -> np.ndarray:
        """One token for each (token, cache) in ``seqs`` -> logits [B, V]; every cache advances by 1."""
        ids, caches = _check_seqs(self.model, seqs)
        x = self.model.embed(ids)                                                # [B, D] (main thread)
        items = []
        for b, c in enumerate(caches):
            it = _Item()
            it.x, it.cache, it.pos0 = np.ascontiguousarray(x[b:b + 1]), c, c.offset
            it.positions = np.asarray([c.offset], dtype=np.int64)
            it.prev, it.want = None, 1
            items.append(it)
        self._run(items)
        for it in items:
            it.cache.advance(it.pos0 + 1)
        return np.concatenate([it.logits for it in items])

    def prefill(self, tokens, cache=None, pos0: int | None = None, *, last_only: bool = True) -> np.ndarray:
        """Prompt in chunks of ``self.chunk`` rows, pipelined as a wavefront; logits [V] or [T, V]."""
        m = self.model
        ids = m.check_tokens(tokens)
        t = ids.size
        if cache is None:
            cache = m.make_cache(t if pos0 is None else int(pos0) + t)
        pos0 = cache.offset if pos0 is None else int(pos0)
        cache.check_room(pos0, t)
        x = self.model.embed(ids)                                                # [T, D]
        items = []
        for c, s in enumerate(range(0, t, self.chunk)):
            e = min(t, s + self.chunk)
            it = _Item()
            it.x, it.cache, it.pos0 = x[s:e], cache, pos0 + s                    # views of one buffer
            it.positions = np.arange(pos0 + s, pos0 + e, dtype=np.int64)
            it.prev = c - 1 if c else None
            it.want = 2 if not last_only else (1 if e == t else 0)
            items.append(it)
        self._run(items)
        cache.advance(pos0 + t)
        if last_only:
            return items[-1].logits[-1]
        return np.concatenate([it.logits for it in items])

    @property
    def stats(self) -> dict:
        """Ring accounting (pushed / popped per ring), futex wakes per bell, busy seconds per stage."""
        out = {name: {"pushed": r.pushed, "popped": r.popped} for name, r in self.rings.items()}
        out["wakes"] = {"A": self._bell_a.wakes, "B": self._bell_b.wakes, "main": self._bell_m.wakes}
        out["busy_s"] = dict(self.busy_s)
        return out

    def close(self) -> None:
        """Stop and join both stage threads; restore numpy's BLAS thread count. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ta.is_alive():
            self.rings["main->A"].push(0, OP_STOP, 0, 0, 0)
        for t in (self._ta, self._tb):
            if t.is_alive():
                t.join(10.0)
        if self._tb.is_alive():   # A died before forwarding the stop
            self.rings["A->B"].push(0, OP_STOP, 0, 0, 0)
            self._tb.join(10.0)
        if self._blas is not None:
            self._blas.restore_original_limits()
            self._blas = None

    @property
    def alive(self) -> bool:
        return self._ta.is_alive() or self._tb.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

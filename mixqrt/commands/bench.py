"""`mixqrt bench`: llama-bench-style pp/tg tokens/s, time to first token, peak RSS, and decode bytes
per token against the machine's read bandwidth measured in the same run."""
from __future__ import annotations

import statistics
import time

import numpy as np

from mixqrt.platform.perf import cpu_jiffies, peak_rss_bytes, steal_fraction


def measure_bandwidth(threads: int, nbytes: int = 1 << 30, probes: int = 3) -> float:
    """Read bandwidth in bytes/s: the best of `probes` runs of the C probe, each itself the best of
    its read patterns (see :func:`mixqrt.ops.read_bandwidth_patterns`). On a shared machine a probe
    can only under-read the bandwidth; the best one gives the tightest, i.e. the most honest, bound."""
    from mixqrt import ops
    if hasattr(ops, "read_bandwidth"):
        return max(float(ops.read_bandwidth(nbytes, threads, 2)) for _ in range(max(1, probes)))
    buf = np.ones(nbytes // 8, dtype=np.float64)
    buf.sum()
    t = time.perf_counter()
    buf.sum()
    return nbytes / (time.perf_counter() - t)


def honest_bound(probe_bytes_s: float, effective_bytes_s) -> tuple[float, str | None]:
    """The bandwidth bound for ratios: the probe, or the best effective rate (bytes read per token x
    tok/s) any runtime reached in the same run when that is higher. A runtime above the probe means
    the probe under-reads the machine; the second value then says so (None otherwise)."""
    eff = max((float(e) for e in effective_bytes_s if e and e == e), default=0.0)
    if eff > probe_bytes_s:
        return eff, (f"a runtime read {eff / 1e9:.1f} GB/s, above the probe's {probe_bytes_s / 1e9:.1f} GB/s: "
                     "the probe is wrong here, the bound is that runtime's rate")
    return probe_bytes_s, None


def _reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (VmHWM) to its current RSS (Linux /proc/self/clear_refs);
    False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS: anonymous + mapped file pages), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def file_rss_bytes(path) -> int | None:
    """Bytes of `path`'s mapping(s) resident in this process (the Rss of its /proc/self/smaps entries):
    the weights a run has touched, against the file's size; None where smaps is not readable."""
    import os
    try:
        want = os.path.realpath(path)
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and ":" in head[3]:      # a mapping's first line
                    inside = len(head) == 6 and os.path.realpath(head[5].strip()) == want
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError):
        return None


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def decode_bytes_per_token(model, ctx_tokens: int, kv_type: str | None = None) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row is gathered;
    a tied table is read whole as the lm_head), plus the K and V cache rows attended to (of
    kv_type, default the model's). A routed expert counts top_k / num_experts of its bytes: what
    one token reads on average."""
    from mixqrt.models.base import is_qtensor
    from mixqrt.models.spec import EMBED, role_of
    total = 0
    tied = model.lm_head is model.embed_tokens
    moe = getattr(model, "_moe_layout", None)
    for name, t in _weights(model):
        if name == EMBED and not tied:
            continue
        nb = t.nbytes if is_qtensor(t) or hasattr(t, "nbytes") else 0
        if moe is not None and ".mlp.experts." in name and role_of(name).startswith("expert_"):
            nb = nb * moe.top_k / moe.n_experts
        total += nb
    total += int(model.kv_bytes_per_token(kv_type) * ctx_tokens)
    return total


def _weights(model):
    """(name, tensor) for each distinct runtime tensor (Model.named_weights; a tied lm_head once)."""
    seen = set()
    for name, t in model.named_weights().items():
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield name, t


def bench(loaded, *, threads=(2,), n_prompt: int = 512, n_gen: int = 128, ttft_prompt: int = 128,
          repeats: int = 3, perf: bool = False, progress: bool = True, probe_bytes: int = 1 << 30,
          probes: int = 3, depth: int = 0, kv_type: str | None = None, depth_text=None) -> list[dict]:
    """One row per thread count: pp_tok_s, tg_tok_s, ttft_s, peak_rss_bytes, model_bytes, bandwidth_ratio.
    The bandwidth probe (``probes`` runs over ``probe_bytes``) runs before and after each row's timings.

    depth (llama-bench's -d): the cache first holds `depth` tokens of context (filled once, not
    timed, with a progress bar; depth_text: their ids, default random ids), and every timed run
    starts after them: pp and the TTFT prompt are written at positions depth.., decode attends over
    depth + the TTFT prompt. kv_type: the KV cache's type (default: what a Pipeline or Engine on this
    model uses, default_kv_type, q4 where the heads allow; the bare graph's own cache is f32)."""
    from mixqrt import ops
    from mixqrt.models.kv_cache import check_kv_type
    model = loaded.model
    kv_type = check_kv_type(kv_type, model.args.head_dim)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    prompt = rng.integers(100, min(vocab, 30000), size=n_prompt)
    depth = int(depth)
    if depth < 0 or depth > model.context_length:     # the timed tokens may run past it, as llama-bench's do
        from mixqrt.errors import GenerationError
        raise GenerationError(f"depth must be in [0, {model.context_length}] (the model's context), got {depth}")
    fill = (np.asarray(depth_text, dtype=np.int64)[:depth] if depth_text is not None
            else rng.integers(100, min(vocab, 30000), size=depth))
    if fill.size < depth:
        from mixqrt.errors import GenerationError
        raise GenerationError(f"depth {depth} needs that many tokens of depth_text, got {fill.size}")
    rows = []
    for nt in threads:
        if hasattr(ops, "set_num_threads"):
            ops.set_num_threads(int(nt))
        bw = measure_bandwidth(int(nt), probe_bytes, probes)
        # the probe's 1 GB buffer is freed again: peak RSS counts from here (where Linux lets us reset it)
        hwm_reset = _reset_peak_rss()
        cache = model.make_cache(depth + max(n_prompt, ttft_prompt + n_gen) + 8, kv_type)
        model(prompt[:32], cache, 0, last_only=True)        # warm-up: page in weights, JIT nothing
        cache.reset()
        fill_s = _fill(model, cache, fill, progress) if depth else 0.0
        path = getattr(loaded, "path", None)
        rss_warm = rss_bytes()
        frss_warm = file_rss_bytes(path) if path else None
        rss_decode = frss_decode = None
        arena = getattr(getattr(loaded, "file", None), "arena", None)
        huge = arena.huge_fraction() if arena is not None else None   # weights in 2 MiB pages (decode speed)
        pp, tg, ttft, steal = [], [], [], []
        counters = None
        for r in range(repeats):
            _rewind(model, cache, fill)
            t = time.perf_counter()
            model(prompt, cache, depth, last_only=True)
            pp.append(n_prompt / (time.perf_counter() - t))
            _rewind(model, cache, fill)
            t = time.perf_counter()
            logits = model(prompt[:ttft_prompt], cache, depth, last_only=True)
            tok = int(np.argmax(logits))
            ttft.append(time.perf_counter() - t)
            if perf and r == 0:
                from mixqrt.platform.perf import Counters
                counters = Counters()
            j0 = cpu_jiffies()
            t = time.perf_counter()
            ctx = counters if (counters is not None and counters.ok and r == 0) else _null()
            with ctx:
                for _ in range(n_gen):
                    logits = model(np.array([tok]), cache, None, last_only=True)
                    tok = int(np.argmax(logits))
            tg.append(n_gen / (time.perf_counter() - t))
            steal.append(steal_fraction(j0, cpu_jiffies()))
            if r == 0:      # resident after the first pp + n_gen decode steps
                rss_decode = rss_bytes()
                frss_decode = file_rss_bytes(path) if path else None
        peak = (_vm_hwm_bytes() if hwm_reset else None) or peak_rss_bytes()
        probe = max(bw, measure_bandwidth(int(nt), probe_bytes, probes))   # probed before and after the timed runs
        tg_med = statistics.median(tg)
        bpt = decode_bytes_per_token(model, depth + ttft_prompt + n_gen // 2, kv_type)
        bw, probe_note = honest_bound(probe, [max(tg) * bpt])
        row = {"threads": int(nt), "pp_tok_s": statistics.median(pp), "tg_tok_s": tg_med,
               "ttft_s": statistics.median(ttft), "peak_rss_bytes": peak,
               "model_bytes": loaded.nbytes, "decode_bytes_per_token": bpt,
               "read_bandwidth_bytes_s": bw, "probe_bandwidth_bytes_s": probe, "probe_note": probe_note,
               # achieved decode bandwidth / measured bandwidth; 1.0 = at the memory limit
               "bandwidth_ratio": tg_med * bpt / bw, "n_prompt": n_prompt, "n_gen": n_gen,
               "weights_huge_fraction": huge, "depth": depth, "depth_fill_seconds": fill_s, "kv_type": kv_type,
               "kv_bytes_per_token": model.kv_bytes_per_token(kv_type),
               # resident memory after the warm-up (a 32-token prompt) and after the first repetition's
               # pp + n_gen decode steps: all of it (VmRSS) and the model file's mapped pages, against
               # the file's size (a MoE model reads only the experts its tokens pick)
               "rss_after_warmup_bytes": rss_warm, "rss_after_decode_bytes": rss_decode,
               "file_rss_after_warmup_bytes": frss_warm, "file_rss_after_decode_bytes": frss_decode,
               "file_bytes": _file_size(path),
               # CPU time the hypervisor took during the decode runs (all CPUs): a noisy-neighbour gauge
               "steal_fraction": statistics.median(steal) if None not in steal else None}
        if perf:
            if counters is not None and counters.ok:
                row["cache_miss_per_instr"] = counters.miss_ratio()
                row["perf"] = counters.values
            else:
                row["perf_error"] = counters.error if counters is not None else "not measured"
        rows.append(row)
    return rows


def _fill(model, cache, fill: np.ndarray, progress: bool, chunk: int = 512) -> float:
    """Write `fill` (the depth's tokens) into an empty cache, chunk by chunk with a progress bar -> seconds."""
    from tqdm.auto import tqdm
    t = time.perf_counter()
    with tqdm(total=fill.size, desc="depth", unit="tok", disable=not progress, leave=False) as bar:
        for s in range(0, fill.size, chunk):
            model(fill[s:s + chunk], cache, s, last_only=True)
            bar.update(min(chunk, fill.size - s))
    return time.perf_counter() - t


def _rewind(model, cache, fill: np.ndarray) -> None:
    """Back to the depth's tokens only (a packed cache may trim further, to a block start: those
    rows are written again)."""
    cache.trim(cache.offset - fill.size)
    if cache.offset < fill.size:
        model(fill[cache.offset:], cache, cache.offset, last_only=True)


def _file_size(path) -> int | None:
    import os
    try:
        return os.path.getsize(path) if path else None
    except OSError:
        return None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def format_rows(rows, label: str) -> str:
    at = f" @ d{rows[0]['depth']}" if rows[0].get("depth") else ""
    head = (f"| model | threads | pp{rows[0]['n_prompt']}{at} tok/s | tg{rows[0]['n_gen']}{at} tok/s | TTFT s | "
            f"peak RSS MiB | model MiB | B/token / bandwidth |")
    out = [head, "|" + "---|" * 8]
    for r in rows:
        out.append(f"| {label} | {r['threads']} | {r['pp_tok_s']:.1f} | {r['tg_tok_s']:.1f} | {r['ttft_s']:.3f} | "
                   f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['model_bytes'] / 2**20:.1f} | "
                   f"{r['bandwidth_ratio']:.2f} ({r['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s) |")
        if r.get("probe_note"):
            out.append(f"NOTE: {r['probe_note']}")
        if r.get("kv_type"):
            out.append(f"KV cache {r['kv_type']}: {r['kv_bytes_per_token']:,.0f} bytes per token"
                       + (f"; depth {r['depth']} tokens ({r['depth'] * r['kv_bytes_per_token'] / 2**20:.1f} MiB of "
                          f"K/V), filled in {r['depth_fill_seconds']:.1f} s" if r.get("depth") else ""))
        if r.get("steal_fraction") is not None and r["steal_fraction"] >= 0.02:
            out.append(f"NOTE: the hypervisor took {100 * r['steal_fraction']:.0f} % of the CPU time during decode "
                       "(steal, /proc/stat): the machine is shared; compare ratios from one run")
        if r.get("rss_after_decode_bytes") is not None and r.get("file_bytes"):
            fr = r.get("file_rss_after_decode_bytes")
            out.append(f"RSS after warm-up {r['rss_after_warmup_bytes'] / 2**20:.0f} MiB, after pp{r['n_prompt']} + "
                       f"tg{r['n_gen']} {r['rss_after_decode_bytes'] / 2**20:.0f} MiB"
                       + (f" (model file pages {fr / 2**20:.0f} MiB = {fr / r['file_bytes']:.2f}x the file)" if fr is not None else "")
                       + f"; file {r['file_bytes'] / 2**20:.0f} MiB")
        if r.get("weights_huge_fraction") is not None and r["weights_huge_fraction"] < 0.5:
            out.append(f"NOTE: only {100 * r['weights_huge_fraction']:.0f} % of the weights are mapped in 2 MiB pages "
                       "(a copied or freshly written file); `mixqrt doctor --model FILE --recache` fixes that and "
                       "decode is faster afterwards")
        if "cache_miss_per_instr" in r:
            warn = "  WARNING: above 15 %" if r["cache_miss_per_instr"] > 0.15 else ""
            out.append(f"cache-misses/instructions: {100 * r['cache_miss_per_instr']:.2f} %{warn}")
        elif "perf_error" in r:
            out.append(f"perf counters unavailable: {r['perf_error']}")
    return "\n".join(out)

"""Fused decode layers (ops.decode_layer / _ops.DecodeLayer): one token through a layer in one native
call gives the same bits as the op-by-op path (models/qwen2.py), on every ISA tier, for float and
packed (rotated, interleaved) weights, GQA shapes, biases, thread counts and the gap prefetch; what
does not fit (a projection left in parts, a float16 cache, a layer hook) decodes op by op; bad
arguments raise."""
import numpy as np
import pytest

from mixqrt import ops
from mixqrt.errors import KernelError
from mixqrt.models import build_model
from mixqrt.formats import quantize, rotation
from mixqrt.formats.codec import to_storage

from test_model import tiny_config, tiny_weights


@pytest.fixture
def fused_switch(monkeypatch):
    def run(model, prompt, steps, fused, dtype=np.float32, kv_type=None):
        monkeypatch.setattr(ops, "FUSED_DECODE", fused)
        cache = (model.make_cache(len(prompt) + steps, kv_type) if kv_type
                 else model.make_cache(len(prompt) + steps, dtype=dtype))
        logits = [model(np.asarray(prompt), cache, last_only=True)]
        tok = int(np.argmax(logits[-1]))
        for _ in range(steps):
            logits.append(model(np.array([tok]), cache, last_only=True))
            tok = int(np.argmax(logits[-1]))
        assert cache.offset == len(prompt) + steps
        return np.stack(logits), cache
    return run


def _quantized(w, fmts, rot=None):
    """2-D weights quantized by role (q/k/v, o, gate/up, down) and stored as convert does (interleaved
    where the format has such a layout); norms, biases, embeddings as given."""
    out = {}
    for name, a in w.items():
        fmt = None
        if a.ndim == 2 and "layers" in name:
            fmt = fmts["attn"] if "self_attn" in name else fmts["down"] if "down" in name else fmts["ffn"]
        if fmt is None:
            out[name] = a
        else:
            use_rot = rot if (rot and a.shape[1] % rot["block"] == 0) else None
            out[name] = to_storage(quantize(a, fmt, rot=use_rot) if use_rot else quantize(a, fmt))
    return out


CASES = [("qwen2", False, 4, 2, 8), ("qwen2", True, 14, 2, 64), ("llama", False, 4, 4, 16), ("llama", True, 6, 2, 32)]


@pytest.mark.parametrize("arch,tied,hq,hkv,dh", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_float_layers_bit_identical(tier, fused_switch, arch, tied, hq, hkv, dh, threads):
    cfg = tiny_config(arch, tied, hq=hq, hkv=hkv, dh=dh, d=64, inter=96, layers=3)
    model = build_model(cfg, tiny_weights(cfg, seed=hq * dh, bias=(arch == "qwen2")))
    with ops.local_threads(threads):
        want, c0 = fused_switch(model, [5, 1, 4, 1, 5, 9, 2], 20, False)
        got, c1 = fused_switch(model, [5, 1, 4, 1, 5, 9, 2], 20, True)
    assert model.fused_layers() is not None and len(model.fused_layers()) == 3
    np.testing.assert_array_equal(got, want)
    for li in range(3):                     # the cache rows the fused layers wrote
        np.testing.assert_array_equal(c1.keys[li], c0.keys[li])
        np.testing.assert_array_equal(c1.values[li], c0.values[li])


@pytest.mark.parametrize("kv_type", ["q4", "q8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layers_on_a_packed_kv_cache(tier, fused_switch, kv_type, threads):
    """The fused layer writes a packed cache's f16 stores, packs the block it completes and attends
    with kv_attention: logits and every store byte equal the op-by-op path, across block boundaries."""
    cfg = tiny_config("qwen2", False, hq=8, hkv=2, dh=64, d=128, inter=192, layers=2)
    cfg["max_position_embeddings"] = 512
    model = build_model(cfg, _quantized(tiny_weights(cfg, seed=3), {"attn": "q6", "ffn": "q3p", "down": "q4"}))
    prompt = list(np.random.default_rng(0).integers(0, cfg["vocab_size"], 100))
    with ops.local_threads(threads):
        want, c0 = fused_switch(model, prompt, 100, False, kv_type=kv_type)
        got, c1 = fused_switch(model, prompt, 100, True, kv_type=kv_type)
    np.testing.assert_array_equal(got, want)
    for li in range(2):
        np.testing.assert_array_equal(c1.pk[li], c0.pk[li])
        for b in (0, 2, 3):              # block 0 and the blocks still kept in f16
            np.testing.assert_array_equal(c1.kf[li][:, 64 * b:64 * b + 8], c0.kf[li][:, 64 * b:64 * b + 8])


@pytest.mark.parametrize("fmts", [{"attn": "q6", "ffn": "q3p", "down": "q4"},
                                  {"attn": "q8", "ffn": "q4", "down": "q3u"}])
@pytest.mark.parametrize("rot", [None, {"block": 32, "seed": rotation.DEFAULT_SEED}])
def test_fused_packed_layers_bit_identical(tier, fused_switch, fmts, rot):
    """Packed weights (16-row multiples are stored interleaved: q6x, q3x, q4x), rotated or not, with and
    without the gap prefetch of the next weight after every product, products split statically or in
    chunks of one 16-row group."""
    cfg = tiny_config("qwen2", False, hq=8, hkv=2, dh=16, d=128, inter=256, layers=3)
    model = build_model(cfg, _quantized(tiny_weights(cfg, seed=11), fmts, rot))
    fmt = model.layers[0].gate_up[0].fmt
    assert fmt in ("q3x", "q4x") and (rot is None) == ("rot" not in (model.layers[0].down.meta or {}))
    before, chunk, static = ops.GAP_PREFETCH_BYTES, ops.set_decode_chunk(), ops.set_decode_static_threads(0)
    try:
        want = None
        for pf, nbytes in ((0, 0), (4096, 1), (4096, 256 << 10)):    # gap prefetch, decode chunking
            ops.GAP_PREFETCH_BYTES = pf
            ops.set_decode_chunk(nbytes)
            if want is None:
                want, _ = fused_switch(model, list(range(3, 40)), 12, False)
            np.testing.assert_array_equal(fused_switch(model, list(range(3, 40)), 12, False)[0], want)
            np.testing.assert_array_equal(fused_switch(model, list(range(3, 40)), 12, True)[0], want)
    finally:
        ops.GAP_PREFETCH_BYTES = before
        ops.set_decode_chunk(chunk)
        ops.set_decode_static_threads(static)
        ops.prefetch_wait()


def test_unfusable_models_decode_op_by_op(fused_switch, monkeypatch):
    """A layer whose q/k/v stayed in parts has no fused form; a float16 cache and a layer hook take
    the op-by-op path too; all give the results of that path."""
    import mixqrt.models.qwen2 as q2
    cfg = tiny_config(d=64, inter=96)
    w = tiny_weights(cfg, seed=3)
    monkeypatch.setattr(q2.spec, "fuse", lambda parts: None if not isinstance(parts[0], np.ndarray) or parts[0].ndim == 2
                        else np.concatenate(parts))
    parts = build_model(cfg, w)
    assert len(parts.layers[0].qkv) == 3 and parts.fused_layers() is None
    want, _ = fused_switch(parts, [1, 2, 3], 6, False)
    got, _ = fused_switch(parts, [1, 2, 3], 6, True)
    np.testing.assert_array_equal(got, want)
    monkeypatch.undo()
    model = build_model(cfg, w)
    want16, _ = fused_switch(model, [1, 2, 3], 6, False, dtype=np.float16)
    got16, _ = fused_switch(model, [1, 2, 3], 6, True, dtype=np.float16)
    np.testing.assert_array_equal(got16, want16)
    from types import SimpleNamespace

    from mixqrt.runtime.scheduler import RowSplitRunner
    calls = []     # a runner with a prefetcher walks the layers itself (the layer API), one call each
    runner = RowSplitRunner(model, prefetcher=SimpleNamespace(advance=calls.append))
    lg = runner.prefill(np.array([4]), model.make_cache(8))
    assert calls == [0, 1] and lg.shape == (model.vocab_size,)
    np.testing.assert_array_equal(lg, model(np.array([4]), model.make_cache(8), last_only=True))


def test_decode_layer_rejects_bad_arguments():
    rng = np.random.default_rng(0)
    d, hq, hkv, dh, inter = 32, 4, 2, 8, 48

    def m(*s):
        return rng.standard_normal(s).astype(np.float32)
    ws = (m((hq + 2 * hkv) * dh, d), m(d, hq * dh), m(2 * inter, d), m(d, inter))
    ones = np.ones(d, np.float32)
    L = ops.decode_layer(ws, ones, ones, None, None, 1e-6, 1e4, hq, hkv, dh)
    with pytest.raises(KernelError, match="shapes"):
        ops.decode_layer((ws[0], ws[1], ws[3], ws[2]), ones, ones, None, None, 1e-6, 1e4, hq, hkv, dh)
    with pytest.raises(KernelError, match="values"):
        ops.decode_layer(ws, ones[:5], ones, None, None, 1e-6, 1e4, hq, hkv, dh)
    with pytest.raises(KernelError, match="even"):
        ops.decode_layer(ws, ones, ones, None, None, 1e-6, 1e4, hq * 2, hkv, dh // 2 + 1)
    work = np.empty(L.work_floats(d, L.nqkv, hq, dh, inter), np.float32)
    k = np.zeros((hkv, 4, dh), np.float32)
    x = m(d)
    with pytest.raises(ValueError, match="outside the cache"):
        L.run(x, k, k.copy(), 4, work)
    with pytest.raises(ValueError, match="caches"):
        L.run(x, np.zeros((hkv, 4, dh + 2), np.float32), k, 0, work)
    with pytest.raises(ValueError, match="workspace"):
        L.run(x, k, k.copy(), 0, work[:10])
    with pytest.raises(ValueError, match="float32"):
        L.run(x, k.astype(np.float16), k, 0, work)
    with pytest.raises(ValueError, match="x has"):
        L.run(x[:-1], k, k.copy(), 0, work)


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8", "q6", "q4", "q3p", "q2c"])
def test_decode_chunking_changes_nothing(fmt):
    """Decode products split in chunks taken in turn (ops.set_decode_chunk) give the bits of the static
    split, whatever the chunk (one group of 16 rows, a few, more than the tensor) and thread count
    (5 threads: fewer chunks than threads, which the pool re-cuts into one per thread), and a bad
    size raises."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((16 * 37 + 16, 256)).astype(np.float32)
    W = w.astype(np.float16) if fmt == "f16" else w if fmt == "f32" else to_storage(quantize(w, fmt))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    before, n0, static = ops.set_decode_chunk(), ops.get_num_threads(), ops.set_decode_static_threads()
    try:
        with ops.local_threads(None):
            ops.set_decode_chunk(0)
            want = ops.matmul(W, x)
            for n in (2, 5):
                ops.set_num_threads(n)
                for upto in (0, 2):              # chunks at 2 threads too, or the static split there
                    ops.set_decode_static_threads(upto)
                    for nbytes in (1, 3 * 16 * 256, 256 << 10, W.nbytes // 3, 1 << 40):
                        ops.set_decode_chunk(nbytes)
                        np.testing.assert_array_equal(ops.matmul(W, x), want)
        with pytest.raises(ValueError):
            ops.set_decode_chunk(-1)
        with pytest.raises(ValueError):
            ops.set_decode_static_threads(-1)
    finally:
        ops.set_decode_chunk(before)
        ops.set_decode_static_threads(static)
        ops.set_num_threads(n0)


@pytest.mark.parametrize("dh", [16, 64])
def test_logits_do_not_depend_on_threads_or_prefill_chunks(fused_switch, dh):
    """Prefill attention rows are the decode computation at their positions and every product gives the
    same bits on any split: a model's logits (prompt, then greedy steps) are the same at 1, 2 and 3
    threads, and a prompt prefilled in chunks gives the logits of one prefill."""
    cfg = tiny_config("qwen2", True, hq=4, hkv=2, dh=dh, d=64, inter=96, layers=2)
    model = build_model(cfg, tiny_weights(cfg, seed=dh, bias=True))
    prompt = [(7 * i + 3) % cfg["vocab_size"] for i in range(40)]
    n0 = ops.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            runs.append(fused_switch(model, prompt, 6, True)[0])
        for r in runs[1:]:
            np.testing.assert_array_equal(r, runs[0])
    finally:
        ops.set_num_threads(n0)
    whole = model(np.asarray(prompt), model.make_cache(40), last_only=False)
    chunked = model(np.asarray(prompt), model.make_cache(40), last_only=False, chunk_size=16)
    np.testing.assert_array_equal(chunked, whole)

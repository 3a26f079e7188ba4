"""Formats on real Qwen2.5-Coder-0.5B weights: fast == reference, q3p beats q3u, q2c embedding rows."""
import numpy as np
import pytest

from mixqrt.formats import bind_range, dequantize, dequantize_rows, layout, quantize


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(qwen_gguf_path))
    t = {x.name: x for x in r.tensors}

    def get(name, rows=None):
        w = np.asarray(gguf.quants.dequantize(t[name].data, t[name].tensor_type), dtype=np.float32)
        if rows is not None:
            w = w[np.random.default_rng(0).choice(w.shape[0], rows, replace=False)]
        return np.ascontiguousarray(w)
    get.names = list(t)
    return get


@pytest.mark.parametrize("fmt", sorted(layout.PACKED))
def test_fast_matches_reference_on_real_ffn_rows(qwen, fmt):
    w = qwen("blk.0.ffn_down.weight", rows=16)            # 4864 columns: 76 q3p blocks, 38 q2c blocks
    assert quantize(w, fmt).to_bytes() == quantize(w, fmt, impl="ref").to_bytes()


def test_q3p_beats_q3u_on_real_ffn(qwen):
    for name in ("blk.0.ffn_gate.weight", "blk.12.ffn_up.weight", "blk.23.ffn_down.weight"):
        w = qwen(name, rows=64)
        e = {f: float(np.sqrt(np.mean((dequantize(quantize(w, f)) - w) ** 2))) for f in ("q3p", "q3u", "q4")}
        assert e["q4"] < e["q3p"] < e["q3u"], (name, e)


def test_q2c_embedding_rows(qwen):
    emb = qwen("token_embd.weight", rows=512)
    qt = quantize(emb, "q2c")
    assert qt.bits_per_weight == pytest.approx(2.5)
    ids = np.array([3, 100, 511, 3])
    np.testing.assert_array_equal(dequantize_rows(qt, ids), dequantize(qt)[ids])
    rel = np.sqrt(np.mean((dequantize(qt) - emb) ** 2)) / np.sqrt(np.mean(emb ** 2))
    assert rel < 0.45                                     # measured ~0.34 (docs/quant-formats.md)


def test_q5g_bound_range_over_real_norms(qwen):
    norms = [qwen(n) for n in qwen.names if n.endswith("norm.weight")]
    lo, hi = bind_range(norms)
    for w in norms[:6]:
        y = dequantize(quantize(w, "q5g", lo=lo, hi=hi))
        assert np.abs(y - w).max() <= (hi - lo) / 31 / 2 * 1.0001

"""Layout promises of .mxq files (page-internal alignment), checked from the raw header, not the reader:
every tensor 64 B aligned, every span on a page boundary, no page shared by two spans or a span and the
header, each layer's tensors inside its span and each non-layer tensor alone in one."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from test_mxq_fuzz import random_qtensor, tiny_model_tensors, write_model  # noqa: I001 (installs the formats stand-in)

from mixqrt.io.mxq import PREFIX, MxqFile, MxqWriter
from mixqrt.formats import layout


def qwen05b_tensors(layers: int = 24, vocab: int = 151936, hidden: int = 896, ffn: int = 4864,
                    heads: int = 14, kv_heads: int = 2, head_dim: int = 64, norm_fmt: str = "q5g"):
    """(name, fmt, shape, layer) of Qwen2.5-0.5B under the 2356 recipe, in the order a quantizer emits."""
    kv = kv_heads * head_dim
    out = [("model.embed_tokens.weight", "q2c", (vocab, hidden), None)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", norm_fmt, (hidden,), i),
                (p + "self_attn.q_proj.weight", "q6", (heads * head_dim, hidden), i),
                (p + "self_attn.q_proj.bias", "f32", (heads * head_dim,), i),
                (p + "self_attn.k_proj.weight", "q6", (kv, hidden), i),
                (p + "self_attn.k_proj.bias", "f32", (kv,), i),
                (p + "self_attn.v_proj.weight", "q6", (kv, hidden), i),
                (p + "self_attn.v_proj.bias", "f32", (kv,), i),
                (p + "self_attn.o_proj.weight", "q6", (hidden, heads * head_dim), i),
                (p + "post_attention_layernorm.weight", norm_fmt, (hidden,), i),
                (p + "mlp.gate_proj.weight", "q3p", (ffn, hidden), i),
                (p + "mlp.up_proj.weight", "q3p", (ffn, hidden), i),
                (p + "mlp.down_proj.weight", "q3p", (hidden, ffn), i)]
    out += [("model.norm.weight", norm_fmt, (hidden,), None), ("lm_head.weight", "q6", (vocab, hidden), None)]
    return out


def check_layout(path) -> dict:
    data = open(path, "rb").read()
    magic, _, hoff, hlen, fsize, crc = PREFIX.unpack(data[:64])
    assert fsize == len(data) and hoff + hlen == fsize and zlib.crc32(data[hoff:]) == crc
    h = json.loads(data[hoff:])
    page, tensors = h["page"], h["tensors"]
    assert h["alignment"] == 64 and page % 4096 == 0
    owner = {}                                           # page index -> span key
    for s in h["spans"]:
        assert s["offset"] % page == 0, f"span {s['key']} at {s['offset']} is not page aligned"
        for pg in range(s["offset"] // page, (s["offset"] + s["nbytes"] - 1) // page + 1):
            assert pg not in owner, f"span {s['key']} shares page {pg} with span {owner[pg]}"
            owner[pg] = s["key"]
    assert hoff % page == 0 and hoff // page not in owner and 0 not in owner   # header and prefix pages alone
    spans = {s["key"]: s for s in h["spans"]}
    for name, t in tensors.items():
        assert t["offset"] % 64 == 0, f"{name} at {t['offset']} is not 64 B aligned"
        assert t["nbytes"] == layout.expected_nbytes(t["fmt"], t["shape"])
        s = spans[name if t["layer"] is None else t["layer"]]
        assert s["offset"] <= t["offset"] and t["offset"] + t["nbytes"] <= s["offset"] + s["nbytes"]
        if t["layer"] is None:
            assert s["offset"] == t["offset"] and s["nbytes"] == t["nbytes"]
    keys = [t["layer"] if t["layer"] is not None else n for n, t in tensors.items()]
    assert set(keys) == set(spans)
    return h


@pytest.mark.parametrize("page", [4096, 8192, 1 << 21])
def test_tiny_layout(tmp_path, page):
    p = tmp_path / "t.mxq"
    write_model(p, tiny_model_tensors(layers=3), page=page)
    h = check_layout(p)
    assert len(h["spans"]) == 3 + 3 and h["page"] == page
    with MxqFile(p) as f:
        for name, q in f.tensors.items():               # the views keep the alignment in memory too
            assert q.raw.ctypes.data % 64 == 0
        for key, (off, nb) in f.spans.items():
            assert f.arena.view(off, nb).ctypes.data % 4096 == 0   # mmap base is page aligned


def test_qwen05b_shaped_layout(tmp_path):
    """The real 0.5B tensor table (3 of 24 layers, vocab cut to 1000 to keep CI fast)."""
    spec = qwen05b_tensors(layers=3, vocab=1000)
    p = tmp_path / "q.mxq"
    rng = np.random.default_rng(0)
    with MxqWriter(p, {"config": {"model_type": "qwen2"}}) as w:
        for name, fmt, shape, lay in spec:
            w.add(name, random_qtensor(rng, fmt, shape), layer=lay)
    h = check_layout(p)
    assert len(h["tensors"]) == 3 * 12 + 3 and len(h["spans"]) == 3 + 3
    with MxqFile(p) as f:
        assert f.num_layers == 3
        pad = f.spans[1][1] - sum(q.nbytes for q in f.layer_tensors(1).values())
        assert 0 <= pad < 64 * 12                       # inside a span: alignment padding only


def test_full_qwen05b_table_sizes():
    """Bytes per format of the full 0.5B table (no file): what load_mxq.py writes."""
    spec = qwen05b_tensors()
    assert len(spec) == 24 * 12 + 3
    total = sum(layout.expected_nbytes(f, s) for _, f, s, _ in spec)
    assert 300e6 < total < 360e6, total

"""The .mxq reader and writer: round trip, one test per reader error from hand-written bytes, atomic writes."""
from __future__ import annotations

import json
import os
import types
import zlib

import numpy as np
import pytest

from test_mxq_fuzz import TINY_META, random_qtensor, tiny_model_tensors, write_model  # noqa: I001 (installs the formats stand-in)

from mixqrt.errors import FormatError
from mixqrt.io import mxq
from mixqrt.io.mxq import MAX_HEADER, PREFIX, MxqFile, MxqWriter, validate
from mixqrt.formats.qtensor import QTensor


# ============================================================================ round trip
def test_round_trip(tmp_path):
    p = tmp_path / "m.mxq"
    rng = np.random.default_rng(0)
    spec = tiny_model_tensors()
    qts = {name: random_qtensor(rng, fmt, shape) for name, fmt, shape, _ in spec}
    with MxqWriter(p, TINY_META) as w:
        for name, fmt, shape, lay in spec:
            w.add(name, qts[name], layer=lay)
    with MxqFile(p) as f:
        assert f.meta == json.loads(json.dumps(TINY_META))
        assert list(f.tensors) == [s[0] for s in spec]
        for name, fmt, shape, lay in spec:
            q = f.tensors[name]
            assert isinstance(q, QTensor) and q.fmt == fmt and q.shape == shape and f.info[name].layer == lay
            assert np.array_equal(q.raw, qts[name].raw)
            assert not q.raw.flags.owndata and not q.raw.flags.writeable      # a view of the mmap
        assert set(f.spans) == {0, 1, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        assert f.num_layers == 2 and len(f.layer_tensors(1)) == 10
        hoff = PREFIX.unpack(p.read_bytes()[:64])[2]
        assert f.header_bytes == 64 + os.path.getsize(p) - hoff
        assert f.arena.prefetch(*f.spans[0]) in (True, False)
    s = validate(p, deep=True)
    assert s["tensors"] == len(spec) and s["layers"] == 2 and s["file_bytes"] == os.path.getsize(p)


def test_hints_and_close_with_live_views(tmp_path):
    p = tmp_path / "m.mxq"
    write_model(p, tiny_model_tensors(layers=1))
    f = MxqFile(p, hugepages=True, willneed=True)
    q = f.tensors["lm_head.weight"]
    want = q.raw.copy()
    f.close()                               # a view is alive: unmapping is deferred, not a crash
    assert np.array_equal(q.raw, want)
    f.close()


def test_writer_drops_its_page_cache_and_recache_keeps_the_bytes(tmp_path, monkeypatch):
    """The writer drops the file's pages after fsync (so they come back in 2 MiB folios through a
    MADV_HUGEPAGE mapping); huge_fraction is a fraction or None; recache keeps every view valid."""
    from mixqrt.io import arena as arena_mod
    dropped = []
    real = arena_mod.drop_cached
    monkeypatch.setattr(mxq, "drop_cached", lambda fd: dropped.append(fd) or real(fd))
    p = tmp_path / "m.mxq"
    write_model(p, tiny_model_tensors(layers=1))
    assert len(dropped) == 1
    with MxqFile(p, hugepages=True) as f:
        want = {n: q.raw.copy() for n, q in f.tensors.items()}
        f.arena.touch()
        frac = f.arena.huge_fraction()
        assert frac is None or 0.0 <= frac <= 1.0
        assert f.arena.recache() in (True, False)
        for n, q in f.tensors.items():
            assert np.array_equal(q.raw, want[n])
    assert f.arena.huge_fraction() is None and f.arena.recache() is False      # closed: no-ops
    f.arena.touch()


def test_empty_model_and_meta_types(tmp_path):
    p = tmp_path / "e.mxq"
    with MxqWriter(p, {"a": [1, None, "é"], "b": {"c": 1.5}}):
        pass
    with MxqFile(p) as f:
        assert f.tensors == {} and f.spans == {} and f.meta["b"]["c"] == 1.5
    assert os.path.getsize(p) == 4096 + (f.header_bytes - 64)


# ============================================================================ hand-written files
def base_header() -> dict:
    return {"format": "mxq", "version": 1, "alignment": 64, "page": 4096, "meta": {"config": {}}, "blobs": {},
            "tensors": {"a": {"fmt": "q6", "shape": [2, 32], "offset": 4096, "nbytes": 52, "layer": 0},
                        "b": {"fmt": "f32", "shape": [4], "offset": 4160, "nbytes": 16, "layer": 0},
                        "emb": {"fmt": "q8", "shape": [1, 32], "offset": 8192, "nbytes": 34, "layer": None}},
            "spans": [{"key": 0, "offset": 4096, "nbytes": 80}, {"key": "emb", "offset": 8192, "nbytes": 34}]}


def assemble(h, hoff=12288, raw_header=None, prefix=None) -> bytes:
    hdr = raw_header if raw_header is not None else json.dumps(h).encode()
    body = bytearray(hoff) + hdr
    fields = dict(magic=mxq.MAGIC, version=1, hoff=hoff, hlen=len(hdr), fsize=len(body), crc=zlib.crc32(hdr))
    fields.update(prefix or {})
    PREFIX.pack_into(body, 0, *fields.values())
    return bytes(body)


def load(tmp_path, data: bytes):
    p = tmp_path / "h.mxq"
    p.write_bytes(data)
    return MxqFile(p)


def test_hand_written_base_is_valid(tmp_path):
    with load(tmp_path, assemble(base_header())) as f:
        assert f.spans == {0: (4096, 80), "emb": (8192, 34)}


def test_version_1_q3p_asks_to_requantize(tmp_path):
    """q3p's codes are pack3c since version 2: a version 1 file with q3p fails naming the fix."""
    h = base_header()
    h["tensors"]["a"].update(fmt="q3p", shape=[1, 64], nbytes=28)
    h["tensors"]["b"].update(offset=4096 + 64)
    with pytest.raises(FormatError, match="q3p tensor 'a' .* re-quantize"):
        load(tmp_path, assemble(h))
    h["version"] = 2
    with load(tmp_path, assemble(h, prefix={"version": 2})) as f:
        assert f.tensors["a"].fmt == "q3p"


def test_upgrade_repacks_version_1_q3p(tmp_path, monkeypatch):
    """upgrade() turns a version 1 file (q3p codes planar, as q3u keeps them) into version 2 with the
    same codes, scales and everything else."""
    from mixqrt.io.mxq import upgrade
    from mixqrt.formats import QTensor, quantize, layout
    w = np.random.default_rng(3).standard_normal((5, 200)).astype(np.float32)
    new = quantize(w, "q3p")
    planar = layout.assemble("q3u", new.shape, layout.disassemble("q3p", new.shape, new.raw))
    other = quantize(w[:2], "q6")
    old_path, new_path = tmp_path / "v1.mxq", tmp_path / "v2.mxq"
    monkeypatch.setattr(mxq, "VERSION", 1)
    with MxqWriter(old_path, {"config": {"a": 1}, "big": "x" * 70000}) as wr:
        wr.add("ffn", QTensor("q3p", new.shape, np.frombuffer(planar, np.uint8)), 0)
        wr.add("attn", other, 0)
    monkeypatch.setattr(mxq, "VERSION", 2)
    with pytest.raises(FormatError, match="re-quantize"):
        MxqFile(old_path)
    assert upgrade(old_path, new_path) == 1
    with MxqFile(new_path) as f:
        assert f.tensors["ffn"].raw.tobytes() == new.raw.tobytes()
        assert f.tensors["attn"].raw.tobytes() == other.raw.tobytes()
        assert f.meta["config"] == {"a": 1} and f.meta["big"] == "x" * 70000
        assert f.info["ffn"].layer == 0


def _set(path, value):
    def edit(h):
        d = h
        for k in path[:-1]:
            d = d[k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return edit


HEADER_LIES = [
    # (id, edit of the header dict, expected message fragment)
    ("unknown-fmt", _set(["tensors", "a", "fmt"], "q9"), "tensor 'a': unknown format"),
    ("zero-dim", _set(["tensors", "a", "shape"], [0, 32]), "tensor 'a': shape"),
    ("negative-dim", _set(["tensors", "a", "shape"], [-2, 32]), "tensor 'a': shape"),
    ("bool-dim", _set(["tensors", "a", "shape"], [True, 32]), "tensor 'a': shape"),
    ("float-dim", _set(["tensors", "a", "shape"], [2.0, 32]), "tensor 'a': shape"),
    ("no-dims", _set(["tensors", "a", "shape"], []), "tensor 'a': shape"),
    ("huge-dim", _set(["tensors", "a", "shape"], [2 ** 64, 32]), "tensor 'a': shape"),
    ("nbytes-lie", _set(["tensors", "a", "nbytes"], 53), "tensor 'a': nbytes 53 != 52"),
    ("shape-lie", _set(["tensors", "a", "shape"], [3, 32]), "tensor 'a': nbytes 52 != 78"),
    ("float-offset", _set(["tensors", "a", "offset"], 4096.0), "tensor 'a': offset and nbytes must be integers"),
    ("negative-offset", _set(["tensors", "a", "offset"], -64), "tensor 'a': bytes [-64"),
    ("misaligned", _set(["tensors", "b", "offset"], 4160 + 8), "tensor 'b': offset 4168 is not 64-byte aligned"),
    ("in-prefix", _set(["tensors", "a", "offset"], 0), "tensor 'a': bytes [0, 52) outside"),
    ("past-data", _set(["tensors", "emb", "offset"], 12288), "tensor 'emb': bytes [12288"),
    ("huge-offset", _set(["tensors", "emb", "offset"], 2 ** 70), "tensor 'emb': bytes"),
    ("overlap", _set(["tensors", "b", "offset"], 4096), "tensor 'b' at 4096 should start at 4160"),
    ("gap", _set(["tensors", "b", "offset"], 4224), "tensor 'b' at 4224 should start at 4160"),
    ("bad-layer", _set(["tensors", "a", "layer"], -1), "tensor 'a': layer -1"),
    ("bool-layer", _set(["tensors", "a", "layer"], True), "tensor 'a': layer True"),
    ("extra-key", _set(["tensors", "a", "dtype"], "x"), "tensor 'a': entry must be an object"),
    ("missing-key", _set(["tensors", "a", "layer"], KeyError), "tensor 'a': entry must be an object"),
    ("empty-name", lambda h: h["tensors"].update({"": h["tensors"].pop("emb")}), "tensor name"),
    ("no-span", lambda h: h["spans"].pop(1), "tensor 'emb' (layer None) has no span"),
    ("empty-span", lambda h: h["spans"].append({"key": 5, "offset": 12288, "nbytes": 1}), "span of layer 5"),
    ("dup-span", lambda h: h["spans"].append(dict(h["spans"][0])), "duplicate span of layer 0"),
    ("span-misaligned", _set(["spans", 1, "offset"], 8256), "span of tensor 'emb': [8256"),
    ("span-size-lie", _set(["spans", 0, "nbytes"], 81), "span of layer 0 says 81 bytes"),
    ("span-bool-key", _set(["spans", 0, "key"], False), "span key False"),
    ("shared-page", lambda h: (h["tensors"]["emb"].update(offset=4096 + 128), h["spans"][1].update(offset=4096 + 128)),
     "span of tensor 'emb': [4224"),
    ("span-gap", lambda h: (h["tensors"]["emb"].update(offset=8192 + 4096), h["spans"][1].update(offset=8192 + 4096)),
     "outside the data region"),
    ("bad-page", _set(["page"], 4000), "page 4000"),
    ("small-page", _set(["page"], 2048), "page 2048"),
    ("bad-alignment", _set(["alignment"], 32), "alignment 32"),
    ("bad-format", _set(["format"], "gguf"), "format/version"),
    ("bad-version", _set(["version"], 2), "format/version"),      # the prefix says 1
    ("bool-version", _set(["version"], True), "format/version"),
    ("unknown-top", _set(["extra"], 1), "header must be an object"),
    ("meta-list", _set(["meta"], []), "meta must be an object"),
    ("tensors-list", _set(["tensors"], []), "tensors must be an object"),
]


@pytest.mark.parametrize("edit,msg", [c[1:] for c in HEADER_LIES], ids=[c[0] for c in HEADER_LIES])
def test_header_lies(tmp_path, edit, msg):
    h = base_header()
    edit(h)
    with pytest.raises(FormatError, match=None) as ei:
        load(tmp_path, assemble(h))
    assert msg in str(ei.value), str(ei.value)


def test_header_moved_away_from_spans(tmp_path):
    with pytest.raises(FormatError, match="header at 16384 should start at 12288"):
        load(tmp_path, assemble(base_header(), hoff=16384))


RAW_LIES = [
    ("magic", lambda d: b"GGUF" + d[4:], "not an .mxq file"),
    ("version", lambda d: d[:4] + (6).to_bytes(4, "little") + d[8:], "unsupported .mxq version 6"),
    ("reserved", lambda d: d[:63] + b"\1" + d[64:], "reserved prefix bytes"),
    ("truncated", lambda d: d[:-1], "prefix says the file has"),
    ("padded", lambda d: d + b"\0", "prefix says the file has"),
    ("tiny", lambda d: d[:10], "too small"),
    ("empty", lambda d: b"", "empty file"),
    ("crc", lambda d: d[:-2] + bytes([d[-2] ^ 1]) + d[-1:], "CRC-32 mismatch"),
]


@pytest.mark.parametrize("edit,msg", [c[1:] for c in RAW_LIES], ids=[c[0] for c in RAW_LIES])
def test_raw_lies(tmp_path, edit, msg):
    with pytest.raises(FormatError) as ei:
        load(tmp_path, edit(assemble(base_header())))
    assert msg in str(ei.value), str(ei.value)


@pytest.mark.parametrize("prefix,msg", [
    ({"hlen": MAX_HEADER + 1}, "header length"),
    ({"hlen": 2 ** 64 - 1}, "header length"),
    ({"hoff": 2 ** 63}, "must end exactly at end of file"),
    ({"hoff": 8}, "must end exactly at end of file"),
    ({"fsize": 2 ** 64 - 1}, "prefix says the file has"),
], ids=["hlen-limit", "hlen-huge", "hoff-huge", "hoff-in-prefix", "fsize-huge"])
def test_prefix_lies(tmp_path, prefix, msg):
    with pytest.raises(FormatError, match=msg):
        load(tmp_path, assemble(base_header(), prefix=prefix))


@pytest.mark.parametrize("raw,msg", [
    (b'{"format": "mxq", "format": "mxq"}', "duplicate key 'format'"),
    (json.dumps(base_header()).replace('"nbytes": 16', '"nbytes": NaN').encode(), "non-finite number NaN"),
    (json.dumps(base_header()).replace('"nbytes": 16', '"nbytes": Infinity').encode(), "non-finite"),
    (json.dumps(base_header()).replace('"nbytes": 16', '"nbytes": 1e400').encode(), "offset and nbytes must be integers"),
    (json.dumps(base_header()).replace('"nbytes": 16', '"nbytes": ' + "9" * 5000).encode(), "not valid UTF-8 JSON"),
    (b"[" * 200_000 + b"]" * 200_000, "not valid UTF-8 JSON"),
    (b'{"a": "\xff"}', "not valid UTF-8 JSON"),
    (b"[1, 2]", "header must be an object"),
    (b'{"a"', "not valid UTF-8 JSON"),
], ids=["dup-key", "nan", "inf", "overflow-float", "huge-int", "deep-nesting", "bad-utf8", "array", "truncated-json"])
def test_json_lies(tmp_path, raw, msg):
    with pytest.raises(FormatError, match=msg):
        load(tmp_path, assemble(None, raw_header=raw))


def test_duplicate_tensor_name(tmp_path):
    txt = json.dumps(base_header())
    entry = '"b": {"fmt": "f32", "shape": [4], "offset": 4160, "nbytes": 16, "layer": 0}'
    assert entry in txt
    with pytest.raises(FormatError, match="duplicate key 'b'"):
        load(tmp_path, assemble(None, raw_header=txt.replace(entry, entry + ", " + entry).encode()))


def test_deep_validate_rejects_nan_weights(tmp_path):
    data = bytearray(assemble(base_header()))
    data[4160:4164] = np.array([np.nan], "<f4").tobytes()
    p = tmp_path / "n.mxq"
    p.write_bytes(bytes(data))
    validate(p)
    with pytest.raises(FormatError, match="tensor 'b': non-finite"):
        validate(p, deep=True)


# ============================================================================ writer
def test_writer_rejects_misuse(tmp_path):
    rng = np.random.default_rng(0)
    q = random_qtensor(rng, "q6", (2, 32))
    p = tmp_path / "w.mxq"
    with pytest.raises(FormatError, match="added twice"):
        with MxqWriter(p, {}) as w:
            w.add("a", q, 0)
            w.add("a", q, 0)
    with pytest.raises(FormatError, match="layer 0 was already closed"):
        with MxqWriter(p, {}) as w:
            w.add("a", q, 0)
            w.add("b", q, 1)
            w.add("c", q, 0)
    with pytest.raises(FormatError, match="layer -1"):
        with MxqWriter(p, {}) as w:
            w.add("a", q, -1)
    bad = types.SimpleNamespace(fmt="q6", shape=(2, 32), raw=q.raw[:-1])
    with pytest.raises(FormatError, match="needs 52 bytes, got 51"):
        with MxqWriter(p, {}) as w:
            w.add("a", bad, 0)
    with pytest.raises(FormatError, match="JSON-serializable"):
        MxqWriter(p, {"x": float("nan")})
    with pytest.raises(FormatError, match="JSON-serializable"):
        MxqWriter(p, {"x": object()})
    assert list(tmp_path.iterdir()) == []                   # nothing committed, no temp file left


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_writer_is_atomic(tmp_path, exc):
    p = tmp_path / "m.mxq"
    write_model(p, tiny_model_tensors(layers=1))
    before = p.read_bytes()
    rng = np.random.default_rng(1)
    with pytest.raises(exc):
        with MxqWriter(p, {"new": True}) as w:
            w.add("x", random_qtensor(rng, "q6", (4, 64)), 0)
            raise exc()
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.mxq"]


def test_writer_abort_in_commit(tmp_path, monkeypatch):
    p = tmp_path / "m.mxq"

    def boom(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(mxq.os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        with MxqWriter(p, {}) as w:
            w.add("x", random_qtensor(np.random.default_rng(0), "f32", (3,)), None)
    assert os.listdir(tmp_path) == []


def test_writer_file_mode_follows_umask(tmp_path):
    p = tmp_path / "m.mxq"
    old = os.umask(0o022)
    try:
        write_model(p, [])
    finally:
        os.umask(old)
    assert (p.stat().st_mode & 0o777) == 0o644


def test_writer_header_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(mxq, "MAX_HEADER", 100)
    with pytest.raises(FormatError, match="exceeds the 100 byte limit"):
        write_model(tmp_path / "m.mxq", [], meta={"t": "x" * 200})
    assert os.listdir(tmp_path) == []


# ============================================================================ blobs (large meta strings)
def test_blob_round_trip_and_corruption(tmp_path):
    p = tmp_path / "b.mxq"
    tok = json.dumps({"model": {"vocab": {f"\u0120t{i}": i for i in range(3000)}}}, ensure_ascii=False)
    meta = {"config": {"a": 1}, "tokenizer": tok, "chat_template": "short"}
    write_model(p, tiny_model_tensors(layers=1), meta=meta, blob_min=1000)
    with MxqFile(p) as f:
        assert f.meta.blob_keys() == ["tokenizer"] and f.meta["tokenizer"] == tok
        assert dict(f.meta) == meta and f.header_bytes > len(tok.encode())
        off = f.meta._blobs["tokenizer"][0]
        assert off % 4096 == 0 and all(o + n <= off for o, n in f.spans.values())
    data = bytearray(p.read_bytes())
    data[off + 10] ^= 1
    p.write_bytes(bytes(data))
    with MxqFile(p) as f:                                   # loading does not read blobs ...
        assert f.meta["config"] == {"a": 1}
        with pytest.raises(FormatError, match="meta 'tokenizer': blob CRC-32 mismatch"):
            f.meta["tokenizer"]                             # ... reading one checks it
    with pytest.raises(FormatError, match="blob CRC-32"):
        validate(p)


@pytest.mark.parametrize("blobs,msg", [
    ({"tok": {"offset": 12288, "nbytes": 5, "crc32": 0}}, "blob 'tok' [12288, +5) should start at 12288 and end before 12288"),
    ({"tok": {"offset": 12289, "nbytes": 5, "crc32": 0}}, "blob 'tok' [12289, +5) should start at 12288"),
    ({"tok": {"offset": 12288, "nbytes": -1, "crc32": 0}}, "blob 'tok'"),
    ({"tok": {"offset": 12288, "nbytes": 5, "crc32": -1}}, "blob 'tok': entry must hold integers"),
    ({"tok": {"offset": 12288, "nbytes": 5}}, "blob 'tok': entry must hold integers"),
    ({"config": {"offset": 12288, "nbytes": 5, "crc32": 0}}, "not used in meta"),
    ([], "blobs must be an object"),
], ids=["past-header", "misplaced", "negative", "bad-crc-field", "missing-field", "shadows-meta", "not-object"])
def test_blob_lies(tmp_path, blobs, msg):
    h = base_header()
    h["blobs"] = blobs
    with pytest.raises(FormatError) as ei:
        load(tmp_path, assemble(h))
    assert msg in str(ei.value), str(ei.value)

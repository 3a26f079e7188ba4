"""Fuzzing the .mxq reader: valid seed files, mutated (truncated, flipped, lying header lengths and
offsets, structurally edited headers with a repaired CRC), must end in FormatError or in a load that an
independent oracle accepts; never another exception, a crash or a hang.

The seed builders, `mutate` and `check` are shared with benchmarks/fuzz_mxq.py (the 100k-case run).
"""
from __future__ import annotations

import copy
import json
import os
import random
import struct
import sys
import tempfile
import types
import zlib

import numpy as np

from mixqrt.errors import FormatError
from mixqrt.formats import layout


def _ensure_formats() -> None:
    """QTensor imports mixqrt.formats.codec (another module, landing separately); until it exists the
    .mxq tests install a stand-in that knows the names in mixqrt.formats.layout."""
    try:
        import mixqrt.formats.codec  # noqa: F401
    except ImportError:
        stub = types.ModuleType("mixqrt.formats.codec")
        stub.FORMATS = {k: None for k in list(layout.PACKED) + list(layout.PLAIN)}
        sys.modules["mixqrt.formats.codec"] = stub


_ensure_formats()

from mixqrt.io import mxq  # noqa: E402
from mixqrt.io.mxq import PREFIX, MxqFile, MxqWriter  # noqa: E402
from mixqrt.formats.qtensor import QTensor  # noqa: E402


# ============================================================================ seeds
def random_qtensor(rng: np.random.Generator, fmt: str, shape) -> QTensor:
    n = layout.expected_nbytes(fmt, shape)
    if fmt in ("f32", "f16"):
        raw = rng.standard_normal(n // layout.PLAIN[fmt].itemsize).astype(layout.PLAIN[fmt]).view(np.uint8)
    else:
        raw = rng.integers(0, 256, n, dtype=np.uint8)
        if fmt == "q5g":
            raw[-8:] = np.array([-1.0, 1.0], dtype="<f4").view(np.uint8)
    return QTensor(fmt, shape, raw)


def tiny_model_tensors(layers=2, hidden=40, ffn=72, vocab=50, kv=16):
    """(name, fmt, shape, layer) of a Qwen2-shaped toy with rows that are not multiples of any group."""
    out = [("model.embed_tokens.weight", "q2c", (vocab, hidden), None)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "q5g", (hidden,), i),
                (p + "self_attn.q_proj.weight", "q6", (hidden, hidden), i),
                (p + "self_attn.q_proj.bias", "f32", (hidden,), i),
                (p + "self_attn.k_proj.weight", "q6", (kv, hidden), i),
                (p + "self_attn.v_proj.weight", "q8", (kv, hidden), i),
                (p + "self_attn.o_proj.weight", "q4", (hidden, hidden), i),
                (p + "post_attention_layernorm.weight", "f16", (hidden,), i),
                (p + "mlp.gate_proj.weight", "q3p", (ffn, hidden), i),
                (p + "mlp.up_proj.weight", "q3u", (ffn, hidden), i),
                (p + "mlp.down_proj.weight", "q3p", (hidden, ffn), i)]
    out += [("model.norm.weight", "f32", (hidden,), None), ("lm_head.weight", "q6", (vocab, hidden), None)]
    return out


TINY_META = {"config": {"model_type": "qwen2", "hidden_size": 40, "rope_theta": 1e6, "tie_word_embeddings": True},
             "tokenizer": json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "\u0120b": 1}}}),
             "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
             "generation_config": {"eos_token_id": [1, 2]}, "recipe": {"name": "2356"},
             "source": "synthetic \u00e9\u4e2d"}


def write_model(path, tensors, meta=None, *, page=4096, seed=0, blob_min=mxq.BLOB_MIN) -> None:
    rng = np.random.default_rng(seed)
    with MxqWriter(path, TINY_META if meta is None else meta, page=page, blob_min=blob_min) as w:
        for name, fmt, shape, lay in tensors:
            w.add(name, random_qtensor(rng, fmt, shape), layer=lay)


def seed_files() -> list[bytes]:
    """Small valid files covering: a 2-layer toy, no tensors, one tensor, a 8 KiB page, empty meta, blobs."""
    specs = [dict(tensors=tiny_model_tensors(), blob_min=40),
             dict(tensors=[]),
             dict(tensors=[("w", "q6", (3, 33), None)], meta={}),
             dict(tensors=tiny_model_tensors(layers=1, hidden=33, ffn=65, vocab=7), page=8192),
             dict(tensors=tiny_model_tensors(layers=3, hidden=8, ffn=8, vocab=3, kv=8), meta={"x": [1, 2.5, None]})]
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, s in enumerate(specs):
            p = os.path.join(d, f"s{i}.mxq")
            write_model(p, s["tensors"], s.get("meta"), page=s.get("page", 4096), seed=i,
                        blob_min=s.get("blob_min", mxq.BLOB_MIN))
            with open(p, "rb") as fh:
                out.append(fh.read())
    return out


# ============================================================================ mutations
INTERESTING = [-1, 0, 1, 2, 7, 63, 64, 65, 4095, 4096, 4097, 8192, 1 << 20, (1 << 31) - 1, 1 << 32,
               (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, 10 ** 30]
JUNK = [None, True, False, 1.5, 1e308, -0.0, "x", "", "q9", [], [0], [-1, 4], {}, {"a": 1}, [1] * 9, [True, 2]]
N_OPS = 9


def _isint(x) -> bool:
    return type(x) is int


def _split(data: bytes):
    magic, ver, hoff, hlen, fsize, crc = PREFIX.unpack_from(data, 0)
    return hoff, hlen


def _with_header(data: bytes, hoff: int, hdr: bytes) -> bytes:
    body = bytearray(data[:hoff] + hdr)
    PREFIX.pack_into(body, 0, mxq.MAGIC, mxq.VERSION, hoff, len(hdr), len(body), zlib.crc32(hdr))
    return bytes(body)


def _edit_header(h: dict, a: int, b: int) -> None:
    """One structural lie in a parsed header: a field of a tensor, a span or the top level."""
    r = random.Random(a * 1_000_003 + b)
    val = r.choice(INTERESTING + JUNK) if r.random() < 0.5 else None
    ttab = h.get("tensors") if isinstance(h.get("tensors"), dict) else {}
    spans = h.get("spans") if isinstance(h.get("spans"), list) else []
    tnames = list(ttab)
    what = r.randrange(8)
    if what <= 2 and tnames:                                       # tensor field
        e = ttab[r.choice(tnames)]
        if not isinstance(e, dict):
            return
        key = r.choice(["fmt", "shape", "offset", "nbytes", "layer", "extra"])
        if val is None and key in ("offset", "nbytes") and isinstance(e.get(key), int):
            val = e[key] + r.choice([-4096, -64, -1, 1, 64, 4096])
        elif val is None and key == "shape" and isinstance(e.get("shape"), list):
            val = [max(1, s + r.choice([-1, 1])) for s in e["shape"]] if r.random() < 0.5 else e["shape"][::-1] + [1]
        elif val is None and key == "fmt":
            val = r.choice(sorted(mxq.FORMATS))
        elif val is None and key == "layer":
            val = r.choice([None, 0, 1, 2, 99])
        if r.random() < 0.1:
            e.pop(key, None)
        else:
            e[key] = val
    elif what == 3 and tnames:                                     # alias / move / swap tensors
        n1, n2 = r.choice(tnames), r.choice(tnames)
        mode = r.randrange(3)
        if mode == 0:
            ttab[n1 + "#copy"] = dict(ttab[n2]) if isinstance(ttab[n2], dict) else ttab[n2]
        elif mode == 1:
            e1, e2 = ttab[n1], ttab[n2]
            if isinstance(e1, dict) and isinstance(e2, dict):
                e1["offset"], e2["offset"] = e2.get("offset"), e1.get("offset")
        else:
            del ttab[n1]
    elif what == 4 and spans:                                      # span field
        s = r.choice(spans)
        if isinstance(s, dict):
            key = r.choice(["key", "offset", "nbytes"])
            if val is None and isinstance(s.get(key), int) and not isinstance(s.get(key), bool):
                val = s[key] + r.choice([-4096, -1, 1, 64, 4096])
            s[key] = val
    elif what == 5 and isinstance(h.get("blobs"), dict) and h["blobs"] and r.random() < 0.5:   # blob field
        b = h["blobs"][r.choice(sorted(h["blobs"]))]
        if isinstance(b, dict):
            key = r.choice(["offset", "nbytes", "crc32"])
            if val is None and _isint(b.get(key)):
                val = b[key] + r.choice([-4096, -1, 1, 4096])
            b[key] = val
    elif what == 5 and spans:                                      # drop / duplicate a span
        if r.random() < 0.5:
            spans.pop(r.randrange(len(spans)))
        else:
            spans.append(copy.deepcopy(r.choice(spans)))
    else:                                                          # top-level field
        key = r.choice(["format", "version", "alignment", "page", "meta", "blobs", "tensors", "spans", "extra"])
        if val is None:
            val = r.choice([32, 128, 2048, 8192, 1 << 21, 2, "mxq", {}, []])
        if r.random() < 0.15:
            h.pop(key, None)
        else:
            h[key] = val


def mutate(data: bytes, ops) -> bytes:
    """Apply ops [(kind, a, b), ...] (any ints) to a file image. Kinds: truncate, flip a byte, lie in a
    prefix field, append, structurally edit the header (CRC repaired), edit header text (CRC repaired),
    insert bytes, move the header, duplicate a JSON key."""
    for kind, a, b in ops:
        kind, a, b = kind % N_OPS, abs(a), abs(b)
        n = len(data)
        if n == 0:
            return data
        if kind == 0:
            data = data[: a % n]
        elif kind == 1:
            i = a % n
            data = data[:i] + bytes([data[i] ^ (b % 255 + 1)]) + data[i + 1:]
        elif kind == 2 and n >= PREFIX.size:
            fields = list(PREFIX.unpack_from(data, 0))
            f = 1 + a % 5
            v = INTERESTING[b % len(INTERESTING)] if b % 3 else fields[f] + (b % 129) - 64
            lim = (1 << 32) if f in (1, 5) else (1 << 64)
            fields[f] = v % lim
            data = PREFIX.pack(*fields) + data[PREFIX.size:]
        elif kind == 3:
            data = data + bytes([b % 256]) * (a % 5000 + 1)
        elif kind in (4, 5, 8) and n >= PREFIX.size:
            hoff, hlen = _split(data)
            if not (PREFIX.size <= hoff <= n and hoff + hlen == n):
                continue
            raw = data[hoff:]
            if kind == 5:                                          # text edit: exercise the JSON parser
                i = a % max(1, len(raw))
                raw = raw[:i] + bytes([b % 256]) + raw[i + 1:] if b % 4 else raw[:i] + raw[i + 1:]
            else:
                try:
                    h = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(h, dict):
                    continue
                if kind == 4:
                    _edit_header(h, a, b)
                    raw = json.dumps(h).encode()
                else:                                              # duplicate key, by text
                    txt = json.dumps(h)
                    names = list(h.get("tensors", {})) if isinstance(h.get("tensors"), dict) else []
                    if names:
                        nm = json.dumps(names[a % len(names)])
                        i = txt.find(nm)
                        j = txt.find("}", i)
                        entry = txt[i:j + 1]
                        txt = txt[:j + 1] + "," + entry + txt[j + 1:]
                    else:
                        txt = '{"format":"mxq",' + txt[1:]
                    raw = txt.encode()
            data = _with_header(data, hoff, raw)
        elif kind == 6:
            i = a % n
            data = data[:i] + bytes([b % 256]) * (b % 70 + 1) + data[i:]
        elif kind == 7 and n >= PREFIX.size:                       # move the header (pad/cut the data)
            hoff, hlen = _split(data)
            if not (PREFIX.size <= hoff <= n):
                continue
            delta = [-4096, -64, -1, 1, 64, 4096][b % 6]
            new = max(PREFIX.size, hoff + delta)
            mid = data[PREFIX.size:hoff]
            mid = mid[: new - PREFIX.size] + bytes(max(0, new - PREFIX.size - len(mid)))
            data = _with_header(data[:PREFIX.size] + mid, new, data[hoff:])
    return data


# ============================================================================ oracle
def check(path) -> str:
    """Load `path`; return 'rejected' (FormatError) or 'loaded' after an independent check of the
    promises a successful load makes. Any other exception propagates (a fuzz failure)."""
    try:
        f = MxqFile(path)
    except FormatError:
        return "rejected"
    with f:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            _, ver, hoff, hlen, fsize, _ = PREFIX.unpack(fh.read(PREFIX.size))
        assert fsize == size and hoff + hlen == size and hlen <= mxq.MAX_HEADER
        page = PREFIX.size
        ranges = []
        for name, t in f.info.items():
            q = f.tensors[name]
            assert q.fmt == t.fmt and q.shape == t.shape and q.raw.size == t.nbytes
            assert t.nbytes == layout.expected_nbytes(t.fmt, t.shape) and all(s > 0 for s in t.shape)
            assert t.offset % 64 == 0 and page <= t.offset and t.offset + t.nbytes <= hoff, name
            assert not q.raw.flags.owndata and not q.raw.flags.writeable
            int(q.raw.sum(dtype=np.uint64))                        # every byte readable (no SIGBUS)
            ranges.append((t.offset, t.offset + t.nbytes, name))
        ranges.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(ranges, ranges[1:]):
            assert a1 <= b0, f"{an} overlaps {bn}"
        pages = {}
        for key, (off, nb) in f.spans.items():
            assert off % 4096 == 0 and nb > 0 and off + nb <= hoff
            for p in range(off // 4096, (off + nb - 1) // 4096 + 1):
                assert p not in pages, f"span {key} shares page {p} with span {pages[p]}"
                pages[p] = key
        for name, t in f.info.items():
            off, nb = f.spans[name if t.layer is None else t.layer]
            assert off <= t.offset and t.offset + t.nbytes <= off + nb
        assert hoff // 4096 not in pages
        for key in f.meta:                                         # blobs: a value or FormatError
            try:
                v = f.meta[key]
            except FormatError:
                continue
            assert key in f.meta.blob_keys() and isinstance(v, str) or v == f.meta._small[key]
    return "loaded"


# ============================================================================ the CI fuzz test
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SEEDS: list[bytes] = []
_TMP = tempfile.mkdtemp(prefix="mxqfuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

_ints = st.one_of(st.integers(0, 300), st.integers(0, 1 << 24), st.sampled_from([0, 1, 63, 64, 4095, 4096]))
OPS = st.lists(st.tuples(st.integers(0, N_OPS - 1), _ints, _ints), min_size=1, max_size=4)


def _seeds() -> list[bytes]:
    if not _SEEDS:
        _SEEDS.extend(seed_files())
    return _SEEDS


def test_seeds_are_valid():
    for i, data in enumerate(_seeds()):
        p = os.path.join(_TMP, f"seed{i}.mxq")
        with open(p, "wb") as fh:
            fh.write(data)
        assert check(p) == "loaded"
        assert mxq.validate(p, deep=True)["file_bytes"] == len(data)


@settings(max_examples=int(os.environ.get("MXQ_FUZZ_EXAMPLES", 3000)), deadline=2000, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 4), ops=OPS)
def test_fuzz_mutated_files(seed, ops):
    data = mutate(_seeds()[seed], ops)
    p = os.path.join(_TMP, "case.mxq")
    with open(p, "wb") as fh:
        fh.write(data)
    assert check(p) in ("rejected", "loaded")


def test_fuzz_reaches_deep_checks():
    """The mutations must get past the prefix and CRC often, or the fuzz only tests the first checks."""
    rng = random.Random(1)
    msgs = set()
    for _ in range(300):
        ops = [(4, rng.randrange(1 << 24), rng.randrange(1 << 24))]
        data = mutate(_seeds()[0], ops)
        p = os.path.join(_TMP, "deep.mxq")
        with open(p, "wb") as fh:
            fh.write(data)
        try:
            MxqFile(p).close()
        except FormatError as e:
            msgs.add(str(e).split(": ", 1)[1][:12])
    assert len(msgs) >= 8, msgs


def teardown_module(module):
    import shutil
    shutil.rmtree(_TMP, ignore_errors=True)


if __name__ == "__main__":
    print(len(seed_files()))
    struct  # noqa: B018

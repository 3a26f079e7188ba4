"""Mutation fuzzing of the GGUF and safetensors/HF-folder readers, shared by tests/test_model_fuzz.py
(hypothesis, in CI) and benchmarks/fuzz_gguf.py / benchmarks/fuzz_safetensors.py (the 100k-case runs).

A case is a small valid seed model plus a list of ops [(kind, a, b), ...] (any ints): structural lies
(retyped, nested, out-of-bounds or string-typed metadata, lying array counts and string lengths,
tensor dims/types/offsets/names, header counts, safetensors dtypes/shapes/offsets, escaping shard
paths) and byte-level damage (flips, truncation, inserted/deleted/appended bytes, planted u64s).
`check_*` opens the result through the real readers, reads every tensor, builds the tokenizer and
the model and runs one token; it returns 'rejected' (FormatError/ModelError) or 'loaded', and lets
anything else propagate: that is a finding.
"""
from __future__ import annotations

import copy
import json
import os
import struct

import numpy as np

from mixqrt.errors import FormatError, ModelError

TYPED = (FormatError, ModelError)
INTERESTING = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 63, 64, 255, 256, 4095, 4096, 65535, 1 << 20, 10 ** 9,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
HIDDEN, INTER, HEADS, KV, LAYERS = 8, 16, 2, 1, 2
TOKENS = ["a", "b", "c", "d", " ", "\u0120", "ab", "cd", "abcd", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["a b", "c d", "ab cd"]


def _weights(rng, hidden=HIDDEN, layers=LAYERS, vocab=len(TOKENS), tied=True, bias=True, inter=INTER):
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(hidden)}
    hd = hidden // HEADS
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": np.ones(hidden), p + "post_attention_layernorm.weight": np.ones(hidden),
                  p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * hd, hidden)),
                  p + "self_attn.k_proj.weight": rng.standard_normal((KV * hd, hidden)),
                  p + "self_attn.v_proj.weight": rng.standard_normal((KV * hd, hidden)),
                  p + "self_attn.o_proj.weight": rng.standard_normal((hidden, HEADS * hd)),
                  p + "mlp.gate_proj.weight": rng.standard_normal((inter, hidden)),
                  p + "mlp.up_proj.weight": rng.standard_normal((inter, hidden)),
                  p + "mlp.down_proj.weight": rng.standard_normal((hidden, inter))})
        if bias:
            w.update({p + "self_attn.q_proj.bias": rng.standard_normal(HEADS * hd),
                      p + "self_attn.k_proj.bias": rng.standard_normal(KV * hd),
                      p + "self_attn.v_proj.bias": rng.standard_normal(KV * hd)})
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, hidden))
    return {k: (0.3 * v).astype(np.float32) for k, v in w.items()}


# ============================================================================ GGUF
# value type codes; structured kv: [key, vtype, value, lie] (lie: a count/length to write instead)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}


def _pack_scalar(vtype, v) -> bytes:
    fmt = _FMT[vtype]
    if vtype in (F32, F64):
        try:
            return struct.pack(fmt, float(v))
        except (OverflowError, TypeError, ValueError):
            return struct.pack(fmt, float("inf"))
    bits = struct.calcsize(fmt) * 8
    v = int(v) if isinstance(v, (int, float, np.integer)) and not (isinstance(v, float) and not np.isfinite(v)) else 0
    v %= 1 << bits
    if fmt[1].islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return struct.pack(fmt, v)


def _pack_str(s, lie=None) -> bytes:
    b = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", (len(b) if lie is None else lie) % (1 << 64)) + b


def _pack_value(vtype, v, lie=None) -> bytes:
    if vtype == STR:
        return _pack_str(v if isinstance(v, (str, bytes)) else str(v), lie)
    if vtype == ARR:
        etype, items = v
        n = len(items) if lie is None else lie
        return struct.pack("<IQ", etype % (1 << 32), n % (1 << 64)) + b"".join(_pack_value(etype, x) for x in items)
    if vtype in _FMT:
        return _pack_scalar(vtype, v)
    return b""                                                     # unknown type code: no payload


def gguf_bytes(g: dict) -> bytes:
    kvs, tensors = g["kvs"], g["tensors"]
    out = [b"GGUF", struct.pack("<I", g.get("version", 3)),
           struct.pack("<QQ", g.get("n_tensors", len(tensors)) % (1 << 64), g.get("n_kv", len(kvs)) % (1 << 64))]
    for key, vtype, val, lie in kvs:
        out.append(_pack_str(key) + struct.pack("<I", vtype % (1 << 32)) + _pack_value(vtype, val, lie))
    for name, dims, ttype, off in tensors:
        out.append(_pack_str(name) + struct.pack("<I", len(dims)) +
                   b"".join(struct.pack("<Q", d % (1 << 64)) for d in dims) + struct.pack("<IQ", ttype % (1 << 32), off % (1 << 64)))
    head = b"".join(out)
    head += bytes(-len(head) % 32)
    return head + g["data"]


def _gguf_seed(arch="qwen2", qtype="F32", hidden=HIDDEN, layers=LAYERS, tied=True, seed=0, inter=INTER) -> dict:
    import gguf

    from mixqrt.io.gguf import hf_to_gguf_name, permute_qk
    rng = np.random.default_rng(seed)
    w = _weights(rng, hidden, layers, tied=tied, bias=arch == "qwen2", inter=inter)
    kvs = [["general.architecture", STR, arch, None], ["general.alignment", U32, 32, None]]
    for k, v, t in [("block_count", layers, U32), ("context_length", 64, U32), ("embedding_length", hidden, U32),
                    ("feed_forward_length", inter, U32), ("attention.head_count", HEADS, U32),
                    ("attention.head_count_kv", KV, U32), ("attention.layer_norm_rms_epsilon", 1e-6, F32),
                    ("rope.freq_base", 10000.0, F32)]:
        kvs.append([f"{arch}.{k}", t, v, None])
    types = [1] * 9 + [3, 3, 3]
    kvs += [["tokenizer.ggml.model", STR, "gpt2", None], ["tokenizer.ggml.pre", STR, "qwen2", None],
            ["tokenizer.ggml.tokens", ARR, (STR, list(TOKENS)), None],
            ["tokenizer.ggml.token_type", ARR, (I32, types), None],
            ["tokenizer.ggml.merges", ARR, (STR, list(MERGES)), None],
            ["tokenizer.ggml.bos_token_id", U32, 9, None], ["tokenizer.ggml.eos_token_id", U32, 11, None],
            ["tokenizer.ggml.add_bos_token", BOOL, 0, None],
            ["tokenizer.chat_template", STR, "{% for m in messages %}{{ m.content }}{% endfor %}", None]]
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    tensors, data = [], b""
    for name, a in w.items():
        if arch == "llama" and ".q_proj." in name:
            a = permute_qk(a, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            a = permute_qk(a, KV)
        if a.ndim == 1 or qtype == "F32":
            raw, t = a.astype("<f4").tobytes(), 0
        elif qtype == "F16":
            raw, t = a.astype("<f2").tobytes(), 1
        else:
            raw, t = gguf.quants.quantize(a, qt).tobytes(), int(qt)
        data += bytes(-len(data) % 32)
        tensors.append([hf_to_gguf_name(name), list(reversed(a.shape)), t, len(data)])
        data += raw
    return {"kvs": kvs, "tensors": tensors, "data": data}


def gguf_seeds() -> list[dict]:
    """A qwen2 (tied, F32), a llama (untied, F16, permuted q/k) and a Q8_0 model (hidden 32)."""
    return [_gguf_seed("qwen2", "F32"), _gguf_seed("llama", "F16", tied=False, seed=1),
            _gguf_seed("qwen2", "Q8_0", hidden=32, layers=1, seed=2, inter=64)]


def _junk_value(r, old):
    """(vtype, value) of another type than a metadata value should have."""
    choice = r % 9
    if choice == 0:
        return STR, str(old if not isinstance(old, tuple) else 7)
    if choice == 1:
        return F32, float(INTERESTING[r % len(INTERESTING)]) * (-1 if r & 1 else 1)
    if choice == 2:
        return BOOL, r & 1
    if choice == 3:
        return ARR, (U32, [INTERESTING[r % len(INTERESTING)]] * (1 + r % 3))
    if choice == 4:
        return I64, -INTERESTING[r % len(INTERESTING)]
    if choice == 5:
        return F64, [float("nan"), float("inf"), -0.0, 1e308][r % 4]
    if choice == 6:
        return ARR, (STR, ["x", "1", ""])
    if choice == 7:
        return 13 + r % 100, None                                  # unknown type code
    return U64, INTERESTING[r % len(INTERESTING)]


N_GGUF_OPS = 17


def mutate_gguf(seed: dict, ops) -> bytes:
    """Structured lies (kinds 0-10) on a copy of the seed, then byte damage (kinds 11-16)."""
    g = copy.deepcopy(seed)
    ops = [(k % N_GGUF_OPS, abs(a), abs(b)) for k, a, b in ops]
    for kind, a, b in sorted(ops, key=lambda o: o[0] >= 11):
        kvs, ts = g["kvs"], g["tensors"]
        if kind == 0 and kvs:                                      # retype a value
            kv = kvs[a % len(kvs)]
            kv[1], kv[2] = _junk_value(b, kv[2])
        elif kind == 1 and kvs:                                    # out-of-bounds integer
            kv = kvs[a % len(kvs)]
            if kv[1] in (U32, U64, I32, I64, U8, U16, I8, I16, BOOL):
                kv[1], kv[2] = [U32, U64, I32, I64][b % 4], INTERESTING[b % len(INTERESTING)] * (-1 if b & 8 else 1)
        elif kind == 2 and kvs and not g.get("nested"):           # nest a value in arrays (once: the
            g["nested"] = True                                     # reader stops at depth 4 anyway)
            kv = kvs[a % len(kvs)]
            v, t = kv[2], kv[1]
            for _ in range(1 + b % 100):
                v, t = (t, [v]), ARR
            kv[1], kv[2] = t, v
        elif kind == 3 and kvs:                                    # lying array count / string length
            kv = kvs[a % len(kvs)]
            if kv[1] in (ARR, STR):
                n = len(kv[2][1]) if kv[1] == ARR else len(str(kv[2]))
                kv[3] = [n + 1, n - 1 if n else 0, n * 2 + 5, INTERESTING[b % len(INTERESTING)]][b % 4]
        elif kind == 4 and kvs:                                    # drop / duplicate a key
            if b & 1:
                kvs.pop(a % len(kvs))
            else:
                kvs.append(copy.deepcopy(kvs[a % len(kvs)]))
        elif kind == 5 and ts:                                     # tensor dims
            t = ts[a % len(ts)]
            m = b % 5
            if m == 0:
                t[1] = t[1][::-1]
            elif m == 1:
                t[1] = t[1] + [1 + b % 3]
            elif m == 2:
                t[1] = [INTERESTING[b % len(INTERESTING)]] + t[1][1:]
            elif m == 3:
                t[1] = []
            else:
                t[1] = [max(0, d + (b % 3) - 1) for d in t[1]]
        elif kind == 6 and ts:                                     # tensor type
            ts[a % len(ts)][2] = [0, 1, 2, 3, 6, 8, 10, 12, 14, 30, 39, 99, 1 << 31][b % 13]
        elif kind == 7 and ts:                                     # tensor offset
            t = ts[a % len(ts)]
            t[3] = [t[3] + 32, t[3] - 32, t[3] + 1, INTERESTING[b % len(INTERESTING)], 0][b % 5]
        elif kind == 8 and ts:                                     # tensor names
            i = a % len(ts)
            m = b % 4
            if m == 0:
                ts.pop(i)
            elif m == 1:
                ts.append(copy.deepcopy(ts[i]))
            elif m == 2:
                ts[i][0] = ts[i][0].replace(".0.", f".{INTERESTING[b % len(INTERESTING)]}.")
            else:
                ts[i][0] = ts[(i + 1) % len(ts)][0]
        elif kind == 9:                                            # header counts
            g["n_tensors" if b & 1 else "n_kv"] = INTERESTING[a % len(INTERESTING)]
        elif kind == 10:                                           # version
            g["version"] = [1, 2, 3, 4, 3 << 24][a % 5]
        elif kind >= 11:
            g["data_raw"] = _damage(g.get("data_raw") or gguf_bytes(g), kind - 11, a, b)
    return g.get("data_raw") or gguf_bytes(g)


def _damage(data: bytes, kind: int, a: int, b: int) -> bytes:
    """Byte-level damage: flip, truncate, insert, delete, append, plant a u64."""
    n = len(data)
    if n == 0:
        return data
    i = a % n
    if kind == 0:
        return data[:i] + bytes([data[i] ^ (1 << (b % 8))]) + data[i + 1:]
    if kind == 1:
        return data[:i]
    if kind == 2:
        return data[:i] + bytes([b % 256]) * (1 + b % 64) + data[i:]
    if kind == 3:
        return data[:i] + data[i + 1 + b % 64:]
    if kind == 4:
        return data + bytes([b % 256]) * (1 + b % 4096)
    return data[:i] + struct.pack("<Q", INTERESTING[b % len(INTERESTING)]) + data[i + 8:]


def check_gguf(path) -> str:
    from mixqrt.io.gguf import GGUFSource
    try:
        src = GGUFSource(path)
    except TYPED:
        return "rejected"
    with src:
        return _exercise(src)


def _exercise(src) -> str:
    """Every tensor, the tokenizer and the model (one token) from an opened source."""
    from mixqrt.models import build_model
    try:
        weights = {n: src.get(n) for n in src.tensor_names()}
        tok = src.tokenizer
        ids = tok.encode("ab cd<|im_end|>")
        tok.decode(ids)
        model = build_model(src.config, weights, arch=src.arch, generation_config=src.generation_config)
        logits = model.logits([0, 1])
    except TYPED:
        return "rejected"
    assert logits.shape == (2, src.config["vocab_size"]), logits.shape
    return "loaded"


# ============================================================================ safetensors / HF folders
def _st_bytes(header: dict, blobs: bytes, length=None) -> bytes:
    h = _json_text(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", (len(h) if length is None else length) % (1 << 64)) + h + blobs


def _st_file(w: dict, dtype="F32", order=None):
    header, data = {}, b""
    names = order or list(w)
    for name in names:
        a = w[name]
        raw = {"F32": a.astype("<f4"), "F16": a.astype("<f2"),
               "BF16": (a.astype("<f4").view("<u4") >> 16).astype("<u2")}[dtype].tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header["__metadata__"] = {"format": "pt"}
    return header, data


def _hf_config(arch, tied):
    return {"architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"], "model_type": arch,
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 64, "vocab_size": len(TOKENS), "tie_word_embeddings": tied,
            "bos_token_id": 9, "eos_token_id": 11}


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(TOKENS[:9])}
    tk = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in MERGES]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(TOKENS[9:])
    return tk.to_str()


def hf_seeds() -> list[dict]:
    """Folders as {file name: JSON-able object or (header, data) for safetensors}: a qwen2 F32,
    a llama BF16 untied, and a sharded qwen2 F16 with an index."""
    tok = _tokenizer_json()
    out = []
    for arch, dtype, tied, sharded, seed in [("qwen2", "F32", True, False, 0), ("llama", "BF16", False, False, 1),
                                             ("qwen2", "F16", True, True, 2)]:
        w = _weights(np.random.default_rng(seed), tied=tied, bias=arch == "qwen2")
        files = {"config.json": _hf_config(arch, tied), "tokenizer.json": tok,
                 "generation_config.json": {"eos_token_id": [11, 10], "do_sample": False},
                 "tokenizer_config.json": {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
                                           "pad_token": {"content": "<|endoftext|>"},
                                           "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}}
        if sharded:
            names = list(w)
            parts = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
                     "model-00002-of-00002.safetensors": names[len(names) // 2:]}
            for fname, group in parts.items():
                files[fname] = _st_file({n: w[n] for n in group}, dtype)
            files["model.safetensors.index.json"] = {"metadata": {}, "weight_map": {
                n: f for f, g in parts.items() for n in g}}
        else:
            files["model.safetensors"] = _st_file(w, dtype)
        out.append(files)
    return out


_JSON_JUNK = [None, True, 0, -1, 1.5, float("nan"), 1e308, "7", "", [], {}, [1, 2], {"a": 1}, "F32", 10 ** 30,
              "../model.safetensors", "/etc/passwd", "model.safetensors"]
N_HF_OPS = 14


def _deep(depth: int, leaf=0):
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _json_text(v) -> str:
    try:
        return json.dumps(v)
    except (RecursionError, ValueError):
        return "[" * 50_000 + "]" * 50_000


def mutate_hf(seed: dict, ops) -> dict[str, bytes]:
    """Structured lies on the folder (kinds 0-8), then byte damage to one safetensors file (9-13).
    Returns {file name: bytes}."""
    f = copy.deepcopy(seed)
    ops = [(k % N_HF_OPS, abs(a), abs(b)) for k, a, b in ops]
    sts = sorted(n for n in f if n.endswith(".safetensors"))
    lengths: dict = {}
    raw: dict[str, bytes] = {}
    for kind, a, b in sorted(ops, key=lambda o: o[0] >= 9):
        st = sts[a % len(sts)]
        header = f[st][0] if isinstance(f.get(st), tuple) else None
        names = [n for n in (header or {}) if n != "__metadata__" and isinstance(header[n], dict)]
        if kind == 0:                                              # config value: junk, bounds, types
            cfg = f["config.json"]
            key = sorted(cfg)[a % len(cfg)]
            cfg[key] = _JSON_JUNK[b % len(_JSON_JUNK)] if b & 1 else INTERESTING[b % len(INTERESTING)]
        elif kind == 1:                                            # drop a config key / nest one
            cfg = f["config.json"]
            key = sorted(cfg)[a % len(cfg)]
            if b & 1:
                del cfg[key]
            else:
                cfg[key] = _deep(1 + b % 2000, cfg[key])
        elif kind == 2 and names:                                  # tensor dtype
            header[names[a % len(names)]]["dtype"] = ["F16", "BF16", "F32", "F64", "I8", "U8", "BOOL", "Q4", 7,
                                                      None, "F8_E4M3"][b % 11]
        elif kind == 3 and names:                                  # tensor shape
            e = header[names[a % len(names)]]
            sh = e.get("shape")
            if not isinstance(sh, list):
                continue
            e["shape"] = [sh[::-1], sh + [1], [INTERESTING[b % len(INTERESTING)]], [], [-1] + sh[1:]][b % 5]
        elif kind == 4 and names:                                  # tensor offsets
            e = header[names[a % len(names)]]
            o = e.get("data_offsets")
            if not (isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o)):
                continue
            e["data_offsets"] = [[o[0] + 4, o[1] + 4], [o[0], o[1] + 4], [o[1], o[0]],
                                 [0, INTERESTING[b % len(INTERESTING)]], [o[0]], "x"][b % 6]
        elif kind == 5 and names:                                  # rename / drop / alias / nest an entry
            n = names[a % len(names)]
            m = b % 4
            if m == 0:
                header[n.replace(".0.", f".{INTERESTING[b % len(INTERESTING)]}.")] = header.pop(n)
            elif m == 1:
                del header[n]
            elif m == 2:
                header[n] = _JSON_JUNK[b % len(_JSON_JUNK)]
            else:
                header["__metadata__"] = _deep(1 + b % 5000) if b & 4 else INTERESTING[b % len(INTERESTING)]
        elif kind == 6:                                            # index: paths out of the folder
            idx = f.get("model.safetensors.index.json")
            if isinstance(idx, dict) and isinstance(idx.get("weight_map"), dict) and idx["weight_map"]:
                wm = idx["weight_map"]
                key = sorted(wm)[a % len(wm)]
                wm[key] = _JSON_JUNK[b % len(_JSON_JUNK)]
            elif b & 1:
                f["model.safetensors.index.json"] = {"weight_map": {"model.norm.weight": "/etc/passwd"}}
        elif kind == 7:                                            # lying header length
            lengths[st] = INTERESTING[b % len(INTERESTING)] if b & 1 else b % 4096
        elif kind == 8 and b & 2:                                  # tokenizer config junk
            tc = f["tokenizer_config.json"]
            key = sorted(tc)[a % len(tc)]
            tc[key] = _JSON_JUNK[b % len(_JSON_JUNK)] if b & 4 else {"content": _JSON_JUNK[a % len(_JSON_JUNK)]}
        elif kind == 8:                                            # generation config junk
            f["generation_config.json"] = {"eos_token_id": _JSON_JUNK[b % len(_JSON_JUNK)],
                                           "temperature": _JSON_JUNK[a % len(_JSON_JUNK)]}
        else:                                                      # byte damage to one file
            if st not in raw:
                raw[st] = _st_bytes(f[st][0], f[st][1], lengths.get(st)) if isinstance(f[st], tuple) else f[st]
            raw[st] = _damage(raw[st], kind - 9, a, b)
    out = {}
    for name, v in f.items():
        if name in raw:
            out[name] = raw[name]
        elif name.endswith(".safetensors"):
            out[name] = _st_bytes(v[0], v[1], lengths.get(name))
        elif isinstance(v, str):
            out[name] = v.encode()
        else:
            out[name] = _json_text(v).encode()
    return out


def write_folder(folder, files: dict[str, bytes]) -> None:
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(data)


def check_hf(folder) -> str:
    from mixqrt.io.hf import HFSource
    try:
        src = HFSource(folder)
    except TYPED:
        return "rejected"
    with src:
        return _exercise(src)

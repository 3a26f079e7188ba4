"""Tiny, deterministic model checkpoints for tests (no downloads).

    make_tiny_hf_model(dir, arch="qwen2"|"llama"|"qwen3"|"gemma3", tied=True, seed=0,
                       dtype="bf16"|"f16"|"f32", sharded=False, config_extra=None) -> Path
        config.json, model.safetensors (or 2 shards + index), tokenizer.json (byte-level BPE
        trained here on a few KB of text), tokenizer_config.json (ChatML template),
        generation_config.json.
    make_tiny_gguf(hf_dir, path, qtype="F32"|"F16"|"Q8_0") -> Path
        the same model written as llama.cpp's converter would (GGUF names, llama q/k permuted,
        vocab + merges + token types in metadata).
    write_safetensors(path, {name: float32 array}, dtype="F32") -> Path
        a raw writer (BF16 too, without torch/ml_dtypes) for building good and bad files by hand.

Dimensions: hidden 64, 2 layers, 4 heads / 2 kv heads (head_dim 16), intermediate 128,
vocab 448 (tokenizer ~400 + padding rows, as real checkpoints pad). qwen3 and gemma3 have
head_dim 32 (independent of hidden / heads, as theirs is) and q/k norms; gemma3 has a sliding
window of 4 on layer 0 (layer 1 is global) and its four norms per layer.
"""
from __future__ import annotations

import json
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 64, 2, 4, 2, 128, 448
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a small model, and we'll test it well.
Language models predict the next token; they don't know what they haven't seen. I've read it.
Quantization stores weights in fewer bits: two, three, five or six bits per weight, plus scales.
def quicksort(xs):
    if len(xs) <= 1:
        return xs
    pivot, rest = xs[0], xs[1:]
    return quicksort([x for x in rest if x < pivot]) + [pivot] + quicksort([x for x in rest if x >= pivot])

for i in range(10):
    print(i, i * i, "hello world")
    total += 12345 * 67890  # numbers 0123456789
class Model:
    def __init__(self, config):
        self.config = config   # the HF config.json keys
今天天气很好。我们去公园散步吧。你好，世界！机器学习和语言模型。
Emoji: 😀 😃 😄 👍🏽 🎉 ❤️ and accents: café, naïve, Zürich, jalapeño.
    Indented   text\twith\ttabs   and   runs   of   spaces.


Blank lines above; Windows\r\nline endings too.
"""


@lru_cache(maxsize=4)
def _tokenizer_json(style: str) -> str:
    """A byte-level BPE trained on _CORPUS; style 'qwen2' (regex split) or 'smollm' (digits+gpt2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mixqrt.generation.tokenizer import _QWEN2_RE

    tk = Tokenizer(models.BPE())
    if style == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_RE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tk.to_str()


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")   # round to nearest even


def write_safetensors(path, tensors: dict, dtype: str = "F32", metadata: dict | None = None) -> Path:
    """Write float32 arrays as F32/F16/BF16 safetensors (header + contiguous data)."""
    header, blobs, pos = {}, [], 0
    for name, a in tensors.items():
        a = np.asarray(a, dtype=np.float32)
        if dtype == "BF16":
            raw = _to_bf16_bits(a).tobytes()
        elif dtype == "F16":
            raw = a.astype("<f2").tobytes()
        else:
            raw = a.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
    return path


def __getattr__(name):          # ARCHS: every registered architecture (mixqrt.models.arch), on first use
    if name == "ARCHS":
        from mixqrt.models import arch
        return arch.names()
    raise AttributeError(name)


def _arch(name: str):
    from mixqrt.models import arch
    a = arch.find(name)
    if a is None:
        from mixqrt.models import arch as reg
        raise ValueError(f"arch must be one of {reg.names()}, got {name!r}")
    return a


def head_dim_of(arch: str) -> int:
    return _arch(arch).tiny.get("head_dim", HEAD_DIM)


def tiny_config(arch: str = "qwen2", tied: bool = True) -> dict:
    """The tiny model's config.json: the shared sizes, then the architecture's own keys (Arch.tiny; a
    None value removes a shared key)."""
    a = _arch(arch)
    cfg = {
        "architectures": [a.hf_class],
        "model_type": a.name, "hidden_act": "silu", "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
        "max_position_embeddings": 256, "vocab_size": VOCAB, "tie_word_embeddings": tied,
        "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    for k, v in a.tiny.items():
        if v is None and k in cfg and k not in ("final_logit_softcapping",):
            del cfg[k]
        else:
            cfg[k] = v
    return cfg


def tiny_weights(arch: str = "qwen2", tied: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights at realistic scale: linears ~ N(0, 1/in), norms ~ 1, q/k biases O(0.1-1)."""
    rng = np.random.default_rng(seed)

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    a = _arch(arch)
    cfg = tiny_config(arch, tied)
    one = 0.0 if a.norm_plus_one else 1.0          # such norms multiply by (1 + weight)

    def norm(n):
        return (one + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hd = head_dim_of(arch)
    w = {"model.embed_tokens.weight": (rng.standard_normal((VOCAB, HIDDEN)) * 0.05).astype(np.float32),
         "model.norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = lin(HEADS * hd, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * hd, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * hd, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * hd)
        if a.qk_norm:
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        if a.ffn_norms:
            w[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            w[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
        if a.qkv_bias == "always":
            w[p + "self_attn.q_proj.bias"] = (0.3 * rng.standard_normal(HEADS * HEAD_DIM)).astype(np.float32)
            w[p + "self_attn.k_proj.bias"] = (0.5 * rng.standard_normal(KV_HEADS * HEAD_DIM)).astype(np.float32)
            w[p + "self_attn.v_proj.bias"] = (0.05 * rng.standard_normal(KV_HEADS * HEAD_DIM)).astype(np.float32)
        if a.moe:
            mi, ne, sh = cfg["moe_intermediate_size"], cfg["num_experts"], cfg.get("shared_expert_intermediate_size")
            w[p + "mlp.gate.weight"] = lin(ne, HIDDEN)
            for e in range(ne):
                w[f"{p}mlp.experts.{e}.gate_proj.weight"] = lin(mi, HIDDEN)
                w[f"{p}mlp.experts.{e}.up_proj.weight"] = lin(mi, HIDDEN)
                w[f"{p}mlp.experts.{e}.down_proj.weight"] = lin(HIDDEN, mi)
            if sh:
                w[p + "mlp.shared_expert.gate_proj.weight"] = lin(sh, HIDDEN)
                w[p + "mlp.shared_expert.up_proj.weight"] = lin(sh, HIDDEN)
                w[p + "mlp.shared_expert.down_proj.weight"] = lin(HIDDEN, sh)
                w[p + "mlp.shared_expert_gate.weight"] = lin(1, HIDDEN)
            continue
        w[p + "mlp.gate_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = lin(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTER)
    if not tied:
        w["lm_head.weight"] = lin(VOCAB, HIDDEN)
    return w


def make_tiny_hf_model(dir, arch: str = "qwen2", tied: bool = True, seed: int = 0, dtype: str = "bf16",
                       sharded: bool = False, config_extra: dict | None = None) -> Path:
    """Write a complete tiny HF model folder and return its path (config_extra: keys set in config.json,
    e.g. a Llama 3 rope_scaling)."""
    a = _arch(arch)
    st_dtype = {"bf16": "BF16", "f16": "F16", "f32": "F32"}[dtype]
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**tiny_config(arch, tied), **(config_extra or {})}
    cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = tiny_weights(arch, tied, seed)
    if sharded:
        names = list(weights)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half],
                  "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for fname, group in shards.items():
            write_safetensors(d / fname, {n: weights[n] for n in group}, st_dtype, {"format": "pt"})
            weight_map.update({n: fname for n in group})
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    else:
        write_safetensors(d / "model.safetensors", weights, st_dtype, {"format": "pt"})
    (d / "tokenizer.json").write_text(_tokenizer_json(a.tiny_tokenizer))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None if a.tiny_tokenizer == "qwen2" else "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML,
        "model_max_length": 256}, indent=2))
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": True,
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}, indent=2))
    return d


def make_tiny_gguf(hf_dir, path, qtype: str = "F32", edit=None, arch: str | None = None,
                   extra_tensors: dict | None = None) -> Path:
    """Convert a tiny HF folder to GGUF the way llama.cpp's convert_hf_to_gguf.py does.

    edit(weights) may change the HF-named float32 dict first (tests drop or poison tensors);
    arch overrides general.architecture (tests write unknown ones); extra_tensors: GGUF-named
    float32 arrays written as they are.
    """
    import gguf

    from mixqrt.io.gguf import add_config_to_gguf, hf_to_gguf_name, permute_qk

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    from mixqrt.models import arch as archs
    a = archs.get(cfg["model_type"])
    arch, arch_override = a.name, arch
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    from mixqrt.io.hf import SafetensorsFile
    files = [SafetensorsFile(p) for p in sorted(hf_dir.glob("*.safetensors"))]
    weights = {n: f.read(n) for f in files for n in f.tensors}
    for f in files:
        f.close()
    if edit is not None:
        edit(weights)

    w = gguf.GGUFWriter(str(path), (a.gguf_name or arch) if arch_override is None else arch_override)
    add_config_to_gguf(w, cfg)
    if cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":             # the converter's rope_freqs.weight: HF inv / this
        from mixqrt.models.qwen2 import rope_inv_freq
        d = cfg["head_dim"]
        plain = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
        w.add_tensor("rope_freqs.weight", (plain / rope_inv_freq(rs, cfg["rope_theta"], d)).astype(np.float32))
    # vocabulary padded to the embedding rows with unused [PAD] tokens, as the converter does
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i < len(vocab):
            tokens.append(vocab[i][0])
            types.append(3 if i in added and added[i]["special"] else 1)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(a.tiny_tokenizer)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    spec_ = a
    for name, a in weights.items():
        gname = hf_to_gguf_name(name, arch)
        if spec_.norm_plus_one and name.endswith("norm.weight"):
            a = a + np.float32(1.0)                     # llama.cpp's Gemma converter stores 1 + w
        if spec_.gguf_permuted_qk and ".self_attn.q_proj." in name:
            a = permute_qk(a, cfg["num_attention_heads"])
        elif spec_.gguf_permuted_qk and ".self_attn.k_proj." in name:
            a = permute_qk(a, cfg["num_key_value_heads"])
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a.astype(np.float32))   # norms and biases stay F32, like llama.cpp
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qt), raw_dtype=qt)
    for gname, a in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)

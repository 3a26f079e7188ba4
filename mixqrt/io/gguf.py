"""GGUF files as a Source: HF names, HF layouts, float32 tensors one at a time.

The header is parsed here rather than with gguf.GGUFReader: the reader builds a numpy object per
string and takes ~8 s on a 150k-token vocabulary, and it does not check that tensor spans lie
inside the file. This parser reads the same format strictly (every length and offset checked
against the file size) in a fraction of a second; gguf.quants still does the dequantization.

llama.cpp's converter permutes the q/k rows of llama-architecture models so that its own RoPE
(adjacent pairs) can be used; we undo it, so every graph uses HF's rotate-half RoPE. Qwen2 GGUFs
are written unpermuted (llama.cpp runs NEOX-style RoPE for them), so they pass through untouched.
"""
from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mixqrt.generation.embed import GGUF_POOLING, dense_name
from mixqrt.errors import FormatError, ModelError
from mixqrt.io.source import Source, check_config, check_layout
from mixqrt.models.config_limits import check_config_limits, check_values
from mixqrt.models import arch as archs

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_STRING = 1 << 30
MAX_NESTING = 4          # arrays of arrays: llama.cpp writes none deeper than 2

# value type code -> (struct format, size); 8 = string and 9 = array are handled by hand
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
               10: "<u8", 11: "<i8", 12: "<f8"}

# GGUF name -> HF name, per layer and global
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_MOE_NAMES = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
              "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
              "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
              "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# routed experts: one GGUF tensor [experts, out, in] per kind, seen as one HF tensor per expert
_EXPS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def _layer_names(arch: str | None) -> dict:
    """GGUF layer tensor -> HF suffix for architecture `arch` (its Arch: q/k norms, experts, its own
    names over the shared ones); the shared ones for None or an unknown name."""
    a = archs.find(arch)
    if a is None:
        return _LAYER_NAMES
    return {**_LAYER_NAMES, **(_QK_NORM_NAMES if a.qk_norm else {}), **(_MOE_NAMES if a.moe else {}),
            **a.gguf_names}


# sentence-transformers dense projections after pooling (llama.cpp LLM_TENSOR_DENSE_2_OUT / _3_OUT)
EMBED_DENSE_TENSORS = ("dense_2.weight", "dense_3.weight")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# tensors that rescale RoPE's frequencies: a reader that cannot apply them must refuse the file
# (rope_freqs.weight, Llama 3's factors, is read into config.rope_scaling where the graph applies it)
_ROPE_FACTOR_TENSORS = {"rope_freqs.weight": "rope_scaling type 'llama3' frequency factors",
                        "rope_factors_long.weight": "rope_scaling type 'longrope' factors",
                        "rope_factors_short.weight": "rope_scaling type 'longrope' factors"}


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """HF name for a GGUF tensor name of architecture `arch`; None for tensors the graphs do not use."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = _layer_names(arch)
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in names:
        return f"model.layers.{int(m.group(1))}.{names[m.group(2)]}"
    return None


_GLOBAL_TO_GGUF = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_to_gguf_name(name: str, arch: str | None = None) -> str:
    """GGUF tensor name for an HF name (inverse of gguf_to_hf_name), as llama.cpp's converter writes it."""
    if name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[name]
    to_gguf = {v: k for k, v in _layer_names(arch).items()}
    m = _HF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in to_gguf:
        return f"blk.{int(m.group(1))}.{to_gguf[m.group(2)]}"
    raise ModelError(f"tensor {name!r} has no GGUF name")


def add_config_to_gguf(writer, cfg: dict) -> None:
    """Write an HF config's hyperparameters as llama.cpp's converter does (inverse of
    config_from_metadata), onto a gguf.GGUFWriter."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's permute(): per head, interleaved pairs -> halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permute() (HF halves -> interleaved pairs); used by tests to build GGUFs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- strict header parser --------------------------------------------------------------------

class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise FormatError(f"{self.path}: truncated GGUF: {what} needs {n} bytes at offset {self.pos}, "
                              f"file has {self.size}")

    def scalar(self, code: int, what: str):
        fmt, n = _SCALARS[code]
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar(10, what + " length")
        if n > MAX_STRING:
            raise FormatError(f"{self.path}: {what}: string length {n} is implausible")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp stores some vocab entries as raw bytes; keep them round-trippable
            return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            etype = self.scalar(4, what + " element type")
            n = self.scalar(10, what + " length")
            if etype in _NP_SCALARS:
                width = _SCALARS[etype][1]
                if n > (self.size - self.pos) // width:
                    self.need(n * width, what)
                arr = np.frombuffer(self.buf, dtype=_NP_SCALARS[etype], count=n, offset=self.pos).copy()
                self.pos += n * width
                return arr.astype(bool) if etype == 7 else arr
            if etype == 8:
                if n > self.size - self.pos:          # each string costs at least 8 bytes
                    self.need(n * 8, what)
                return [self.string(what) for _ in range(n)]
            if etype == 9:
                if depth >= MAX_NESTING:
                    raise FormatError(f"{self.path}: {what}: arrays nested deeper than {MAX_NESTING}")
                if n > (self.size - self.pos) // 12:  # each inner array costs at least 12 bytes
                    self.need(n * 12, what)
                return [self.value(9, what, depth + 1) for _ in range(n)]
            raise FormatError(f"{self.path}: {what}: unknown array element type {etype}")
        raise FormatError(f"{self.path}: {what}: unknown value type {vtype}")


def read_gguf_header(buf, path: Path):
    """(metadata dict, {gguf tensor name: (dims ne0-first, type, absolute offset, nbytes)})."""
    c = _Cursor(buf, path)
    c.need(4, "magic")
    if bytes(buf[0:4]) != GGUF_MAGIC:
        raise FormatError(f"{path}: not a GGUF file (magic {bytes(buf[0:4])!r})")
    c.pos = 4
    version = c.scalar(4, "version")
    if version not in (2, 3):
        hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
        raise FormatError(f"{path}: unsupported GGUF version {version}{hint}")
    n_tensors = c.scalar(10, "tensor count")
    n_kv = c.scalar(10, "metadata count")
    if n_tensors > c.size // 24 or n_kv > c.size // 12:  # each entry needs at least that many bytes
        raise FormatError(f"{path}: truncated GGUF: header claims {n_tensors} tensors / {n_kv} keys")
    meta = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}")
        vtype = c.scalar(4, f"type of {key}")
        meta[key] = c.value(vtype, key)
    infos = {}
    for i in range(n_tensors):
        name = c.string(f"tensor name #{i}")
        nd = c.scalar(4, f"tensor {name} rank")
        if not 1 <= nd <= MAX_DIMS:
            raise FormatError(f"{path}: tensor {name!r} has rank {nd}")
        dims = tuple(c.scalar(10, f"tensor {name} dims") for _ in range(nd))
        ttype = c.scalar(4, f"tensor {name} type")
        offset = c.scalar(10, f"tensor {name} offset")
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise FormatError(f"{path}: tensor {name!r} has unknown ggml type {ttype}") from None
        block, nbytes_block = GGML_QUANT_SIZES[qtype]
        if any(d <= 0 for d in dims) or dims[0] % block:
            raise FormatError(f"{path}: tensor {name!r} dims {dims} do not fit {qtype.name} blocks of {block}")
        nbytes = int(np.prod(dims, dtype=object)) // block * nbytes_block
        if name in infos:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        infos[name] = (dims, qtype, offset, nbytes)
    align = meta.get("general.alignment", 32)
    if isinstance(align, (bool, np.bool_)) or not isinstance(align, (int, np.integer)):
        raise FormatError(f"{path}: general.alignment must be an integer, got {type(align).__name__}")
    align = int(align)
    if align <= 0 or align & (align - 1):
        raise FormatError(f"{path}: general.alignment={align} is not a power of two")
    data_start = (c.pos + align - 1) // align * align
    out = {}
    for name, (dims, qtype, offset, nbytes) in infos.items():
        start = data_start + offset
        if offset % align or start + nbytes > c.size:
            raise FormatError(f"{path}: tensor {name!r} spans bytes [{start}, {start + nbytes}) but the "
                              f"file has {c.size} (truncated or corrupt)")
        out[name] = (dims, qtype, start, nbytes)
    return meta, out


# -- metadata -> HF config -------------------------------------------------------------------

# HF config key -> GGUF metadata key (after "{arch}."), for reading and for error messages
_HF_TO_GGUF_KEY = {
    "num_hidden_layers": "block_count", "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
}


def meta_int(meta: dict, key: str, path, default=None, required=True):
    """An integer GGUF metadata value; ModelError naming the key for a string, float, bool or array."""
    v = meta.get(key, default)
    if v is None:
        if required:
            raise ModelError(f"{path}: GGUF metadata key {key} is missing")
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ModelError(f"{path}: GGUF metadata key {key} must be an integer, got {type(v).__name__} "
                         f"{str(v)[:40]!r}")
    return int(v)


def meta_float(meta: dict, key: str, path, default=None, required=True):
    """A finite float GGUF metadata value; ModelError naming the key otherwise."""
    v = meta.get(key, default)
    if v is None:
        if required:
            raise ModelError(f"{path}: GGUF metadata key {key} is missing")
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not np.isfinite(v):
        raise ModelError(f"{path}: GGUF metadata key {key} must be a finite number, got {type(v).__name__} "
                         f"{str(v)[:40]!r}")
    return float(v)


def meta_str(meta: dict, key: str, path, default=None):
    v = meta.get(key, default)
    if v is not None and not isinstance(v, str):
        raise ModelError(f"{path}: GGUF metadata key {key} must be a string, got {type(v).__name__}")
    return v


class _ArchMeta:
    """What an architecture's gguf_config reads: "{general.architecture}.KEY" values, checked, and
    the sizes already read."""

    def __init__(self, meta, garch, path, hidden, n_head, head_dim, tensors):
        self.meta, self.garch, self.path = meta, garch, path
        self.hidden, self.n_head, self.head_dim, self.tensors = hidden, n_head, head_dim, tensors

    def int(self, key, default=None, required=True):
        return meta_int(self.meta, f"{self.garch}.{key}", self.path, default, required)

    def float(self, key, default=None, required=True):
        return meta_float(self.meta, f"{self.garch}.{key}", self.path, default, required)


def config_from_metadata(meta: dict, tensors: dict, path: Path) -> dict:
    garch = meta.get("general.architecture")
    a = archs.by_gguf_name(garch) if isinstance(garch, str) else None
    if a is None:
        raise ModelError(f"{path}: unknown architecture {str(garch)[:40]} "
                         f"(supported: {', '.join(x.gguf_name or x.name for x in map(archs.get, archs.names()))})")
    arch = a.name
    names = {hf: f"{garch}.{g}" for hf, g in _HF_TO_GGUF_KEY.items()}

    def key_int(hf, default=None, required=True):
        return meta_int(meta, names[hf], path, default, required)

    n_head = key_int("num_attention_heads")
    hidden = key_int("hidden_size")
    # bounds before any arithmetic: head_count=0 is a named error, not a ZeroDivisionError
    check_config_limits({"num_attention_heads": n_head, "hidden_size": hidden}, str(path), names)
    tokens = meta.get("tokenizer.ggml.tokens")
    emb = tensors.get("token_embd.weight")
    if tokens is not None:
        if not isinstance(tokens, list):
            raise ModelError(f"{path}: GGUF metadata key tokenizer.ggml.tokens must be an array of strings")
        vocab = len(tokens)
    elif emb is not None and len(emb[0]) == 2:
        vocab = int(emb[0][1])
    else:
        vocab = meta_int(meta, f"{arch}.vocab_size", path)
    k_len = key_int("head_dim", hidden // n_head)
    v_len = meta_int(meta, f"{garch}.attention.value_length", path, k_len)
    if v_len != k_len:
        raise ModelError(f"{path}: GGUF metadata {garch}.attention.value_length={v_len} differs from "
                         f"{garch}.attention.key_length={k_len} (head_dim mismatch; not supported)")
    cfg = {
        "architectures": [a.hf_class],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": key_int("intermediate_size"),
        "num_hidden_layers": key_int("num_hidden_layers"),
        "num_attention_heads": n_head,
        "num_key_value_heads": key_int("num_key_value_heads", n_head),
        "head_dim": k_len,
        "rms_norm_eps": meta_float(meta, names["rms_norm_eps"], path),
        "rope_theta": meta_float(meta, names["rope_theta"], path, 10000.0),
        "max_position_embeddings": key_int("max_position_embeddings"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if a.qkv_bias == "config":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if a.gguf_config is not None:
        a.gguf_config(_ArchMeta(meta, garch, path, hidden, n_head, k_len, tensors), cfg)
    scaling = meta_str(meta, f"{garch}.rope.scaling.type", path)
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"type": scaling, "rope_type": scaling,
                               "factor": meta_float(meta, f"{garch}.rope.scaling.factor", path, 1.0)}
        orig = meta_int(meta, f"{garch}.rope.scaling.original_context_length", path, required=False)
        if orig:
            cfg["rope_scaling"]["original_max_position_embeddings"] = orig
    for tok in ("bos", "eos", "padding"):
        v = meta_int(meta, f"tokenizer.ggml.{tok}_token_id", path, required=False)
        if v is not None:
            cfg["pad_token_id" if tok == "padding" else f"{tok}_token_id"] = v
    check_config_limits(cfg, str(path), names)
    return cfg


def embedding_from_metadata(meta: dict, tensors: dict, path) -> dict | None:
    """mixqrt.generation.embed's settings from GGUF metadata, as llama.cpp reads them: ``<arch>.pooling_type``
    (llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last), ``<arch>.attention.causal`` and the dense
    projections ``dense_2`` / ``dense_3``. None for a file that names none of them (a plain LM)."""
    garch = meta.get("general.architecture")
    pt = meta_int(meta, f"{garch}.pooling_type", path, required=False)
    causal = meta.get(f"{garch}.attention.causal")
    if causal is not None and not isinstance(causal, (bool, np.bool_)):
        raise ModelError(f"{path}: GGUF metadata key {garch}.attention.causal must be a bool")
    dense = [n for n in EMBED_DENSE_TENSORS if n in tensors]
    if pt is None and causal is None and not dense and garch != "gemma-embedding":
        return None
    if pt is not None and pt != -1 and pt not in GGUF_POOLING:
        raise ModelError(f"{path}: GGUF metadata {garch}.pooling_type={pt} is not supported "
                         f"(0 none, 1 mean, 2 cls, 3 last)")
    pooling = GGUF_POOLING.get(pt)
    causal = bool(causal) if causal is not None else garch != "gemma-embedding"
    return {"pooling": pooling, "normalize": True, "causal": causal,
            "dense": [[dense_name(i), None, None] for i in range(len(dense))],
            "matryoshka": garch == "gemma-embedding" or (garch == "qwen3" and pooling == "last")}


def generation_config_from_metadata(meta: dict, eos_ids, path="GGUF") -> dict:
    gen = {"eos_token_id": sorted(eos_ids) if len(eos_ids) > 1 else next(iter(eos_ids), None)}
    for k in ("bos_token_id", "padding_token_id"):
        v = meta_int(meta, f"tokenizer.ggml.{k}", path, required=False)
        if v is not None:
            gen["pad_token_id" if k.startswith("padding") else k] = v
    # newer converters copy generation_config.json's sampling defaults into general.sampling.*
    for gk, hk in (("top_k", "top_k"), ("top_p", "top_p"), ("temp", "temperature"),
                   ("min_p", "min_p"), ("penalty_repeat", "repetition_penalty")):
        key = f"general.sampling.{gk}"
        if meta.get(key) is not None:
            gen[hk] = meta_float(meta, key, path) if hk != "top_k" else meta_int(meta, key, path)
    if "temperature" in gen or "top_p" in gen or "top_k" in gen:
        gen["do_sample"] = True
    return gen


# -- the Source --------------------------------------------------------------------------------

class GGUFSource(Source):
    """A .gguf file; tensors are dequantized to float32 on .get, one at a time."""

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:                         # an empty file cannot be mapped
            raise FormatError(f"{self.path}: empty file, not a GGUF model") from None
        try:
            self.metadata, self._gguf = read_gguf_header(self._map, self.path)
            # every value, before any reaches a str/int/float (the vocabulary keeps raw bytes as
            # surrogate escapes on purpose: the Tokenizer reads those)
            check_values(self.metadata, str(self.path), skip=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
            self.config = config_from_metadata(self.metadata, self._gguf, self.path)
            self.arch = self.config["model_type"]
            self._arch = archs.get(self.arch)
            self._rope_factors()
            check_config(self.config, str(self.path),
                         {hf: f"{self.metadata['general.architecture']}.{g}" for hf, g in _HF_TO_GGUF_KEY.items()})
            self._names = {}                        # HF name -> GGUF name
            self._expert = {}                       # HF name of a routed expert -> its index in the GGUF tensor
            self.unmapped = []                      # GGUF tensors the graphs do not use
            for gname, (dims, qtype, _, _) in self._gguf.items():
                m = _EXPS_RE.fullmatch(gname) if self._arch.moe else None
                if m is not None and len(dims) == 3:
                    for e in range(int(dims[2])):
                        hname = f"model.layers.{int(m.group(1))}.mlp.experts.{e}.{m.group(2)}_proj.weight"
                        self._names[hname], self._expert[hname] = gname, e
                        self._info[hname] = ((int(dims[1]), int(dims[0])), qtype.name)
                    continue
                hname = gguf_to_hf_name(gname, self.arch)
                if hname is None and gname in _ROPE_FACTOR_TENSORS:
                    continue                         # read (or refused) by _rope_factors above
                if hname is None:
                    self.unmapped.append(gname)
                    continue
                self._names[hname] = gname
                shape = tuple(int(d) for d in reversed(dims))
                self._info[hname] = ((1,) + shape if hname.endswith("shared_expert_gate.weight") else shape,
                                     qtype.name)
            check_layout(self)
            from mixqrt.generation.tokenizer import eos_ids_from_gguf
            self.embedding = embedding_from_metadata(self.metadata, self._gguf, self.path)
            self.generation_config = generation_config_from_metadata(
                self.metadata, eos_ids_from_gguf(self.metadata, str(self.path)), self.path)
        except BaseException:
            self.close()
            raise

    def _rope_factors(self) -> None:
        """Llama 3's rope_freqs.weight (per-frequency divisors) into config.rope_scaling, where the graph
        applies it; any other RoPE factor tensor, or one on an architecture without it, is refused:
        skipping it would run every position with the wrong frequencies."""
        for gname, what in _ROPE_FACTOR_TENSORS.items():
            if gname not in self._gguf:
                continue
            if gname != "rope_freqs.weight" or not self._arch.gguf_rope_freqs:
                raise ModelError(f"{self.path}: tensor {gname!r} ({what}) is not supported for architecture "
                                 f"{self.arch}")
            dims, qtype, start, nbytes = self._gguf[gname]
            half = self.config["head_dim"] // 2
            if tuple(dims) != (half,) or qtype != GGMLQuantizationType.F32:
                raise ModelError(f"{self.path}: tensor {gname!r} must be F32 of {half} values (head_dim / 2), "
                                 f"got {qtype.name} {tuple(dims)}")
            ff = np.frombuffer(self._map, dtype="<f4", count=half, offset=start).astype(np.float64)
            if not np.isfinite(ff).all() or (ff <= 0).any():
                raise ModelError(f"{self.path}: tensor {gname!r} must hold positive finite factors")
            self.config["rope_scaling"] = {"rope_type": "llama3", "freq_factors": [float(f) for f in ff]}

    def _load_tokenizer(self):
        from mixqrt.generation.tokenizer import Tokenizer
        return Tokenizer.from_gguf_metadata(self.metadata, where=str(self.path))

    def extra_tensor(self, name: str) -> np.ndarray:
        """An embedding model's dense projection (mixqrt.generation.embed.dense_name(i): GGUF dense_2, dense_3)
        as float32 [out, in]."""
        present = [n for n in EMBED_DENSE_TENSORS if n in self._gguf]
        gname = dict((dense_name(i), n) for i, n in enumerate(present)).get(name)
        if gname is None:
            raise ModelError(f"{self.path}: no embedding tensor named {name!r}")
        dims, qtype, start, nbytes = self._gguf[gname]
        shape = tuple(int(d) for d in reversed(dims))
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
        w = self._decode(gname, raw, qtype, shape)
        if not np.isfinite(w).all():
            raise FormatError(f"{self.path}: tensor {gname!r} holds NaN/Inf values")
        return w

    def _span(self, name: str):
        """(GGUF name, ggml type, start, nbytes, HF shape) of an HF tensor: one expert's slice of a
        stacked expert tensor, else the whole GGUF tensor."""
        gname = self._names[name]
        dims, qtype, start, nbytes = self._gguf[gname]
        e = self._expert.get(name)
        if e is None:
            return gname, qtype, start, nbytes, tuple(int(d) for d in reversed(dims))
        per = nbytes // int(dims[2])
        return gname, qtype, start + e * per, per, (int(dims[1]), int(dims[0]))

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """(raw bytes of the GGUF tensor as a read-only uint8 view, ggml type name), HF name in."""
        _, qtype, start, nbytes, _ = self._span(name)
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start), qtype.name

    def _decode(self, gname: str, raw: np.ndarray, qtype, shape: tuple) -> np.ndarray:
        """Raw bytes of whole rows of a GGUF tensor -> float32 of `shape` (a fresh array)."""
        if qtype == GGMLQuantizationType.F32:
            return raw.view("<f4").reshape(shape).copy()
        if qtype == GGMLQuantizationType.F16:
            return raw.view("<f2").astype(np.float32).reshape(shape)
        if qtype == GGMLQuantizationType.BF16:
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        try:
            w = dequantize(raw.reshape(-1, raw.size // (int(np.prod(shape)) // shape[-1])), qtype)
        except NotImplementedError:
            raise ModelError(f"{self.path}: tensor {gname!r}: cannot dequantize ggml type "
                             f"{qtype.name}") from None
        return np.asarray(w, dtype=np.float32).reshape(shape)

    def rows(self, name: str, idx) -> np.ndarray:
        """Only the rows asked for are read and dequantized (GGUF rows are contiguous blocks)."""
        gname, qtype, start, nbytes, shape = self._span(name)
        idx = np.asarray(idx, dtype=np.int64)
        if len(shape) != 2 or (self._arch.gguf_permuted_qk and gname.endswith(("attn_q.weight", "attn_k.weight"))) \
                or idx.size == 0 or idx.min() < 0 or idx.max() >= shape[0]:
            return super().rows(name, idx)             # row permutation, odd shapes, bad indices
        rb = nbytes // shape[0]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start).reshape(shape[0], rb)
        w = self._decode(gname, np.ascontiguousarray(raw[idx]).reshape(-1), qtype, (idx.size, shape[1]))
        return np.ascontiguousarray(w, dtype=np.float32)

    def _read(self, name: str) -> np.ndarray:
        gname, qtype, start, nbytes, shape = self._span(name)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
        w = self._decode(gname, raw, qtype, shape)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)                      # GGUF stores the one-row gate as a vector
        if self._arch.gguf_permuted_qk and gname.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_qk(w, self.config["num_attention_heads"])
        elif self._arch.gguf_permuted_qk and gname.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_qk(w, self.config["num_key_value_heads"])
        if self._arch.norm_plus_one and gname.endswith("norm.weight"):
            w = w - np.float32(1.0)                   # the converter stored 1 + HF's weight
        w = np.ascontiguousarray(w, dtype=np.float32)
        del raw
        self._release(start, nbytes)
        return w

    def _release(self, start: int, nbytes: int) -> None:
        """Unmap this tensor's file pages from our RSS (they stay in the page cache): streaming a
        model through the quantizer must not accumulate the whole file in the process's RSS."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start - start % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, lo, start + nbytes - lo)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        m, f = getattr(self, "_map", None), getattr(self, "_file", None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass                                # a raw() view is still alive; GC closes it later
            self._map = None
        if f is not None:
            f.close()
            self._file = None

"""Synthetic models of real shapes with seeded random weights: a Hugging Face folder (Qwen2-7B's
config and tensor shapes, bf16 shards) and a model-shaped .mxq in a recipe's packed formats. Speed
and memory runs use them at sizes no real checkpoint here has; the tests at tiny sizes (same code).
The command lines are benchmarks/synthetic_checkpoint.py and benchmarks/synthetic_mxq.py.

## The Hugging Face folder (write_checkpoint)

    python benchmarks/synthetic_checkpoint.py --out /tmp/mixqrt-7b/qwen2-7b-synthetic
    python benchmarks/synthetic_checkpoint.py --out /tmp/x --dims 64,2,4,2,128,448 --tokenizer tiny

The hub is not reachable here, so the 7B-at-full-size measurements (docs/qwen2-7b.md) run on a
checkpoint that has everything of Qwen2-7B-Instruct but its trained values: config.json (hidden
3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocab 152064, untied lm_head, rope
1e6, q/k/v bias), bf16 weights in model-0000N-of-0000M.safetensors shards with
model.safetensors.index.json (about 15.2 GB, like the real one), tokenizer.json, tokenizer_config.json
with the ChatML template, generation_config.json.

Values: per tensor a generator seeded from (seed, tensor index) draws N(0, 1); projections get
std 0.02 (embedding 0.015) times a log-normal per-row scale, plus a few outliers per row (4 entries
at 6-12 sigma), so row-wise quantizers meet the spread real checkpoints have; biases are small
(std 0.01-0.1), norm weights are |1 + 0.2 N| with a few channels near 4-8 (the "massive
activation" channels real Qwen2 norms carry). Values are rounded to bf16. Speed and memory do not
depend on the values; quality (perplexity) does, so nothing measured on these weights is a quality
number.

Streaming: every shape is known from the config, so each shard's header is written first and the
tensor bytes follow in chunks of ~16M values; at most one chunk is in memory. Each shard is written
to a temporary name and renamed into place (atomic per file); a shard already present with the
right size and header is kept, so an interrupted run resumes. The index and the small JSON files
come last: a folder with model.safetensors.index.json is complete.

The tokenizer: --tokenizer PATH.gguf rebuilds the Qwen tokenizer from a Qwen GGUF (default: the
Qwen2.5-Coder-0.5B test model of mixqrt.testing, whose 151,936-entry vocabulary is Qwen2's; the tiny
one when that cannot be fetched), PATH/tokenizer.json is copied, 'tiny' uses mixqrt.testing.tiny's
400-token BPE. Embedding rows beyond the tokenizer's
vocabulary are padding that no encode produces, as in the real checkpoint (151,646 tokens, 152,064
rows).
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

from mixqrt.io.atomic import atomic_write

# Qwen/Qwen2-7B-Instruct's config.json
QWEN2_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}

# Qwen2-7B-Instruct's tokenizer_config.json chat template (plain ChatML with a default system turn)
QWEN2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHUNK_VALUES = 1 << 24          # values per generated chunk (64 MiB of float32); fixed so output is too
MAX_SHARD_BYTES = 4_000_000_000  # 15.2 GB -> 4 shards, as the real Qwen2-7B ships
OUTLIERS_PER_ROW = 4


def scaled_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """Qwen2-7B's config with other dimensions (the same code path at test size)."""
    cfg = dict(QWEN2_7B_CONFIG)
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
               max_window_layers=layers)
    return cfg


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """[(HF name, shape, kind)] in the state-dict order transformers saves Qwen2 in."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter, vocab = h // nh, cfg["intermediate_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (nh * hd, h), "proj"), (p + "self_attn.q_proj.bias", (nh * hd,), "q_bias"),
                (p + "self_attn.k_proj.weight", (nkv * hd, h), "proj"), (p + "self_attn.k_proj.bias", (nkv * hd,), "k_bias"),
                (p + "self_attn.v_proj.weight", (nkv * hd, h), "proj"), (p + "self_attn.v_proj.bias", (nkv * hd,), "v_bias"),
                (p + "self_attn.o_proj.weight", (h, nh * hd), "proj"),
                (p + "mlp.gate_proj.weight", (inter, h), "proj"), (p + "mlp.up_proj.weight", (inter, h), "proj"),
                (p + "mlp.down_proj.weight", (h, inter), "proj"),
                (p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), "proj"))
    return out


def _nvalues(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_shards(specs, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[tuple]]:
    """Greedy split in order, like transformers' max_shard_size: a shard closes before it would overflow."""
    shards, cur, size = [], [], 0
    for spec in specs:
        nb = 2 * _nvalues(spec[1])
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += nb
    if cur:
        shards.append(cur)
    return shards


def shard_header(specs) -> bytes:
    """The safetensors header (8-byte length + JSON, padded to 8) for BF16 tensors stored in order."""
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        nb = 2 * _nvalues(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + nb]}
        pos += nb
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h


# -- values -------------------------------------------------------------------------------------

def _bf16_into(buf: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest (in place on buf; finite values only)."""
    u = buf.view(np.uint32)
    u += 0x8000
    np.copyto(out, u.view(np.uint16)[1::2])     # little-endian: the high half is the odd u16
    return out


def tensor_chunks(kind: str, shape, seed: int, index: int):
    """Yield the tensor's values as float32 chunks of whole rows (reused buffers: consume before next)."""
    rng = np.random.default_rng([seed, index, 0])       # bulk normals
    aux = np.random.default_rng([seed, index, 1])       # row scales, outliers, special channels
    if len(shape) == 1:
        n = shape[0]
        x = rng.standard_normal(n, dtype=np.float32)
        if kind == "norm":
            x = np.abs(1.0 + 0.2 * x)
            hot = aux.choice(n, size=min(n, 3), replace=False)
            x[hot] = aux.uniform(4.0, 8.0, size=hot.size)
        else:
            x *= {"q_bias": 0.05, "k_bias": 0.1, "v_bias": 0.01}[kind]
        yield x.astype(np.float32)
        return
    rows, cols = shape
    std = 0.015 if kind == "embed" else 0.02
    step = max(1, CHUNK_VALUES // cols)
    buf = np.empty(min(rows, step) * cols, np.float32)
    k = min(OUTLIERS_PER_ROW, cols)
    for r0 in range(0, rows, step):
        r = min(step, rows - r0)
        x = buf[: r * cols]
        rng.standard_normal(dtype=np.float32, out=x)
        x2 = x.reshape(r, cols)
        scale = (std * aux.lognormal(0.0, 0.25, size=(r, 1))).astype(np.float32)
        x2 *= scale
        idx = aux.integers(0, cols, size=(r, k)) + (np.arange(r) * cols)[:, None]
        mag = aux.uniform(6.0, 12.0, size=(r, k)) * np.where(aux.random((r, k)) < 0.5, -1.0, 1.0)
        x[idx.ravel()] = (mag * scale).astype(np.float32).ravel()      # outliers at 6-12 row sigmas
        yield x2


def tensor_values(kind: str, shape, seed: int, index: int) -> np.ndarray:
    """The whole tensor as float32, exactly as stored (bf16-rounded); for tests, not for 7B."""
    parts = []
    for c in tensor_chunks(kind, shape, seed, index):
        c = np.ascontiguousarray(c, dtype=np.float32).reshape(-1).copy()
        bits = _bf16_into(c, np.empty(c.size, np.uint16))
        parts.append((bits.astype(np.uint32) << 16).view(np.float32))
    return np.concatenate(parts).reshape(shape)


# -- files --------------------------------------------------------------------------------------

def _write_atomic_text(path: Path, text: str) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def _shard_complete(path: Path, header: bytes, nbytes: int) -> bool:
    if not path.is_file() or path.stat().st_size != len(header) + nbytes:
        return False
    with open(path, "rb") as f:
        return f.read(len(header)) == header


def write_shard(path: Path, specs, seed: int, index0: int, progress=None) -> None:
    """Header first, then each tensor's bf16 bytes chunk by chunk; renamed into place when complete."""
    header = shard_header(specs)
    nbytes = sum(2 * _nvalues(s) for _, s, _ in specs)
    if _shard_complete(path, header, nbytes):
        if progress:
            progress(f"{path.name}: already complete, kept")
        return
    out = None
    with atomic_write(path) as f:                     # an error, or a short write, leaves no file
        f.write(header)
        for j, (name, shape, kind) in enumerate(specs):
            t = time.perf_counter()
            for chunk in tensor_chunks(kind, shape, seed, index0 + j):
                flat = chunk.reshape(-1)
                if out is None or out.size < flat.size:
                    out = np.empty(flat.size, np.uint16)
                f.write(memoryview(_bf16_into(flat, out[: flat.size])))
            if progress and len(shape) == 2:
                progress(f"{path.name}: {name} {shape} {time.perf_counter() - t:.1f} s")
        f.flush()
        if f.tell() != len(header) + nbytes:
            raise OSError(f"{path}: wrote {f.tell()} bytes, expected {len(header) + nbytes}")


def tokenizer_json(source) -> str:
    """tokenizer.json text from a GGUF (rebuilt), a tokenizer.json / HF folder, or 'tiny'."""
    if source in (None, "tiny"):
        from mixqrt.testing.tiny import _tokenizer_json
        return _tokenizer_json("qwen2")
    p = Path(source)
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.suffix == ".json":
        return p.read_text(encoding="utf-8")
    from mixqrt.io import open_source
    with open_source(p) as src:
        return src.tokenizer.backend.to_str()


def write_checkpoint(out_dir, cfg: dict | None = None, *, seed: int = 0, tokenizer="auto",
                     max_shard_bytes: int = MAX_SHARD_BYTES, progress=None) -> Path:
    """Write (or finish) the folder; returns its path. tokenizer: 'auto' | 'tiny' | path | tokenizer.json text."""
    cfg = dict(cfg or QWEN2_7B_CONFIG)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, str) and tokenizer.lstrip().startswith("{"):
        tok_text = tokenizer
    else:
        if tokenizer == "auto":
            from mixqrt.errors import ModelError
            from mixqrt.testing.models import model_path
            try:
                tokenizer = model_path("qwen")
            except ModelError:
                tokenizer = "tiny"
        tok_text = tokenizer_json(tokenizer)
    tok = json.loads(tok_text)
    n_tok = len(tok["model"]["vocab"]) + sum(1 for t in tok.get("added_tokens", ()) if t["content"] not in tok["model"]["vocab"])
    if n_tok > cfg["vocab_size"]:
        raise ValueError(f"tokenizer has {n_tok} tokens but vocab_size is {cfg['vocab_size']}")

    specs = tensor_specs(cfg)
    shards = plan_shards(specs, max_shard_bytes)
    m = len(shards)
    weight_map, index0, total = {}, 0, 0
    for k, group in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{m:05d}.safetensors"
        write_shard(out / fname, group, seed, index0, progress)
        index0 += len(group)
        for name, shape, _ in group:
            weight_map[name] = fname
            total += 2 * _nvalues(shape)

    _write_atomic_text(out / "tokenizer.json", tok_text)
    im_end = "<|im_end|>" if "<|im_end|>" in tok_text else None
    _write_atomic_text(out / "tokenizer_config.json", json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "chat_template": QWEN2_CHATML,
        "clean_up_tokenization_spaces": False, "eos_token": im_end, "errors": "replace",
        "model_max_length": cfg["max_position_embeddings"], "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}, indent=2))
    ids = {name: json.loads(tok_text)["model"]["vocab"].get(name) for name in ("<|endoftext|>", "<|im_end|>")}
    for t in tok.get("added_tokens", ()):
        ids[t["content"]] = t["id"]
    eot, im_end_id = ids.get("<|endoftext|>"), ids.get("<|im_end|>")
    gen = {"bos_token_id": eot, "pad_token_id": eot, "do_sample": True,
           "eos_token_id": [i for i in (im_end_id, eot) if i is not None],
           "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
           "transformers_version": "4.41.2"}
    _write_atomic_text(out / "generation_config.json", json.dumps(gen, indent=2))
    cfg = dict(cfg, bos_token_id=eot, eos_token_id=im_end_id if im_end_id is not None else eot)
    _write_atomic_text(out / "config.json", json.dumps(cfg, indent=2))
    _write_atomic_text(out / "model.safetensors.index.json", json.dumps(
        {"metadata": {"total_size": total, "synthetic": {"seed": seed, "generator": "mixqrt.testing.synthetic"}},
         "weight_map": weight_map}, indent=2))
    return out


def is_complete(out_dir, cfg: dict | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> bool:
    """True when the index exists and every shard has its full size (cheap: no data read)."""
    out = Path(out_dir)
    if not (out / "model.safetensors.index.json").is_file() or not (out / "config.json").is_file():
        return False
    shards = plan_shards(tensor_specs(dict(cfg or QWEN2_7B_CONFIG)), max_shard_bytes)
    for k, group in enumerate(shards, 1):
        p = out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        if not _shard_complete(p, shard_header(group), sum(2 * _nvalues(s) for _, s, _ in group)):
            return False
    return True


def checkpoint_main(argv=None) -> int:
    """The command line of benchmarks/synthetic_checkpoint.py."""
    ap = argparse.ArgumentParser(prog="synthetic_checkpoint.py",
                                 description="A synthetic Qwen2-7B Hugging Face folder: the real config and "
                                             "tensor shapes, seeded bf16 weights (mixqrt.testing.synthetic).")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dims", default=None, metavar="H,L,HEADS,KV,INTER,VOCAB",
                    help="scaled-down dimensions (default: Qwen2-7B's)")
    ap.add_argument("--tokenizer", default="auto", help="a Qwen .gguf, a tokenizer.json or HF folder, or 'tiny'")
    ap.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_BYTES / 1e9)
    a = ap.parse_args(argv)
    cfg = None
    if a.dims:
        cfg = scaled_config(*[int(v) for v in a.dims.split(",")])
    t = time.perf_counter()
    out = write_checkpoint(a.out, cfg, seed=a.seed, tokenizer=a.tokenizer,
                           max_shard_bytes=int(a.max_shard_gb * 1e9),
                           progress=lambda s: print(s, file=sys.stderr, flush=True))
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}: {size / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
    return 0



# -- a model-shaped .mxq (write_mxq) ---------------------------------------------------------------
# A model-shaped .mxq with synthetic packed weights in a recipe's formats, for decode-speed runs at
# sizes no real checkpoint here has (Qwen2-7B) without a 15 GB float checkpoint or a quantization.
#
#     python benchmarks/synthetic_mxq.py [--recipe 2356t] [--out /tmp/mixqrt-7b-2356t.mxq] [--config 7b]
#     mixqrt bench /tmp/mixqrt-7b-2356t.mxq -t 1,2 -p 32 -n 32 -r 2      # decode vs the bandwidth bound
#
# Each matrix is one real 16-row slab (random normal weights quantized to its format with the
# recipe's quantizer, in the stored form: q4x / q6x / q3x) repeated down the rows, so scales and codes
# are well formed and the activations stay finite, while every row still sits at its own address:
# a decode step reads exactly the bytes of a real file of this recipe (same formats, same sizes,
# fused q/k/v and gate/up as `mixqrt quantize` writes them). Rotations are not applied (they change
# a product's input by one Hadamard transform, not the bytes read). There is no tokenizer: use token
# ids (mixqrt bench does). The values are meaningless: speed only.

CONFIGS = {"7b": QWEN2_7B_CONFIG,
           # Qwen2.5(-Coder)-0.5B's shapes: the demo model, for machines without its GGUF (a device run)
           "0.5b": {**QWEN2_7B_CONFIG, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                    "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                    "max_window_layers": 24, "tie_word_embeddings": True},
           "tiny": {**QWEN2_7B_CONFIG, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512}}


class ShapeSource:
    """Just enough of a Source for recipes.tensor_plan: the config's tensor names and shapes."""

    arch = "qwen2"

    def __init__(self, config: dict):
        from mixqrt.models.spec import ModelSpec
        self.config = dict(config)
        self._shapes = ModelSpec(self.config, self.arch).shapes(with_lm_head=not self.config.get("tie_word_embeddings"))

    def tensor_names(self):
        return list(self._shapes)

    def tensor_info(self, name):
        return self._shapes[name], "float32"


def slab_tensor(fmt: str, shape, rng, lo_hi=None):
    """A QTensor of `shape` in fmt's stored form: one quantized 16-row slab repeated (see module doc)."""
    from mixqrt.formats import layout, quantize
    from mixqrt.formats.codec import to_storage
    from mixqrt.formats.qtensor import QTensor
    if len(shape) == 1:                  # norm weights and biases: ones (q5g in the bound range lo_hi)
        return quantize(np.ones(shape, np.float32), fmt, **({"lo": lo_hi[0], "hi": lo_hi[1]} if fmt == "q5g" and lo_hi else {}))
    n, k = shape
    g = layout.XROWS if n % layout.XROWS == 0 else 1
    slab = quantize((rng.standard_normal((g, k)) * 0.02).astype(np.float32), fmt)
    if fmt in layout.PLAIN:
        return QTensor(fmt, shape, np.tile(slab.raw, n // g))
    return to_storage(QTensor(fmt, (n, k), np.tile(slab.raw, n // g)))   # slab: whole groups


def write_mxq(out: str, recipe: str, config: dict, seed: int = 0, progress: bool = True) -> dict:
    """Write the synthetic .mxq of `config` in `recipe`'s formats to `out`; returns path, bytes, tensors, seconds."""
    from tqdm.auto import tqdm

    from mixqrt.quantize.convert import MXQ_KIND, _q3p_levels
    from mixqrt.io.mxq import MxqWriter
    from mixqrt.models import spec
    from mixqrt.quantize.recipes import get_recipe, tensor_plan
    rng = np.random.default_rng(seed)
    rec = get_recipe(recipe)
    # a tied config under a tying recipe (2356t): one embedding tensor in the lm_head's format, as
    # `mixqrt quantize` writes the real 0.5B
    tie = spec.EMBED if (config.get("tie_word_embeddings") and rec.tie) else None
    plan = tensor_plan(ShapeSource(config), rec, tie=tie)
    meta = {"kind": MXQ_KIND, "arch": "qwen2", "config": dict(config), "generation_config": {},
            "recipe": rec.spec(), "source": "synthetic (mixqrt.testing.synthetic)",
            "fused": {g.target: list(g.parts) for g in spec.FUSION_GROUPS},
            "q3p_levels": [int(v) for v in _q3p_levels()]}
    t0 = time.perf_counter()
    pending, nbytes = {}, 0
    with MxqWriter(out, meta) as w:
        for name, role, fmt, shape in tqdm(plan, desc="writing", unit="tensor", disable=not progress):
            qt = slab_tensor(fmt, shape, rng, (0.5, 1.5))
            nbytes += qt.nbytes
            layer, _ = spec.split_layer(name)
            group = spec.group_of(name)
            if group is None:
                w.add(name, qt, layer=layer)
                continue
            pending[name] = qt
            target, parts = group
            if all(p in pending for p in parts):
                qts = [pending.pop(p) for p in parts]
                fused = spec.fuse(qts)
                for nm, q in ([(target, fused)] if fused is not None else list(zip(parts, qts))):
                    w.add(nm, q, layer=layer)
    return {"path": out, "bytes": nbytes, "tensors": len(plan), "seconds": time.perf_counter() - t0}


def mxq_main(argv=None) -> int:
    """The command line of benchmarks/synthetic_mxq.py."""
    ap = argparse.ArgumentParser(prog="synthetic_mxq.py", description="A model-shaped .mxq with synthetic "
                                 "packed weights in a recipe's formats (mixqrt.testing.synthetic).")
    ap.add_argument("--recipe", default=None, help="recipe (default: mixqrt's default recipe)")
    ap.add_argument("--config", default="7b", choices=sorted(CONFIGS))
    ap.add_argument("--out", default=None, help="output .mxq (default /tmp/mixqrt-<config>-<recipe>.mxq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    from mixqrt.quantize.recipes import DEFAULT_RECIPE
    recipe = a.recipe or DEFAULT_RECIPE
    out = a.out or f"/tmp/mixqrt-{a.config}-{recipe}.mxq"
    r = write_mxq(out, recipe, CONFIGS[a.config], a.seed, progress=not a.quiet)
    print(f"wrote {r['path']}: {r['tensors']} tensors, {r['bytes'] / 1e9:.3f} GB in {r['seconds']:.1f} s")
    return 0


"""Qwen3, Llama 3 (rope_scaling "llama3") and Gemma 3 from tiny random-weight HF folders: mixqrt's
float32 logits against a numpy forward written here from the Hugging Face formulas (float64), the
decode paths (one token at a time, decode_batch) against the prompt forward, and bad configs."""
import math

import numpy as np
import pytest

from mixqrt.errors import ModelError
from mixqrt.io.hf import HFSource
from mixqrt.models import load_f32
from tinymodel import make_tiny_gguf, make_tiny_hf_model, tiny_weights

LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}, "rope_theta": 5e5}
CASES = {"qwen3": ("qwen3", {}), "llama3": ("llama", LLAMA3), "gemma3": ("gemma3", {}),
         "gemma3_softcap": ("gemma3", {"final_logit_softcapping": 3.0}), "qwen2_moe": ("qwen2_moe", {}),
         "qwen3_moe": ("qwen3_moe", {})}
IDS = np.array([5, 77, 3, 200, 41, 9, 123, 300, 7, 64, 18, 250, 99, 1], dtype=np.int64)


def _rms(x, w, eps, plus_one=False):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * ((1.0 + w) if plus_one else w)


def _inv_freq(cfg, theta, scaled=True):
    d = cfg["head_dim"]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    rs = cfg.get("rope_scaling") if scaled else None
    if rs and rs.get("rope_type") == "llama3":          # transformers' _compute_llama3_parameters
        f, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
            rs["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        il = np.where(wl > old / lo, inv / f, inv)
        sm = (old / wl - lo) / (hi - lo)
        smoothed = (1 - sm) * il / f + sm * il
        medium = ~(wl < old / hi) & ~(wl > old / lo)
        inv = np.where(medium, smoothed, il)
    return inv


def _rope(x, inv):                                   # x [T, H, D], rotate-half
    ang = np.arange(x.shape[0])[:, None, None] * inv[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def _silu_mlp(f, g, u, d):
    a = f @ g.T
    return (a / (1 + np.exp(-a)) * (f @ u.T)) @ d.T


def _moe_reference(cfg, w, p, f):
    """Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock, token by token."""
    z = f @ w[p + "mlp.gate.weight"].T
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(f)
    for r in range(f.shape[0]):
        top = np.argsort(-probs[r], kind="stable")[: cfg["num_experts_per_tok"]]
        wt = probs[r, top] / (probs[r, top].sum() if cfg["norm_topk_prob"] else 1.0)
        for e, we in zip(top, wt):
            out[r] += we * _silu_mlp(f[r:r + 1], *(w[f"{p}mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")))[0]
    if cfg.get("shared_expert_intermediate_size"):
        gate = 1 / (1 + np.exp(-(f @ w[p + "mlp.shared_expert_gate.weight"].T)))
        out += gate * _silu_mlp(f, *(w[f"{p}mlp.shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")))
    return out


def reference(cfg, w, ids):
    """HF's forward in float64: Qwen3Model / LlamaModel / Gemma3TextModel."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    gemma = cfg["model_type"] in ("gemma3_text", "gemma3")
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    if gemma:
        x = x * np.float32(math.sqrt(cfg["hidden_size"]))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps, gemma)
        q, k, v = (a @ w[p + f"self_attn.{c}_proj.weight"].T + w.get(p + f"self_attn.{c}_proj.bias", 0.0)
                   for c in "qkv")
        q, k, v = q.reshape(n, nh, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
        if p + "self_attn.q_norm.weight" in w:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        local = gemma and (cfg["layer_types"][i] == "sliding_attention" if cfg.get("layer_types")
                           else (i + 1) % cfg["sliding_window_pattern"] != 0)
        inv = _inv_freq(cfg, cfg["rope_local_base_freq"], False) if local else _inv_freq(cfg, cfg["rope_theta"])
        q, k = _rope(q, inv), _rope(k, inv)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else hd ** -0.5
        s = np.einsum("ihd,jhd->hij", q, k) * scale
        dist = np.arange(n)[:, None] - np.arange(n)[None, :]
        mask = (dist < 0) | ((dist >= cfg["sliding_window"]) if local else False)
        s = np.where(mask[None], -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", s, v).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            o = _rms(o, w[p + "post_attention_layernorm.weight"], eps, True)
        x = x + o
        f = _rms(x, w[p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")],
                 eps, gemma)
        if cfg.get("num_experts"):
            y = _moe_reference(cfg, w, p, f)
        else:
            g, u = f @ w[p + "mlp.gate_proj.weight"].T, f @ w[p + "mlp.up_proj.weight"].T
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) if gemma \
                else g / (1 + np.exp(-g))
            y = (act * u) @ w[p + "mlp.down_proj.weight"].T
        if gemma:
            y = _rms(y, w[p + "post_feedforward_layernorm.weight"], eps, True)
        x = x + y
    x = _rms(x, w["model.norm.weight"], eps, gemma)
    logits = x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T
    cap = cfg.get("final_logit_softcapping")
    return np.tanh(logits / cap) * cap if cap else logits


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, extra = CASES[request.param]
    d = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=arch, dtype="f32", config_extra=extra)
    with HFSource(d) as src:
        model = load_f32(src)
        cfg = dict(src.config)
    return request.param, model, cfg, tiny_weights(arch, True, 0), d


def test_logits_match_hf_formulas(case):
    name, model, cfg, w, _ = case
    got = model.logits(IDS)
    ref = reference(cfg, w, IDS)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-5, (name, err)
    assert model.args.model_type == CASES[name][0]


def test_decode_one_token_at_a_time_equals_prompt(case):
    """The decode paths (sliding window over the cache for Gemma's local layers, batched decode)
    give the prompt forward's logits."""
    name, model, cfg, w, _ = case
    full = model.logits(IDS)
    cache = model.make_cache(len(IDS))
    step = np.stack([model(IDS[i:i + 1], cache, last_only=True) for i in range(len(IDS))])
    np.testing.assert_allclose(step, full, rtol=0, atol=2e-5 * np.abs(full).max())
    c1, c2 = model.make_cache(len(IDS)), model.make_cache(len(IDS))
    model(IDS[:6], c1)
    model(IDS[:9], c2)
    out = model.decode_batch(np.array([IDS[6], IDS[9]]), [c1, c2])
    np.testing.assert_allclose(out, full[[6, 9]], rtol=0, atol=2e-5 * np.abs(full).max())


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma3"])   # MoE GGUFs: tests/test_oracle.py
def test_gguf_loads_the_same_model(name, tmp_path):
    """The folder written as llama.cpp's converter writes it (GGUF names, Gemma's norms + 1, Llama 3's
    rope_freqs.weight, llama's q/k permutation) gives the folder's logits; for Gemma 3, whose GGUF
    says less (attention scale 1/sqrt(head_dim), every 6th layer global), the HF formulas' logits
    under the config the file gives."""
    arch, extra = CASES[name]
    d = make_tiny_hf_model(tmp_path / "hf", arch=arch, dtype="f32", config_extra=extra)
    w = tiny_weights(arch, True, 0)
    with HFSource(d) as src:
        model = load_f32(src)
    from mixqrt.io.gguf import GGUFSource
    path = make_tiny_gguf(d, tmp_path / "m.gguf")
    with GGUFSource(path) as src:
        assert src.arch == CASES[name][0]
        g = load_f32(src)
        gcfg = dict(src.config)
    full = model.logits(IDS) if name != "gemma3" else reference(gcfg, w, IDS)
    np.testing.assert_allclose(g.logits(IDS), full, rtol=0, atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("arch,tensor,values,match", [
    ("gemma3", "rope_freqs.weight", np.ones(16), "rope_freqs"),             # no Llama 3 scaling in Gemma
    ("llama", "rope_factors_long.weight", np.ones(8), "rope_factors_long"),  # longrope: not supported
    ("llama", "rope_freqs.weight", np.ones(5), "head_dim / 2"),
    ("llama", "rope_freqs.weight", -np.ones(8), "positive"),
])
def test_gguf_rope_factor_tensors_refused(tmp_path, arch, tensor, values, match):
    from mixqrt.io.gguf import GGUFSource
    d = make_tiny_hf_model(tmp_path / "hf", arch=arch, dtype="f32")
    path = make_tiny_gguf(d, tmp_path / "m.gguf", extra_tensors={tensor: values})
    with pytest.raises(ModelError, match=match):
        GGUFSource(path)


def test_qwen3_head_dim_is_independent():
    """Qwen3-0.6B's shapes: hidden 1024, 16 heads of 128 (q is 2048 wide), q/k norms of 128."""
    from mixqrt.models.spec import ModelSpec
    cfg = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8}
    s = ModelSpec(cfg, "qwen3").layer_shapes(0)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (1024, 2048)
    assert s["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "model.layers.0.self_attn.q_proj.bias" not in s


@pytest.mark.parametrize("arch,extra,field", [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": -1, "low_freq_factor": 1, "high_freq_factor": 4,
                                "original_max_position_embeddings": 64}}, "rope_scaling.factor"),
    ("gemma3", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gemma3", {"sliding_window": 0}, "sliding_window"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
    ("qwen3", {"head_dim": 7}, "head_dim"),
])
def test_bad_config_names_the_field(tmp_path, arch, extra, field):
    d = make_tiny_hf_model(tmp_path, arch=arch, dtype="f32", config_extra=extra)
    with pytest.raises(ModelError, match=field.replace(".", r"\.")):
        with HFSource(d) as src:
            load_f32(src)


# ----------------------------------------------------------------------------- SentencePiece GGUF vocabularies
def _spm_meta():
    """A small Gemma-style vocabulary: controls, 256 byte tokens, pieces with scores (higher merges first)."""
    pieces = ["\u2581", "a", "b", "c", "\u2581a", "ab", "bc", "abc", "\u2581ab", "ca", "\u2581\u2581", "cab", "bb"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    rng = np.random.default_rng(0)
    scores = [-1000.0] * 4 + [0.0] * 256 + list(-rng.permutation(len(pieces)).astype(float) - 1)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
            "tokenizer.ggml.scores": np.array(scores, dtype=np.float32), "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _spm_reference(meta, text):
    """llama.cpp's SPM tokenizer: join the adjacent pair whose join is a normal token of the highest
    score (leftmost on ties) until none is; pieces not in the vocabulary as their UTF-8 bytes."""
    tokens, types, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], \
        meta["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    sym = list(text.replace(" ", "\u2581"))
    while True:
        best = None
        for j in range(len(sym) - 1):
            i = vocab.get(sym[j] + sym[j + 1])
            if i is not None and types[i] == 1 and (best is None or scores[i] > best[0]):
                best = (scores[i], j)
        if best is None:
            break
        j = best[1]
        sym[j:j + 2] = [sym[j] + sym[j + 1]]
    out = []
    for s in sym:
        out.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return out


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc é", max_size=24))
def test_spm_gguf_tokenizer_is_llama_cpps(text):
    from mixqrt.generation.tokenizer import Tokenizer
    meta = _spm_meta()
    tok = _SPM.get("tok") or _SPM.setdefault("tok", Tokenizer.from_gguf_metadata(meta))
    assert tok.encode(text, parse_special=False) == _spm_reference(meta, text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_special_tokens=True)[:1] == [2]


_SPM: dict = {}


# ----------------------------------------------------------------------------- mixture of experts
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.data())
def test_route_top_k_with_ties(t, e, data):
    """route(): the k largest softmax probabilities, lower expert index first among equal ones,
    weights renormalised only with norm_topk_prob; logits drawn from few values so ties are common."""
    from mixqrt.models.moe import route
    k = data.draw(st.integers(1, e))
    logits = np.array(data.draw(st.lists(st.lists(st.sampled_from([-2.0, 0.0, 0.5, 3.0]), min_size=e, max_size=e),
                                         min_size=t, max_size=t)), dtype=np.float32)
    top, w = route(logits, k, False)
    top_n, w_n = route(logits, k, True)
    assert top.shape == (t, k) and np.array_equal(top, top_n)
    for r in range(t):
        order = sorted(range(e), key=lambda i: (-logits[r, i], i))[:k]     # exact ties: by index
        assert list(top[r]) == order
        p = np.exp(logits[r].astype(np.float64) - logits[r].max())
        p /= p.sum()
        np.testing.assert_allclose(w[r], p[order], rtol=1e-6)
        np.testing.assert_allclose(w_n[r].sum(), 1.0, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.sampled_from([(4, 1), (4, 2), (4, 4), (3, 2)]), st.booleans(), st.integers(0, 1000))
def test_moe_grouped_by_expert_equals_token_by_token(t, ek, shared, seed):
    """Tokens that share experts are run together (one product per expert over its tokens): the same
    result as each token through its own experts."""
    from mixqrt.models.moe import Experts, moe_ffn, route
    e, k = ek
    rng = np.random.default_rng(seed)
    d, i = 16, 8
    ex = Experts(rng.standard_normal((e, d)).astype(np.float32),
                 [rng.standard_normal((i, d)).astype(np.float32) for _ in range(e)],
                 [rng.standard_normal((i, d)).astype(np.float32) for _ in range(e)],
                 [rng.standard_normal((d, i)).astype(np.float32) for _ in range(e)],
                 tuple(rng.standard_normal(s).astype(np.float32) for s in ((i, d), (i, d), (d, i))) if shared else None,
                 rng.standard_normal((1, d)).astype(np.float32) if shared else None)
    h = rng.standard_normal((t, d)).astype(np.float32)
    got = moe_ffn(ex, h, k, True)
    for r in range(t):
        one = moe_ffn(ex, h[r:r + 1], k, True)
        np.testing.assert_allclose(got[r], one[0], rtol=1e-5, atol=1e-5)
    top, _ = route(h @ ex.router.T, k, True)
    assert top.shape == (t, k)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 130), st.integers(1, 2100), st.integers(1, 5), st.integers(0, 2**31))
def test_router_scores_are_the_same_bits_on_every_tier(n, k, t, seed):
    """ops.router_logits (a MoE router's scores) gives the same bits on every ISA tier and in ops_ref,
    for odd widths too, so the experts a token is routed to never depend on the CPU; the matmul
    kernels' float products do not promise that."""
    import mixqrt.platform.isa as isa
    from mixqrt import ops
    from mixqrt.ops import ref as ops_ref
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    want = ops_ref.router_logits(w, x)
    np.testing.assert_allclose(want, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    before = isa.current()
    try:
        for tier in isa.available():
            isa.set_isa(tier)
            np.testing.assert_array_equal(ops.router_logits(w, x), want, err_msg=tier)
            np.testing.assert_array_equal(ops.router_logits(w, x[0]), want[0], err_msg=tier)
    finally:
        isa.set_isa(before)


@pytest.mark.parametrize("arch,extra,field", [
    ("qwen3_moe", {"num_experts": 0}, "num_experts"),
    ("qwen3_moe", {"num_experts": -2}, "num_experts"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("qwen3_moe", {"mlp_only_layers": "all"}, "mlp_only_layers"),
    ("qwen3_moe", {"head_dim": 7}, "head_dim"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_bad_moe_config_names_the_field(tmp_path, arch, extra, field):
    d = make_tiny_hf_model(tmp_path, arch=arch, dtype="f32", config_extra=extra)
    with pytest.raises(ModelError, match=field):
        with HFSource(d) as src:
            load_f32(src)


def test_calibration_rounds_experts_no_token_chose(tmp_path):
    """GPTQ calibration of a MoE model whose router never picks experts 2 and 3 (all logits tie, so
    top-2 is always experts 0 and 1): those experts are rounded without a Hessian instead of the
    quantization failing, and the file loads and runs."""
    import subprocess
    import sys

    from tinymodel import write_safetensors
    d = make_tiny_hf_model(tmp_path, arch="qwen3_moe", dtype="f32")
    w = tiny_weights("qwen3_moe", True, 0)
    for i in range(2):
        w[f"model.layers.{i}.mlp.gate.weight"][:] = 0.0
    write_safetensors(d / "model.safetensors", w, "F32", {"format": "pt"})
    out = tmp_path / "m.mxq"
    r = subprocess.run([sys.executable, "-m", "mixqrt", "quantize", str(d), "--recipe", "2356t", "-o", str(out), "-q",
                        "--calibrate", "self", "--calib-tokens", "64"], capture_output=True, text=True,
                       cwd=tmp_path)     # not the checkout: `-m` would import its unbuilt sources first
    assert r.returncode == 0, r.stderr[-2000:]
    import mixqrt
    assert np.isfinite(mixqrt.load(str(out)).model.logits(IDS[:4])).all()


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_multimodal_folder_loads_its_text_decoder(tmp_path, prefix):
    """A Gemma 3 folder with its vision tower (Gemma3ForConditionalGeneration: config.text_config,
    the decoder's tensors under language_model.model. or, since transformers 4.52,
    model.language_model.) loads as the text model; the vision tensors are skipped."""
    import json

    from tinymodel import write_safetensors
    d = make_tiny_hf_model(tmp_path / "text", arch="gemma3", dtype="f32")
    mm = tmp_path / "mm"
    mm.mkdir()
    text_cfg = json.loads((d / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_cfg,
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]}))
    w = {(prefix + n[len("model."):] if n.startswith("model.") else n): a for n, a in tiny_weights("gemma3").items()}
    w["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    w["multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 64), np.float32)
    write_safetensors(mm / "model.safetensors", w, "F32", {"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (mm / f).write_text((d / f).read_text())
    with HFSource(d) as a, HFSource(mm) as b:
        assert b.arch == "gemma3"
        np.testing.assert_array_equal(load_f32(b).logits(IDS[:5]), load_f32(a).logits(IDS[:5]))


@pytest.mark.parametrize("arch,want", [("gemma3", "f32"), ("qwen3", "q5g")])
def test_gemma_norms_stay_float_in_2356(tmp_path, arch, want):
    """Gemma's (1 + weight) norms stay float32 where a recipe says q5g (Arch.float_norms);
    other architectures' norms keep the recipe's q5g; an explicit override still wins."""
    from mixqrt.quantize.recipes import get_recipe, parse_overrides, tensor_plan
    d = make_tiny_hf_model(tmp_path, arch=arch, dtype="f32")
    with HFSource(d) as src:
        plan = tensor_plan(src, get_recipe("2356"))
        assert {fmt for _, role, fmt, _ in plan if role == "norm"} == {want}
        rec = get_recipe("2356")
        rec.overrides = parse_overrides(["norm=q8"])
        assert {fmt for _, role, fmt, _ in tensor_plan(src, rec) if role == "norm"} == {"q8"}

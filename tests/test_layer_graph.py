"""One layer graph: GPTQ calibration runs the model's own layer functions, so the input it records for
every product (its Hessian's data) is, bit for bit, the input the quantized model's forward feeds that
product. Both sides are recorded through the same hook (models.base.product_inputs)."""
import json

import numpy as np
import pytest

import mixqrt
from mixqrt.quantize.convert import quantize_model
from mixqrt.models import spec
from mixqrt.models.base import product_inputs
from mixqrt.quantize import calibrate

from tinymodel import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, make_tiny_hf_model, tiny_weights, write_safetensors

TEXT = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n" * 40


def _model(root, arch, attention_bias):
    """A tiny f32 checkpoint; attention_bias None: the key absent. llama + bias gets q/k/v/o biases."""
    d = make_tiny_hf_model(root / f"{arch}-{attention_bias}", arch=arch, tied=False, seed=1, dtype="f32")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("attention_bias", None)
    if attention_bias is not None:
        cfg["attention_bias"] = attention_bias
    (d / "config.json").write_text(json.dumps(cfg))
    if arch == "llama" and attention_bias:
        w = tiny_weights(arch, tied=False, seed=1)
        rng = np.random.default_rng(5)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.self_attn."
            for n, size in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM),
                            ("o", HIDDEN)):
                w[p + f"{n}_proj.bias"] = (0.3 * rng.standard_normal(size)).astype(np.float32)
        write_safetensors(d / "model.safetensors", w, "F32", {"format": "pt"})
    return d


def _calibrated(src, out, monkeypatch, recipe="2356"):
    """quantize_model with GPTQ; -> (the calibration chunks, {(chunk, HF name): recorded input})."""
    seen, chunks = {}, []
    init = calibrate.Calibrator.__init__

    def spy(self, args, ch, *a, **kw):
        chunks.extend(ch)
        count = {}

        def observe(names, x):      # chunks are run in order, each once per recording pass
            c = count[names] = count.get(names, -1) + 1
            for n in names:
                seen[(c, n)] = np.array(x)
        init(self, args, ch, *a, observe=observe, **kw)

    monkeypatch.setattr(calibrate.Calibrator, "__init__", spy)
    quantize_model(str(src), recipe, out, progress=False, calibrate=TEXT, calib_tokens=96, calib_ctx=48)
    monkeypatch.undo()
    return chunks, seen


def _forward_inputs(model, chunks):
    """{(chunk, HF name): input} of every product of the model's own forward over each chunk."""
    names = {}
    for n, w in model.named_weights().items():
        if n != spec.EMBED:
            names.setdefault(id(w), []).extend(spec.parts_of(n))
    got, c = {}, [0]

    def hook(w, x):
        for n in names.get(id(w), ()):
            got[(c[0], n)] = np.array(x).reshape(-1, np.shape(x)[-1])

    with product_inputs(hook):
        for c[0], ids in enumerate(chunks):
            model.logits(ids)
    return got


@pytest.mark.parametrize("arch,bias", [("qwen2", None), ("qwen2", False), ("llama", False), ("llama", True)])
def test_gptq_records_exactly_the_inputs_of_the_models_forward(tmp_path, monkeypatch, arch, bias):
    """(qwen2, False) is the case the old copy of the layer got wrong: Qwen2 always has q/k/v biases
    (spec.arch_biases; transformers ignores attention_bias), so the runtime adds them, and so must the
    Hessians' inputs from o_proj on."""
    src = _model(tmp_path, arch, bias)
    chunks, cal = _calibrated(src, tmp_path / "q.mxq", monkeypatch)
    assert len(chunks) == 2
    m = mixqrt.load(str(tmp_path / "q.mxq"), progress=False)
    try:
        fwd = _forward_inputs(m.model, chunks)
        layer_products = {n for n, shp in spec.ModelSpec(m.model.args.__dict__, arch).shapes().items()
                          if len(shp) == 2 and n != spec.EMBED}
        assert {n for _, n in cal} == layer_products           # every product calibrated (lm_head too)
        assert set(cal) == set(fwd)
        for key in sorted(cal):
            np.testing.assert_array_equal(cal[key], fwd[key], err_msg=str(key))
        has_qkv_bias = m.model.layers[0].qkv_bias is not None
        assert has_qkv_bias == (arch == "qwen2" or bool(bias))
        assert (m.model.layers[0].o_bias is not None) == (arch == "llama" and bool(bias))
    finally:
        m.close()


def test_the_hook_sees_each_product_once_with_the_silu_input(tmp_path):
    """A float down projection (ops.matmul's own SiLU fallback calls matmul again) is seen once, with
    the SiLU product it multiplies."""
    from mixqrt.models import build_model
    from tinymodel import tiny_config
    model = build_model(tiny_config("qwen2"), tiny_weights("qwen2"))
    seen = []
    with product_inputs(lambda w, x: seen.append((id(w), np.shape(x)))):
        model.logits(np.arange(5))
    downs = [s for i, s in seen if i == id(model.layers[0].down)]
    assert downs == [(5, model.args.intermediate_size)]
    assert len(seen) == 4 * model.n_layers + 1


def test_a_model_built_piece_by_piece_is_the_model(tmp_path):
    """Model.empty + load_global + load_layer (what calibration uses) give the loaded model's logits, and
    layer_weights / named_weights name every runtime tensor by the spec (fused targets or parts)."""
    from mixqrt.errors import ModelError
    from mixqrt.models import build_model, get_model_class
    from tinymodel import tiny_config
    cfg, w = tiny_config("llama", tied=False), tiny_weights("llama", tied=False, seed=2)
    whole = build_model(cfg, w)
    cls = get_model_class("llama")
    part = cls.empty(cls.args_class.from_dict(cfg))
    for n in (spec.EMBED, spec.FINAL_NORM, spec.LM_HEAD):
        part.load_global(n, w[n])
    for i in range(part.n_layers):
        part.load_layer(i, {n: t for n, t in w.items() if spec.split_layer(n)[0] == i})
    ids = np.arange(7)
    np.testing.assert_array_equal(part.logits(ids), whole.logits(ids))
    names = set(whole.named_weights())
    assert names == {spec.EMBED, spec.FINAL_NORM, spec.LM_HEAD} | {
        f"model.layers.{i}.{s}" for i in range(whole.n_layers) for s in (
            "input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")}
    with pytest.raises(ModelError, match="not part of layer 0"):
        part.load_layer(0, {**{n: t for n, t in w.items() if spec.split_layer(n)[0] == 0},
                            "model.layers.1.mlp.down_proj.weight": w["model.layers.1.mlp.down_proj.weight"]})
    with pytest.raises(ModelError, match="layer index"):
        part.layer_weights(2)
    part.unload_layer(1)
    assert part.layer_weights(1) == {} and part.fused_layers() is None

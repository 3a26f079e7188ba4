"""docs/architecture.md, "Adding an architecture": a new family is one file (its graph and its Arch,
registered once) plus its oracle test. Here the file is this test module: a toy architecture, a Llama
clone under its own name, declared the way the doc says. Nothing else of mixqrt names it, yet its
tiny HF checkpoint, its GGUF (as llama.cpp's converter writes Llama: q/k rows permuted), the .mxq
made from either and the fused decode all work, and give Llama's logits."""
from __future__ import annotations

import numpy as np
import pytest

import mixqrt
from mixqrt.models import arch, llama
from mixqrt.models.arch import Arch
from mixqrt.quantize.convert import quantize_model
from mixqrt.testing.tiny import make_tiny_gguf, make_tiny_hf_model


# ---------------------------------------------------------------------------- the "file": graph + Arch
class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_dict(cls, config, model_type=None):
        return super().from_dict(config, model_type="toyllama")


class Model(llama.Model):
    args_class = ModelArgs


TOY = Arch("toyllama", "ToyLlamaForCausalLM", module=__name__, native_decode=True, gguf_permuted_qk=True,
           gguf_rope_freqs=True, tiny={"attention_bias": False})


@pytest.fixture
def toy():
    arch.register(TOY)
    yield TOY
    arch.unregister(TOY.name)


def test_a_toy_architecture_runs_from_every_source_like_llama(toy, tmp_path):
    assert "toyllama" in arch.names() and arch.get("toyllama") is TOY
    ids = np.array([1, 5, 9, 33, 7, 2, 40])
    ref_dir = make_tiny_hf_model(tmp_path / "llama", arch="llama", seed=3, dtype="f32")
    toy_dir = make_tiny_hf_model(tmp_path / "toy", arch="toyllama", seed=3, dtype="f32")
    ref_mxq, toy_mxq = tmp_path / "llama.mxq", tmp_path / "toy.mxq"
    quantize_model(str(ref_dir), "f32", ref_mxq, progress=False)
    quantize_model(str(toy_dir), "f32", toy_mxq, progress=False)
    ref = mixqrt.load(ref_mxq)
    toy_model = mixqrt.load(toy_mxq)
    assert type(toy_model.model) is Model and toy_model.meta.get("arch") == "toyllama"
    want = ref.logits(ids)
    np.testing.assert_array_equal(toy_model.logits(ids), want)
    # the GGUF llama.cpp's converter would write (q/k rows permuted), read back through the Arch
    gguf = make_tiny_gguf(toy_dir, tmp_path / "toy.gguf", "F32")
    from_gguf = tmp_path / "toy-gguf.mxq"
    quantize_model(str(gguf), "f32", from_gguf, progress=False)
    np.testing.assert_allclose(mixqrt.load(from_gguf).logits(ids), want, rtol=0, atol=1e-5)
    # the fused single-token decode (Arch.native_decode): the same tokens as Llama's
    a = [r.token for r in mixqrt.Engine(toy_model, max_context=64).submit(list(ids), max_new_tokens=6,
                                                                          temperature=0.0, eos_token_ids=[])]
    b = [r.token for r in mixqrt.Engine(ref, max_context=64).submit(list(ids), max_new_tokens=6,
                                                                    temperature=0.0, eos_token_ids=[])]
    assert a == b and toy_model.model.fused_layers() is not None


def test_an_unregistered_name_is_refused_by_name(tmp_path):
    with pytest.raises(mixqrt.ModelError, match="toyllama"):
        arch.get("toyllama")

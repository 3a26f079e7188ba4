"""mixqrt against llama.cpp's logits, without llama.cpp: tests/data/oracle/<name>.npz holds llama.cpp's
F32 logits over 128 fixed tokens for each synthetic GGUF of mixqrt.testing.synthetic_gguf (written by
benchmarks/oracle_logits.py). Each test rebuilds the GGUF from its seed, checks that it is
byte-identical to the one llama.cpp ran (sha256), and compares mixqrt's f32 logits. A float64 numpy
forward written from llama.cpp's graph code (synthetic_gguf.reference_logits) must reproduce every
stored file too, so the semantics a new architecture must implement are spelled out and checked.

A configuration mixqrt cannot run yet must be refused with a ModelError that names what is missing
(the architecture, or the tensor it cannot apply), never run with a wrong answer. Adding its name
to COMPARED turns the refusal check into the comparison.

The bound. Both sides compute in float32 from the same float32 weights; llama.cpp with an F32 KV
cache. What differs is the order of summation (blocked dot products, threads), exp/SiLU/GELU
implementations and RoPE's sin/cos: each costs a few float32 ulps per operation, and over 2-6
layers of width 64-128 that grows to ~2e-7 of the logit scale (measured, docs/oracle.md). MAX_REL =
1e-4 leaves a factor of ~500 for other ISA tiers and thread counts (Gemma 3's GELU excepted, see
MAX_REL_FOR),
and is still ~1000x below what a real mistake costs: a missing bias, a wrong RoPE variant or an
ignored rope_freqs tensor moves the logits by 10-100 % of their scale.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mixqrt.errors import ModelError
from mixqrt.testing.synthetic_gguf import (SPECS, reference_logits, sha256_file, spec, token_ids,
                                           write_synthetic_gguf)

ORACLE = Path(__file__).parent / "data" / "oracle"

# configurations mixqrt runs today: their logits are compared with llama.cpp's
COMPARED = ["qwen2", "llama", "llama3", "qwen3", "gemma3", "qwen2moe", "qwen3moe"]
# what the ModelError of a refused configuration must name (default: its architecture)
REFUSAL_NAMES: dict = {}
MAX_REL = 1e-4          # max |mixqrt - llama.cpp| / max |llama.cpp logit|
# llama.cpp's CPU GELU reads a half-precision table (GGML_GELU_FP16 in ggml-cpu/vec.h): the input is
# rounded to fp16 and so is the result, up to 2^-11 = 4.9e-4 relative per activation. An exact
# tanh-GELU forward differs from it by 4.9e-4 of the logit scale (measured, gemma3); 2e-3 leaves 4x.
MAX_REL_FOR = {"gemma3": 2e-3}
MIN_TOP1 = 0.99         # same top token at this share of positions


def _load(name: str) -> dict:
    path = ORACLE / f"{name}.npz"
    assert path.is_file(), f"{path} is missing: run benchmarks/oracle_logits.py --only {name}"
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def agreement(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(share of positions with the same top token, max |Δ| / max |ref|)."""
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    return top1, float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """name -> (stored oracle, path of the GGUF rebuilt from its seed)."""
    folder = tmp_path_factory.mktemp("oracle")
    cache = {}

    def get(name):
        if name not in cache:
            z = _load(name)
            path = write_synthetic_gguf(name, folder / f"{name}.gguf", seed=int(z["seed"]))
            cache[name] = (z, path)
        return cache[name]
    return get


def test_every_configuration_has_an_oracle_file():
    assert sorted(p.stem for p in ORACLE.glob("*.npz")) == sorted(SPECS)
    assert set(COMPARED) <= set(SPECS) and set(REFUSAL_NAMES) <= set(SPECS)
    assert sum(p.stat().st_size for p in ORACLE.glob("*.npz")) < 3_000_000


@pytest.mark.parametrize("name", sorted(SPECS))
def test_oracle_file_matches_the_rebuilt_model(name, rebuilt):
    z, path = rebuilt(name)
    assert str(z["name"]) == name
    assert json.loads(str(z["config"])) == spec(name), "SPECS changed: rerun benchmarks/oracle_logits.py"
    assert sha256_file(path) == str(z["gguf_sha256"]), "the rebuilt GGUF differs from the one llama.cpp ran"
    np.testing.assert_array_equal(z["token_ids"], token_ids(name))
    assert z["logits"].dtype == np.float32 and z["logits"].shape == (len(z["token_ids"]), spec(name)["vocab"])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_numpy_reference_agrees_with_llamacpp(name):
    """The float64 numpy forward of synthetic_gguf.reference_logits, written from llama.cpp's graph
    code, reproduces llama.cpp's stored logits for every configuration: the specification a new
    architecture is implemented against, checked here so that it stays true."""
    z = _load(name)
    top1, rel = agreement(reference_logits(name, z["token_ids"], seed=int(z["seed"])), z["logits"])
    assert top1 >= MIN_TOP1 and rel <= MAX_REL_FOR.get(name, MAX_REL), \
        f"{name}: top-1 {top1:.3f}, max rel err {rel:.2e}"


@pytest.mark.parametrize("name", COMPARED)
def test_logits_agree_with_llamacpp(name, rebuilt):
    from mixqrt.io import open_source
    from mixqrt.models import load_f32

    z, path = rebuilt(name)
    with open_source(path) as src:
        model = load_f32(src)
    ours = np.asarray(model.logits(z["token_ids"]), dtype=np.float32)
    top1, rel = agreement(ours, z["logits"])
    assert top1 >= MIN_TOP1 and rel <= MAX_REL_FOR.get(name, MAX_REL), \
        f"{name}: top-1 {top1:.3f}, max rel err {rel:.2e}"


UNSUPPORTED = sorted(set(SPECS) - set(COMPARED))


def test_every_configuration_is_compared_or_refused():
    assert set(COMPARED) | set(UNSUPPORTED) == set(SPECS)


if UNSUPPORTED:      # every configuration is compared today; a new one starts here until it runs
    @pytest.mark.parametrize("name", UNSUPPORTED)
    def test_unsupported_configuration_is_refused_by_name(name, rebuilt):
        from mixqrt.io import open_source
        from mixqrt.models import load_f32

        _, path = rebuilt(name)
        what = REFUSAL_NAMES.get(name, spec(name)["arch"])
        with pytest.raises(ModelError, match=what):
            with open_source(path) as src:
                load_f32(src)

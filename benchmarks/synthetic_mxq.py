"""A model-shaped .mxq with synthetic packed weights in a recipe's formats, for decode-speed runs at
sizes no real checkpoint here has (Qwen2-7B) without a 15 GB float checkpoint or a quantization.

    python benchmarks/synthetic_mxq.py [--recipe 2356t] [--out /tmp/mixqrt-7b-2356t.mxq] [--config 7b]
    mixqrt bench /tmp/mixqrt-7b-2356t.mxq -t 1,2 -p 32 -n 32 -r 2      # decode vs the bandwidth bound

Each matrix is one real 16-row slab (random normal weights quantized to its format with the
recipe's quantizer, in the stored form: q4x / q6x / q3x) repeated down the rows, so scales and codes
are well formed and the activations stay finite, while every row still sits at its own address:
a decode step reads exactly the bytes of a real file of this recipe (same formats, same sizes,
fused q/k/v and gate/up as `mixqrt quantize` writes them). Rotations are not applied (they change
a product's input by one Hadamard transform, not the bytes read). There is no tokenizer: use token
ids (mixqrt bench does). The values are meaningless: speed only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from synthetic_checkpoint import QWEN2_7B_CONFIG  # noqa: E402

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


def write(out: str, recipe: str, config: dict, seed: int = 0, progress: bool = True) -> dict:
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
            "recipe": rec.spec(), "source": f"synthetic ({os.path.basename(__file__)})",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=None, help="recipe (default: mixqrt's default recipe)")
    ap.add_argument("--config", default="7b", choices=sorted(CONFIGS))
    ap.add_argument("--out", default=None, help="output .mxq (default /tmp/mixqrt-<config>-<recipe>.mxq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    from mixqrt.quantize.recipes import DEFAULT_RECIPE
    recipe = a.recipe or DEFAULT_RECIPE
    out = a.out or f"/tmp/mixqrt-{a.config}-{recipe}.mxq"
    r = write(out, recipe, CONFIGS[a.config], a.seed, progress=not a.quiet)
    print(f"wrote {r['path']}: {r['tensors']} tensors, {r['bytes'] / 1e9:.3f} GB in {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

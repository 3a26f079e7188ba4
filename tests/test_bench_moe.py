"""benchmarks/moe.py: its GGUF (llama.cpp's qwen2moe tensor names, read back by mixqrt) and its page."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import moe as bench_moe  # noqa: E402

SMALL = {"hidden": 64, "n_head": 4, "n_head_kv": 4, "head_dim": 16, "n_expert": 6, "n_expert_used": 2,
         "expert_ff": 32, "shared_ff": 48}


def test_gguf_is_a_qwen2moe_mixqrt_reads(tmp_path):
    from mixqrt.io.gguf import GGUFSource
    from mixqrt.models import load_f32
    p = tmp_path / "m.gguf"
    bench_moe.write_gguf(p, 2, 1000, shape=SMALL)
    with GGUFSource(p) as src:
        assert src.arch == "qwen2_moe"
        c = src.config
        assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                c["shared_expert_intermediate_size"], c["vocab_size"]) == (6, 2, 32, 48, 1000)
        assert src.tensor_info("model.layers.1.mlp.experts.5.down_proj.weight")[0] == (64, 32)
        logits = load_f32(src).logits(np.array([1, 2, 3]))
    assert logits.shape == (3, 1000) and np.isfinite(logits).all()
    import gguf
    names = {t.name for t in gguf.GGUFReader(str(p)).tensors}
    for n in ("blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
              "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_gate_shexp.weight",
              "blk.0.ffn_up_shexp.weight", "blk.0.ffn_down_shexp.weight", "output.weight"):
        assert n in names, n


def test_page_states_each_target_against_the_numbers():
    res = {"settings": {"layers": 4, "vocab": 151936, "threads": 2, "n_prompt": 512, "n_gen": 128, "reps": 2,
                        "recipe": "2356t", "types": ["Q4_0", "Q3_K_M"], "params": 2_900_000_000,
                        "variants": {"mixqrt": [], "mixqrt:x": ["expert_up=q3p"]}, "provenance": "- command: `x`"},
           "quantize": {"Q4_0": {"bytes": 1700}, "Q3_K_M": {"bytes": 1500}, "mixqrt": {"bytes": 1100},
                        "mixqrt:x": {"bytes": 1300}},
           "bench": {"Q4_0": {"ok": True, "pp_tok_s": 50.0, "tg_tok_s": 10.0},
                     "Q3_K_M": {"ok": True, "pp_tok_s": 40.0, "tg_tok_s": 8.0},
                     "mixqrt": {"ok": True, "pp_tok_s": 20.0, "tg_tok_s": 16.0, "rss_after_warmup_bytes": 2**30,
                                "rss_after_decode_bytes": 2**31, "file_rss_after_decode_bytes": 2**30,
                                "file_rss_after_warmup_bytes": 2**29, "file_bytes": 2**30},
                     "mixqrt:x": {"ok": True, "pp_tok_s": 25.0, "tg_tok_s": 12.0}}}
    text = bench_moe.doc_blocks(res)["moe-results"]
    assert "**1.60x** (met)" in text                     # decode 16 / 10 against Q4_0, the faster type
    assert "**0.73x** (met)" in text and "**0.87x** (not met)" in text     # file 1100 / 1500, 1300 / 1500
    assert "**0.40x** (not met)" in text                 # prefill 20 / 50
    assert "4 of 24 layers" in text and "1.00x** its" in text


def test_depth_fit_projects_a_linear_step_time():
    """--depth-fit: step time = fixed + layers x per-layer through two runs, projected to 24 layers."""
    def run(layers, tg, pp):
        return {"settings": {"types": ["Q4_0"], "n_prompt": 512, "n_gen": 128, "recipe": "2356t",
                             "provenance": f"- date: 2026-12-05 10:0{layers} UTC, commit x"},
                "bench": {"Q4_0": {"tg_tok_s": tg[0], "pp_tok_s": pp[0]}, "mixqrt": {"tg_tok_s": tg[1], "pp_tok_s": pp[1]}}}
    # per token: Q4_0 10 ms + 5 ms a layer, mixqrt 5 ms + 2.5 ms a layer; prompts: 1 s + 0.5 s a layer for both
    runs = {1: run(1, (1 / 0.015, 1 / 0.0075), (512 / 1.5, 512 / 1.5)),
            4: run(4, (1 / 0.030, 1 / 0.015), (512 / 3.0, 512 / 3.0))}
    fixed, per, full = bench_moe.depth_fit(runs, "Q4_0", "tg_tok_s")
    assert abs(fixed - 0.010) < 1e-9 and abs(per - 0.005) < 1e-9 and abs(full - 0.130) < 1e-9
    page = bench_moe.depth_fit_block(runs, "python benchmarks/moe.py --depth-fit 1,4")
    assert "**projected**" in page and "the 1-layer run (date: 2026-12-05 10:01 UTC" in page
    assert "mixqrt decode **2.00x**" in page and "prefill **1.00x**" in page

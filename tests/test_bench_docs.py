"""benchmarks/_common.py's docs/ writer: generated tables between markers, hand-written prose kept."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _common import ROOT, replace_blocks, shown, update_doc, write_json  # noqa: E402

PAGE = """# Page

Hand-written intro.

<!-- BEGIN mixqrt:t1 -->
| old | table |
<!-- END mixqrt:t1 -->

Prose between.

<!-- BEGIN mixqrt:t2 -->
old 2
<!-- END mixqrt:t2 -->
Closing words.
"""


def test_update_keeps_prose_and_replaces_tables(tmp_path):
    p = tmp_path / "page.md"
    p.write_text(PAGE)
    update_doc(p, {"t1": "| new | table |\n|---|---|", "t2": "new 2\n"})
    text = p.read_text()
    assert text == (PAGE.replace("| old | table |", "| new | table |\n|---|---|").replace("old 2", "new 2"))
    update_doc(p, {"t1": "| new | table |\n|---|---|", "t2": "new 2"})
    assert p.read_text() == text                                   # idempotent
    assert [x.name for x in tmp_path.iterdir()] == ["page.md"]     # no temporary left behind


def test_missing_page_gets_a_skeleton_and_missing_markers_are_appended(tmp_path, capsys):
    p = tmp_path / "new.md"
    update_doc(p, {"a": "A", "b": "B"}, title="New page")
    text = p.read_text()
    assert text.startswith("# New page\n") and text.index("mixqrt:a") < text.index("mixqrt:b")
    p.write_text("# Page\n\nprose only\n")
    update_doc(p, {"a": "A"})
    assert p.read_text().startswith("# Page\n\nprose only\n") and "A\n<!-- END mixqrt:a -->" in p.read_text()
    assert "no markers for a" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["<!-- BEGIN mixqrt:t -->\nx\n",
                                 "<!-- END mixqrt:t -->\n<!-- BEGIN mixqrt:t -->\n",
                                 "<!-- BEGIN mixqrt:t -->\n<!-- END mixqrt:t -->\n<!-- BEGIN mixqrt:t -->\n"])
def test_broken_markers_raise_and_leave_the_page(tmp_path, bad):
    with pytest.raises(ValueError, match="block 't'"):
        replace_blocks(bad, {"t": "x"})
    p = tmp_path / "page.md"
    p.write_text(bad)
    with pytest.raises(ValueError):
        update_doc(p, {"t": "x"})
    assert p.read_text() == bad


def test_write_json_is_atomic_and_readable(tmp_path):
    p = tmp_path / "data" / "r.json"
    write_json(p, {"b": (1, 2), "a": Path("/x")})
    assert json.loads(p.read_text()) == {"a": "/x", "b": [1, 2]}
    assert [x.name for x in p.parent.iterdir()] == ["r.json"]



def _qwen_results():
    """A results.json as benchmarks/qwen2_7b.py builds it (every step, llama.cpp included)."""
    row = {"ttft_s": 2.4, "tg_tok_s": 7.9, "pp_tok_s": 42.9, "read_bandwidth_bytes_s": 47e9,
           "decode_bytes_per_token": 3.62e9, "bandwidth_ratio": 0.61, "peak_rss_bytes": 3.85e9}
    bench = {"ok": True, "row": row, "cpu_util": 0.85, "loadavg": [1.4, 1.6], "started": "17:30:14",
             "max_rss_bytes": 4.9e9, "build": {"ops_so_built": "16:51:36"}}
    quant = {"ok": True, "started": "14:22:18", "wall_s": 1323, "cpu_s": 600, "max_rss_bytes": 4.53e9,
             "peak_anon_bytes": 4.51e9, "peak_file_bytes": 0.02e9, "file_bytes": 3.78e9, "bits_per_weight": 3.967,
             "atomic": True, "loadavg": [9.0, 8.2],
             "by_role": {"ffn_up": {"formats": ["q3p"], "params": 10, "bytes": 5, "bpw": 3.5}}}
    lc = {"file_bytes": 3.81e9, "decode_bytes": 3.57e9, "wall_s": 119, "max_rss_bytes": 3.29e9,
          "bench": {"1": {"ok": True, "row": {"ttft_s": 6.3, "tg_tok_s": 3.75}, "max_rss_bytes": 5.2e9},
                    "2": {"ok": False}}}
    return {"machine": {"cpu": "AMD EPYC", "cores": 2, "mem_gb": 25.3, "isa": "avx512", "python": "3.11.7"},
            "checkpoint": {"shards": 4, "bytes": 15.23e9},
            "settings": {"n_prompt": 128, "n_gen": 32, "reps": 3, "pipe_tokens": 8, "date": "d", "command": "c"},
            "dry_run": {"f32": {"tensor_bytes": 30.46e9}, "f16": {"tensor_bytes": 15.23e9}},
            "quantize": {"2356": quant, "q8": {"ok": False, "wall_s": 5, "rc": 1}},
            "bench": {"2356": {"1": bench, "2": bench}},
            "pipeline": {"2356": {"ok": True, "max_rss_bytes": 3.79e9, "peak_anon_bytes": 0.15e9,
                                  "result": {"load_s": 0.65, "prompt_tokens": 36, "first_piece_s": 1.93, "ttft_s": 1.89,
                                             "generated_tokens": 8, "total_s": 2.89, "gen_tps": 7.34}}},
            "llamacpp": {"base": {"type": "Q8_0", "file_bytes": 8.1e9, "wall_s": 75, "max_rss_bytes": 3.43e9,
                                  "peak_anon_bytes": 3.3e9}, "Q3_K_M": lc}}


def test_qwen2_7b_tables_and_page_markers():
    import importlib.util
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("qwen2_7b_bench", root / "benchmarks" / "qwen2_7b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    blocks = mod.doc_blocks(_qwen_results())
    assert "| 2356 mixed (`2356`) | 2.7 GB | 3.78 GB | 3.97 |" in blocks["qwen7b-article"]
    assert "| `2356` | 2 | 3.62 GB | 47.0 GB/s | 12.98 | 7.90 | 0.61 | yes |" in blocks["qwen7b-bandwidth"]
    assert "**failed (rc 1)**" in blocks["qwen7b-quantize"]
    assert "| Q3_K_M | 3.81 GB | 3.57 GB | 119 | 3.29 | 6300 / - | 3.75 / - | 0.28 / - | 5.20 / - |" \
        in blocks["qwen7b-llamacpp"]
    assert "| 0.65 | 36 | 1.93 | 1.89 | 8 | 2.89 | 7.34 | 3.79 | 0.15 |" in blocks["qwen7b-pipeline"]
    assert mod.doc_blocks({})                                   # nothing measured yet: still renders
    page = (root / "docs" / "lab" / "qwen2-7b.md").read_text()
    for name in blocks:
        assert page.count(f"<!-- BEGIN mixqrt:{name} -->") == 1 and page.count(f"<!-- END mixqrt:{name} -->") == 1


def test_formats_tables_land_in_docs_formats_page(tmp_path, capsys):
    """benchmarks/formats.py rewrites only the marked tables of docs/quant-formats.md (a copy here)."""
    import argparse
    import importlib.util
    import shutil
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("formats_bench", root / "benchmarks" / "formats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = tmp_path / "quant-formats.md"
    shutil.copy(root / "docs" / "quant-formats.md", page)
    before = page.read_text()
    sec = {k: ["| x | y |", "|---|---|", f"| {k} | 1 |"] for k in "aglbcd"}
    kl = {(0, "q3u"): 0.4, (0, "q3p"): 0.3, (12, "q3u"): 0.5, (12, "q3p"): 0.55}
    mod.write_doc(argparse.Namespace(out=page, quick=True), sec, "16 tokens", kl, [0, 1], 16, 16, 1.0, (64, 896))
    after = page.read_text()
    assert "no markers" not in capsys.readouterr().err
    assert after.count("<!-- BEGIN mixqrt:") == before.count("<!-- BEGIN mixqrt:") == 8
    assert "layer 0: 25.0% lower, layer 12: -10.0% lower" in after and "| d | 1 |" in after
    prose = [ln for ln in before.splitlines() if ln and not ln.startswith(("|", "- **", "<!--", "Slice:", "Lloyd",
                                                                           "Speed-up", "q3p's KL"))]
    assert all(ln in after for ln in prose)                       # the hand-written text is untouched
    assert json.loads((tmp_path / "data" / "quant-formats.json").read_text())["kl_mean"]["0/q3p"] == 0.3


def test_thread_scaling_renders_a_saved_run(tmp_path):
    """benchmarks/thread_scaling.py --from-json writes one machine's tables (named by --tag) into a page
    from the raw rows a run on another machine saved (docs/data/thread-scaling-xeon16.json)."""
    import thread_scaling
    saved = Path(__file__).resolve().parent.parent / "docs" / "data" / "thread-scaling-xeon16.json"
    run = json.loads(saved.read_text())
    page = tmp_path / "p.md"
    page.write_text("# P\n\nprose\n")
    assert thread_scaling.main(["--from-json", str(saved), "--tag", "x", "--out", str(page)]) == 0
    text = page.read_text()
    assert "prose" in text and text.count("BEGIN mixqrt:thread-scaling-x-") == 4
    decode = thread_scaling.scaling_table(run["rows"])
    # one row per (model, threads); speed-up against the model's 1-thread row
    assert decode.count("\n") == len(run["rows"]) + 1 and "| 1.00x |" in decode
    assert "| 16 |" in thread_scaling.probe_table({int(k): v for k, v in run["probes"].items()})


def test_generated_blocks_name_no_path_outside_the_repository(tmp_path):
    """A benchmark's command line (a scratch model, ../shared texts) lands on a docs/ page as file names;
    paths inside the repository become relative to its root; endpoints and ratios are left alone."""
    cmd = (f"python benchmarks/x.py /tmp/m/q.mxq --gguf /root/l/Q3.gguf --text ../shared/data/w.txt "
           f"--calibrate self+/work/shared/data/t.txt --out {ROOT}/docs/lab/x.md")
    assert shown(cmd) == "python benchmarks/x.py q.mxq --gguf Q3.gguf --text w.txt --calibrate self+t.txt --out docs/lab/x.md"
    assert shown("GET /v1/chat/completions at 1/2 tok/s") == "GET /v1/chat/completions at 1/2 tok/s"
    page = tmp_path / "p.md"
    update_doc(page, {"run": "Command: `python benchmarks/y.py --model /tmp/a/b.mxq`"})
    assert "/tmp" not in page.read_text() and "`python benchmarks/y.py --model b.mxq`" in page.read_text()

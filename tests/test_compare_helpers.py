"""Pure helpers of benchmarks/compare_llamacpp.py: system names, option values, goals, the report."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_llamacpp.py"
_spec = importlib.util.spec_from_file_location("compare_llamacpp", _PATH)
cl = importlib.util.module_from_spec(_spec)
sys.modules["compare_llamacpp"] = cl           # dataclasses look their module up while the class is built
_spec.loader.exec_module(cl)


def test_parse_system_kinds_and_options():
    s = cl.parse_system("mixqrt:2356")
    assert (s.kind, s.name, s.opts, s.key, s.label) == ("mixqrt", "2356", (), "mixqrt:2356", "2356")
    s = cl.parse_system("llama.cpp:q4_k_m")
    assert (s.kind, s.name, s.key, s.label) == ("llamacpp", "Q4_K_M", "llamacpp:Q4_K_M", "llama.cpp Q4_K_M")
    s = cl.parse_system("mixqrt:2356:imatrix=/tmp/x/imat.json:budget-bytes=3e8")
    assert s.opts == (("imatrix", "/tmp/x/imat.json"), ("budget_bytes", "3e8"))
    assert cl.parse_system(s.key) == s                      # the key is what --worker receives
    assert s.label == "2356+imatrix(imat.json)+budget_bytes(3e8)"
    assert cl.parse_system("machine").kind == "machine"


@pytest.mark.parametrize("bad", ["2356", "mixqrt:", "llamacpp:Q5_K_S", "gpu:f32", "mixqrt:2356:imatrix"])
def test_parse_system_rejects(bad):
    with pytest.raises(ValueError):
        cl.parse_system(bad)


def test_select_systems_defaults_extras_and_dedup():
    all_ = cl.select_systems("all")
    assert [s.key for s in all_][:2] == ["mixqrt:f32", "mixqrt:q8"]
    assert len(all_) == len(cl.MIXQRT_RECIPES) + len(cl.LCPP_FTYPES)
    sel = cl.select_systems("mixqrt:f32,llamacpp:F32,mixqrt:f32", ["2356:imatrix=/a", "mixqrt:auto:budget_bytes=1"])
    assert [s.key for s in sel] == ["mixqrt:f32", "llamacpp:F32", "mixqrt:2356:imatrix=/a", "mixqrt:auto:budget_bytes=1"]
    assert [s.extra for s in sel] == [False, False, True, True]


@pytest.mark.parametrize("text,value", [("12", 12), ("330e6", 330_000_000), ("0.5", 0.5), ("300M", 300_000_000),
                                        ("1.5k", 1500), ("true", True), ("/tmp/a.json", "/tmp/a.json")])
def test_coerce(text, value):
    v = cl.coerce(text)
    assert v == value and type(v) is type(value)


def _results(**over):
    """A results dict as measure() builds it."""
    spec = {
        "mixqrt:f32": dict(file_bytes=2500e6, ppl=13.90, tg=10.0, pp=50.0, kld=0.0),
        "mixqrt:2356": dict(file_bytes=330e6, ppl=15.0, tg=30.0, pp=80.0, kld=0.05),
        "llamacpp:F32": dict(file_bytes=2500e6, ppl=13.88, tg=9.0, pp=60.0, kld=0.001),
        "llamacpp:Q3_K_M": dict(file_bytes=430e6, ppl=15.5, tg=24.0, pp=70.0, kld=0.07),
        "llamacpp:Q2_K": dict(file_bytes=415e6, ppl=18.0, tg=25.0, pp=75.0, kld=0.2),
    }
    for k, v in over.items():
        spec[k.replace("__", ":")].update(v)
    out = {}
    for k, v in spec.items():
        out[k] = {"system": cl.parse_system(k), "prepare": {"file_bytes": v["file_bytes"]},
                  "ppl": {"ppl": v["ppl"], "ppl_err": 0.1, "chunks": 1, "tokens": 255, "kld_mean": v["kld"]},
                  "speed": {"tg_tok_s": v["tg"], "pp_tok_s": v["pp"], "ttft_s": 0.5, "cpu_utilisation": 0.95,
                            "peak_rss_bytes": 5e8, "bandwidth_ratio": 0.4}}
    return out


def test_agreement_and_goals():
    r = _results()
    m, l_, rel = cl.agreement(r)
    assert (m, l_) == (13.90, 13.88) and rel == pytest.approx(0.02 / 13.88)
    g = cl.goals(r, "mixqrt:2356")
    assert [x["ok"] for x in g] == [True, True, True, True, True]
    assert "1.20x (needs 1.20x)" in g[2]["gap"] and "Q2_K" in g[2]["gap"]     # fastest llama.cpp decode is Q2_K
    assert cl.lost_sentences(r, "mixqrt:2356", "2356") == []


def test_goals_fail_and_missing():
    r = _results(mixqrt__2356=dict(file_bytes=420e6, ppl=16.0, tg=29.0, pp=74.0, kld=0.08))
    g = cl.goals(r, "mixqrt:2356")
    assert [x["ok"] for x in g] == [False, False, False, False, False]
    assert g[4]["goal"].startswith("(e) KL") and "+14.3 %" in g[4]["gap"]
    lost = cl.lost_sentences(r, "mixqrt:2356", "2356")
    assert len(lost) == 5 and lost[2].startswith("2356 loses decode")
    r["llamacpp:Q3_K_M"]["ppl"] = {"error": "boom"}
    assert cl.goals(r, "mixqrt:2356")[1]["ok"] is None
    assert cl.agreement({}) is None


def test_report_and_plot(tmp_path):
    r = _results()
    systems = [r[k]["system"] for k in r]
    a = cl.argparse.Namespace(threads=2, repeats=3, n_prompt=512, n_gen=128, ttft_prompt=128, chunks=1, ctx=512,
                              model="/m/qwen.gguf", text="/t/wiki.txt", cache_dir="/tmp/c", report_only=False,
                              out=str(tmp_path / "results.md"), plot=str(tmp_path / "results.png"))
    info = {"command": "python benchmarks/compare_llamacpp.py", "cpu_model": "CPU", "cpu_vendor": "V",
            "usable_cpus": 2, "logical_cpus": 2, "ram_bytes": 2**34, "isa": "avx2", "loadavg": (0.1, 0.1, 0.1),
            "date_utc": "today", "git_commit": "abc", "llama_cpp_python": "0.3.36", "wall_seconds": 60,
            "task_log": [], "read_bandwidth_bytes_s": 2e10}
    cl.write_report(a, systems, r, info)
    md = Path(a.out).read_text()
    assert "relative difference 0.144 % -> PASS" in md
    assert md.count("**PASS**") == 5 and "WARNING" not in md
    assert "| 2356 |" in md and "| llama.cpp Q2_K |" in md
    pytest.importorskip("matplotlib")
    cl.write_plot(a.plot, systems, r, "qwen")
    assert os.path.getsize(a.plot) > 1000


def test_busy_warning():
    r = _results()
    info = {"usable_cpus": 2, "loadavg": (5.0, 1, 1), "loadavg_end": (0.5, 1, 1)}
    assert "load average 5.0" in cl.busy_warning(r, info, 2)
    info["loadavg"] = (0.5, 1, 1)
    assert cl.busy_warning(r, info, 2) is None
    r["mixqrt:2356"]["speed"]["cpu_utilisation"] = 0.3
    assert "lowest: 30 %" in cl.busy_warning(r, info, 2)


def test_docs_results_page_has_every_block(tmp_path):
    """docs/results.md carries the markers of every block write_report generates, so a rerun updates
    its tables in place and keeps the hand-written text."""
    r = _results()
    a = cl.argparse.Namespace(threads=2, repeats=3, n_prompt=512, n_gen=128, ttft_prompt=128, chunks=1, ctx=512,
                              model="/m/q.gguf", text="/t/w.txt", cache_dir="/tmp/c", report_only=False)
    info = {"command": "c", "loadavg": (0.1, 0.1, 0.1), "date_utc": "d", "git_commit": "g", "wall_seconds": 1,
            "task_log": []}
    blocks = cl.report_blocks(a, [r[k]["system"] for k in r], r, info)
    page = (_PATH.parent.parent / "docs" / "results.md").read_text()
    for name in blocks:
        assert page.count(f"<!-- BEGIN mixqrt:{name} -->") == 1 and page.count(f"<!-- END mixqrt:{name} -->") == 1
    assert cl.json_path("docs/results.md") == Path("docs/data/results.json")


def test_speed_mixqrt_runs_bench_without_its_probe(tmp_path):
    """speed_mixqrt replaces mixqrt.commands.bench's bandwidth probe (measured once per run) by a stub that
    must take whatever bench() passes it: a stub of the wrong signature failed every mixqrt speed
    task of a comparison run once."""
    from tinymodel import make_tiny_hf_model

    from mixqrt.quantize.convert import quantize_model
    src = make_tiny_hf_model(tmp_path / "hf", arch="llama", tied=False, seed=3)
    out = tmp_path / "m.mxq"
    quantize_model(str(src), "q8", str(out), progress=False, offline=True)
    import mixqrt.commands.bench as mb
    real = mb.measure_bandwidth
    try:
        r = cl.speed_mixqrt(cl.parse_system("mixqrt:q8"), {"path": str(out), "threads": 1, "n_prompt": 8,
                                                            "n_gen": 4, "ttft_prompt": 4, "repeats": 1})
    finally:
        mb.measure_bandwidth = real
    assert r["tg_tok_s"] > 0 and r["pp_tok_s"] > 0 and r["decode_bytes_per_token"] > 0

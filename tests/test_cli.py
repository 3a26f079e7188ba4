"""The `mixqrt` command line on the tiny model (and the real one under the realmodel fixtures)."""
import json
import os
import subprocess
import sys

import pytest

from mixqrt.cli import main
from tinymodel import make_tiny_hf_model


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", tied=False, seed=2)


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ISA tier" in out and "usable" in out
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["isa"] in ("generic", "avx2", "avx512") and info["usable_cpus"] >= 1
    # the pool's pinning order covers every usable CPU once; cores and LLC as sysfs says
    assert sorted(info["worker_cpus"]) == sorted(os.sched_getaffinity(0))
    assert 1 <= info["physical_cores"] <= len(info["worker_cpus"]) and info["llc_bytes"] >= 0


def test_doctor_model_pages(tiny, tmp_path, capsys):
    out = tmp_path / "m.mxq"
    assert main(["quantize", str(tiny), "--recipe", "2356", "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--model", str(out), "--recache"]) == 0
    text = capsys.readouterr().out
    assert "in 2 MiB pages" in text and "recache" in text
    assert main(["doctor", "--json", "--model", str(out)]) == 0
    pages = json.loads(capsys.readouterr().out)["model_pages"]
    assert pages["model"] == str(out) and "recached" not in pages
    assert main(["doctor", "--model", str(tmp_path / "none.mxq")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--recache"])
    assert e.value.code == 2


def test_doctor_honours_mixqrt_isa():
    import os
    import mixqrt  # run where the imported package lives (the source tree in development, site-packages in CI)
    out = subprocess.run([sys.executable, "-m", "mixqrt", "doctor", "--json"], capture_output=True, text=True,
                         env={**os.environ, "MIXQRT_ISA": "generic"}, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(mixqrt.__file__)))).stdout
    assert json.loads(out)["isa"] == "generic"


def test_quantize_inspect_generate(tiny, tmp_path, capsys):
    out = tmp_path / "m.mxq"
    assert main(["quantize", str(tiny), "--recipe", "2356", "-o", str(out), "-q", "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip(), cap.err
    rep = json.loads(cap.out)
    assert rep["total_bytes"] > 0 and 2 < rep["bits_per_weight"] < 33 and rep["by_role"]["embed"]["formats"] == ["q2c"]
    assert main(["quantize", str(tiny), "--dry-run", "--tensor-type", "ffn_down=q8"]) == 0
    assert "ffn_down" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "q2c" in text and "total" in text and "page-aligned spans" in text
    assert main(["inspect", str(out), "--placement"]) == 0
    assert "node" in capsys.readouterr().out.lower()
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bits_per_weight"] > 0
    assert main(["generate", str(out), "-p", "hello", "-n", "4", "--temperature", "0", "-q"]) == 0
    assert capsys.readouterr().out.startswith("")


def test_cli_errors_are_one_line(tiny, tmp_path, capsys):
    assert main(["quantize", str(tiny), "--recipe", "nope", "-o", str(tmp_path / "x.mxq")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixqrt: error:") and "unknown recipe" in err
    assert main(["generate", str(tmp_path / "missing.gguf"), "-p", "x"]) == 2
    assert not (tmp_path / "x.mxq").exists()


def test_ppl_and_bench_json(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["ppl", str(tiny), "--recipe", "q8", "--text", str(text), "--ctx", "32", "--chunks", "3",
                 "--json", "-q", "--save-logits", str(tmp_path / "b.lg")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ppl"] > 1 and r["tokens"] == 3 * 15 and "seconds" in r and "same_top_pct" in r
    assert main(["ppl", str(tiny), "--recipe", "2356", "--text", str(text), "--ctx", "32", "--chunks", "3",
                 "--json", "-q", "--kl-base", str(tmp_path / "b.lg")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kld_mean"] >= 0 and 0 <= r["same_top_pct"] <= 100
    assert main(["bench", str(tiny), "--recipe", "q8", "-t", "1", "-p", "16", "-n", "4", "-r", "1", "--json",
                 "-q", "--perf"]) == 0
    b = json.loads(capsys.readouterr().out)
    for k in ("pp_tok_s", "tg_tok_s", "ttft_s", "peak_rss_bytes", "model_bytes", "bandwidth_ratio"):
        assert b[k] > 0, k


def test_bench_peak_rss_excludes_freed_probe_buffer():
    """`bench` resets the peak-RSS mark after the bandwidth probe frees its buffer, so a model's
    peak is not the probe's 1 GiB (Linux; elsewhere it falls back to ru_maxrss)."""
    import numpy as np

    from mixqrt.commands import bench
    if not bench._reset_peak_rss():
        pytest.skip("/proc/self/clear_refs not writable here")
    big = np.ones(64 << 20, dtype=np.uint8)          # 64 MiB resident, then freed
    before = bench._vm_hwm_bytes()
    del big
    assert bench._reset_peak_rss()
    after = bench._vm_hwm_bytes()
    assert before is not None and after is not None and after < before - (32 << 20)


def test_q5g_gate_and_up_quantize_and_run(tiny, tmp_path, capsys):
    # issue #14: a q5g gate/up pair (a per-tensor range, so no fused tensor) used to fail midway
    # through quantization; the parts are now written separately and run as two matmuls
    out = tmp_path / "q5.mxq"
    assert main(["quantize", str(tiny), "-o", str(out), "-q", "--tensor-type", "ffn_gate=q5g",
                 "--tensor-type", "ffn_up=q5g"]) == 0
    assert main(["generate", str(out), "-p", "hello", "-n", "3", "--temperature", "0", "-q"]) == 0
    capsys.readouterr()

"""A mixture-of-experts .mxq: every expert tensor on pages of its own, the file readable as any other, and
`mixqrt bench`'s resident-memory report."""
import numpy as np
import pytest

from tinymodel import make_tiny_hf_model


@pytest.fixture(scope="module")
def moe_mxq(tmp_path_factory):
    from mixqrt.quantize.convert import quantize_model
    d = tmp_path_factory.mktemp("moe")
    src = make_tiny_hf_model(d / "hf", arch="qwen2_moe", dtype="f32")
    out = d / "m.mxq"
    quantize_model(str(src), "2356t", out, progress=False)
    return out


def test_expert_tensors_are_page_aligned(moe_mxq):
    from mixqrt.io.mxq import MxqFile, validate
    with MxqFile(moe_mxq) as f:
        page = 4096
        experts = {n: t for n, t in f.tensors.items() if ".mlp.experts." in n}
        assert len(experts) == 2 * 4 * 3
        for name, t in f.info.items():        # every tensor: an expert never shares a page with another
            assert t.offset % page == 0, (name, t.offset)
        ends = sorted((t.offset, t.offset + t.nbytes) for t in f.info.values())
        for (_, e0), (s1, _) in zip(ends, ends[1:]):
            assert s1 >= e0 and s1 % page == 0
    validate(str(moe_mxq), deep=True)


def test_dense_files_keep_cache_line_alignment(tmp_path):
    from mixqrt.io.mxq import MxqFile
    from mixqrt.quantize.convert import quantize_model
    src = make_tiny_hf_model(tmp_path / "hf", arch="qwen2", dtype="f32")
    quantize_model(str(src), "q8", tmp_path / "d.mxq", progress=False)
    with MxqFile(tmp_path / "d.mxq") as f:
        assert any(t.offset % 4096 for t in f.info.values())


def test_moe_file_runs_and_bench_reports_rss(moe_mxq):
    import mixqrt
    from mixqrt.commands.bench import bench, format_rows
    m = mixqrt.load(str(moe_mxq))
    assert np.isfinite(m.model.logits(np.array([5, 77, 3, 200]))).all()
    rows = bench(m, threads=(1,), n_prompt=16, n_gen=4, ttft_prompt=8,
                 repeats=1, probe_bytes=1 << 22, probes=1)
    r = rows[0]
    for k in ("rss_after_warmup_bytes", "rss_after_decode_bytes", "file_rss_after_warmup_bytes",
              "file_rss_after_decode_bytes", "file_bytes"):
        assert k in r, k
    assert r["file_bytes"] == moe_mxq.stat().st_size
    if r["rss_after_decode_bytes"] is not None:            # Linux
        assert r["rss_after_decode_bytes"] > 0 and 0 < r["file_rss_after_decode_bytes"] <= r["file_bytes"] + 2**21
        assert "RSS after warm-up" in format_rows(rows, "moe")
    # decode reads top_k / num_experts of the routed experts' bytes
    from mixqrt.commands.bench import _weights, decode_bytes_per_token
    w = dict(_weights(m.model))                     # tied: the embedding is read whole as the output head
    routed = sum(t.nbytes for n, t in w.items() if ".mlp.experts." in n)
    rest = sum(t.nbytes for n, t in w.items() if ".mlp.experts." not in n)
    assert decode_bytes_per_token(m.model, 0) == pytest.approx(rest + routed * 2 / 4, rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_single_token_path_is_bit_identical(tmp_path, arch, monkeypatch):
    """Decode's single-token MoE path (models/moe._moe_one: no grouping, silu inside the down product)
    gives the general path's bits, on packed (2356t) and float weights."""
    import mixqrt
    from mixqrt.models import moe
    from mixqrt.quantize.convert import quantize_model
    src = make_tiny_hf_model(tmp_path / "hf", arch=arch, dtype="f32")
    one = moe._moe_one
    for recipe in ("2356t", "f32"):
        out = tmp_path / f"{recipe}.mxq"
        quantize_model(str(src), recipe, out, progress=False)
        m = mixqrt.load(str(out)).model
        got, calls = {}, []
        monkeypatch.setattr(moe, "_moe_one", lambda *a: calls.append(1) or one(*a))
        for fast in (True, False):
            monkeypatch.setattr(moe, "FAST_DECODE", fast)
            cache = m.make_cache(32)
            m(np.array([5, 77, 3]), cache, 0, last_only=True)
            got[fast] = np.stack([m(np.array([t]), cache, None, last_only=True) for t in (9, 123, 300, 7)])
        np.testing.assert_array_equal(got[True], got[False])
        # 4 decode steps x 2 sparse layers, fast path only, + the prompt's last layer (last row only)
        assert len(calls) == 4 * 2 + 1

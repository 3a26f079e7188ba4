"""Hub ids, tested without network: a fake HF cache, HF_HUB_OFFLINE, and a stubbed downloader."""
import shutil

import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError
import pytest
from tinymodel import make_tiny_hf_model

from mixqrt.errors import FormatError, ModelError
from mixqrt.io import open_source, resolve_hub
from mixqrt.io.hf import HFSource
from mixqrt.io.hub import ALLOW_PATTERNS
from mixqrt.io.dispatch import _looks_like_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_cache(cache, repo_id, make_files):
    """Lay out `cache` the way huggingface_hub does: models--org--name/{refs/main, snapshots/<sha>/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    make_files(snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def cache(tmp_path):
    c = tmp_path / "hub"
    _fake_cache(c, "tiny-org/tiny-qwen", lambda d: make_tiny_hf_model(d))
    return c


def test_offline_cache_hit(cache):
    folder = resolve_hub("tiny-org/tiny-qwen", offline=True, cache_dir=cache)
    assert folder.name == COMMIT and (folder / "config.json").is_file()
    with open_source("tiny-org/tiny-qwen", offline=True, cache_dir=cache, progress=False) as src:
        assert isinstance(src, HFSource) and src.arch == "qwen2"
        assert src.tokenizer.encode("hello") != []


def test_env_offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hub("tiny-org/tiny-qwen", cache_dir=cache).name == COMMIT
    with pytest.raises(ModelError) as e:
        resolve_hub("Qwen/Qwen2-0.5B-Instruct", cache_dir=cache)
    msg = str(e.value)
    assert "Qwen/Qwen2-0.5B-Instruct" in msg and "HF_HUB_OFFLINE" in msg
    assert "download Qwen/Qwen2-0.5B-Instruct" in msg and "HF_HOME" in msg


def test_offline_miss_through_open_source(cache):
    with pytest.raises(ModelError, match="no-such/model.*not in the Hugging Face cache"):
        open_source("no-such/model", offline=True, cache_dir=cache)


def test_pickle_only_snapshot_refused(tmp_path):
    def files(d):
        d.mkdir(parents=True)
        make_tiny_hf_model(tmp_path / "src")
        shutil.copy(tmp_path / "src" / "config.json", d / "config.json")
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    c = tmp_path / "hub"
    _fake_cache(c, "old/pickled", files)
    with pytest.raises(FormatError, match="pickle"):
        open_source("old/pickled", offline=True, cache_dir=c)


def test_download_asks_only_for_safe_files(monkeypatch, tmp_path):
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return str(make_tiny_hf_model(tmp_path / "dl"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    resolve_hub("org/model", progress=False)
    assert seen["local_files_only"] is False and seen["repo_id"] == "org/model"
    assert seen["allow_patterns"] == ALLOW_PATTERNS and "tqdm_class" in seen
    assert not any(p.endswith((".bin", ".pt", ".pth", ".pkl")) or p == "*" for p in ALLOW_PATTERNS)


@pytest.mark.parametrize("exc", [OSError("Connection refused"),
                                 LocalEntryNotFoundError("no cache, no net")])
def test_network_failures_become_model_errors(monkeypatch, exc):
    def fake(**kw):
        raise exc
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(ModelError, match="org/model.*download org/model"):
        resolve_hub("org/model", offline=False)


def test_repo_id_detection(tmp_path):
    assert _looks_like_repo_id("Qwen/Qwen2-0.5B")
    for s in ("model.gguf", "./a/b", "/abs/path", "a/b/c", "~/x", "a/"):
        assert not _looks_like_repo_id(s), s

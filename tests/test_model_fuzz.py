"""Mutation fuzzing of the GGUF and safetensors/HF-folder readers (hypothesis, in CI): every mutated
file ends in FormatError/ModelError or in a model that runs; never another exception, a crash or a
hang. The 100k-case runs are benchmarks/fuzz_gguf.py and benchmarks/fuzz_safetensors.py (same
mutators and oracle, mixqrt/testing/fuzz_files.py); their results are in docs/format.md."""
from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixqrt.testing.fuzz_files import (INTERESTING, N_GGUF_OPS, N_HF_OPS, check_gguf, check_hf, gguf_seeds, hf_seeds,
                        mutate_gguf, mutate_hf, write_folder)

_TMP = tempfile.mkdtemp(prefix="modelfuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
_SEEDS: dict = {}
EXAMPLES = int(os.environ.get("MODEL_FUZZ_EXAMPLES", 1000))

_ints = st.one_of(st.integers(0, 300), st.integers(0, 1 << 24), st.sampled_from(INTERESTING))


def _ops(n_kinds):
    return st.lists(st.tuples(st.integers(0, n_kinds - 1), _ints, _ints), min_size=1, max_size=4)


def _seeds(kind):
    if kind not in _SEEDS:
        _SEEDS[kind] = gguf_seeds() if kind == "gguf" else hf_seeds()
    return _SEEDS[kind]


def test_seeds_load():
    p = os.path.join(_TMP, "seed.gguf")
    for s in _seeds("gguf"):
        with open(p, "wb") as fh:
            fh.write(mutate_gguf(s, []))
        assert check_gguf(p) == "loaded"
    folder = os.path.join(_TMP, "seed")
    os.makedirs(folder, exist_ok=True)
    for s in _seeds("hf"):
        write_folder(folder, mutate_hf(s, []))
        assert check_hf(folder) == "loaded"


_SETTINGS = settings(max_examples=EXAMPLES, deadline=5000, derandomize=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(seed=st.integers(0, 2), ops=_ops(N_GGUF_OPS))
def test_fuzz_gguf(seed, ops):
    p = os.path.join(_TMP, "case.gguf")
    with open(p, "wb") as fh:
        fh.write(mutate_gguf(_seeds("gguf")[seed], ops))
    assert check_gguf(p) in ("rejected", "loaded")


@_SETTINGS
@given(seed=st.integers(0, 2), ops=_ops(N_HF_OPS))
def test_fuzz_safetensors(seed, ops):
    folder = os.path.join(_TMP, "case")
    os.makedirs(folder, exist_ok=True)
    write_folder(folder, mutate_hf(_seeds("hf")[seed], ops))
    assert check_hf(folder) in ("rejected", "loaded")


def teardown_module(module):
    shutil.rmtree(_TMP, ignore_errors=True)

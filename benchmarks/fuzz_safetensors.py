"""Long mutation fuzz of the safetensors / HF-folder reader (outside CI): N mutated folders (config,
index, generation config and safetensors headers and bytes) through HFSource, every tensor, the
tokenizer and the model; each must end in FormatError/ModelError or a load that runs. Crashes, hangs
and any other exception are failures (see mixqrt/testing/fuzz.py).

    python benchmarks/fuzz_safetensors.py -n 100000 [--seed 0] [--timeout 5] [--json out.json]

Reproduce case i:  mutate_hf(hf_seeds()[s], ops) with (s, ops) from the failure report.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree, as the other benchmarks
from mixqrt.testing import fuzz as _fuzz  # noqa: E402


def make_runner():
    from mixqrt.testing.fuzz_files import N_HF_OPS, check_hf, hf_seeds, mutate_hf, write_folder
    seeds = hf_seeds()
    root = tempfile.mkdtemp(prefix="stfuzz-")  # under the harness's scratch folder
    folder = os.path.join(root, "model")
    os.mkdir(folder)

    def run_case(r):
        s, ops = r.randrange(len(seeds)), _fuzz.rand_ops(r, N_HF_OPS)
        write_folder(folder, mutate_hf(seeds[s], ops))
        return check_hf(folder)
    return run_case


def describe(seed, i):
    from mixqrt.testing.fuzz_files import N_HF_OPS
    s, ops = _fuzz.case_ops(seed, i, 3, N_HF_OPS)
    return {"seed_file": s, "ops": ops}


if __name__ == "__main__":
    sys.exit(_fuzz.main("safetensors", make_runner, describe))

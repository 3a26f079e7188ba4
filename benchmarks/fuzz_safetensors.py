"""Long mutation fuzz of the safetensors / HF-folder reader (outside CI): N mutated folders (config,
index, generation config and safetensors headers and bytes) through HFSource, every tensor, the
tokenizer and the model; each must end in FormatError/ModelError or a load that runs. Crashes, hangs
and any other exception are failures (see benchmarks/_fuzz.py).

    python benchmarks/fuzz_safetensors.py -n 100000 [--seed 0] [--timeout 5] [--json out.json]

Reproduce case i:  mutate_hf(hf_seeds()[s], ops) with (s, ops) from the failure report.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import _fuzz  # noqa: E402


def _case(seed: int, i: int):
    import random

    from model_fuzz import N_HF_OPS
    r = random.Random(f"{seed}:{i}")
    s = r.randrange(3)
    return s, _fuzz.rand_ops(r, N_HF_OPS)


def make_runner():
    from model_fuzz import N_HF_OPS, check_hf, hf_seeds, mutate_hf, write_folder
    seeds = hf_seeds()
    root = tempfile.mkdtemp(prefix="stfuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    folder = os.path.join(root, "model")
    os.mkdir(folder)

    def run_case(r):
        s = r.randrange(len(seeds))
        write_folder(folder, mutate_hf(seeds[s], _fuzz.rand_ops(r, N_HF_OPS)))
        return check_hf(folder)
    return run_case


def describe(seed, i):
    s, ops = _case(seed, i)
    return {"seed_file": s, "ops": ops}


if __name__ == "__main__":
    sys.exit(_fuzz.main("safetensors", make_runner, describe))

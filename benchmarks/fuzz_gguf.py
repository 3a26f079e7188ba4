"""Long mutation fuzz of the GGUF reader (outside CI): N mutated files through GGUFSource, every
tensor, the tokenizer and the model; each must end in FormatError/ModelError or a load that runs.
Crashes, hangs and any other exception are failures (see mixqrt/testing/fuzz.py).

    python benchmarks/fuzz_gguf.py -n 100000 [--seed 0] [--timeout 5] [--json out.json]

Reproduce case i:  mutate_gguf(gguf_seeds()[s], ops) with (s, ops) from the failure report.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree, as the other benchmarks
from mixqrt.testing import fuzz as _fuzz  # noqa: E402


def make_runner():
    from mixqrt.testing.fuzz_files import N_GGUF_OPS, check_gguf, gguf_seeds, mutate_gguf
    seeds = gguf_seeds()
    d = tempfile.mkdtemp(prefix="ggufzz-")  # under the harness's scratch folder
    path = os.path.join(d, "case.gguf")

    def run_case(r):
        s, ops = r.randrange(len(seeds)), _fuzz.rand_ops(r, N_GGUF_OPS)
        data = mutate_gguf(seeds[s], ops)
        with open(path, "wb") as fh:
            fh.write(data)
        return check_gguf(path)
    return run_case


def describe(seed, i):
    from mixqrt.testing.fuzz_files import N_GGUF_OPS
    s, ops = _fuzz.case_ops(seed, i, 3, N_GGUF_OPS)
    return {"seed_file": s, "ops": ops}


if __name__ == "__main__":
    sys.exit(_fuzz.main("GGUF", make_runner, describe))

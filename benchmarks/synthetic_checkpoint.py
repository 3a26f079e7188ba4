"""A synthetic Qwen2-7B Hugging Face folder: the real config and tensor shapes, seeded bf16 weights
(the generator is mixqrt.testing.synthetic; its docstring describes the values and the files).

    python benchmarks/synthetic_checkpoint.py --out /tmp/mixqrt-7b/qwen2-7b-synthetic
    python benchmarks/synthetic_checkpoint.py --out /tmp/x --dims 64,2,4,2,128,448 --tokenizer tiny
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree, as the other benchmarks
from mixqrt.testing.synthetic import checkpoint_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(checkpoint_main())

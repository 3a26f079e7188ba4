"""A model-shaped .mxq with synthetic packed weights in a recipe's formats, for decode-speed runs at
sizes no real checkpoint here has (the generator is mixqrt.testing.synthetic.write_mxq).

    python benchmarks/synthetic_mxq.py [--recipe 2356t] [--out /tmp/mixqrt-7b-2356t.mxq] [--config 7b]
    mixqrt bench /tmp/mixqrt-7b-2356t.mxq -t 1,2 -p 32 -n 32 -r 2      # decode vs the bandwidth bound
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree, as the other benchmarks
from mixqrt.testing.synthetic import mxq_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(mxq_main())

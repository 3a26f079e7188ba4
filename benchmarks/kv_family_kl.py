"""KL of a packed KV type against f32 K/V for any model (docs/long-context.md, "the other families"):
WikiText-2 windows of CTX tokens, the second half of each scored, KL of the next-token distributions.
Not timed; the evaluation text only, never tuned on.

    python benchmarks/kv_family_kl.py MODEL.mxq 2048 q4,q8 3      # model, window, types, windows
"""
import sys
import time
from pathlib import Path

import numpy as np

import mixqrt
from mixqrt.commands.evaluate import log_softmax

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "wikitext-2-test.txt"


def main() -> None:
    mxq, ctx, types = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    nw = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    m = mixqrt.load(mxq)
    net = m.model if hasattr(m, "model") else m
    ids = np.asarray(m.tokenizer.encode(TEXT.read_text()[:ctx * 6 * nw + 50000]), np.int64)
    means = {}
    for w in range(nw):
        win = ids[w * ctx:(w + 1) * ctx]
        half, base = ctx // 2, None
        for kt in ["f32"] + types:
            t0 = time.time()
            lp = log_softmax(net(win, net.make_cache(ctx, kv_type=kt), 0, last_only=False)[half:-1])
            if base is None:
                base = lp
                continue
            kl = (np.exp(base) * (base - lp)).sum(-1)
            means.setdefault(kt, []).append(kl.mean())
            print(f"window {w} {kt}: KL {kl.mean():.6f} p99 {np.quantile(kl, .99):.5f} "
                  f"top-1 same {(base.argmax(-1) == lp.argmax(-1)).mean():.4f} ({time.time() - t0:.0f} s)", flush=True)
    for kt, v in means.items():
        print(f"{kt}: mean KL {np.mean(v):.6f} over {len(v)} windows")


if __name__ == "__main__":
    main()

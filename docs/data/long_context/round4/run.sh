#!/bin/bash
# issue 41, fourth round (the attention's softmax in base 2, 2026-12-06 night): decode at 16k against depth 0
# in alternation (benchmarks/depth_ratio.py), the previous code (OLD_PYTHONPATH: a checkout of bef56aa
# with its extensions built) and this one in the same run; mixqrt bench at 0 / 16k / 32k; llama.cpp's best
# decode at 16k (Q3_K_M, -fa 0) measured again; pp16384 with peak RSS; the attention kernels' cost.
# Each step under the benchmark lock; /tmp/timed.active pauses the untimed quality runs meanwhile.
HERE=$(cd "$(dirname "$0")/../../../.." && pwd)
. "$HERE/docs/data/long_context/round3/common.sh" "${1:-$HERE/docs/data/long_context/round4}"
G3=${GGUF_DIR:-/tmp/longctx-lcpp}/qwen-Q3_K_M.gguf
B=${MIXQRT_LLAMA_CPP_BIN:-/work/llama/build/bin}/llama-bench
ratio() {   # tag [PYTHONPATH]
  log "depth_ratio $1"
  run env ${2:+PYTHONPATH=$2} $PY $HERE/benchmarks/depth_ratio.py $M --depth 16384 --kv-type q4 --rounds 20 -q \
      --out $OUT/ratio-$1.json > $OUT/ratio-$1.txt 2> $OUT/ratio-$1.err; }
[ -n "${OLD_PYTHONPATH:-}" ] && ratio old "$OLD_PYTHONPATH"
ratio new
NGEN=128; for d in 0 16384; do mx q4 $d; done
NGEN=32; mx q4 32768
log "llama q3km-tg-fa0-f16-d16k"
run $B -m $G3 -t 2 -r 1 -o jsonl -p 0 -n 32 -d 16384 -fa 0 > $OUT/llama-q3km-tg-fa0-f16-d16k.jsonl 2> $OUT/llama-q3km-tg-fa0-f16-d16k.err
log "mixqrt q4 pp16384 (peak RSS)"
run $PY -m mixqrt bench $M -t 2 --kv-type q4 -p 16384 -n 8 -r 1 --json -q > $OUT/mixqrt-q4-pp16384.json 2> $OUT/mixqrt-q4-pp16384.err
[ -n "${OLD_PYTHONPATH:-}" ] && ratio old2 "$OLD_PYTHONPATH"
ratio new2
log "kernel cost"
run $PY $HERE/benchmarks/kv_kernel_cost.py --depths 4096,16384 --threads 1,2 --seconds 2 > $OUT/kernel-cost.txt 2> $OUT/kernel-cost.err
log done

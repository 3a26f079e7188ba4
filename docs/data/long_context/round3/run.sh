#!/bin/bash
# issue 41, third round (the q4 of 2026-12-05 night): mixqrt's steps of benchmarks/depth_run.sh again, with
# llama.cpp's best decode at 16k (Q3_K_M, -fa 0) measured again in the same run; llama.cpp's other rows
# are round2's files (the same machine and boot, 19:21-19:51 UTC, llama.cpp unchanged), copied here.
# Each step under the benchmark lock; /tmp/timed.active pauses the untimed quality runs meanwhile.
. "$(dirname "$0")/common.sh" "${1:-}"
G3=${GGUF_DIR:-/tmp/longctx-lcpp}/qwen-Q3_K_M.gguf
B=${MIXQRT_LLAMA_CPP_BIN:-/work/llama/build/bin}/llama-bench
for d in 0 16384 4096; do mx q4 $d; done
log "llama q3km-tg-fa0-f16-d16k"
run $B -m $G3 -t 2 -r 1 -o jsonl -p 0 -n 32 -d 16384 -fa 0 > $OUT/llama-q3km-tg-fa0-f16-d16k.jsonl 2> $OUT/llama-q3km-tg-fa0-f16-d16k.err
mx q4 32768
mx q4 0 again
mx q4 16384 again2
log "mixqrt q4 pp16384 (peak RSS)"
run $PY -m mixqrt bench $M -t 2 --kv-type q4 -p 16384 -n 8 -r 1 --json -q > $OUT/mixqrt-q4-pp16384.json 2> $OUT/mixqrt-q4-pp16384.err
log done

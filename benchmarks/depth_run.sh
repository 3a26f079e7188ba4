#!/bin/bash
# issue 41: the side-by-side depth table (mixqrt bench --depth against llama-bench -d, same weights, 2
# threads), each step under the benchmark lock (LOCK); raw outputs and load averages into the folder
# given (default docs/data/long_context/round2), then python benchmarks/depth_table.py FOLDER.
# llama.cpp files: benchmarks/long_context.py prepares Q4_0 / Q3_K_M in GGUF_DIR (llama-quantize).
# /tmp/timed.active marks a timed step in progress (the lead's untimed quality runs pause while it exists).
set -u
OUT=$(realpath -m "${1:-docs/data/long_context/round2}"); mkdir -p "$OUT"
cd /tmp     # python -m puts the working directory first on sys.path: run the installed mixqrt
M=${MXQ:-$HOME/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq}
G=${GGUF_DIR:-/tmp/longctx-lcpp}/qwen-Q4_0.gguf
G3=${GGUF_DIR:-/tmp/longctx-lcpp}/qwen-Q3_K_M.gguf
B=${MIXQRT_LLAMA_CPP_BIN:-/work/llama/build/bin}/llama-bench
PY="${PYTHON:-python}"
log() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/log; }
mx() {   # kv depth
  log "mixqrt $1 d$2"; flock ${LOCK:-/work/bench.lock} bash -c 'touch /tmp/timed.active; sleep 2; "$@"; rm -f /tmp/timed.active' _ $PY -m mixqrt bench $M -t 2 --depth $2 --kv-type $1 -p 512 -n 32 -r 2 --json -q > $OUT/mixqrt-$1-d$2.json 2> $OUT/mixqrt-$1-d$2.err; }
lc() {   # name gguf args...
  local n=$1 g=$2; shift 2; log "llama $n"; flock ${LOCK:-/work/bench.lock} bash -c 'touch /tmp/timed.active; sleep 2; "$@"; rm -f /tmp/timed.active' _ $B -m $g -t 2 -r 1 -o jsonl "$@" > $OUT/llama-$n.jsonl 2> $OUT/llama-$n.err; }
for d in 0 4096 16384; do mx q4 $d; done
mx q8 16384
lc tg-fa0-f16-d0-4k-16k $G -p 0 -n 32 -d 0,4096,16384 -fa 0
lc tg-fa1-f16-d0-4k-16k $G -p 0 -n 32 -d 0,4096,16384 -fa 1
lc pp-fa1-f16-d0-4k-16k $G -p 512 -n 0 -d 0,4096,16384 -fa 1
lc q3km-tg-fa0-f16-d16k $G3 -p 0 -n 32 -d 16384 -fa 0
lc pp16384-fa1-f16 $G -p 16384 -n 0 -fa 1
mx q4 32768
lc tg-fa0-f16-d32k $G -p 0 -n 32 -d 32768 -fa 0
log done

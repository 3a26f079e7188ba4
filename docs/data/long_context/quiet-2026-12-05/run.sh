#!/bin/bash
# side by side at depth 16384 and a 16384-token prompt: mixqrt (kv worktree == main) and llama-bench, 2 threads
cd /work/wt/kv; . /work/venvs/kv/bin/activate
M=/root/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq
L=/tmp/longctx-lcpp/qwen-Q4_0.gguf
B=/work/llama/build/bin/llama-bench
O=/work/kvexp/depth16k
log() { echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $O/log; }
log start
for kt in q8 q4; do
  log "mixqrt tg d0 $kt"; mixqrt bench $M -t 2 --depth 0 --kv-type $kt -p 512 -n 32 -r 1 --json -q > $O/mixqrt-$kt-d0.json 2>> $O/err
  log "mixqrt tg d16384 $kt"; mixqrt bench $M -t 2 --depth 16384 --kv-type $kt -p 512 -n 32 -r 1 --json -q > $O/mixqrt-$kt-d16384.json 2>> $O/err
done
log "llama tg d16384 fa1 f16"; $B -m $L -t 2 -fa 1 -ctk f16 -ctv f16 -d 16384 -p 512 -n 32 -r 1 -o jsonl > $O/llama-fa1-f16-d16384.jsonl 2>> $O/err
log "mixqrt pp16384 q8"; /usr/bin/time -v mixqrt bench $M -t 2 --depth 0 --kv-type q8 -p 16384 -n 8 -r 1 --json -q > $O/mixqrt-q8-pp16384.json 2> $O/mixqrt-q8-pp16384.time
log "llama pp16384 fa1 f16"; $B -m $L -t 2 -fa 1 -ctk f16 -ctv f16 -p 16384 -n 0 -r 1 -o jsonl > $O/llama-fa1-f16-pp16384.jsonl 2>> $O/err
log "llama tg d16384 fa0 f16"; $B -m $L -t 2 -fa 0 -ctk f16 -ctv f16 -d 16384 -p 0 -n 32 -r 1 -o jsonl > $O/llama-fa0-f16-d16384.jsonl 2>> $O/err
log done

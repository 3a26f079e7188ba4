#!/bin/bash
cd /work/wt/kv; . /work/venvs/kv/bin/activate
M=/root/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq
O=/work/kvexp/depth16k
log() { echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $O/log2; }
for kt in q8 f32; do
  log "mixqrt d0 $kt"; mixqrt bench $M -t 2 --depth 0 --kv-type $kt -p 512 -n 64 -r 2 --json -q > $O/r2-mixqrt-$kt-d0.json 2>> $O/err2
done
log "mixqrt d16384 q8"; mixqrt bench $M -t 2 --depth 16384 --kv-type q8 -p 512 -n 64 -r 2 --json -q > $O/r2-mixqrt-q8-d16384.json 2>> $O/err2
log "mixqrt pp16384 q8"; /usr/bin/time -v mixqrt bench $M -t 2 --depth 0 --kv-type q8 -p 16384 -n 8 -r 1 --json -q > $O/r2-mixqrt-q8-pp16384.json 2> $O/r2-mixqrt-q8-pp16384.time
log done

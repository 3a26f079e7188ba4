#!/bin/bash
# after run.sh: depth 4k and 32k once more (their first steps looked low against the second round), same settings
set -u
OUT=$(realpath -m "${1:-docs/data/long_context/round3}")
cd /tmp
M=${MXQ:-$HOME/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq}
PY="${PYTHON:-python}"
log() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/log; }
run() { flock ${LOCK:-/work/bench.lock} bash -c 'touch /tmp/timed.active; sleep 2; "$@"; rm -f /tmp/timed.active' _ "$@"; }
mx() { local f=$OUT/mixqrt-$1-d$2${3:+-$3}; log "mixqrt $1 d$2 ${3:-}"
  run $PY -m mixqrt bench $M -t 2 --depth $2 --kv-type $1 -p 512 -n 32 -r 2 --json -q > $f.json 2> $f.err; }
mx q4 4096 again3
mx q4 32768 again4
mx q4 0 again5
log done2

#!/bin/bash
# after run.sh, run2.sh and run3.sh: depth 0 and 16k alternated, two pairs of 128 decode steps each (-n 128: depth 0 steadier), for the ratio of decode at 16k to
# decode at depth 0 (issue 41's 0.6x), same settings as run.sh
set -u
OUT=$(realpath -m "${1:-docs/data/long_context/round3}")
cd /tmp
M=${MXQ:-$HOME/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq}
PY="${PYTHON:-python}"
log() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/log; }
run() { flock ${LOCK:-/work/bench.lock} bash -c 'touch /tmp/timed.active; sleep 2; "$@"; rm -f /tmp/timed.active' _ "$@"; }
mx() { local f=$OUT/mixqrt-$1-d$2${3:+-$3}; log "mixqrt $1 d$2 ${3:-}"
  run $PY -m mixqrt bench $M -t 2 --depth $2 --kv-type $1 -p 512 -n 128 -r 2 --json -q > $f.json 2> $f.err; }
for i in ${PAIRS:-1 2}; do mx q4 0 n128pair$i; mx q4 16384 n128pair$i; done
log done4

# sourced by run.sh .. run4.sh: the folder, the model, the logging and the locked step they share.
# NGEN: decode steps per measurement (32 in run.sh .. run3.sh, 128 in run4.sh).
set -u
OUT=$(realpath -m "${1:-docs/data/long_context/round3}"); mkdir -p "$OUT"
cd /tmp     # python -m puts the working directory first on sys.path
M=${MXQ:-$HOME/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-b80f564a3d26.mxq}
PY="${PYTHON:-python}"
log() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/log; }
run() { flock ${LOCK:-/work/bench.lock} bash -c 'touch /tmp/timed.active; sleep 2; "$@"; rm -f /tmp/timed.active' _ "$@"; }
mx() {   # kv depth [tag]
  local f=$OUT/mixqrt-$1-d$2${3:+-$3}; log "mixqrt $1 d$2 ${3:-}"
  run $PY -m mixqrt bench $M -t 2 --depth $2 --kv-type $1 -p 512 -n ${NGEN:-32} -r 2 --json -q > $f.json 2> $f.err; }

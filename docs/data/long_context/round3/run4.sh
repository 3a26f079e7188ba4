#!/bin/bash
# after run.sh, run2.sh and run3.sh: depth 0 and 16k alternated, two pairs of 128 decode steps each (-n 128: depth 0 steadier), for the ratio of decode at 16k to
# decode at depth 0 (issue 41's 0.6x), same settings as run.sh
NGEN=128
. "$(dirname "$0")/common.sh" "${1:-}"
for i in ${PAIRS:-1 2}; do mx q4 0 n128pair$i; mx q4 16384 n128pair$i; done
log done4

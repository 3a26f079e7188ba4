#!/bin/bash
# after run.sh and run2.sh: depth 0 and 16k alternated, three pairs, for the ratio of decode at 16k to
# decode at depth 0 (issue 41's 0.6x), same settings as run.sh
. "$(dirname "$0")/common.sh" "${1:-}"
for i in 1 2 3; do mx q4 0 pair$i; mx q4 16384 pair$i; done
log done3

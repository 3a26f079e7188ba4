#!/bin/bash
# after run.sh: depth 4k and 32k once more (their first steps looked low against the second round), same settings
. "$(dirname "$0")/common.sh" "${1:-}"
mx q4 4096 again3
mx q4 32768 again4
mx q4 0 again5
log done2

#!/usr/bin/env bash
# Show the end of a run's logs on one or all workers.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME --run RUN [options]"
USAGE_TEXT="Print the last lines of REMOTE_DIR/runs/RUN/logs/*.log on one worker or on all of them
('tpu-vm ssh --worker=...'); every file starts with a '==> ...worker-<hostname>.log <==' header.
With --follow, keep printing until Ctrl-C."

common_opts
remote_opts
run_opt "" "run name, as given to train.sh (required)"
opt --worker WORKER all "worker index, or all"
opt --lines TAIL_LINES 50 "number of lines from the end of each log"
switch --follow FOLLOW "keep printing new lines (tail -F)"
parse_args "$@"
require ZONE TPU_NAME REMOTE_DIR
check_run_name
[[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker index or all, got '$WORKER'"
[[ $TAIL_LINES =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$TAIL_LINES'"
if ((FOLLOW && NUM_SLICES > 1)); then
	die "--follow on several slices would stop at the first; follow one slice: --name $TPU_NAME-0 --num-slices 1"
fi

tail_cmd=(tail -v -n "$TAIL_LINES")
((FOLLOW)) && tail_cmd+=(-F)
# The glob stays unquoted so that each worker expands it.
ssh_slices "$WORKER" "$(quote_cmd "${tail_cmd[@]}") $(shquote "$RUN_DIR/logs")/*.log"

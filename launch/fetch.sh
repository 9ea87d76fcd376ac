#!/usr/bin/env bash
# Copy a run directory back from one worker (worker 0 of slice 0 by default).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME --run RUN [options]"
USAGE_TEXT="Copy REMOTE_DIR/runs/RUN from one worker to DEST/RUN here ('tpu-vm scp --recurse').
Each worker holds only its own log (and, on a local workdir, only its own checkpoint shards):
on several hosts, write checkpoints to a gs:// workdir and use logs.sh for the other logs."

common_opts
remote_opts
run_opt "" "run name, as given to train.sh (required)"
opt --dest DEST runs "local directory that receives the run directory"
opt --worker WORKER 0 "worker to copy from"
parse_args "$@"
require ZONE TPU_NAME REMOTE_DIR DEST
check_run_name
[[ $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker index, got '$WORKER'"

gcloud_loc
slice_nodes
run mkdir -p "$DEST"
run gcloud compute tpus tpu-vm scp "${NODES[0]}:$RUN_DIR" "$DEST" --recurse "${GCLOUD_LOC[@]}" --worker="$WORKER"

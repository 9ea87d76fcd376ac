#!/usr/bin/env bash
# Copy a run's logs back: from its gs:// workdir, or from one worker (worker 0 of slice 0 by default).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME --run RUN [options]"
USAGE_TEXT="Copy a run to DEST/RUN here. With --workdir gs://..., the run's logs (metrics.jsonl,
TensorBoard files, config, plots; not the checkpoints) are copied from that workdir, where
sat-jax keeps them beside the checkpoints ('gcloud storage rsync'). Otherwise REMOTE_DIR/runs/RUN
is copied from one worker ('tpu-vm scp --recurse'); each worker holds only its own log (and, on a
local workdir, only its own checkpoint shards)."

common_opts
remote_opts
run_opt "" "run name, as given to train.sh (required)"
opt --workdir WORKDIR "" "the run's gs:// workdir, as given to train.sh (empty: copy from a worker)"
opt --dest DEST runs "local directory that receives the run directory"
opt --worker WORKER 0 "worker to copy from (without --workdir)"
parse_args "$@"
require DEST
check_run_name
[[ $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker index, got '$WORKER'"

if [[ -n $WORKDIR ]]; then
	[[ $WORKDIR == gs://* ]] || die "--workdir must be a gs:// URL (a local workdir is on the workers: omit --workdir), got '$WORKDIR'"
	run mkdir -p "$DEST/$RUN_NAME"
	run gcloud storage rsync "${WORKDIR%/}" "$DEST/$RUN_NAME" --recursive \
		--exclude='^(checkpoints|replaced-[^/]*|checkpoints-replaced-[^/]*)(/|$)'
	exit 0
fi
require ZONE TPU_NAME REMOTE_DIR
gcloud_loc
slice_nodes
run mkdir -p "$DEST"
run gcloud compute tpus tpu-vm scp "${NODES[0]}:$RUN_DIR" "$DEST" --recurse "${GCLOUD_LOC[@]}" --worker="$WORKER"

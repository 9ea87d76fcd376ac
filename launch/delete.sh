#!/usr/bin/env bash
# Delete the TPU VM or queued resource (this is what stops the billing).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME [options]"
USAGE_TEXT="Delete the TPU VM ('tpu-vm delete --quiet'), or with --queued the queued resource together
with its TPU VMs ('queued-resources delete --force --quiet'). Multi-slice implies --queued.
Anything only on the workers' disks (logs, local checkpoints) is lost: run fetch.sh first."

common_opts
switch --queued QUEUED "the TPU was created as a queued resource (create.sh --queued)"
switch --async ASYNC "return at once instead of waiting for the deletion to finish"
parse_args "$@"
require ZONE TPU_NAME
if ((NUM_SLICES > 1)); then
	QUEUED=1
fi

gcloud_loc
extra=()
((ASYNC)) && extra+=(--async)
if ((QUEUED)); then
	run gcloud compute tpus queued-resources delete "$TPU_NAME" "${GCLOUD_LOC[@]}" --force "${extra[@]}" --quiet
else
	run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GCLOUD_LOC[@]}" "${extra[@]}" --quiet
fi

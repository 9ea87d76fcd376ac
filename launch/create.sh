#!/usr/bin/env bash
# Create a Cloud TPU VM (or a queued resource that becomes one) for sat_jax.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME [options]"
USAGE_TEXT="Create a TPU VM with 'gcloud compute tpus tpu-vm create', or with --queued a queued resource
('gcloud compute tpus queued-resources create') that Cloud TPU provisions when capacity frees up.
Multi-slice (--num-slices > 1) always uses a queued resource. With --wait, poll the queued
resource until it is ACTIVE (or stop on FAILED, SUSPENDING, SUSPENDED, DELETING); a poll that
fails (a transient gcloud or network error) is retried, up to WAIT_RETRIES failures in a row.
When the wait gives up, the message says how to delete what may be left."

common_opts
opt --accelerator-type ACCELERATOR_TYPE v5litepod-8 "TPU type and size, e.g. v5litepod-8, v5litepod-16, v6e-16, v5p-8"
opt --runtime-version RUNTIME_VERSION "" "TPU software version (empty: by generation, v6e: v2-alpha-tpuv6e, v5e: v2-alpha-tpuv5-lite, v5p: v2-alpha-tpuv5, v4 and older: tpu-ubuntu2204-base)"
switch --queued QUEUED "create a queued resource instead of a TPU VM directly"
switch --spot SPOT "Spot capacity (cheaper, can be preempted at any time)"
switch --reserved RESERVED "use the project's reserved capacity"
switch --wait WAIT "queued resource: wait until it is ACTIVE"
opt --wait-interval WAIT_INTERVAL 60 "seconds between two polls under --wait"
opt --wait-retries WAIT_RETRIES 5 "failed polls in a row that --wait tolerates before it gives up"
parse_args "$@"
require ZONE TPU_NAME ACCELERATOR_TYPE

if ((SPOT && RESERVED)); then
	die "--spot and --reserved exclude each other"
fi
if ((NUM_SLICES > 1)); then
	QUEUED=1
fi
if ((WAIT && !QUEUED)); then
	die "--wait applies to a queued resource (--queued); 'tpu-vm create' already waits"
fi
[[ $WAIT_INTERVAL =~ ^[0-9]+$ ]] || die "--wait-interval must be a number of seconds"
[[ $WAIT_RETRIES =~ ^[0-9]+$ ]] || die "--wait-retries must be a number, got '$WAIT_RETRIES'"
if [[ -z $RUNTIME_VERSION ]]; then
	RUNTIME_VERSION=$(default_runtime_version "$ACCELERATOR_TYPE")
fi

gcloud_loc
capacity=()
((SPOT)) && capacity+=(--spot)
((RESERVED)) && capacity+=(--reserved)

if ((!QUEUED)); then
	run gcloud compute tpus tpu-vm create "$TPU_NAME" "${GCLOUD_LOC[@]}" \
		--accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${capacity[@]}"
	exit 0
fi

if ((NUM_SLICES == 1)); then
	nodes=(--node-id="$TPU_NAME")
else
	nodes=(--node-count="$NUM_SLICES" --node-prefix="$TPU_NAME")
fi
run gcloud compute tpus queued-resources create "$TPU_NAME" "${GCLOUD_LOC[@]}" \
	--accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
	"${nodes[@]}" "${capacity[@]}"

((WAIT)) || exit 0
describe="gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE"
failures=0
while :; do
	if ! state=$(capture ACTIVE gcloud compute tpus queued-resources describe "$TPU_NAME" \
		"${GCLOUD_LOC[@]}" --format="value(state.state)"); then
		failures=$((failures + 1))
		if ((failures > WAIT_RETRIES)); then
			die "could not read the state of queued resource $TPU_NAME ($failures failed polls in a row); it may still be provisioning, and then billing: check with '$describe', delete with: $(delete_hint queued)"
		fi
		info "polling queued resource $TPU_NAME failed ($failures of at most $WAIT_RETRIES in a row); retrying"
		sleep "$WAIT_INTERVAL"
		continue
	fi
	failures=0
	info "queued resource $TPU_NAME: ${state:-unknown}"
	case $state in
	ACTIVE) exit 0 ;;
	FAILED | SUSPENDING | SUSPENDED | DELETING) die "queued resource $TPU_NAME is $state (see: $describe); delete it with: $(delete_hint queued)" ;;
	esac
	sleep "$WAIT_INTERVAL"
done

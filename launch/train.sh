#!/usr/bin/env bash
# Start one sat_jax training run on every worker of a TPU VM at once, in the background.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME --config CONFIG --run RUN [options] [--config.KEY=VALUE ...] [-- EXTRA ...]"
USAGE_TEXT="Start 'sat-jax train --config CONFIG --workdir WORKDIR' on all workers at once (one
'tpu-vm ssh --worker=all' per slice), under nohup so it outlives the ssh session. Each worker logs
to REMOTE_DIR/runs/RUN/logs/worker-<hostname>.log, appending when a run is restarted
(read them with logs.sh). Arguments of the form
--config.KEY=VALUE, and everything after '--', go to 'sat-jax train' unchanged.
On more than one host (MULTIHOST=auto decides from ACCELERATOR_TYPE and NUM_SLICES) the command
gets --multihost=on; on more than one slice also --coordinator_address=IP:PORT, by default the
internal IP of worker 0 of slice 0 (from 'tpu-vm describe') and COORDINATOR_PORT."

common_opts
remote_opts
opt --accelerator-type ACCELERATOR_TYPE v5litepod-8 "TPU type of each slice; decides single- or multi-host"
opt --config CONFIG "" "config file, e.g. configs/sat_gspo_r3.py, or just its name: sat_gspo_r3 (required)"
run_opt "" "run name: the run directory is REMOTE_DIR/runs/RUN (required)"
opt --workdir WORKDIR "" "sat-jax --workdir (empty: runs/RUN inside REMOTE_DIR; multi-host: use a gs:// path)"
opt --multihost MULTIHOST auto "auto, on or off: pass --multihost=on to sat-jax train"
opt --coordinator-address COORDINATOR_ADDRESS "" "IP[:PORT] of the JAX coordinator (empty: JAX finds it on one slice; worker 0 of slice 0 on several)"
opt --coordinator-port COORDINATOR_PORT 8476 "port of the JAX coordinator when the address has none"
ACCEPTS_PASSTHROUGH=1
parse_args "$@"
require ZONE TPU_NAME CONFIG REMOTE_DIR VENV
check_venv
check_run_name

if [[ $CONFIG != */* && $CONFIG != *.py ]]; then
	CONFIG="configs/$CONFIG.py"
fi
WORKDIR=${WORKDIR:-runs/$RUN_NAME}
[[ $COORDINATOR_PORT =~ ^[0-9]+$ ]] || die "--coordinator-port must be a number, got '$COORDINATOR_PORT'"

case $MULTIHOST in
auto)
	hosts=$(hosts_per_slice "$ACCELERATOR_TYPE")
	if ((hosts * NUM_SLICES > 1)); then MULTIHOST=on; else MULTIHOST=off; fi
	;;
on | off) ;;
*) die "--multihost must be auto, on or off, got '$MULTIHOST'" ;;
esac

train=(train --config "$CONFIG" --workdir "$WORKDIR")
if [[ $MULTIHOST == on ]]; then
	train+=(--multihost=on)
fi
if [[ -z $COORDINATOR_ADDRESS ]] && ((NUM_SLICES > 1)); then
	gcloud_loc
	slice_nodes
	COORDINATOR_ADDRESS=$(capture COORDINATOR_IP gcloud compute tpus tpu-vm describe "${NODES[0]}" \
		"${GCLOUD_LOC[@]}" --format="value(networkEndpoints[0].ipAddress)")
	[[ -n $COORDINATOR_ADDRESS ]] || die "could not read the internal IP of ${NODES[0]}; pass --coordinator-address"
fi
if [[ -n $COORDINATOR_ADDRESS ]]; then
	if [[ $COORDINATOR_ADDRESS != *:* ]]; then
		COORDINATOR_ADDRESS+=":$COORDINATOR_PORT"
	fi
	train+=(--coordinator_address="$COORDINATOR_ADDRESS")
fi
train+=("${PASSTHROUGH[@]}")

logs=$(shquote "runs/$RUN_NAME/logs")
# The VENV path is quoted after "~/" so the workers' shell still expands the tilde.
command="cd $(shquote "$REMOTE_DIR") && mkdir -p $logs && nohup ~/$(shquote "$VENV")/bin/sat-jax"
command+=" $(quote_cmd "${train[@]}")"
command+=" >> $logs/worker-\$(hostname).log 2>&1 < /dev/null &"
ssh_slices all "$command"
if ((!DRY_RUN)); then
	info "started run '$RUN_NAME'; follow it with: launch/logs.sh --zone $ZONE --name $TPU_NAME --run $RUN_NAME --follow"
fi

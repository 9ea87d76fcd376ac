# shellcheck shell=bash
# Shared helpers for the launch/ scripts: option declaration and parsing, --help text, the
# run-or-print wrapper behind --dry-run, and what the scripts derive from a TPU accelerator type.
# Sourced by each script, never executed.
#
# A script declares its options with `opt` (takes a value) and `switch` (on/off), then calls
# `parse_args "$@"`. Every option is also an environment variable: the flag wins over the
# variable, the variable over the default. --help prints each flag, its variable and its default.

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
	echo "$0: needs bash >= 4.4 (this is $BASH_VERSION; on macOS: brew install bash)" >&2
	exit 2
fi

# Dry-run output goes to the script's original stdout even from inside $( ... ).
exec 3>&1

PROG="$(basename "$0")"
USAGE_SYNOPSIS=""
USAGE_TEXT=""
ACCEPTS_PASSTHROUGH=0 # 1: `--config.*` arguments and everything after `--` land in PASSTHROUGH
PASSTHROUGH=()

_OPT_KINDS=()
_OPT_FLAGS=()
_OPT_VARS=()
_OPT_DEFAULTS=()
_OPT_HELPS=()

die() {
	printf '%s: error: %s\n' "$PROG" "$*" >&2
	printf "Run '%s --help' for usage.\n" "$PROG" >&2
	exit 2
}

info() {
	printf '%s: %s\n' "$PROG" "$*" >&2
}

_declare() {
	local kind=$1 flag=$2 var=$3 default=$4 help=$5
	_OPT_KINDS+=("$kind")
	_OPT_FLAGS+=("$flag")
	_OPT_VARS+=("$var")
	_OPT_DEFAULTS+=("$default")
	_OPT_HELPS+=("$help")
	if [[ -z "${!var+set}" ]]; then
		printf -v "$var" '%s' "$default"
	fi
}

# opt FLAG VAR DEFAULT HELP: an option that takes a value (--flag VALUE or --flag=VALUE).
opt() { _declare value "$@"; }

# switch FLAG VAR HELP: an on/off option; the variable accepts 1/0, true/false, yes/no, on/off.
switch() { _declare switch "$1" "$2" 0 "$3"; }

# The options every script has.
common_opts() {
	opt --project PROJECT_ID "" "Google Cloud project (empty: gcloud's configured project)"
	opt --zone ZONE "" "zone of the TPU, e.g. us-west4-a (required)"
	opt --name TPU_NAME "" "name of the TPU VM / queued resource (required)"
	opt --num-slices NUM_SLICES 1 "number of slices (>1: multi-slice, nodes NAME-0 .. NAME-<n-1>)"
	switch --dry-run DRY_RUN "print the commands instead of running them"
}

# The options of scripts that work inside the checkout on the workers.
remote_opts() {
	opt --remote-dir REMOTE_DIR sat_jax "the project's directory on each worker, relative to the remote home"
	opt --venv VENV sat_jax_venv "virtual environment on each worker, relative to the remote home"
}

# The --run option, and RUN_DIR: the run's directory on the workers (relative to the remote home).
run_opt() {
	opt --run RUN_NAME "$1" "$2"
}

check_venv() {
	[[ $VENV != /* && $VENV != '~'* ]] || die "--venv must be relative to the remote home, got '$VENV'"
}

check_run_name() {
	require RUN_NAME
	[[ $RUN_NAME =~ ^[A-Za-z0-9._-]+$ ]] || die "--run must be letters, digits, '.', '_' or '-', got '$RUN_NAME'"
	# shellcheck disable=SC2034 # used by the scripts that source this file
	RUN_DIR="$REMOTE_DIR/runs/$RUN_NAME"
}

usage() {
	local i flag
	printf 'Usage: %s %s\n\n%s\n\nOptions (each also read from the environment variable shown):\n' \
		"$PROG" "$USAGE_SYNOPSIS" "$USAGE_TEXT"
	for i in "${!_OPT_FLAGS[@]}"; do
		flag=${_OPT_FLAGS[i]}
		if [[ ${_OPT_KINDS[i]} == value ]]; then
			flag="$flag ${_OPT_VARS[i]}"
		fi
		printf '  %s\n      %s\n      [env %s, default: %s]\n' "$flag" "${_OPT_HELPS[i]}" \
			"${_OPT_VARS[i]}" "${_OPT_DEFAULTS[i]:-(empty)}"
	done
	printf '  -h, --help\n      show this help and exit\n'
}

_find_opt() {
	local i
	for i in "${!_OPT_FLAGS[@]}"; do
		if [[ ${_OPT_FLAGS[i]} == "$1" ]]; then
			printf '%s' "$i"
			return 0
		fi
	done
	return 1
}

_bool() {
	case ${!1,,} in
	1 | true | yes | on) printf -v "$1" 1 ;;
	0 | false | no | off | "") printf -v "$1" 0 ;;
	*) die "$1 must be 1 or 0, got '${!1}'" ;;
	esac
}

parse_args() {
	local arg flag value idx has_value
	while (($#)); do
		arg=$1
		shift
		case $arg in
		-h | --help)
			usage
			exit 0
			;;
		--)
			((ACCEPTS_PASSTHROUGH)) || die "unexpected '--': $PROG takes no extra arguments"
			PASSTHROUGH+=("$@")
			break
			;;
		--config.*)
			if ((ACCEPTS_PASSTHROUGH)); then
				PASSTHROUGH+=("$arg")
				continue
			fi
			;;
		esac
		[[ $arg == --* ]] || die "unexpected argument: '$arg'"
		flag=${arg%%=*}
		has_value=0
		if [[ $arg == *=* ]]; then
			value=${arg#*=}
			has_value=1
		fi
		idx=$(_find_opt "$flag") || die "unknown option: $flag"
		if [[ ${_OPT_KINDS[idx]} == switch ]]; then
			((has_value)) && die "$flag takes no value"
			printf -v "${_OPT_VARS[idx]}" 1
			continue
		fi
		if ((!has_value)); then
			if (($# == 0)) || [[ $1 == --* ]]; then
				die "$flag needs a value (${_OPT_VARS[idx]})"
			fi
			value=$1
			shift
		fi
		printf -v "${_OPT_VARS[idx]}" '%s' "$value"
	done
	for idx in "${!_OPT_VARS[@]}"; do
		if [[ ${_OPT_KINDS[idx]} == switch ]]; then
			_bool "${_OPT_VARS[idx]}"
		fi
	done
	if [[ -n ${NUM_SLICES+set} ]]; then
		[[ $NUM_SLICES =~ ^[1-9][0-9]*$ ]] || die "--num-slices must be a positive integer, got '$NUM_SLICES'"
	fi
}

# require VAR...: fail with the flag's name when a required setting is empty.
require() {
	local var idx
	for var; do
		if [[ -z ${!var} ]]; then
			for idx in "${!_OPT_VARS[@]}"; do
				if [[ ${_OPT_VARS[idx]} == "$var" ]]; then
					die "${_OPT_FLAGS[idx]} (or $var) is required"
				fi
			done
			die "$var is required"
		fi
	done
}

# shquote ARG: ARG as one shell word: bare if it is made of safe characters, else single-quoted.
shquote() {
	if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
		printf '%s' "$1"
	else
		local q="'\\''"
		printf "'%s'" "${1//\'/$q}"
	fi
}

# quote_cmd ARG...: the command as one line that a shell reads back into the same arguments.
quote_cmd() {
	local out=() a
	for a; do
		out+=("$(shquote "$a")")
	done
	printf '%s' "${out[*]}"
}

# redact TEXT: TEXT with the credentials of every URL in it ("https://user:TOKEN@host",
# "https://TOKEN@host") and every URL's query string ("https://host/r.git?token=TOKEN", where
# tokens travel too) replaced by "***", for anything these scripts print.
redact() {
	local re='^(.*[A-Za-z][A-Za-z0-9+.-]*://)[^/@[:space:]'"'"']+@(.*)$' rest=$1 tail=""
	local query='^(.*[A-Za-z][A-Za-z0-9+.-]*://[^?[:space:]'"'"']*[?])[^[:space:]'"'"']+(.*)$'
	# Greedy: each round masks the last credentials left in REST and moves what follows to TAIL.
	while [[ $rest =~ $re ]]; do
		tail="***@${BASH_REMATCH[2]}$tail"
		rest=${BASH_REMATCH[1]}
	done
	rest="$rest$tail" tail=""
	while [[ $rest =~ $query ]]; do
		tail="***${BASH_REMATCH[2]}$tail"
		rest=${BASH_REMATCH[1]}
	done
	printf '%s' "$rest$tail"
}

# has_credentials URL: whether URL carries a user name, password or token before its host, or a
# query string (which may hold a token).
has_credentials() {
	[[ $1 =~ ^[A-Za-z][A-Za-z0-9+.-]*://[^/@]+@ || $1 == *://*[?]* ]]
}

# delete_hint [queued]: the delete.sh command for this TPU, for messages about a TPU left
# running; "queued" when it is known to be a queued resource.
delete_hint() {
	local cmd=(launch/delete.sh --zone "$ZONE" --name "$TPU_NAME")
	[[ -n $PROJECT_ID ]] && cmd+=(--project "$PROJECT_ID")
	((NUM_SLICES > 1)) && cmd+=(--num-slices "$NUM_SLICES")
	[[ ${1:-} == queued ]] && cmd+=(--queued)
	printf '%s' "$(quote_cmd "${cmd[@]}")"
	if [[ ${1:-} != queued ]] && ((NUM_SLICES == 1)); then
		printf ' (add --queued if create.sh made it with --queued)'
	fi
}

# run CMD...: run the command (echoed to stderr), or under --dry-run print it on stdout. Either
# way URL credentials are masked in what is shown.
run() {
	if ((DRY_RUN)); then
		printf '%s\n' "$(redact "$(quote_cmd "$@")")" >&3
	else
		info "+ $(redact "$(quote_cmd "$@")")"
		"$@"
	fi
}

# capture PLACEHOLDER CMD...: print the command's output; under --dry-run print the command and
# output PLACEHOLDER instead (for commands whose answer feeds a later command).
capture() {
	local placeholder=$1
	shift
	if ((DRY_RUN)); then
		printf '%s\n' "$(redact "$(quote_cmd "$@")")" >&3
		printf '%s' "$placeholder"
	else
		info "+ $(redact "$(quote_cmd "$@")")"
		"$@"
	fi
}

# gcloud_loc: the --zone/--project arguments every gcloud TPU command takes.
gcloud_loc() {
	GCLOUD_LOC=("--zone=$ZONE")
	if [[ -n $PROJECT_ID ]]; then
		GCLOUD_LOC+=("--project=$PROJECT_ID")
	fi
}

# slice_nodes: the TPU VM node names, one per slice, in NODES.
slice_nodes() {
	local i
	NODES=()
	if ((NUM_SLICES == 1)); then
		NODES=("$TPU_NAME")
	else
		for ((i = 0; i < NUM_SLICES; i++)); do
			NODES+=("$TPU_NAME-$i")
		done
	fi
}

# ssh_slices WORKER COMMAND: run COMMAND on WORKER (a worker index or "all") of every slice:
# one ssh per slice, which gcloud fans out to the slice's workers at once.
ssh_slices() {
	local node
	gcloud_loc
	slice_nodes
	for node in "${NODES[@]}"; do
		run gcloud compute tpus tpu-vm ssh "$node" "${GCLOUD_LOC[@]}" --worker="$1" --command="$2"
	done
}

_accel_split() {
	ACCEL_GEN=${1%-*}
	ACCEL_SIZE=${1##*-}
	if [[ $1 != *-* || ! $ACCEL_SIZE =~ ^[0-9]+$ ]]; then
		die "cannot read accelerator type '$1' (expected e.g. v5litepod-8, v6e-16, v5p-8, v4-8)"
	fi
}

# default_runtime_version TYPE: the TPU software version Google lists for JAX on that generation.
default_runtime_version() {
	_accel_split "$1"
	case $ACCEL_GEN in
	v6e) printf 'v2-alpha-tpuv6e' ;;
	v5litepod) printf 'v2-alpha-tpuv5-lite' ;;
	v5p) printf 'v2-alpha-tpuv5' ;;
	v2 | v3 | v4) printf 'tpu-ubuntu2204-base' ;;
	*) die "no default runtime version for '$1': pass --runtime-version" ;;
	esac
}

# hosts_per_slice TYPE: number of TPU VM hosts in one slice of that type. v5e and v6e count
# chips (up to 8 on one host, 4 per host beyond); v2-v5p count TensorCores (8 per host).
hosts_per_slice() {
	_accel_split "$1"
	local n=$ACCEL_SIZE per_host
	case $ACCEL_GEN in
	v5litepod | v6e) per_host=4 ;;
	v2 | v3 | v4 | v5p) per_host=8 ;;
	*) die "unknown accelerator generation in '$1': pass --multihost on|off" ;;
	esac
	if ((n <= 8)); then
		printf 1
	else
		printf '%s' $((n / per_host))
	fi
}

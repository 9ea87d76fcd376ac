#!/usr/bin/env bash
# Install sat_jax on every worker of a TPU VM: code, virtual environment, package, jax[tpu].
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE_SYNOPSIS="--zone ZONE --name NAME [options]"
USAGE_TEXT="Put the code on every worker and install it, all workers at once (one 'tpu-vm ssh --worker=all'
per slice). The code comes from this checkout's last commit (git archive HEAD, copied with
'tpu-vm scp --worker=all'), or with --repo-url from a git clone on the workers. Then, on each
worker: make the venv, install the project with INSTALL_CMD and JAX for TPU with JAX_INSTALL_CMD.
Safe to run again after a new commit: it unpacks over the old copy and reinstalls.
A --repo-url with credentials (https://USER:TOKEN@host/...) never appears in a command line or in
the workers' .git/config: the URL goes to each worker in a file (tpu-vm scp), which the remote
command reads and removes before fetching by URL; printed commands show it as https://***@host.
If setup fails, the TPU is left running (and billing): the message says how to delete it."

common_opts
remote_opts
opt --repo-url REPO_URL "" "git URL to clone on the workers (empty: copy this checkout's HEAD)"
opt --ref REPO_REF main "branch, tag or commit to check out with --repo-url"
opt --local-dir LOCAL_DIR "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "local checkout to archive when no --repo-url is given"
opt --tarball TARBALL "" "where to write the local archive (empty: \${TMPDIR:-/tmp}/sat_jax-src-NAME.tar.gz)"
opt --python PYTHON python3.11 "Python on the workers that makes the venv (the project needs >= 3.11)"
opt --apt-packages APT_PACKAGES "python3.11 python3.11-venv" "apt packages installed first on each worker (empty: skip apt)"
opt --install-cmd INSTALL_CMD 'pip install -e ".[test,gcs]"' "command that installs the project, run in the project directory inside the venv"
opt --jax-install-cmd JAX_INSTALL_CMD 'pip install -U "jax[tpu]"' "command that installs JAX for TPU, run after INSTALL_CMD"
parse_args "$@"
require ZONE TPU_NAME REMOTE_DIR VENV PYTHON INSTALL_CMD
check_venv

REMOTE_ARCHIVE=sat_jax-src.tar.gz
REMOTE_URL_FILE=.sat_jax_repo_url
dir=$(shquote "$REMOTE_DIR")
url_file=""
armed=0 # 1 once the settings are checked: a failure from then on leaves the TPU set up partly

on_exit() {
	local status=$?
	if [[ -n $url_file ]]; then
		rm -f "$url_file"
	fi
	if ((status != 0 && armed && !DRY_RUN)); then
		info "setup did not finish (exit status $status): the TPU '$TPU_NAME' is left running, and billing; delete it with: $(delete_hint)"
	fi
}
trap on_exit EXIT
steps=()
if [[ -n $APT_PACKAGES ]]; then
	read -r -a pkgs <<<"$APT_PACKAGES"
	steps+=("sudo apt-get update -qq" "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $(quote_cmd "${pkgs[@]}")")
fi

if [[ -z $REPO_URL ]]; then
	git -C "$LOCAL_DIR" rev-parse --git-dir >/dev/null 2>&1 || die "--local-dir '$LOCAL_DIR' is not a git checkout"
fi
armed=1

if [[ -z $REPO_URL ]]; then
	if [[ -n $(git -C "$LOCAL_DIR" status --porcelain --untracked-files=no) ]]; then
		info "warning: uncommitted changes in $LOCAL_DIR are not copied (only HEAD is); commit them first"
	fi
	TARBALL=${TARBALL:-${TMPDIR:-/tmp}/sat_jax-src-$TPU_NAME.tar.gz}
	run git -C "$LOCAL_DIR" archive --format=tar.gz --output="$TARBALL" HEAD
	gcloud_loc
	slice_nodes
	for node in "${NODES[@]}"; do
		run gcloud compute tpus tpu-vm scp "$TARBALL" "$node:$REMOTE_ARCHIVE" "${GCLOUD_LOC[@]}" --worker=all
	done
	steps+=("mkdir -p $dir" "tar -xzf $REMOTE_ARCHIVE -C $dir")
elif has_credentials "$REPO_URL"; then
	ref=$(shquote "$REPO_REF")
	if ((!DRY_RUN)); then
		url_file=$(umask 077 && mktemp "${TMPDIR:-/tmp}/sat_jax-repo-url.XXXXXX")
		printf '%s\n' "$REPO_URL" >"$url_file"
	fi
	gcloud_loc
	slice_nodes
	for node in "${NODES[@]}"; do
		run gcloud compute tpus tpu-vm scp "${url_file:-URL_FILE}" "$node:$REMOTE_URL_FILE" "${GCLOUD_LOC[@]}" --worker=all
	done
	# Fetching by URL keeps it out of .git/config (a clone would store it as origin's url).
	steps+=("{ url=\$(cat ~/$REMOTE_URL_FILE); rm -f ~/$REMOTE_URL_FILE; test -n \"\$url\"; }"
		"{ test -d $dir/.git || git init --quiet $dir; }"
		"git -C $dir fetch --quiet \"\$url\" $ref"
		"git -C $dir checkout --quiet --force FETCH_HEAD")
else
	url=$(shquote "$REPO_URL")
	ref=$(shquote "$REPO_REF")
	steps+=("{ test -d $dir/.git || git clone --quiet $url $dir; }"
		"git -C $dir fetch --quiet $url $ref"
		"git -C $dir checkout --quiet --force FETCH_HEAD")
fi

steps+=("$(shquote "$PYTHON") -m venv ~/$(shquote "$VENV")"
	". ~/$(shquote "$VENV")/bin/activate"
	"cd $dir"
	"pip install --quiet -U pip"
	"$INSTALL_CMD")
if [[ -n $JAX_INSTALL_CMD ]]; then
	steps+=("$JAX_INSTALL_CMD")
fi
steps+=("python -c 'import jax, sat_jax; print(\"sat_jax ready, jax\", jax.__version__)'")

command=""
for step in "${steps[@]}"; do
	command+="${command:+ && }$step"
done
ssh_slices all "$command"

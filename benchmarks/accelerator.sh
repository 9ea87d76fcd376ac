#!/usr/bin/env bash
# One command for a lent accelerator: a GPU machine (no network; JAX with its CUDA plugin, flax,
# optax, orbax-checkpoint and chex already installed) or a Cloud TPU VM.
#
#   benchmarks/accelerator.sh OUT_DIR              # device checks, then the benchmarks (< 8 min)
#   benchmarks/accelerator.sh --cpu-smoke OUT_DIR  # setup and the device script at toy sizes
#                                                  # on a CPU (CI), so none of it rots
#
# It uses the JAX it finds (on a TPU VM without a TPU JAX it installs jax[tpu]), installs the
# project with --no-deps, and takes any missing pure-Python dependency from benchmarks/wheels/
# (built beforehand on a machine with network by `make wheels`, carried with the tree). Every
# step prints JSON and leaves it in OUT_DIR: device_checks.json (sharded losses, model and
# sampler against the CPU), device_trainer.json (trainer step tokens/s and MFU), losses.json
# (objectives fwd+bwd), engines.json (static and continuous decode), testbed_loop.json (the
# staleness testbed's loop steps/s), plus log.txt. A step that fails is logged and the others
# still run; the exit status is that of the device checks.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

SMOKE=0
if [[ "${1:-}" == "--cpu-smoke" ]]; then
  SMOKE=1
  shift
fi
OUT=${1:?usage: benchmarks/accelerator.sh [--cpu-smoke] OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
# A relative interpreter path (PYTHON=.venv/bin/python) would break once the steps cd into
# benchmarks/: make it absolute, keeping the venv's own path (no symlink resolution).
if [[ $PY == */* ]]; then
  PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
fi
LOG="$OUT/log.txt"
: >"$LOG"
say() { echo "== $*" | tee -a "$LOG"; }

# --- environment -----------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  export JAX_PLATFORMS=cpu
elif [[ -e /dev/accel0 || -e /dev/vfio/0 || -n "${TPU_NAME:-}" ]]; then
  if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "tpu")' 2>/dev/null; then
    say "TPU VM: installing jax[tpu]"
    "$PY" -m pip install --quiet -U "jax[tpu]" >>"$LOG" 2>&1
  fi
fi
missing=$("$PY" - <<'EOF'
import importlib.util
# Import name -> distribution name of the project's runtime dependencies.
deps = {"jax": "jax", "numpy": "numpy", "chex": "chex", "flax": "flax", "optax": "optax",
        "orbax.checkpoint": "orbax-checkpoint", "ml_collections": "ml_collections",
        "absl": "absl-py", "tensorboardX": "tensorboardX", "matplotlib": "matplotlib",
        "rich": "rich", "etils": "etils"}
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(dist for mod, dist in deps.items() if not found(mod)))
EOF
)
if [[ -n "$missing" && "${NO_INSTALL:-0}" != 1 ]]; then
  say "installing from benchmarks/wheels: $missing"
  # shellcheck disable=SC2086  # one argument per missing distribution
  "$PY" -m pip install --quiet --no-index --find-links "$ROOT/benchmarks/wheels" $missing \
    >>"$LOG" 2>&1 || say "could not install $missing from benchmarks/wheels (make wheels)"
fi
# NO_INSTALL=1 leaves the Python's packages alone (a shared environment); the tree is on
# PYTHONPATH either way.
if [[ "${NO_INSTALL:-0}" != 1 ]]; then
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >>"$LOG" 2>&1 \
    || say "pip install --no-deps failed; running from the tree (PYTHONPATH)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export SAT_JAX_BENCH_RESULTS="$OUT"
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
"$PY" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' 2>&1 \
  | tee -a "$LOG"

# --- steps -----------------------------------------------------------------------------------
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit (the whole script must fit a
# loan's 8 minutes, compilation included), its output into the log.
status=0
step() {
  local name=$1 limit=$2
  shift 2
  say "$name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "$name: exit $rc after $((SECONDS - t0))s"
  return $rc
}

cd "$ROOT/benchmarks" || exit 1
if [[ $SMOKE == 1 ]]; then
  step checks 300 "$PY" device.py --only checks --size smoke || status=1
  step trainer 300 "$PY" device.py --only trainer --size smoke --repeats 1
else
  step checks 90 "$PY" device.py --only checks || status=1
  step trainer 150 "$PY" device.py --only trainer --size 0.6b --repeats 5
  step losses 60 "$PY" losses.py --tokens $((1 << 24)) --repeats 5 --no-hlo
  step engines 90 "$PY" engines.py --batch 128 --sequences 512 --repeats 2
  step testbed_loop 80 "$PY" testbed_loop.py --steps 15 --rounds 1
fi
say "results in $OUT"
find "$OUT" -maxdepth 1 -type f -printf "%f\n" | sort | tee -a "$LOG"
exit $status

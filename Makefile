# Two entry points, each self-contained on a fresh machine:
#   make train   -> creates .venv, installs sat_jax, runs `sat-jax train` on its built-in default
#   make test    -> creates .venv, installs sat_jax with its test extras, runs the test suite
PYTHON ?= python3.11
VENV ?= .venv
PIP_EXTRAS ?= test,hf,gcs

.PHONY: install train test lint bench report wheels

$(VENV)/.installed-$(PIP_EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(if $(PRE_INSTALL),$(VENV)/bin/python -m pip install --quiet $(PRE_INSTALL))
	$(VENV)/bin/python -m pip install --quiet -e ".[$(PIP_EXTRAS)]"
	touch $@

install: $(VENV)/.installed-$(PIP_EXTRAS)

# glibc >= 2.35: transparent huge pages for malloc'd memory. XLA:CPU takes a fresh temporary
# buffer every execution, and with 4 KiB pages each execution page-faults on all of it
# (docs/system.md, "Page faults"); older glibc ignores the unknown tunable. Override with
# GLIBC_TUNABLES=.
GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
export GLIBC_TUNABLES

train: install
	$(VENV)/bin/sat-jax train

# A test whose xdist worker dies (a signal: XLA:CPU's compiler has segfaulted now and then on one
# of this suite's hundreds of programs, never on a re-run) runs once more on a fresh worker; the
# summary counts it as a rerun. An ordinary failure or error is never re-run (--rerun-except
# matches every exception). tests/package/test_crash_rerun.py checks both with these flags.
PYTEST_RERUN ?= --reruns 1 --rerun-except '.*'

test: install
	$(VENV)/bin/python -m pytest -n 2 $(PYTEST_RERUN) tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The short benchmarks, then docs/benchmarks.md from every result in benchmarks/results/. The
# long ones and the peers run by name (benchmarks/README.md); `make report` only re-renders.
bench: install
	$(VENV)/bin/python benchmarks/losses.py --repeats 10
	$(VENV)/bin/python benchmarks/sampler.py
	$(VENV)/bin/python benchmarks/moe.py --no-torch --repeats 10
	$(VENV)/bin/python benchmarks/logprobs.py --quick
	$(VENV)/bin/python benchmarks/report.py

report: install
	$(VENV)/bin/python benchmarks/report.py

# sat_jax.integrations.tunix in an environment of its own: google-tunix pins safetensors<0.8, the
# hf extra >=0.8, so this one installs the test and tunix extras and leaves hf out.
TUNIX_VENV ?= .ci-venv-tunix

.PHONY: test-tunix

$(TUNIX_VENV)/.installed-tunix: pyproject.toml
	$(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TUNIX_VENV)/bin/python -m pip install --quiet -e ".[test,tunix]"
	touch $@

test-tunix: $(TUNIX_VENV)/.installed-tunix
	$(TUNIX_VENV)/bin/python -m pytest -n 0 tests/integrations

# Wheels of the pure-Python dependencies a lent GPU machine lacks (it has JAX, flax, optax,
# orbax-checkpoint and chex, and no network), for benchmarks/accelerator.sh to install from.
# Built on a machine with network; git ignores the folder, which travels with the tree.
WHEELS ?= ml_collections tensorboardX
wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --dest benchmarks/wheels $(WHEELS)

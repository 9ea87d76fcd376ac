"""A ``sat-jax train`` process that sends itself SIGTERM at one phase of the run, on one process.

Usage: python _preempt.py PHASE PROCESS_INDEX SAT_JAX_ARGS...

PHASE: ``mid_step`` (inside step 2's update), ``eval`` (entering the closing evaluation),
``save`` (entering the closing checkpoint write) or ``after_last_step`` (after the last step,
before the closing evaluation and save). Only process ``PROCESS_INDEX`` is signalled, as a
preemption notice that reaches one host.
"""

import os
import signal
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from sat_jax.cli import run  # noqa: E402
from sat_jax.run.checkpoint import Checkpointer  # noqa: E402
from sat_jax.train import learner  # noqa: E402

phase, target = sys.argv[1], int(sys.argv[2])
calls = {"update": 0}


def _before(owner, name, when):
    original = getattr(owner, name)

    def patched(self, *args, **kwargs):
        if when(self, *args) and jax.process_index() == target:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    setattr(owner, name, patched)


def _second_update(self, rollout, step):
    calls["update"] += 1
    return calls["update"] == 2


if phase == "mid_step":
    _before(learner._Session, "update", _second_update)
elif phase == "eval":
    _before(learner._Session, "evaluate", lambda self, step: step == self.end)
elif phase == "save":
    _before(Checkpointer, "save", lambda self, step, *rest: step == 3)
elif phase == "after_last_step":
    _before(learner._Session, "finish", lambda self: True)
else:
    raise SystemExit(f"unknown phase {phase!r}")
sys.argv = ["sat-jax", *sys.argv[3:]]
run()

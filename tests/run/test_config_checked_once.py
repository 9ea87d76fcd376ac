"""One ``sat-jax train`` checks its config once and builds each piece once: one validation, one
prompt-source build (one task), one lag schedule, one row check of the data."""

import sys

from _tiny_models import TINY_RUN
from absl import flags

from sat_jax import cli
from sat_jax.rl.lag import LagSchedule

TINY = (*TINY_RUN, "num_steps=1", "sft.steps=0", "eval.every=0", "log.progress=false")


def _count_calls(monkeypatch, module, name: str) -> list:
    """Counts calls of ``module.name`` wherever a loaded module holds it by that name."""
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if (
            mod is not None
            and mod.__name__.startswith("sat_jax")
            and getattr(mod, name, None) is real
        ):
            monkeypatch.setattr(mod, name, counted)
    return calls


def test_one_train_command_validates_and_builds_once(monkeypatch, tmp_path, capsys):
    from sat_jax.config import validation
    from sat_jax.data import prompt_sources, tasks
    from sat_jax.train import learner  # noqa: F401 - loaded, so its imported names are patched

    counts = {
        "validate": _count_calls(monkeypatch, validation, "validate"),
        "build_sources": _count_calls(monkeypatch, prompt_sources, "build_sources"),
        "task_from_config": _count_calls(monkeypatch, tasks, "task_from_config"),
        "check_data_rows": _count_calls(monkeypatch, validation, "check_data_rows"),
        "LagSchedule": [],
    }
    real_init = LagSchedule.__init__

    def init(self, *args, **kwargs):
        counts["LagSchedule"].append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LagSchedule, "__init__", init)
    argv = [
        "sat-jax",
        f"--config={cli.defaults_module.__file__}",
        *(f"--config.{o}" for o in TINY),
        "train",
        f"--workdir={tmp_path}/run",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    if flags.FLAGS.is_parsed():
        flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)
    rc = cli.main(flags.FLAGS(argv))
    assert rc == 0, capsys.readouterr().err
    seen = {k: len(v) for k, v in counts.items()}
    assert seen == dict.fromkeys(counts, 1)

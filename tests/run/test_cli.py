"""The ``sat-jax`` front door, in-process: help, the config command, and every impossible config
value stopping with ``sat-jax: error: invalid config: ...`` and exit 2 before anything compiles."""

import sys

import jax
import pytest
from absl import flags

from sat_jax import cli

_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _COMPILES.append(name) if "backend_compile" in name else None
)


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """A config that passes validation by mistake must not start a run."""
    from sat_jax.train import learner

    def refuse(*args, **kwargs):
        raise AssertionError("validation passed: the run would have started")

    monkeypatch.setattr(learner, "train", refuse)
    monkeypatch.setattr(learner, "evaluate_run", refuse)


def run_cli(capsys, *args):
    """``sat-jax ARGS`` in this process, as ``cli.run`` does it: (exit status, stdout, stderr)."""
    rc = cli.print_help(list(args))
    if rc is None:
        argv = ["sat-jax", f"--config={cli.defaults_module.__file__}", *args]
        saved = sys.argv
        # ml_collections registers the --config.KEY overrides it finds in sys.argv on parsing.
        sys.argv = argv
        try:
            if flags.FLAGS.is_parsed():
                flags.FLAGS.unparse_flags()
            for name in [n for n in flags.FLAGS if n.startswith("config.")]:
                delattr(flags.FLAGS, name)  # the previous call's override flags
            rc = cli.main(flags.FLAGS(argv))
        finally:
            sys.argv = saved
    out = capsys.readouterr()
    return rc, out.out, out.err


INVALID = [
    ("optim.learning_rate=-1", "optim.learning_rate must be > 0"),
    ("loss.alpha=1.5", "loss.alpha=1.5 (checked by 'sat_gspo'): `alpha` must be <= 1.0"),
    ("loss.eps_low=1.0", "loss.eps_low=1.0 (checked by 'sat_gspo'): `eps_low` must be < 1.0"),
    ("loss.eps_high=-0.1", "`eps_high` must be >= 0.0"),
    ("loss.dual_clip=0.5", "`dual_clip` must be > 1.0"),
    ("loss.hill_exponent=0", "`hill_exponent` must be > 0.0"),
    ("loss.objective=nope", "loss.objective 'nope' is not one of"),
    ("loss.correction=nope", "loss.correction must be 'none' or one of"),
    ("loss.correction=kpop", "loss.kpop_phi=0.0 (checked by 'kpop'): `phi` must be > 0.0"),
    ("loss.tis_cap=0", "loss.tis_cap"),
    ("loss.aggregation=mean", "loss.aggregation must be one of"),
    ("loss.advantage=ppo", "loss.advantage must be one of"),
    ("loss.kl_coef=-1", "loss.kl_coef must be >= 0"),
    ("loss.entropy_coef=-0.01", "loss.entropy_coef must be >= 0, got -0.01"),
    ("loss.ratio_denominator=x", "loss.ratio_denominator must be"),
    ("rollout.group_size=1", "rollout.group_size=1 with loss.advantage='grpo'"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.dtype=int8", "rollout.dtype must be"),
    ("rollout.stream_chunk=0", "rollout.stream_chunk >= 1"),
    ("rollout.prefill_chunk=-1", "rollout.prefill_chunk must be an int >= 0 (0: one call), got -1"),
    ("model.num_experts_per_tok=40", "num_experts_per_tok=40 exceeds num_experts=16"),
    ("model.num_kv_heads=3", "model: ModelConfig"),
    ("data.max_new_tokens=0", "data.max_new_tokens must be >= 1"),
    ("data.task=nope", "data.task='nope'"),
    ("data.source=tfds", "data.tfds_name is required"),
    ("lag=-1", "lag for mode 'broadcast' must be >= 1"),
    ("lag_mode=sync", "lag mode must be one of"),
    ("num_steps=0", "num_steps must be >= 1"),
    ("snapshot_placement=disk", "snapshot_placement must be one of"),
    ("optim.b2=1.0", "optim.b2 must be in [0, 1)"),
    ("optim.schedule=linear", "optim.schedule"),
    ("optim.num_minibatches=3", "must split into"),
    ("optim.micro_batches=0", "optim.micro_batches must be an int >= 1 (1: off), got 0"),
    ("optim.micro_batches=3", "optim.micro_batches=3: each minibatch"),
    ("sft.batch_size=0", "sft.batch_size >= 1"),
    ("eval.num_prompts=0", "eval.num_prompts must be >= 1"),
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep must be >= 1"),
    ("mesh.data=100", "mesh (data=100, fsdp=1, expert=1, tensor=1) needs 100 trainer devices"),
    ("mesh.fsdp=0", "mesh.fsdp must be a positive int"),
    ("loss.logprob_chunk=-1", "loss.logprob_chunk must be an int >= 0"),
    ("rollout.temperature=inf", "rollout.temperature finite and > 0"),
    ("optim.grad_clip=nan", "optim.grad_clip must be a finite number >= 0, got nan"),
    ("optim.weight_decay=nan", "optim.weight_decay must be a finite number >= 0, got nan"),
    ("optim.grad_clip=inf", "optim.grad_clip must be a finite number >= 0, got inf"),
    ("sft.learning_rate=inf", "sft.learning_rate > 0"),
    ("seed=-1", "seed must be an int in [0, 2**63), got -1"),
    ("mesh.tensor=3", "mesh (data=2, fsdp=1, expert=1, tensor=3) does not fit the model: mesh"),
    ("mesh.expert=3", "mesh axis 'expert' (3) of size 3 does not divide ModelConfig.hidden_size"),
    (
        "rollout.prompts_per_step=9752",
        "prompts_per_step=9752: batch_size=9752 is larger than the source (9744 examples",
    ),
    ("data.chat_template=True", "data.chat_template=True needs a Hugging Face tokenizer"),
    (
        "loss.advantage=dr_grpo rollout.group_size=1",
        "rollout.group_size=1 with loss.advantage='dr_grpo'",
    ),
]


@pytest.mark.parametrize("override,message", INVALID, ids=[o for o, _ in INVALID])
def test_invalid_values_exit_2_before_compiling(override, message, capsys, tmp_path):
    _COMPILES.clear()
    overrides = [f"--config.{o}" for o in override.split(" ")]
    rc, out, err = run_cli(capsys, "train", *overrides, f"--workdir={tmp_path}/run")
    assert rc == 2, (out, err)
    assert err.startswith("sat-jax: error: invalid config: "), err
    assert message in err, err
    assert "Traceback" not in out + err
    assert _COMPILES == []  # checked by tracing (jax.eval_shape), nothing compiled
    assert not (tmp_path / "run").exists()


def test_help_lists_commands_flags_and_where_the_config_keys_are(capsys):
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    for command in cli.COMMANDS:
        assert f"\n  {command} " in out
    assert "--config.KEY=VALUE" in out and "--workdir" in out and "sat-jax config" in out
    rc, out, _ = run_cli(capsys, "train", "--help")
    assert rc == 0 and out.startswith("usage: sat-jax train") and "--max_steps" in out
    rc, out, _ = run_cli(capsys)  # no command: the help, not a training run
    assert rc == 2 and out.startswith("usage: sat-jax COMMAND")


def test_config_command_prints_the_resolved_config(capsys):
    rc, out, err = run_cli(capsys, "config", "--config.lag=3")
    assert rc == 0, err
    assert "lag: 3" in out and "objective: sat_gspo" in out and "kpop_phi" in out
    rc, _, err = run_cli(capsys, "frobnicate")
    assert rc == 2 and "unknown command 'frobnicate'" in err


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``sat-jax config | head -1``: the reader leaving is not a traceback."""
    import subprocess

    proc = subprocess.run(
        f"{sys.executable} -c 'from sat_jax import cli; cli.run()' config | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert proc.stdout.strip() == "checkpoint:"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr

"""Two JAX processes (loopback coordinator, gloo CPU collectives): a local workdir the processes
do not share is refused on every process before anything runs, and a SIGTERM that reaches one
process only stops both after the same step, with one checkpoint."""

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
from test_two_processes import _env, _free_port

from sat_jax.run.checkpoint import Checkpointer

_CLI = (
    "import jax; jax.config.update('jax_cpu_collectives_implementation', 'gloo');"
    "import sys; from sat_jax.cli import run; sys.argv[0] = 'sat-jax'; run()"
)


def _train_args(workdir, port, cache):
    return [
        "train",
        f"--workdir={workdir}",
        "--multihost=on",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--config.model.num_layers=1",
        "--config.model.hidden_size=32",
        "--config.model.num_experts=4",
        "--config.model.num_experts_per_tok=2",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.group_size=4",
        f"--config.sft.cache_dir={cache}",
        "--config.sft.steps=3",
        "--config.eval.every=0",
        "--config.log.progress=False",
        "--config.log.plots=False",
        "--config.log.tensorboard=False",
        "--config.lag=1",
    ]


def _start(args, i, cwd):
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, *args, f"--process_id={i}"],
        env=_env(2),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs, timeout=300):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_unshared_local_workdir_is_refused_on_every_process(tmp_path):
    # One relative --workdir, two working directories: each process its own copy of "run".
    port, dirs = _free_port(), [tmp_path / "host0", tmp_path / "host1"]
    for d in dirs:
        d.mkdir()
    args = _train_args("run", port, tmp_path / "cache")
    procs = [_start(args, i, dirs[i]) for i in range(2)]
    outs = _finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 2, out[-3000:]
        assert "is not shared by the hosts of this multi-host run (processes [1]" in out
        assert "Traceback" not in out
    # Nothing was started: no checkpoint, no metrics, no lock; the probe file is gone.
    assert os.listdir(dirs[0] / "run") == [] and not (dirs[1] / "run").exists()


def test_eval_refuses_hosts_that_see_different_checkpoints(tmp_path):
    port, dirs = _free_port(), [tmp_path / "host0", tmp_path / "host1"]
    with Checkpointer(dirs[0] / "run" / "checkpoints") as ckpt:  # only host 0's copy has one
        ckpt.save(1, {"w": jnp.ones(2)}, {})
    (dirs[1] / "run" / "checkpoints").mkdir(parents=True)
    args = [
        "eval",
        "--workdir=run",
        "--multihost=on",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    procs = [_start(args, i, dirs[i]) for i in range(2)]
    outs = _finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 2, out[-3000:]
        assert "do not see the same newest checkpoint" in out and "[1, -1]" in out
        assert "Traceback" not in out


def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    workdir, port = tmp_path / "run", _free_port()
    args = [
        *_train_args(workdir, port, tmp_path / "cache"),
        "--config.num_steps=100000",
        "--config.checkpoint.every=0",
    ]
    procs = [_start(args, i, tmp_path) for i in range(2)]
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and metrics.read_text().count('"train/reward_mean"') >= 2:
            break
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice on one host only
    outs = _finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM: stopping after this step" in outs[1]
    logged = metrics.read_text().count('"train/reward_mean"')
    steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps == [logged]  # saved by both processes at the step both stopped after

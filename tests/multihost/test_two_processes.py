"""Two JAX processes on this machine (loopback coordinator, gloo CPU collectives) against one."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    # The suite's other XLA flags (tests/conftest.py) stay; the device count is this test's own.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
    )
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_processes(cmds_envs, timeout=420):
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in cmds_envs
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outs


def test_two_processes_match_one_process(tmp_path):
    worker = os.path.join(HERE, "_worker.py")
    cache = str(tmp_path / "cache")
    single = str(tmp_path / "single.npz")
    multi = str(tmp_path / "multi.npz")
    # Warm the shared warm-up cache first so both runs start from the same cached parameters.
    _run_processes([([sys.executable, worker, "0", "1", "0", single, cache], _env(4))])
    port = str(_free_port())
    outs = _run_processes(
        [([sys.executable, worker, str(i), "2", port, multi, cache], _env(2)) for i in range(2)]
    )
    assert all("devices=4 ok" in o for o in outs)
    a, b = np.load(single), np.load(multi)
    assert float(a["loss"]) != 0.0  # the three steps had a gradient to follow
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("mode", ["broadcast"])
def test_cli_train_on_two_processes(mode, tmp_path):
    port = str(_free_port())
    workdir = tmp_path / "run"
    args = [
        "train",
        f"--workdir={workdir}",
        "--multihost=on",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--config.num_steps=3",
        "--config.model.num_layers=1",
        "--config.model.hidden_size=32",
        "--config.model.num_experts=4",
        "--config.model.num_experts_per_tok=2",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.group_size=4",
        f"--config.sft.cache_dir={tmp_path / 'cache'}",
        "--config.sft.steps=3",
        "--config.eval.every=0",
        "--config.log.progress=False",
        "--config.log.plots=False",
        f"--config.lag_mode={mode}",
        "--config.lag=1",
    ]
    outs = _run_processes(
        [
            (
                [
                    sys.executable,
                    "-c",
                    "import jax; jax.config.update('jax_cpu_collectives_implementation', 'gloo');"
                    "import sys; from sat_jax.cli import run; sys.argv[0] = 'sat-jax'; run()",
                    *args,
                    f"--process_id={i}",
                ],
                _env(2),
            )
            for i in range(2)
        ]
    )
    assert '"steps"' in outs[0]  # only process 0 prints the summary
    assert '"steps"' not in outs[1]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert sum('"train/reward_mean"' in line for line in lines) == 3
    assert (workdir / "checkpoints" / "3").is_dir()

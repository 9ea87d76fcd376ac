"""The RL system end to end at toy size: configs, lag exactness, resume after SIGKILL, refusing
another run's workdir, eval equal to the in-training evaluation, sharding, CLI errors."""

import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tiny_models import tiny_run as tiny
from _traces import compiles_of

from sat_jax import config as config_lib
from sat_jax import parallel
from sat_jax.rl import LagSchedule, lag_stats, sft, trainer
from sat_jax.rl.stream import StreamRollouts
from sat_jax.run.metrics import read_metrics
from sat_jax.sampling import SamplingParams
from sat_jax.train import learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The real-model configs name a checkpoint to load (model.hf_path); their tiny runs are
# tests/data/test_task_configs.py's.
REAL_MODEL_CONFIGS = ("qwen3_30b_a3b.py", "qwen3_30b_a3b_math.py", "qwen3_countdown.py")
METHOD_CONFIGS = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if os.path.basename(p) not in REAL_MODEL_CONFIGS
)


def load_config(path):
    spec = importlib.util.spec_from_file_location("cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


@pytest.mark.parametrize("path", METHOD_CONFIGS, ids=[os.path.basename(p) for p in METHOD_CONFIGS])
def test_each_config_runs_two_steps(path, tmp_path, cache_dir):
    config = tiny(load_config(path), tmp_path / "run", cache_dir)
    summary = learner.train(config, quiet=True)
    assert summary["end_step"] == 2 and not summary["interrupted"]
    hist = summary["history"]
    for h in hist:
        assert np.isfinite(h["loss/total"]) and np.isfinite(h["loss/mismatch"])
    if config.loss.objective.startswith("sat"):
        assert "loss/sat/q" in hist[0] and "loss/sat/binding_rate" in hist[0]
    if config.loss.correction == "tis":
        assert "mismatch/engine" in hist[0]
    records = read_metrics(config.workdir)
    assert [r["step"] for r in records if "train/reward_mean" in r] == [1, 2]


@pytest.mark.parametrize("mode,lag,correction", [("fixed", 2, "tis"), ("broadcast", 3, "kpop")])
def test_lag_bookkeeping_is_exact(mode, lag, correction, tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.num_steps = mode, lag, 5
    # TIS needs the behaviour version's snapshot at every step; KPop compares with the current
    # policy (its phi from loss.kpop_phi).
    config.loss.correction, config.loss.kpop_phi = correction, 0.05
    with compiles_of("train_on_mesh") as step:
        hist = learner.train(config, quiet=True)["history"]
    # Five steps, one compilation (one signature of types and shardings): the state's step
    # counters are placed like the rest of it.
    assert len(hist) == 5 and (step.traces, step.lowerings) == (1, 1)
    schedule = LagSchedule(mode, lag)
    for j, h in enumerate(hist):
        expected = j - schedule.version_for(j)
        # Every token of batch j was produced by exactly the scheduled version.
        assert h["lag/min"] == h["lag/max"] == h["lag/mean"] == expected, (j, h)
        assert h["lag/pqs_mean"] == 0 and h["lag/iqs_mean"] == expected
        # The store holds what the schedule needs, never more than its capacity.
        assert 1 <= h["snapshots/versions"] <= schedule.capacity
        assert (
            h["snapshots/device_bytes"]
            == h["snapshots/versions"] * h["snapshots/bytes_per_version"]
        )
    assert ("mismatch/engine" in hist[0]) == (correction == "tis")  # KPop needs no recompute


def test_sampled_lag_float16_engine_and_router_noise_run_end_to_end(tmp_path, cache_dir):
    """Heterogeneous lag, a float16 engine and engine router noise through the learner: every
    step's realized lags are exactly the groups' drawn lags (each row has at least one token),
    and the noisy engine's routing differs from the trainer's."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.lag_dist, config.lag_cap = "sampled", 2, "zipf", 3
    config.rollout.dtype, config.rollout.router_noise = "float16", 1.0
    config.num_steps = 4
    hist = learner.train(config, quiet=True)["history"]
    schedule = LagSchedule("sampled", 2, "zipf", 3)
    for j, h in enumerate(hist):
        lags = j - schedule.group_versions(j, config.rollout.prompts_per_step, config.seed)
        assert (h["lag/min"], h["lag/max"]) == (lags.min(), lags.max()), (j, h, lags)
        assert h["rollout/versions"] == len(set(lags.tolist()))
        assert h["snapshots/versions"] <= schedule.capacity
        assert np.isfinite(h["loss/total"]) and np.isfinite(h["mismatch/p99"])
    assert max(h["routing/flip_rate"] for h in hist) > 0


def test_decomposed_mismatch_adds_up_in_the_learner(tmp_path, cache_dir):
    """log.decompose_mismatch with fixed lag 2: steps 0-2 train on version-0 rollouts, so at
    step 0 (θ = θ_0) the staleness part s = log(π_θ/π_θv) is 0 up to float32 rounding (the
    trainer's forward and the behaviour version's are two compiled programs, fused differently)
    and the engine part e = log(π_θv/μ) is all of log r = e + s; by step 2 the policy has moved
    and staleness is well above that rounding.

    Each statistic of log r is within the rounding that s carries of the engine part's: an order
    statistic of |log r| moves by at most max|s| from that of |e|, a mean of |·| by at most E|s|,
    a sequence sum by at most max|Σs|, and Kish's ESS by a factor within e^(±4·max|s|)."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.num_steps = "fixed", 2, 3
    config.log.decompose_mismatch = True
    # The router's load-balancing loss moves the policy even when a toy batch has no reward
    # signal (all-equal groups, zero advantages).
    config.model.router_aux_loss_coef, config.optim.learning_rate = 1.0, 3e-3
    hist = learner.train(config, quiet=True)["history"]
    first, last = hist[0], hist[-1]
    s_max = first["mismatch/staleness_max"]
    assert 0.0 <= first["mismatch/staleness"] <= s_max < 1e-5
    bounds = {
        "p50": s_max,
        "p90": s_max,
        "p99": s_max,
        "max": s_max,
        "seq_sum_max": first["mismatch/staleness_seq_sum_max"],
        "ess": 4 * s_max,
    }
    np.testing.assert_allclose(
        first["mismatch/engine"],
        first["loss/mismatch"],
        rtol=1e-5,
        atol=1e-7 + first["mismatch/staleness"],
    )
    for stat, bound in bounds.items():
        np.testing.assert_allclose(
            first[f"mismatch/engine_{stat}"],
            first[f"mismatch/{stat}"],
            rtol=1e-5,
            atol=1e-7 + bound,
            err_msg=stat,
        )
    assert last["mismatch/staleness"] > 100 * first["mismatch/staleness_max"]


def test_separate_rollout_device(tmp_path, cache_dir):
    """A rollout device apart from the trainer mesh (the paper's split pools), on one host."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.mesh.data, config.mesh.rollout_device = 4, 7
    parts = learner.build(config)
    assert parts.rollout_device not in parts.mesh.devices.ravel().tolist()
    hist = learner.train(config, quiet=True)["history"]
    assert len(hist) == 2 and all(np.isfinite(h["loss/total"]) for h in hist)


@pytest.mark.parametrize(
    "mode,lag,prefetched",
    [("fixed", 2, True), ("sampled", 2, True), ("broadcast", 2, True), ("fixed", 0, False)],
)
def test_prefetch_rolls_out_the_same_batches_and_resumes_before_a_waiting_one(
    mode, lag, prefetched, tmp_path, cache_dir
):
    """rollout.prefetch draws batch s + 1 while step s trains (on a rollout device of its own):
    every logged number equals the run without it, checkpoints taken while a prefetched batch
    waits resume before that batch, and lag 0 (batch s + 1 reads version s + 1) never
    prefetches."""

    def config_for(name, prefetch):
        c = tiny(config_lib.get_config(), tmp_path / name, cache_dir)
        c.lag_mode, c.lag, c.num_steps = mode, lag, 6
        if mode == "sampled":
            c.lag_dist, c.lag_cap = "zipf", 3
        c.mesh.rollout_device, c.rollout.prefetch = 7, prefetch
        c.checkpoint.every, c.eval.every = 2, 3
        return c

    reference = learner.train(config_for("reference", False), quiet=True)
    run = learner.train(config_for("prefetch", True), quiet=True)
    flags = [h.get("rollout/prefetched", 0.0) for h in run["history"]]
    # Batch 0 is drawn at the start; each later one while the step before it trained.
    assert flags == ([0.0] + [1.0] * 5 if prefetched else [0.0] * 6)

    def rows(workdir):
        return [
            {k: v for k, v in r.items() if k != "rollout/prefetched"}
            for r in read_metrics(workdir)
            if "train/reward_mean" in r or "eval/pass@1" in r
        ]

    _same_rows(rows(tmp_path / "reference"), rows(tmp_path / "prefetch"))
    assert run["final_eval"] == reference["final_eval"]
    # The checkpoint at step 4 was saved while batch 4 waited: resuming from it draws batch 4
    # from the same prompts again, so steps 5 and 6 are logged as before.
    shutil.rmtree(tmp_path / "prefetch" / "checkpoints" / "6")
    resumed = learner.train(config_for("prefetch", True), quiet=True)
    assert resumed["start_step"] == 4
    _same_rows(rows(tmp_path / "reference"), rows(tmp_path / "prefetch"))


def test_versions_decoded_on_several_devices_give_the_same_run(tmp_path, cache_dir):
    """rollout.decode_devices: a sampled-lag batch's versions decoded in turn on 3 devices, all
    dispatched before any is read, log every number of the run on one; other modes refuse it."""

    def config_for(name, k):
        c = tiny(config_lib.get_config(), tmp_path / name, cache_dir)
        c.lag_mode, c.lag, c.lag_dist, c.lag_cap, c.num_steps = "sampled", 2, "zipf", 3, 5
        c.rollout.decode_devices, c.eval.every = k, 5
        return c

    one = learner.train(config_for("one", 1), quiet=True)
    three = learner.train(config_for("three", 3), quiet=True)
    assert max(h["rollout/versions"] for h in three["history"]) >= 2  # something to spread
    _same_rows(_train_rows(tmp_path / "one"), _train_rows(tmp_path / "three"))
    assert one["final_eval"] == three["final_eval"]
    bad = config_for("bad", 2)
    bad.lag_mode = "fixed"
    with pytest.raises(ValueError, match="rollout.decode_devices=2 spreads"):
        learner.train(bad, quiet=True)
    bad = config_for("bad", 9)
    with pytest.raises(ValueError, match=r"decode_devices must be an int in \[1, 8\]"):
        learner.train(bad, quiet=True)


def test_prefetch_is_refused_in_stream_mode(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.rollout.prefetch = "stream", 2, True
    with pytest.raises(ValueError, match="rollout.prefetch=True needs lag_mode fixed"):
        learner.train(config, quiet=True)


def test_stream_mode_records_per_token_versions(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.num_steps = "stream", 2, 6
    config.rollout.stream_chunk = 1
    hist = learner.train(config, quiet=True)["history"]
    assert len(hist) == 6
    for j, h in enumerate(hist):
        assert 0 <= h["lag/min"] <= h["lag/max"] <= j
        assert h["lag/pqs_mean"] + h["lag/iqs_mean"] == pytest.approx(h["lag/mean"])
    # The worker runs ahead of the trainer: later batches are stale.
    assert max(h["lag/max"] for h in hist) >= 1


def _cli_overrides(workdir, cache_dir):
    return [
        f"--workdir={workdir}",
        "--config.model.num_layers=1",
        "--config.model.hidden_size=32",
        "--config.model.num_experts=4",
        "--config.model.num_experts_per_tok=2",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.group_size=4",
        f"--config.sft.cache_dir={cache_dir}",
        "--config.sft.steps=3",
        "--config.sft.batch_size=16",
        "--config.data.max_new_tokens=4",
        "--config.model.num_heads=2",
        "--config.model.num_kv_heads=1",
        "--config.model.head_dim=16",
        "--config.model.moe_intermediate_size=16",
        "--config.eval.num_prompts=8",
        "--config.log.progress=False",
        "--config.log.plots=False",
        "--config.log.tensorboard=False",
        "--config.mesh.data=1",
    ]


def _train_rows(workdir):
    return [r for r in read_metrics(workdir) if "train/reward_mean" in r]


def _same_rows(a, b):
    timing = ("time", "time/", "throughput/")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(timing)}
        assert keys == {k for k in rb if not k.startswith(timing)}
        for k in keys:
            assert ra[k] == rb[k] or (ra[k] != ra[k] and rb[k] != rb[k]), (ra["step"], k)


@pytest.mark.parametrize("mode,lag", [("fixed", 2), ("broadcast", 3)])
def test_sigkill_between_checkpoints_then_resume_logs_each_step_once(
    mode, lag, tmp_path, cache_dir
):
    def config_for(name):
        c = tiny(config_lib.get_config(), tmp_path / name, cache_dir)
        c.num_steps, c.checkpoint.every, c.lag, c.lag_mode = 7, 2, lag, mode
        c.eval.every = 3
        return c

    full = learner.train(config_for("full"), quiet=True)
    # The same run as a CLI process, SIGKILLed (no handler, no closing checkpoint) after step 5
    # is logged: its newest checkpoint is step 4, so step 5 is logged again after the resume.
    workdir = tmp_path / "killed"
    args = [
        *_cli_overrides(workdir, cache_dir),
        "--config.num_steps=7",
        "--config.checkpoint.every=2",
        f"--config.lag={lag}",
        f"--config.lag_mode={mode}",
        "--config.eval.every=3",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sat_jax.cli", "train", *args],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (workdir / "metrics.jsonl").exists() and len(_train_rows(workdir)) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(_train_rows(workdir)) in (5, 6)  # killed between the checkpoints at 4 and 6
    resumed = learner.train(config_for("killed"), quiet=True)
    assert resumed["start_step"] == 4
    _same_rows(_train_rows(tmp_path / "full"), _train_rows(workdir))
    steps = [r["step"] for r in read_metrics(workdir) if "eval/pass@1" in r]
    assert steps == [0, 3, 6, 7]  # each evaluation once
    assert full["final_eval"] == resumed["final_eval"]

    # The run is finished: training again says so and does nothing.
    again = learner.train(config_for("killed"), quiet=True)
    assert again["finished"] and again["history"] == [] and again["end_step"] == 7
    # Another config in the same workdir is refused, naming the field; resume=False starts over.
    changed = config_for("killed")
    changed.loss.eps_high, changed.num_steps = 0.3, 8
    with pytest.raises(learner.ResumeError, match=r"loss.eps_high: 0.2 -> 0.3"):
        learner.train(changed, quiet=True)
    changed.resume, changed.num_steps = False, 1
    assert learner.train(changed, quiet=True)["end_step"] == 1
    assert [r["step"] for r in _train_rows(workdir)] == [1]
    assert any(p.name.startswith("replaced-") for p in workdir.iterdir())


def test_corrupt_latest_checkpoint_falls_back(tmp_path, cache_dir):
    c = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    c.num_steps, c.checkpoint.every = 4, 2
    c.snapshot_placement = "host"  # pinned host snapshots go through the checkpoint too
    hist = learner.train(c, quiet=True)["history"]
    assert all(h["snapshots/device_bytes"] == 0 < h["snapshots/host_bytes"] for h in hist)
    ckpt_dir = tmp_path / "run" / "checkpoints" / "4"
    victims = [p for p in ckpt_dir.rglob("*") if p.is_file() and p.stat().st_size > 0]
    for p in victims:
        p.write_bytes(b"")  # a partial write of the newest checkpoint
    c.num_steps = 5
    summary = learner.train(c, quiet=True)
    assert summary["start_step"] == 2  # the previous valid checkpoint


def test_sharded_step_equals_single_device(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.rollout.prompts_per_step = 4  # 16 sequences: 2 per device on 8 devices
    parts = learner.build(config)
    examples = [parts.train_src[i] for i in range(4)]
    out = parts.engine.generate(parts.params, examples, jax.random.key(0), 0)
    batch = parts.engine.score(examples, out)
    # Plain SGD, so parameter differences are gradient differences (Adam's first step is
    # lr·sign(g) and would amplify float noise on near-zero gradients).
    optimizer = optax.sgd(0.1)
    results = []
    for n in (1, 8):
        mesh = parallel.make_mesh(n)
        step = trainer.make_train_step(
            parts.graphdef,
            optimizer,
            parts.spec,
            prompt_width=config.data.max_prompt_len,
            mesh=mesh,
        )
        params = parallel.replicate(parts.params, mesh)
        state = trainer.init_train_state(params, optimizer)
        state, metrics = step(state, batch.shard(mesh), {})
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (p1, m1), (p8, m8) = results
    # The model's forward on 2 rows per device rounds differently from one 16-row forward (matmul
    # blocking), so log-ratios of ~1e-3 differ in their last bits; SAT's q and c± are ratios of
    # such numbers. Everything else agrees to float32 rounding.
    sensitive = {"loss/sat/q", "loss/sat/c_min", "loss/sat/eps_low_mean", "loss/sat/eps_high_mean"}
    for k in m1:
        rtol = 2e-3 if k in sensitive else 1e-4
        np.testing.assert_allclose(m8[k], m1[k], rtol=rtol, atol=1e-6, err_msg=k)
    assert m1["loss/sat/gate_rate"] == m8["loss/sat/gate_rate"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p8)


def test_rollout_and_train_step_vmap_over_a_run_axis(tmp_path, cache_dir):
    """SPEC: many small runs as one program over a leading run axis. The sampler and the trainer
    step are pure, so ``jax.vmap`` over stacked parameters, keys, optimizer states and batches
    gives each run what it would get alone."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    parts = learner.build(config)
    examples = [parts.train_src[i] for i in range(4)]
    sampler, mesh, runs = parts.engine.sampler, parallel.make_mesh(1), 2
    params = [jax.tree.map(lambda x, r=r: x * (1 + 0.05 * r), parts.params) for r in range(runs)]
    keys = jax.random.split(jax.random.key(0), runs)
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731

    # Rollouts: one compiled sampler over the run axis vs each run alone.
    alone = [parts.engine.generate(p, examples, k, 0) for p, k in zip(params, keys, strict=True)]
    tokens, mask, widths = sampler._layout(*parts.engine.encode(examples))
    sampling = SamplingParams(
        *(
            jnp.asarray(v, jnp.int32 if i == 2 else jnp.float32)
            for i, v in enumerate(parts.engine.sampling)
        )
    )

    def generate(p, key):
        state = sampler._prefill_impl(p, tokens, mask, widths, key, sampling)
        return sampler._decode_impl(p, state, jnp.int32(sampler.max_new_tokens), jnp.int32(0))

    together = jax.jit(jax.vmap(generate))(stack(params), keys)
    for r in range(runs):
        np.testing.assert_array_equal(together.tokens[r], alone[r].tokens)

    # Trainer step: one compiled step over the run axis vs each run alone.
    batches = [parts.engine.score(examples, out) for out in alone]
    step = trainer.make_train_step(
        parts.graphdef,
        parts.optimizer,
        parts.spec,
        prompt_width=config.data.max_prompt_len,
        mesh=mesh,
    )
    states = [
        parallel.replicate(trainer.init_train_state(p, parts.optimizer), mesh) for p in params
    ]
    single = [step(s, b.shard(mesh), {}) for s, b in zip(states, batches, strict=True)]
    stacked = stack(batches)
    v_state, v_metrics = jax.jit(jax.vmap(step, in_axes=(0, 0, None)))(stack(states), stacked, {})
    sensitive = {"loss/sat/q", "loss/sat/c_min", "loss/sat/eps_low_mean", "loss/sat/eps_high_mean"}
    for r, (state, metrics) in enumerate(single):
        jax.tree.map(
            lambda a, b, r=r: np.testing.assert_allclose(a[r], b, rtol=1e-5, atol=1e-6),
            v_state.params,
            state.params,
        )
        for k, v in metrics.items():  # batched matmuls round differently; SAT's ratios amplify it
            np.testing.assert_allclose(
                v_metrics[k][r], v, rtol=2e-3 if k in sensitive else 1e-4, atol=1e-6, err_msg=k
            )


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--config.nonexistent_key=1"], "nonexistent_key"),
        (
            ["train", "--config.lag_mode=broadcast", "--config.lag=0"],
            "lag for mode 'broadcast' must be >= 1",
        ),
        (
            ["train", "--config.data.source=jsonl", "--config.data.path=/nonexistent.jsonl"],
            "does not exist",
        ),
        (["frobnicate"], "unknown command"),
    ],
)
def test_cli_rejects_bad_input_before_compute(args, message, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-m", "sat_jax.cli", *args, f"--workdir={tmp_path}/run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode != 0
    assert message in res.stderr + res.stdout
    assert "Traceback" not in res.stderr + res.stdout
    assert not os.path.exists(tmp_path / "run")  # nothing was started


def test_cli_train_eval_plot(tmp_path, cache_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    overrides = [
        f"--workdir={tmp_path}/run",
        "--config.num_steps=2",
        "--config.model.num_layers=1",
        "--config.model.hidden_size=32",
        "--config.model.num_experts=4",
        "--config.model.num_experts_per_tok=2",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.group_size=4",
        f"--config.sft.cache_dir={cache_dir}",
        "--config.sft.steps=3",
        "--config.eval.every=0",
        "--config.eval.num_prompts=8",
        "--config.log.progress=False",
        "--config.mesh.data=1",
    ]
    train = subprocess.run(
        [sys.executable, "-m", "sat_jax.cli", "train", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads(train.stdout[train.stdout.index("{") :])
    assert summary["steps"] == [0, 2]
    assert os.path.exists(tmp_path / "run" / "plots" / "summary.png")
    ev = subprocess.run(
        [sys.executable, "-m", "sat_jax.cli", "eval", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout[ev.stdout.index("{") :])["step"] == 2


def test_stream_worker_swaps_weights_mid_decode(tmp_path, cache_dir):
    """New versions published while a batch decodes are picked up between chunks, and every
    token records the version that produced it."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.data.max_new_tokens = 6
    parts = learner.build(config)
    prompts = iter(lambda: [parts.train_src[i] for i in range(4)], None)
    stream = StreamRollouts(parts.engine, prompts, seed=0, queue_size=1, chunk=1)
    stream.publish(0, parts.params)
    stream.start()
    try:
        version, batch = 0, None
        # A hang guard, not a timing: the worker compiles its decode first, which on a loaded
        # machine outlasts any fixed number of publishes.
        deadline = time.monotonic() + 600
        while batch is None and time.monotonic() < deadline:
            version += 1
            stream.publish(version, parts.params)  # same values, new version numbers
            time.sleep(0.002)
            if not stream.queue.empty():
                batch = stream.next(version).batch
        assert batch is not None, "the worker produced no batch"
    finally:
        stream.close()
    assert stream.store.versions() == [version]  # nothing recomputes: only the newest is kept
    versions, mask = batch.versions, batch.response_mask
    assert stream.swaps >= 1
    for row, m in zip(versions, mask, strict=True):
        live = row[m]
        assert np.all(np.diff(live) >= 0)  # versions only move forward within a response
    assert max(len(set(row[m])) for row, m in zip(versions, mask, strict=True)) >= 2
    stats = lag_stats(versions, mask, step=version)
    assert stats["lag/pqs_mean"] > 0


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, cache_dir):
    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sat_jax.cli",
            "train",
            f"--workdir={workdir}",
            "--config.num_steps=100000",
            "--config.model.num_layers=1",
            "--config.model.hidden_size=32",
            "--config.model.num_experts=4",
            "--config.model.num_experts_per_tok=2",
            "--config.rollout.prompts_per_step=4",
            "--config.rollout.group_size=4",
            f"--config.sft.cache_dir={cache_dir}",
            "--config.sft.steps=3",
            "--config.eval.every=0",
            "--config.checkpoint.every=0",
            "--config.log.progress=False",
            "--config.log.plots=False",
            "--config.mesh.data=1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("train/reward_mean") >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: checkpoint saved at step" in out
    assert "Traceback" not in out
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 2


def test_resume_and_eval_do_not_train_the_warmup_a_checkpoint_replaces(
    tmp_path, cache_dir, monkeypatch
):
    """A resumed run and ``eval`` take every parameter from the checkpoint, so an uncached
    warm-up (a fresh machine, a cleared cache) is not trained for them; a fresh run still is."""
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.eval.every = 2
    learner.train(config, quiet=True)
    in_training = [r for r in read_metrics(config.workdir) if "eval/pass@1" in r]

    def no_warmup(*args, **kwargs):
        raise AssertionError("the warm-up was trained for a run whose checkpoint replaces it")

    monkeypatch.setattr(sft, "warmup", no_warmup)
    evaluated = learner.evaluate_run(config)
    assert evaluated["step"] == 2 and evaluated["pass@1"] == in_training[-1]["eval/pass@1"]
    config.num_steps = 3
    assert learner.train(config, quiet=True)["end_step"] == 3
    fresh = tiny(config_lib.get_config(), tmp_path / "fresh", cache_dir)
    with pytest.raises(AssertionError, match="the warm-up was trained"):
        learner.train(fresh, quiet=True)


def test_jsonl_source_runs_through_the_learner(tmp_path, cache_dir):
    path = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(40):
        a, b = rng.integers(0, 50, size=2)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    path.write_text("\n".join(lines) + "\n")
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    config.data.source, config.data.path = "jsonl", str(path)
    config.data.eval_path = str(held_out)
    config.eval.every, config.eval.num_prompts = 2, 8
    summary = learner.train(config, quiet=True)
    assert summary["end_step"] == 2
    final = summary["final_eval"]
    # G = 4 samples of the one held-out prompt
    assert set(final) == {"pass@1", "avg@4", "pass@4", "num_prompts"} and final["num_prompts"] == 1
    # Scored by the numeric verifier (0/1): pass@1 is the share of the 4 samples that say 2, and
    # pass@4 whether any does.
    assert final["pass@1"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert final["avg@4"] == final["pass@1"] and final["pass@4"] == float(final["pass@1"] > 0)
    records = read_metrics(config.workdir)
    in_training = [r for r in records if "eval/pass@1" in r and r["step"] == 2]
    # `sat-jax eval` of the step-2 checkpoint samples exactly as the evaluation during training.
    evaluated = learner.evaluate_run(config)
    assert evaluated["step"] == 2
    assert {
        k: evaluated[k.removeprefix("eval/")] for k in in_training[0] if k.startswith("eval/")
    } == {k: v for k, v in in_training[0].items() if k.startswith("eval/")}

"""Host-loop benchmark: trainer steps/s, rollout tokens/s, the train step broken down, stream vs
broadcast, and google-tunix's GRPO loop on the matching shape beside it.

Runs the built-in default (tiny MoE, 2-digit addition, SAT-GSPO w/ R3) for a few dozen steps in
``broadcast`` and in ``stream`` mode at the same settings, and in ``broadcast`` once more with
``loss.share_prompt=False`` (every row computes its own prompt in the trainer and the prefill:
``shared_over_plain``), and prints one JSON object. Steady-state
figures skip the first steps (compilation); the first step's train time (compile included) is
reported as ``first_step_train_s``.

``train_step_breakdown`` times separately jitted pieces of the default run's train step on one of
its own rollout batches (128 sequences × 13 tokens), interleaved, medians:

* ``logprob_fwd_ms``: the training log-prob pass (``token_logprobs`` with R3 and support replay);
* ``logprob_fwd_bwd_ms``: the same with its gradient; ``logprob_bwd_ms`` is the difference, and
  ``logprob_bwd_over_fwd`` its ratio to the forward (paired per round);
* ``loss_and_grad_ms``: ``value_and_grad`` of the whole policy loss; ``loss_ms`` is what the
  objective (SAT-GSPO, its statistics and metrics) adds to the log-prob pass;
* ``optimizer_ms``: ``optimizer.update`` + ``apply_updates`` (Adam, global-norm clip);
* ``train_step_ms``: the compiled step itself; ``step_overhead_ms`` = it minus loss_and_grad and
  optimizer (norms, sharding constraints, output copies);
* ``host_to_device_ms`` (placing a host batch on the mesh) and ``metrics_to_host_ms`` (the
  step's metrics as floats, which waits for the step);
* ``objective_step_ms``: the whole compiled train step with each of PPO, SAT, GSPO and SAT-GSPO
  as the objective (ε as the run's), on the same batch and state; ``sat_step_over_ppo`` and
  ``sat_gspo_step_over_gspo`` are medians of the per-round ratios.

Beside tunix: ``--tunix-python PYTHON`` runs ``benchmarks/peers/tunix_grpo.py`` (override with
``--tunix-script``) with that interpreter (a venv with ``google-tunix``; never the project's own,
tunix pins other versions) in the same sitting, after ours, on the matching shape (d 64,
2 layers, 16 prompts × 8 samples, prompt 8, 5 new tokens; its dense SwiGLU of width 128 is the
routed MLP work per token of our 16-expert top-4 MoE of width 32), and reports its figures and
the ratios. Without it (or when tunix does not import there) the JSON says how to run it.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/loop.py [--steps 40]
[--tunix-python /work/venvs/tunix/bin/python]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import _results
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sat_jax import config as config_lib
from sat_jax import parallel
from sat_jax.data import PromptIterator
from sat_jax.rl import trainer
from sat_jax.train import learner
from sat_jax.train.components import build

WARMUP_STEPS = 5
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "tunix_grpo.py")


def _config(workdir: str, steps: int, mode: str, lag: int, share_prompt: bool = True):
    c = config_lib.get_config()
    c.loss.share_prompt = share_prompt
    c.workdir = workdir
    c.num_steps = steps
    c.lag_mode, c.lag = mode, lag
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    c.resume = False
    return c


def run(mode: str, steps: int, lag: int, workdir: str, share_prompt: bool = True) -> dict:
    c = _config(workdir, steps, mode, lag, share_prompt)
    t0 = time.perf_counter()
    summary = learner.train(c, quiet=True)
    wall = time.perf_counter() - t0
    hist = summary["history"][WARMUP_STEPS:]
    step_s = np.array([h["time/step_s"] for h in hist])
    tokens = np.array([h["train/tokens"] for h in hist])
    out = {
        "steps_measured": len(hist),
        "trainer_steps_per_s": float(1.0 / np.median(step_s)),
        "rollout_tokens_per_s": float(tokens.sum() / step_s.sum()),
        "median_step_ms": float(np.median(step_s) * 1e3),
        "median_train_ms": float(np.median([h["time/train_s"] for h in hist]) * 1e3),
        "median_rollout_ms": float(np.median([h["time/rollout_s"] for h in hist]) * 1e3),
        # The first step's train time: compiling the step (and the first run of it).
        "first_step_train_s": round(float(summary["history"][0]["time/train_s"]), 2),
        "first_step_s": round(float(summary["history"][0]["time/step_s"]), 2),
        "wall_s_including_compile": round(wall, 1),
        "mean_lag": float(np.mean([h["lag/mean"] for h in hist])),
        "final_reward_mean": float(np.mean([h["train/reward_mean"] for h in hist[-10:]])),
    }
    if mode != "stream":
        share = np.array([h["time/outside_compiled_share"] for h in hist])
        out["outside_compiled_share"] = float(np.sum(share * step_s) / step_s.sum())
    else:
        out["mean_queue_wait_ms"] = float(np.mean([h["time/queue_wait_s"] for h in hist]) * 1e3)
        out["weight_swaps_mid_decode"] = hist[-1].get("stream/swaps", 0.0)
        out["mean_pqs"] = float(np.mean([h["lag/pqs_mean"] for h in hist]))
        out["mean_iqs"] = float(np.mean([h["lag/iqs_mean"] for h in hist]))
    return out


def _interleaved(fns: dict, repeats: int) -> dict[str, np.ndarray]:
    """Seconds of each (already compiled) thunk per round, round-robin so load drifts hit all."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    rounds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            rounds[name].append(time.perf_counter() - start)
    return {k: np.array(v) for k, v in rounds.items()}


#: The objectives whose whole train step is timed on the same batch (``objective_step_ms``).
OBJECTIVES = ("ppo", "sat", "gspo", "sat_gspo")


def _objective_step(parts, spec, name, pw, state, batch, extra, share):
    """A thunk running the compiled train step of ``spec`` with objective ``name`` in place of
    its own (ε as the run's) on ``batch``."""
    eps = tuple((k, v) for k, v in spec.objective_kwargs if k in ("eps_low", "eps_high"))
    s = dataclasses.replace(spec, objective=name, objective_kwargs=eps)
    step = trainer.make_train_step(
        parts.graphdef, parts.optimizer, s, prompt_width=pw, mesh=parts.mesh
    )
    compiled = (step.jitted if share else step.unshared).lower(*step.args(state, batch, extra))
    compiled = compiled.compile()
    return lambda: compiled(*step.args(state, batch, extra))


def breakdown(workdir: str, lag: int, repeats: int) -> dict:
    """The default run's train step in separately jitted pieces, on one of its rollout batches."""
    c = _config(workdir, 1, "broadcast", lag)
    parts = build(c)
    prompts = PromptIterator(parts.train_src, c.rollout.prompts_per_step, seed=c.seed)
    source = learner.make_source(c, parts, prompts, first_step=0)
    source.publish(0, parts.params)
    source.start()
    rollout = source.next(0)
    source.close()
    host_batch = rollout.batch
    batch = host_batch.shard(parts.mesh)
    graphdef, spec, pw = parts.graphdef, parts.spec, c.data.max_prompt_len
    step = trainer.make_train_step(
        graphdef, parts.optimizer, spec, prompt_width=pw, mesh=parts.mesh
    )
    state = trainer.init_train_state(
        parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
    )
    extra = dict(rollout.behaviour)
    params = state.params
    # The step's program: each group's prompt once in every block when the batch allows it
    # (loss.share_prompt, on by default); the pieces below time the same pass.
    share = trainer.shares_prompt(host_batch, spec, pw)

    def logprobs(p, b):
        logp, entropy, _ = trainer._logprobs(graphdef, p, b, spec, pw, share)
        return logp, entropy

    def logprob_sum(p, b):  # a scalar of both outputs, so the backward covers both
        logp, entropy = logprobs(p, b)
        return jnp.sum(logp) + jnp.sum(entropy)

    def loss(p, b):
        return trainer.policy_loss(
            p, b, extra, graphdef=graphdef, spec=spec, prompt_width=pw, share=share
        )

    def update(grads, opt_state, p):
        updates, opt_state = parts.optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    fwd = jax.jit(logprobs)
    fwd_bwd = jax.jit(jax.value_and_grad(logprob_sum))
    loss_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    opt = jax.jit(update)
    grads = loss_grad(params, batch)[1]
    compiled = (
        (step.jitted if share else step.unshared).lower(*step.args(state, batch, extra)).compile()
    )
    flops = {
        name: fn.lower(params, batch).compile().cost_analysis().get("flops")
        for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd))
    }
    _, metrics = step(state, batch, extra)

    def train_step():
        return compiled(*step.args(state, batch, extra))

    # The run's own objective is ``train_step``, already compiled above.
    objective_steps = {
        f"step_{name}": _objective_step(parts, spec, name, pw, state, batch, extra, share)
        for name in OBJECTIVES
        if name != spec.objective
    }
    t = _interleaved(
        {
            "logprob_fwd": lambda: fwd(params, batch),
            "logprob_fwd_bwd": lambda: fwd_bwd(params, batch),
            "loss_and_grad": lambda: loss_grad(params, batch),
            "optimizer": lambda: opt(grads, state.opt_state, params),
            "train_step": train_step,
            "host_to_device": lambda: host_batch.shard(parts.mesh),
            "metrics_to_host": lambda: {k: float(v) for k, v in parallel.to_host(metrics).items()},
            **objective_steps,
        },
        repeats,
    )
    if spec.objective in OBJECTIVES:
        t[f"step_{spec.objective}"] = t["train_step"]
    ms = {k: float(np.median(v) * 1e3) for k, v in t.items()}
    bwd_rounds = t["logprob_fwd_bwd"] - t["logprob_fwd"]
    return {
        "batch": f"{batch.size} sequences x {batch.tokens.shape[1]} tokens",
        "shared_prompt": bool(share),
        "repeats": repeats,
        **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
        "logprob_bwd_ms": round(float(np.median(bwd_rounds) * 1e3), 2),
        "logprob_bwd_over_fwd": round(float(np.median(bwd_rounds / t["logprob_fwd"])), 2),
        "loss_ms": round(float(np.median(t["loss_and_grad"] - t["logprob_fwd_bwd"]) * 1e3), 2),
        "step_overhead_ms": round(ms["train_step"] - ms["loss_and_grad"] - ms["optimizer"], 2),
        "objective_step_ms": {name: round(ms[f"step_{name}"], 2) for name in OBJECTIVES},
        # Medians of the per-round ratios (each pair run back to back).
        "sat_step_over_ppo": round(float(np.median(t["step_sat"] / t["step_ppo"])), 3),
        "sat_gspo_step_over_gspo": round(float(np.median(t["step_sat_gspo"] / t["step_gspo"])), 3),
        "logprob_gflop_fwd_fwd_bwd": [
            round(flops["fwd"] / 1e9, 3),
            round(flops["fwd_bwd"] / 1e9, 3),
        ],
    }


def tunix(python: str, script: str, workdir: str) -> dict:
    """google-tunix's GRPO loop on the matching shape, run by ``python`` (its own venv)."""
    probe = subprocess.run([python, "-c", "import tunix"], capture_output=True, text=True)
    if probe.returncode:
        return {"skipped": f"tunix does not import in {python}: {probe.stderr.strip()[-300:]}"}
    out = os.path.join(workdir, "tunix.json")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, script, "--embed", "64", "--layers", "2", "--mlp", "128", "--json", out],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        return {"failed": proc.stderr.strip()[-1000:]}
    with open(out) as f:
        r = json.load(f)
    warmup = r["loop"]["warmup_steps"]
    step_s = np.array(r["per_step_s"][warmup:])
    return {
        "tunix": r["tunix"],
        "jax": r["jax"],
        "model": r["model"],
        "loop": r["loop"],
        "steps_measured": len(step_s),
        "trainer_steps_per_s": float(1.0 / np.median(step_s)),
        "median_step_ms": float(np.median(step_s) * 1e3),
        "median_train_ms": float(np.median(r["per_step_train_s"][warmup:]) * 1e3),
        "median_rollout_ms": float(np.median(r["per_step_rollout_s"][warmup:]) * 1e3),
        "first_step_train_s": r["first_step_train_s"],
        "first_step_s": r["first_step_s (incl. compile)"],
        "wall_s_including_setup": round(time.perf_counter() - t0, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lag", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="rounds of the breakdown")
    parser.add_argument("--no-stream", action="store_true", help="skip the stream-mode run")
    parser.add_argument(
        "--no-plain",
        action="store_true",
        help="skip the run with loss.share_prompt=False (each row its own prompt)",
    )
    parser.add_argument(
        "--tunix-python",
        default="",
        help="a python with google-tunix installed: run its GRPO loop beside",
    )
    parser.add_argument("--tunix-script", default=PEER)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        broadcast = run("broadcast", args.steps, args.lag, os.path.join(tmp, "broadcast"))
        # The obvious alternative beside: every row computes its own prompt (trainer and prefill).
        plain = (
            None
            if args.no_plain
            else run(
                "broadcast", args.steps, args.lag, os.path.join(tmp, "plain"), share_prompt=False
            )
        )
        stream = (
            None
            if args.no_stream
            else run("stream", args.steps, args.lag, os.path.join(tmp, "stream"))
        )
        parts = breakdown(os.path.join(tmp, "breakdown"), args.lag, args.repeats)
        peer = (
            tunix(args.tunix_python, os.path.abspath(args.tunix_script), tmp)
            if args.tunix_python
            else None
        )
    out = {
        "benchmark": "loop",
        "device": f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores)",
        "jax": jax.__version__,
        "config": "default (tiny MoE, addition, SAT-GSPO w/ R3), 16 prompts x 8 samples",
        "lag": args.lag,
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "broadcast": broadcast,
        "train_step_breakdown": parts,
    }
    if plain is not None:
        out["broadcast_without_shared_prompts"] = plain
        out["shared_over_plain"] = {
            "trainer_steps_per_s": round(
                broadcast["trainer_steps_per_s"] / plain["trainer_steps_per_s"], 3
            ),
            "train_ms (plain / shared)": round(
                plain["median_train_ms"] / broadcast["median_train_ms"], 3
            ),
            "rollout_ms (plain / shared)": round(
                plain["median_rollout_ms"] / broadcast["median_rollout_ms"], 3
            ),
        }
    if stream is not None:
        out["stream"] = stream
        out["stream_over_broadcast_steps_per_s"] = round(
            stream["trainer_steps_per_s"] / broadcast["trainer_steps_per_s"], 3
        )
    if peer is None:
        out["tunix"] = (
            "not run: pass --tunix-python PYTHON (a venv with `pip install "
            "google-tunix`, not this project's) to run "
            f"{os.path.relpath(args.tunix_script)} beside ours, or run it yourself: "
            "PYTHON benchmarks/peers/tunix_grpo.py --embed 64 --layers 2 --mlp 128 --json out.json"
        )
    else:
        out["tunix"] = peer
        if "trainer_steps_per_s" in peer:
            out["ours_over_tunix"] = {
                "trainer_steps_per_s": round(
                    broadcast["trainer_steps_per_s"] / peer["trainer_steps_per_s"], 3
                ),
                "train_ms (tunix / ours: > 1 = ours faster)": round(
                    peer["median_train_ms"] / broadcast["median_train_ms"], 3
                ),
                "rollout_ms (tunix / ours)": round(
                    peer["median_rollout_ms"] / broadcast["median_rollout_ms"], 3
                ),
                "first_step_train_s (ours, tunix)": [
                    broadcast["first_step_train_s"],
                    peer["first_step_train_s"],
                ],
            }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    sys.stdout.flush()
    _results.write("loop", out)


if __name__ == "__main__":
    main()

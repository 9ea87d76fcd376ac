"""google-tunix's GRPO loop on the shape of sat_jax's default run, for ``benchmarks/loop.py``.

A tiny random tunix Qwen3 (d 64, 2 layers, a dense SwiGLU of 128: the routed MLP work per token of
our 16-expert top-4 MoE of width 32), a character tokenizer defined here (no files, no downloads),
one CPU device, tunix's ``vanilla`` rollout engine and its ``GRPOLearner`` with Adam; 16 prompts ×
8 samples a step, prompts of at most 8 tokens, 5 new tokens, a trivial reward. It times every full
step (rollout + reward + train, the time between successive step ends), the rollout
(``RLCluster.generate``) and the train update (``RLCluster.update_actor``, waited on), and writes
the per-step times to ``--json`` in the form ``benchmarks/loop.py --tunix-python`` reads.

Run it in its own virtualenv (tunix pins its own JAX and Flax; never this project's venv):

    python3.11 -m venv /work/venvs/tunix && /work/venvs/tunix/bin/pip install google-tunix
    /work/venvs/tunix/bin/python benchmarks/peers/tunix_grpo.py --json /tmp/tunix.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout


class Chars:
    """Ids 3..vocab-1 are the ASCII characters of the same code; 0 pad, 1 bos, 2 eos."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, **_) -> list[int]:
        return [ord(c) for c in text if 3 <= ord(c) < self.vocab]

    def decode(self, ids, **_) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) >= 3)

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


def random_qwen3(args) -> tuple[nnx.Module, int]:
    cfg = qwen3.ModelConfig(
        num_layers=args.layers,
        vocab_size=args.vocab,
        embed_dim=args.embed,
        hidden_dim=args.mlp,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
    )
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(params=0))
    # tunix initialises some kernels to zero (it expects checkpoint weights); a zero MLP would make
    # the backward pass trivially cheap, so every all-zero matrix gets a scaled normal init.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.key(1)
    for i, x in enumerate(leaves):
        if x.ndim >= 2 and not bool(jnp.any(x != 0)):
            fan_in = int(np.prod(x.shape[:-1]))
            leaves[i] = jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) / np.sqrt(
                fan_in
            )
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
    return model, int(sum(x.size for x in leaves))


def reward(prompts, completions, **_):
    return [float("7" in c) for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embed", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--steps", type=int, default=40, help="measured steps after the warm-up")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    total = args.warmup + args.steps
    prompt_len = 8

    model, num_params = random_qwen3(args)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=Chars(args.vocab),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={
                rl_cluster_lib.Role.ACTOR: mesh,
                rl_cluster_lib.Role.REFERENCE: mesh,
                rl_cluster_lib.Role.ROLLOUT: mesh,
            },
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(1e-4, b1=0.9, b2=0.999),
                eval_every_n_steps=10**9,
                max_steps=total,
                mini_batch_size=args.prompts,  # one optimizer step per batch, as ours
                train_micro_batch_size=args.prompts,
                metrics_logging_options=None,
                checkpoint_root_directory=None,
                pbar_description=None,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=args.new_tokens,
                max_prompt_length=prompt_len,
                kv_cache_size=prompt_len + args.new_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=None,
            ),
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=args.group, num_iterations=1, beta=0.0, epsilon=0.2
        ),
        reward_fns=[reward],
    )

    times = {"rollout": [], "train": [], "end": []}

    def timed(fn, name, wait=None):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            if wait is not None:
                jax.block_until_ready(wait())
            times[name].append(time.perf_counter() - start)
            return out

        return wrapper

    cluster.generate = timed(cluster.generate, "rollout")
    cluster.update_actor = timed(
        cluster.update_actor, "train", wait=lambda: nnx.state(cluster.actor_trainer.model)
    )
    step = learner._run_global_step

    def step_end(*a, **kw):
        out = step(*a, **kw)
        times["end"].append(time.perf_counter())
        return out

    learner._run_global_step = step_end

    rng = np.random.default_rng(0)
    data = [
        {"prompts": np.array([f"{a}+{b}=" for a, b in rng.integers(10, 100, (args.prompts, 2))])}
        for _ in range(total + 2)
    ]
    start = time.perf_counter()
    learner.train(data)
    per_step = np.diff(np.concatenate([[start], times["end"]]))
    if len(per_step) != total:
        raise RuntimeError(f"tunix ran {len(per_step)} steps, expected {total}")
    measured = slice(args.warmup, None)
    result = {
        "tunix": importlib.metadata.version("google-tunix"),
        "jax": jax.__version__,
        "model": {
            "embed": args.embed,
            "layers": args.layers,
            "mlp (dense SwiGLU)": args.mlp,
            "vocab": args.vocab,
            "params": num_params,
        },
        "loop": {
            "prompts_per_step": args.prompts,
            "group": args.group,
            "max_prompt_len": prompt_len,
            "new_tokens": args.new_tokens,
            "optimizer": "adam 1e-4 (0.9, 0.999)",
            "rollout_engine": "vanilla",
            "warmup_steps": args.warmup,
        },
        "trainer_steps_per_s": round(float(1.0 / np.median(per_step[measured])), 3),
        "median_train_ms": round(float(np.median(times["train"][measured])) * 1e3, 2),
        "median_rollout_ms": round(float(np.median(times["rollout"][measured])) * 1e3, 2),
        "first_step_s (incl. compile)": round(float(per_step[0]), 3),
        "first_step_train_s": round(float(times["train"][0]), 3),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            per_step_lists = {
                "per_step_s": per_step.tolist(),
                "per_step_rollout_s": times["rollout"],
                "per_step_train_s": times["train"],
            }
            json.dump({**result, **per_step_lists}, f, indent=1)


if __name__ == "__main__":
    main()

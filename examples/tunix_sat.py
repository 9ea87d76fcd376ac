"""SAT inside tunix: tunix's own GRPO learner, with ``policy_loss_fn="sat"``.

Needs google-tunix (``pip install "sat-jax[tunix]"``, in an environment without the ``hf`` extra;
``make test-tunix`` builds one). Runs on CPU:

    python examples/tunix_sat.py --steps 4 --num-iterations 2

The model is tunix's own test transformer with its mock vocabulary, randomly initialised, so that
nothing is downloaded; a real run builds its model, tokenizer and mesh the tunix way and changes
nothing else. The only SAT-specific lines are the import of ``sat_jax.integrations.tunix`` (which
registers the objectives in tunix's registry) and ``policy_loss_fn``. ``num_iterations`` > 1 is
what gives the ratio π_θ / π_old room to move: with one update per batch it is 1 and no trust
region acts.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common

import sat_jax.integrations.tunix  # noqa: F401  (registers "sat", "sat_gspo", ...)

PROMPTS = ["input string", "hello world", "My name", "hello there"]
TARGET = "Tunix"
SAT_METRICS = ("sat/q", "sat/binding_rate")


def reward(prompts, completions, **kwargs):
    """How often the completion says the target word (a task the tiny model can learn)."""
    del prompts, kwargs
    return [float(c.split().count(TARGET)) for c in completions]


def build(
    policy_loss_fn: str = "sat",
    *,
    num_iterations: int = 2,
    steps: int = 4,
    batch_size: int = 2,
    learning_rate: float = 0.1,
    max_tokens: int = 8,
    seed: int = 0,
):
    """The tiny model and tunix's GRPO learner with ``policy_loss_fn``; returns (learner, data)."""
    vocab = test_common.MockVocab()
    config = test_common.ModelConfig(vocab_size=vocab.GetPieceSize(), num_layers=1)
    actor = test_common.ToyTransformer(config=config, rngs=nnx.Rngs(seed))
    # One device, with the axis names the test model's partitioning uses; Auto axes (the Mesh
    # default), as tunix's models expect.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(learning_rate),
            eval_every_n_steps=10**6,
            max_steps=steps * num_iterations,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=max_tokens,
            max_prompt_length=8,
            kv_cache_size=64,
            temperature=1.0,
            seed=seed,
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=None, tokenizer=vocab, cluster_config=cluster_config
    )
    algo_config = grpo_learner.GRPOConfig(
        policy_loss_fn=policy_loss_fn,
        num_generations=2,
        num_iterations=num_iterations,
        beta=0.0,
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=algo_config, reward_fns=reward
    )
    if policy_loss_fn in ("sat", "sat_gspo"):
        # tunix logs only the aux entries it is told to: add SAT's quantile and binding rate.
        learner.rl_cluster.actor_trainer.with_rl_metrics_to_log(
            {name: np.mean for name in ("kl", "pg_clipfrac", *SAT_METRICS)}
        )
    rng = np.random.default_rng(seed)
    data = [{"prompts": rng.choice(PROMPTS, size=batch_size)} for _ in range(steps)]
    return learner, data


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", default="sat", help="tunix policy_loss_fn (default: sat)")
    parser.add_argument("--steps", type=int, default=4, help="batches (default: 4)")
    parser.add_argument("--num-iterations", type=int, default=2, help="updates per batch")
    args = parser.parse_args(argv)
    learner, data = build(args.loss, num_iterations=args.num_iterations, steps=args.steps)
    learner.train(data)
    history = learner.rl_cluster.actor_trainer.metrics_logger
    logged = ("loss", *SAT_METRICS) if args.loss in ("sat", "sat_gspo") else ("loss",)
    print(f"{args.loss}, {args.steps} batches x {args.num_iterations} updates:")
    for name in logged:
        values = history.get_metric_history("actor", name, "train")
        print(f"  {name:18s} {np.round(values, 4).tolist()}")


if __name__ == "__main__":
    main()

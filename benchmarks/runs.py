"""Many small runs as one program: a vmapped run axis vs the same runs one after another.

SPEC ("Small-scale studies on a CPU") suggests running seeds and methods as one compiled program
over a leading run axis. This measures what that buys for the built-in default model and
batch (``sat_jax.config.defaults``: 16 prompts × 8 samples, 230k-parameter MoE): per R runs,
the device work of one study step (rollout: prefill + decode to the end; then one trainer step),
either

* ``sequential``: R calls of the jitted single-run sampler and trainer step, or
* ``vmapped``: one call of ``jax.vmap`` of each over stacked parameters, keys, optimizer states
  and batches.

Host work (tokenising, rewards) scales with R in both and is left out. The weights are the
untrained initialisation (no warm-up): decode then runs to the full length in both modes, which
is the work being compared. Prints one JSON object. Run: ``python benchmarks/runs.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import _results
import jax
import jax.numpy as jnp
from _timing import median_seconds

from sat_jax import config as config_lib
from sat_jax import parallel
from sat_jax.rl import trainer
from sat_jax.sampling import SamplingParams
from sat_jax.train import learner


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="1,2,4,8", help="comma-separated run counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step")
    parser.add_argument("--group", type=int, default=None, help="samples per prompt")
    args = parser.parse_args()

    config = config_lib.get_config()
    config.workdir = tempfile.mkdtemp()
    config.sft.steps = 0
    config.mesh.data = 1
    if args.prompts:
        config.rollout.prompts_per_step = args.prompts
    if args.group:
        config.rollout.group_size = args.group
    parts = learner.build(config)
    engine, sampler = parts.engine, parts.engine.sampler
    mesh = parallel.make_mesh(1)
    examples = [parts.train_src[i] for i in range(config.rollout.prompts_per_step)]
    tokens, mask, widths = sampler._layout(*engine.encode(examples))
    sampling = SamplingParams(
        jnp.float32(engine.sampling.temperature),
        jnp.float32(engine.sampling.top_p),
        jnp.int32(engine.sampling.top_k),
    )
    steps = jnp.int32(sampler.max_new_tokens)

    def generate(params, key):
        state = sampler._prefill_impl(params, tokens, mask, widths, key, sampling)
        return sampler._decode_impl(params, state, steps, jnp.int32(0))

    single_generate = jax.jit(generate)
    batched_generate = jax.jit(jax.vmap(generate))
    step = trainer.make_train_step(
        parts.graphdef,
        parts.optimizer,
        parts.spec,
        prompt_width=config.data.max_prompt_len,
        mesh=mesh,
    )
    batched_step = jax.jit(jax.vmap(step, in_axes=(0, 0, None)))
    # One scored batch, reused by every run: the trainer's work does not depend on its values.
    out = engine.generate(parts.params, examples, jax.random.key(0), 0)
    batch = engine.score(examples, out).shard(mesh)

    results = {}
    for runs in [int(r) for r in args.runs.split(",")]:
        params = [
            jax.tree.map(lambda x, r=r: x * (1 + 0.01 * r), parts.params) for r in range(runs)
        ]
        keys = list(jax.random.split(jax.random.key(1), runs))
        states = [
            parallel.replicate(trainer.init_train_state(p, parts.optimizer), mesh) for p in params
        ]
        stacked_params, stacked_keys, stacked_states = (
            _stack(params),
            jnp.stack(keys),
            _stack(states),
        )
        stacked_batch = jax.tree.map(lambda v, runs=runs: jnp.stack([v] * runs), batch)

        def sequential(params=params, keys=keys, states=states):
            rollouts = [single_generate(p, k) for p, k in zip(params, keys, strict=True)]
            return rollouts, [step(s, batch, {}) for s in states]

        def vmapped(p=stacked_params, k=stacked_keys, s=stacked_states, b=stacked_batch):
            return batched_generate(p, k), batched_step(s, b, {})

        seq = median_seconds(sequential, repeats=args.repeats)
        vec = median_seconds(vmapped, repeats=args.repeats)
        results[str(runs)] = {
            "sequential_ms": round(seq * 1e3, 1),
            "vmapped_ms": round(vec * 1e3, 1),
            "vmapped_ms_per_run": round(vec * 1e3 / runs, 1),
            "speedup": round(seq / vec, 2),
        }

    out = {
        "benchmark": "runs",
        "device": f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores)",
        "jax": jax.__version__,
        "batch": f"{config.rollout.prompts_per_step} prompts x {config.rollout.group_size} "
        f"samples, {config.data.max_new_tokens} new tokens",
        "study_step": results,
    }
    print(json.dumps(out, indent=1))
    _results.write("runs", out)


if __name__ == "__main__":
    main()

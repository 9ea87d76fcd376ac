"""One process of the multi-host test: 3 sharded trainer steps on a fixed global batch.

Usage: python _worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz CACHE_DIR
With NUM_PROCESSES == 1 it is the single-process reference over the same global batch.
"""

import sys

import jax

process_id, num_processes, port, out_path, cache_dir = sys.argv[1:6]
process_id, num_processes = int(process_id), int(num_processes)
if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

from sat_jax import config as config_lib  # noqa: E402
from sat_jax import parallel  # noqa: E402

parallel.maybe_initialize_distributed(
    "on" if num_processes > 1 else "off", f"127.0.0.1:{port}", num_processes, process_id
)

import numpy as np  # noqa: E402

from sat_jax.rl import trainer  # noqa: E402
from sat_jax.train import learner  # noqa: E402


def main():
    c = config_lib.get_config()
    c.model.hidden_size, c.model.num_layers, c.model.num_heads = 32, 1, 2
    c.model.num_kv_heads, c.model.head_dim = 1, 16
    c.model.num_experts, c.model.num_experts_per_tok, c.model.moe_intermediate_size = 4, 2, 16
    c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
    c.data.max_new_tokens = 4
    c.sft.steps, c.sft.batch_size, c.sft.cache_dir = 3, 16, cache_dir
    parts = learner.build(c)
    # The same global batch in every process: rolled out on this process's own first device from
    # a process-local view of the (replicated) parameters, with a fixed key.
    local = jax.tree.map(lambda x: x.addressable_shards[0].data, parts.params)
    examples = [parts.train_src[i] for i in range(c.rollout.prompts_per_step)]
    out = parts.engine.generate(local, examples, jax.random.key(123), 0)
    batch = parts.engine.score(examples, out)
    # A barely trained policy solves nothing (all advantages 0, zero gradient); fixed advantages
    # make the three steps move the parameters.
    batch = batch.replace(
        advantages=np.random.default_rng(0).normal(size=batch.advantages.shape).astype(np.float32)
    )
    rows = batch.size // jax.process_count()
    lo = jax.process_index() * rows
    mine = batch.select(slice(lo, lo + rows))
    step = trainer.make_train_step(
        parts.graphdef,
        parts.optimizer,
        parts.spec,
        prompt_width=c.data.max_prompt_len,
        mesh=parts.mesh,
    )
    state = trainer.init_train_state(parts.params, parts.optimizer)
    for _ in range(3):
        # Each process checks its own rows; they agree on the shared-prompt program.
        share = trainer.shares_prompt(mine, parts.spec, c.data.max_prompt_len)
        assert share, "the sampler's groups share their prompts"
        state, metrics = step(state, mine.shard(parts.mesh), {}, share=share)
    params = parallel.to_host(state.params)
    leaves = jax.tree_util.tree_leaves(params)
    if jax.process_index() == 0:
        np.savez(out_path, *leaves, loss=np.asarray(parallel.to_host(metrics["loss/total"])))
    print(
        f"process {jax.process_index()}/{jax.process_count()} devices={jax.device_count()} ok",
        flush=True,
    )


main()

"""The real-model task configs: their state fits a chip of the slice they name, their train step
compiles on a fake mesh of that slice, and the same files with a tiny random model and a
tokenizer made here (no download) run a few steps end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tiny_models import train_bpe_tokenizer

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (sat_jax[tasks])")
pytest.importorskip("tokenizers", reason="needs the tokenizers package (sat_jax[hf])")

from sat_jax import config as config_lib  # noqa: E402
from sat_jax import parallel  # noqa: E402
from sat_jax.config.validation import loss_spec  # noqa: E402
from sat_jax.models import config_from_hf, graphdef_for  # noqa: E402
from sat_jax.rl import trainer  # noqa: E402
from sat_jax.rl.batch import RolloutBatch  # noqa: E402
from sat_jax.train import learner  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
GIB = 2**30


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_bytes(tree) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def test_qwen3_countdown_fits_a_v6e8_chip():
    """Full-depth state bytes a chip from the shardings, plus XLA's scratch of the step compiled
    with two blocks at the config's rows and tokens a chip, plus one saved bf16 residual per
    further block (full remat): within the chip's HBM."""
    module = _load("qwen3_countdown")
    c, chip = module.get_config(), module.SLICE
    assert chip["chips"] == jax.device_count() == c.mesh.fsdp * c.mesh.data

    def model(**hf):
        return dataclasses.replace(
            config_from_hf(dict(c.hf_config_reference) | hf),
            dtype=jnp.bfloat16,
            remat=c.model.remat,
            attention_chunk=c.model.attention_chunk,
        )

    full, two = model(), model(num_hidden_layers=2, max_window_layers=2)
    mesh = parallel.make_mesh(num_data=c.mesh.data, fsdp=c.mesh.fsdp)
    optimizer = trainer.make_optimizer(c.optim.learning_rate, b1=c.optim.b1, b2=c.optim.b2)
    state = trainer.abstract_train_state(full, optimizer, mesh)
    params = _device_bytes(state.params)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    assert 3.9e9 < n_params < 4.1e9
    # parameters, gradients, Adam moments (in the state), and the lag's stale fp32 copy
    persistent = _device_bytes(state) + 2 * params

    rows = c.rollout.prompts_per_step * c.rollout.group_size // c.optim.num_minibatches
    width = c.data.max_prompt_len + c.data.max_new_tokens
    spec = dataclasses.replace(loss_spec(c), logprob_chunk=c.loss.logprob_chunk)
    step = trainer.make_train_step(
        graphdef_for(two), optimizer, spec, prompt_width=c.data.max_prompt_len, mesh=mesh
    )
    batch = RolloutBatch.abstract(
        mesh,
        rows=rows,
        prompt_width=c.data.max_prompt_len,
        response_width=c.data.max_new_tokens,
        num_moe_layers=two.num_moe_layers,
        experts_per_tok=two.num_experts_per_tok,
    )
    compiled = step.lower(trainer.abstract_train_state(two, optimizer, mesh), batch, {}).compile()
    mem = compiled.memory_analysis()
    scratch = mem.temp_size_in_bytes if mem is not None else 0
    residuals = (full.num_layers - 2) * rows // chip["chips"] * width * full.hidden_size * 2
    total = persistent + scratch + residuals
    assert persistent < 12 * GIB
    assert total < chip["hbm_gib"] * GIB, (persistent / GIB, scratch / GIB, residuals / GIB)


def test_qwen3_30b_a3b_math_state_fits_a_v6e64_chip():
    """The full model's state a chip on the config's 64-device mesh (an abstract mesh: shardings
    only), with the stale copy and the KL reference, plus an estimate of the activations of one
    update (a bf16 [tokens, d] residual per block, and six fp32 [rows, chunk, vocab] buffers of
    the chunked LM head). The compiled step on this mesh is ``benchmarks/scale.py``'s."""
    module = _load("qwen3_30b_a3b_math")
    c, chip = module.get_config(), module.SLICE
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor)
    assert math.prod(sizes) == chip["chips"]
    mesh = jax.sharding.AbstractMesh(
        sizes, parallel.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    full = dataclasses.replace(config_from_hf(dict(c.hf_config_reference)), dtype=jnp.bfloat16)
    optimizer = trainer.make_optimizer(c.optim.learning_rate, b1=c.optim.b1, b2=c.optim.b2)
    state = trainer.abstract_train_state(full, optimizer, mesh)
    params = _device_bytes(state.params)
    persistent = _device_bytes(state) + 3 * params  # + gradients, stale copy, KL reference
    assert 10 * GIB < persistent < 12 * GIB  # docs/scaling.md's table: 10.9 GiB
    rows = c.rollout.prompts_per_step * c.rollout.group_size // c.optim.num_minibatches
    rows //= c.mesh.data * c.mesh.fsdp
    tokens = rows * (c.data.max_prompt_len + c.data.max_new_tokens)
    residuals = full.num_layers * tokens * full.hidden_size * 2
    head = 6 * rows * c.loss.logprob_chunk * full.vocab_size * 4
    assert persistent + residuals + head < chip["hbm_gib"] * GIB


@pytest.mark.parametrize(
    "name, mesh, evaluate",
    [("qwen3_countdown", None, True), ("qwen3_30b_a3b_math", {"fsdp": 2, "expert": 4}, False)],
)
def test_config_runs_a_few_steps_with_a_tiny_random_model(name, mesh, evaluate, tmp_path):
    from sat_jax.data import user_prompt
    from sat_jax.data.reasoning_gym_source import reasoning_gym_sources

    c = _load(name).get_config()
    c.workdir = str(tmp_path / "run")
    c.data.rg.train_size, c.data.eval_size, c.eval.num_prompts = 16, 4, 4
    train, held_out, _ = reasoning_gym_sources(c.data)
    texts = [user_prompt(ex["prompt"]) + ex["target"] for ex in (*train, *held_out)]
    os.makedirs(tmp_path / "tokenizer")
    # the generated prompts' fixed wording becomes a few tokens: short prompts for the tiny runs
    c.data.tokenizer = train_bpe_tokenizer(tmp_path / "tokenizer", texts * 4, vocab_size=1024)
    # The tiny random policy of the defaults instead of the checkpoint; the rest of the file as is.
    defaults = config_lib.get_config().model
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        c.model[key] = defaults[key]
    c.model.hf_path = ""
    c.model.attention_chunk = 0
    if mesh:
        c.mesh.fsdp, c.mesh.expert = mesh["fsdp"], mesh["expert"]
    c.data.max_prompt_len, c.data.max_new_tokens = 128, 8
    c.rollout.prompts_per_step, c.rollout.group_size = 8, 2
    c.optim.num_minibatches = 2
    c.loss.logprob_chunk = 0
    # One file evaluates (held-out rewards through the same scorer); the other only trains.
    c.num_steps, c.eval.every, c.checkpoint.every = 2, 2 if evaluate else 0, 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    try:
        config_lib.validate(c, num_devices=jax.device_count())
    except config_lib.ConfigError as e:
        if "task|jsonl|tfds," in str(e):
            pytest.skip("config validation does not accept data.source=reasoning_gym yet")
        raise
    summary = learner.train(c, quiet=True)
    assert summary["end_step"] == 2
    for row in summary["history"]:
        assert np.isfinite(row["loss/total"]) and 0.0 <= row["train/reward_mean"] <= 1.0
    if evaluate:  # 4 held-out prompts × 2 samples, 0/1 rewards
        final = summary["final_eval"]
        assert 0.0 <= final["pass@1"] <= 1.0 and final["pass@1"] * 8 == round(final["pass@1"] * 8)

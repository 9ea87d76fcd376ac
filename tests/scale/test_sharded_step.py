"""The trainer step on (data, fsdp, expert, tensor) meshes of 8 fake CPU devices (conftest.py).

* A train step on a small MoE (one MoE and one dense block) equals the single-device step, for
  data 8; data 2 × fsdp 2 × expert 2; fsdp 2 × expert 2 × tensor 2.
* Per-device parameter + optimizer bytes are total / (fsdp · expert · tensor), except the
  replicated norms and router.
* A mesh that does not divide the model or the batch is one ValueError naming axis and dimension.
* The step's HLO: no all-gather on a data-only mesh; on an FSDP mesh only parameter-shaped
  all-gathers (the SAT loss's statistics stay scalar psums, nothing token-sized is gathered).
* A 2-block model of Qwen3-30B-A3B's widths compiles its train step abstractly.
* Chunked attention (``attention_chunk``) on the tensor-split mesh equals the same reference.
* The shared-prompt program (``LossSpec.prompt_group``) on a sharded mesh equals the plain step.
"""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tiny_models import mixed_moe

from sat_jax import parallel
from sat_jax.models import (
    ModelConfig,
    abstract_params,
    graphdef_for,
    init_model,
    logical_axes,
    param_path,
    param_shardings,
    token_logprobs,
)
from sat_jax.rl import trainer
from sat_jax.rl.batch import RolloutBatch

CFG = mixed_moe(init_std=0.1)
B, P_W, N = 8, 3, 5  # rows, prompt width, response width
MESHES = {
    "data8": dict(num_data=8),
    "data2_fsdp2_expert2": dict(num_data=2, fsdp=2, expert=2),
    "fsdp2_expert2_tensor2": dict(num_data=1, fsdp=2, expert=2, tensor=2),
}
CHUNKED = "fsdp2_expert2_tensor2+attention_chunk3"
SPEC = trainer.LossSpec(objective="sat", objective_kwargs=(("eps_low", 0.2), ("eps_high", 0.2)))
# SGD with momentum: its state is parameter-shaped (bytes are checked) and, unlike Adam's first
# step lr·sign(g), it does not amplify float noise on near-zero gradients.
OPT = optax.sgd(0.1, momentum=0.9)
# SAT's q and c± are ratios of log-ratios ~1e-3 that round differently under other blockings.
SENSITIVE = {"loss/sat/q", "loss/sat/c_min", "loss/sat/eps_low_mean", "loss/sat/eps_high_mean"}


def _batch(graphdef, params, rng_seed=0, rows=B):
    rng = np.random.default_rng(rng_seed)
    t = P_W + N
    tokens = rng.integers(2, CFG.vocab_size, (rows, t)).astype(np.int32)
    mask = np.ones((rows, t), bool)
    mask[1, :2] = False  # left padding
    lengths = rng.integers(1, N + 1, rows)
    response_mask = np.arange(N)[None, :] < lengths[:, None]
    mask[:, P_W:] = response_mask
    logp, _, aux = jax.jit(token_logprobs, static_argnames="response_start")(
        graphdef, params, jnp.asarray(tokens), input_mask=jnp.asarray(mask), response_start=P_W
    )
    behavior = np.asarray(logp) + rng.normal(0, 0.05, (rows, N)).astype(np.float32)
    return {
        "tokens": tokens,
        "input_mask": mask,
        "response_mask": response_mask,
        "behavior_logp": np.where(response_mask, behavior, 0.0).astype(np.float32),
        "cutoffs": np.full((rows, N), -np.inf, np.float32),
        "advantages": rng.normal(size=(rows,)).astype(np.float32),
        "routing": np.asarray(aux["routing"]),
    }


def _host_batch(fields) -> RolloutBatch:
    return RolloutBatch(
        **fields,
        versions=np.zeros_like(fields["behavior_logp"], np.int32),
        rewards=np.zeros_like(fields["advantages"]),
    )


def _run(mesh_kwargs, graphdef, batch):
    mesh = parallel.make_mesh(**mesh_kwargs)
    _, params = init_model(CFG, seed=0, mesh=mesh)
    state = trainer.init_train_state(params, OPT, mesh, config=CFG)
    step = trainer.make_train_step(graphdef, OPT, SPEC, prompt_width=P_W, mesh=mesh, donate=True)
    placed = _host_batch(batch).shard(mesh)
    before = {
        "opt": _device_bytes(state.opt_state),
        "shardings": [x.sharding for x in jax.tree.leaves(state)],
    }
    new_state, metrics = step(state, placed, {})
    assert state.opt_state is not None and all(  # the optimizer state was donated
        x.is_deleted() for x in jax.tree.leaves(state.opt_state)
    )
    assert not any(x.is_deleted() for x in jax.tree.leaves(state.params))  # params survive
    return mesh, (state, before), new_state, jax.device_get(metrics)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def batch(model):
    return _batch(*model)


@pytest.fixture(scope="module")
def reference(model, batch):
    _, _, new_state, metrics = _run(dict(num_data=1), model[0], batch)
    return jax.device_get(new_state.params), jax.device_get(new_state.opt_state), metrics


def _device_bytes(tree) -> int:
    dev = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == dev
    )


@pytest.mark.parametrize("name", [*MESHES, CHUNKED])
def test_sharded_step_equals_single_device_and_splits_memory(name, model, batch, reference):
    graphdef = model[0]
    if name == CHUNKED:  # heads split over tensor, queries scanned in chunks of 3 (8 → 9 slots)
        graphdef = graphdef_for(CFG.replace(attention_chunk=3))
    mesh, (state, before), new_state, metrics = _run(MESHES[name.split("+")[0]], graphdef, batch)
    want_params, want_opt, want_metrics = reference
    for k, v in want_metrics.items():
        np.testing.assert_allclose(
            metrics[k], v, rtol=2e-3 if k in SENSITIVE else 2e-5, atol=1e-7, err_msg=k
        )
    chex.assert_trees_all_close(jax.device_get(new_state.params), want_params, rtol=2e-5, atol=1e-7)
    # The momentum trace is the gradient: sharded contractions sum in another order, so compare
    # relative to each gradient's scale (float32 rounding, ~1e-7 of it).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a, b, rtol=2e-5, atol=1e-6 * float(np.max(np.abs(b)))
        ),
        jax.device_get(new_state.opt_state),
        want_opt,
    )

    # Memory: every weight but norms and routers takes 1/(fsdp·expert·tensor) per device, in
    # the parameters, the optimizer state, and the updated state alike.
    shards = math.prod(mesh.shape[a] for a in ("fsdp", "expert", "tensor"))
    flat = jax.tree_util.tree_flatten_with_path(new_state.params)[0]
    replicated = 0
    for path, leaf in flat:
        axes = logical_axes(param_path(path), leaf.ndim)
        local = _device_bytes(leaf)
        if set(axes) <= {"layers", "norm", "router_embed", "router_expert"}:
            assert local == leaf.nbytes, path
            replicated += leaf.nbytes
        else:
            assert local * shards == leaf.nbytes, (path, leaf.sharding)
    total = sum(x.nbytes for x in jax.tree.leaves(new_state.params))
    want = (total - replicated) // shards + replicated
    assert before["opt"] == want  # the momentum trace: one parameter-shaped tree
    for tree in (state.params, new_state.params, new_state.opt_state):
        assert _device_bytes(tree) == want
    # The updated state keeps the layout it came in with (no recompilation next step).
    for a, b in zip(before["shardings"], jax.tree.leaves(new_state), strict=True):
        assert a == b.sharding, (a, b.sharding)


def test_policy_loss_off_the_mesh_is_the_steps_loss(model, batch, reference):
    """``trainer.policy_loss`` without a mesh (what the loop benchmark times) gives the loss and
    metrics the single-device step logged for the same parameters and batch."""
    graphdef, params = model
    host = jax.tree.map(jnp.asarray, _host_batch(batch))
    loss, metrics = jax.jit(
        lambda p, b: trainer.policy_loss(p, b, {}, graphdef=graphdef, spec=SPEC, prompt_width=P_W)
    )(params, host)
    want = reference[2]
    # Without a parameter version the staleness buckets (mismatch/lag_*) are not computed.
    assert set(metrics) == {k for k in want if not k.startswith(("optim/", "mismatch/lag_"))}
    np.testing.assert_allclose(loss, want["loss/total"], rtol=2e-5)
    for k, v in jax.device_get(metrics).items():
        np.testing.assert_allclose(
            v, want[k], rtol=2e-3 if k in SENSITIVE else 2e-5, atol=1e-7, err_msg=k
        )


def test_shared_prompt_step_equals_plain_step(model):
    """Groups of G = 2 rows sharing their prompt slots: the shared-prompt program on data 2 ×
    fsdp 2 × expert 2 (two groups a device) equals the plain single-device step; a batch whose
    groups differ runs the plain program."""
    graphdef, params = model
    fields = _batch(graphdef, params, rng_seed=1)
    tokens, mask = fields["tokens"].copy(), fields["input_mask"].copy()
    tokens[1::2, :P_W], mask[1::2, :P_W] = tokens[::2, :P_W], mask[::2, :P_W]
    fields = _batch_from(graphdef, params, fields, tokens, mask)
    host = _host_batch(fields)
    assert host.shares_prompt(2, P_W)
    _, _, want_state, want = _run(dict(num_data=1), graphdef, fields)

    mesh = parallel.make_mesh(num_data=2, fsdp=2, expert=2)
    spec = dataclasses.replace(SPEC, prompt_group=2)
    state = trainer.init_train_state(init_model(CFG, seed=0, mesh=mesh)[1], OPT, mesh, config=CFG)
    step = trainer.make_train_step(graphdef, OPT, spec, prompt_width=P_W, mesh=mesh)
    new_state, metrics = step(state, host.shard(mesh), {})  # share=None: the step checks
    # The step took the shared program. (Counted by the step itself: jit's own cache counts
    # read 0 now and then in a full xdist run, after the program had run.)
    assert step.calls == {"shared": 1, "plain": 0}
    metrics = jax.device_get(metrics)
    for k, v in want.items():
        np.testing.assert_allclose(
            metrics[k], v, rtol=2e-3 if k in SENSITIVE else 2e-5, atol=1e-7, err_msg=k
        )
    chex.assert_trees_all_close(
        jax.device_get(new_state.params),
        jax.device_get(want_state.params),
        rtol=2e-5,
        atol=1e-7,
    )

    # One prompt token of row 3 changed: group 1 no longer shares, so the plain program runs.
    tokens[3, P_W - 1] = (tokens[3, P_W - 1] + 1) % CFG.vocab_size
    broken = _host_batch(_batch_from(graphdef, params, fields, tokens, mask))
    assert not broken.shares_prompt(2, P_W)
    step(state, broken.shard(mesh), {})
    assert step.calls == {"shared": 1, "plain": 1}
    with pytest.raises(ValueError, match="prompt_group > 1"):
        trainer.make_train_step(graphdef, OPT, SPEC, prompt_width=P_W, mesh=mesh)(
            state, broken.shard(mesh), {}, share=True
        )


def _batch_from(graphdef, params, fields, tokens, mask):
    """``fields`` with new tokens and masks, and the routing a fresh pass on them captures."""
    aux = jax.jit(token_logprobs, static_argnames="response_start")(
        graphdef, params, jnp.asarray(tokens), input_mask=jnp.asarray(mask), response_start=P_W
    )[2]
    return {**fields, "tokens": tokens, "input_mask": mask, "routing": np.asarray(aux["routing"])}


def test_mesh_that_does_not_divide_is_one_clear_error(model, batch):
    with pytest.raises(ValueError, match=r"'expert' \(8\).*num_experts=4"):
        init_model(CFG, mesh=parallel.make_mesh(num_data=1, expert=8))
    with pytest.raises(ValueError, match=r"'tensor' \(4\).*num_kv_heads=2"):
        param_shardings(CFG, parallel.make_mesh(num_data=2, tensor=4))
    mesh = parallel.make_mesh(num_data=4, fsdp=2)
    step = trainer.make_train_step(model[0], OPT, SPEC, prompt_width=P_W, mesh=mesh)
    state = trainer.init_train_state(model[1], OPT, mesh, config=CFG)
    odd = _host_batch(batch).select(slice(0, 6))
    with pytest.raises(ValueError, match=r"'data' \(4\) × 'fsdp' \(2\).*batch size=6"):
        step(state, odd, {})
    with pytest.raises(ValueError, match="tensor"):
        parallel.make_mesh(num_data=1, tensor=0)


def _abstract_state(config, mesh, optimizer):
    return trainer.abstract_train_state(config, optimizer, mesh)


def P_(*a):
    return jax.sharding.PartitionSpec(*a)


def _abstract_batch(config, mesh, rows, t, prompt=P_W):
    return RolloutBatch.abstract(
        mesh,
        rows=rows,
        prompt_width=prompt,
        response_width=t - prompt,
        num_moe_layers=config.num_moe_layers,
        experts_per_tok=config.num_experts_per_tok,
    )


def _all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    shapes = []
    for m in re.finditer(r"=\s+\(?([^=]*?)\)?\s+all-gather(?:-start)?\(", hlo):
        for dims in re.findall(r"\[([\d,]*)\]", m.group(1)):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def test_sharded_sat_step_gathers_no_token_sized_arrays(model):
    rows, t = 16, P_W + 7
    # Data-only mesh: parameters replicated, so the step has no all-gather at all.
    mesh = parallel.make_mesh(num_data=8)
    step = trainer.make_train_step(model[0], OPT, SPEC, prompt_width=P_W, mesh=mesh)
    hlo = (
        step.lower(_abstract_state(CFG, mesh, OPT), _abstract_batch(CFG, mesh, rows, t), {})
        .compile()
        .as_text()
    )
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert re.search(r"all-reduce(?:-start)?\(", hlo), "expected psums of the loss statistics"
    # FSDP mesh: the only all-gathers are of parameters (FSDP gathers weights where used).
    mesh = parallel.make_mesh(num_data=2, fsdp=4)
    step = trainer.make_train_step(model[0], OPT, SPEC, prompt_width=P_W, mesh=mesh)
    hlo = (
        step.lower(_abstract_state(CFG, mesh, OPT), _abstract_batch(CFG, mesh, rows, t), {})
        .compile()
        .as_text()
    )
    allowed = set()
    for leaf in jax.tree.leaves(abstract_params(CFG)):
        allowed |= {tuple(leaf.shape), tuple(leaf.shape[1:])}
    gathered = _all_gather_shapes(hlo)
    assert gathered, "FSDP should all-gather parameters"
    token_dims = {rows, rows // 8, rows // 2, t, t - 1, t - P_W}
    for shape in gathered:
        assert shape in allowed or not (set(shape) & token_dims), shape


def test_qwen3_30b_a3b_width_train_step_compiles_abstractly():
    """Two blocks at Qwen3-30B-A3B's published widths: nothing of that size is allocated. The
    attention in chunks of 8 of the 24 positions, heads split over tensor, as its config runs."""
    config = ModelConfig(
        vocab_size=151_936,
        hidden_size=2048,
        num_layers=2,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        rope_theta=1e6,
        dtype=jnp.bfloat16,
        remat="full",
        attention_chunk=8,
    )
    mesh = parallel.make_mesh(num_data=1, fsdp=2, expert=2, tensor=2)
    optimizer = optax.adam(1e-6)
    graphdef = graphdef_for(config)
    step = trainer.make_train_step(
        graphdef, optimizer, trainer.LossSpec(), prompt_width=8, mesh=mesh
    )
    state = _abstract_state(config, mesh, optimizer)
    compiled = step.lower(state, _abstract_batch(config, mesh, 4, 8 + 16, 8), {}).compile()
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    assert 1.8e9 < n_params < 2.0e9  # 2 × (attention + 128 experts) + embeddings + head
    mem = compiled.memory_analysis()
    if mem is not None:  # per-device arguments: 1/8 of parameters + 2 Adam moments (f32)
        assert mem.argument_size_in_bytes < 1.1 * 3 * 4 * n_params / 8 + 1e8


def test_kv_cache_is_created_sharded():
    from sat_jax.models import init_cache

    mesh = parallel.make_mesh(num_data=2, fsdp=2, tensor=2)
    cache = init_cache(CFG, 8, 16, mesh=mesh)
    chex.assert_shape(cache.k, (CFG.num_layers, 8, 16, CFG.num_kv_heads, CFG.head_dim))
    assert cache.k.sharding.spec == P_(None, ("data", "fsdp"), None, "tensor")
    chex.assert_shape(cache.v.addressable_shards[0].data, (CFG.num_layers, 2, 16, 1, CFG.head_dim))
    with pytest.raises(ValueError, match=r"batch size=6"):
        init_cache(CFG, 6, 16, mesh=mesh)


def test_sampler_decodes_from_sharded_parameters(model):
    """The engine runs on the mesh-sharded parameters as they are (GSPMD), same greedy tokens."""
    from sat_jax.sampling import Sampler, SamplingParams

    graphdef, params = model
    _, sharded = init_model(
        CFG, seed=0, mesh=parallel.make_mesh(num_data=1, fsdp=2, expert=2, tensor=2)
    )
    sampler = Sampler(CFG, max_prompt_len=4, max_new_tokens=4, eos_id=1)
    prompts = np.array([[5, 9, 17, 3], [7, 8, 0, 0]], np.int32)
    lengths = np.array([4, 2], np.int32)
    want = sampler.generate(params, prompts, lengths, jax.random.key(0), SamplingParams(top_k=1))
    got = sampler.generate(sharded, prompts, lengths, jax.random.key(0), SamplingParams(top_k=1))
    chex.assert_trees_all_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    chex.assert_trees_all_equal(np.asarray(got.routing), np.asarray(want.routing))
    chex.assert_trees_all_close(
        np.asarray(got.behavior_logp), np.asarray(want.behavior_logp), rtol=1e-7, atol=1e-5
    )

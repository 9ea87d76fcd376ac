"""Gradient accumulation over micro-batches (``LossSpec.micro_batches``, ``optim.micro_batches``).

k micro-batches give the update of one batch, for every objective of ``sat_jax.losses``: the
batch statistics (SAT's quantile, M2PO's selection, BAPO's bounds, the token-mean denominator,
GSPO's sequence means) are the whole batch's, on one device and on a (data, fsdp, expert) mesh of
8 fake CPU devices; with shared prompts; with the behaviour recompute, the reference KL and the
entropy bonus on; the Switch loss is the mean of the micro-batches' own. Naive accumulation (each
micro-batch its own statistics) differs, so the tests can tell the two apart.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tiny_models import mixed_moe

from sat_jax import parallel
from sat_jax.models import init_model, token_logprobs
from sat_jax.rl import trainer
from sat_jax.rl.batch import RolloutBatch

CFG = mixed_moe(init_std=0.1)
B, P_W, N = 8, 3, 5
OPT = optax.sgd(0.1, momentum=0.9)
# Statistics that are ratios of log-ratios ~1e-3 and round differently under other blockings.
SENSITIVE = ("loss/sat/", "loss/bapo/", "loss/m2po/", "loss/age/")
OBJECTIVES = {
    "sat": (("eps_low", 0.2), ("eps_high", 0.2)),
    "sat_gspo": (),
    "ppo": (),
    "gspo": (),
    "m2po": (("tau", 1e-3),),
    "m2po_gspo": (("tau", 1e-4),),
    "bapo": (),
    "bapo_gspo": (),
    "cispo": (),
    "sapo": (),
    "age_clip": (("kappa", 0.5),),
    "decoupled_ppo": (),
    "dppo": (),
    "tis_pg": (),
}


def _fields(graphdef, params, seed=0, share=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, CFG.vocab_size, (B, P_W + N)).astype(np.int32)
    mask = np.ones((B, P_W + N), bool)
    mask[1, :2] = False
    if share:  # groups of two rows share their prompt slots
        tokens[1::2, :P_W], mask[1::2, :P_W] = tokens[::2, :P_W], mask[::2, :P_W]
    response = np.arange(N)[None, :] < rng.integers(1, N + 1, B)[:, None]
    mask[:, P_W:] = response
    logp, _, aux = jax.jit(token_logprobs, static_argnames="response_start")(
        graphdef, params, jnp.asarray(tokens), input_mask=jnp.asarray(mask), response_start=P_W
    )
    # Behaviour log-probs 0.05-0.3 off: enough mismatch for the clips, masks and bounds to act.
    noise = rng.normal(0, 0.05, (B, N)) * np.linspace(1, 6, B)[:, None]
    behavior = np.where(response, np.asarray(logp) + noise, 0.0).astype(np.float32)
    return RolloutBatch(
        tokens=tokens,
        input_mask=mask,
        response_mask=response,
        behavior_logp=behavior,
        cutoffs=np.full((B, N), -np.inf, np.float32),
        advantages=rng.normal(size=(B,)).astype(np.float32),
        routing=np.asarray(aux["routing"]),
        # Each row 0-3 versions behind a step at version 3 (the age-aware clip reads them).
        versions=np.repeat(np.arange(B)[:, None] % 4, N, axis=1).astype(np.int32),
        rewards=np.zeros((B,), np.float32),
    )


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _step(spec, batch, extra=None, mesh_kwargs=None, cfg=CFG):
    """One update from version 3 on ``mesh_kwargs``' mesh (one device by default)."""
    mesh = parallel.make_mesh(**(mesh_kwargs or dict(num_data=1)))
    graphdef, params = init_model(cfg, seed=0, mesh=mesh)
    state = trainer.init_train_state(params, OPT, mesh, config=cfg)
    state = state._replace(step=jnp.asarray(3, state.step.dtype))
    step = trainer.make_train_step(graphdef, OPT, spec, prompt_width=P_W, mesh=mesh)
    new_state, metrics = step(state, batch.shard(mesh), extra or {})
    return jax.device_get(new_state), jax.device_get(metrics)


def _assert_same(got, want):
    (got_state, got_metrics), (want_state, want_metrics) = got, want
    assert set(got_metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        rtol = 2e-3 if k.startswith(SENSITIVE) else 2e-5
        np.testing.assert_allclose(got_metrics[k], v, rtol=rtol, atol=1e-6, err_msg=k)
    chex.assert_trees_all_close(got_state.params, want_state.params, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_micro_batches_give_the_update_of_one_batch(objective, model):
    spec = trainer.LossSpec(objective=objective, objective_kwargs=OBJECTIVES[objective])
    batch = _fields(*model)
    want = _step(spec, batch)
    assert want[1]["optim/nonfinite"] == 0 and np.isfinite(want[1]["loss/total"])
    # Four micro-batches where a statistic selects tokens (a quantile, a mask, a bound search).
    for k in (2, 4) if objective in ("sat", "m2po", "bapo") else (2,):
        _assert_same(_step(dataclasses.replace(spec, micro_batches=k), batch), want)


def test_the_statistics_are_the_whole_batchs(model):
    """SAT's quantile under micro-batching is the whole batch's, not a micro-batch's: the
    micro-batches' own quantiles differ from it, and naive accumulation gives another update."""
    graphdef, params = model
    spec = trainer.LossSpec(objective="sat", objective_kwargs=OBJECTIVES["sat"])
    batch = _fields(graphdef, params)
    want_state, want = _step(spec, batch)
    _, got = _step(dataclasses.replace(spec, micro_batches=2), batch)
    np.testing.assert_allclose(got["loss/sat/q"], want["loss/sat/q"], rtol=1e-5)
    host = jax.tree.map(jnp.asarray, batch)

    def loss(p, b):
        return trainer.policy_loss(p, b, {}, graphdef=graphdef, spec=spec, prompt_width=P_W)

    halves = [host.select(slice(0, B // 2)), host.select(slice(B // 2, B))]
    qs = [float(jax.jit(loss)(params, h)[1]["loss/sat/q"]) for h in halves]
    assert all(abs(q - float(want["loss/sat/q"])) > 1e-4 for q in qs), (qs, want["loss/sat/q"])
    naive = jax.tree.map(
        lambda *g: sum(g) / 2, *(jax.grad(lambda p, h=h: loss(p, h)[0])(params) for h in halves)
    )
    full = jax.grad(lambda p: loss(p, host)[0])(params)
    gap = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(naive), jax.tree.leaves(full), strict=True)
    )
    assert gap > 1e-4  # the naive update is a different one


@pytest.mark.parametrize(
    "mesh_kwargs",
    [dict(num_data=8), dict(num_data=2, fsdp=2, expert=2)],
    ids=["data8", "data2_fsdp2_expert2"],
)
def test_micro_batches_on_a_mesh_equal_one_device(mesh_kwargs, model):
    """Micro-batches of whole rows over 8 fake devices (every device an equal share of each)."""
    spec = trainer.LossSpec(objective="sat_gspo")
    batch = _fields(*model)
    want = _step(spec, batch)
    k = 8 // (mesh_kwargs["num_data"] * mesh_kwargs.get("fsdp", 1))
    _assert_same(_step(dataclasses.replace(spec, micro_batches=k), batch, None, mesh_kwargs), want)
    with pytest.raises(ValueError, match=r"micro_batches=2: each micro-batch \(4 sequences\)"):
        _step(dataclasses.replace(spec, micro_batches=2), batch, None, dict(num_data=8))


def test_shared_prompts_recompute_reference_and_entropy(model):
    """Groups of two rows sharing their prompts (the shared-prompt program, whole groups in each
    micro-batch), the behaviour recompute (TIS against the recomputed log-probs), the reference
    KL and the entropy bonus: all on, the update of one batch."""
    graphdef, params = model
    batch = _fields(graphdef, params, seed=3, share=True)
    assert batch.shares_prompt(2, P_W)
    spec = trainer.LossSpec(
        objective="sat",
        correction="tis",
        ratio_denominator="recompute",
        kl_coef=0.1,
        entropy_coef=0.01,
        prompt_group=2,
    )
    old = jax.tree.map(lambda x: x * 1.01, params)
    extra = {"old": old, "ref": params}
    want = _step(spec, batch, extra)
    assert {"loss/kl_ref", "loss/entropy_bonus", "mismatch/engine"} <= set(want[1])
    _assert_same(_step(dataclasses.replace(spec, micro_batches=2), batch, extra), want)
    with pytest.raises(ValueError, match="micro_batches=8: the batch of 8 sequences must split"):
        _step(dataclasses.replace(spec, micro_batches=8), batch, extra)


def test_the_switch_loss_is_the_mean_of_the_micro_batches():
    """With the model's load-balancing loss on, the step's gradient is that of the objective on
    the whole batch plus the mean of the two micro-batches' own Switch losses."""
    cfg = CFG.replace(router_aux_loss_coef=0.01)
    graphdef, params = init_model(cfg, seed=0)
    spec = trainer.LossSpec(objective="ppo", router_aux=True, micro_batches=2)
    batch = _fields(graphdef, params, seed=5)
    state, metrics = _step(spec, batch, cfg=cfg)
    host = jax.tree.map(jnp.asarray, batch)
    micro = trainer._split_micro(host, 2, 1)
    parts = [jax.tree.map(lambda x, i=i: x[i], micro) for i in range(2)]
    plain = dataclasses.replace(spec, router_aux=False, micro_batches=1)

    def want_loss(p):
        loss = trainer.policy_loss(
            p, host, {}, graphdef=graphdef, spec=plain, prompt_width=P_W, version=3
        )[0]
        aux = [
            token_logprobs(
                graphdef,
                p,
                m.tokens,
                input_mask=m.input_mask,
                response_start=P_W,
                routing=m.routing,
                cutoffs=m.cutoffs,
            )[2]
            for m in parts
        ]
        return loss + (aux[0]["aux_loss"] + aux[1]["aux_loss"]) / 2

    loss, grads = jax.value_and_grad(want_loss)(params)
    np.testing.assert_allclose(metrics["loss/total"], loss, rtol=2e-5)
    assert float(metrics["loss/router_aux"]) > 0
    # SGD with momentum from zero: the first update is −0.1 · g.
    want_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(state.params, jax.device_get(want_params), rtol=2e-5, atol=1e-6)

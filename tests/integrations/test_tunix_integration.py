"""sat_jax.integrations.tunix inside tunix's own GRPO learner.

Runs only where google-tunix is installed (``make test-tunix`` builds that environment; the main
suite skips this module at collection). The learner runs a few steps of examples/tunix_sat.py's
tiny model with several updates per batch, so that π_θ moves away from the policy that sampled the
batch; a wrapper registered in tunix's registry captures, on every update, the arrays tunix hands
the loss and the loss it gets back, and the tests recompute the loss with ``sat_jax.losses``.
"""

import dataclasses
import importlib.util
import pathlib

import pytest

pytest.importorskip("tunix", reason="needs google-tunix: `make test-tunix` (sat_jax[tunix])")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core, common, function_registry  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

from sat_jax import losses  # noqa: E402
from sat_jax.integrations import tunix as sat_tunix  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tunix_sat.py"
NUM_ITERATIONS = 3
STEPS = 3
CAPTURE = "test_sat_capture"
FIELDS = ("prompt_ids", "completion_ids", "logp", "old_logp", "advantages", "mask", "loss")


def _load_example():
    spec = importlib.util.spec_from_file_location("tunix_sat_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run():
    """The learner's run with the SAT loss; every update's inputs and loss, and tunix's log."""
    captured = []
    sat_loss = function_registry.get_policy_loss_fn("sat")

    def capturing(model, train_example, algo_config, pad_id, eos_id, **kwargs):
        loss, aux = sat_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs)
        logp = sat_tunix.per_token_logps(
            model, train_example, algo_config, pad_id, eos_id, stop_gradient=True
        )
        arrays = (
            train_example.prompt_ids,
            train_example.completion_ids,
            logp,
            train_example.old_per_token_logps,
            train_example.advantages,
            train_example.completion_mask,
            loss,
        )
        jax.debug.callback(
            lambda *a: captured.append(dict(zip(FIELDS, map(np.asarray, a), strict=True))),
            *arrays,
        )
        return loss, aux

    function_registry.register_policy_loss_fn(CAPTURE)(capturing)
    learner, data = _load_example().build(CAPTURE, num_iterations=NUM_ITERATIONS, steps=STEPS)
    learner.train(data)
    logged = learner.rl_cluster.actor_trainer.metrics_logger.get_metric_history(
        "actor", "loss", "train"
    )
    return captured, np.asarray(logged), learner


def _recompute(step, objective="sat"):
    return losses.get(objective)(
        step["logp"],
        step["old_logp"],
        step["advantages"],
        step["mask"],
        aggregation="seq-mean-token-mean",  # tunix's default loss_agg_mode
    )


def test_registers_every_objective_without_replacing_tunix_losses():
    registered = function_registry.default_registry.list_functions("policy_loss_fn")
    for name in losses.names():
        assert sat_tunix.PREFIX + name in registered
    assert {"sat", "sat_gspo"} <= set(registered)
    assert function_registry.get_policy_loss_fn("grpo") is algo_core.grpo_loss_fn
    assert function_registry.get_policy_loss_fn("ppo") is algo_core.ppo_policy_loss_fn
    assert sat_tunix.register_all() == ()
    # GRPOConfig accepts the new names (its check lists only tunix's own algorithms).
    assert grpo_learner.GRPOConfig(policy_loss_fn="sat").policy_loss_fn == "sat"


def test_bad_registrations_name_the_argument():
    with pytest.raises(ValueError, match="alpha"):
        sat_tunix.register("test_sat_bad_alpha", "sat", alpha=1.5)
    with pytest.raises(ValueError, match="bogus"):
        sat_tunix.register("test_sat_bogus", "sat", bogus=1)
    with pytest.raises(ValueError, match="already"):
        sat_tunix.register("grpo", "sat")
    with pytest.raises(KeyError, match="nope"):
        sat_tunix.register("test_sat_nope", "nope")


@pytest.mark.parametrize("mode", sorted(sat_tunix.AGGREGATIONS))
def test_aggregation_modes_match_tunix(mode):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    mask = jnp.asarray([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]])
    ours = losses.aggregate(x, mask, sat_tunix.AGGREGATIONS[mode])
    np.testing.assert_allclose(ours, common.aggregate_loss(x, mask, mode), rtol=1e-6)


def test_learner_loss_is_sat_on_the_arrays_tunix_passes(run):
    captured, logged, _ = run
    assert len(captured) == len(logged) == STEPS * NUM_ITERATIONS
    for step, tunix_loss in zip(captured, logged, strict=True):
        np.testing.assert_allclose(step["loss"], tunix_loss, rtol=1e-6)
        np.testing.assert_allclose(_recompute(step).loss, step["loss"], rtol=1e-5, atol=1e-6)


def test_sat_binds_on_a_later_update(run):
    captured, _, _ = run
    # The first update of each batch starts at π_θ = π_old: ratio 1.
    first = captured[0]
    np.testing.assert_allclose(first["logp"], first["old_logp"], atol=1e-5)
    binding = [float(_recompute(s).metrics["sat/binding_rate"]) for s in captured]
    step = captured[int(np.argmax(binding))]
    assert max(binding) > 0, binding
    # Where SAT binds, its loss is not PPO's: the comparison above could tell them apart.
    assert abs(float(_recompute(step, "ppo").loss) - float(step["loss"])) > 1e-5


def test_gate_off_equals_tunix_grpo_loss_and_gradient(run):
    """Our PPO and SAT at alpha = 1 against tunix's grpo loss and KL term, ratios past the clip."""
    captured, _, learner = run
    step = captured[-1]
    # Spread the old log-probs so that tokens leave [1 - ε, 1 + ε] on both sides.
    noise = np.random.default_rng(1).normal(scale=0.3, size=step["old_logp"].shape)
    example = grpo_learner.TrainExample(
        prompt_ids=jnp.asarray(step["prompt_ids"]),
        prompt_mask=jnp.asarray(step["prompt_ids"] != 0),
        completion_ids=jnp.asarray(step["completion_ids"]),
        completion_mask=jnp.asarray(step["mask"]),
        ref_per_token_logps=jnp.asarray(step["logp"] - np.abs(noise[::-1]), jnp.float32),
        advantages=jnp.asarray(step["advantages"]),
        old_per_token_logps=jnp.asarray(step["old_logp"] + noise, jnp.float32),
    )
    # tunix's KL penalty on, so that its term is compared too.
    config = dataclasses.replace(learner.algo_config, beta=0.04)
    config.temperature = learner.algo_config.temperature
    model = learner.rl_cluster.actor_trainer.model
    graphdef, state = nnx.split(model)
    pad_id = learner.rl_cluster.rollout.pad_id()
    eos_id = learner.rl_cluster.rollout.eos_id()

    def value_and_grad(loss_fn):
        def f(state):
            return loss_fn(nnx.merge(graphdef, state), example, config, pad_id, eos_id)

        return jax.value_and_grad(f, has_aux=True)(state)

    (ref, ref_aux), ref_grad = value_and_grad(algo_core.grpo_loss_fn)
    assert ref_aux["pg_clipfrac"] > 0.1 and ref_aux["kl_loss"] > 0
    gate_off = sat_tunix.policy_loss_fn("sat", alpha=1.0)
    for fn in (function_registry.get_policy_loss_fn(sat_tunix.PREFIX + "ppo"), gate_off):
        (loss, aux), grad = value_and_grad(fn)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
        chex.assert_trees_all_close(grad, ref_grad, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(aux["kl"], ref_aux["kl"], rtol=1e-5)


def test_gspo_loss_algo_is_refused(run):
    captured, _, learner = run
    config = grpo_learner.GRPOConfig(policy_loss_fn="sat", loss_algo="gspo-token")
    with pytest.raises(ValueError, match="loss_algo"):
        function_registry.get_policy_loss_fn("sat")(
            learner.rl_cluster.actor_trainer.model, None, config, 0, 2
        )

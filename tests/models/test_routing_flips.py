"""Routing flip rate (trainer top-k set vs the engine's recorded set, with R3 on or off) and the
engine-only router-noise knob: exactly 0 flips with a float32 engine and no noise, > 0 with
noise; noise changes the chosen experts and nothing else, so replay removes its mismatch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.models import ModelConfig, init_model, routing_flips, token_logprobs
from sat_jax.rl.trainer import routing_flip_share
from sat_jax.sampling import Sampler

P, N = 6, 10
PROMPTS = np.array([[5, 6, 7, 0, 0, 0], [8, 9, 10, 11, 12, 13], [3, 4, 0, 0, 0, 0]] * 2)
LENGTHS = np.array([3, 6, 2] * 2)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny(num_layers=2)
    graphdef, params = init_model(cfg, seed=0)
    return cfg, graphdef, params


@pytest.fixture(scope="module")
def score():
    return jax.jit(token_logprobs, static_argnames=("response_start",))


def _flip_rate(score, graphdef, params, out, replay):
    logp, _, aux = score(
        graphdef,
        params,
        out.tokens,
        input_mask=out.input_mask,
        response_start=P,
        routing=out.routing if replay else None,
    )
    share = routing_flip_share(aux["router_top_k"], out.routing, P)
    mask = np.asarray(out.response_mask)
    return float(np.asarray(share)[mask].mean()), logp


def test_routing_flips_compares_sets():
    chosen = jnp.array([[[1, 2], [3, 0], [0, 1]]])
    recorded = jnp.array([[[2, 1], [3, 1], [0, 1]]])
    np.testing.assert_array_equal(routing_flips(chosen, recorded), [[False, True, False]])
    with pytest.raises(ValueError, match="recorded"):
        routing_flips(chosen, recorded[:, :2])


def test_flip_share_takes_the_slot_that_predicts_each_response_token():
    # One layer, one row, P = 2, N = 3: fed slots 0..3; response column j is predicted at slot
    # P − 1 + j = 1 + j. Slot 0 (a prompt slot) differs and must not count.
    top = jnp.array([[[[0, 1], [0, 1], [2, 3], [0, 1]]]])
    rec = jnp.array([[[[2, 3], [1, 0], [2, 1], [0, 1]]]])
    np.testing.assert_array_equal(routing_flip_share(top, rec, 2), [[0.0, 1.0, 0.0]])
    two_layers = jnp.concatenate([top, rec], axis=0)  # layer 1 agrees with itself
    np.testing.assert_array_equal(
        routing_flip_share(two_layers, jnp.concatenate([rec, rec], 0), 2), [[0.0, 0.5, 0.0]]
    )
    empty = jnp.zeros((0, 1, 4, 2), jnp.int32)
    np.testing.assert_array_equal(routing_flip_share(empty, empty, 2), [[0.0, 0.0, 0.0]])


@pytest.mark.parametrize("replay", [True, False], ids=["r3", "no-r3"])
def test_float32_engine_without_noise_flips_nothing(model, score, replay):
    cfg, graphdef, params = model
    sampler = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1)
    out = sampler.generate(params, PROMPTS, LENGTHS, jax.random.key(0))
    assert int(out.response_mask.sum()) > 0
    rate, _ = _flip_rate(score, graphdef, params, out, replay)
    assert rate == 0.0


def test_router_noise_flips_routing_and_replay_removes_its_mismatch(model, score):
    cfg, graphdef, params = model
    noisy = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1, router_noise=0.05)
    out = noisy.generate(params, PROMPTS, LENGTHS, jax.random.key(0))
    mask = out.response_mask
    rate_r3, logp_r3 = _flip_rate(score, graphdef, params, out, replay=True)
    rate_fresh, logp_fresh = _flip_rate(score, graphdef, params, out, replay=False)
    assert rate_r3 > 0 and rate_fresh > 0
    # Float32 engine, noise only in the choice: replaying the choice reproduces log μ.
    assert float(jnp.max(jnp.abs(logp_r3 - out.behavior_logp) * mask)) < 1e-5
    assert float(jnp.max(jnp.abs(logp_fresh - out.behavior_logp) * mask)) > 1e-3
    # Seeded: the same key gives the same rollout; another key other routing.
    again = noisy.generate(params, PROMPTS, LENGTHS, jax.random.key(0))
    chex.assert_trees_all_equal(again.routing, out.routing)
    other = noisy.generate(params, PROMPTS, LENGTHS, jax.random.key(1))
    assert not np.array_equal(other.routing, out.routing)


def test_zero_noise_is_the_plain_engine_and_bad_noise_is_refused(model):
    cfg, _, params = model
    plain = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1)
    zero = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1, router_noise=0.0)
    a = plain.generate(params, PROMPTS, LENGTHS, jax.random.key(3))
    b = zero.generate(params, PROMPTS, LENGTHS, jax.random.key(3))
    chex.assert_trees_all_equal(a.tokens, b.tokens)
    chex.assert_trees_all_equal(a.behavior_logp, b.behavior_logp)
    for bad in (-0.1, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="router_noise"):
            Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1, router_noise=bad)


def test_float16_engine_runs_end_to_end(model, score):
    cfg, graphdef, params = model
    sampler = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1, dtype=jnp.float16)
    out = sampler.generate(params, PROMPTS, LENGTHS, jax.random.key(0))
    mask = np.asarray(out.response_mask)
    assert mask.sum() > 0 and np.all(np.isfinite(np.asarray(out.behavior_logp)[mask]))
    rate, logp = _flip_rate(score, graphdef, params, out, replay=False)
    d = np.abs(np.asarray(logp) - np.asarray(out.behavior_logp))[mask]
    # Half precision: a real but small engine mismatch.
    assert 0 < d.mean() < 0.1 and 0 <= rate < 0.5

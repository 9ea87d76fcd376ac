"""The rollout engine against the trainer's log-prob path: same numerics + replay gives the same
log-probs (routing R3 and support Eq. 50), bf16 engine vs f32 trainer reproduces routing mismatch
that replay reduces, determinism, chunked decode with parameter swaps, one compile, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.models import ModelConfig, init_model, token_logprobs
from sat_jax.sampling import Sampler, SamplingParams

P, N = 6, 12
PROMPTS = (
    np.array(
        [[5, 6, 7, 0, 0, 0], [8, 9, 10, 11, 12, 13], [3, 4, 0, 0, 0, 0], [20, 21, 22, 23, 0, 0]] * 2
    )
    + np.array([0] * 4 + [30] * 4)[:, None] * (np.arange(6) < 2)[None, :]
)
LENGTHS = np.array([3, 6, 2, 4] * 2)
TRUNCATED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny(num_layers=2)


@pytest.fixture(scope="module")
def params(cfg):
    return init_model(cfg, seed=0)


@pytest.fixture(scope="module")
def sampler32(cfg):
    return Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1)


@pytest.fixture(scope="module")
def sampler16(cfg):
    return Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1, dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def score():
    fn = jax.jit(token_logprobs, static_argnames=("response_start",))

    def run(graphdef, params, out, temperature, replay=True):
        return fn(
            graphdef,
            params,
            out.tokens,
            input_mask=out.input_mask,
            response_start=out.prompt_width,
            routing=out.routing if replay else None,
            cutoffs=out.cutoffs,
            temperature=temperature,
        )

    return run


def _mean_abs(a, b, mask):
    return float(jnp.sum(jnp.abs(a - b) * mask) / jnp.sum(mask))


def test_output_layout(cfg, params, sampler32):
    out = sampler32.generate(params[1], PROMPTS, LENGTHS, jax.random.key(0))
    b = len(LENGTHS)
    chex.assert_shape(out.tokens, (b, P + N))
    assert out.prompt_width == P
    chex.assert_shape([out.behavior_logp, out.cutoffs, out.versions], (b, N))
    chex.assert_shape(out.routing, (cfg.num_moe_layers, b, P + N - 1, cfg.num_experts_per_tok))
    chex.assert_type([out.versions, out.routing], jnp.int32)
    # Prompts are left-aligned against slot P.
    for i, n in enumerate(LENGTHS):
        chex.assert_trees_all_equal(out.tokens[i, P - n : P], PROMPTS[i, :n])
        assert int(jnp.sum(out.input_mask[i, :P])) == n
    chex.assert_trees_all_equal(out.response_mask, out.input_mask[:, P:])
    assert bool(jnp.all(jnp.isneginf(out.cutoffs)))  # no truncation requested
    assert bool(jnp.all(out.behavior_logp <= 0))


@pytest.mark.parametrize("sampling", [SamplingParams(), TRUNCATED], ids=["full", "top-p-top-k"])
def test_same_numerics_with_replay_matches_behavior_logp(params, sampler32, score, sampling):
    graphdef, p = params
    out = sampler32.generate(p, PROMPTS, LENGTHS, jax.random.key(1), sampling)
    logp, _, aux = score(graphdef, p, out, sampling.temperature)
    mask = out.response_mask
    assert int(jnp.sum(mask)) > 0
    diff = jnp.max(jnp.abs(logp - out.behavior_logp) * mask)
    assert float(diff) < 1e-5
    if sampling is TRUNCATED:
        assert bool(jnp.all(jnp.isfinite(out.cutoffs) | ~mask))
        # Without the replayed support the trainer scores the full vocabulary instead.
        full, _, _ = jax.jit(token_logprobs, static_argnames=("response_start",))(
            graphdef,
            p,
            out.tokens,
            input_mask=out.input_mask,
            response_start=P,
            routing=out.routing,
            temperature=sampling.temperature,
        )
        assert _mean_abs(full, out.behavior_logp, mask) > 1e-2


def test_bf16_engine_routing_mismatch_and_replay(cfg, params, sampler16, score):
    graphdef, p = params
    out = sampler16.generate(p, PROMPTS, LENGTHS, jax.random.key(2))
    with_replay, _, _ = score(graphdef, p, out, 1.0, replay=True)
    without, _, aux = score(graphdef, p, out, 1.0, replay=False)
    fed = out.input_mask[:, :-1][None]
    flipped = jnp.any(jnp.sort(aux["routing"], -1) != jnp.sort(out.routing, -1), -1) & fed
    assert int(jnp.sum(flipped)) > 0  # the bf16 engine routes some tokens differently
    mask = out.response_mask
    d_replay = _mean_abs(with_replay, out.behavior_logp, mask)
    d_fresh = _mean_abs(without, out.behavior_logp, mask)
    assert 0 < d_replay < d_fresh


def test_determinism_chunking_and_versions(params, sampler32):
    _, p = params
    key = jax.random.key(3)
    one = sampler32.generate(p, PROMPTS, LENGTHS, key, TRUNCATED, version=4)
    again = sampler32.generate(p, PROMPTS, LENGTHS, key, TRUNCATED, version=4)
    chex.assert_trees_all_equal(one.tokens, again.tokens)
    chex.assert_trees_all_equal(one.behavior_logp, again.behavior_logp)
    # Chunks of 5 with the same parameters but new versions: same tokens, versions per chunk.
    state = sampler32.init(p, PROMPTS, LENGTHS, key, TRUNCATED)
    version = 4
    while not sampler32.is_done(state):
        state = sampler32.decode(p, state, num_steps=5, version=version)
        version += 1
    chunked = sampler32.finalize(state)
    chex.assert_trees_all_equal(chunked.tokens, one.tokens)
    chex.assert_trees_all_close(chunked.behavior_logp, one.behavior_logp, rtol=1e-7, atol=1e-6)
    expected = np.repeat([4, 5, 6], 5)[:N]
    chex.assert_trees_all_equal(chunked.versions, np.where(one.response_mask, expected, -1))
    other = sampler32.generate(p, PROMPTS, LENGTHS, jax.random.key(4), TRUNCATED)
    assert not np.array_equal(other.tokens, one.tokens)


def test_parameter_swap_between_chunks(params, sampler32, score):
    graphdef, p = params
    p_new = jax.tree.map(lambda x: x * 1.5, p)
    state = sampler32.init(p, PROMPTS, LENGTHS, jax.random.key(5))
    state = sampler32.decode(p, state, num_steps=4, version=0)
    state = sampler32.decode(p_new, state, num_steps=N, version=1)
    out = sampler32.finalize(state)
    np.testing.assert_array_equal(out.versions[:, :4], 0)
    chex.assert_trees_all_equal(out.versions[:, 4:], jnp.where(out.response_mask[:, 4:], 1, -1))
    # Tokens of the first chunk were sampled from the old parameters: the trainer agrees there.
    logp_old, _, _ = score(graphdef, p, out, 1.0)
    chex.assert_trees_all_close(logp_old[:, :4], out.behavior_logp[:, :4], rtol=1e-7, atol=1e-5)


def test_one_compile_per_shape(params, sampler32):
    _, p = params
    p2 = jax.tree.map(lambda x: x + 0.01, p)
    calls = [(p, SamplingParams()), (p2, TRUNCATED), (p, SamplingParams(2.0))]
    # Samplers of the same configuration share compilations, so other tests may have compiled
    # this batch shape already: count what these three calls add.
    before = sampler32._prefill._cache_size(), sampler32._decode._cache_size()
    for i, (pp, sp) in enumerate(calls):
        sampler32.generate(
            pp, PROMPTS[:, : 4 + i % 3], np.minimum(LENGTHS, 4), jax.random.key(i), sp, version=i
        )
    assert sampler32._prefill._cache_size() - before[0] <= 1
    assert sampler32._decode._cache_size() - before[1] <= 1


def test_samplers_of_one_configuration_share_compilations(cfg):
    def make(**kw):
        return Sampler(cfg, **{"max_prompt_len": 8, "max_new_tokens": 6, "eos_id": 1, **kw})

    a, b = make(), make()
    assert a._prefill is b._prefill and a._decode is b._decode
    c = make(max_new_tokens=7)
    assert c._decode is not a._decode
    d = make(dtype=jnp.bfloat16)
    assert d._decode is not a._decode


def test_eos_stops_and_pads(cfg, params):
    _, p = params
    greedy = SamplingParams(top_k=1)
    probe = Sampler(cfg, max_prompt_len=4, max_new_tokens=4, eos_id=1, pad_id=0)
    first = probe.generate(p, PROMPTS[:2, :4], np.array([3, 4]), jax.random.key(0), greedy)
    eos = int(first.tokens[0, 4])  # make row 0's first greedy token the EOS
    sampler = Sampler(cfg, max_prompt_len=4, max_new_tokens=4, eos_id=eos, pad_id=0)
    out = sampler.generate(p, PROMPTS[:2, :4], np.array([3, 4]), jax.random.key(0), greedy)
    assert int(out.response_lengths[0]) == 1 and int(out.tokens[0, 4]) == eos
    np.testing.assert_array_equal(out.tokens[0, 5:], 0)
    np.testing.assert_array_equal(out.response_mask[0], [1, 0, 0, 0])
    np.testing.assert_array_equal(out.versions[0], [0, -1, -1, -1])
    np.testing.assert_array_equal(out.behavior_logp[0, 1:], 0.0)
    # Greedy: the sampled token carries the whole (top-1) mass.
    chex.assert_trees_all_close(out.behavior_logp[0, 0], 0.0, rtol=1e-7, atol=1e-6)


def test_bad_input_raises_value_errors(cfg, params, sampler32):
    _, p = params
    key = jax.random.key(0)
    too_long = np.ones((2, P + 1), np.int32)
    with pytest.raises(ValueError, match="prompts"):
        sampler32.init(p, too_long, np.array([P + 1, 2]), key)
    with pytest.raises(ValueError, match="prompts"):
        sampler32.init(p, np.where(np.arange(6) == 0, cfg.vocab_size, PROMPTS), LENGTHS, key)
    with pytest.raises(ValueError, match="prompts"):
        sampler32.init(p, -PROMPTS - 1, LENGTHS, key)
    with pytest.raises(ValueError, match="prompt_lengths"):
        sampler32.init(p, PROMPTS, np.zeros_like(LENGTHS), key)
    # Slots past a prompt's length are padding and are not checked.
    sampler32.init(p, np.where(np.arange(6) == 5, -7, PROMPTS), np.minimum(LENGTHS, 5), key)
    with pytest.raises(ValueError, match="prompt_lengths"):
        sampler32.init(p, PROMPTS, LENGTHS[:3], key)
    with pytest.raises(ValueError, match="temperature"):
        sampler32.init(p, PROMPTS, LENGTHS, key, SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="eos_id"):
        Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=cfg.vocab_size)


def test_a_tokens_key_depends_on_its_row_and_position_only(params, sampler32):
    """Row n, position j draws with fold_in(fold_in(key, n), j): the first rows of a batch sample
    what they sample alone, and a per-row length limit stops a row without moving the others."""
    _, p = params
    key = jax.random.key(6)
    full = sampler32.generate(p, PROMPTS, LENGTHS, key, TRUNCATED)
    head = sampler32.generate(p, PROMPTS[:4], LENGTHS[:4], key, TRUNCATED)
    chex.assert_trees_all_equal(head.tokens, full.tokens[:4])
    chex.assert_trees_all_close(head.behavior_logp, full.behavior_logp[:4], rtol=1e-7, atol=1e-6)
    limits = np.array([1, 3, N, 2, N, N, 5, 4])
    cut = sampler32.generate(p, PROMPTS, LENGTHS, key, TRUNCATED, max_lengths=limits)
    want = np.minimum(np.asarray(full.response_lengths), limits)
    chex.assert_trees_all_equal(cut.response_lengths, want)
    keep = np.arange(N)[None, :] < want[:, None]
    chex.assert_trees_all_equal(
        np.where(keep, cut.response_tokens, -1), np.where(keep, full.response_tokens, -1)
    )
    chex.assert_trees_all_equal(cut.versions, np.where(keep, 0, -1))
    with pytest.raises(ValueError, match="max_lengths"):
        sampler32.init(p, PROMPTS, LENGTHS, key, max_lengths=np.full(8, N + 1))

"""The merged decode layout samples what the per-call layout samples: per-row keys against the
batch key, V versions in one vmap'd decode against V decodes, evaluation in large calls against
training-shaped ones, and a short sampled-lag run with evaluations, metric for metric.

The engines here compute in float32. A row's logits depend on the shape of its call only through
kernel choices (the MoE's block size and path follow the token count), which move a bfloat16
engine's logits by its rounding, as calls of different sizes in the per-call layout already do;
at float32 that is far below what could change a sampled token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_system import tiny

from sat_jax.data import CharTokenizer
from sat_jax.models import ModelConfig, init_model
from sat_jax.rl import rollout
from sat_jax.rl.rollout import RolloutEngine
from sat_jax.sampling import Sampler, SamplingParams, sequence_keys
from sat_jax.study.grid import method_config
from sat_jax.train import learner

P, N, G = 8, 10, 2
TOKENIZER = CharTokenizer()


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny(
        num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8
    )


@pytest.fixture(scope="module")
def params(cfg):
    # Three parameter versions: the same tree, different values.
    return [init_model(cfg, seed=s)[1] for s in range(3)]


def _sampler(cfg, noise=0.0):
    return Sampler(
        cfg,
        max_prompt_len=P,
        max_new_tokens=N,
        eos_id=TOKENIZER.eos_id,
        pad_id=TOKENIZER.pad_id,
        dtype=jnp.float32,
        router_noise=noise,
    )


def _prompts(texts):
    rows = [t for t in texts for _ in range(G)]
    return TOKENIZER.batch_encode(rows, pad_to=P)


def _row(out, i):
    """Row ``i`` of a ``SampleOutput`` (routing's batch axis is 1, every other field's 0)."""
    return out._replace(
        **{
            name: np.asarray(a)[:, i : i + 1] if name == "routing" else np.asarray(a)[i : i + 1]
            for name, a in out._asdict().items()
        }
    )


def _same_samples(got, want):
    """Tokens, masks, versions and routing exactly; log-probs and cut-offs to float rounding."""
    for name in ("tokens", "input_mask", "versions", "routing", "response_lengths"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name in ("behavior_logp", "cutoffs"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5)


def test_per_row_keys_draw_what_the_batch_key_draws(cfg, params):
    """Rows of two batches (keys a, b) shuffled into one call with their sequence keys."""
    sampler, sp = _sampler(cfg), SamplingParams(0.9, top_p=0.95)
    ka, kb = jax.random.key(3), jax.random.key(4)
    ids_a, len_a = _prompts(["12+3=", "4*56="])
    ids_b, len_b = _prompts(["7-1=", "99+99=", "5="])
    want_a = sampler.generate(params[0], ids_a, len_a, ka, sp, 7, group_size=G)
    want_b = sampler.generate(params[0], ids_b, len_b, kb, sp, 7, group_size=G)
    # Groups b2, a0, b0, a1, b1: every group's G rows stay together.
    order = [("b", 2), ("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    src = {"a": (ids_a, len_a, ka), "b": (ids_b, len_b, kb)}
    rows = [(name, grp * G + s) for name, grp in order for s in range(G)]
    ids = np.stack([src[name][0][r] for name, r in rows])
    lengths = np.array([src[name][1][r] for name, r in rows])
    keys = jnp.stack([sequence_keys(src[name][2], [r])[0] for name, r in rows])
    got = sampler.generate(params[0], ids, lengths, keys, sp, 7, group_size=G)
    want = {"a": want_a, "b": want_b}
    for i, (name, r) in enumerate(rows):
        _same_samples(_row(got, i), _row(want[name], r))


def test_per_row_keys_refuse_router_noise_and_a_wrong_count(cfg, params):
    ids, lengths = _prompts(["1=", "2="])
    keys = sequence_keys(jax.random.key(0), np.arange(4))
    with pytest.raises(ValueError, match="router_noise"):
        _sampler(cfg, noise=0.5).generate(params[0], ids, lengths, keys, group_size=G)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        _sampler(cfg).generate(params[0], ids, lengths, keys[:3], group_size=G)


@pytest.mark.parametrize("noise", [0.0, 0.7])
def test_versions_in_one_decode_equal_one_decode_each(cfg, params, noise):
    sampler, sp = _sampler(cfg, noise), SamplingParams(1.0, top_k=20)
    texts = [["12+3=", "8*8="], ["31-4=", "1="], ["655+1=", "2*3="]]
    keys = [jax.random.key(10 + i) for i in range(3)]
    versions = [5, 2, 9]
    encoded = [_prompts(t) for t in texts]
    got = sampler.generate_versions(
        params,
        np.stack([e[0] for e in encoded]),
        np.stack([e[1] for e in encoded]),
        jnp.stack(keys),
        sp,
        versions,
        group_size=G,
    )
    assert got.tokens.shape == (3, 2 * G, P + N)
    for i in range(3):
        want = sampler.generate(params[i], *encoded[i], keys[i], sp, versions[i], group_size=G)
        _same_samples(jax.tree.map(lambda a, i=i: a[i], got), want)
    with pytest.raises(ValueError, match="leading axis of 3"):
        sampler.generate_versions(params, encoded[0][0][None], encoded[0][1][None], jnp.stack(keys))


def _engine(cfg):
    def reward(text, example):  # depends on the whole completion, so any differing token shows
        return float(sum(map(ord, text)) % 3 == 0)

    return RolloutEngine(
        sampler=_sampler(cfg),
        tokenizer=TOKENIZER,
        reward_fn=reward,
        group_size=G,
        sampling=SamplingParams(1.0),
    )


def test_evaluation_in_large_calls_equals_training_shaped_calls(cfg, params, monkeypatch):
    """11 prompts of 3 lengths, batches of 4 (the last one padded) against calls of 3 prompts
    sorted by length (the last one padded too)."""
    engine = _engine(cfg)
    examples = [
        {"prompt": p, "level": str(len(p))}
        for p in "1+2= 33*4= 5= 123+45= 9-8= 7= 60*61= 2+2= 8= 41-1= 0=".split()
    ]
    key = jax.random.key(21)
    # An untrained model's responses are malformed under the decoding rule (PAD/BOS before EOS:
    # all score 0); this test is about which row gets which sample, so it reads every row's raw
    # text, and any token that differs between the layouts changes a reward.
    response = lambda out: np.asarray(out.tokens)[:, engine.sampler.max_prompt_len :]  # noqa: E731
    engine.completions = lambda out: [
        TOKENIZER.decode(row[row < TOKENIZER.vocab_size]) for row in response(out)
    ]
    monkeypatch.setattr(rollout, "DECODE_LAYOUT", "per_call")
    assert not engine.merges_rows
    want = rollout.evaluate(engine, params[1], examples, 4, key, version=3)
    monkeypatch.setattr(rollout, "DECODE_LAYOUT", "merged")
    monkeypatch.setattr(rollout, "EVAL_ROWS_PER_CALL", 3 * G)
    assert engine.merges_rows
    got = rollout.evaluate(engine, params[1], examples, 4, key, version=3)
    assert got == want
    assert 0 < want["pass@1"] < 1 and len([k for k in want if k.startswith("pass@1/")]) == 5


def test_short_sampled_lag_run_logs_the_same_metrics(tmp_path, monkeypatch):
    """The staleness preset, shrunk: sampled lag (several versions per batch) and evaluations.
    GSPO, not SAT: with a float32 engine every |log r| is rounding noise, and SAT's statistics
    rank that noise."""

    def run(layout, versions="per_version"):
        monkeypatch.setattr(rollout, "DECODE_LAYOUT", layout)
        monkeypatch.setattr(rollout, "VERSIONS_LAYOUT", versions)
        c = tiny(
            method_config("gspo", "stale_sort"), tmp_path / f"{layout}-{versions}", tmp_path / "sft"
        )
        c.num_steps = 4
        c.lag_mode, c.lag, c.lag_dist, c.lag_cap = "sampled", 2, "zipf", 3
        c.rollout.prompts_per_step = 6
        c.eval.every, c.eval.num_prompts = 2, 10
        c.rollout.dtype = "float32"
        summary = learner.train(c, quiet=True)
        return summary["history"], summary["final_eval"]

    monkeypatch.setattr(rollout, "EVAL_ROWS_PER_CALL", 16)
    want_history, want_eval = run("per_call")
    assert max(h["rollout/versions"] for h in want_history) >= 2
    for got_history, got_eval in (run("merged"), run("merged", "vmapped")):
        assert got_eval == pytest.approx(want_eval, abs=1e-6)
        for got, want in zip(got_history, want_history, strict=True):
            for name, value in want.items():
                if not name.startswith(("time/", "throughput/")):
                    assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), name

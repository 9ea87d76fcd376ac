"""Parity with the reference PyTorch implementation in ``transformers``.

Tiny random Qwen3-MoE / Qwen3 models are built and saved by ``transformers`` (float32, CPU, small
shards so the index path is used), loaded by ``sat_jax.models.load_hf`` and compared on the same
tokens: logits to 1e-4, top-k routing exactly. ``save_hf`` output is reloaded by ``transformers``
and must reproduce its logits. The R3 replay path and the sampler then run on the loaded model.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip(
    "torch", reason="HF parity tests need torch (pip install torch==2.13.0, a CPU build)"
)
transformers = pytest.importorskip(
    "transformers", reason="HF parity tests need transformers (pip install 'sat_jax[hf]')"
)

from sat_jax.models import load_hf, save_hf, token_logprobs  # noqa: E402
from sat_jax.sampling import Sampler, SamplingParams  # noqa: E402

VOCAB, B, T = 128, 2, 12
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)
_MOE = dict(_SMALL, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)

CASES = {
    # norm_topk_prob on, the second block dense via mlp_only_layers.
    "moe_norm_topk_mlp_only": ("qwen3_moe", dict(_MOE, norm_topk_prob=True, mlp_only_layers=[1])),
    # full-softmax gates, every block MoE, tied embeddings.
    "moe_softmax_gates_tied": (
        "qwen3_moe",
        dict(_MOE, norm_topk_prob=False, tie_word_embeddings=True),
    ),
    # decoder_sparse_step = 2: block 0 dense, block 1 MoE.
    "moe_sparse_step": ("qwen3_moe", dict(_MOE, norm_topk_prob=True, decoder_sparse_step=2)),
    "dense_qwen3": ("qwen3", dict(_SMALL)),
}


def _hf_model(model_type: str, fields: dict, seed: int):
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**fields)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**fields)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        # Randomise everything (norm weights included, which HF initialises to 1) so that a wrong
        # name or layout anywhere changes the logits; routers at a scale where top-k is decisive.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def _hf_forward(model, tokens: np.ndarray, mask: np.ndarray | None = None):
    ids = torch.from_numpy(tokens.astype(np.int64))
    kwargs = {}
    if mask is not None:
        m = torch.from_numpy(mask.astype(np.int64))
        kwargs = dict(attention_mask=m, position_ids=torch.clamp(torch.cumsum(m, -1) - 1, min=0))
    with torch.no_grad():
        if isinstance(model, transformers.Qwen3MoeForCausalLM):
            kwargs["output_router_logits"] = True
        out = model(ids, **kwargs)
    routers = [r.numpy() for r in (getattr(out, "router_logits", None) or ())]
    return out.logits.numpy(), routers


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    name = request.param
    model_type, fields = CASES[name]
    model = _hf_model(model_type, fields, seed=len(name))
    src = tmp_path_factory.mktemp(f"{name}_hf")
    model.save_pretrained(src, max_shard_size="40KB")  # several shards + index
    return name, model, src


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, (B, T)).astype(np.int32)


def _forward(graphdef, params, tokens, mask):
    return jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, input_mask=m))(params, tokens, mask)


def _check_routing(routers, ours, k, valid):
    """HF top-k (from its router logits) equals our captured routing as sets, on valid tokens
    whose k-th and (k+1)-th logits are not near-tied (ties could flip on 1e-7 differences)."""
    assert len(routers) == ours.shape[0]
    for layer, z in enumerate(routers):
        z = z.reshape(B, T, -1)
        top = np.sort(np.argsort(-z, axis=-1)[..., :k], axis=-1)
        srt = np.sort(z, axis=-1)[..., ::-1]
        decisive = (srt[..., k - 1] - srt[..., k] > 1e-5) & valid
        assert decisive.mean() > 0.8 * valid.mean()
        chex.assert_trees_all_equal(
            top[decisive], np.sort(np.asarray(ours[layer]), axis=-1)[decisive]
        )


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_logits_routing_and_resave_match_transformers(case, tokens, tmp_path):
    name, model, src = case
    assert (src / "model.safetensors.index.json").exists()
    config, graphdef, params = load_hf(src)
    assert config.num_layers == 2
    mask = np.ones((B, T), bool)
    if name == "moe_norm_topk_mlp_only":
        mask[1, :3] = False  # left padding: positions from the mask, padding never attended
    ref_logits, routers = _hf_forward(model, tokens, None if mask.all() else mask)
    out = _forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask))
    got = np.asarray(out.logits)
    chex.assert_trees_all_close(got[mask], ref_logits[mask], rtol=0, atol=1e-4)
    _check_routing(routers, out.routing, config.num_experts_per_tok, mask)
    if name == "dense_qwen3":
        assert config.num_moe_layers == 0 and out.routing.shape[0] == 0

    dst = tmp_path / "resaved"
    save_hf(dst, config, params, max_shard_size="30KB")
    assert (dst / "model.safetensors.index.json").exists()
    reloaded, info = type(model).from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    resaved_logits, _ = _hf_forward(reloaded.eval(), tokens, None if mask.all() else mask)
    chex.assert_trees_all_close(resaved_logits[mask], ref_logits[mask], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["moe_norm_topk_mlp_only"], indirect=True)
def test_sampler_and_r3_replay_on_loaded_model(case):
    _, model, src = case
    config, graphdef, params = load_hf(src)
    prompts = np.array([[5, 9, 17, 33, 0], [7, 8, 0, 0, 0]], np.int32)
    lengths = np.array([4, 2], np.int32)
    sampler = Sampler(config, max_prompt_len=5, max_new_tokens=4, eos_id=1, pad_id=0)

    # Greedy decoding equals transformers' greedy generate on the same prompt.
    greedy = sampler.generate(
        params, prompts[:1, :4], lengths[:1], jax.random.key(0), SamplingParams(top_k=1)
    )
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompts[:1, :4].astype(np.int64)),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=1,
            pad_token_id=0,
        )
    n = int(greedy.response_lengths[0])
    chex.assert_trees_all_equal(
        np.asarray(greedy.response_tokens[0, :n]), ref.numpy()[0, 4 : 4 + n]
    )

    # Sampled rollout: trainer log-probs with replayed routing equal the behavior log-probs.
    out = sampler.generate(params, prompts, lengths, jax.random.key(1), SamplingParams(1.0))
    logp, _, aux = jax.jit(
        lambda p, t, m, r: token_logprobs(
            graphdef, p, t, input_mask=m, response_start=out.prompt_width, routing=r
        )
    )(params, out.tokens, out.input_mask, out.routing)
    rm = np.asarray(out.response_mask)
    assert rm.sum() > 0
    chex.assert_trees_all_close(
        np.asarray(logp)[rm], np.asarray(out.behavior_logp)[rm], rtol=0, atol=1e-5
    )
    # Replay used exactly the recorded experts.
    chex.assert_trees_all_equal(np.asarray(aux["routing"]), np.asarray(out.routing))

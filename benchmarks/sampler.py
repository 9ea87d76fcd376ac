"""Rollout-engine and log-prob throughput of the tiny MoE model on this machine; prints JSON.

Measures, in one run (jitted, block_until_ready, median of repeats after a warm-up call):

* decode tokens/s with the KV cache (``Sampler.decode``) against a decoder that recomputes the
  whole prefix each step (one full forward over the fixed [B, P + N] buffer per generated token,
  the only way to avoid a recompile per length), and their ratio;
* the training log-prob pass (``token_logprobs`` with routing and support replay): forward, and
  forward + backward, in tokens/s;
* achieved FLOP/s of that forward (XLA's cost analysis of the compiled program divided by the
  measured time) as a fraction of a plain float32 ``jnp.dot`` matmul's FLOP/s measured here;

The engines on spread-out response lengths (continuous against static, and transformers'
``generate``) are ``benchmarks/engines.py``'s.

Usage: ``python benchmarks/sampler.py [--batch 8] [--prompt 16] [--new 128] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_seconds
from flax import nnx

from sat_jax.models import (
    ModelConfig,
    init_model,
    param_count,
    scale_logits,
    token_logprobs,
)
from sat_jax.sampling import Sampler, SamplingParams


def _flops(jitted, *args, **kwargs) -> float:
    cost = jitted.lower(*args, **kwargs).compile().cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul", type=int, default=1024)
    args = ap.parse_args()
    b, p, n = args.batch, args.prompt, args.new

    cfg = ModelConfig.tiny()
    graphdef, params = init_model(cfg, seed=0)
    device = f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()})"
    # No token id is the EOS, so every run decodes exactly n steps.
    sampler = Sampler(cfg, max_prompt_len=p, max_new_tokens=n, eos_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(0)
    lengths = rng.integers(p // 2, p + 1, size=b)
    prompts = rng.integers(2, cfg.vocab_size - 1, size=(b, p))
    key = jax.random.key(0)
    state0 = sampler.init(params, prompts, lengths, key, SamplingParams())

    # --- KV-cache decode.
    t_cache = median_seconds(lambda: sampler.decode(params, state0, n).tokens, repeats=args.repeats)
    steps = int(sampler.decode(params, state0, n).step)

    # --- Baseline: recompute the full (padded) prefix at every step, same sampling.
    @jax.jit
    def decode_no_cache(params, tokens, mask, key):
        def body(i, carry):
            tokens, mask = carry
            model = nnx.merge(graphdef, params)
            logits = model(tokens, input_mask=mask).logits  # [B, P + N, V]
            slot = p - 1 + i
            last = jax.lax.dynamic_index_in_dim(logits, slot, axis=1, keepdims=False)
            y = jax.random.categorical(jax.random.fold_in(key, i), scale_logits(last, 1.0))
            tokens = jax.lax.dynamic_update_slice_in_dim(
                tokens, y[:, None].astype(jnp.int32), slot + 1, 1
            )
            mask = jax.lax.dynamic_update_slice_in_dim(mask, jnp.ones((b, 1), bool), slot + 1, 1)
            return tokens, mask

        return jax.lax.fori_loop(0, n, body, (tokens, mask))[0]

    t_full = median_seconds(
        lambda: decode_no_cache(params, state0.tokens, state0.input_mask, key),
        repeats=args.repeats,
    )

    # --- Training log-prob pass with replay, forward and forward + backward.
    out = sampler.finalize(sampler.decode(params, state0, n))
    lp_kwargs = dict(
        input_mask=out.input_mask, response_start=p, routing=out.routing, cutoffs=out.cutoffs
    )
    fwd = jax.jit(lambda prm: token_logprobs(graphdef, prm, out.tokens, **lp_kwargs)[0])

    def loss(prm):
        return -jnp.sum(token_logprobs(graphdef, prm, out.tokens, **lp_kwargs)[0])

    fwd_bwd = jax.jit(jax.value_and_grad(loss))
    t_fwd = median_seconds(lambda: fwd(params), repeats=args.repeats)
    t_fwd_bwd = median_seconds(lambda: fwd_bwd(params), repeats=args.repeats)
    fed_tokens = b * (p + n - 1)
    flops_fwd = _flops(fwd, params)
    flops_fwd_bwd = _flops(fwd_bwd, params)

    # --- Reference: a plain float32 matmul on this machine.
    m = args.matmul
    x = jax.random.normal(jax.random.key(1), (m, m), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (m, m), jnp.float32)
    dot = jax.jit(jnp.dot)
    t_dot = median_seconds(lambda: dot(x, y), repeats=args.repeats)
    dot_flops_s = 2.0 * m**3 / t_dot

    result = {
        "device": device,
        "jax": jax.__version__,
        "model": {
            "config": "ModelConfig.tiny()",
            "params": param_count(params),
            "dtype": str(cfg.dtype),
            "moe_compute": "dense (all experts)",
        },
        "shape": {"batch": b, "prompt_width": p, "new_tokens": n, "repeats": args.repeats},
        "decode": {
            "kv_cache_tokens_per_s": b * steps / t_cache,
            "recompute_prefix_tokens_per_s": b * n / t_full,
            "speedup": (b * steps / t_cache) / (b * n / t_full),
            "kv_cache_seconds": t_cache,
            "recompute_prefix_seconds": t_full,
        },
        "logprob_pass": {
            "fed_tokens": fed_tokens,
            "forward_tokens_per_s": fed_tokens / t_fwd,
            "forward_backward_tokens_per_s": fed_tokens / t_fwd_bwd,
            "forward_flops": flops_fwd,
            "forward_flops_per_s": flops_fwd / t_fwd,
            "forward_backward_flops_per_s": flops_fwd_bwd / t_fwd_bwd,
        },
        "matmul_reference": {"size": m, "flops_per_s": dot_flops_s},
        "note": (
            "FLOPs are XLA cost-analysis counts of the executed programs; the small-scale dense "
            "MoE path computes every expert for every token, i.e. num_experts / "
            "num_experts_per_tok times the routed-expert FLOPs of a dispatching implementation."
        ),
        "mfu_vs_matmul": {
            "forward": flops_fwd / t_fwd / dot_flops_s,
            "forward_backward": flops_fwd_bwd / t_fwd_bwd / dot_flops_s,
        },
    }
    print(json.dumps(result, indent=2))
    import _results  # benchmarks/results/sampler.json, which benchmarks/report.py renders

    _results.write("sampler", result)


if __name__ == "__main__":
    main()

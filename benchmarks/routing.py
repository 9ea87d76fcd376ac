"""Routing mismatch between the rollout engine and the trainer on warm-up-policy rollouts; prints
JSON.

Builds a run config's components (its cached warm-up included), rolls out ``--batches`` batches
of training prompts with the engine (``rollout.dtype``, bfloat16 by default), then scores them
with the float32 trainer twice, routing afresh (no replay) and replaying the engine's routing
(R3, Eq. 40). Reports:

* ``flip_rate_r3_off`` / ``flip_rate_r3_on``: share of token-layers whose trainer top-k expert
  *set* (its own router's choice, ``aux["router_top_k"]``) differs from the one the engine
  recorded, over response tokens (``trainer.routing_flip_share``, the trainer's per-step
  diagnostic), in the forward without and with replay (under replay the trainer's own choice is
  computed from replayed hidden states); ``flip_rate_all_fed`` (R3 off) over every real fed
  token, prompt included; ``tokens_any_flip`` (R3 off): share of response tokens with a flip in
  at least one layer;
* ``d_pi_r3_off`` / ``d_pi_r3_on``: d̄_π = mean |log π_trainer − log μ| over response tokens,
  without and with routing replay (R3 removes the routing part of the engine mismatch; the
  paper reports ≈ 0.0103 → ≈ 0.0058 on its 30B MoE);
* the reward of the rollouts (the policy's pass@1 on those prompts) and response lengths.

With ``--set rollout.dtype=float32`` the engine computes in the trainer's precision: the control
for the dtype's share of the flips (the sampler's cached decode and the trainer's full forward
still differ in reduction order).

Usage: ``python benchmarks/routing.py [--config configs/stale_base.py] [--batches 4]
[--set KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import time

import jax
import numpy as np

from sat_jax.config import validate
from sat_jax.models import param_count, token_logprobs
from sat_jax.models.moe import routing_flips
from sat_jax.rl.trainer import routing_flip_share
from sat_jax.study.grid import apply_override
from sat_jax.train import components

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("run_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(_ROOT, "configs", "stale_base.py"))
    ap.add_argument("--batches", type=int, default=4, help="rollout batches (prompts_per_step x G)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    config = load_config(args.config)
    for item in args.set:
        apply_override(config, item)
    validate(config)
    t0 = time.perf_counter()
    parts = components.build(config)
    build_s = time.perf_counter() - t0
    spec = parts.spec

    @functools.partial(jax.jit, static_argnums=2)
    def score(params, out, replay: bool):
        logp, _, aux = token_logprobs(
            parts.graphdef,
            params,
            out.tokens,
            input_mask=out.input_mask,
            response_start=out.prompt_width,
            routing=out.routing if replay else None,
            cutoffs=out.cutoffs if spec.support_replay else None,
            temperature=spec.temperature,
        )
        top_k = aux["router_top_k"]
        per_token = routing_flip_share(top_k, out.routing, out.prompt_width)  # [B, N]
        flips = routing_flips(top_k, out.routing)  # [L, B, P + N - 1]
        return logp, per_token, flips

    engine, per = parts.engine, config.rollout.prompts_per_step
    keys = ("flips_off", "flips_on", "flips_all", "any_flip", "d_off", "d_on", "tokens", "fed")
    sums = dict.fromkeys(keys, 0.0)
    rewards, lengths = [], []
    t0 = time.perf_counter()
    for i in range(args.batches):
        examples = [parts.train_src[i * per + j] for j in range(per)]
        out = engine.generate(
            parts.params, examples, jax.random.key(config.seed * 1000 + i), version=0
        )
        rewards.append(engine.score(examples, out).rewards)
        mu = np.asarray(out.behavior_logp)
        resp = np.asarray(out.response_mask, np.float64)
        fed = np.asarray(out.input_mask[:, :-1], np.float64)
        for replay, tag in ((False, "off"), (True, "on")):
            logp, per_token, flips = (np.asarray(x) for x in score(parts.params, out, replay))
            sums[f"flips_{tag}"] += float(np.sum(per_token * resp))
            sums[f"d_{tag}"] += float(np.sum(np.abs(logp - mu) * resp))
            if not replay:
                sums["flips_all"] += float(np.sum(flips.mean(axis=0) * fed))
                scoring = flips[:, :, out.prompt_width - 1 :].any(axis=0)
                sums["any_flip"] += float(np.sum(scoring * resp))
        sums["tokens"] += float(resp.sum())
        sums["fed"] += float(fed.sum())
        lengths.append(np.asarray(out.response_lengths))
    lengths = np.concatenate(lengths)
    result = {
        "config": os.path.relpath(args.config, _ROOT),
        "overrides": args.set,
        "task": parts.train_src.name,
        "params": param_count(parts.params),
        "num_experts": config.model.num_experts,
        "top_k": config.model.num_experts_per_tok,
        "moe_layers": parts.model_cfg.num_moe_layers,
        "engine_dtype": config.rollout.dtype,
        "trainer_dtype": config.model.dtype,
        "sequences": int(len(lengths)),
        "response_tokens": int(sums["tokens"]),
        "flip_rate_r3_off": sums["flips_off"] / max(sums["tokens"], 1),
        "flip_rate_r3_on": sums["flips_on"] / max(sums["tokens"], 1),
        "flip_rate_all_fed": sums["flips_all"] / max(sums["fed"], 1),
        "tokens_any_flip": sums["any_flip"] / max(sums["tokens"], 1),
        "d_pi_r3_off": sums["d_off"] / max(sums["tokens"], 1),
        "d_pi_r3_on": sums["d_on"] / max(sums["tokens"], 1),
        "reward_mean": float(np.mean(np.concatenate(rewards))),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": int(lengths.max()),
        "sft": parts.sft_info,
        "build_seconds": build_s,
        "measure_seconds": time.perf_counter() - t0,
        "backend": jax.default_backend(),
    }
    result["d_pi_r3_reduction"] = 1.0 - result["d_pi_r3_on"] / max(result["d_pi_r3_off"], 1e-30)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Routing mismatch between the rollout engine and the trainer on warm-up-policy rollouts; prints
JSON.

Builds a run config's components (its cached warm-up included), rolls out ``--batches`` batches
of training prompts with the engine (``rollout.dtype``, bfloat16 by default), then scores them
with the float32 trainer twice, routing afresh (no replay) and replaying the engine's routing
(R3, Eq. 40). Reports:

* ``flip_rate``: share of token-layers whose trainer top-k expert *set* differs from the one
  the engine recorded, over the fed positions that produce the response's log-probs (the
  response-scoring slots, ``prompt_width - 1`` onwards, while the response lasts);
  ``flip_rate_all_fed`` over every real fed token (prompt included); ``tokens_any_flip``: share
  of response-scoring positions with a flip in at least one layer;
* ``d_pi_r3_off`` / ``d_pi_r3_on``: d̄_π = mean |log π_trainer − log μ| over response tokens,
  without and with routing replay (R3 removes the routing part of the engine mismatch; the
  paper reports ≈ 0.0103 → ≈ 0.0058 on its 30B MoE);
* the reward of the rollouts (the policy's pass@1 on those prompts) and response lengths.

With ``--set rollout.dtype=float32`` the engine and trainer compute in the same precision (the
flip rate should then be ≈ 0; the sampler's decode and the trainer's full forward still differ
in reduction order).

Usage: ``python benchmarks/routing.py [--config configs/stale_base.py] [--batches 4]
[--set KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import jax
import numpy as np

from sat_jax.config import validate
from sat_jax.models import param_count, token_logprobs
from sat_jax.rl import components
from sat_jax.study.grid import apply_override

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("run_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def routing_flips(trainer_routing, engine_routing) -> np.ndarray:
    """[L, B, T] bool: the two top-k expert sets differ (order within the set ignored)."""
    a = np.sort(np.asarray(trainer_routing), axis=-1)
    b = np.sort(np.asarray(engine_routing), axis=-1)
    return np.any(a != b, axis=-1)


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

    @jax.jit
    def score(params, tokens, input_mask, cutoffs, routing):
        logp, _, aux = token_logprobs(
            parts.graphdef,
            params,
            tokens,
            input_mask=input_mask,
            response_start=config.data.max_prompt_len,
            routing=routing,
            cutoffs=cutoffs if spec.support_replay else None,
            temperature=spec.temperature,
        )
        return logp, aux["routing"]

    engine, per = parts.engine, config.rollout.prompts_per_step
    sums = dict(flips=0.0, flips_all=0.0, any_flip=0.0, off=0.0, on=0.0)
    counts = dict(layers=0.0, layers_all=0.0, positions=0.0, tokens=0.0)
    rewards, lengths = [], []
    t0 = time.perf_counter()
    for i in range(args.batches):
        examples = [parts.train_src[i * per + j] for j in range(per)]
        out = engine.generate(
            parts.params, examples, jax.random.key(config.seed * 1000 + i), version=0
        )
        rewards.append(engine.score(examples, out).rewards)
        tokens, input_mask = out.tokens, out.input_mask
        logp_off, fresh = score(parts.params, tokens, input_mask, out.cutoffs, None)
        logp_on, _ = score(parts.params, tokens, input_mask, out.cutoffs, out.routing)
        mu = np.asarray(out.behavior_logp)
        resp = np.asarray(out.response_mask, np.float64)
        flips = routing_flips(fresh, out.routing)  # [L, B, T - 1]
        p = out.prompt_width
        scoring = np.zeros(flips.shape[1:], np.float64)  # slots p-1 .. predict the response
        scoring[:, p - 1 :] = resp
        fed = np.asarray(input_mask[:, :-1], np.float64)
        layers = flips.shape[0]
        sums["flips"] += float(np.sum(flips * scoring))
        sums["flips_all"] += float(np.sum(flips * fed))
        sums["any_flip"] += float(np.sum(flips.any(axis=0) * scoring))
        sums["off"] += float(np.sum(np.abs(np.asarray(logp_off) - mu) * resp))
        sums["on"] += float(np.sum(np.abs(np.asarray(logp_on) - mu) * resp))
        counts["layers"] += layers * float(scoring.sum())
        counts["layers_all"] += layers * float(fed.sum())
        counts["positions"] += float(scoring.sum())
        counts["tokens"] += float(resp.sum())
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
        "response_tokens": int(counts["tokens"]),
        "flip_rate": sums["flips"] / max(counts["layers"], 1),
        "flip_rate_all_fed": sums["flips_all"] / max(counts["layers_all"], 1),
        "tokens_any_flip": sums["any_flip"] / max(counts["positions"], 1),
        "d_pi_r3_off": sums["off"] / max(counts["tokens"], 1),
        "d_pi_r3_on": sums["on"] / max(counts["tokens"], 1),
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

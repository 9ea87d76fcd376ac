"""Checks and figures for a real accelerator (GPU or TPU), run by ``benchmarks/accelerator.sh``.

``--only checks``: the losses sharded over every real device against the same loss on the host
CPU (loss and gradient); the model's log-probs on the device against the CPU; the sampler's
behaviour log-probs on the device against the CPU trainer's log-probs of the same tokens (routing
replayed, float32). Each prints its largest difference and whether it is within tolerance.

``--only trainer``: the trainer step (GRPO, Adam) on a Qwen3-MoE-shaped model with random weights
(``--size 0.6b``: 8 blocks of 64 experts, top-8, hidden 1024, about 0.7B parameters of which about
0.16B active a token; ``smoke``: ``ModelConfig.tiny``): compile time, median step time, tokens/s and
model FLOP utilisation (6 × active parameters × tokens over the step time and the device's peak
bfloat16 FLOP/s, where the device kind is known).

Prints one JSON object per part and writes it as ``device_<part>`` like every benchmark
(``_results``: ``benchmarks/results/`` or ``$SAT_JAX_BENCH_RESULTS``), the device named in it.
"""

from __future__ import annotations

import argparse
import json
import time

import _results
import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import losses, parallel
from sat_jax.config import get_config
from sat_jax.config.validation import loss_spec
from sat_jax.models import ModelConfig, init_model, param_count, token_logprobs
from sat_jax.rl import trainer
from sat_jax.rl.batch import RolloutBatch
from sat_jax.sampling import Sampler, SamplingParams

#: Dense bfloat16 peak FLOP/s per device, by a substring of ``device_kind`` (vendor sheets).
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}


def _peak(kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)


def _close(name: str, got, want, tol: float) -> dict:
    diff = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    return {"check": name, "max_abs_diff": diff, "tolerance": tol, "ok": bool(diff <= tol)}


def checks(smoke: bool) -> list[dict]:
    cpu = jax.devices("cpu")[0]
    devices = jax.devices()
    out = []
    # SAT over the real devices (batch split over "data") against one CPU device.
    b, t = (8 * len(devices), 16) if smoke else (256 * len(devices), 512)
    rng = np.random.default_rng(0)
    logp = rng.normal(-1.0, 0.3, (b, t)).astype(np.float32)
    behaviour = (logp + rng.normal(0, 0.05, (b, t))).astype(np.float32)
    adv = rng.normal(size=(b,)).astype(np.float32)
    mask = rng.random((b, t)) < 0.9

    def loss(lp):
        return losses.sat(lp, behaviour, adv, mask).loss

    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
    spec = jax.sharding.PartitionSpec("data")

    def sharded(lp, bh, a, m):
        def local(lp, bh, a, m):
            return losses.sat(lp, bh, a, m, axis_name="data").loss

        out_spec = jax.sharding.PartitionSpec()
        return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=out_spec)(
            lp, bh, a, m
        )

    with jax.default_device(cpu):
        want, want_g = jax.jit(jax.value_and_grad(loss))(logp)
    placed = jax.device_put((logp, behaviour, adv, mask), jax.sharding.NamedSharding(mesh, spec))
    got, got_g = jax.jit(jax.value_and_grad(sharded))(*placed)
    out.append(_close("sat_loss_sharded_vs_cpu", got, want, 1e-5))
    out.append(_close("sat_grad_sharded_vs_cpu", got_g, want_g, 1e-6))
    # The model's log-probs, float32, on the device and on the CPU.
    cfg = ModelConfig.tiny(num_layers=2)
    graphdef, params = init_model(cfg, seed=0)
    tokens = rng.integers(3, cfg.vocab_size, (8, 48)).astype(np.int32)
    fn = jax.jit(token_logprobs, static_argnums=0, static_argnames="response_start")
    dev_logp = fn(graphdef, params, tokens, response_start=16)[0]
    with jax.default_device(cpu):
        cpu_params = jax.device_put(params, cpu)
        cpu_logp = fn(graphdef, cpu_params, jax.device_put(tokens, cpu), response_start=16)[0]
    out.append(_close("model_logprobs_device_vs_cpu", dev_logp, cpu_logp, 2e-4))
    # The sampler on the device, scored by the CPU trainer pass with its routing replayed.
    sampler = Sampler(cfg, max_prompt_len=16, max_new_tokens=32, eos_id=1)
    prompts = rng.integers(3, cfg.vocab_size, (16, 16)).astype(np.int32)
    sample = sampler.generate(
        params, prompts, np.full((16,), 16), jax.random.key(1), SamplingParams(1.0), group_size=1
    )
    with jax.default_device(cpu):
        s = jax.device_put(sample, cpu)
        scored = fn(
            graphdef,
            cpu_params,
            s.tokens,
            input_mask=s.input_mask,
            response_start=16,
            routing=s.routing,
            cutoffs=s.cutoffs,
        )[0]
    m = np.asarray(s.response_mask)
    out.append(
        _close(
            "sampler_logp_device_vs_cpu_trainer",
            np.asarray(sample.behavior_logp)[m],
            np.asarray(scored)[m],
            5e-4,
        )
    )
    return out


def _model(size: str) -> ModelConfig:
    if size == "smoke":
        return ModelConfig.tiny(num_layers=2)
    return ModelConfig(
        vocab_size=32768,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        dtype=jnp.bfloat16,
        remat="full",
    )


def trainer_step(size: str, repeats: int) -> dict:
    cfg = _model(size)
    rows, prompt, response = (8, 8, 8) if size == "smoke" else (64, 256, 768)
    width = prompt + response
    config = get_config()
    config.loss.objective, config.loss.r3, config.loss.correction = "ppo", False, "none"
    spec = loss_spec(config)
    graphdef, params = init_model(cfg, seed=0)
    optimizer = trainer.make_optimizer(1e-6)
    mesh = parallel.make_mesh(len(jax.devices()), jax.devices())
    state = trainer.init_train_state(params, optimizer, mesh, config=cfg)
    rng = np.random.default_rng(0)
    ones = np.ones((rows, response), np.float32)
    batch = RolloutBatch(
        tokens=rng.integers(3, cfg.vocab_size, (rows, width)).astype(np.int32),
        input_mask=np.ones((rows, width), bool),
        response_mask=ones > 0,
        behavior_logp=-ones,
        cutoffs=np.full((rows, response), -np.inf, np.float32),
        routing=np.zeros((cfg.num_moe_layers, rows, width - 1, cfg.num_experts_per_tok), np.int32),
        versions=np.zeros((rows, response), np.int32),
        advantages=rng.normal(size=(rows,)).astype(np.float32),
        rewards=np.zeros((rows,), np.float32),
    ).shard(mesh)
    step = trainer.make_train_step(graphdef, optimizer, spec, prompt_width=prompt, mesh=mesh)
    t0 = time.perf_counter()
    state, metrics = step(state, batch, {})
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, {})
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    total = param_count(params)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_moe_layers
    active = total - expert * (cfg.num_experts - cfg.num_experts_per_tok)
    tokens = rows * width
    flops = 6.0 * active * tokens
    kind = jax.devices()[0].device_kind
    peak = _peak(kind)
    return {
        "size": size,
        "params": int(total),
        "active_params": int(active),
        "tokens_per_step": tokens,
        "compile_and_first_step_s": round(compile_s, 2),
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_flops_per_s": flops / step_s,
        "mfu": None if peak is None else flops / step_s / (peak * len(jax.devices())),
        "peak_bf16_per_device": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("checks", "trainer"), required=True)
    ap.add_argument("--size", choices=("smoke", "0.6b"), default="0.6b")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    head = {
        "device": jax.devices()[0].device_kind,
        "devices": len(jax.devices()),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
    }
    if args.only == "checks":
        body = {"checks": checks(args.size == "smoke")}
        body["all_ok"] = all(c["ok"] for c in body["checks"])
    else:
        body = trainer_step(args.size, args.repeats)
    out = {**head, **body}
    print(json.dumps(out, indent=1))
    _results.write(f"device_{args.only}", out)
    if args.only == "checks" and not out["all_ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

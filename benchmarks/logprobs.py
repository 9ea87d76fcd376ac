"""Chunked vs full log-probs: forward + backward time and XLA's compiled temp memory.

Two comparisons, each against the obvious alternative in the same run:

* the LM head + log-softmax alone (``chunked_logprobs`` vs materialising the [B, n, V] logits), at
  vocab-heavy shapes, with top-p support replay and temperature 0.7;
* the whole trainer log-prob pass ``token_logprobs(chunk_size=None)`` vs ``chunk_size=c`` on
  ``ModelConfig.tiny()`` (vocab 128, where chunking has nothing to save: its overhead).

Prints one JSON object. Run from the repository root:
``PYTHONPATH=$PWD python benchmarks/logprobs.py`` (``--quick`` for the smallest shapes only).
Times are medians over interleaved repeats of jitted calls after a warm-up, ``block_until_ready``
included; temp bytes are ``compile().memory_analysis().temp_size_in_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import _results
import jax
import jax.numpy as jnp
from _timing import interleaved_ms, paired_ratio

from sat_jax.models import (
    ModelConfig,
    apply_support_cutoff,
    chunked_logprobs,
    init_model,
    scale_logits,
    token_logprobs,
)
from sat_jax.sampling.truncation import support_cutoff

TEMP = 0.7


def _full(hidden, w, targets, cutoffs):
    logits = jax.lax.dot_general(
        hidden, w.astype(hidden.dtype), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    scaled = apply_support_cutoff(scale_logits(logits, TEMP), cutoffs, keep=targets)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(log_probs)
    return logp, -jnp.sum(p * jnp.where(p > 0, log_probs, 0.0), axis=-1)


def _fwd_bwd(fn):
    def loss(hidden, w, targets, cutoffs):
        logp, ent = fn(hidden, w, targets, cutoffs)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _temp_mib(fn, args) -> float:
    return round(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20, 1)


def head_case(b, n, d, v, chunks, dtype, repeats):
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (b, n, d)).astype(dtype)
    w = jax.random.normal(k[1], (d, v)) / jnp.sqrt(d)
    targets = jax.random.randint(k[2], (b, n), 0, v)
    logits = jnp.einsum("bnd,dv->bnv", hidden.astype(jnp.float32), w)
    cutoffs = support_cutoff(scale_logits(logits, TEMP), top_p=0.9)
    del logits
    args = (hidden, w, targets, cutoffs)
    fns = {"full": _fwd_bwd(_full)}
    for c in chunks:
        fns[f"chunk_{c}"] = _fwd_bwd(
            lambda h, w_, y, cut, c=c: chunked_logprobs(
                h, w_, y, cutoffs=cut, temperature=TEMP, chunk_size=c
            )
        )
    ms, rounds = interleaved_ms(fns, args, repeats)
    return {
        "shape": {"B": b, "n": n, "d": d, "V": v, "dtype": jnp.dtype(dtype).name},
        "logits_mib": round(b * n * v * 4 / 2**20, 1),
        "fwd_bwd_ms": {k_: round(t, 2) for k_, t in ms.items()},
        "temp_mib": {k_: _temp_mib(f, args) for k_, f in fns.items()},
        "time_ratio_vs_full": {k_: paired_ratio(rounds, k_, "full") for k_ in fns if k_ != "full"},
    }


def model_case(batch, length, chunk, repeats):
    cfg = ModelConfig.tiny()
    graphdef, params = init_model(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, cfg.vocab_size)
    start = length // 4
    cutoffs = jnp.full((batch, length - start), -jnp.inf)

    def fwd_bwd(chunk_size):
        def loss(p):
            logp, ent, _ = token_logprobs(
                graphdef,
                p,
                tokens,
                response_start=start,
                cutoffs=cutoffs,
                temperature=TEMP,
                chunk_size=chunk_size,
            )
            return jnp.sum(logp) + 0.01 * jnp.sum(ent)

        return jax.jit(jax.value_and_grad(loss))

    fns = {"full": fwd_bwd(None), f"chunk_{chunk}": fwd_bwd(chunk)}
    ms, rounds = interleaved_ms(fns, (params,), repeats)
    return {
        "model": "ModelConfig.tiny()",
        "shape": {"B": batch, "T": length, "response_start": start, "V": cfg.vocab_size},
        "fwd_bwd_ms": {k: round(t, 2) for k, t in ms.items()},
        "temp_mib": {k: _temp_mib(f, (params,)) for k, f in fns.items()},
        "time_ratio_vs_full": {f"chunk_{chunk}": paired_ratio(rounds, f"chunk_{chunk}", "full")},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smallest head shape only")
    args = parser.parse_args()
    shapes = [(2, 128, 64, 32768, (16, 64), jnp.float32)]
    if not args.quick:
        shapes += [
            (2, 128, 64, 32768, (16, 64), jnp.bfloat16),
            # Qwen3's vocabulary. B·n ≫ d as in training, else ∂W [d, V] alone is logits-sized.
            (2, 128, 32, 151936, (16, 64), jnp.float32),
        ]
    out = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "temperature": TEMP,
        "head": [head_case(*s, repeats=args.repeats) for s in shapes],
    }
    if not args.quick:
        out["model"] = model_case(8, 144, 32, args.repeats)
    print(json.dumps(out, indent=1))
    _results.write("logprobs", out)


if __name__ == "__main__":
    main()

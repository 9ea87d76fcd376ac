"""Qwen3-30B-A3B at the paper's size, proven on a fake CPU mesh: nothing of its size is allocated.

Builds the model from ``configs/qwen3_30b_a3b.py``'s published ``config.json`` abstractly (shapes
only), places it on a mesh of ``--devices`` fake CPU devices, then lowers and compiles

* the trainer step (SAT-GSPO w/ R3, Adam, bf16 compute with fp32 master parameters, remat, the
  dispatching MoE, chunked log-probs) on ``--seqs`` sequences of ``--seq-len`` tokens per batch
  shard, and
* one decode step of the rollout engine (bf16, KV cache of ``--seq-len`` slots),

and prints one JSON object: parameter count; per-device bytes of parameters, gradients and
optimizer state (from the shardings); XLA's compiled memory analysis of both steps; the MoE
layer's FLOPs dense vs dispatching (counted: 6·N·E·d·f against 6·N·k·d·f for the three expert
matmuls, forward); compile seconds; and whether ``jax.export`` of the train step for TPU succeeds.

Run (64 fake devices, minutes on 2 cores)::

    python benchmarks/scale.py                      # fsdp 16 x expert 4 (default)
    python benchmarks/scale.py --mesh 1,64,1,1      # data, fsdp, expert, tensor
    python benchmarks/scale.py --layers 2 --devices 8 --mesh 1,4,2,1   # quick check

The per-device batch is what each (data, fsdp) shard holds; devices along ``expert`` and
``tensor`` share their shard's rows.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=64, help="fake CPU devices")
    p.add_argument("--mesh", default="1,16,4,1", help="data,fsdp,expert,tensor sizes")
    p.add_argument("--seqs", type=int, default=8, help="sequences per (data, fsdp) shard")
    p.add_argument("--seq-len", type=int, default=4096, help="prompt + response tokens")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=0, help="override the depth (0: the model's 48)")
    p.add_argument(
        "--moe-impl",
        default="auto",
        help="MoE path of the compiled train step (auto: blocked on CPU); the TPU "
        "export always uses ragged (grouped matmuls)",
    )
    p.add_argument("--logprob-chunk", type=int, default=512)
    p.add_argument(
        "--attention-chunk",
        type=int,
        default=512,
        help="ModelConfig.attention_chunk of the train step (0: all queries at once)",
    )
    p.add_argument("--no-export", action="store_true", help="skip the TPU export")
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from configs.qwen3_30b_a3b import QWEN3_30B_A3B_CONFIG  # noqa: E402
from sat_jax import parallel  # noqa: E402
from sat_jax.models import cache_spec, config_from_hf  # noqa: E402
from sat_jax.models.transformer import (  # noqa: E402
    graphdef_for,
)
from sat_jax.rl import trainer  # noqa: E402
from sat_jax.rl.batch import RolloutBatch, batch_axes  # noqa: E402
from sat_jax.sampling import Sampler, SamplingParams  # noqa: E402

GIB = 2.0**30


def _device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _total_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {}
    for name in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    ):
        if hasattr(m, name):
            out[name.replace("_in_bytes", "_gib")] = round(getattr(m, name) / GIB, 3)
    return out


def main(args) -> dict:
    data, fsdp, expert, tensor = (int(v) for v in args.mesh.split(","))
    overrides = {
        "remat": "full",
        "moe_impl": args.moe_impl,
        "attention_chunk": args.attention_chunk,
    }
    if args.layers:
        overrides["num_layers"] = args.layers
    cfg = config_from_hf(QWEN3_30B_A3B_CONFIG, dtype=jnp.bfloat16, **overrides)
    mesh = parallel.make_mesh(data, fsdp=fsdp, expert=expert, tensor=tensor)
    optimizer = trainer.make_optimizer(1e-6, b1=0.9, b2=0.98, grad_clip=1.0)
    state = trainer.abstract_train_state(cfg, optimizer, mesh)
    params = state.params
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    opt_bytes = _device_bytes(state.opt_state)
    param_bytes = _device_bytes(params)
    out = {
        "model": "Qwen3-30B-A3B" + (f" (depth {args.layers})" if args.layers else ""),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "mesh": dict(mesh.shape),
        "param_count": n_params,
        "param_count_billions": round(n_params / 1e9, 3),
        "bytes_total_gib": {
            "params_fp32": round(_total_bytes(params) / GIB, 2),
            "grads_fp32": round(_total_bytes(params) / GIB, 2),
            "adam_fp32": round(_total_bytes(state.opt_state) / GIB, 2),
        },
        "bytes_per_device_gib": {
            "params": round(param_bytes / GIB, 3),
            "grads": round(param_bytes / GIB, 3),
            "optimizer": round(opt_bytes / GIB, 3),
        },
    }
    ideal = (2 * _total_bytes(params) + _total_bytes(state.opt_state)) / len(jax.devices())
    out["params_grads_opt_per_device_over_ideal"] = round((2 * param_bytes + opt_bytes) / ideal, 4)

    # ---------------------------------------------------------------- train step
    shards = data * fsdp
    b = args.seqs * shards
    n_resp = args.seq_len - args.prompt_len
    k = cfg.num_experts_per_tok
    batch = RolloutBatch.abstract(
        mesh,
        rows=b,
        prompt_width=args.prompt_len,
        response_width=n_resp,
        num_moe_layers=cfg.num_moe_layers,
        experts_per_tok=k,
    )
    spec_loss = trainer.LossSpec(
        objective="sat_gspo",
        r3=True,
        support_replay=False,
        logprob_chunk=args.logprob_chunk or None,
    )
    step = trainer.make_train_step(
        graphdef_for(cfg),
        optimizer,
        spec_loss,
        prompt_width=args.prompt_len,
        mesh=mesh,
        donate=True,
    )
    t0 = time.perf_counter()
    lowered = step.lower(state, batch, {})
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out["train_step"] = {
        "global_batch": [b, args.seq_len],
        "per_shard_batch": [args.seqs, args.seq_len],
        "tokens_per_device": args.seqs * args.seq_len,
        "lower_s": round(t1 - t0, 1),
        "compile_s": round(t2 - t1, 1),
        "memory": _memory(compiled),
    }
    hlo = compiled.as_text()
    out["train_step"]["all_gather_of_token_arrays"] = _token_all_gathers(hlo, args)

    if not args.no_export:
        try:
            from jax import export

            tpu_cfg = cfg.replace(moe_impl="ragged")
            tpu_step = trainer.make_train_step(
                graphdef_for(tpu_cfg),
                optimizer,
                spec_loss,
                prompt_width=args.prompt_len,
                mesh=mesh,
                donate=True,
            )
            t0 = time.perf_counter()
            exp = export.export(tpu_step.jitted, platforms=["tpu"])(
                *tpu_step.args(state, batch, {})
            )
            out["tpu_export"] = {
                "ok": True,
                "platforms": list(exp.platforms),
                "moe_impl": "ragged",
                "stablehlo_mib": round(len(exp.mlir_module()) / 2**20, 2),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        except Exception as err:  # reported, not raised: the rest of the figures stand
            out["tpu_export"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:400]}

    out["attention_layer"] = _attention_memory(cfg, tensor, args)

    # ---------------------------------------------------------------- decode step
    out["decode_step"] = _decode(cfg, mesh, params, b, args)

    # ---------------------------------------------------------------- MoE FLOPs
    n_tok = args.seqs * args.seq_len
    dense = 6 * n_tok * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
    routed = 6 * n_tok * k * cfg.hidden_size * cfg.moe_intermediate_size
    out["moe_layer_forward_flops_per_shard"] = {
        "how": "counted: 3 expert matmuls of 2·d·f FLOPs per (token, expert) pair",
        "dense_all_experts": dense,
        "dispatching_routed_only": routed,
        "ratio": dense / routed,
    }
    return out


def _attention_memory(cfg, tensor, args) -> dict:
    """XLA's scratch for one layer's attention core, forward + backward, on one device's rows and
    heads (bf16 q, k, v; float32 scores): the plain program autodiff differentiates (it keeps
    the [rows, heads, t, t] weights), the custom VJP taking all queries at once, and in chunks."""
    from sat_jax.models.attention import attend, attend_reference

    kv = cfg.num_kv_heads // tensor
    g, d, t = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, args.seq_len
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    q = jax.ShapeDtypeStruct((args.seqs, t, kv, g, d), jnp.bfloat16, sharding=one)
    k = jax.ShapeDtypeStruct((args.seqs, t, kv, d), jnp.bfloat16, sharding=one)
    allowed = jax.ShapeDtypeStruct((args.seqs, t, t), jnp.bool_, sharding=one)
    out = {
        "rows": args.seqs,
        "tokens": t,
        "heads_per_device": kv * g,
        "temp_gib": {},
        "how": "compiled memory_analysis().temp_size_in_bytes, one device",
    }
    programs = {"plain_autodiff": attend_reference, "custom_vjp_whole": attend}
    if args.attention_chunk:
        programs[f"custom_vjp_chunk_{args.attention_chunk}"] = lambda q, k, v, a: attend(
            q, k, v, a, chunk=args.attention_chunk
        )
    for name, fn in programs.items():

        def loss(q, k, v, a, fn=fn):
            return jnp.sum(fn(q, k, v, a).astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        m = grad.lower(q, k, k, allowed).compile().memory_analysis()
        out["temp_gib"][name] = round(m.temp_size_in_bytes / GIB, 3)
    return out


def _decode(cfg, mesh, params, rows, args) -> dict:
    """One decode step of the bf16 engine: batch over (data, fsdp), KV cache sharded."""
    n_resp = args.seq_len - args.prompt_len
    sampler = Sampler(
        cfg.replace(moe_impl="auto"),
        max_prompt_len=args.prompt_len,
        max_new_tokens=n_resp,
        eos_id=0,
        dtype=jnp.bfloat16,
    )
    i32 = jnp.int32
    t = args.prompt_len + n_resp
    rows_spec = NamedSharding(mesh, P(batch_axes(mesh)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = jax.eval_shape(
        sampler._prefill_impl,
        params,
        jax.ShapeDtypeStruct((rows, t), i32),
        jax.ShapeDtypeStruct((rows, t), jnp.bool_),
        jax.ShapeDtypeStruct((rows,), i32),
        key,
        SamplingParams(
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((), i32),
        ),
    )
    cache = NamedSharding(mesh, cache_spec(mesh))
    routing = NamedSharding(mesh, P(None, batch_axes(mesh)))
    replicated = NamedSharding(mesh, P())

    def place(path, x):
        name = str(getattr(path[0], "name", path[0]))
        if name == "cache":
            sh = cache
        elif name == "routing":
            sh = routing
        elif x.ndim >= 1 and x.shape[0] == rows:
            sh = rows_spec
        else:
            sh = replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    state = jax.tree_util.tree_map_with_path(place, state)
    one = jax.ShapeDtypeStruct((), i32, sharding=replicated)
    t0 = time.perf_counter()
    compiled = jax.jit(sampler._decode_impl).lower(params, state, one, one).compile()
    return {
        "rows": rows,
        "cache_slots": t,
        "compile_s": round(time.perf_counter() - t0, 1),
        "memory": _memory(compiled),
    }


def _token_all_gathers(hlo: str, args) -> int:
    """Count all-gathers whose result has a token-sized dimension (the loss must have none;
    FSDP weight gathers are expected and not counted)."""
    import re

    count = 0
    for line in hlo.splitlines():
        if "all-gather" not in line or "=" not in line:
            continue
        shape = re.search(r"=\s*\w+\[([0-9,]*)\]", line)
        if shape and any(
            int(s) in (args.seq_len - args.prompt_len,) for s in shape.group(1).split(",") if s
        ):
            count += 1
    return count


if __name__ == "__main__":
    import _results  # benchmarks/results/scale.json, which benchmarks/report.py renders

    print(json.dumps(out := main(ARGS), indent=1))
    _results.write("scale", out)

"""Routed-expert benchmark: forward and forward+backward of every ``expert_ffn`` path against the
dense reference (and against transformers' PyTorch ``Qwen3MoeExperts`` on the same weights and
routing, when torch is installed), with XLA's FLOP counts.

Prints one JSON object. Run: ``python benchmarks/moe.py`` (``--repeats 10 --no-torch`` for a quick
run). Shapes: ``tiny`` = ``ModelConfig.tiny()``'s MoE at the peer's log-prob pass (8 × 144
tokens, d 128, 32 experts top-4, f 32); ``default`` = the default run's at the trainer's batch
(128 × 13 tokens, d 64, 16 experts top-4, f 32); ``*_decode`` = one decode step of those runs
(forward only). Times are medians (and minima: the machine is shared) of interleaved repeats of
jitted calls, each right after an untimed call of the same function, ``block_until_ready``
included; speedups are medians of same-round pairs. ``bwd_over_fwd`` = (fwd+bwd − fwd) / fwd,
in time and in FLOPs. forward+backward = the gradient w.r.t. x, the gates and the three expert
tensors of ⟨y, c⟩ for a fixed random cotangent c. FLOPs are XLA's
``compiled.cost_analysis()["flops"]`` (XLA:CPU counts ``ragged_dot`` as the dense expansion it
runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import _results
import jax
import jax.numpy as jnp
import numpy as np
from _timing import paired_ratio

from sat_jax.models.moe import _default_block, _resolve, expert_ffn

SHAPES = {  # name: (tokens N, d, experts E, k, f, forward only)
    "tiny": (8 * 144, 128, 32, 4, 32, False),
    "default": (128 * 13, 64, 16, 4, 32, False),
    "tiny_decode": (8, 128, 32, 4, 32, True),
    "default_decode": (128, 64, 16, 4, 32, True),
}


def _inputs(n, d, e, k, f, seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (n, d))
    z = jax.random.normal(ks[1], (n, e))
    idx = jax.lax.top_k(z, k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jnp.take_along_axis(z, idx, axis=1), axis=-1)
    gp = 0.02 * jax.random.normal(ks[2], (e, d, f))
    up = 0.02 * jax.random.normal(ks[3], (e, d, f))
    dp = 0.02 * jax.random.normal(ks[4], (e, f, d))
    ct = jax.random.normal(ks[5], (n, d))
    return (x, idx, w, gp, up, dp), ct


def _jax_fns(impl, block):
    def fwd(x, idx, w, gp, up, dp):
        return expert_ffn(x, idx, w, gp, up, dp, impl=impl, block_size=block)

    def fwd_bwd(x, idx, w, gp, up, dp, ct):
        def loss(x, w, gp, up, dp):
            return jnp.sum(fwd(x, idx, w, gp, up, dp) * ct)

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, gp, up, dp)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _flops(fn, *args) -> float:
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost.get("flops", float("nan")))


def _torch_fns(args, ct, implementation):
    """transformers' ``Qwen3MoeExperts`` on our weights and routing, with one of its expert
    implementations: "grouped_mm" (what ``Qwen3MoeForCausalLM`` picks by default, so the one the
    peer model-pass benchmark runs) or "eager" (a loop over the hit experts with ``index_add_``)."""
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.set_num_threads(2)
    x, idx, w, gp, up, dp = (np.array(a) for a in args)
    e, d, f = gp.shape
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=idx.shape[1]
    )
    cfg._experts_implementation = implementation
    mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():  # torch stores [E, out, in]: gate_up = [G; U]ᵀ, down = Dᵀ
        mod.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gp, up], -1).transpose(0, 2, 1)))
        mod.down_proj.copy_(torch.from_numpy(dp.transpose(0, 2, 1).copy()))
    tx = torch.from_numpy(x).requires_grad_()
    tw = torch.from_numpy(w).requires_grad_()
    ti = torch.from_numpy(idx.astype(np.int64))
    tct = torch.from_numpy(np.array(ct))

    def fwd():
        with torch.no_grad():
            return mod(tx, ti, tw)

    def fwd_bwd():
        mod.zero_grad(set_to_none=True)
        tx.grad = tw.grad = None
        mod(tx, ti, tw).backward(tct)
        return tx.grad

    return fwd, fwd_bwd, fwd().numpy()


TORCH_IMPLS = ("grouped_mm", "eager")


def _interleaved_warm_ms(fns, repeats):
    """Like ``_timing.interleaved_ms`` (round-robin, so load drift hits all alike), but each call
    is preceded by one untimed call of the same function: measured here, whichever function ran
    right after a slow one (ragged's 0.5 s, torch) came out up to 2× slower than in other runs."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm-up
    rounds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            jax.block_until_ready(fn())
            start = time.perf_counter()
            jax.block_until_ready(fn())
            rounds[name].append(time.perf_counter() - start)
    return {k: float(np.median(v) * 1e3) for k, v in rounds.items()}, rounds


def bench_shape(name, repeats, blocks, with_torch, paths=("dense", "ragged", "blocked")):
    n, d, e, k, f, fwd_only = SHAPES[name]
    args, ct = _inputs(n, d, e, k, f)
    impls = dict.fromkeys(("dense",) + tuple(p for p in paths if p != "dense"))
    impls.update({f"blocked_b{b}": b for b in blocks})
    out = {
        "shape": dict(tokens=n, d=d, experts=e, k=k, f=f),
        "auto_on_cpu": _resolve("auto", "cpu", n, k, e, None),
        "default_block": _default_block(n * k, e),
    }
    fwd_fns, fb_fns, flops = {}, {}, {}
    ref = None
    for impl, block in impls.items():
        path = "blocked" if impl.startswith("blocked") else impl
        fwd, fb = _jax_fns(path, block)
        y = np.asarray(fwd(*args))
        ref = y if ref is None else ref
        err = float(np.max(np.abs(y - ref)))
        assert err < 1e-4, (impl, err)
        fwd_fns[impl], fb_fns[impl] = fwd, fb
        flops[impl] = {"fwd": _flops(fwd, *args)}
        if not fwd_only:
            flops[impl]["fwd_bwd"] = _flops(fb, *args, ct)
    fns = {f"{i}/fwd": (lambda fn=fn: fn(*args)) for i, fn in fwd_fns.items()}
    if not fwd_only:
        fns.update({f"{i}/fwd_bwd": (lambda fn=fn: fn(*args, ct)) for i, fn in fb_fns.items()})
    torch_names = []
    if with_torch:
        for timpl in TORCH_IMPLS:
            t_fwd, t_fb, ty = _torch_fns(args, ct, timpl)
            name_t = f"torch_{timpl}"
            torch_names.append(name_t)
            out[f"{name_t}_max_abs_diff"] = float(np.max(np.abs(ty - ref)))
            fns[f"{name_t}/fwd"] = t_fwd
            if not fwd_only:
                fns[f"{name_t}/fwd_bwd"] = t_fb
    # Zero-argument closures; jax.block_until_ready passes torch's tensors through unchanged.
    ms, rounds = _interleaved_warm_ms(fns, repeats)
    best = {k_: round(float(np.min(v)) * 1e3, 3) for k_, v in rounds.items()}
    results = {}
    base = "torch_grouped_mm"
    for impl in list(impls) + torch_names:
        r = {"fwd_ms": round(ms[f"{impl}/fwd"], 3), "fwd_min_ms": best[f"{impl}/fwd"]}
        if impl in flops:
            r["fwd_gflop"] = round(flops[impl]["fwd"] / 1e9, 4)
        if impl != "dense" and not impl.startswith("torch"):
            r["fwd_speedup_vs_dense"] = paired_ratio(rounds, "dense/fwd", f"{impl}/fwd")
        if not fwd_only:
            r["fwd_bwd_ms"] = round(ms[f"{impl}/fwd_bwd"], 3)
            r["fwd_bwd_min_ms"] = best[f"{impl}/fwd_bwd"]
            r["bwd_over_fwd_time"] = round((r["fwd_bwd_ms"] - r["fwd_ms"]) / r["fwd_ms"], 2)
            if impl in flops:
                fb_flops = flops[impl]["fwd_bwd"]
                r["fwd_bwd_gflop"] = round(fb_flops / 1e9, 4)
                r["bwd_over_fwd_flops"] = round(
                    (fb_flops - flops[impl]["fwd"]) / flops[impl]["fwd"], 2
                )
            if impl != "dense" and not impl.startswith("torch"):
                r["fwd_bwd_speedup_vs_dense"] = paired_ratio(
                    rounds, "dense/fwd_bwd", f"{impl}/fwd_bwd"
                )
        if with_torch and impl != base:
            r[f"fwd_speedup_vs_{base}"] = paired_ratio(rounds, f"{base}/fwd", f"{impl}/fwd")
            if not fwd_only:
                r[f"fwd_bwd_speedup_vs_{base}"] = paired_ratio(
                    rounds, f"{base}/fwd_bwd", f"{impl}/fwd_bwd"
                )
        results[impl] = r
    out["impls"] = results
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blocks", default="16,64,128", help="extra block sizes of 'blocked'")
    ap.add_argument(
        "--paths",
        default="dense,ragged,blocked",
        help="expert_ffn paths to time (dense, the reference, always runs)",
    )
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    with_torch = not a.no_torch
    if with_torch:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            with_torch = False
    blocks = [int(b) for b in a.blocks.split(",") if b]
    res = {
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "dtype": "float32",
        "repeats": a.repeats,
    }
    if with_torch:
        import torch

        res["torch"] = torch.__version__
        res["torch_threads"] = 2
    paths = tuple(a.paths.split(","))
    res["shapes"] = {
        s: bench_shape(s, a.repeats, blocks, with_torch, paths) for s in a.shapes.split(",")
    }
    print(json.dumps(res, indent=1))
    _results.write("moe", res)


if __name__ == "__main__":
    main()

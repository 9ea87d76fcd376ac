"""Loss benchmarks: forward+backward time of PPO, SAT, GSPO, SAT-GSPO and the field's stabilizers
(M2PO, BAPO, the age-aware clip, CISPO, SAPO, decoupled PPO), each against PPO in the same run, and
the exact quantile.

Prints one JSON object. Run: ``python benchmarks/losses.py`` (``--tokens 65536`` for a quick run).
Times are medians over interleaved repeats of jitted calls after a warm-up, ``block_until_ready``
included; time ratios are medians of back-to-back pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from unittest import mock

import _results
import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_ms, median_seconds, paired_ratio

from sat_jax import losses
from sat_jax.losses import objectives as objectives_module


def _inputs(batch, length, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    beh = jnp.log(jax.random.uniform(k[0], (batch, length), minval=0.05, maxval=0.95))
    logp = beh + 0.01 * jax.random.normal(k[1], (batch, length))  # d̄_π ≈ 0.008, as in the paper
    adv = jax.random.normal(k[2], (batch,))
    lengths = jax.random.randint(k[3], (batch, 1), length // 4, length + 1)
    mask = jnp.arange(length)[None, :] < lengths
    return logp, beh, adv, mask


def _fwd_bwd(fn, **kw):
    def f(logp, beh, adv, mask):
        out, grad = jax.value_and_grad(lambda x: fn(x, beh, adv, mask, **kw).loss)(logp)
        return out, grad

    return jax.jit(f)


def _fixed_q_sat(data):
    """SAT with its quantile replaced by the true q as a constant: what SAT costs without selection.

    Compiled while ``objectives.quantile`` is patched, so the patch does not outlive this call.
    """
    q = float(losses.quantile(jnp.abs(data[0] - data[1]), data[3], 0.9))
    with mock.patch.object(objectives_module, "quantile", lambda *a, **k: jnp.float32(q)):
        return _fwd_bwd(losses.sat).lower(*data).compile()


def _hlo_collectives(tokens: int) -> dict:
    """Collectives of the shard_map'd SAT loss on 8 CPU devices (run in a child process)."""
    code = f"""
import json, re, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding
from sat_jax import losses
mesh = jax.make_mesh((8,), ("data",))
out = {{}}
for method in ("radix", "bisect"):
    def body(lp, beh, adv, m):
        return jax.value_and_grad(lambda x: losses.sat(x, beh, adv, m, axis_name="data",
                                  quantile_method=method).loss)(lp)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 4,
                              out_specs=(P(), P("data"))))
    s = NamedSharding(mesh, P("data"))
    b, t = 1024, {tokens} // 1024
    args = [jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=s)] * 2 + [
        jax.ShapeDtypeStruct((b,), jnp.float32, sharding=s),
        jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=s)]
    hlo = f.lower(*args).compile().as_text()
    shapes = re.findall(r"=\\s+(.+?)\\s+all-reduce(?:-start)?\\(", hlo)
    out[method] = {{"all_gather": hlo.count("all-gather"), "all_reduce_shapes": sorted(set(shapes)),
                   "num_all_reduce": len(shapes)}}
print(json.dumps(out))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="B·T (B = 1024)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-hlo", action="store_true", help="skip the HLO collective check")
    args = parser.parse_args()
    batch = 1024
    length = args.tokens // batch
    data = _inputs(batch, length)
    n_active = int(jnp.sum(data[3]))

    objectives = {
        "ppo": _fwd_bwd(losses.ppo),
        "sat": _fwd_bwd(losses.sat),
        "sat_bisect": _fwd_bwd(losses.sat, quantile_method="bisect"),
        "gspo": _fwd_bwd(losses.gspo),
        "sat_gspo": _fwd_bwd(losses.sat_gspo),
        "sat_fixed_q": _fixed_q_sat(data),
    }
    # Lags 0-8 for the objectives that read each token's staleness.
    staleness = jax.random.randint(jax.random.key(1), data[0].shape, 0, 9)
    stabilizers = {
        "m2po": _fwd_bwd(losses.m2po),
        "m2po_bisect": _fwd_bwd(losses.m2po, selection_method="bisect"),
        "m2po_gspo": _fwd_bwd(losses.m2po_gspo),
        "bapo": _fwd_bwd(losses.bapo),
        "bapo_gspo": _fwd_bwd(losses.bapo_gspo),
        "age_clip": _fwd_bwd(losses.age_clip, staleness=staleness),
        "age_clip_gspo": _fwd_bwd(losses.age_clip_gspo, staleness=staleness),
        "cispo": _fwd_bwd(losses.cispo),
        "sapo": _fwd_bwd(losses.sapo),
        "decoupled_ppo": _fwd_bwd(losses.decoupled_ppo, staleness=staleness),
    }
    objectives.update(stabilizers)
    fwd_bwd_ms, rounds = interleaved_ms(objectives, data, args.repeats)

    absd = jnp.abs(data[0] - data[1])
    mask = data[3]
    k = int(np.ceil(0.9 * n_active))
    flat_active = jnp.where(mask, absd, jnp.inf).ravel()  # inactive sort last

    quantile_fns = {
        "radix": jax.jit(lambda x, m: losses.quantile(x, m, 0.9, method="radix")),
        "bisect": jax.jit(lambda x, m: losses.quantile(x, m, 0.9, method="bisect")),
        "jnp_quantile": jax.jit(lambda x: jnp.quantile(x[:n_active], 0.9, method="inverted_cdf")),
        "lax_top_k": jax.jit(lambda x: -jax.lax.top_k(-x, k)[0][-1]),
    }
    sorted_active = jnp.sort(flat_active)  # outside timing: jnp_quantile gets exactly the actives
    quantile_args = {
        "radix": (absd, mask),
        "bisect": (absd, mask),
        "jnp_quantile": (sorted_active,),
        "lax_top_k": (flat_active,),
    }
    quantile_ms = {  # the two sorting baselines are slow: 3 repeats
        name: 1e3
        * median_seconds(
            fn, *quantile_args[name], repeats=args.repeats if name in ("radix", "bisect") else 3
        )
        for name, fn in quantile_fns.items()
    }
    # The floor for any exact selection on this backend: one scatter-add histogram pass (what each
    # radix pass costs) and one masked count (what each bisection step costs), over the same tokens.
    t = jnp.float32(exact_value := float(sorted_active[k - 1]))
    floor_fns = {
        "histogram_pass": jax.jit(
            lambda x, m: (
                jnp.zeros(1 << 16, jnp.int32)
                .at[jnp.where(m, jax.lax.bitcast_convert_type(x, jnp.int32) >> 16, 1 << 16).ravel()]
                .add(1, mode="drop")
            )
        ),
        "count_pass": jax.jit(lambda x, m: jnp.sum(jnp.where(m & (x <= t), 1, 0))),
    }
    floor_ms, _ = interleaved_ms(floor_fns, (absd, mask), args.repeats)
    exact = exact_value
    agree = {name: float(quantile_fns[name](absd, mask)) == exact for name in ("radix", "bisect")}
    agree["lax_top_k"] = float(quantile_fns["lax_top_k"](flat_active)) == exact

    result = {
        "benchmark": "losses",
        "device": f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores)",
        "jax": jax.__version__,
        "tokens": batch * length,
        "active_tokens": n_active,
        "forward_backward_ms": {k: round(v, 3) for k, v in fwd_bwd_ms.items()},
        # Ratios are medians of back-to-back pairs (see _timing.paired_ratio).
        "sat_over_ppo": paired_ratio(rounds, "sat", "ppo"),
        "sat_bisect_over_ppo": paired_ratio(rounds, "sat_bisect", "ppo"),
        "sat_gspo_over_gspo": paired_ratio(rounds, "sat_gspo", "gspo"),
        "sat_fixed_q_over_ppo": paired_ratio(rounds, "sat_fixed_q", "ppo"),
        "stabilizers_over_ppo": {name: paired_ratio(rounds, name, "ppo") for name in stabilizers},
        "m2po_bisect_over_radix": paired_ratio(rounds, "m2po_bisect", "m2po"),
        "quantile_ms": {k: round(v, 3) for k, v in quantile_ms.items()},
        "quantile_speedup_vs_jnp_quantile": round(
            quantile_ms["jnp_quantile"] / quantile_ms["radix"], 1
        ),
        "quantile_speedup_vs_top_k": round(quantile_ms["lax_top_k"] / quantile_ms["radix"], 1),
        "quantile_exact": agree,
        "floor_ms": {k: round(v, 3) for k, v in floor_ms.items()},
        "histogram_pass_over_ppo": round(floor_ms["histogram_pass"] / fwd_bwd_ms["ppo"], 3),
    }
    if not args.no_hlo:
        result["sharded_sat_collectives"] = _hlo_collectives(batch * length)
    print(json.dumps(result, indent=1))
    _results.write("losses", result)


if __name__ == "__main__":
    main()

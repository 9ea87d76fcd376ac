"""The blocked MoE's three batched matmuls alone, XLA:CPU against torch, in GFLOP/s.

The ``blocked`` path (``sat_jax.models.moe``) computes its experts as batched matmuls over nb
blocks of B rows: forward ``bnd,bdf->bnf`` (and ``bnf,bfd->bnd``), backward ``bnd,bnf->bdf``
(the weight gradient) and ``bnf,bdf->bnd`` (the rows' gradient). This times each einsum on the
rows of the transformers-peer pass (R ≈ 6,592 sorted rows, d 128, f 32) for several B, jitted
JAX against ``torch.einsum`` (CPU torch, 2 threads), so the MoE's speed in the model can be set
against what the backends do with the same shapes. Prints one JSON line.

    python benchmarks/batched_matmul.py [--blocks 16,32,64,128] [--repeats 25]
"""

from __future__ import annotations

import argparse
import json
import time

import _results
import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_seconds

EINSUMS = {
    "forward": "bnd,bdf->bnf",
    "weight_grad": "bnd,bnf->bdf",
    "row_grad": "bnf,bdf->bnd",
}


def _torch_seconds(torch, eq, a, b, repeats):
    ta, tb = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))
    torch.einsum(eq, ta, tb)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.einsum(eq, ta, tb)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="16,32,64,128")
    ap.add_argument("--rows", type=int, default=6592)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--f", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    torch = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    results = []
    for block in (int(b) for b in args.blocks.split(",")):
        nb = args.rows // block
        x = rng.standard_normal((nb, block, args.d)).astype(np.float32)
        w = rng.standard_normal((nb, args.d, args.f)).astype(np.float32)
        dy = rng.standard_normal((nb, block, args.f)).astype(np.float32)
        operands = {"forward": (x, w), "weight_grad": (x, dy), "row_grad": (dy, w)}
        flops = 2 * nb * block * args.d * args.f
        row = {"block": block, "num_blocks": nb}
        for name, eq in EINSUMS.items():
            a, b = operands[name]
            fn = jax.jit(lambda a, b, eq=eq: jnp.einsum(eq, a, b))
            ja, jb = jnp.asarray(a), jnp.asarray(b)
            row[f"{name}_jax_gflops"] = round(
                flops / median_seconds(fn, ja, jb, repeats=args.repeats) / 1e9, 1
            )
            if torch is not None:
                row[f"{name}_torch_gflops"] = round(
                    flops / _torch_seconds(torch, eq, a, b, args.repeats) / 1e9, 1
                )
        results.append(row)
    out = {
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "rows": args.rows,
        "d": args.d,
        "f": args.f,
        "results": results,
    }
    print(json.dumps(out))
    _results.write("batched_matmul", out)


if __name__ == "__main__":
    main()

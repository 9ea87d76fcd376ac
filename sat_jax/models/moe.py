"""The routed experts of the MoE layer: a dense reference and two dropless dispatching paths, with
expert parallelism over a mesh axis.

For tokens x_n (n < N), chosen experts e_{n,j} = ``indices[n, j]`` (j < k) and gate weights
w_{n,j} = ``weights[n, j]`` (a differentiable function of the router logits, Eq. 40 under R3):

    y_n = Σ_j w_{n,j} · Expert_{e_{n,j}}(x_n),   Expert_e(x) = (silu(x·G_e) ⊙ (x·U_e)) · D_e

with G_e, U_e = ``gate_proj[e], up_proj[e]`` [d, f] and D_e = ``down_proj[e]`` [f, d]
(Qwen3-MoE's SwiGLU experts; Shazeer et al. 2017, Fedus et al. 2021 for the routed layer).
Every path below computes this same function, values and gradients (w.r.t. x, w and the three
expert tensors; indices are discrete). Routing itself (top-k, R3 replay, capture) stays with the
caller, so replay and the router's gradient behave identically whatever path runs here.

Paths (``impl``), with M = N·k (token, expert) pairs:

* ``"dense"`` — the reference: the gates scattered to [N, E] (zero off the chosen set) and every
  expert run on every token. FLOPs 6·N·E·d·f forward; activations 3·N·E·f. Exact and simple,
  E/k times the work of a dispatching path.
* ``"ragged"`` — dropless dispatch (MegaBlocks, Gale et al. 2023): the M pairs sorted by expert
  (a counting sort: each pair's row is its expert's start plus its rank among that expert's
  pairs, from a cumsum of the [N, E] counts; no argsort), group sizes per expert, the rows
  gathered in that order, the three expert matmuls as ``jax.lax.ragged_dot`` over the groups,
  the rows weighted and summed back per token.
  FLOPs 6·M·d·f on a grouped-matmul kernel (TPU, GPU); activations M·(2d + 3f). XLA:CPU expands
  ``ragged_dot`` to a masked dense product over all E groups, so on CPU it costs more than dense.
* ``"blocked"`` — the CPU path: the same sort, but each expert's group padded to a multiple of a
  block of B rows, so the sorted buffer is nb = ⌊(M + E·(B−1))/B⌋ blocks of B rows that each
  belong to one expert (blocks past the used ones hold zero rows); the expert matmuls are then one
  batched matmul over blocks against the per-block gathered weights [nb, d, f]. FLOPs 6·R·d·f with
  R = B·nb ≤ M + E·(B−1) rows; activations R·(2d + 3f); extra memory the gathered weights
  3·nb·d·f (their gradient is scattered back to [E, d, f]), taken in groups of blocks when they
  pass ``GROUP_BYTES`` (256 MiB; a ``lax.map`` forward, a ``lax.scan`` backward). B defaults to
  the power of two ≤ M/(2E), clipped to [8, 128].
* ``"auto"`` — ``ragged`` on TPU/GPU; on CPU ``blocked``, unless its padded rows R exceed twice
  the N·E rows of the dense path (a handful of tokens over many experts), then ``dense``.

Why ``blocked`` on CPU: XLA:CPU has no grouped-matmul kernel, so ``ragged`` runs E/k times the
dispatching FLOPs and ``dense`` runs every expert on every token, while ``blocked`` does only the
padded rows' work in one batched matmul. Its backward is about twice its forward in FLOPs (the
dense path's backward, with its [N, E, f] activations, is far more than that in time). Block sizes
of 32–128 rows cost about the same at training shapes and small blocks win at decode sizes, hence
the default M/(2E). Alternatives that lost on CPU and are not used: a ``lax.scan`` over blocks with
dynamically sliced weights (no weight gather), one fused [d, 2f] gate-and-up matmul, and
``argsort`` for the sort instead of the counting sort. ``benchmarks/moe.py`` times every path
against transformers' experts; its latest figures are in ``docs/benchmarks.md``.

The permutations into and out of the sorted buffer are gathers whose transposes would be
scatter-adds (slower than a gather on XLA:CPU); since each pair occupies
exactly one row, the transpose
of "gather by the row→pair map" is "gather by the pair→row map", and ``_dispatch`` and
``_combine`` say so with custom VJPs (as MaxText writes the sort's backward as the inverse
permutation). ``_dispatch`` gathers each row from its token (not from a [N·k, d] broadcast of the
tokens) and reads padding rows from an appended zero row; on one device (no sink pairs) no
gather needs XLA's out-of-range fill, a select over the whole gathered buffer on XLA:CPU.

``blocked`` goes one step further: dispatch, the three expert matmuls and the combine are one
function with its own VJP (``_blocked_ffn``), whose backward keeps only the gate and up
activations [R, f] and regathers the rows and block weights. Plain autodiff of the same program
would keep the gathered rows [R, d], the gathered weights [nb, d, f] ×3 and the outputs, stacked
over layers inside the blocks' scan. At Qwen3-30B-A3B's widths one shard's blocks (≈ 2,100 of 128
rows at 32k tokens) would gather ≈ 19 GiB of bf16 weights a layer at once, hence the groups of
``GROUP_BYTES`` (``benchmarks/scale.py`` reports the compiled scratch per device); the tiny model's
blocks fit one group, so its program has no group loop.

Expert parallelism (``mesh`` with an ``expert_axis`` of size P > 1; experts split in P contiguous
ranges of E/P, ``gate_proj`` etc. sharded on axis 0 over it): a ``jax.shard_map`` manual over every
mesh axis (see ``_sharded``: rows split over the batch axes, experts over the expert axis,
operands replicated over the rest), in which each device runs the chosen path on
its own E/P experts and only on the pairs routed to them (the others are sorted into a sink
group after the real ones, which no block holds and no ragged group covers, or get a zero gate in
``dense``), then the partial outputs are summed.
Two token layouts:

* ``split_tokens=False`` (default; the layout of a batch split over data × fsdp only, tokens
  replicated over the expert axis): every device already holds all tokens, so nothing moves before
  the experts; one ``psum`` (all-reduce, 2·N·d·(P−1)/P elements a device) combines the outputs.
* ``split_tokens=True`` (batch also split over the expert axis, as in MaxText): the tokens, indices
  and gates are all-gathered over the axis (N·d·(P−1)/P), the experts run, and a reduce-scatter
  returns each device its own tokens' outputs (N·d·(P−1)/P).

Why an all-gather rather than an all-to-all of the routed pairs: a dropless all-to-all needs its
receive buffers sized for the worst case (every pair to one device), i.e. the same P·N_local·k
rows as the gather of k copies, and ``ragged_all_to_all`` is not supported on every backend; the
all-gather moves (P−1)·N_local·d elements, no more than the average all-to-all's
k·(P−1)/P·N_local·d whenever P ≤ k (Qwen3-30B-A3B: k = 8), needs no capacity and no dynamic sizes,
and differentiates into a reduce-scatter. The static shapes are still worst-case: each device's
sorted buffer holds all M pairs (in ``blocked``, ⌊(M + E/P·(B−1))/B⌋ blocks), of which on average
M/P are its own; ``ragged_dot`` kernels skip the rows beyond the groups, XLA:CPU's blocked path
computes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sat_jax import _checks

IMPLS = ("auto", "dense", "ragged", "blocked")


def noisy_logits(router_logits: jax.Array, key: jax.Array, std) -> jax.Array:
    """z + std·ε, ε ~ N(0, 1) i.i.d. per token and expert, in float32: the scores a noisy
    rollout engine takes its top-k of (``MoE(noise=(key, std))``; the gates keep the clean z).

    ``std`` may be a Python float or a traced scalar; the caller draws one ``key`` per layer and
    forward pass, so every token-layer gets independent noise.
    """
    z = router_logits.astype(jnp.float32)
    return z + jnp.asarray(std, jnp.float32) * jax.random.normal(key, z.shape, jnp.float32)


def routing_flips(chosen: jax.Array, recorded: jax.Array) -> jax.Array:
    """Whether two routing decisions differ as sets: ``[..., k]`` int → ``[...]`` bool.

    Top-k order is not part of the decision (the gates depend on the set only), so each row is
    sorted before comparing. The routing flip rate of a batch is the mean of this over its
    token-layers: with ``chosen`` the trainer's fresh top-k of its own router logits and
    ``recorded`` the rollout engine's (the indices R3 replays), it is defined whether or not the
    trainer replays them.
    """
    _checks.check_integer("chosen", chosen)
    _checks.check_shape("recorded", recorded, chosen.shape)
    return jnp.any(jnp.sort(chosen, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)


def expert_ffn(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    gate_proj: jax.Array,
    up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    impl: str = "auto",
    mesh: jax.sharding.Mesh | None = None,
    expert_axis: str = "expert",
    split_tokens: bool = False,
    token_axes: tuple[str, ...] = (),
    block_size: int | None = None,
) -> jax.Array:
    """y_n = Σ_j w_{n,j} · (silu(x_n·G_e) ⊙ (x_n·U_e)) · D_e with e = indices[n, j] (module doc).

    Args:
      x: [N, d] activations in the compute dtype (tokens flattened).
      indices: [N, k] integer chosen experts (fresh top-k or R3-replayed), in [0, E). Checked when
        concrete; under ``jit`` an out-of-range index is not detected (jnp gather semantics).
      weights: [N, k] float gate weights of those experts (cast to x's dtype); differentiable, so
        the router's gradient flows through them.
      gate_proj, up_proj: [E, d, f]; down_proj: [E, f, d], in x's dtype.
      impl: "auto" | "dense" | "ragged" | "blocked" (module doc).
      mesh: optional mesh; when it has ``expert_axis`` of size > 1, experts are computed where
        they live (expert parallelism). E must be divisible by that size.
      expert_axis: name of the mesh axis the experts are split over.
      split_tokens: under expert parallelism, whether the tokens are split over ``expert_axis``
        (all-gather in, reduce-scatter out) or replicated over it (one all-reduce out).
      token_axes: mesh axes the rows of x are split over (the batch axes, e.g. ``("data",
        "fsdp")``). With ``mesh``, each device then sorts and computes only its own rows: a
        dispatch traced over the global rows would make the compiler gather the routing of
        every token (the sort is global), which no data-parallel step should do.
      block_size: rows per block of ``blocked`` (default from the shapes, see module doc).
    Returns:
      y [N, d] in x's dtype.
    """
    num_experts = _check_inputs(
        x, indices, weights, gate_proj, up_proj, down_proj, impl, block_size
    )
    ep = 1
    if mesh is not None and expert_axis in mesh.shape:
        ep = int(mesh.shape[expert_axis])
    if ep > 1 and num_experts % ep:
        raise ValueError(
            f"mesh axis {expert_axis!r} of size {ep} must divide the number of experts "
            f"(gate_proj.shape[0] = {num_experts})"
        )
    # An AbstractMesh (traced under ``use_abstract_mesh``) has no devices: the default backend.
    platform = (
        mesh.devices.flat[0].platform
        if isinstance(mesh, jax.sharding.Mesh)
        else jax.default_backend()
    )
    weights = weights.astype(x.dtype)
    token_axes = tuple(a for a in token_axes if mesh is not None and mesh.shape.get(a, 1) > 1)
    if ep == 1 and not token_axes:
        path = _resolve(impl, platform, x.shape[0], indices.shape[1], num_experts, block_size)
        return _local_ffn(
            path,
            x,
            indices,
            weights,
            gate_proj,
            up_proj,
            down_proj,
            offset=0,
            block_size=block_size,
        )
    return _sharded(
        x,
        indices,
        weights,
        gate_proj,
        up_proj,
        down_proj,
        impl=impl,
        platform=platform,
        mesh=mesh,
        axis=expert_axis,
        ep=ep,
        split_tokens=split_tokens and ep > 1,
        token_axes=token_axes,
        block_size=block_size,
    )


# --------------------------------------------------------------------------------------------
# Checks and path choice


def _check_inputs(x, indices, weights, gate_proj, up_proj, down_proj, impl, block_size) -> int:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _checks.check_rank("x", x, 2)
    _checks.check_floating("x", x)
    n, d = x.shape
    _checks.check_rank("indices", indices, 2)
    k = indices.shape[1]
    _checks.check_shape("indices", indices, (n, k))
    _checks.check_integer("indices", indices)
    _checks.check_shape("weights", weights, (n, k))
    _checks.check_floating("weights", weights)
    _checks.check_rank("gate_proj", gate_proj, 3)
    e, _, f = gate_proj.shape
    _checks.check_shape("gate_proj", gate_proj, (e, d, f))
    _checks.check_shape("up_proj", up_proj, (e, d, f))
    _checks.check_shape("down_proj", down_proj, (e, f, d))
    for name, w in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype} (cast first), got {w.dtype}")
    if _checks.is_concrete(indices) and indices.size:
        idx = np.asarray(indices)
        if idx.min() < 0 or idx.max() >= e:
            raise ValueError(
                f"indices must lie in [0, {e}) (gate_proj.shape[0] experts), got min "
                f"{idx.min()}, max {idx.max()}"
            )
    return e


def _default_block(m: int, e: int) -> int:
    """The power of two ≤ M/(2E) (half the mean group), in [8, 128]; see the module doc."""
    target = max(1, m // (2 * e))
    return int(min(128, max(8, 2 ** int(math.floor(math.log2(target))))))


def _num_blocks(m: int, e: int, block: int) -> int:
    # Σ_e ceil(g_e / B) ≤ Σ_e (g_e + B − 1) / B = (M + E(B − 1)) / B for any split Σ g_e = M.
    return max(1, (m + e * (block - 1)) // block)


#: Bytes of gathered expert weights (the three [blocks, d, f] copies) that ``blocked`` keeps live
#: at once; more blocks than fit are taken in groups (``_blocked_ffn``).
GROUP_BYTES = 256 * 2**20


def _block_groups(nb: int, d: int, f: int, itemsize: int) -> tuple[int, int]:
    """(blocks, groups): nb rounded up to equal groups whose gathered weights fit GROUP_BYTES
    (the extra blocks hold only padding rows)."""
    fit = max(1, GROUP_BYTES // (3 * d * f * itemsize))
    if fit >= nb:
        return nb, 1
    groups = -(-nb // fit)
    return groups * -(-nb // groups), groups


def _resolve(impl: str, platform: str, n: int, k: int, e: int, block_size: int | None) -> str:
    """The concrete path of ``impl`` for a (local) problem of N tokens, k of E experts each."""
    if impl != "auto":
        return impl
    if platform != "cpu":
        return "ragged"
    m = n * k
    b = block_size or _default_block(m, e)
    # Padded rows vs the dense path's N·E rows; at equal rows blocked does no more work and skips
    # the [N, E] gate scatter.
    return "blocked" if _num_blocks(m, e, b) * b <= 2 * n * e else "dense"


# --------------------------------------------------------------------------------------------
# The single-device (or per-expert-shard) computation


def _local_ffn(path, x, indices, weights, gate_proj, up_proj, down_proj, *, offset, block_size):
    """The experts ``offset + [0, E_local)`` on all N tokens' pairs routed to them (others: 0)."""
    n, k = indices.shape
    m, e = n * k, gate_proj.shape[0]
    local = indices.astype(jnp.int32) - offset
    # Pairs of other devices' experts get key E: a sink after all real groups, never computed
    # (and never negative: scatter and gather would wrap a negative index around).
    local = jnp.where((local >= 0) & (local < e), local, e)
    if path == "dense":
        return _dense(x, local, weights, gate_proj, up_proj, down_proj)
    # Counting sort, pair (n, j) → its rank among the pairs of its expert in flat order n·k + j
    # (the rank a stable argsort would give): pairs of earlier tokens (an exclusive cumsum of the
    # [N, E] counts) plus earlier duplicates within the token: no argsort.
    counts = jnp.zeros((n, e), jnp.int32).at[jnp.arange(n)[:, None], local].add(1, mode="drop")
    sizes = jnp.sum(counts, axis=0)
    earlier = jnp.cumsum(counts, axis=0) - counts
    safe = jnp.minimum(local, e - 1)
    earlier_slot = jnp.tri(k, k, -1, dtype=bool)[None]  # [1, j, j'] with j' < j
    dup = jnp.sum((local[:, :, None] == local[:, None, :]) & earlier_slot, axis=-1)
    rank = jnp.take_along_axis(earlier, safe, axis=1) + dup.astype(jnp.int32)
    if path == "ragged":
        rows = m
        group_start = jnp.cumsum(sizes) - sizes
    else:
        block = block_size or _default_block(m, e)
        nb, groups = _block_groups(
            _num_blocks(m, e, block), *gate_proj.shape[1:], jnp.dtype(gate_proj.dtype).itemsize
        )
        rows = nb * block
        padded = (sizes + block - 1) // block * block
        ends = jnp.cumsum(padded)
        group_start = ends - padded
        # Block b holds rows [bB, (b+1)B) of the expert whose padded range contains them; blocks
        # past the used ones hold only zero rows and get the last expert (their output is unread).
        # (A count of the ends ≤ bB, i.e. searchsorted; an [nb, E] compare is cheap here and,
        # unlike jnp.searchsorted in JAX 0.10, works on shard_map's varying values.)
        block_start = jnp.arange(nb, dtype=jnp.int32)[:, None] * block
        block_expert = jnp.minimum(jnp.sum(ends[None, :] <= block_start, axis=1), e - 1)
        block_expert = block_expert.astype(jnp.int32)
    # row_of_pair: pair → row (sentinel `rows` for sink pairs); pair_of_row: row → pair
    # (sentinel m for padding rows). They are inverse maps on the pairs that are computed.
    row_of_pair = jnp.where(local < e, group_start[safe] + rank, rows).reshape(m)
    pair_of_row = (
        jnp.full((rows,), m, jnp.int32)
        .at[row_of_pair]
        .set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    )

    # ep = 1 (offset a Python 0): every pair is local, so row_of_pair is in range everywhere and
    # its gathers need no out-of-range fill (a select over the gathered buffer on XLA:CPU).
    sink = not (isinstance(offset, int) and offset == 0)
    if path == "blocked":
        with jax.named_scope("experts"):
            return _blocked_ffn(
                x,
                weights,
                gate_proj,
                up_proj,
                down_proj,
                pair_of_row,
                row_of_pair.reshape(n, k),
                block_expert,
                sink,
                groups,
            )
    with jax.named_scope("dispatch"):
        x_rows = _dispatch(x, pair_of_row, row_of_pair.reshape(n, k), sink)  # padding rows: 0
    with jax.named_scope("experts"):
        y_rows = _ragged_experts(x_rows, sizes, gate_proj, up_proj, down_proj)
    with jax.named_scope("combine"):
        return _combine(y_rows, weights, row_of_pair.reshape(n, k), pair_of_row, sink)


def _dense(x, local_indices, weights, gate_proj, up_proj, down_proj):
    """Every (local) expert on every token, gates scattered to [N, E]: the reference path."""
    n, e = x.shape[0], gate_proj.shape[0]
    # Index E (other devices' experts) is dropped; duplicates add up, as in the other paths.
    gates = (
        jnp.zeros((n, e), x.dtype)
        .at[jnp.arange(n)[:, None], local_indices]
        .add(weights, mode="drop")
    )
    g = jnp.einsum("nd,edf->nef", x, gate_proj)
    u = jnp.einsum("nd,edf->nef", x, up_proj)
    h = jax.nn.silu(g) * u * gates[..., None]
    return jnp.einsum("nef,efd->nd", h, down_proj)


def _ragged_experts(x_rows, sizes, gate_proj, up_proj, down_proj):
    g = jax.lax.ragged_dot(x_rows, gate_proj, sizes)
    u = jax.lax.ragged_dot(x_rows, up_proj, sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, down_proj, sizes)
    # Rows past Σ sizes (sink pairs) belong to no group: their value is not specified by every
    # backend, so zero them rather than rely on it (they are never read, but NaN·0 would leak).
    valid = jnp.arange(x_rows.shape[0]) < jnp.sum(sizes)
    return jnp.where(valid[:, None], y, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _blocked_ffn(
    x, weights, gate_proj, up_proj, down_proj, pair_of_row, row_of_pair, block_expert, sink, groups
):
    """Dispatch, the blocked expert matmuls and the combine as one function with its own VJP.

    Rows r < R = nb·B of the sorted buffer: token τ(r) = pair_of_row[r] // k (N, an appended
    zero row, for padding rows), gate w_r (0 on padding rows), expert ε(b) = block_expert[b] of
    its block b. Forward, per block (one batched matmul over blocks for each of the three):

        g = X_b·G_ε(b),  u = X_b·U_ε(b),  h = silu(g) ⊙ u,  y_rows = h·D_ε(b)
        y[n] = Σ_j w[n, j] · y_rows[row_of_pair[n, j]]

    The backward keeps only g and u [R, f] (and the inputs): the gathered rows X and weights,
    h and y_rows are recomputed or never needed, where plain autodiff would store all of them
    (inside the blocks' scan, stacked over layers: ≈ 10× the bytes). With ∂y_rows[r] =
    ∂y[τ(r)] (the unweighted cotangent) and c = ∂y_rows·D_ε(b)ᵀ:

        ∂w(pair of r) = ⟨c_r, h_r⟩   (= ⟨∂y[τ(r)], y_rows[r]⟩, without y_rows)
        ∂h = w ⊙ c,   ∂D_e = Σ_{b: ε(b)=e} h_bᵀ·(w ⊙ ∂y_rows)_b
        ∂g = ∂h ⊙ u ⊙ silu'(g),   ∂u = ∂h ⊙ silu(g)
        ∂G_e = Σ_b X_bᵀ·∂g_b,  ∂U_e = Σ_b X_bᵀ·∂u_b,  ∂X = ∂g·Gᵀ + ∂u·Uᵀ
        ∂x[n] = Σ_j ∂X[row_of_pair[n, j]]

    The sums over blocks of one expert are a scatter-add of [d, f] windows at sorted indices.
    ``sink``: pairs of other devices' experts (row sentinel R) read 0. ``groups`` > 1 takes the
    blocks nb/groups at a time (a ``lax.map`` forward, a ``lax.scan`` backward summing the
    expert gradients in float32), so that no more than nb/groups gathered block weights
    [·, d, f] are live: at Qwen3-30B-A3B's widths all of a shard's blocks at once are tens of GiB.
    """
    y, _ = _blocked_ffn_fwd(
        x,
        weights,
        gate_proj,
        up_proj,
        down_proj,
        pair_of_row,
        row_of_pair,
        block_expert,
        sink,
        groups,
    )
    return y


def _of_blocks(w, block_expert):  # [E, ...] → [nb, ...]; block_expert lies in [0, E), no fill
    return w.at[block_expert].get(mode="promise_in_bounds")


def _groups(a, groups):  # [nb, ...] → [groups, nb / groups, ...]
    return a.reshape((groups, a.shape[0] // groups) + a.shape[1:])


def _blocks_fwd(xb, block_expert, gate_proj, up_proj, down_proj):
    """g, u [nb, B, f] and y_rows [nb, B, d] of some blocks (one batched matmul each)."""
    g = jnp.einsum("bnd,bdf->bnf", xb, _of_blocks(gate_proj, block_expert))
    u = jnp.einsum("bnd,bdf->bnf", xb, _of_blocks(up_proj, block_expert))
    y = jnp.einsum("bnf,bfd->bnd", jax.nn.silu(g) * u, _of_blocks(down_proj, block_expert))
    return g, u, y


def _blocks_bwd(xb, dyb, w_b, g, u, block_expert, gate_proj, up_proj, down_proj):
    """Of some blocks: ∂w per row (float32), ∂X rows, and the per-block weight gradients."""
    c = jnp.einsum("bnd,bfd->bnf", dyb, _of_blocks(down_proj, block_expert))
    sg = jax.nn.silu(g)
    h = sg * u
    g_w_rows = jnp.sum((c * h).astype(jnp.float32), axis=-1)
    dh = w_b * c
    sig = jax.nn.sigmoid(g)
    dg = dh * u * (sig * (1 + g * (1 - sig)))
    du = dh * sg
    per_block = (
        jnp.einsum("bnd,bnf->bdf", xb, dg),
        jnp.einsum("bnd,bnf->bdf", xb, du),
        jnp.einsum("bnf,bnd->bfd", h, dyb * w_b),
    )
    g_rows = jnp.einsum("bnf,bdf->bnd", dg, _of_blocks(gate_proj, block_expert)) + jnp.einsum(
        "bnf,bdf->bnd", du, _of_blocks(up_proj, block_expert)
    )
    return g_w_rows, g_rows, per_block


def _blocked_ffn_fwd(
    x, weights, gate_proj, up_proj, down_proj, pair_of_row, row_of_pair, block_expert, sink, groups
):
    nb, k = block_expert.shape[0], row_of_pair.shape[1]
    x_rows, w_rows = _token_rows(x, pair_of_row, k), _pair_rows(weights, pair_of_row)
    xb = x_rows.reshape(nb, -1, x.shape[1])
    if groups == 1:
        g, u, y_rows = _blocks_fwd(xb, block_expert, gate_proj, up_proj, down_proj)
    else:  # a group of blocks at a time: at most nb/groups gathered weights live
        g, u, y_rows = (
            a.reshape((nb,) + a.shape[2:])
            for a in jax.lax.map(
                lambda a: _blocks_fwd(a[0], a[1], gate_proj, up_proj, down_proj),
                (_groups(xb, groups), _groups(block_expert, groups)),
            )
        )
    y_rows = (y_rows.reshape(x_rows.shape) * w_rows[:, None]).astype(x.dtype)
    y = _sum_pairs(y_rows, row_of_pair, sink)
    res = (x, weights, gate_proj, up_proj, down_proj, pair_of_row, row_of_pair, block_expert, g, u)
    return y, res


def _blocked_ffn_bwd(sink, groups, res, g_y):
    x, weights, gate_proj, up_proj, down_proj, pair_of_row, row_of_pair, block_expert, g, u = res
    nb, block, _ = g.shape
    k = row_of_pair.shape[1]
    x_rows = _token_rows(x, pair_of_row, k)
    xb = x_rows.reshape(nb, block, -1)
    dyb = _token_rows(g_y, pair_of_row, k).reshape(xb.shape)
    w_b = _pair_rows(weights, pair_of_row).reshape(nb, block, 1).astype(g.dtype)
    like = (gate_proj, up_proj, down_proj)

    def to_experts(acc, per_block, be):  # Σ over each expert's blocks (sorted): a window scatter
        return acc.at[be].add(
            per_block.astype(acc.dtype), indices_are_sorted=True, mode="promise_in_bounds"
        )

    if groups == 1:
        g_w_rows, g_rows, per_block = _blocks_bwd(xb, dyb, w_b, g, u, block_expert, *like)
        g_gate, g_up, g_down = (
            to_experts(jnp.zeros_like(w), p, block_expert)
            for w, p in zip(like, per_block, strict=True)
        )
    else:  # the expert gradients summed over the groups in float32

        def step(acc, a):
            g_w_rows, g_rows, per_block = _blocks_bwd(*a, *like)
            acc = tuple(to_experts(s, p, a[5]) for s, p in zip(acc, per_block, strict=True))
            return acc, (g_w_rows, g_rows)

        acc, (g_w_rows, g_rows) = jax.lax.scan(
            step,
            tuple(jnp.zeros_like(w, jnp.float32) for w in like),
            tuple(_groups(a, groups) for a in (xb, dyb, w_b, g, u, block_expert)),
        )
        g_gate, g_up, g_down = (s.astype(w.dtype) for s, w in zip(acc, like, strict=True))
    g_w = _gather_rows(g_w_rows.reshape(-1), row_of_pair, not sink).astype(weights.dtype)
    g_x = _sum_pairs(g_rows.reshape(x_rows.shape), row_of_pair, sink)
    return (g_x.astype(x.dtype), g_w, g_gate, g_up, g_down, None, None, None)


_blocked_ffn.defvjp(_blocked_ffn_fwd, _blocked_ffn_bwd)


def _gather_rows(src, index, in_range: bool):
    """src[index] along axis 0; 0 where index is out of range unless ``in_range`` promises none
    is (then no fill: XLA:CPU spends a select over the whole result on it)."""
    if in_range:
        return src.at[index].get(mode="promise_in_bounds")
    return src.at[index].get(mode="fill", fill_value=0)


def _with_zero_row(a):
    """``a`` with one zero row appended: row ``len(a)`` is the fill of out-of-range sentinels."""
    return jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)], axis=0)


# The two maps between the sorted rows and the (token, slot) pairs, as gathers:


def _token_rows(a, pair_of_row, k: int):
    """a[token of row r] for every row: [N, ...] → [R, ...], 0 on padding rows (whose pair, the
    sentinel N·k, reads the appended zero row)."""
    return _with_zero_row(a).at[pair_of_row // k].get(mode="promise_in_bounds")


def _pair_rows(weights, pair_of_row):
    """weights[pair of row r]: [N, k] → [R], 0 on padding rows."""
    flat = weights.reshape(weights.shape[0] * weights.shape[1])
    return _with_zero_row(flat).at[pair_of_row].get(mode="promise_in_bounds")


def _sum_pairs(rows, row_of_pair, sink: bool):
    """Σ_j rows[row_of_pair[n, j]]: [R, ...] → [N, ...] (sink pairs, out of range: 0)."""
    return jnp.sum(_gather_rows(rows, row_of_pair, not sink), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, pair_of_row, row_of_pair, sink):
    """x_rows[r] = x[pair_of_row[r] // k] (the token of row r's pair), 0 on padding rows.

    Gathers from the tokens, not from a [N·k, d] broadcast of them, and reads the padding rows'
    sentinel (pair m, token N) from an appended zero row, so no out-of-range fill is needed.
    Transpose: each computed pair owns exactly one row, so g_x[n] = Σ_j g_rows[row_of_pair[n, j]]
    is a gather and a sum over k (no scatter-add), with a fill only for sink pairs (``sink``).
    """
    return _token_rows(x, pair_of_row, row_of_pair.shape[1])


def _dispatch_fwd(x, pair_of_row, row_of_pair, sink):
    return _dispatch(x, pair_of_row, row_of_pair, sink), row_of_pair  # all the transpose reads


def _dispatch_bwd(sink, row_of_pair, g_rows):
    return _sum_pairs(g_rows, row_of_pair, sink), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(y_rows, weights, row_of_pair, pair_of_row, sink):
    """y[n] = Σ_j w[n, j] · y_rows[row_of_pair[n, j]] (sink pairs, out of range: 0).

    Transpose: g_rows[r] = w(pair of r) · g_y[token of r], 0 on padding rows (whose pair, the
    sentinel m, reads an appended zero weight and zero cotangent); g_w[n, j] = g_y[n] ·
    y_rows[row_of_pair[n, j]]. Gathers only, no scatter-add.
    """
    return _combine_fwd(y_rows, weights, row_of_pair, pair_of_row, sink)[0]


def _combine_fwd(y_rows, weights, row_of_pair, pair_of_row, sink):
    y_pairs = _gather_rows(y_rows, row_of_pair, not sink)  # [N, k, d]
    return jnp.einsum("nk,nkd->nd", weights, y_pairs), (y_pairs, weights, pair_of_row)


def _combine_bwd(sink, res, g_y):
    y_pairs, weights, pair_of_row = res
    g_w = jnp.einsum("nd,nkd->nk", g_y, y_pairs)
    g_rows = _pair_rows(weights, pair_of_row)[:, None] * _token_rows(
        g_y, pair_of_row, weights.shape[1]
    )
    return g_rows, g_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


# --------------------------------------------------------------------------------------------
# Expert parallelism


def _sharded(
    x,
    indices,
    weights,
    gate_proj,
    up_proj,
    down_proj,
    *,
    impl,
    platform,
    mesh,
    axis,
    ep,
    split_tokens,
    token_axes,
    block_size,
):
    """``_local_ffn`` inside a shard_map that is manual over every mesh axis (a partially manual
    one, with e.g. ``tensor`` left to the compiler, aborts XLA 0.10's SPMD partitioner): rows
    split over ``token_axes`` (and over ``axis`` with ``split_tokens``), experts over ``axis``;
    every other axis sees replicated operands (the boundary gathers what the weights' own
    shardings split, e.g. FSDP or tensor-split widths)."""
    n, k = indices.shape
    shards = math.prod(int(mesh.shape[a]) for a in token_axes)
    e_local = gate_proj.shape[0] // ep
    n_pad = -n % (shards * (ep if split_tokens else 1))
    if n_pad:
        # Padding tokens get gate 0 on expert 0: they contribute nothing and are sliced off.
        x = jnp.pad(x, ((0, n_pad), (0, 0)))
        indices = jnp.pad(indices, ((0, n_pad), (0, 0)))
        weights = jnp.pad(weights, ((0, n_pad), (0, 0)))
    path = _resolve(impl, platform, (n + n_pad) // shards, k, e_local, block_size)

    def body(xs, idx, w, gp, up, dp):
        if token_axes:
            # The expert weights are the same on every row shard; the blocked path's custom VJP
            # returns their cotangent per shard, so they enter it as per-shard values (this
            # cast's transpose is the psum over the row shards that autodiff would insert).
            gp, up, dp = (jax.lax.pcast(a, token_axes, to="varying") for a in (gp, up, dp))
        if ep == 1:
            return _local_ffn(path, xs, idx, w, gp, up, dp, offset=0, block_size=block_size)
        if split_tokens:
            xs, idx, w = (jax.lax.all_gather(a, axis, tiled=True) for a in (xs, idx, w))
        else:
            # The sorted rows differ per device (each sorts for its own experts), so the
            # replicated x enters them as a per-device value; this cast's transpose is the psum
            # of x's cotangent over the axis, which the custom-VJP gathers cannot insert.
            # The gates likewise enter the custom-VJP combine (their cotangent psums back).
            xs, w = (jax.lax.pcast(a, axis, to="varying") for a in (xs, w))
        offset = jax.lax.axis_index(axis) * e_local
        y = _local_ffn(path, xs, idx, w, gp, up, dp, offset=offset, block_size=block_size)
        if split_tokens:
            return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, axis)

    rows = token_axes + ((axis,) if split_tokens else ())
    tok = P(rows or None)
    experts = P(axis) if ep > 1 else P()
    y = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, tok, tok, experts, experts, experts),
        out_specs=tok,
    )(x, indices, weights, gate_proj, up_proj, down_proj)
    return y[:n] if n_pad else y

"""Parameter sharding rules for a (data, expert, model) mesh: expert parallel + tensor parallel.

The rules follow Megatron-style tensor parallelism (Shoeybi et al. 2019) for attention and dense
SwiGLU blocks and GShard-style expert parallelism (Lepikhin et al. 2020) for the routed experts:

====================================  ======================  =================================
parameter (shape)                     spec                    why
====================================  ======================  =================================
``embed_tokens`` [V, d]               (model, None)           vocabulary split
``lm_head.kernel`` [d, V]             (None, model)           logits split over the vocabulary
``self_attn.{q,k,v}_proj`` [d, H·D]   (None, model)           column parallel: heads split
``self_attn.o_proj`` [H·D, d]         (model, None)           row parallel: one all-reduce
dense ``mlp.{gate,up}_proj`` [d, f]   (None, model)           column parallel
dense ``mlp.down_proj`` [f, d]        (model, None)           row parallel
``mlp.gate.kernel`` [d, E]            replicated              router: same routing everywhere
``mlp.{gate,up}_proj`` [E, d, f]      (expert, None, model)   experts split, width split
``mlp.down_proj`` [E, f, d]           (expert, model, None)   same split, row parallel
norms (RMSNorm weights)               replicated              tiny
====================================  ======================  =================================

Parameters are replicated over the ``data`` axis (plain data parallel: the batch is split there,
gradients are averaged there). The router stays replicated on purpose: routing is a discrete
decision, and splitting its matmul would change reduction order and so flip near-tie top-k choices
between devices and between the trainer and the engine (the mismatch R3 exists to remove).

These are GSPMD annotations: ``jax.jit`` inserts the collectives. The MoE layer of
``sat_jax.models`` computes every expert densely, so with experts split over ``expert`` each device
computes only its experts and one all-reduce sums them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from sat_jax.models.hf import param_path

_EXPERT = "expert"
_MODEL = "model"


def _rule(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical spec (entries "expert", "model" or None) of one parameter from its path."""
    names = [k for k in path if isinstance(k, str)]
    last = names[-1] if names else ""
    if path == ("embed_tokens",):
        return (_MODEL, None)
    if path[:1] == ("lm_head",):
        return (None, _MODEL)
    if ndim == 3 and "mlp" in names:  # stacked routed experts [E, in, out]
        return (_EXPERT, None, _MODEL) if last in ("gate_proj", "up_proj") else (
            _EXPERT, _MODEL, None)
    if ndim == 2 and last == "kernel":
        owner = names[-2]
        if owner in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return (None, _MODEL)
        if owner in ("o_proj", "down_proj"):
            return (_MODEL, None)
    return (None,) * ndim  # router, shared-expert gate, norms: replicated


def sharding_rules(
    params: nnx.State,
    *,
    mesh_axes: Sequence[str | None] = ("data", "expert", "model"),
    mesh: jax.sharding.Mesh | None = None,
) -> nnx.State:
    """``PartitionSpec`` per parameter, a tree shaped like ``params`` (see the module table).

    Args:
      params: parameter ``nnx.State`` (arrays or ``jax.ShapeDtypeStruct``s; only shapes are read).
      mesh_axes: names of the (data, expert, model) mesh axes; None drops that role (e.g.
        ``("data", None, "model")`` replicates experts). The data axis only names the mesh axis
        parameters are replicated over.
      mesh: optional; when given, a dimension whose size its mesh axis does not divide (or whose
        axis the mesh lacks) is left unsplit instead of failing at placement.
    Returns:
      a tree of ``PartitionSpec`` with the structure of ``params``. Place with
      ``jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))``.

    Example::

        mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "model"))
        specs = sharding_rules(params, mesh=mesh)
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    """
    if len(mesh_axes) != 3:
        raise ValueError(f"mesh_axes must name (data, expert, model) axes, got {mesh_axes!r}")
    roles = {_EXPERT: mesh_axes[1], _MODEL: mesh_axes[2]}
    sizes = dict(mesh.shape) if mesh is not None else None

    def spec(key_path, leaf) -> P:
        shape = tuple(leaf.shape)
        out = []
        for dim, role in zip(shape, _rule(param_path(key_path), len(shape)), strict=True):
            axis = roles.get(role) if role else None
            if axis is not None and sizes is not None and (
                axis not in sizes or dim % sizes[axis]
            ):
                axis = None
            out.append(axis)
        return P(*out)

    return jax.tree_util.tree_map_with_path(spec, params)

"""Logical axes of every parameter and the one table that maps them onto a device mesh.

Every parameter dimension has a logical axis name (derived from its path in the parameter tree:
``logical_axes``); ``LOGICAL_AXIS_RULES`` maps logical names to the mesh axes of
``sat_jax.parallel.make_mesh`` (``data``, ``fsdp``, ``expert``, ``tensor``; any may have size 1):

====================================  ================================  ==========================
parameter (unstacked shape)           logical axes                      mesh axes
====================================  ================================  ==========================
``embed_tokens`` [V, d]               (vocab, embed)                    (tensor, (fsdp, expert))
``lm_head.kernel`` [d, V]             (embed, vocab)                    ((fsdp, expert), tensor)
``self_attn.q_proj`` [d, H·D]         (embed, heads)                    ((fsdp, expert), tensor)
``self_attn.{k,v}_proj`` [d, Hk·D]    (embed, kv_heads)                 ((fsdp, expert), tensor)
``self_attn.o_proj`` [H·D, d]         (heads, embed)                    (tensor, (fsdp, expert))
dense ``mlp.{gate,up}_proj`` [d, f]   (embed, mlp)                      ((fsdp, expert), tensor)
dense ``mlp.down_proj`` [f, d]        (mlp, embed)                      (tensor, (fsdp, expert))
experts ``mlp.{gate,up}_proj``        (expert, expert_embed, mlp)       (expert, fsdp, tensor)
[E, d, f]
experts ``mlp.down_proj`` [E, f, d]   (expert, mlp, expert_embed)       (expert, tensor, fsdp)
router ``mlp.gate.kernel`` [d, E]     (router_embed, router_expert)     replicated
shared-expert gate [d, 1]             (router_embed, router_expert)     replicated
norms (RMSNorm weights)               (norm,)                           replicated
stacked blocks: leading [L]           layers                            replicated
====================================  ================================  ==========================

* FSDP (Zhao et al. 2023, ZeRO-3 of Rajbhandari et al. 2020): every large weight is split over
  ``fsdp`` along its model width, so parameters, gradients and optimizer state take 1/fsdp of
  the memory each, and GSPMD all-gathers a weight where it is used. Weights that are not experts
  are split over ``expert`` as well (the expert axis would otherwise hold full copies of them),
  so per-device parameter bytes are total / (fsdp · expert · tensor) up to the replicated norms
  and routers.
* Expert parallelism (GShard, Lepikhin et al. 2020): experts over ``expert``.
* Tensor parallelism (Megatron, Shoeybi et al. 2019): attention heads, KV heads, MLP / expert
  width and the vocabulary over ``tensor``.
* The router stays replicated on purpose: routing is a discrete decision, and a split router
  matmul changes the reduction order and so flips near-tie top-k choices between devices and
  between the trainer and the engine (the mismatch R3 exists to remove). Norms are tiny.
* The batch is split over ``(data, fsdp)`` (``BATCH_AXES``); parameters are replicated over
  ``data``.

A mesh that does not divide what the table splits is one ``ValueError`` (``check_mesh``), raised
before anything compiles, naming the mesh axis and the dimension; nothing silently falls back to
replication. Mesh axes of size 1 (or absent from the mesh) are dropped from the specs, so a 1-D
data mesh gives fully replicated parameters (``PartitionSpec()``), as plain data parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax.models.config import ModelConfig
from sat_jax.parallel import DATA, EXPERT, FSDP, TENSOR

#: Mesh axes the batch dimension is split over.
BATCH_AXES = (DATA, FSDP)

#: The one table: logical axis -> mesh axis (a name, a tuple of names, or None = replicated).
LOGICAL_AXIS_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": TENSOR,
    "embed": (FSDP, EXPERT),
    "heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "expert": EXPERT,
    "expert_embed": FSDP,
    "router_embed": None,
    "router_expert": None,
    "norm": None,
    # activations / cache
    "batch": BATCH_AXES,
    "length": None,
    "head_dim": None,
}

_Path = tuple[Any, ...]


def _key(k) -> Any:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    raise TypeError(f"unexpected key {k!r} in a parameter path")


def param_path(path) -> _Path:
    """A ``jax.tree_util`` key path into an ``nnx.State`` as a plain tuple, e.g.
    ``("moe_layers", "mlp", "gate_proj")`` (the variables' trailing ``.value`` dropped)."""
    out = tuple(_key(k) for k in path)
    return out[:-1] if out and out[-1] == "value" else out


_STACKS = ("moe_layers", "dense_layers")


def logical_axes(path: _Path, ndim: int) -> tuple[str, ...]:
    """Logical axis names of the parameter at ``path`` (a ``param_path`` tuple) of rank ``ndim``.

    Raises:
      ValueError: for a path the table does not know (a new parameter must be added here).
    """
    names = [k for k in path if isinstance(k, str)]
    stacked = bool(names) and names[0] in _STACKS
    lead = ("layers",) if stacked else ()
    rank = ndim - len(lead)
    last = names[-1] if names else ""
    owner = names[-2] if len(names) > 1 else ""
    axes: tuple[str, ...] | None = None
    if names == ["embed_tokens"]:
        axes = ("vocab", "embed")
    elif names[:1] == ["lm_head"]:
        axes = ("embed", "vocab")
    elif last == "weight":  # every RMSNorm
        axes = ("norm",)
    elif owner == "gate" or owner == "shared_expert_gate":  # router, shared-expert gate
        axes = ("router_embed", "router_expert")
    elif rank == 3 and last in ("gate_proj", "up_proj"):
        axes = ("expert", "expert_embed", "mlp")
    elif rank == 3 and last == "down_proj":
        axes = ("expert", "mlp", "expert_embed")
    elif last == "kernel" and owner == "q_proj":
        axes = ("embed", "heads")
    elif last == "kernel" and owner in ("k_proj", "v_proj"):
        axes = ("embed", "kv_heads")
    elif last == "kernel" and owner == "o_proj":
        axes = ("heads", "embed")
    elif last == "kernel" and owner in ("gate_proj", "up_proj"):
        axes = ("embed", "mlp")
    elif last == "kernel" and owner == "down_proj":
        axes = ("mlp", "embed")
    if axes is None or len(axes) != rank:
        raise ValueError(f"no logical axes for parameter {path} of rank {ndim}")
    return lead + axes


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _mesh_axes_of(logical: str, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes (present and of size > 1) a logical axis splits over."""
    rule = LOGICAL_AXIS_RULES[logical]
    if rule is None:
        return ()
    rule = (rule,) if isinstance(rule, str) else tuple(rule)
    return tuple(a for a in rule if sizes.get(a, 1) > 1)


def spec_for(logical: Sequence[str | None], mesh) -> P:
    """``PartitionSpec`` of an array with logical axes ``logical`` (None = unsplit) on ``mesh``."""
    sizes = _mesh_sizes(mesh)
    entries = []
    for name in logical:
        axes = () if name is None else _mesh_axes_of(name, sizes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:  # canonical: P() when replicated
        entries.pop()
    return P(*entries)


def batch_spec(mesh, ndim: int = 1, axis: int = 0) -> P:
    """Spec of an array whose ``axis`` is the batch: split over ``BATCH_AXES``."""
    logical = [None] * ndim
    logical[axis] = "batch"
    return spec_for(logical, mesh)


def check_mesh(config: ModelConfig, mesh, *, batch: int | None = None) -> None:
    """One clear error, before compiling, if ``mesh`` does not divide what the table splits.

    Checks every split dimension of ``config`` (experts over ``expert``; heads, KV heads, vocab,
    MLP and expert widths over ``tensor``; the model width over ``fsdp`` (× ``expert`` for
    non-expert weights)) and, when given, the global ``batch`` size over ``data × fsdp``.

    Raises:
      ValueError: naming the mesh axis, its size and the dimension it does not divide.
    """
    sizes = _mesh_sizes(mesh)
    dims: list[tuple[str, str, int]] = [
        ("vocab", "vocab_size", config.vocab_size),
        ("embed", "hidden_size", config.hidden_size),
        ("heads", "num_heads", config.num_heads),
        ("kv_heads", "num_kv_heads", config.num_kv_heads),
    ]
    if config.num_moe_layers:
        dims += [
            ("expert", "num_experts", config.num_experts),
            ("expert_embed", "hidden_size", config.hidden_size),
            ("mlp", "moe_intermediate_size", config.moe_intermediate_size),
        ]
        if config.shared_expert_intermediate_size:
            dims.append(
                ("mlp", "shared_expert_intermediate_size", config.shared_expert_intermediate_size)
            )
    if config.dense_layer_ids:
        dims.append(("mlp", "intermediate_size", config.intermediate_size))
    for logical, field, size in dims:
        _check_divides(sizes, _mesh_axes_of(logical, sizes), f"ModelConfig.{field}", size)
    if batch is not None:
        _check_divides(sizes, _mesh_axes_of("batch", sizes), "the batch size", batch)


def _check_divides(sizes, axes: tuple[str, ...], what: str, size: int) -> None:
    n = math.prod(sizes[a] for a in axes)
    if axes and size % n:
        detail = " × ".join(f"{a!r} ({sizes[a]})" for a in axes)
        raise ValueError(
            f"mesh axis {detail} of size {n} does not divide {what}={size}; choose a mesh whose "
            f"axes divide it (see sat_jax.models.sharding.LOGICAL_AXIS_RULES)"
        )


def sharding_rules(params, *, mesh) -> Any:
    """``PartitionSpec`` per parameter, a tree shaped like ``params`` (see the module table).

    Args:
      params: parameter ``nnx.State`` (arrays or ``jax.ShapeDtypeStruct``s; only shapes are read).
      mesh: the device mesh (axes named as in ``LOGICAL_AXIS_RULES``).
    Raises:
      ValueError: a split dimension the mesh axis does not divide, naming both.
    """
    sizes = _mesh_sizes(mesh)

    def spec(key_path, leaf) -> P:
        path = param_path(key_path)
        shape = tuple(leaf.shape)
        logical = logical_axes(path, len(shape))
        for dim, name in zip(shape, logical, strict=True):
            _check_divides(
                sizes,
                _mesh_axes_of(name, sizes),
                f"dimension {name!r} of parameter {'.'.join(map(str, path))}",
                dim,
            )
        return spec_for(logical, mesh)

    return jax.tree_util.tree_map_with_path(spec, params)


def named_shardings(specs, mesh) -> Any:
    """``NamedSharding(mesh, spec)`` for every ``PartitionSpec`` leaf of ``specs``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def cache_spec(mesh) -> P:
    """KV cache [L, B, S, kv_heads, head_dim]: batch over (data, fsdp), KV heads over tensor."""
    return spec_for(("layers", "batch", "length", "kv_heads", "head_dim"), mesh)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Sharding constraint of an activation by logical axes, under the mesh being traced for.

    Inside ``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` (the trainer step sets it) this
    pins e.g. the residual stream to ``("batch", None, None)`` so that GSPMD all-gathers FSDP
    weights where they are used instead of resharding activations to the weights' layout; with
    no mesh in context (the sampler, plain calls) it is the identity.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) & set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(logical, mesh))

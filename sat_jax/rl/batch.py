"""The rollout batch: one typed pytree from the sampler's output to the trainer step.

A :class:`RolloutBatch` holds the G samples of each prompt contiguously (B = prompts × G):

* ``tokens``, ``input_mask``: [B, P + N], the sampler's layout (left-padded prompt, response);
* ``response_mask``, ``behavior_logp``, ``cutoffs``, ``versions``: [B, N], per response token;
* ``routing``: [L, B, P + N − 1, k], the experts of every fed slot (batch on axis 1);
* ``advantages``, ``rewards``: [B].

It knows each field's batch axis, and so its ``PartitionSpec`` over the batch mesh axes
(:data:`BATCH_AXES`, ``("data", "fsdp")``, those of them a mesh has: ``batch_axes(mesh)``) and
how to split into minibatches. ``versions`` and ``rewards`` ride
along to the device for the logs; the step never reads them, so XLA drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax import _checks
from sat_jax.models.sharding import BATCH_AXES

# Fields whose batch dimension is not axis 0.
_BATCH_AXIS = {"routing": 1}


def batch_axes(mesh) -> tuple[str, ...]:
    """The batch axes (:data:`BATCH_AXES`) that ``mesh`` has."""
    return tuple(a for a in BATCH_AXES if a in mesh.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """A scored rollout batch (NumPy on the host, ``jax.Array`` once sharded); see the module
    docstring for shapes."""

    tokens: jax.Array
    input_mask: jax.Array
    response_mask: jax.Array
    behavior_logp: jax.Array
    cutoffs: jax.Array
    routing: jax.Array
    versions: jax.Array
    advantages: jax.Array
    rewards: jax.Array

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_sample(cls, out, advantages, rewards) -> RolloutBatch:
        """From a ``sat_jax.sampling.SampleOutput`` and the per-sequence scores, as NumPy."""
        sample = {k: np.asarray(getattr(out, k)) for k in cls.fields() if hasattr(out, k)}
        return cls(
            **sample,
            advantages=np.asarray(advantages, np.float32),
            rewards=np.asarray(rewards, np.float32),
        )

    @classmethod
    def abstract(
        cls,
        mesh,
        *,
        rows: int,
        prompt_width: int,
        response_width: int,
        num_moe_layers: int,
        experts_per_tok: int,
        axes: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """Shapes, dtypes and shardings of a batch on ``mesh`` (``jax.ShapeDtypeStruct`` leaves,
        nothing allocated): what ahead-of-time lowering of the trainer step takes."""
        t, n = prompt_width + response_width, response_width
        i32, f32, b = np.int32, np.float32, np.bool_
        shapes = {
            "tokens": ((rows, t), i32),
            "input_mask": ((rows, t), b),
            "response_mask": ((rows, n), b),
            "behavior_logp": ((rows, n), f32),
            "cutoffs": ((rows, n), f32),
            "versions": ((rows, n), i32),
            "routing": ((num_moe_layers, rows, t - 1, experts_per_tok), i32),
            "advantages": ((rows,), f32),
            "rewards": ((rows,), f32),
        }
        specs = cls.specs(batch_axes(mesh) if axes is None else axes)
        return cls(
            **{
                f: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, getattr(specs, f)))
                for f, (shape, dt) in shapes.items()
            }
        )

    @classmethod
    def batch_axis(cls, field: str) -> int:
        return _BATCH_AXIS.get(field, 0)

    @classmethod
    def specs(cls, axes: Sequence[str] = BATCH_AXES) -> RolloutBatch:
        """The same structure with each field's ``PartitionSpec``: batch axis over ``axes``."""
        axes = tuple(axes)
        return cls(**{f: P(*([None] * cls.batch_axis(f)), axes) for f in cls.fields()})

    @property
    def size(self) -> int:
        """B, the number of sequences."""
        return int(self.tokens.shape[0])

    def replace(self, **changes) -> RolloutBatch:
        return dataclasses.replace(self, **changes)

    def select(self, rows: slice) -> RolloutBatch:
        """The sequences ``rows`` of every field (along each field's batch axis)."""

        def take(f):
            value = getattr(self, f)
            index = (slice(None),) * self.batch_axis(f) + (rows,)
            return value[index]

        return RolloutBatch(**{f: take(f) for f in self.fields()})

    def shares_prompt(self, group_size: int, prompt_width: int, *, routing: bool = True) -> bool:
        """Whether every group of ``group_size`` consecutive rows has identical prompt slots:
        ``tokens`` and ``input_mask`` of the first ``prompt_width`` positions and, with
        ``routing``, the replayed experts of those fed slots. The sampler's G samples of one
        prompt do; it is what the trainer's shared-prompt program (``LossSpec.prompt_group``)
        relies on. Reads host copies (a device batch is fetched)."""
        g, p = int(group_size), int(prompt_width)
        if g < 1 or self.size % g or not 0 < p <= self.tokens.shape[1] - 1:
            return False
        fields = [np.asarray(self.tokens[:, :p]), np.asarray(self.input_mask[:, :p])]
        if routing:
            fields.append(np.moveaxis(np.asarray(self.routing[:, :, :p]), 1, 0))
        return all(_checks.first_differing_group(a, g) is None for a in fields)

    def minibatches(self, num: int) -> Iterator[RolloutBatch]:
        """``num`` equal, contiguous minibatches (whole groups when ``num`` divides the prompts)."""
        if num < 1 or self.size % num:
            raise ValueError(
                f"a batch of {self.size} sequences does not split into {num} equal minibatches"
            )
        if num == 1:
            yield self
            return
        size = self.size // num
        for i in range(num):
            yield self.select(slice(i * size, (i + 1) * size))

    def shard(self, mesh, axes: Sequence[str] | None = None) -> RolloutBatch:
        """Places a host batch on ``mesh``, each field's batch axis sharded over ``axes``
        (default: the mesh's batch axes, ``batch_axes(mesh)``).

        One process: ``self`` is the global batch. Several: it is this process's contiguous
        share (process i holds rows i·b … (i+1)·b − 1), assembled with
        ``jax.make_array_from_process_local_data``.
        """
        specs = self.specs(batch_axes(mesh) if axes is None else axes)
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        host = jax.tree.map(np.asarray, self)
        if jax.process_count() == 1:
            return jax.device_put(host, shardings)  # one call for all fields: half the time
        return jax.tree.map(jax.make_array_from_process_local_data, shardings, host)

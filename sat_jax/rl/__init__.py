"""The asynchronous RL system: the rollout batch, snapshots, lag modes, rollout sources, the
trainer step; the host loop that drives them is ``sat_jax.train``."""

from sat_jax.rl.batch import BATCH_AXES, RolloutBatch
from sat_jax.rl.lag import MODES, LagSchedule, lag_stats
from sat_jax.rl.snapshots import PLACEMENTS, SnapshotStore

__all__ = [
    "BATCH_AXES",
    "MODES",
    "PLACEMENTS",
    "LagSchedule",
    "RolloutBatch",
    "SnapshotStore",
    "lag_stats",
]

"""The asynchronous RL system: snapshots, lag modes, rollouts, trainer step and host loop."""

from sat_jax.rl.lag import MODES, LagSchedule, lag_stats
from sat_jax.rl.snapshots import SnapshotStore

__all__ = ["MODES", "LagSchedule", "SnapshotStore", "lag_stats"]

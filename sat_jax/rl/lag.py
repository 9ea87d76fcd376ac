"""Which parameter version samples which batch: the lag modes of Section 4.4.

Versions count optimizer updates: version v is the policy after v updates, version 0 the initial
(SFT) policy. Trainer step j consumes batch j and produces version j + 1. The realized lag of a
token sampled by version v and trained at step j is N = j − v (Eq. 25).

* ``fixed`` (k): batch j is sampled by version max(j − k, 0): every token has lag exactly k once
  j ≥ k. k = 0 is on-policy.
* ``broadcast`` (n): the rollout engine receives weights every n trainer steps and generates the
  next batch while the trainer works on the current one, so batch j comes from the newest
  broadcast version before step j: v(j) = n·⌊(j − 1)/n⌋. n = 1 is the usual one-step-off-policy
  pipeline; the paper's lag-8 runs are n = 8 (lags 1 … 8 within each window).
* ``stream``: fully asynchronous (see ``sat_jax.rl.stream``); versions are whatever the rollout
  worker held while decoding each token, recorded per token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("fixed", "broadcast", "stream")


@dataclasses.dataclass(frozen=True)
class LagSchedule:
    """The behaviour version of each batch in the synchronous lag modes.

    Args:
      mode: ``"fixed"``, ``"broadcast"`` or ``"stream"``.
      lag: k for ``fixed`` (≥ 0), n for ``broadcast`` (≥ 1); for ``stream`` it sizes the
        rollout queue's bound and has no effect on versions.
    """

    mode: str
    lag: int

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"lag mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.lag, (int, np.integer)) or isinstance(self.lag, bool):
            raise TypeError(f"lag must be an int, got {self.lag!r}")
        minimum = 1 if self.mode == "broadcast" else 0
        if self.lag < minimum:
            raise ValueError(f"lag for mode {self.mode!r} must be >= {minimum}, got {self.lag}")

    def version_for(self, step: int) -> int:
        """Behaviour version of batch ``step`` (``fixed``/``broadcast`` only)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.mode == "fixed":
            return max(step - self.lag, 0)
        if self.mode == "broadcast":
            return 0 if step == 0 else self.lag * ((step - 1) // self.lag)
        raise ValueError("version_for is undefined in stream mode: versions are recorded per token")

    def needed_after(self, step: int) -> set[int]:
        """Versions that batches after ``step`` will be sampled from (what a store must keep once
        step ``step`` has produced version ``step + 1``; versions not yet produced included)."""
        if self.mode == "stream":
            return set()
        return {self.version_for(i) for i in range(step + 1, step + self.lag + 2)}

    @property
    def capacity(self) -> int:
        """The most versions :meth:`needed_after` ever asks to hold together with the newest:
        k + 1 for ``fixed`` (the k stale versions and the newest), 2 for ``broadcast`` (the last
        broadcast copy and the newest, which becomes the next broadcast)."""
        if self.mode == "fixed":
            return self.lag + 1
        if self.mode == "broadcast":
            return 2
        raise ValueError("stream mode sizes its store by its queue (sat_jax.rl.stream)")


def lag_stats(versions: np.ndarray, response_mask: np.ndarray, step: int) -> dict[str, float]:
    """Realized per-token lag N = step − v and its split N = N_PQS + N_IQS (Eq. 25).

    N_PQS (versions that pass while the response is decoded) is v_last(b) − v_bt, with v_last the
    newest version that produced a token of response b; N_IQS (versions that pass while the
    finished response waits) is step − v_last(b).

    Args:
      versions: [B, N] int, the version of each response token (−1 on padding).
      response_mask: [B, N] bool.
      step: the trainer step consuming the batch.
    """
    versions = np.asarray(versions)
    mask = np.asarray(response_mask, bool)
    if not mask.any():
        return {
            "lag/mean": 0.0,
            "lag/max": 0.0,
            "lag/min": 0.0,
            "lag/pqs_mean": 0.0,
            "lag/iqs_mean": 0.0,
        }
    v_last = np.where(mask, versions, -1).max(axis=1, keepdims=True)
    lag = (step - versions)[mask]
    pqs = np.broadcast_to(v_last - versions, mask.shape)[mask]
    iqs = np.broadcast_to(step - v_last, mask.shape)[mask]
    return {
        "lag/mean": float(lag.mean()),
        "lag/max": float(lag.max()),
        "lag/min": float(lag.min()),
        "lag/pqs_mean": float(pqs.mean()),
        "lag/iqs_mean": float(iqs.mean()),
    }

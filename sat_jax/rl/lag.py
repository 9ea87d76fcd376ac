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
* ``sampled`` (mean m, cap C, distribution ``dist``): heterogeneous staleness. Each group of
  batch j draws its own lag L from a distribution on {1, …, C} with mean exactly m and is sampled
  by version max(j − L, 0), so one batch mixes fresh and very stale groups, as an asynchronous
  system with uneven queueing does (AReaL's staleness table, PipelineRL). ``dist`` is
  ``"geometric"`` (P(L = k) ∝ ρ^(k−1), light tail) or ``"zipf"`` (P(L = k) ∝ k^(−s), a power
  law, heavy tail), the shape parameter ρ or s solved so that E[L] = m (:func:`lag_pmf`).
* ``stream``: fully asynchronous (see ``sat_jax.rl.stream``); versions are whatever the rollout
  worker held while decoding each token, recorded per token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Seed-sequence tag of the lag draws (kept apart from every other use of the run's seed).
_LAG_STREAM = 0x1A6

MODES = ("fixed", "broadcast", "sampled", "stream")
#: Lag distributions of the ``sampled`` mode.
DISTRIBUTIONS = ("geometric", "zipf")


def _unnormalised(dist: str, cap: int, shape: float) -> np.ndarray:
    k = np.arange(1, cap + 1, dtype=np.float64)
    if dist == "geometric":  # ρ^(k−1) = exp((k − 1)·log ρ), shape = log ρ
        logw = (k - 1) * shape
    else:  # k^(−s), shape = s
        logw = -shape * np.log(k)
    return np.exp(logw - logw.max())


def lag_pmf(dist: str, mean: float, cap: int) -> np.ndarray:
    """P(L = k) for k = 1 … ``cap`` (index k − 1) of the ``sampled`` mode's lag distribution.

    ``"geometric"``: P(L = k) ∝ ρ^(k−1); ``"zipf"``: P(L = k) ∝ k^(−s). The mean is increasing in
    log ρ and decreasing in s, from 1 (all mass on k = 1) to ``cap`` (all mass on ``cap``), so for
    1 ≤ ``mean`` ≤ ``cap`` one shape parameter gives E[L] = ``mean`` (to 1e-9, by bisection).
    ρ < 1 and s > 0 (decreasing probabilities: most groups fresh, a tail of stale ones) hold
    exactly when ``mean`` < (cap + 1)/2, the uniform distribution's mean.

    Raises:
      ValueError: unknown ``dist``, ``cap`` < 1, or ``mean`` outside [1, ``cap``].
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"lag distribution must be one of {DISTRIBUTIONS}, got {dist!r}")
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
        raise ValueError(f"lag cap must be an int >= 1, got {cap!r}")
    if not 1 <= mean <= cap:
        raise ValueError(f"lag mean must lie in [1, cap={cap}], got {mean}")
    if cap == 1 or mean == 1 or mean == cap:
        pmf = np.zeros(cap)
        pmf[0 if mean == 1 else cap - 1] = 1.0
        return pmf
    sign = 1.0 if dist == "geometric" else -1.0  # the mean grows with sign·shape

    def mean_of(shape):
        w = _unnormalised(dist, cap, shape)
        return float(np.dot(np.arange(1, cap + 1), w) / w.sum())

    lo, hi = -1.0, 1.0
    while mean_of(sign * lo) > mean:
        lo *= 2
    while mean_of(sign * hi) < mean:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mean_of(sign * mid) < mean:
            lo = mid
        else:
            hi = mid
        if abs(mean_of(sign * mid) - mean) < 1e-12:
            break
    w = _unnormalised(dist, cap, sign * 0.5 * (lo + hi))
    return w / w.sum()


@dataclasses.dataclass(frozen=True)
class LagSchedule:
    """The behaviour version of each batch in the synchronous lag modes.

    Args:
      mode: ``"fixed"``, ``"broadcast"``, ``"sampled"`` or ``"stream"``.
      lag: k for ``fixed`` (≥ 0), n for ``broadcast`` (≥ 1), the mean lag for ``sampled``
        (1 ≤ lag ≤ cap); for ``stream`` it sizes the rollout queue's bound and has no effect on
        versions.
      dist: the ``sampled`` mode's distribution, ``"geometric"`` or ``"zipf"`` (:func:`lag_pmf`).
      cap: the ``sampled`` mode's largest lag C ≥ 1.
    """

    mode: str
    lag: int
    dist: str = "geometric"
    cap: int = 16

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"lag mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.lag, (int, np.integer)) or isinstance(self.lag, bool):
            raise TypeError(f"lag must be an int, got {self.lag!r}")
        minimum = 1 if self.mode in ("broadcast", "sampled") else 0
        if self.lag < minimum:
            raise ValueError(f"lag for mode {self.mode!r} must be >= {minimum}, got {self.lag}")
        if self.mode == "sampled":
            if isinstance(self.cap, (int, np.integer)) and self.lag > self.cap >= 1:
                raise ValueError(
                    f"the mean lag {self.lag} of mode 'sampled' is above its cap lag_cap="
                    f"{self.cap}: no distribution on 1..{self.cap} has that mean"
                )
            object.__setattr__(self, "_pmf", lag_pmf(self.dist, self.lag, self.cap))

    @property
    def pmf(self) -> np.ndarray:
        """``sampled`` mode: P(L = k) for k = 1 … cap (index k − 1)."""
        if self.mode != "sampled":
            raise ValueError(f"mode {self.mode!r} has no lag distribution")
        return self._pmf

    def group_lags(self, step: int, num_groups: int, seed: int) -> np.ndarray:
        """``sampled`` mode: the lag of each of the ``num_groups`` groups of batch ``step``, int64
        [num_groups], i.i.d. from :attr:`pmf`; a function of (seed, step) alone, so a resumed run
        draws the same lags."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([_LAG_STREAM, int(seed), int(step)])
        return rng.choice(np.arange(1, self.cap + 1), size=int(num_groups), p=self.pmf)

    def group_versions(self, step: int, num_groups: int, seed: int) -> np.ndarray:
        """``sampled`` mode: the behaviour version of each group of batch ``step``,
        max(step − L, 0) with L from :meth:`group_lags`."""
        return np.maximum(step - self.group_lags(step, num_groups, seed), 0)

    def version_for(self, step: int) -> int:
        """Behaviour version of batch ``step`` (``fixed``/``broadcast`` only)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.mode == "fixed":
            return max(step - self.lag, 0)
        if self.mode == "broadcast":
            return 0 if step == 0 else self.lag * ((step - 1) // self.lag)
        if self.mode == "sampled":
            raise ValueError("version_for is undefined in sampled mode: see group_versions")
        raise ValueError("version_for is undefined in stream mode: versions are recorded per token")

    def needed_after(self, step: int) -> set[int]:
        """Versions that batches after ``step`` will be sampled from (what a store must keep once
        step ``step`` has produced version ``step + 1``; versions not yet produced included)."""
        if self.mode == "stream":
            return set()
        if self.mode == "sampled":  # batch i ≥ step + 1 reads versions max(i − C, 0) … i − 1
            return set(range(max(step + 1 - self.cap, 0), step + 1))
        return {self.version_for(i) for i in range(step + 1, step + self.lag + 2)}

    @property
    def capacity(self) -> int:
        """The most versions :meth:`needed_after` ever asks to hold together with the newest:
        k + 1 for ``fixed`` (the k stale versions and the newest), 2 for ``broadcast`` (the last
        broadcast copy and the newest, which becomes the next broadcast), C + 1 for ``sampled``
        (the C versions a lag up to C can reach, and the newest)."""
        if self.mode == "fixed":
            return self.lag + 1
        if self.mode == "broadcast":
            return 2
        if self.mode == "sampled":
            return self.cap + 1
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

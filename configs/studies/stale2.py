"""Staleness study 2 (docs/results/stale2/CALIBRATION.md): staleness that differs within a batch.

* ``stale2-calib``: the calibration on seeds 0-3 (CALIBRATION.md, stated before its runs): GSPO,
  SAT-GSPO and the arms whose constant the calibration fixes (the tuned uniform clip, the
  age-aware clip, M2PO and BAPO, all in the GSPO family) on the sorting testbed under a
  heavy-tailed sampled lag (Zipf, cap 32) of mean 8, and the same mode at mean 1, lr 4e-5, 300
  steps, 128-prompt evaluations every 25 steps. Each arm's constant is swept by invocations that
  ``--set`` it and write their own ``--out`` (CALIBRATION.md gives the commands); the counted
  grid is added to this file with ``PROTOCOL.md``, before any counted run, as
  :func:`counted_grid` at the constants the calibration fixes (``python -m sat_jax.study.arms``).
* ``stale2``: the counted grid (docs/results/stale2/PROTOCOL.md) at the constants of
  docs/results/stale2/arms.md: the tuned clip's ε 0.05, the age-aware clip's κ 1.0, M2PO's τ
  1e-3 and BAPO's ρ₀ 0.5; seeds 20-31 (20-27 for the secondary arms).
* ``stale2-rerun``: the same protocol on seeds 32-43 (32-39), which no phase used.
"""

import dataclasses

from sat_jax.study.grid import stale_grid

#: The settings the calibration checks (CALIBRATION.md, "The setting to be checked").
SETTINGS = (
    "optim.learning_rate=4e-5",
    "num_steps=300",
    "eval.every=25",
    "eval.num_prompts=128",
    "lag_dist=zipf",
    "lag_cap=32",
)

#: The counted runs add 512-prompt evaluations where tail20 reads them (CALIBRATION.md).
FULL_EVALS = "eval.full_at=0,250,275,300"
PRIMARY_ARMS = ("gspo", "sat_gspo", "gspo_tight")


def counted_grid(
    *,
    tight_eps: float,
    kappa: float,
    tau: float | None,
    rho_target: float | None,
    first_seed: int = 20,
    name: str = "stale2",
):
    """Study 2's counted grid at the calibrated constants: GSPO, SAT-GSPO and the tuned clip
    (ε_low = ε_high = ``tight_eps``) at mean lag 1 and 8 on 12 seeds; the age-aware clip
    (``kappa``), M2PO (``tau``) and BAPO (``rho_target``) at mean lag 8 on the first 8 of them.
    ``tau`` or ``rho_target`` None: the calibration dropped that arm. The primary comparison is
    SAT-GSPO against the tuned clip at mean lag 8 (a paired difference, not an interaction).
    """
    secondary = {"age_clip_gspo": {"kappa": float(kappa)}}
    if tau is not None:
        secondary["m2po_gspo"] = {"tau": float(tau)}
    if rho_target is not None:
        secondary["bapo_gspo"] = {"rho_target": float(rho_target)}
    grid = stale_grid(
        (*PRIMARY_ARMS, *secondary),
        lags=(1, 8),
        seeds=12,
        first_seed=first_seed,
        baseline="gspo",
        primary=("sat_gspo", "gspo_tight"),
        primary_lag=8,
        tight_eps=tight_eps,
        preset="stale_sort",
        settings=(*SETTINGS, FULL_EVALS),
        lag_mode="sampled",
        arm_loss=secondary,
        arm_lags={arm: (8,) for arm in secondary},
        arm_seeds={arm: 8 for arm in secondary},
    )
    return dataclasses.replace(
        grid,
        name=name,
        description="staleness study 2 (docs/results/stale2/PROTOCOL.md): SAT-GSPO against the "
        "tuned uniform clip, the age-aware clip, M2PO and BAPO under a heavy-tailed sampled lag "
        "of mean 8 (Zipf, cap 32), and GSPO, SAT-GSPO and the clip at mean 1",
    )


#: The constants the calibration fixed (docs/results/stale2/arms.md, by CALIBRATION.md's rules).
ARM_CONSTANTS = dict(tight_eps=0.05, kappa=1.0, tau=1e-3, rho_target=0.5)

GRIDS = {
    "stale2": counted_grid(**ARM_CONSTANTS),
    "stale2-rerun": counted_grid(**ARM_CONSTANTS, first_seed=32, name="stale2-rerun"),
    "stale2-calib": dataclasses.replace(
        stale_grid(
            ("gspo", "sat_gspo", "gspo_tight", "age_clip_gspo", "m2po_gspo", "bapo_gspo"),
            lags=(1, 8),
            seeds=4,
            first_seed=0,
            baseline="gspo",
            primary=None,
            preset="stale_sort",
            settings=SETTINGS,
            lag_mode="sampled",
        ),
        name="stale2-calib",
        description="calibration of staleness study 2 (docs/results/stale2/CALIBRATION.md): "
        "the GSPO family under a heavy-tailed sampled lag of mean 8 (Zipf, cap 32) and at "
        "mean 1, seeds 0-3; settings chosen by manipulation checks, arms' constants by the "
        "rules stated there",
    ),
}

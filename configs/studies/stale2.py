"""Staleness study 2 (docs/results/stale2/CALIBRATION.md): staleness that differs within a batch.

* ``stale2-calib``: the calibration on seeds 0-3 (CALIBRATION.md, stated before its runs): GSPO,
  SAT-GSPO and the arms whose constant the calibration fixes (the tuned uniform clip, the
  age-aware clip, M2PO and BAPO, all in the GSPO family) on the sorting testbed under a
  heavy-tailed sampled lag (Zipf, cap 32) of mean 8, and the same mode at mean 1, lr 4e-5, 300
  steps, 128-prompt evaluations every 25 steps. Each arm's constant is swept by invocations that
  ``--set`` it and write their own ``--out`` (CALIBRATION.md gives the commands); the counted
  grid is added to this file with ``PROTOCOL.md``, before any counted run.
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

GRIDS = {
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

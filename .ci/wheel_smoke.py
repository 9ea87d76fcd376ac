"""Runs in a bare environment (the built wheel, jax, numpy and chex, nothing else): the losses
import and compute there. Run outside the checkout, so that the wheel is what gets imported."""

import importlib.util
import sys

import numpy as np

from sat_jax import losses

for extra in ("flax", "optax", "orbax", "ml_collections", "matplotlib"):
    if importlib.util.find_spec(extra) is not None:
        sys.exit(f"{extra} is installed: this environment is not the bare one the check needs")
if "site-packages" not in losses.__file__:
    sys.exit(f"sat_jax.losses came from {losses.__file__}, not from the installed wheel")

# On-policy every ratio is 1, so SAT's loss is minus the token mean of the advantages:
# rows of 3 and 2 active tokens with A = 1 and -0.5 give -(3 - 1) / 5.
logp = np.log(np.full((2, 3), 0.25, np.float32))
mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
out = losses.sat(logp, logp, np.array([1.0, -0.5], np.float32), mask, alpha=0.9)
np.testing.assert_allclose(out.loss, -0.4, rtol=1e-6)
np.testing.assert_allclose(out.metrics["mismatch"], 0.0, atol=1e-7)
print(f"wheel ok: sat_jax.losses from {losses.__file__}, SAT loss {float(out.loss):+.4f}")

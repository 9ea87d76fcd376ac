"""``sat_jax.losses`` needs jax, numpy and chex only: importing it loads none of the system's
dependencies (the built wheel is checked in a bare environment by .ci/run)."""

import json
import subprocess
import sys

SYSTEM_ONLY = ("flax", "optax", "orbax", "ml_collections", "tensorboardX", "matplotlib", "rich")


def test_importing_the_losses_loads_no_system_dependency():
    code = (
        "import json, sys; import sat_jax.losses, sat_jax.advantages; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "sat_jax.losses" in loaded
    heavy = [m for m in loaded if m.startswith(SYSTEM_ONLY)]
    assert heavy == []
    sat_modules = {m for m in loaded if m.startswith("sat_jax")}
    assert sat_modules <= {"sat_jax", "sat_jax._checks", "sat_jax.advantages"} | {
        m for m in sat_modules if m.startswith("sat_jax.losses")
    }

"""One process of a two-process CPU job that runs a cross-process program and prints its result
and whether JAX's persistent compilation cache is on.

Usage: python _cached_program.py PROCESS_ID PORT (the environment names the cache directory)
"""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sat_jax import parallel  # noqa: E402

process_id, port = int(sys.argv[1]), sys.argv[2]
parallel.maybe_initialize_distributed("on", f"127.0.0.1:{port}", 2, process_id)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
local = np.arange(2, dtype=np.float32) + 2 * process_id
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)


@jax.jit
def program(x):
    # Long enough to compile past any minimum compile time the environment sets for caching.
    for _ in range(50):
        x = jnp.sin(x) + 0.5 * jnp.cos(x)
    return jnp.sum(x)


print(f"cache on: {jax.config.jax_enable_compilation_cache}", flush=True)
print(f"result: {float(program(x)):.6f}", flush=True)

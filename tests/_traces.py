"""Counting how often jit traces and lowers a function, by name, from JAX's monitoring events.

jit traces a function once per new input type signature and lowers it once per new signature
of types and shardings, whatever its dispatch cache or the persistent compilation cache hold.
So the counts do not depend on what else the test process ran before, unlike ``jax.jit``'s
``_cache_size``, which counts entries of a process-wide dispatch cache (it read 0 for a step
that had run five times in a test worker that had run other tests first)."""

import contextlib
import dataclasses

import jax

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@dataclasses.dataclass
class Compiles:
    name: str
    traces: int = 0
    lowerings: int = 0

    def matches(self, fun_name: str) -> bool:
        # Lowering events name the module, e.g. ``jit(train_on_mesh)`` or ``jit_train_on_mesh``.
        return fun_name in (self.name, f"jit({self.name})", f"jit_{self.name}")


_ACTIVE: list[Compiles] = []


def _listen(event, _duration, fun_name="", **_kw):
    for seen in _ACTIVE:
        if seen.matches(fun_name):
            if event == _TRACE:
                seen.traces += 1
            elif event == _LOWER:
                seen.lowerings += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def compiles_of(fun_name: str):
    """Counts the traces and lowerings of every function named ``fun_name`` while open."""
    seen = Compiles(fun_name)
    _ACTIVE.append(seen)
    try:
        yield seen
    finally:
        _ACTIVE.remove(seen)

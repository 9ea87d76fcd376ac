"""One run of the staleness protocol, old decode layout against new, with where the time goes.

Runs a reduced protocol run (one arm and seed of the ``stale`` grid in
``configs/studies/stale.py``: ``stale_sort``, its model, warm-up, learning rate and evaluation
set; ``--steps`` steps, an evaluation every ``--eval-every`` steps of ``--eval-prompts``
held-out prompts × 8) once per decode layout (``sat_jax.rl.rollout.DECODE_LAYOUT`` and
``VERSIONS_LAYOUT``): ``per_call`` (the old path: evaluation in training-shaped calls, one
decode per behaviour version), ``merged`` (the default: large evaluation calls of one shape, one
decode per behaviour version) and, with ``--layouts per_call,merged,vmapped``, ``vmapped``
(large evaluation calls, every version of a sampled-lag batch in one vmap'd decode), and with
``prefetch`` in ``--layouts``, ``prefetch`` (merged, with ``rollout.prefetch``: batch s + 1 rolled
out on a second CPU device, ``mesh.rollout_device=1``, while the trainer runs step s on the
first) and ``spread`` (merged, with ``rollout.decode_devices=2``: a sampled-lag batch's versions
decoded in turn on the two CPU devices, all dispatched before any is read; sampled lag only),
alternating ``--rounds`` times, in two settings:

* ``fixed``: study 1, a fixed lag of 4 (``--lag``);
* ``sampled``: study 2's setting, a Zipf-distributed lag per group (mean 8, cap 32, lr 4e-5).

Per run it prints the wall time and its phases: ``build`` (data, model, cached warm-up),
``compile`` (JAX tracing, lowering and XLA compilation, from ``jax.monitoring``; it overlaps the
phases below, each of which includes its own), ``rollout_decode`` (compiled decoding),
``rollout_host`` (tokenising, scoring, batch assembly), ``train_step``, ``eval``, ``metrics``
(the per-step statistics and logs) and ``other`` (the rest: publishing versions, checkpoints,
plots). ``new_over_old`` is merged wall time over per-call wall time (``vmapped_over_old`` and
``prefetch_over_old`` likewise; ``prefetch_over_new`` and ``spread_over_new`` over merged),
without ``build``, per setting (best round of each); below 1 the new layout is faster. The
process has two CPU devices (``--xla_force_host_platform_device_count=2``); every layout but
``prefetch`` and ``spread`` trains and samples on the first (``mesh.data=1``), as a one-device
run does.
``eval_max_abs_diff`` is the largest difference of a held-out metric between the layouts
(the same keys draw the same tokens; a bfloat16 engine's rounding can move a rare token).

The warm-up is trained on the first run of a seed (600 supervised steps) and cached in
``~/.cache/sat_jax``; ``--sft-steps`` overrides it (the smoke run). From the repository root:
``PYTHONPATH=$PWD python benchmarks/study_run.py [--steps 50 --eval-every 25 --eval-prompts 512]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

# Two CPU devices before JAX starts: the prefetch layout samples on the second.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import _results  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from sat_jax.rl import rollout  # noqa: E402
from sat_jax.run.metrics import read_metrics  # noqa: E402
from sat_jax.study.grid import expand, grids  # noqa: E402
from sat_jax.train import learner  # noqa: E402

#: layout name -> (rollout.DECODE_LAYOUT, rollout.VERSIONS_LAYOUT)
LAYOUTS = {
    "per_call": ("per_call", "per_version"),
    "merged": ("merged", "per_version"),
    "vmapped": ("merged", "vmapped"),
    "prefetch": ("merged", "per_version"),
    "spread": ("merged", "per_version"),
}
#: Config fields per layout (the others: the trainer and the engine on the first device).
LAYOUT_FIELDS = {
    "prefetch": {"rollout.prefetch": True, "mesh.rollout_device": 1},
    "spread": {"rollout.decode_devices": 2},
}
SETTINGS = {
    "fixed": {"lag_mode": "fixed"},
    "sampled": {
        "lag_mode": "sampled",
        "lag": 8,
        "lag_dist": "zipf",
        "lag_cap": 32,
        "optim.learning_rate": 4e-5,
    },
}
_COMPILE_EVENTS = ("/jax/core/compile/", "/jax/compilation_cache/")


class _Clock:
    """Seconds per phase of the run in progress, fed by wrappers and JAX's compile events."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, **_) -> None:
        if event.startswith(_COMPILE_EVENTS) and event.endswith("duration"):
            self.add("compile", duration)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + float(seconds)

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - t0)

        return wrapper


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _config(setting: str, layout: str, workdir: str, args):
    (_, c), *_ = expand(grids()["stale"], workdir)
    c.seed = args.seed
    c.lag = args.lag
    c.mesh.data = 1
    for key, value in {**SETTINGS[setting], **LAYOUT_FIELDS.get(layout, {})}.items():
        node, *path = c, *key.split(".")
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    c.workdir, c.resume = os.path.join(workdir, "run"), False
    c.num_steps, c.eval.every, c.eval.num_prompts = args.steps, args.eval_every, args.eval_prompts
    if args.sft_steps is not None:
        c.sft.steps = args.sft_steps
    return c


def run(setting: str, layout: str, clock: _Clock, args) -> dict:
    """One run; its wall time broken into phases (seconds)."""
    # Each run compiles its own programs, as a fresh protocol run does.
    jax.clear_caches()
    from sat_jax.sampling import sampler

    sampler._JIT_CACHE.clear()
    clock.seconds = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        decode, versions = LAYOUTS[layout]
        stack.enter_context(_patched(rollout, "DECODE_LAYOUT", decode))
        stack.enter_context(_patched(rollout, "VERSIONS_LAYOUT", versions))
        stack.enter_context(_patched(learner, "build", clock.timed("build", learner.build)))
        stack.enter_context(_patched(learner, "_eval", clock.timed("eval", learner._eval)))
        record = clock.timed("metrics", learner._Session.record)
        stack.enter_context(_patched(learner._Session, "record", record))
        t0 = time.perf_counter()
        summary = learner.train(_config(setting, layout, tmp, args), quiet=True)
        wall = time.perf_counter() - t0
        rows = read_metrics(summary["workdir"])
    evals = {
        str(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")}
        for r in rows
        if any(k.startswith("eval/") for k in r)
    }
    hist = summary["history"]
    rollout_s = sum(h["time/rollout_s"] for h in hist)
    # Compiled rollout time: the step's compiled share less the train step's.
    decode_s = sum(
        (1.0 - h["time/outside_compiled_share"]) * h["time/step_s"] - h["time/train_s"]
        for h in hist
    )
    phases = {
        "build": clock.seconds.get("build", 0.0),
        "compile": clock.seconds.get("compile", 0.0),
        "rollout": rollout_s,
        "train_step": sum(h["time/train_s"] for h in hist),
        "eval": clock.seconds.get("eval", 0.0),
        "metrics": clock.seconds.get("metrics", 0.0),
    }
    phases["rollout_decode"] = min(decode_s, rollout_s)
    phases["rollout_host"] = rollout_s - phases["rollout_decode"]
    phases["other"] = wall - sum(
        phases[k] for k in ("build", "rollout", "train_step", "eval", "metrics")
    )
    versions = [h.get("rollout/versions", 1.0) for h in hist]
    return {
        "wall_s": round(wall, 2),
        "wall_without_build_s": round(wall - phases["build"], 2),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "mean_versions_per_batch": float(np.mean(versions)),
        "evals": evals,
    }


def _max_abs_diff(a: dict, b: dict) -> float:
    """Largest difference of one held-out metric at one step between two runs' ``evals``."""
    return max(
        (abs(a[step][k] - b[step][k]) for step in a for k in a[step] if k in b.get(step, {})),
        default=float("nan"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--lag", type=int, default=4, help="the fixed setting's lag")
    ap.add_argument("--seed", type=int, default=4, help="the protocol's first seed")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the layouts")
    ap.add_argument(
        "--layouts", default="per_call,merged", help=f"some of {sorted(LAYOUTS)}, per_call first"
    )
    ap.add_argument("--settings", default="fixed,sampled")
    ap.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (smoke runs)")
    args = ap.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown or not settings:
        ap.error(f"--settings must name some of {sorted(SETTINGS)}, got {args.settings!r}")
    layouts = [x for x in args.layouts.split(",") if x]
    if layouts[:2] != ["per_call", "merged"] or not set(layouts) <= set(LAYOUTS):
        ap.error(
            "--layouts must be per_call,merged and any of vmapped, prefetch, spread, got "
            f"{args.layouts!r}"
        )
    clock = _Clock()
    out = {
        "config": f"grid stale (configs/studies/stale.py) arm gspo, seed {args.seed}, "
        f"{args.steps} steps, eval every "
        f"{args.eval_every} steps on {args.eval_prompts} prompts x 8; fixed: lag {args.lag}; "
        "sampled: Zipf lag mean 8, cap 32, lr 4e-5",
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "rounds": args.rounds,
    }
    for setting in settings:
        # decode_devices spreads a sampled-lag batch's versions: a fixed lag has one.
        here = [x for x in layouts if not (x == "spread" and setting == "fixed")]
        rounds: dict[str, list[dict]] = {layout: [] for layout in here}
        for i in range(args.rounds):
            for layout in here if i % 2 == 0 else here[::-1]:
                rounds[layout].append(run(setting, layout, clock, args))
        best = {k: min(v, key=lambda r: r["wall_without_build_s"]) for k, v in rounds.items()}
        out[setting] = {
            "old": best["per_call"],
            "new": best["merged"],
            **{
                ("new" if layout == "merged" else layout) + "_over_old": round(
                    best[layout]["wall_without_build_s"] / best["per_call"]["wall_without_build_s"],
                    3,
                )
                for layout in here[1:]
            },
            "eval_max_abs_diff": _max_abs_diff(best["per_call"]["evals"], best["merged"]["evals"]),
            **({"per_round": rounds} if args.rounds > 1 else {}),
        }
        for layout in ("vmapped", "prefetch", "spread"):
            if layout in best:
                out[setting][layout] = best[layout]
        for layout in ("prefetch", "spread"):
            if layout in best:
                out[setting][f"{layout}_over_new"] = round(
                    best[layout]["wall_without_build_s"] / best["merged"]["wall_without_build_s"],
                    3,
                )
                out[setting][f"{layout}_eval_max_abs_diff"] = _max_abs_diff(
                    best["merged"]["evals"], best[layout]["evals"]
                )
    _results.write("study_run", out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

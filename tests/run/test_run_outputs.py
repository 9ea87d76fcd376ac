"""Run outputs: metrics JSONL round trip, resume, TensorBoard (sat_jax.run.metrics), plots
(sat_jax.run.plots), progress (sat_jax.run.progress), primary-only writing."""

import io
import json
import logging
import math
import struct
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.run.metrics import RunLogger, read_metrics
from sat_jax.run.plots import plot_compare, plot_run, smooth
from sat_jax.run.progress import Progress

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == _PNG_MAGIC, path
    assert len(data) > 2000, (path, len(data))


def test_no_module_shadows_the_standard_library():
    import pkgutil

    import sat_jax

    ours = {m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(sat_jax.__path__, "sat_jax.")}
    assert not ours & set(sys.stdlib_module_names)
    assert logging.getLogger is sys.modules["logging"].getLogger


def test_jsonl_round_trip_nan_inf_and_jax_scalars(tmp_path):
    with RunLogger(tmp_path, config={"lr": 1e-3, "method": "sat"}, enable_tensorboard=False) as lg:
        lg.log(1, {"loss": jnp.float32(0.5), "n": np.int32(3), "ok": True, "x": 2.0})
        lg.log(2, {"nan": jnp.array(jnp.nan), "inf": math.inf, "ninf": np.float64(-np.inf)})
        lg.log(3, {"pass@1": 0.25}, prefix="eval")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["time"], float) for r in records)
    r1 = records[0]
    assert r1["loss"] == 0.5 and r1["n"] == 3 and type(r1["n"]) is int and r1["ok"] is True
    r2 = records[1]
    assert math.isnan(r2["nan"]) and r2["inf"] == math.inf and r2["ninf"] == -math.inf
    assert records[2]["eval/pass@1"] == 0.25
    # The file itself is strict JSON: non-finite values are the documented strings.
    line2 = (tmp_path / "metrics.jsonl").read_text().splitlines()[1]
    raw = json.loads(line2, parse_constant=lambda c: pytest.fail(f"bare {c} in JSONL"))
    assert (raw["nan"], raw["inf"], raw["ninf"]) == ("NaN", "Infinity", "-Infinity")
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-3, "method": "sat"}


def test_bad_metrics_raise_clear_errors(tmp_path):
    with RunLogger(tmp_path, enable_tensorboard=False) as lg:
        with pytest.raises(ValueError, match="'v' must be a scalar"):
            lg.log(0, {"v": jnp.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            lg.log(0, {"step": 1})
        with pytest.raises(TypeError, match="numeric"):
            lg.log(0, {"s": np.str_("a")})


def test_resume_truncates_later_steps(tmp_path):
    with RunLogger(tmp_path, enable_tensorboard=False) as lg:
        for step in range(6):
            lg.log(step, {"r": float(step)})
    # A crash can leave half a line at the end; it must not break the resume.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "r"')
    with RunLogger(tmp_path, enable_tensorboard=False, resume_step=3) as lg:
        lg.log(4, {"r": 40.0})
    records = read_metrics(tmp_path)
    assert [(r["step"], r["r"]) for r in records] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def _read_tb_scalars(event_file) -> dict[str, list[tuple[int, float]]]:
    """Parses TFRecord framing by hand so the test needs no TensorBoard install."""
    from tensorboardX.proto import event_pb2

    data, pos, out = event_file.read_bytes(), 0, {}
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboardX")
    with RunLogger(tmp_path) as lg:
        lg.log(5, {"reward_mean": jnp.float32(0.75)}, prefix="train")
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert _read_tb_scalars(files[0])["train/reward_mean"] == [(5, 0.75)]


def test_missing_tensorboardx_warns_and_continues(tmp_path, monkeypatch, caplog):
    import sat_jax.run.metrics as run_logging

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes the import fail
    monkeypatch.setattr(run_logging, "_warned_no_tensorboardx", False)
    with caplog.at_level(logging.WARNING), RunLogger(tmp_path) as lg:
        lg.log(0, {"a": 1.0})
    assert any("tensorboardX" in r.getMessage() for r in caplog.records)
    assert read_metrics(tmp_path)[0]["a"] == 1.0
    assert not (tmp_path / "tensorboard").exists()


def test_non_primary_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with RunLogger(run_dir, config={"a": 1}, is_primary=False) as lg:
        lg.log(0, {"a": 1.0})
        lg.flush()
    out = io.StringIO()
    with Progress(10, is_primary=False, stream=out) as progress:
        progress.update(10, {"a": 1.0})
    assert not run_dir.exists() and out.getvalue() == ""


def _synthetic_run(run_dir, seed: int, steps: int = 12) -> None:
    rng = np.random.default_rng(seed)
    with RunLogger(run_dir, enable_tensorboard=False) as lg:
        for step in range(steps):
            lg.log(step, {"reward_mean": step / steps + 0.1 * rng.random()}, prefix="train")
            lg.log(
                step,
                {
                    "mismatch": 0.01 * rng.random(),
                    "clip_frac": 0.1,
                    "sat/gate_rate": 0.5,
                    "sat/q": 0.2 if step else math.nan,
                },
                prefix="loss",
            )
            lg.log(step, {"mean": 1.5, "max": 3}, prefix="lag")
            if step % 4 == 0:
                lg.log(step, {"pass@1": step / steps}, prefix="eval")


def test_plot_run_writes_pngs_for_present_panels(tmp_path):
    _synthetic_run(tmp_path / "run", seed=0)
    paths = plot_run(tmp_path / "run")
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "eval_accuracy.png",
        "mismatch.png",
        "clip_gate.png",
        "sat_q.png",
        "lag.png",
        "summary.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "run" / "plots"
        _assert_png(path)
    # A run without any panel key gets no plots.
    with RunLogger(tmp_path / "empty", enable_tensorboard=False) as lg:
        lg.log(0, {"other": 1.0})
    assert plot_run(tmp_path / "empty", tmp_path / "out") == []


def test_plot_compare_groups_seeds(tmp_path, caplog):
    dirs = [tmp_path / f"{m}-seed{s}" for m in ("sat", "ppo") for s in range(2)]
    for i, d in enumerate(dirs):
        _synthetic_run(d, seed=i, steps=8)
    with RunLogger(tmp_path / "no-key", enable_tensorboard=False) as lg:
        lg.log(0, {"x": 1.0})
    with caplog.at_level(logging.WARNING):
        out = plot_compare([*dirs, tmp_path / "no-key"], "train/reward_mean", tmp_path / "c.png")
    _assert_png(out)
    assert any("no-key" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="labels"):
        plot_compare(dirs, "train/reward_mean", tmp_path / "d.png", labels=["a"])
    with pytest.raises(ValueError, match="none of the"):
        plot_compare(dirs, "missing/key", tmp_path / "e.png")


def test_smooth_is_a_trailing_mean():
    values = np.array([0.0, 1.0, 2.0, 3.0, 10.0])
    # Hand-computed: means of [0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 10].
    np.testing.assert_allclose(smooth(values, 3), [0.0, 0.5, 1.0, 2.0, 5.0])
    np.testing.assert_array_equal(smooth(values, 1), values)
    with pytest.raises(ValueError, match="window"):
        smooth(values, 0)


def test_reward_panel_draws_raw_and_smoothed_lines(tmp_path, monkeypatch):
    import sat_jax.run.plots as plots

    _synthetic_run(tmp_path / "run", seed=0)
    labels = []
    monkeypatch.setattr(plots, "_new_figure", _recording_figure(plots._new_figure, labels))
    plots.plot_run(tmp_path / "run", panels={"reward": plots.PANELS["reward"]})
    assert labels[0] == ["train/reward_mean (raw)", "train/reward_mean (mean of 5 steps)"]


def _recording_figure(make, labels):
    def new_figure(figsize):
        fig = make(figsize)
        add = fig.add_subplot

        def add_subplot(*args, **kwargs):
            ax = add(*args, **kwargs)
            legend = ax.legend

            def record(*a, **k):
                labels.append([line.get_label() for line in ax.get_lines()])
                return legend(*a, **k)

            ax.legend = record
            return ax

        fig.add_subplot = add_subplot
        return fig

    return new_figure


@pytest.mark.parametrize("backend", ["auto", "plain", "rich", "tqdm"])
def test_progress_on_non_tty_stream(backend):
    out = io.StringIO()  # not a TTY, as in CI
    with Progress(10, is_primary=True, backend=backend, stream=out, print_every=5) as progress:
        for step in range(1, 11):
            progress.update(step, {"loss": jnp.float32(0.5), "lag": 2})
        progress.close()  # idempotent
    text = out.getvalue()
    if progress.backend == "plain":
        assert text.splitlines() == [
            line for line in text.splitlines() if line.startswith(("step 5/10", "step 10/10"))
        ]
        assert "loss=0.5 lag=2" in text
    assert backend != "auto" or progress.backend == "plain"

"""``save_hf`` into an existing checkpoint writes beside it and swaps: a failure midway leaves
the old checkpoint whole, a success replaces its weights (another shard count too) and keeps its
other files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import pytest

pytest.importorskip("safetensors", reason="needs the safetensors package (sat_jax[hf])")

from sat_jax.models import ModelConfig, hf, hf_save, init_model, load_hf, save_hf  # noqa: E402

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


def _assert_params(path, expected):
    _, _, params = load_hf(path)
    chex.assert_trees_all_equal(jax.tree.leaves(params), jax.tree.leaves(expected))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_failed_save_keeps_the_old_checkpoint_and_a_good_one_replaces_it(
    tmp_path, monkeypatch, exchange
):
    if not exchange:
        monkeypatch.setattr(hf_save, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    _, old = init_model(MODEL, seed=0)
    _, new = init_model(MODEL, seed=1)
    save_hf(path, MODEL, old, max_shard_size="20KB")  # sharded
    (path / "tokenizer.json").write_text('{"model": "kept"}')
    before = sorted(os.listdir(path))
    assert hf.INDEX_FILE in before and len([n for n in before if n.startswith("model-")]) > 1

    real = hf._import_safetensors()

    def failing_after_one_file():
        calls = []

        def save_file(arrays, filename, metadata=None):
            if calls:
                raise OSError(28, "No space left on device")
            calls.append(filename)
            real[1](arrays, filename, metadata=metadata)

        return real[0], save_file

    monkeypatch.setattr(hf, "_import_safetensors", failing_after_one_file)
    with pytest.raises(OSError, match="No space left"):
        save_hf(path, MODEL, new, max_shard_size="20KB")
    assert sorted(os.listdir(path)) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing half-written left beside it
    _assert_params(path, old)

    monkeypatch.setattr(hf, "_import_safetensors", lambda: real)
    save_hf(path, MODEL, new)  # one file now: the old shards and index go
    assert sorted(os.listdir(path)) == sorted([hf.CONFIG_FILE, hf.SINGLE_FILE, "tokenizer.json"])
    assert (path / "tokenizer.json").read_text() == '{"model": "kept"}'
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_params(path, new)


def test_save_into_a_symlinked_directory_replaces_its_target(tmp_path):
    _, params = init_model(MODEL, seed=0)
    target = tmp_path / "real"
    save_hf(target, MODEL, params)
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    _, new = init_model(MODEL, seed=1)
    assert save_hf(tmp_path / "link", MODEL, new) == tmp_path / "link"
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(target)
    _assert_params(target, new)
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # nothing left beside them


def test_a_killed_save_leaves_nothing_the_next_save_keeps(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now
    _, params = init_model(MODEL, seed=0)
    abandoned = tmp_path / f".ckpt.saving-{dead.pid}"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".ckpt.saving-{os.getppid()}"  # a live process's save in flight: kept
    live.mkdir()
    save_hf(tmp_path / "ckpt", MODEL, params)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", live.name])
    _assert_params(tmp_path / "ckpt", params)


def test_a_shard_under_a_symlinked_subdirectory_is_refused(tmp_path):
    _, params = init_model(MODEL, seed=0)
    save_hf(tmp_path / "outside", MODEL, params, max_shard_size="20KB")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "sub").symlink_to(tmp_path / "outside", target_is_directory=True)
    index = json.loads((tmp_path / "outside" / hf.INDEX_FILE).read_text())
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    (ckpt / hf.INDEX_FILE).write_text(json.dumps(index))
    (ckpt / hf.CONFIG_FILE).write_text((tmp_path / "outside" / hf.CONFIG_FILE).read_text())
    with pytest.raises(ValueError, match="symlink to a directory"):
        load_hf(ckpt)
    # A linked shard file (the Hugging Face cache's layout) still loads.
    (ckpt / "sub").unlink()
    (ckpt / "sub").mkdir()
    for v in set(index["weight_map"].values()):
        (ckpt / v).symlink_to(tmp_path / "outside" / v.split("/", 1)[1])
    _assert_params(ckpt, params)

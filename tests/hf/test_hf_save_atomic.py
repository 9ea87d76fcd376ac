"""``save_hf`` into an existing checkpoint writes beside it and swaps: a failure midway leaves
the old checkpoint whole, a success replaces its weights (another shard count too) and keeps its
other files."""

from __future__ import annotations

import os

import chex
import jax
import pytest

pytest.importorskip("safetensors", reason="needs the safetensors package (sat_jax[hf])")

from sat_jax.models import ModelConfig, hf, init_model, load_hf, save_hf  # noqa: E402

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
        monkeypatch.setattr(hf, "_exchange", lambda a, b: False)
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

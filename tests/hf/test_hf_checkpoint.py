"""save_hf / load_hf without torch: exact round trips, shard layout, dtypes, config mapping, and
clear errors for bad checkpoints (missing / unexpected / wrong-shape tensors, unsupported options).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="checkpoint tests need safetensors (sat_jax[hf])")
from _tiny_models import mixed_moe  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from sat_jax.models import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    hf_tensor_shapes,
    init_model,
    load_hf,
    param_path,
    save_hf,
)

CFG = mixed_moe(intermediate_size=24, rope_theta=1e6)

# The published config.json of Qwen3-30B-A3B(-Base) (transformers 4.51 layout), as the paper's
# config file holds it.
_spec = importlib.util.spec_from_file_location(
    "qwen3_30b_a3b_config",
    os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_30b_a3b.py"),
)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
QWEN3_30B_A3B = _module.QWEN3_30B_A3B_CONFIG


def _leaves(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {param_path(p): np.asarray(x) for p, x in flat}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    _, params = init_model(CFG, seed=3)
    path = tmp_path_factory.mktemp("ckpt")
    save_hf(path, CFG, params, max_shard_size="8KB")
    return path, params


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_round_trip_is_exact_and_sharded(saved):
    path, params = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    shapes = hf_tensor_shapes(CFG)
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == 4 * sum(math.prod(s) for s in shapes.values())
    with safe_open(
        str(path / index["weight_map"]["model.layers.0.mlp.experts.3.down_proj.weight"]),
        framework="numpy",
    ) as f:
        # Expert kernels are stored [out, in] like torch.nn.Linear: down_proj is [d, f].
        assert tuple(f.get_slice("model.layers.0.mlp.experts.3.down_proj.weight").get_shape()) == (
            32,
            16,
        )
    config, _, loaded = load_hf(path)
    assert config == CFG
    a, b = _leaves(params), _leaves(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_single_file_and_bfloat16(tmp_path):
    _, params = init_model(CFG, seed=4)
    save_hf(tmp_path, CFG, params, dtype="bfloat16")
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    config, graphdef, loaded = load_hf(tmp_path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert config.dtype == jnp.bfloat16
    chex.assert_type(list(_leaves(loaded).values()), jnp.bfloat16)
    want = _leaves(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    chex.assert_trees_all_equal(_leaves(loaded), want)
    # Saving again into the same directory as shards removes the stale single file.
    save_hf(tmp_path, CFG, params, max_shard_size="16KB")
    assert not (tmp_path / "model.safetensors").exists()
    load_hf(tmp_path)


def test_config_round_trip_and_the_paper_model():
    assert config_from_hf(config_to_hf(CFG)) == CFG
    dense = CFG.replace(mlp_only_layers=(0, 1))
    assert config_to_hf(dense)["model_type"] == "qwen3"
    got = config_from_hf(QWEN3_30B_A3B, router_aux_loss_coef=0.0)
    assert (got.num_layers, got.hidden_size, got.num_heads, got.num_kv_heads, got.head_dim) == (
        48,
        2048,
        32,
        4,
        128,
    )
    assert (got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size) == (128, 8, 768)
    assert got.norm_topk_prob and got.rope_theta == 1e6 and got.mlp_only_layers == ()
    assert got.router_aux_loss_coef == 0.0 and not got.tie_embeddings
    # 30.5B parameters, counted from shapes alone (nothing allocated).
    total = sum(math.prod(s) for s in hf_tensor_shapes(got).values())
    per_layer = (
        2048 * 4096 * 2 + 2048 * 512 * 2 + 2 * 128 + 2 * 2048 + 2048 * 128 + 128 * 3 * 2048 * 768
    )
    assert total == 48 * per_layer + 2 * 151936 * 2048 + 2048
    # transformers-5 layout of the same fields.
    v5 = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("rope_theta", "num_experts")}
    v5.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_local_experts=128)
    assert config_from_hf(v5) == config_from_hf(QWEN3_30B_A3B)
    # decoder_sparse_step and mlp_only_layers combine as in transformers.
    sparse = dict(QWEN3_30B_A3B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert config_from_hf(sparse).moe_layer_ids == (1, 5)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"hidden_size": None}, "'hidden_size'"),
    ],
)
def test_unsupported_configs_are_named(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(dict(QWEN3_30B_A3B, **change))


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match="not_a_field"):
        config_from_hf(QWEN3_30B_A3B, not_a_field=1)


def _edit_shard(path, name, edit):
    """Apply ``edit(dict of arrays)`` to the shard holding ``name`` and update the index."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"][name]
    arrays = load_file(str(path / shard))
    edit(arrays)
    save_file(arrays, str(path / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in arrays})
    index_file.write_text(json.dumps(index))


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "c")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    _edit_shard(path, name, lambda a: a.pop(name))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*experts\.2\.up_proj"):
        load_hf(path)


def test_unexpected_tensor_is_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "c")
    name = "model.layers.0.mlp.gate.weight"
    extra = "model.layers.0.mlp.experts.9.gate_proj.weight"
    _edit_shard(path, name, lambda a: a.__setitem__(extra, np.zeros((16, 32), np.float32)))
    with pytest.raises(ValueError, match=r"unexpected tensor.*experts\.9\.gate_proj"):
        load_hf(path)


@pytest.mark.parametrize(
    "name, bad, message",
    [
        # A kernel stored in our [in, out] layout instead of torch's [out, in].
        ("model.layers.1.self_attn.k_proj.weight", (32, 16), r"\(32, 16\), expected \(16, 32\)"),
        ("model.layers.0.mlp.gate.weight", (5, 32), r"\(5, 32\), expected \(4, 32\)"),
    ],
)
def test_wrong_shape_is_named(saved, tmp_path, name, bad, message):
    path = _copy(saved[0], tmp_path / "c")
    _edit_shard(path, name, lambda a: a.__setitem__(name, np.zeros(bad, np.float32)))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*" + message):
        load_hf(path)


def test_missing_files_are_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "c")
    (
        path
        / "model-00002-of-{:05d}.safetensors".format(
            len(
                set(
                    json.loads((path / "model.safetensors.index.json").read_text())[
                        "weight_map"
                    ].values()
                )
            )
        )
    ).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of"):
        load_hf(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(path)
    with pytest.raises(FileNotFoundError, match="neither"):
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "config.json").write_text(json.dumps(config_to_hf(CFG)))
        load_hf(empty)


def test_save_rejects_mismatched_params_and_bad_sizes(tmp_path):
    _, params = init_model(CFG, seed=0)
    with pytest.raises(ValueError, match="params do not match config"):
        save_hf(tmp_path, CFG.replace(num_layers=3), params)
    with pytest.raises(ValueError, match="max_shard_size"):
        save_hf(tmp_path, CFG, params, max_shard_size="lots")
    with pytest.raises(ValueError, match="shared_expert"):
        config_to_hf(CFG.replace(shared_expert_intermediate_size=8))
    with pytest.raises(ValueError, match="param_dtype"):
        save_hf(tmp_path, CFG, params)
        load_hf(tmp_path, param_dtype=jnp.int32)


def _edit_index(path, edit):
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index)
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize("file", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_weight_map_entries_stay_in_the_directory(saved, tmp_path, file):
    path = _copy(saved[0], tmp_path / "c")
    outside = tmp_path / "outside.safetensors"
    first = sorted(path.glob("model-*.safetensors"))[0]
    outside.write_bytes(first.read_bytes())  # a readable shard, but not the checkpoint's
    file = str(outside) if file == "ABS" else file
    name = "model.norm.weight"
    _edit_index(path, lambda index: index["weight_map"].__setitem__(name, file))
    with pytest.raises(ValueError, match=rf"entry '{name}': .* points outside the checkpoint"):
        load_hf(path)


@pytest.mark.parametrize(
    "index, message",
    [
        ("[1, 2]", "has no 'weight_map' object"),
        ('{"weight_map": ["model.norm.weight"]}', "has no 'weight_map' object"),
        ('{"weight_map": {"model.norm.weight": 5}}', "entry 'model.norm.weight': 5 is not a file"),
        ('{"weight_map": {"model.norm.weight": null}}', "entry 'model.norm.weight': None is not"),
        ('{"weight_map": {', "is not valid JSON"),
    ],
)
def test_malformed_index_is_one_clear_error(saved, tmp_path, index, message):
    path = _copy(saved[0], tmp_path / "c")
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=message):
        load_hf(path)


@pytest.mark.parametrize("dtype, shown", [(np.int64, "I64"), (np.int32, "I32"), (np.bool_, "BOOL")])
def test_integer_and_bool_weights_are_refused(saved, tmp_path, dtype, shown):
    path = _copy(saved[0], tmp_path / "c")
    name = "model.layers.0.input_layernorm.weight"
    _edit_shard(path, name, lambda a: a.__setitem__(name, np.ones(a[name].shape, dtype)))
    with pytest.raises(ValueError, match=rf"{re.escape(name)} in .* has dtype {shown}"):
        load_hf(path)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(saved, tmp_path, value):
    path = _copy(saved[0], tmp_path / "c")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"

    def poison(arrays):
        arrays[name] = arrays[name].copy()
        arrays[name][3, 2] = value

    _edit_shard(path, name, poison)
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight in .* holds 1 non-finite"):
        load_hf(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": "48"}, "field 'num_hidden_layers' must be an integer, got '48'"),
        ({"num_experts": 1.5}, "field 'num_experts' must be an integer, got 1.5"),
        ({"mlp_only_layers": 3}, "field 'mlp_only_layers' must be a list of layer indices"),
        ({"rms_norm_eps": "tiny"}, "field 'rms_norm_eps' must be a finite number"),
        ({"rope_theta": float("nan")}, "field 'rope_theta' must be a finite number"),
        ({"vocab_size": True}, "field 'vocab_size' must be an integer, got True"),
    ],
)
def test_malformed_config_fields_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**QWEN3_30B_A3B, **change})
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        config_from_hf([QWEN3_30B_A3B])

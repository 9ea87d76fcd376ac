"""configs/qwen3_30b_a3b.py and configs/qwen3_moe_small.py: get_config() returns the paper's values
and a model that sat_jax can build."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax.numpy as jnp
import pytest

pytest.importorskip("ml_collections", reason="config files need ml_collections")

from sat_jax.models import ModelConfig, config_from_hf, hf_tensor_shapes  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _get_config(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_paper_config():
    c = _get_config("qwen3_30b_a3b")
    assert (c.loss.objective, c.loss.r3) == ("sat_gspo", True)
    assert (c.rollout.group_size, c.rollout.prompts_per_step) == (16, 256)
    assert (c.loss.eps_low, c.loss.eps_high, c.loss.alpha, c.lag) == (0.2, 0.2, 0.9, 1)
    assert (c.optim.learning_rate, c.optim.b1, c.optim.b2) == (1e-6, 0.9, 0.98)
    assert (c.rollout.temperature, c.rollout.top_p, c.loss.kl_coef) == (1.0, 1.0, 1e-3)
    assert c.model.hf_path.startswith("REQUIRED")  # a local path, set on the command line
    assert (c.model.dtype, c.model.param_dtype) == ("bfloat16", "float32")
    assert c.model.attention_chunk > 0 and c.loss.logprob_chunk > 0  # 34,816-token rows
    model = config_from_hf(
        c.hf_config_reference.to_dict(),
        dtype=jnp.bfloat16,
        router_aux_loss_coef=c.model.router_aux_loss_coef,
    )
    assert model.dtype == jnp.bfloat16 and model.router_aux_loss_coef == 0.0
    assert (model.num_layers, model.num_experts, model.num_experts_per_tok) == (48, 128, 8)
    total = sum(math.prod(s) for s in hf_tensor_shapes(model).values())
    assert 30.4e9 < total < 30.6e9


def test_paper_config_stops_before_compute_until_paths_are_set():
    from sat_jax import config as config_lib

    with pytest.raises(ValueError, match="'REQUIRED:.*' does not exist"):
        config_lib.validate(_get_config("qwen3_30b_a3b"), num_devices=8)


def test_small_config_builds_a_model():
    c = _get_config("qwen3_moe_small")
    assert c.loss.objective == "sat_gspo" and c.loss.r3 and c.lag == 1
    fields = c.model.to_dict()
    assert fields.pop("hf_path") == ""
    model = ModelConfig(vocab_size=64, **fields)
    assert model.num_moe_layers == 4 and model.rope_theta == 1e6
    assert 1.5e6 < sum(math.prod(s) for s in hf_tensor_shapes(model).values()) < 2.5e6

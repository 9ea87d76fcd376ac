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
COMMON = ("objective", "eps_low", "eps_high", "alpha", "lag", "group_size", "prompts_per_step",
          "learning_rate", "b1", "b2", "temperature", "top_p", "seed")


def _get_config(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_paper_config():
    c = _get_config("qwen3_30b_a3b")
    for key in COMMON:
        assert key in c, key
    assert (c.objective, c.routing_replay) == ("sat_gspo", True)
    assert (c.group_size, c.prompts_per_step) == (16, 256)
    assert (c.eps_low, c.eps_high, c.alpha, c.lag) == (0.2, 0.2, 0.9, 1)
    assert (c.learning_rate, c.b1, c.b2) == (1e-6, 0.9, 0.98)
    assert (c.temperature, c.top_p) == (1.0, 1.0)
    assert c.model.hf_path is None  # a required local path, set on the command line
    model = config_from_hf(c.model.hf_config.to_dict(), dtype=c.model.dtype,
                           router_aux_loss_coef=c.model.router_aux_loss_coef)
    assert model.dtype == jnp.bfloat16 and model.router_aux_loss_coef == 0.0
    assert (model.num_layers, model.num_experts, model.num_experts_per_tok) == (48, 128, 8)
    total = sum(math.prod(s) for s in hf_tensor_shapes(model).values())
    assert 30.4e9 < total < 30.6e9


def test_small_config_builds_a_model():
    c = _get_config("qwen3_moe_small")
    assert c.loss.objective == "sat_gspo" and c.loss.r3 and c.lag == 1
    model = ModelConfig(vocab_size=64, **c.model.to_dict())
    assert model.num_moe_layers == 4 and model.rope_theta == 1e6
    assert 1.5e6 < sum(math.prod(s) for s in hf_tensor_shapes(model).values()) < 2.5e6

"""The warm-up cache (``sat_jax.rl.sft``): a second call with the same settings and code loads the
first's parameters; a change of the code digest (model source, JAX version), of the corrupted
share or of the schedule trains again; a corrupt entry is rebuilt."""

import glob
import json

import jax
import numpy as np
import pytest

from sat_jax.data.tasks import AdditionTask
from sat_jax.data.tokenizer import CharTokenizer
from sat_jax.models import ModelConfig, init_model
from sat_jax.rl import sft


def _warmup(cache_dir, params, graphdef, tokenizer, steps=2, **kwargs):
    return sft.warmup(
        graphdef,
        params,
        tokenizer,
        AdditionTask(1, eval_size=20),
        steps=steps,
        batch_size=4,
        learning_rate=1e-2,
        seed=0,
        prompt_width=6,
        response_width=3,
        cache_dir=str(cache_dir),
        cache_spec={"case": "test"},
        **kwargs,
    )


def _model():
    tokenizer = CharTokenizer()
    cfg = ModelConfig.tiny(
        vocab_size=tokenizer.vocab_size,
        num_layers=1,
        num_experts=4,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        moe_intermediate_size=8,
    )
    graphdef, params = init_model(cfg, seed=0)
    return tokenizer, graphdef, params


def test_cache_reuses_only_the_same_code(tmp_path, monkeypatch):
    tokenizer, graphdef, params = _model()
    assert len(sft.code_digest()) == 16 and sft.code_digest() == sft.code_digest()

    trained, info = _warmup(tmp_path, params, graphdef, tokenizer)
    assert info["sft/cached"] == 0.0
    digest = info["sft/digest"]
    again, info = _warmup(tmp_path, params, graphdef, tokenizer)
    assert info["sft/cached"] == 1.0
    jax.tree.map(np.testing.assert_array_equal, again, trained)
    assert info["sft/digest"] == digest == sft.params_digest(trained)

    monkeypatch.setattr(sft, "code_digest", lambda: "another-program")
    _, info = _warmup(tmp_path, params, graphdef, tokenizer)
    assert info["sft/cached"] == 0.0
    assert len(glob.glob(str(tmp_path / "sft-*.npz"))) == 2  # one entry per program

    for path in glob.glob(str(tmp_path / "sft-*.npz")):
        with open(path, "wb") as f:
            f.write(b"not an npz")
    rebuilt, info = _warmup(tmp_path, params, graphdef, tokenizer)
    assert info["sft/cached"] == 0.0
    jax.tree.map(np.testing.assert_array_equal, rebuilt, trained)  # same program, same result


def test_corrupt_share_is_in_the_key(tmp_path):
    tokenizer, graphdef, params = _model()
    clean, info = _warmup(tmp_path, params, graphdef, tokenizer)
    assert info["sft/cached"] == 0.0
    corrupted, info = _warmup(tmp_path, params, graphdef, tokenizer, corrupt_share=0.5)
    assert info["sft/cached"] == 0.0  # another warm-up, not the clean one's entry
    assert len(glob.glob(str(tmp_path / "sft-*.npz"))) == 2
    differs = jax.tree.map(lambda a, b: bool(np.any(a != b)), clean, corrupted)
    assert any(jax.tree.leaves(differs))
    _, info = _warmup(tmp_path, params, graphdef, tokenizer, corrupt_share=0.5)
    assert info["sft/cached"] == 1.0
    assert info["sft/digest"] == sft.params_digest(corrupted) != sft.params_digest(clean)
    with pytest.raises(ValueError, match=r"corrupt_share must be in \[0, 1\], got -0.5"):
        _warmup(tmp_path, params, graphdef, tokenizer, corrupt_share=-0.5)


def test_schedule_is_in_the_key_and_decays(tmp_path):
    """A cosine warm-up is its own cache entry; its first step is the constant one's (both at
    the peak rate), its second is not (the rate has decayed)."""
    tokenizer, graphdef, params = _model()
    one = {
        s: _warmup(tmp_path / "one", params, graphdef, tokenizer, steps=1, schedule=s)
        for s in sft.SCHEDULES
    }
    assert [info["sft/cached"] for _, info in one.values()] == [0.0, 0.0]
    assert len(glob.glob(str(tmp_path / "one" / "sft-*.npz"))) == 2
    jax.tree.map(np.testing.assert_array_equal, one["constant"][0], one["cosine"][0])
    two = {
        s: _warmup(tmp_path / "two", params, graphdef, tokenizer, schedule=s) for s in sft.SCHEDULES
    }
    differs = jax.tree.map(lambda a, b: bool(np.any(a != b)), two["constant"][0], two["cosine"][0])
    assert any(jax.tree.leaves(differs))
    with pytest.raises(ValueError, match=r"schedule must be one of .*got 'linear'"):
        _warmup(tmp_path, params, graphdef, tokenizer, schedule="linear")


def test_params_digest_is_an_exact_fingerprint():
    """One changed bit, dtype or shape changes the digest; a float JSON keeps it exactly."""
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    d = sft.params_digest(a)
    assert d == float(int(d)) and 0 <= d < 2**52
    assert json.loads(json.dumps(d)) == d
    flipped = np.arange(6, dtype=np.float32).reshape(2, 3)
    flipped.view(np.uint32)[1, 2] ^= 1  # the last bit of one value
    for other in (
        {"w": flipped, "b": a["b"]},
        {"w": a["w"].reshape(3, 2), "b": a["b"]},
        {"w": a["w"].astype(np.float64), "b": a["b"]},
    ):
        assert sft.params_digest(other) != d
    assert sft.params_digest({"w": a["w"].copy(), "b": a["b"].copy()}) == d

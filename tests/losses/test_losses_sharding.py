"""Data-parallel exactness: shard_map and pmap over 8 CPU devices equal the unsharded batch."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sat_jax import losses

NDEV = 8
B, T = 16, 6  # two sequences per device
OBJECTIVES = [
    ("ppo", {"dual_clip": 2.0}),
    ("sat", {"eps_low": 0.05, "eps_high": 0.05, "alpha": 0.8}),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.05}),
    ("gspo_token", {"eps_low": 0.05, "eps_high": 0.05}),
    ("sat_gspo", {"eps_low": 0.05, "eps_high": 0.05, "alpha": 0.8}),
    ("seqclip", {"low": 0.97, "high": 1.03}),
    ("dppo", {"delta": 0.02}),
    ("spo", {}),
    ("drpo", {"delta": 0.05}),
]


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= NDEV, "tests/conftest.py should provide 8 CPU devices"
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    beh = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    logp = (beh + rng.normal(0, 0.1, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B,)).astype(np.float32)
    # Uneven active counts per device: device 0 has none, device 1 one token, others random.
    lengths = rng.integers(0, T + 1, size=B)
    lengths[:2] = 0
    lengths[2:4] = [1, 0]
    mask = np.arange(T)[None, :] < lengths[:, None]
    logp[~mask] = np.inf  # padding must never matter, sharded or not
    return logp, beh, adv, mask


def _value_and_grad(fn, hp, axis_name=None):
    def f(logp, beh, adv, mask):
        def loss(x):
            out = fn(x, beh, adv, mask, axis_name=axis_name, **hp)
            return out.loss, out.metrics

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
        return value, metrics, grad

    return f


def _sharded(fn, hp, mesh, **kw):
    body = _value_and_grad(fn, hp, axis_name="data")
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=(P(), P(), P("data")), **kw
        )
    )


def _put(mesh, *arrays):
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    return [jax.device_put(a, sharding) for a in arrays]


def _assert_same(got, want, tag):
    (gv, gm, gg), (wv, wm, wg) = got, want
    np.testing.assert_allclose(gv, wv, rtol=1e-5, atol=1e-7, err_msg=tag)
    assert set(gm) == set(wm)
    for k in wm:
        np.testing.assert_allclose(gm[k], wm[k], rtol=1e-5, atol=1e-7, err_msg=f"{tag}:{k}")
    np.testing.assert_allclose(gg, wg, rtol=1e-5, atol=1e-8, err_msg=tag)


@pytest.mark.parametrize("name,hp", OBJECTIVES, ids=[n for n, _ in OBJECTIVES])
def test_shard_map_equals_unsharded(name, hp, mesh, batch):
    fn = losses.get(name)
    want = jax.jit(_value_and_grad(fn, hp))(*batch)
    got = _sharded(fn, hp, mesh)(*_put(mesh, *batch))
    _assert_same(got, want, name)
    if "sat/q" in want[1]:  # the global quantile is exact, not approximately equal
        assert float(got[1]["sat/q"]) == float(want[1]["sat/q"])


@pytest.mark.parametrize("name,hp", OBJECTIVES, ids=[n for n, _ in OBJECTIVES])
def test_pmap_equals_unsharded(name, hp, batch):
    fn = losses.get(name)
    want = jax.jit(_value_and_grad(fn, hp))(*batch)
    split = [a.reshape(NDEV, B // NDEV, *a.shape[1:]) for a in batch]
    value, metrics, grad = jax.pmap(_value_and_grad(fn, hp, axis_name="data"), axis_name="data")(
        *split
    )
    # Every device holds the global loss and metrics.
    for dev in range(NDEV):
        np.testing.assert_allclose(value[dev], want[0], rtol=1e-5, atol=1e-7)
        for k in want[1]:
            np.testing.assert_allclose(metrics[k][dev], want[1][k], rtol=1e-5, atol=1e-7, err_msg=k)
    # pmap transposes psum to psum: per-device input gradients carry a factor NDEV (documented).
    np.testing.assert_allclose(grad.reshape(B, T) / NDEV, want[2], rtol=1e-5, atol=1e-8)


def test_mismatch_metrics_sharded(mesh, batch):
    logp, beh, _, mask = batch
    want = losses.mismatch_metrics(logp, beh, mask)
    f = jax.jit(
        jax.shard_map(
            functools.partial(losses.mismatch_metrics, axis_name="data"),
            mesh=mesh,
            in_specs=(P("data"),) * 3,
            out_specs=P(),
        )
    )
    got = f(*_put(mesh, logp, beh, mask))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    split = [a.reshape(NDEV, B // NDEV, T) for a in (logp, beh, mask)]
    got = jax.pmap(functools.partial(losses.mismatch_metrics, axis_name="d"), axis_name="d")(*split)
    for k in want:
        np.testing.assert_allclose(got[k][3], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("method", ["radix", "bisect"])
def test_quantile_sharded_is_exact(method, mesh):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((NDEV * 37,)).astype(np.float32)
    mask = rng.random(x.shape) < np.repeat(np.linspace(0, 1, NDEV), 37)  # uneven per device
    f = jax.jit(
        jax.shard_map(
            lambda a, m: losses.quantile(a, m, 0.9, axis_name="data", method=method),
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=P(),
        )
    )
    got = f(*_put(mesh, x, mask))
    assert float(got) == float(losses.quantile(x, mask, 0.9, method=method))


def test_parameter_gradients_shard_map_and_pmap(mesh, batch):
    """With a replicated parameter, shard_map's gradient and pmap's pmean'd gradient are exact."""
    _, beh, adv, mask = batch
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(B, T, 3)).astype(np.float32)
    w = jnp.array([0.1, -0.2, 0.05])

    def loss(w, feats, beh, adv, mask, axis_name=None):
        logp = beh + jnp.einsum("btf,f->bt", feats, w)
        out = losses.sat(logp, beh, adv, mask, eps_low=0.05, eps_high=0.05, axis_name=axis_name)
        return out.loss

    want = jax.grad(loss)(w, feats, beh, adv, mask)
    sm = jax.jit(
        jax.shard_map(
            lambda w, *a: jax.grad(loss)(w, *a, axis_name="data"),
            mesh=mesh,
            in_specs=(P(),) + (P("data"),) * 4,
            out_specs=P(),
        )
    )
    np.testing.assert_allclose(sm(w, *_put(mesh, feats, beh, adv, mask)), want, rtol=1e-5)
    split = [a.reshape(NDEV, B // NDEV, *a.shape[1:]) for a in (feats, beh, adv, mask)]
    pm = jax.pmap(
        lambda w, *a: jax.lax.pmean(jax.grad(loss)(w, *a, axis_name="data"), "data"),
        axis_name="data",
        in_axes=(None, 0, 0, 0, 0),
    )
    np.testing.assert_allclose(pm(w, *split)[0], want, rtol=1e-5)


def _collective_shapes(hlo: str) -> list[str]:
    return re.findall(r"=\s+(.+?)\s+all-reduce(?:-start)?\(", hlo)


@pytest.mark.parametrize("method", ["radix", "bisect"])
def test_sharded_sat_has_no_token_sized_collectives(method, mesh):
    fn = functools.partial(losses.sat, quantile_method=method)
    shapes = {}
    for batch_rows in (16, 64):
        args = [
            jax.ShapeDtypeStruct((batch_rows, 32), jnp.float32),
            jax.ShapeDtypeStruct((batch_rows, 32), jnp.float32),
            jax.ShapeDtypeStruct((batch_rows,), jnp.float32),
            jax.ShapeDtypeStruct((batch_rows, 32), jnp.bool_),
        ]
        sharding = jax.sharding.NamedSharding(mesh, P("data"))
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
        hlo = _sharded(fn, {}, mesh).lower(*args).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo and "reduce-scatter" not in hlo
        shapes[batch_rows] = sorted(_collective_shapes(hlo))
        assert shapes[batch_rows], "expected psum collectives in the sharded loss"
    # Collective sizes do not grow with the number of tokens.
    assert shapes[16] == shapes[64]
    sizes = [int(n) for s in shapes[16] for n in re.findall(r"\[(\d+)\]", s)]
    if method == "bisect":
        assert not sizes, f"bisection should use scalar collectives only, got {shapes[16]}"
    else:
        assert max(sizes) <= 1 << 16, shapes[16]

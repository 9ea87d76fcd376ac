"""Every objective run four ways, as rlax's tests do (parameterized, no ``chex.variants``): eager,
jitted, under ``jax.shard_map`` and under ``jax.pmap`` over 8 CPU devices. Each way must give the
unsharded batch's loss, metrics and gradient: shapes and dtypes checked with chex, values against
the NumPy reference (``_loss_reference``) and the eager metrics, padding (``inf``) never leaking.

The same pattern checks a user's own objective: swap ``losses.get(name)`` for it.
"""

import functools
import operator
import re

import _loss_reference as ref
import chex
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
VARIANTS = ["eager", "jit", "shard_map", "pmap"]


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= NDEV, "tests/conftest.py should provide 8 CPU devices"
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _make_batch():
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


@pytest.fixture(scope="module")
def batch():
    return _make_batch()


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


def _split(*arrays):  # the leading batch axis as pmap's device axis
    return [a.reshape(NDEV, a.shape[0] // NDEV, *a.shape[1:]) for a in arrays]


def _pmapped(fn, hp, batch):
    value, metrics, grad = jax.pmap(_value_and_grad(fn, hp, axis_name="data"), axis_name="data")(
        *_split(*batch)
    )
    # Every device holds the global loss and metrics.
    chex.assert_shape(value, (NDEV,))
    chex.assert_trees_all_close(
        *(jax.tree.map(operator.itemgetter(d), (value, metrics)) for d in range(NDEV))
    )
    # pmap transposes psum to psum: per-device input gradients carry a factor NDEV (documented).
    return value[0], jax.tree.map(lambda x: x[0], metrics), grad.reshape(B, T) / NDEV


def _run(variant, fn, hp, batch, mesh):
    if variant == "eager":
        return _value_and_grad(fn, hp)(*batch)
    if variant == "jit":
        return jax.jit(_value_and_grad(fn, hp))(*batch)
    if variant == "shard_map":
        return _sharded(fn, hp, mesh)(*_put(mesh, *batch))
    return _pmapped(fn, hp, batch)


@functools.cache
def _eager_metrics(name):
    fn, hp = losses.get(name), dict(OBJECTIVES)[name]
    return jax.tree.map(np.asarray, dict(_value_and_grad(fn, hp)(*_make_batch())[1]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name,hp", OBJECTIVES, ids=[n for n, _ in OBJECTIVES])
def test_every_way_of_running_gives_the_unsharded_batch(name, hp, variant, mesh, batch):
    value, metrics, grad = _run(variant, losses.get(name), hp, batch, mesh)
    metrics = dict(metrics)
    chex.assert_shape(value, ())
    chex.assert_shape(list(metrics.values()), ())  # every metric a scalar
    chex.assert_shape(grad, (B, T))
    chex.assert_type([value, *metrics.values(), grad], jnp.float32)
    chex.assert_tree_all_finite((value, metrics, grad))  # the inf padding stays out
    logp, beh, adv, mask = batch
    clean = np.where(mask, logp, 0.0)
    want = ref.loss(name, clean, beh, adv, mask, **hp)
    want_grad = ref.grad(name, clean, beh, adv, mask, **hp)
    chex.assert_trees_all_close(value, np.float32(want), rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(grad, want_grad.astype(np.float32), rtol=2e-4, atol=2e-6)
    chex.assert_trees_all_close(metrics, _eager_metrics(name), rtol=1e-5, atol=1e-7)
    if "sat/q" in metrics:  # the global quantile is exact, not approximately equal
        chex.assert_trees_all_equal(metrics["sat/q"], _eager_metrics(name)["sat/q"])


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
    chex.assert_trees_all_close(dict(got), dict(want), rtol=1e-5, atol=1e-7)
    pmapped = functools.partial(losses.mismatch_metrics, axis_name="d")
    got = jax.pmap(pmapped, axis_name="d")(*_split(logp, beh, mask))
    chex.assert_trees_all_close({k: v[3] for k, v in got.items()}, dict(want), rtol=1e-5, atol=1e-7)


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
    chex.assert_trees_all_equal(got, losses.quantile(x, mask, 0.9, method=method))


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
    chex.assert_trees_all_close(sm(w, *_put(mesh, feats, beh, adv, mask)), want, rtol=1e-5)
    split = _split(feats, beh, adv, mask)
    pm = jax.pmap(
        lambda w, *a: jax.lax.pmean(jax.grad(loss)(w, *a, axis_name="data"), "data"),
        axis_name="data",
        in_axes=(None, 0, 0, 0, 0),
    )
    chex.assert_trees_all_close(pm(w, *split)[0], want, rtol=1e-5)


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

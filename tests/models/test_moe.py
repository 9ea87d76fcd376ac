"""Every routed-expert path (dense reference, ragged, blocked, expert-parallel) computes the same
function: a hand-computed example, then values and gradients against dense on random routings."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax.models import moe
from sat_jax.models.moe import expert_ffn

N, D, E, K, F = 24, 8, 8, 3, 4
PATHS = ("ragged", "blocked")  # "auto" is "blocked" on CPU at these sizes (see test_auto_...)


def _silu(v):
    return v / (1.0 + math.exp(-v))


def test_hand_example_every_path():
    # d = f = 1, E = 2: Expert_e(x) = silu(x·G_e) · (x·U_e) · D_e, written out per token.
    g, u, dn = [0.5, -1.0], [2.0, 0.25], [1.5, -2.0]
    x = jnp.array([[1.0], [2.0], [-1.0]])
    idx = jnp.array([[0, 1], [1, 0], [1, 1]], jnp.int32)  # token 2 lists expert 1 twice
    w = jnp.array([[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]])

    def expert(e, v):
        return _silu(v * g[e]) * (v * u[e]) * dn[e]

    want = [
        0.75 * expert(0, 1.0) + 0.25 * expert(1, 1.0),
        1.0 * expert(1, 2.0),
        1.0 * expert(1, -1.0),  # duplicates add: 0.5 + 0.5 of expert 1
    ]
    params = [jnp.array(v).reshape(2, 1, 1) for v in (g, u, dn)]
    for impl in ("dense", "auto") + PATHS:
        y = expert_ffn(x, idx, w, *params, impl=impl)
        np.testing.assert_allclose(y[:, 0], want, rtol=1e-6, err_msg=impl)


def _params(seed, dtype=jnp.float32, n=N):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (n, D))
    gp = 0.4 * jax.random.normal(ks[1], (E, D, F))
    up = 0.4 * jax.random.normal(ks[2], (E, D, F))
    dp = 0.4 * jax.random.normal(ks[3], (E, F, D))
    return tuple(a.astype(dtype) for a in (x, gp, up, dp)), ks[4]


def _routing(case, key, n=N):
    """indices [n, k] and softmax weights [n, k] of one routing pattern."""
    k = 1 if case == "k1" else K
    kz, kw = jax.random.split(key)
    if case in ("topk", "k1"):
        idx = jax.lax.top_k(jax.random.normal(kz, (n, E)), k)[1]
    elif case == "distinct_random":  # duplicate-free random sets, no logits behind them
        idx = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(kz, n))
    elif case == "one_expert":  # every token on expert 5 (k copies: duplicates add)
        idx = jnp.full((n, k), 5)
    elif case == "some_empty":  # experts 0, 3 and 6 only; the other five get no token
        idx = jnp.array([0, 3, 6])[jax.random.randint(kz, (n, k), 0, 3)]
    else:
        raise AssertionError(case)
    w = jax.nn.softmax(jax.random.normal(kw, (n, k)), axis=-1)
    return idx.astype(jnp.int32), w


def _value_and_grads(impl, idx, **kw):
    def loss(x, w, gp, up, dp):
        y = expert_ffn(x, idx, w, gp, up, dp, impl=impl, **kw)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

    def run(x, w, gp, up, dp):
        y = expert_ffn(x, idx, w, gp, up, dp, impl=impl, **kw)
        return y, jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, gp, up, dp)

    return jax.jit(run)


def _assert_same(got, want, tol=1e-5):
    """Leaf by leaf; for ``_value_and_grads``: y, then d/dx, d/dweights, d/dgate, d/dup, d/ddown."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=tol,
            atol=tol,
            err_msg=f"leaf {i}",
        )


@pytest.mark.parametrize("case", ["topk", "distinct_random", "one_expert", "some_empty", "k1"])
def test_every_path_equals_dense_values_and_gradients(case):
    (x, gp, up, dp), key = _params(0)
    idx, w = _routing(case, key)
    want = _value_and_grads("dense", idx)(x, w, gp, up, dp)
    assert float(jnp.max(jnp.abs(want[1][1]))) > 0  # the router-side gradient is not trivially 0
    for impl in PATHS:
        _assert_same(_value_and_grads(impl, idx)(x, w, gp, up, dp), want)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_blocked_any_block_size(block):
    # 1: every row its own block; 3: blocks straddle nothing but pad oddly; 64 > every group.
    (x, gp, up, dp), key = _params(1)
    idx, w = _routing("topk", key)
    want = _value_and_grads("dense", idx)(x, w, gp, up, dp)
    _assert_same(_value_and_grads("blocked", idx, block_size=block)(x, w, gp, up, dp), want)


def test_block_groups_by_hand(monkeypatch):
    # 3 weights of d·f = 2·2 float32 are 48 bytes a block; 100 bytes fit 2 blocks a group.
    monkeypatch.setattr(moe, "GROUP_BYTES", 100)
    assert moe._block_groups(2, 2, 2, 4) == (2, 1)
    assert moe._block_groups(5, 2, 2, 4) == (6, 3)  # 3 groups of 2; one padding block
    assert moe._block_groups(7, 2, 2, 4) == (8, 4)
    monkeypatch.setattr(moe, "GROUP_BYTES", 10)  # not even one block fits: one a group
    assert moe._block_groups(3, 2, 2, 4) == (3, 3)


@pytest.mark.parametrize("case", ["topk", "some_empty"])
def test_blocked_in_groups_equals_dense(monkeypatch, case):
    # Room for 2 blocks of 4 rows a group (3·D·F·4 = 384 bytes a block): 24 blocks in 12 groups,
    # the forward a lax.map and the backward a scan that sums the expert gradients.
    monkeypatch.setattr(moe, "GROUP_BYTES", 800)
    (x, gp, up, dp), key = _params(6)
    idx, w = _routing(case, key)
    assert moe._block_groups(moe._num_blocks(N * K, E, 4), D, F, 4)[1] > 1
    want = _value_and_grads("dense", idx)(x, w, gp, up, dp)
    _assert_same(_value_and_grads("blocked", idx, block_size=4)(x, w, gp, up, dp), want)


def test_blocked_backward_keeps_only_gate_and_up_activations():
    # What the VJP closes over: the inputs, the routing maps (ints) and the [nb, B, F] gate and
    # up activations; not the gathered rows [R, D], block weights [nb, D, F] or outputs.
    (x, gp, up, dp), key = _params(4)
    idx, w = _routing("topk", key)
    block = 4
    nb = moe._num_blocks(N * K, E, block)
    _, vjp = jax.vjp(
        lambda *a: expert_ffn(*a, impl="blocked", block_size=block), x, idx, w, gp, up, dp
    )
    floats = [a for a in jax.tree.leaves(vjp) if jnp.issubdtype(a.dtype, jnp.floating)]
    inputs = {a.shape for a in (x, w, gp, up, dp)}
    extra = sorted(a.shape for a in floats if a.shape not in inputs)
    assert extra == [(nb, block, F), (nb, block, F)]


def test_bfloat16_close_to_dense():
    (x, gp, up, dp), key = _params(2, jnp.bfloat16)
    idx, w = _routing("topk", key)
    want = expert_ffn(x, idx, w, gp, up, dp, impl="dense")
    for impl in ("ragged", "blocked"):
        y = expert_ffn(x, idx, w, gp, up, dp, impl=impl)
        chex.assert_type(y, jnp.bfloat16)
        chex.assert_trees_all_close(
            np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2
        )


def test_blocked_inside_remat_and_scan():
    # The MoE layer runs inside scanned, rematerialised blocks: the custom-VJP gathers must too.
    (x, gp, up, dp), key = _params(3)
    idx, w = _routing("topk", key)
    stack = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), (gp, up, dp))

    def net(impl):
        def layer(h, p):
            return h + expert_ffn(h, idx, w, *p, impl=impl), None

        def loss(h, s):
            return jnp.sum(jnp.sin(jax.lax.scan(jax.checkpoint(layer), h, s)[0]))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    _assert_same(net("blocked")(x, stack), net("dense")(x, stack))


def test_auto_picks_by_backend_and_size():
    assert moe._resolve("auto", "tpu", 1152, 4, 32, None) == "ragged"
    assert moe._resolve("auto", "gpu", 8, 4, 32, None) == "ragged"
    # Training shapes on CPU: B = 4608 / 64 → 64, ⌊(4608 + 32·63) / 64⌋ = 103 blocks, 6592 rows
    # against 36,864 dense rows: blocked.
    assert moe._default_block(1152 * 4, 32) == 64
    assert moe._num_blocks(1152 * 4, 32, 64) == 103
    assert moe._resolve("auto", "cpu", 1152, 4, 32, None) == "blocked"
    # One decode step of 8 sequences: 32 blocks of 8 rows = 256 = N·E rows, still blocked.
    assert moe._resolve("auto", "cpu", 8, 4, 32, None) == "blocked"
    # One token, 8 of 128 experts: 113 blocks of 8 rows = 904 > 2 · 128 rows: dense.
    assert moe._num_blocks(8, 128, 8) == 113
    assert moe._resolve("auto", "cpu", 1, 8, 128, None) == "dense"
    assert moe._resolve("blocked", "cpu", 1, 8, 128, None) == "blocked"


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.mark.parametrize(
    "shape, names, split, impl, n",
    [
        ((4, 2), ("data", "expert"), False, "blocked", N),
        ((2, 4), ("data", "expert"), True, "blocked", 22),  # 22 tokens: padded to 24 inside
        ((2, 2, 2), ("data", "expert", "tensor"), False, "ragged", N),
        ((2, 2, 2), ("data", "expert", "tensor"), True, "dense", N),
        ((2, 4), ("data", "expert"), False, "auto", N),
    ],
)
def test_expert_parallel_equals_dense(shape, names, split, impl, n):
    mesh = _mesh(shape, names)
    (x, gp, up, dp), key = _params(4, n=n)
    idx, w = _routing("some_empty", key, n)  # experts 0, 3, 6: some devices get no pair at all
    idx = idx.at[: n // 2].set(_routing("topk", key, n)[0][: n // 2])
    want = _value_and_grads("dense", idx)(x, w, gp, up, dp)
    tensor = "tensor" if "tensor" in names else None
    put = jax.device_put
    gp_s, up_s = (put(a, NamedSharding(mesh, P("expert", None, tensor))) for a in (gp, up))
    dp_s = put(dp, NamedSharding(mesh, P("expert", tensor, None)))
    x_s = put(x, NamedSharding(mesh, P("data" if n % 2 == 0 else None)))
    got = _value_and_grads(impl, idx, mesh=mesh, split_tokens=split)(x_s, w, gp_s, up_s, dp_s)
    _assert_same(got, want)


def test_expert_parallel_moves_only_what_it_should():
    # split_tokens=False: no token all-gather, one all-reduce; True: all-gather + reduce-scatter.
    mesh = _mesh((4, 2), ("data", "expert"))
    (x, gp, up, dp), key = _params(5)
    idx, w = _routing("topk", key)

    def hlo(split):
        f = jax.jit(lambda *a: expert_ffn(*a, impl="blocked", mesh=mesh, split_tokens=split))
        return f.lower(x, idx, w, gp, up, dp).compile().as_text()

    replicated, split = hlo(False), hlo(True)
    assert "all-reduce" in replicated and "all-gather" not in replicated
    assert "all-gather" in split and "reduce-scatter" in split


@pytest.mark.parametrize(
    "change, error, word",
    [
        ({"x": jnp.zeros((N,))}, ValueError, "`x` must have rank 2"),
        ({"x": jnp.zeros((N, D), jnp.int32)}, TypeError, "`x` must have a floating dtype"),
        ({"indices": jnp.zeros((N + 1, K), jnp.int32)}, ValueError, "`indices` must have shape"),
        ({"indices": jnp.zeros((N, K))}, TypeError, "`indices` must have an integer dtype"),
        ({"indices": jnp.full((N, K), E, jnp.int32)}, ValueError, r"indices must lie in \[0, 8\)"),
        ({"indices": jnp.full((N, K), -1, jnp.int32)}, ValueError, "indices must lie"),
        ({"weights": jnp.zeros((N, K + 1))}, ValueError, "`weights` must have shape"),
        ({"weights": jnp.zeros((N, K), jnp.int32)}, TypeError, "`weights` must have a float"),
        ({"gate_proj": jnp.zeros((E, D + 1, F))}, ValueError, "`gate_proj` must have shape"),
        ({"up_proj": jnp.zeros((E, D, F + 1))}, ValueError, "`up_proj` must have shape"),
        ({"down_proj": jnp.zeros((E, D, F))}, ValueError, "`down_proj` must have shape"),
        (
            {"down_proj": jnp.zeros((E, F, D), jnp.bfloat16)},
            ValueError,
            "down_proj must have x's dtype",
        ),
        ({"impl": "megablox"}, ValueError, "impl must be one of"),
        ({"block_size": 0}, ValueError, "block_size must be a positive int"),
    ],
)
def test_bad_input_names_the_argument(change, error, word):
    (x, gp, up, dp), key = _params(6)
    idx, w = _routing("topk", key)
    args = dict(x=x, indices=idx, weights=w, gate_proj=gp, up_proj=up, down_proj=dp)
    kwargs = {k: change.pop(k) for k in ("impl", "block_size") if k in change}
    args.update(change)
    with pytest.raises(error, match=word):
        expert_ffn(**args, **kwargs)


def test_expert_axis_must_divide_experts():
    mesh = _mesh((8,), ("expert",))
    (x, gp, up, dp), key = _params(7)
    idx, w = _routing("topk", key)
    gp6, up6, dp6 = gp[:6], up[:6], dp[:6]
    with pytest.raises(ValueError, match="'expert' of size 8 must divide the number of experts"):
        expert_ffn(x, idx % 6, w, gp6, up6, dp6, mesh=mesh)


def test_blocked_in_groups_under_expert_parallel_with_token_axes(monkeypatch):
    # The grouped scan inside the shard_map (rows split over data, experts over expert): its
    # float32 gradient carry must take the expert weights' varying axes.
    monkeypatch.setattr(moe, "GROUP_BYTES", 800)
    mesh = _mesh((4, 2), ("data", "expert"))
    (x, gp, up, dp), key = _params(7)
    idx, w = _routing("topk", key)
    want = _value_and_grads("dense", idx)(x, w, gp, up, dp)
    put = jax.device_put
    gp_s, up_s, dp_s = (put(a, NamedSharding(mesh, P("expert"))) for a in (gp, up, dp))
    x_s = put(x, NamedSharding(mesh, P("data")))
    got = _value_and_grads("blocked", idx, mesh=mesh, token_axes=("data",), block_size=2)(
        x_s, w, gp_s, up_s, dp_s
    )
    _assert_same(got, want)

"""Exact lower empirical quantile over active tokens, global over a data-parallel axis.

SAT's reference point (Eq. 14) is

    q = inf{x : F̂(x) ≥ α},   F̂(x) = (1/n) Σ_{active} 1{x_i ≤ x},

i.e. the ⌈α·n⌉-th smallest active value (1-based; n the number of active tokens). It needs neither a
sort nor an all-gather: float32 values map to 32-bit keys that order like the floats, so the k-th
smallest key can be found by counting. Two exact methods are offered:

* ``"radix"``: two histogram passes over the key (high 16 bits, then low 16 bits among the tokens of
  the selected high bucket). Two passes over the data; across devices it sums two fixed-size
  (2¹⁶-bucket) count vectors, whatever the batch size. Fastest on CPU and GPU, where a scatter-add
  histogram costs a few counting passes (``benchmarks/losses.py``'s ``floor_ms``). On XLA:CPU the
  scatter is fastest when inactive tokens come in runs (right-padded responses, as in RL
  batches): out-of-range updates are dropped by a well-predicted branch. A mask scattered at
  random over the batch makes the first pass slower (the result is the same).
* ``"bisect"``: a 32-step bisection over the key, each step one masked count (one scalar ``psum``).
  32 passes, but each is a plain compare-and-sum, which is what TPUs do best (they scatter slowly).

``"auto"`` picks ``"bisect"`` on TPU and ``"radix"`` elsewhere. Both give bit-identical results.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax.losses import _base

METHODS = ("auto", "radix", "bisect")

# α is read as the nearest fraction num/den with den ≤ 10⁴, so that ⌈α·n⌉ is exact in int32
# arithmetic for any n < 2³¹ (0.9 means 9/10, not the binary double just above it).
_MAX_DENOMINATOR = 10_000
_HALF = 16  # bits per radix pass
_BUCKETS = 1 << _HALF


def _rank(alpha: float, n: jax.Array) -> jax.Array:
    """``⌈α·n⌉`` exactly, as int32, for a traced int32 count ``n``."""
    frac = Fraction(alpha).limit_denominator(_MAX_DENOMINATOR)
    num, den = frac.numerator, frac.denominator
    whole, rest = n // den, n % den
    return whole * num + (rest * num + den - 1) // den


def _sortable_key(x: jax.Array) -> jax.Array:
    """Maps float32 to uint32 so that unsigned key order equals float order (-0 sorts before +0).

    Non-negative floats already order like their bit patterns; negative ones order in reverse, so
    their magnitude bits are flipped. Adding 2³¹ then makes the key unsigned.
    """
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _key_to_float(key: jax.Array) -> jax.Array:
    i = jax.lax.bitcast_convert_type(key ^ jnp.uint32(0x80000000), jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
    return jax.lax.bitcast_convert_type(i, jnp.float32)


def _histogram(index: jax.Array, active: jax.Array, weight: jax.Array | None) -> jax.Array:
    """Sum of ``weight`` (1 when None) per value of ``index`` in [0, 2¹⁶) over ``active`` positions.

    Inactive positions get an out-of-range index and are dropped by the scatter, so with unit
    weights the update operand is a scalar and only the index array is materialised (one pass
    fewer than a weighted scatter over the whole array).
    """
    index = jnp.where(active, index.astype(jnp.int32), _BUCKETS).ravel()
    updates = 1 if weight is None else weight.ravel()
    return jnp.zeros(_BUCKETS, jnp.int32).at[index].add(updates, mode="drop")


def _select_bucket(hist: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bucket holding the k-th smallest (1-based) element, and k's rank inside that bucket.

    Two levels of 2⁸ (row sums, then one row) instead of a cumulative sum over all 2¹⁶ buckets:
    XLA:CPU lowers a long cumsum to a chain of reduce-windows costing about a third of a
    histogram pass.
    """
    side = 1 << (_HALF // 2)
    rows = hist.reshape(side, side)
    row_sums = jnp.sum(rows, axis=1)

    def locate(counts, k):
        cum = jnp.cumsum(counts)
        i = jnp.minimum(jnp.sum(cum < k), side - 1).astype(jnp.int32)  # k == 0: empty input
        return i, k - (cum[i] - counts[i])

    row, k_in_row = locate(row_sums, k)
    col, k_in_bucket = locate(jax.lax.dynamic_index_in_dim(rows, row, keepdims=False), k_in_row)
    return row * side + col, k_in_bucket


def _radix_select(key, active, weight, alpha, axis_name):
    high, low = key >> _HALF, key & jnp.uint32(_BUCKETS - 1)
    hist = _base.psum(_histogram(high, active, weight), axis_name)
    n = jnp.sum(hist)  # the count comes free with the histogram: no extra pass over the tokens
    k = _rank(alpha, n)
    high_bucket, k_in = _select_bucket(hist, k)
    in_bucket = active & (high == high_bucket.astype(jnp.uint32))
    hist = _base.psum(_histogram(low, in_bucket, weight), axis_name)
    low_bucket, _ = _select_bucket(hist, k_in)
    return (high_bucket.astype(jnp.uint32) << _HALF) | low_bucket.astype(jnp.uint32), n


def _bisect_select(key, active, weight, alpha, axis_name):
    weight = active.astype(jnp.int32) if weight is None else jnp.where(active, weight, 0)
    n = _base.psum(jnp.sum(weight), axis_name)
    k = _rank(alpha, n)

    # Invariant: count(key <= hi) >= k, and (lo == 0 or count(key <= lo - 1) < k).
    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        count = _base.psum(jnp.sum(jnp.where(key <= mid, weight, 0)), axis_name)
        ok = count >= k
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, body, (jnp.uint32(0), jnp.uint32(0xFFFFFFFF)))
    return lo, n


def quantile(
    x: _base.ArrayLike,
    mask: _base.ArrayLike,
    alpha: float,
    axis_name=None,
    *,
    weights: _base.ArrayLike | None = None,
    method: str = "auto",
) -> jax.Array:
    """Exact lower empirical α-quantile of ``x`` over the positions where ``mask`` is set.

    Returns the ⌈α·n⌉-th smallest active value (Eq. 14 of "Stale but Stable"), with n the number
    of active positions counted over the whole data-parallel batch when ``axis_name`` is given. The
    result is detached and float32; it is 0 when no position is active.

    Args:
      x: array of any shape, float (computed in float32).
      mask: bool or 0/1 array of the same shape.
      alpha: quantile level in (0, 1], a Python float. It is read as the nearest fraction with
        denominator ≤ 10⁴, so ⌈α·n⌉ is computed exactly.
      axis_name: name of the ``shard_map``/``pmap`` axis to reduce over, or None.
      weights: optional non-negative integer multiplicities of the same shape: ``x[i]`` counts
        ``weights[i]`` times. SAT-GSPO uses it to take the token-level quantile of a sequence
        score from ``[B]`` values weighted by their active-token counts, without a ``[B, T]`` pass.
      method: ``"radix"``, ``"bisect"`` or ``"auto"`` (see the module docstring).

    Example:
      >>> quantile(jnp.array([3., 1., 2., 9.]), jnp.array([1, 1, 1, 0]), 0.5)
      Array(2., dtype=float32)
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    if (
        isinstance(alpha, (bool, np.bool_))
        or not isinstance(alpha, (int, float, np.number))
        or not 0.0 < float(alpha) <= 1.0
    ):
        raise ValueError(f"`alpha` must be a Python or NumPy float in (0, 1], got {alpha!r}.")
    x = _base.check_float("x", x)
    mask = _base.check_mask(mask, x.shape)
    weight = None
    if weights is not None:
        weights = _base._as_array("weights", weights)
        if not jnp.issubdtype(weights.dtype, jnp.integer) or weights.shape != x.shape:
            raise ValueError(
                f"`weights` must be an integer array of shape {tuple(x.shape)}, "
                f"got {weights.dtype}{list(weights.shape)}."
            )
        weight = jnp.maximum(weights.astype(jnp.int32), 0)
    if method == "auto":
        method = "bisect" if jax.default_backend() == "tpu" else "radix"
    key = _sortable_key(jax.lax.stop_gradient(x))
    select = _radix_select if method == "radix" else _bisect_select
    key, n = select(key, mask, weight, float(alpha), axis_name)
    return jnp.where(n > 0, _key_to_float(key), 0.0)


def _sums(x: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Σ x, count) over ``active``: float32 and int32 scalars."""
    return jnp.sum(jnp.where(active, x, 0.0)), jnp.sum(active.astype(jnp.int32))


def _bucket_sums(index: jax.Array, active: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per value of ``index`` in [0, 2¹⁶): Σ x and the count over ``active`` positions."""
    index = jnp.where(active, index.astype(jnp.int32), _BUCKETS).ravel()
    sums = jnp.zeros(_BUCKETS, jnp.float32).at[index].add(x.ravel(), mode="drop")
    return sums, jnp.zeros(_BUCKETS, jnp.int32).at[index].add(1, mode="drop")


def _last_within(sums, counts, start_sum, start_count, tau):
    """Index in [-1, 2¹⁶) of the last bucket at whose end the running mean is still ≤ ``tau``.

    The running (Σ x, count) starts at (``start_sum``, ``start_count``) and adds the buckets in
    order; its surplus Σ (x − tau) only grows past ``tau`` (every bucketed x exceeds it), so the
    test holds on a prefix of the buckets. Two levels of 2⁸, as :func:`_select_bucket`. Also
    returns the running (Σ x, count) at that bucket's end. The sums are in an order other than
    :func:`mean_bounded_keep`'s direct test, which checks the result.
    """
    side = 1 << (_HALF // 2)
    rows_s, rows_c = sums.reshape(side, side), counts.reshape(side, side)

    def prefix(s, c, s0, c0):
        cs, cc = s0 + jnp.cumsum(s), c0 + jnp.cumsum(c)
        good = cs <= tau * cc.astype(jnp.float32)
        return jnp.sum(good.astype(jnp.int32)), cs, cc

    row, cs, cc = prefix(jnp.sum(rows_s, axis=1), jnp.sum(rows_c, axis=1), start_sum, start_count)
    first = jnp.minimum(row, side - 1)  # row == side: every bucket passes
    s0 = jnp.where(first > 0, cs[first - 1], start_sum)
    c0 = jnp.where(first > 0, cc[first - 1], start_count)
    col, cs2, cc2 = prefix(rows_s[first], rows_c[first], s0, c0)
    col = jnp.where(row == side, side, col)
    last = first * side + col - 1
    at = jnp.maximum(col - 1, 0)
    end_s = jnp.where(col > 0, cs2[at], s0)
    end_c = jnp.where(col > 0, cc2[at], c0)
    return last.astype(jnp.int32), end_s, end_c


def mean_bounded_keep(
    x: jax.Array,
    mask: jax.Array,
    candidates: jax.Array,
    tau: float,
    axis_name=None,
    *,
    method: str = "auto",
) -> jax.Array:
    """M2PO's selection: drop the largest candidate values until the kept mean is ≤ ``tau``.

    Returns the kept ``[...]`` bool mask: every active non-candidate, and the candidates with
    ``x ≤ θ``, θ the largest threshold at which the mean of the kept ``x`` over all active
    positions is ≤ ``tau``. Dropping the largest values one by one stops exactly there, except
    that values tied at θ are kept or dropped together (so the kept mean never exceeds ``tau``).
    When even θ = ``tau`` fails (the non-candidates alone average above ``tau``), no candidate is
    kept, as the one-by-one drop would end.

    Like :func:`quantile` it needs no sort and no all-gather. Above ``tau`` the kept surplus
    Σ (x − tau) grows with θ, so θ is the last float32 key that passes the test
    ``Σ x ≤ tau · count`` (sums over the kept, float32, psum'd over ``axis_name``):

    * ``"bisect"``: a 32-step bisection over the key, each step one masked (sum, count) pass.
    * ``"radix"``: two passes of per-bucket (sum, count) histograms over the key's high and low
      16 bits, which locate θ from running sums; the direct test then checks θ passes and the
      next key fails (one pass), and only if rounding in the bucketed sums made them disagree
      does the bisection run. The result is the bisection's whenever the test is monotone in θ,
      which float32 sums break only within rounding of a zero surplus; there each method returns
      a threshold that passes the test with the next key failing it.

    ``"auto"`` picks ``"bisect"`` on TPU (which scatters slowly) and ``"radix"`` elsewhere. ``x``
    must be non-negative and finite.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    if method == "auto":
        method = "bisect" if jax.default_backend() == "tpu" else "radix"
    x = jax.lax.stop_gradient(x.astype(jnp.float32))
    key = _sortable_key(x)
    candidates = mask & candidates
    fixed = mask & ~candidates
    tau32 = jnp.float32(tau)
    lo0 = _sortable_key(tau32)

    base_sum, base_count = _base.psum(_sums(x, fixed), axis_name)

    def kept(k):
        """(Σ x, count) over the kept positions when the candidates up to key ``k`` stay."""
        s, c = _base.psum(_sums(x, candidates & (key <= k)), axis_name)
        return base_sum + s, base_count + c

    def passes(s, c):
        return s <= tau32 * c.astype(jnp.float32)

    def ok(k):
        return passes(*kept(k))

    def bisect():
        # Invariant: ok(lo); ok(k) is monotone (true, then false) for k ≥ key(tau).
        def body(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo + jnp.uint32(1)) // jnp.uint32(2)
            good = ok(mid)
            return jnp.where(good, mid, lo), jnp.where(good, hi, mid - jnp.uint32(1))

        lo, _ = jax.lax.fori_loop(0, 32, body, (lo0, jnp.uint32(0xFFFFFFFF)))
        return lo

    s0, c0 = kept(lo0)  # what every threshold keeps: read once, by both tests below
    start_ok = passes(s0, c0)
    if method == "bisect":
        theta = bisect()
    else:
        above = candidates & (key > lo0)
        high, low = key >> _HALF, key & jnp.uint32(_BUCKETS - 1)
        sums, counts = _base.psum(_bucket_sums(high, above, x), axis_name)
        last, s1, c1 = _last_within(sums, counts, s0, c0, tau32)
        bucket = (last + 1).astype(jnp.uint32)  # the first bucket that fails (2¹⁶: none)
        sums, counts = _base.psum(_bucket_sums(low, above & (high == bucket), x), axis_name)
        last_low, _, _ = _last_within(sums, counts, s1, c1, tau32)
        start = bucket << _HALF
        guess = jnp.where(
            last_low < 0, start - jnp.uint32(1), start + last_low.astype(jnp.uint32)
        )  # last_low == -1: the previous bucket's end
        guess = jnp.where(last == _BUCKETS - 1, jnp.uint32(0xFFFFFFFF), jnp.maximum(guess, lo0))
        nxt = guess + jnp.uint32(1)
        exact = ok(guess) & ((guess == jnp.uint32(0xFFFFFFFF)) | ~ok(nxt))
        theta = jax.lax.cond(exact | ~start_ok, lambda: guess, bisect)
    return fixed | (candidates & (key <= theta) & start_ok)

"""Top-p / top-k support cut-offs (Eq. 50) on hand examples, and their replay."""

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.models import apply_support_cutoff
from sat_jax.sampling import support_cutoff

LOGITS = jnp.array([3.0, 2.0, 1.0, 0.0])  # softmax ≈ [0.644, 0.237, 0.087, 0.032]


@pytest.mark.parametrize(
    "top_p, top_k, expected",
    [
        (1.0, 0, -math.inf),  # no truncation
        (0.8, 0, 1.5),  # mass before: 0, .644, .881 → keep {3, 2}; cut midway to 1
        (0.5, 0, 2.5),  # the top token alone already reaches 0.5
        (1.0, 1, 2.5),  # greedy
        (1.0, 3, 0.5),
        (1.0, 4, -math.inf),  # k = V cuts nothing
        # top-k first, then top-p on the renormalised top-3: probs ≈ [.665, .245, .090],
        # mass before 0, .665, .910 → keep 2.
        (0.9, 3, 1.5),
        (0.95, 3, 0.5),  # .910 < .95 keeps the third, and top-k caps it there
    ],
)
def test_support_cutoff_hand_examples(top_p, top_k, expected):
    got = support_cutoff(LOGITS, top_p, top_k)
    chex.assert_trees_all_close(got, expected, rtol=1e-7)


def test_support_cutoff_batched_and_kept_set():
    logits = jnp.stack([LOGITS, LOGITS[::-1]])
    cut = support_cutoff(logits, 0.8, 0)
    kept = jnp.isfinite(apply_support_cutoff(logits, cut))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 0, 1, 1]])


def test_ties_at_the_boundary_are_all_kept():
    logits = jnp.array([1.0, 1.0, 0.0, 0.0])
    cut = support_cutoff(logits, 1.0, 1)
    np.testing.assert_array_equal(jnp.isfinite(apply_support_cutoff(logits, cut)), [1, 1, 0, 0])


def test_apply_support_cutoff_keeps_the_scored_token():
    cut = jnp.array(1.5)
    out = apply_support_cutoff(LOGITS, cut, keep=jnp.array(3))
    np.testing.assert_array_equal(jnp.isfinite(out), [1, 1, 0, 1])

"""Supervised warm-up to a weak base policy, cached by content hash.

RL on a built-in task should start like the paper's: from a base model that solves the task
sometimes, not never (no reward signal) and not always (nothing to learn). A short cross-entropy
warm-up on (prompt, answer) pairs gets there in seconds; the result is cached so every run of the
same model/task/warm-up settings starts from identical parameters. The key also holds a digest
of the code whose float rounding decides the result (the model's and this module's source, the
JAX and jaxlib versions), so a change there trains the warm-up again instead of reusing a base
policy another program made.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

from sat_jax.models.logprobs import token_logprobs

#: Learning-rate schedules of the warm-up (see :func:`warmup`).
SCHEDULES = ("constant", "cosine")


def layout_pairs(tokenizer, pairs, prompt_width: int, response_width: int):
    """Tokens [B, P + N] in the sampler's layout: BOS+prompt left-padded to P, answer+EOS after.

    Returns (tokens, input_mask, response_mask) as NumPy arrays.
    """
    b = len(pairs)
    tokens = np.full((b, prompt_width + response_width), tokenizer.pad_id, np.int32)
    mask = np.zeros(tokens.shape, bool)
    for i, (prompt, answer) in enumerate(pairs):
        p = tokenizer.encode(prompt, add_bos=True)
        a = tokenizer.encode(answer, add_eos=True)
        if len(p) > prompt_width or len(a) > response_width:
            raise ValueError(
                f"pair {prompt!r} -> {answer!r} needs {len(p)} prompt / {len(a)} response slots, "
                f"more than {prompt_width} / {response_width}"
            )
        tokens[i, prompt_width - len(p) : prompt_width] = p
        tokens[i, prompt_width : prompt_width + len(a)] = a
        mask[i, prompt_width - len(p) : prompt_width + len(a)] = True
    return tokens, mask, mask[:, prompt_width:]


@functools.cache
def code_digest() -> str:
    """Digest of sat_jax/models/*.py, this file, and the JAX and jaxlib versions."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(pkg, "models", "*.py"))) + [os.path.abspath(__file__)]
    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    for path in files:
        h.update(os.path.relpath(path, pkg).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def corrupt_pairs(task, pairs, share: float, seed: int) -> list[tuple[str, str]]:
    """``pairs`` with exactly ``floor(share * len(pairs) + 1/2)`` targets corrupted by
    ``task.corrupt`` (a wrong final answer), the corrupted positions and digits fixed by ``seed``.

    Raises:
      ValueError: ``share`` outside [0, 1].
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"corrupt_share must be in [0, 1], got {share}")
    n = int(np.floor(share * len(pairs) + 0.5))
    if n == 0:
        return list(pairs)
    # A stream of its own, so the clean pairs drawn from ``seed`` are the same at every share.
    rng = np.random.default_rng((seed, 1))
    out = list(pairs)
    for i in sorted(rng.permutation(len(pairs))[:n].tolist()):
        prompt, target = out[i]
        out[i] = (prompt, task.corrupt(target, rng))
    return out


def _cache_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def params_digest(params) -> float:
    """A digest of the parameters' bytes (shapes, dtypes and values, in leaf order) as an exact
    float: the first 52 bits of their SHA-256. Runs that log the same ``sft/digest`` started from
    the same warm-up; the warm-up's float rounding differs across CPUs, so the same config on
    another machine trains a different base policy and logs another digest."""
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(params):
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return float(int(h.hexdigest()[:13], 16))


def _save(path: str, params) -> None:
    leaves = jax.tree_util.tree_leaves(params)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # processes of one host may write the same entry
    np.savez(tmp, *[np.asarray(x) for x in leaves])
    os.replace(tmp, path)


def _load(path: str, template):
    with np.load(path) as data:
        leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
    t_leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(leaves) != len(t_leaves) or any(
        a.shape != b.shape for a, b in zip(leaves, t_leaves, strict=True)
    ):
        raise ValueError(f"cached warm-up {path} does not match the model")
    bad = [i for i, x in enumerate(leaves) if not np.isfinite(x).all()]
    if bad:
        raise ValueError(f"cached warm-up {path} holds NaN or infinity (arrays {bad})")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])


def warmup(
    graphdef,
    params,
    tokenizer,
    task,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    prompt_width: int,
    response_width: int,
    cache_dir: str | None,
    cache_spec: dict[str, Any],
    corrupt_share: float = 0.0,
    schedule: str = "constant",
    log=None,
):
    """Cross-entropy on the task's supervised pairs, ``corrupt_share`` of them with a wrong
    answer (`corrupt_pairs`); returns (params, info dict). The info holds ``sft/cached``,
    ``sft/digest`` (:func:`params_digest`, trained or cached) and, when trained,
    ``sft/final_loss``. ``schedule`` is ``"constant"`` (Adam at ``learning_rate`` throughout) or
    ``"cosine"`` (``learning_rate`` decayed to 0 over ``steps``).

    ``cache_spec`` must describe everything that determines the result (model config, task,
    these settings); the cache file is keyed by its hash. A corrupt cache entry is rebuilt.
    """
    if not 0.0 <= corrupt_share <= 1.0:
        raise ValueError(f"corrupt_share must be in [0, 1], got {corrupt_share}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    spec = dict(
        cache_spec,
        corrupt_share=float(corrupt_share),
        steps=steps,
        batch_size=batch_size,
        lr=learning_rate,
        schedule=schedule,
        seed=seed,
        widths=(prompt_width, response_width),
        code=code_digest(),
    )
    path = None
    if cache_dir:
        cache_dir = os.path.expanduser(cache_dir)
        os.makedirs(cache_dir, exist_ok=True)
        path = os.path.join(cache_dir, f"sft-{_cache_key(spec)}.npz")
        if os.path.exists(path):
            try:
                loaded = _load(path, params)
                return loaded, {"sft/cached": 1.0, "sft/digest": params_digest(loaded)}
            except Exception as e:  # a corrupt or stale cache is rebuilt, not trusted
                if log:
                    log(f"ignoring unreadable warm-up cache {path}: {e}")

    rate = learning_rate
    if schedule == "cosine":
        rate = optax.cosine_decay_schedule(learning_rate, max(steps, 1))
    optimizer = optax.adam(rate)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens, input_mask, response_mask):
        def loss_fn(p):
            logp, _, _ = token_logprobs(
                graphdef, p, tokens, input_mask=input_mask, response_start=prompt_width
            )
            m = response_mask.astype(jnp.float32)
            return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    pairs = corrupt_pairs(
        task, task.supervised_pairs(steps * batch_size, seed), corrupt_share, seed
    )
    loss = float("nan")
    for i in range(steps):
        chunk = pairs[(i * batch_size) % len(pairs) :][:batch_size]
        if len(chunk) < batch_size:
            chunk = chunk + pairs[: batch_size - len(chunk)]
        tokens, input_mask, response_mask = layout_pairs(
            tokenizer, chunk, prompt_width, response_width
        )
        params, opt_state, loss = step(params, opt_state, tokens, input_mask, response_mask)
    info = {"sft/final_loss": float(loss), "sft/cached": 0.0, "sft/digest": params_digest(params)}
    if not all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(params)):
        raise ValueError(
            f"the supervised warm-up diverged (final loss {float(loss)}): its parameters hold "
            f"NaN or infinity; lower sft.learning_rate={learning_rate}"
        )
    if path:
        _save(path, params)
    return params, info

"""Jitted autoregressive rollout engine with a KV cache, resumable in chunks for parameter swaps.

Sequence layout (shared with ``sat_jax.models.token_logprobs``):

* Prompts come in right-padded (as a tokenizer emits them) with per-sequence lengths, and are
  stored **left-padded** to a fixed width P = ``max_prompt_len``, so every sequence starts its
  response at slot P and one decode step serves the whole batch. Rotary positions come from the
  mask (``cumsum(mask) − 1``), so padding changes no real position.
* ``tokens`` is [B, P + N] (prompt and response, N = ``max_new_tokens``); slots after a
  sequence's EOS hold ``pad_id`` and are masked out. The EOS itself is part of the response.
* Per-response-token arrays (``behavior_logp``, ``cutoffs``, ``versions``, ``response_mask``) are
  [B, N], column j describing token ``tokens[:, P + j]``.
* ``routing`` is [num_moe_layers, B, P + N − 1, k]: the experts used at every *fed* slot
  0 … P + N − 2 (the last token is sampled, never fed). It is exactly what ``token_logprobs``
  expects for ``tokens``.

Decoding: a prefill writes the cache for slots 0 … P − 2; then each decode step feeds one token
(slot P − 1 + step), samples the next one and records its behavior log-prob log μ(y | s) under the
distribution actually sampled from (temperature, then top-k/top-p truncation), the support
cut-off (Eq. 50), the routing and the parameter version of the step. Steps run inside one
``lax.while_loop`` per call; ``decode`` stops after ``num_steps`` steps or when every sequence
has finished, and can be called again with different parameters (the "stream" mode of Section
4.4: the cache written by older parameters is kept, as in an engine that swaps weights in flight).

Randomness (``token_keys``): the token at response position j of sequence n is drawn with
``fold_in(fold_in(key, n), j)``, n = prompt index × G + sample index (the row, in a batch of
groups). A token's key therefore depends on nothing but (prompt, sample, position): not on how
decoding is split into chunks, on the batch it shares, or (in the continuous engine,
``sat_jax.sampling.continuous``) on the slot, admission order or slot count, and both engines
draw the same tokens from the same key.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax import _checks
from sat_jax.models.config import ModelConfig
from sat_jax.models.layers import LayerCache
from sat_jax.models.logprobs import apply_support_cutoff, scale_logits
from sat_jax.models.transformer import graphdef_for, init_cache, positions_from_mask
from sat_jax.sampling.truncation import support_cutoff


class SamplingParams(NamedTuple):
    """Sampling distribution: softmax of logits / temperature over the top-k / top-p support.

    All three are traced scalars inside the engine: changing them never recompiles.
    ``top_k`` ≤ 0 disables top-k (top_k = 1 is greedy); ``top_p`` = 1 disables top-p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def token_keys(key: jax.Array, sequence_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] PRNG keys of the tokens at response ``positions`` [B] of sequences ``sequence_ids`` [B]:
    ``fold_in(fold_in(key, n), j)``, the one rule both engines sample with."""
    fold = lambda n, j: jax.random.fold_in(jax.random.fold_in(key, n), j)  # noqa: E731
    return jax.vmap(fold)(sequence_ids.astype(jnp.uint32), positions.astype(jnp.uint32))


def sample_next(
    logits: jax.Array, keys: jax.Array, sampling: SamplingParams
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row from logits [B, V] under ``sampling``, row b drawn with ``keys[b]``.

    Returns (tokens [B] int32, behaviour log-probs [B] float32 under the distribution sampled from
    (temperature, then the top-k / top-p support), support cut-offs [B] (Eq. 50)).
    """
    scaled = scale_logits(logits, sampling.temperature)  # [B, V]
    cutoff = support_cutoff(scaled, sampling.top_p, sampling.top_k)
    masked = apply_support_cutoff(scaled, cutoff)
    y = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(masked, axis=-1), y[:, None], axis=-1)[:, 0]
    return y, logp, cutoff


def traced_sampling(sampling: SamplingParams | None) -> SamplingParams:
    """``sampling`` (default: temperature 1, no truncation) as traced scalars, checked."""
    sampling = SamplingParams() if sampling is None else sampling
    sp = SamplingParams(
        jnp.asarray(sampling.temperature, jnp.float32),
        jnp.asarray(sampling.top_p, jnp.float32),
        jnp.asarray(sampling.top_k, jnp.int32),
    )
    if not (np.asarray(sp.temperature) > 0 and 0 < np.asarray(sp.top_p) <= 1):
        raise ValueError(f"sampling needs temperature > 0 and top_p in (0, 1], got {sampling}")
    return sp


class DecodeState(NamedTuple):
    """Resumable decode state (a pytree; see the module docstring for layouts)."""

    tokens: jax.Array  # [B, P + N] int32
    input_mask: jax.Array  # [B, P + N] bool
    prompt_lengths: jax.Array  # [B] int32
    limits: jax.Array  # [B] int32: response tokens each sequence may take (≤ N)
    cache: LayerCache  # stacked [L, B, P + N, kv_heads, head_dim], engine dtype
    step: jax.Array  # int32 scalar: response tokens decoded so far
    done: jax.Array  # [B] bool: EOS sampled
    behavior_logp: jax.Array  # [B, N] float32
    cutoffs: jax.Array  # [B, N] float32
    versions: jax.Array  # [B, N] int32
    routing: jax.Array  # [L, B, P + N − 1, k] int32
    key: jax.Array  # PRNG key
    sampling: SamplingParams  # traced scalars


class SampleOutput(NamedTuple):
    """A finished (or partial) batch of rollouts.

    Attributes:
      tokens: [B, P + N] int32, left-padded prompt then response (``pad_id`` after EOS).
      input_mask: [B, P + N] bool, real tokens (prompt and response up to and including EOS).
      prompt_lengths: [B] int32.
      behavior_logp: [B, N] float32, log μ(y_t | s_t) of each response token under the sampled
        distribution (after temperature and truncation); 0 on padding.
      response_mask: [B, N] bool, response tokens that exist (through EOS).
      response_lengths: [B] int32.
      routing: [num_moe_layers, B, P + N − 1, k] int32, experts used at every fed slot.
      cutoffs: [B, N] float32 support cut-off per response token (−∞: no truncation / padding).
      versions: [B, N] int32, parameter version that produced each token; −1 on padding.
    """

    tokens: jax.Array
    input_mask: jax.Array
    prompt_lengths: jax.Array
    behavior_logp: jax.Array
    response_mask: jax.Array
    response_lengths: jax.Array
    routing: jax.Array
    cutoffs: jax.Array
    versions: jax.Array

    @property
    def prompt_width(self) -> int:
        """P: the slot of the first response token; pass as ``token_logprobs(response_start=)``."""
        return self.tokens.shape[1] - self.behavior_logp.shape[1]

    @property
    def response_tokens(self) -> jax.Array:
        """[B, N] response tokens (``pad_id`` after EOS)."""
        return self.tokens[:, self.prompt_width :]


# Samplers with the same static configuration share their jitted functions (and so their
# compilations): a run builds a fresh sampler for training and evaluation, and a study or test
# builds many. Bounded, least recently used first out.
_JIT_CACHE: collections.OrderedDict = collections.OrderedDict()
_JIT_CACHE_SIZE = 16
_JIT_CACHE_LOCK = threading.Lock()
# fold_in tag of the router-noise stream of a rollout key (the sampling draws fold in a sequence
# id first, ``token_keys``: apart unless a batch reaches this many sequences).
_ROUTER_NOISE_STREAM = 0x6E6F6973


def shared_jit(key: tuple, build):
    """The jitted functions of ``key`` (built by ``build()`` on first use), shared by every engine
    with the same static configuration. ``build`` binds them to the first engine with ``key``,
    so every field the bodies read must be in the key."""
    with _JIT_CACHE_LOCK:
        if key in _JIT_CACHE:
            _JIT_CACHE.move_to_end(key)
        else:
            _JIT_CACHE[key] = build()
            if len(_JIT_CACHE) > _JIT_CACHE_SIZE:
                _JIT_CACHE.popitem(last=False)
        return _JIT_CACHE[key]


def _shared_jit(sampler):
    key = (
        "static",
        sampler.config,
        sampler.max_prompt_len,
        sampler.max_new_tokens,
        sampler.eos_id,
        sampler.pad_id,
        sampler.router_noise,
    )
    return shared_jit(
        key,
        lambda: (
            jax.jit(sampler._prefill_impl, static_argnums=6),
            jax.jit(sampler._decode_impl),
        ),
    )


class Sampler:
    """Batched rollout engine for one model configuration and fixed prompt/response widths.

    Args:
      config: the trainer's ``ModelConfig`` (same parameter tree).
      max_prompt_len: P, prompt slots; longer prompts are rejected.
      max_new_tokens: N, response slots; the KV cache holds P + N slots.
      eos_id: end-of-sequence id; the sequence stops after sampling it.
      pad_id: id written after EOS (masked out everywhere).
      dtype: engine compute dtype (default ``config.dtype``). ``jnp.bfloat16`` against a float32
        trainer reproduces the paper's engine mismatch, routing flips included; ``jnp.float16``
        is the other half-precision engine.
      router_noise: std ≥ 0 of Gaussian noise added to every MoE router's logits before the
        engine picks its top-k (the gates keep the clean logits; ``MoE``), drawn from the
        rollout key, so a fixed key gives the same rollouts. Routing mismatch against the
        trainer without a change of precision; 0 (default) adds nothing.

    Usage::

        sampler = Sampler(cfg, max_prompt_len=16, max_new_tokens=64, eos_id=1)
        out = sampler.generate(params, prompts, prompt_lengths, key, SamplingParams(1.0))
        # or, swapping parameters between chunks:
        state = sampler.init(params, prompts, prompt_lengths, key, SamplingParams(1.0))
        while not sampler.is_done(state):
            version, params = snapshot_store.latest()
            state = sampler.decode(params, state, num_steps=8, version=version)
        out = sampler.finalize(state)

    Each of ``init`` and ``decode`` compiles once per (batch size, params structure); sampling
    parameters, chunk sizes, versions and parameter values are traced.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_prompt_len: int,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int = 0,
        dtype=None,
        router_noise: float = 0.0,
    ):
        if (
            isinstance(router_noise, bool)
            or not isinstance(router_noise, (int, float, np.floating, np.integer))
            or not np.isfinite(router_noise)
            or router_noise < 0
        ):
            raise ValueError(f"router_noise must be a finite float >= 0, got {router_noise!r}")
        if max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(
                f"max_prompt_len and max_new_tokens must be ≥ 1, got {max_prompt_len}, "
                f"{max_new_tokens}"
            )
        for name, v in (("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= v < config.vocab_size:
                raise ValueError(f"{name}={v} is outside [0, {config.vocab_size})")
        self.config = config.replace(dtype=config.dtype if dtype is None else dtype, remat=False)
        self.graphdef = graphdef_for(self.config)
        self.max_prompt_len = int(max_prompt_len)
        self.max_new_tokens = int(max_new_tokens)
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.router_noise = float(router_noise)
        self._prefill, self._decode = _shared_jit(self)

    # ------------------------------------------------------------------ public API

    def init(
        self,
        params: nnx.State,
        prompts,
        prompt_lengths,
        key: jax.Array,
        sampling: SamplingParams | None = None,
        *,
        group_size: int = 1,
        max_lengths=None,
    ) -> DecodeState:
        """Validate and left-align the prompts, prefill the KV cache; no token is sampled yet.

        Args:
          params: float32 parameter ``nnx.State`` (cast to the engine dtype at use).
          prompts: [B, W] int, right-padded, W ≤ max_prompt_len.
          prompt_lengths: [B] int in [1, W].
          key: PRNG key of the whole rollout.
          sampling: ``SamplingParams`` (default: temperature 1, no truncation).
          group_size: G ≥ 1 dividing B: the rows are groups of G consecutive copies of one prompt
            (a GRPO batch). The prefill then runs each prompt once and copies its KV cache and
            routing to the group's rows (the same cache the G rows would compute, to float
            rounding, for 1/G of the prefill); each row still samples its own response. Checked:
            a group whose prompts differ is a ValueError.
          max_lengths: optional [B] int in [1, max_new_tokens]: a per-sequence response length
            limit (a request's own ``max_tokens``); default max_new_tokens for every row.
        """
        tokens, mask, lengths = self._layout(prompts, prompt_lengths)
        group_size = self._check_groups(tokens, mask, group_size)
        limits = self.check_limits(max_lengths, tokens.shape[0])
        sp = traced_sampling(sampling)
        return self._prefill(
            params, tokens, mask, lengths, key, sp, group_size, jnp.asarray(limits)
        )

    def decode(
        self, params: nnx.State, state: DecodeState, num_steps: int | None = None, version=0
    ) -> DecodeState:
        """Decode up to ``num_steps`` more tokens (default: to the end) with ``params``, tagging
        each with ``version``. Stops early once every sequence has sampled EOS."""
        n = self.max_new_tokens if num_steps is None else int(num_steps)
        if n < 0:
            raise ValueError(f"num_steps must be ≥ 0, got {num_steps}")
        return self._decode(
            params, state, jnp.asarray(n, jnp.int32), jnp.asarray(version, jnp.int32)
        )

    def is_done(self, state: DecodeState) -> bool:
        """True once all N tokens are decoded or every sequence has finished (host sync)."""
        return bool(state.step >= self.max_new_tokens) or bool(jnp.all(state.done))

    def finalize(self, state: DecodeState) -> SampleOutput:
        """Package a decode state (finished or not) as a ``SampleOutput``."""
        p = self.max_prompt_len
        response_mask = state.input_mask[:, p:]
        return SampleOutput(
            tokens=state.tokens,
            input_mask=state.input_mask,
            prompt_lengths=state.prompt_lengths,
            behavior_logp=state.behavior_logp,
            response_mask=response_mask,
            response_lengths=jnp.sum(response_mask, axis=-1, dtype=jnp.int32),
            routing=state.routing,
            cutoffs=state.cutoffs,
            versions=state.versions,
        )

    def generate(
        self,
        params: nnx.State,
        prompts,
        prompt_lengths,
        key: jax.Array,
        sampling: SamplingParams | None = None,
        version=0,
        *,
        group_size: int = 1,
        max_lengths=None,
    ) -> SampleOutput:
        """``init`` + ``decode`` to the end with one parameter version + ``finalize``."""
        state = self.init(
            params,
            prompts,
            prompt_lengths,
            key,
            sampling,
            group_size=group_size,
            max_lengths=max_lengths,
        )
        return self.finalize(self.decode(params, state, version=version))

    # ------------------------------------------------------------------ internals

    def _noise(self, key, index):
        """``(key, std)`` of the router noise of one forward (prefill: index N, decode step i:
        index i), from a stream of the rollout key apart from the sampling draws; None at 0."""
        if self.router_noise == 0.0:
            return None
        stream = jax.random.fold_in(key, _ROUTER_NOISE_STREAM)
        return jax.random.fold_in(stream, index), self.router_noise

    def _layout(self, prompts, prompt_lengths):
        """Host-side validation and left-alignment into [B, P + N] (fixed shapes: no recompiles)."""
        _checks.check_rank("prompts", prompts, 2)
        _checks.check_integer("prompts", prompts)
        b, w = np.shape(prompts)
        _checks.check_shape("prompt_lengths", prompt_lengths, (b,))
        _checks.check_integer("prompt_lengths", prompt_lengths)
        prompts = np.asarray(prompts)
        lengths = np.asarray(prompt_lengths).astype(np.int32)
        p, n = self.max_prompt_len, self.max_new_tokens
        if lengths.min(initial=1) < 1:
            raise ValueError(f"prompt_lengths must be ≥ 1, got min {lengths.min()}")
        if lengths.max(initial=0) > w:
            raise ValueError(f"prompt_lengths max {lengths.max()} exceeds the prompts width {w}")
        if lengths.max(initial=0) > p:
            raise ValueError(
                f"prompts: a prompt of {lengths.max()} tokens exceeds max_prompt_len={p} (the KV "
                f"cache holds max_prompt_len + max_new_tokens = {p + n} slots)"
            )
        valid = np.arange(w)[None, :] < lengths[:, None]
        _checks.check_token_ids("prompts", prompts, self.config.vocab_size, where=valid)
        tokens = np.full((b, p + n), self.pad_id, np.int32)
        mask = np.zeros((b, p + n), bool)
        for i in range(b):
            li = int(lengths[i])
            tokens[i, p - li : p] = prompts[i, :li]
            mask[i, p - li : p] = True
        return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(lengths)

    def check_limits(self, max_lengths, b: int) -> np.ndarray:
        """Per-sequence response limits [b] int32 (default ``max_new_tokens``), checked."""
        n = self.max_new_tokens
        if max_lengths is None:
            return np.full((b,), n, np.int32)
        _checks.check_shape("max_lengths", max_lengths, (b,))
        _checks.check_integer("max_lengths", max_lengths)
        limits = np.asarray(max_lengths).astype(np.int32)
        if b and not (limits.min() >= 1 and limits.max() <= n):
            raise ValueError(
                f"max_lengths must lie in [1, max_new_tokens={n}], got [{limits.min()}, "
                f"{limits.max()}]"
            )
        return limits

    @staticmethod
    def _check_groups(tokens, mask, group_size) -> int:
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, (int, np.integer))
            or group_size < 1
        ):
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        g, b = int(group_size), tokens.shape[0]
        if b % g:
            raise ValueError(f"group_size={g} must divide the number of prompts ({b})")
        for name, a in (("prompts", tokens), ("prompt_lengths", mask)):
            bad = _checks.first_differing_group(a, g) if g > 1 else None
            if bad is not None:
                raise ValueError(
                    f"group_size={g}: rows {bad * g}..{bad * g + g - 1} of {name} "
                    "are not copies of one prompt"
                )
        return g

    def _prefill_impl(self, params, tokens, mask, lengths, key, sampling, group=1, limits=None):
        cfg = self.config
        b = tokens.shape[0]
        p, n = self.max_prompt_len, self.max_new_tokens
        cache = init_cache(cfg, b, p + n)
        routing = jnp.zeros((cfg.num_moe_layers, b, p + n - 1, cfg.num_experts_per_tok), jnp.int32)
        if p > 1:  # the last prompt token is fed by the first decode step
            model = nnx.merge(self.graphdef, params)
            # One row per group (``group_size``): the prompt's cache and routing, then copied.
            first_mask = mask[::group]
            out = model(
                tokens[::group, : p - 1],
                input_mask=first_mask[:, : p - 1],
                positions=positions_from_mask(first_mask[:, : p - 1]),
                cache=init_cache(cfg, b // group, p + n),
                cache_index=0,
                kv_mask=first_mask,
                logits_from=p - 2,
                router_noise=self._noise(key, n),
            )
            cache = jax.tree.map(lambda a: jnp.repeat(a, group, axis=1), out.cache)
            routing = routing.at[:, :, : p - 1].set(jnp.repeat(out.routing, group, axis=1))
        return DecodeState(
            tokens=tokens,
            input_mask=mask,
            prompt_lengths=lengths,
            limits=jnp.full((b,), n, jnp.int32) if limits is None else limits,
            cache=cache,
            step=jnp.zeros((), jnp.int32),
            done=jnp.zeros((b,), jnp.bool_),
            behavior_logp=jnp.zeros((b, n), jnp.float32),
            cutoffs=jnp.full((b, n), -jnp.inf, jnp.float32),
            versions=jnp.full((b, n), -1, jnp.int32),
            routing=routing,
            key=key,
            sampling=sampling,
        )

    def _decode_impl(self, params, state: DecodeState, num_steps, version):
        p, n = self.max_prompt_len, self.max_new_tokens
        stop = jnp.minimum(state.step + num_steps, n)

        def cond(s: DecodeState):
            return (s.step < stop) & ~jnp.all(s.done)

        def body(s: DecodeState) -> DecodeState:
            model = nnx.merge(self.graphdef, params)
            slot = p - 1 + s.step  # slot of the token fed at this step
            fed = jax.lax.dynamic_slice_in_dim(s.tokens, slot, 1, axis=1)
            out = model(
                fed,
                input_mask=jnp.ones_like(fed, jnp.bool_),
                positions=(s.prompt_lengths - 1 + s.step)[:, None],
                cache=s.cache,
                cache_index=slot,
                kv_mask=s.input_mask,
                router_noise=self._noise(s.key, s.step),
            )
            rows = jnp.arange(s.tokens.shape[0], dtype=jnp.int32)
            keys = token_keys(s.key, rows, jnp.broadcast_to(s.step, rows.shape))
            y, logp, cutoff = sample_next(out.logits[:, 0], keys, s.sampling)
            active = ~s.done
            y = jnp.where(active, y, self.pad_id)
            col = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v[:, None], s.step, axis=1)
            return DecodeState(
                tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, y[:, None], slot + 1, 1),
                input_mask=jax.lax.dynamic_update_slice_in_dim(
                    s.input_mask, active[:, None], slot + 1, 1
                ),
                prompt_lengths=s.prompt_lengths,
                limits=s.limits,
                cache=out.cache,
                step=s.step + 1,
                done=s.done | (active & ((y == self.eos_id) | (s.step + 1 >= s.limits))),
                behavior_logp=col(s.behavior_logp, jnp.where(active, logp, 0.0)),
                cutoffs=col(s.cutoffs, jnp.where(active, cutoff, -jnp.inf)),
                versions=col(s.versions, jnp.where(active, version, -1)),
                routing=jax.lax.dynamic_update_slice_in_dim(s.routing, out.routing, slot, 2),
                key=s.key,
                sampling=s.sampling,
            )

        return jax.lax.while_loop(cond, body, state)

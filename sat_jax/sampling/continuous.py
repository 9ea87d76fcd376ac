"""Continuous batching: a fixed number of decode slots, refilled as responses finish.

The static engine (``sat_jax.sampling.sampler``) decodes a batch until its longest response ends,
so finished rows keep occupying the batch. Here S decode slots run one jitted window of
``harvest_every`` = h decode steps at a time; between windows the host harvests the slots whose
response ended (EOS or its length limit) and refills them with waiting prompts, prefilled in
batches and written into the freed slots' cache. The host never acts per token. With
``prefill_chunk`` = c, a prompt's P − 1 prefill tokens are fed c per model call, each call
writing its chunk's cache columns and attending to the chunks before it, so the prefill's
activations and attention scores per call scale with c instead of P − 1.

Output: every finished sequence is a row of the static engine's ``SampleOutput`` layout
(``tokens`` [P + N], ``behavior_logp`` / ``cutoffs`` / ``versions`` / ``response_mask`` [N],
``routing`` [L, P + N − 1, k] for R3), kept in per-slot buffers written at the sequence's own
response position. The G samples of a prompt are G slots sharing one prefill (the prompt's cache
is computed once and copied into its G slots); a prompt's group is emitted whole, when its last
sample ends.

Randomness: ``sat_jax.sampling.sampler.token_keys``, keyed by (prompt id × G + sample, response
position) only, so the tokens do not depend on slot assignment, admission order, slot count or
window length, and equal the static engine's for the same key and prompts (prompt ids 0, 1, …
in batch order).

Versions: each ``advance`` runs one window with the parameters it is given and tags its tokens
with their version, so weights can be swapped at any harvest point; a sequence decoded across a
swap keeps the cache its earlier tokens wrote (as an engine swapping weights in flight).

Cache layout: all slots feed their token at the same cache column, so one decode step is one
model call with a scalar ``cache_index`` (the layout the model's attention and cache write
expect). The C = P + N − 1 columns are a ring: decode step t (counted over the session) writes
column t mod C, for every slot. A sequence admitted before step t0 has its prompt in the P − 1
columns before t0 (mod C) and writes at most N columns t0 … t0 + N − 1, so while it decodes the
ring never comes back to a column of its own; nothing is moved between windows. Rotary positions
are the sequence's own (prompt length − 1 + response position), so the column a key sits in
changes nothing but the order of masked slots.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax.models import sharding as _sharding
from sat_jax.models.config import ModelConfig
from sat_jax.models.layers import LayerCache
from sat_jax.models.transformer import init_cache, positions_from_mask
from sat_jax.sampling.sampler import (
    SampleOutput,
    Sampler,
    SamplingParams,
    sample_next,
    shared_jit,
    token_keys,
    traced_sampling,
)

#: Largest sequence id the key rule takes (prompt id × G + sample).
_ID_LIMIT = 2**31


class SlotState(NamedTuple):
    """Device state of the S slots (a pytree). Output buffers are in ``SampleOutput``'s layout."""

    cache: LayerCache  # [L, S, C, kv_heads, head_dim], engine dtype
    kv_mask: jax.Array  # [S, C] bool: cache columns holding the slot's tokens
    column: jax.Array  # [] int32: the ring column the next decode step writes
    last: jax.Array  # [S] int32: the token the next step feeds
    prompt_lengths: jax.Array  # [S] int32
    limits: jax.Array  # [S] int32: response tokens the sequence may take
    step: jax.Array  # [S] int32: response tokens decoded so far
    live: jax.Array  # [S] bool: the slot holds a sequence still decoding
    sequence_ids: jax.Array  # [S] int32: prompt id × G + sample (the key rule)
    tokens: jax.Array  # [S, P + N] int32
    input_mask: jax.Array  # [S, P + N] bool
    behavior_logp: jax.Array  # [S, N] float32
    cutoffs: jax.Array  # [S, N] float32
    versions: jax.Array  # [S, N] int32
    routing: jax.Array  # [L, S, P + N − 1, k] int32
    key: jax.Array
    sampling: SamplingParams


class FinishedGroup(NamedTuple):
    """The G samples of one prompt, all finished: ``output`` holds G rows (NumPy), sample order."""

    prompt_id: int
    tag: Any
    output: SampleOutput


def concat_outputs(outputs: Sequence[SampleOutput]) -> SampleOutput:
    """Rows of several ``SampleOutput``s as one (routing's batch axis is 1), in order."""
    return SampleOutput(
        *(
            np.concatenate([np.asarray(o[i]) for o in outputs], axis=1 if f == "routing" else 0)
            for i, f in enumerate(SampleOutput._fields)
        )
    )


def _bucket(n: int, cap: int) -> int:
    """The call size for n ≥ 1 rows: the next power of two, at most ``cap`` (≥ n), so that a few
    compiled programs serve every count."""
    return min(1 << (n - 1).bit_length(), cap)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_slots(num_slots: int, group_size: int, *, prefix: str = "") -> None:
    """Raises ValueError when ``num_slots`` is fewer than ``group_size``: the G samples of a
    prompt decode in G slots at once."""
    if num_slots < group_size:
        raise ValueError(
            f"{prefix}num_slots={num_slots} is fewer than {prefix}group_size={group_size}: the G "
            "samples of a prompt decode in G slots at once"
        )


class ContinuousSampler:
    """Continuous-batching rollout engine with the static ``Sampler``'s outputs and key rule.

    Args:
      config: the trainer's ``ModelConfig``.
      max_prompt_len: P, prompt positions; longer prompts are rejected.
      max_new_tokens: N, the longest response.
      eos_id, pad_id, dtype: as ``Sampler``.
      num_slots: S, sequences decoded at once (≥ group_size: a group's samples are slots).
      harvest_every: h, decode steps per window; the host admits and harvests between windows.
      group_size: G, samples per prompt.
      max_prefill: most prompts per prefill call (default: S // G). Prefill and harvest calls
        are padded to a power of two, so a few programs serve every admission and harvest.
      cache_tokens: KV-cache capacity in token positions (None: sized to S slots); S slots of
        ``slot_width`` positions that exceed it are an error.
      mesh: place the slot state on this mesh (slots over the batch axes (data, fsdp), KV heads
        over tensor, as the static engine's cache); None: default placement.
      prefill_chunk: c, prompt tokens per prefill model call: a prompt's P − 1 prefill tokens
        go c at a time into its cache (None, or c ≥ P − 1: one call). Bounds the prefill's
        activations and attention scores per call to c rather than P − 1 query positions; the
        outputs are the same up to float rounding (attention products of other shapes).

    Usage::

        engine = ContinuousSampler(cfg, max_prompt_len=16, max_new_tokens=64, eos_id=1,
                                   num_slots=32, harvest_every=8, group_size=4)
        out = engine.generate(params, prompts, lengths, key, sampling, group_size=4)
        # or, streaming with weight swaps at harvest points:
        run = engine.session(key, sampling)
        run.add(prompts, lengths, prompt_ids=ids)
        while run.pending:
            version, params = store.latest()
            for group in run.advance(params, version):
                ...
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
        num_slots: int,
        harvest_every: int,
        group_size: int = 1,
        max_prefill: int | None = None,
        cache_tokens: int | None = None,
        mesh: jax.sharding.Mesh | None = None,
        prefill_chunk: int | None = None,
    ):
        # The static engine validates prompts, groups and limits with the same rules.
        self.reference = Sampler(
            config,
            max_prompt_len=max_prompt_len,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            dtype=dtype,
        )
        self.config, self.graphdef = self.reference.config, self.reference.graphdef
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.eos_id, self.pad_id = self.reference.eos_id, self.reference.pad_id
        self.num_slots = _positive_int("num_slots", num_slots)
        self.harvest_every = _positive_int("harvest_every", harvest_every)
        self.group_size = _positive_int("group_size", group_size)
        check_slots(self.num_slots, self.group_size)
        groups = self.num_slots // self.group_size
        self.max_prefill = (
            groups if max_prefill is None else _positive_int("max_prefill", max_prefill)
        )
        self.max_prefill = min(self.max_prefill, groups)
        p, n = max_prompt_len, max_new_tokens
        self.slot_width = p + n - 1  # the ring of the module docstring
        need = self.num_slots * self.slot_width
        if cache_tokens is not None and need > _positive_int("cache_tokens", cache_tokens):
            raise ValueError(
                f"num_slots={num_slots} slots of {self.slot_width} cache positions each "
                f"(max_prompt_len + max_new_tokens - 1) need {need}, but "
                f"cache_tokens={cache_tokens} holds {cache_tokens // self.slot_width} slots"
            )
        # None when one call feeds the whole prefix, so equal engines share programs.
        chunk = None if prefill_chunk is None else _positive_int("prefill_chunk", prefill_chunk)
        self.prefill_chunk = None if chunk is None or chunk >= p - 1 else chunk
        self.mesh = mesh
        if mesh is not None:
            _sharding.check_mesh(self.config, mesh, batch=self.num_slots)
        key = (
            "continuous",
            self.config,
            p,
            n,
            self.eos_id,
            self.pad_id,
            self.num_slots,
            self.harvest_every,
            self.group_size,
            mesh,
            self.prefill_chunk,
        )
        self._empty, self._admit, self._run, self._take = shared_jit(key, self._build)

    # ------------------------------------------------------------------ public API

    def session(self, key: jax.Array, sampling: SamplingParams | None = None) -> Session:
        """Empty slots and an empty queue, sampling with ``key`` and ``sampling``."""
        return Session(self, self._empty(key, traced_sampling(sampling)))

    def generate(
        self,
        params: nnx.State,
        prompts,
        prompt_lengths,
        key: jax.Array,
        sampling: SamplingParams | None = None,
        version=0,
        *,
        group_size: int | None = None,
        max_lengths=None,
    ) -> SampleOutput:
        """``Sampler.generate``'s contract through the slots: rows are groups of G copies of a
        prompt, prompt ids 0, 1, … in order, one parameter version; rows come back in order."""
        g = self.group_size
        if group_size is not None and group_size != g:
            raise ValueError(f"group_size={group_size} differs from this engine's {g}")
        tokens, mask, _ = self.reference._layout(prompts, prompt_lengths)
        self.reference._check_groups(tokens, mask, g)
        limits = self.reference.check_limits(max_lengths, tokens.shape[0])
        prompts, lengths = np.asarray(prompts), np.asarray(prompt_lengths)
        run = self.session(key, sampling)
        ids = np.arange(tokens.shape[0] // g)
        run.add(prompts[::g], lengths[::g], prompt_ids=ids, max_lengths=limits)
        done: dict[int, SampleOutput] = {}
        while run.pending:
            for group in run.advance(params, version):
                done[group.prompt_id] = group.output
        return concat_outputs([done[int(i)] for i in ids])

    # ------------------------------------------------------------------ compiled programs

    def _build(self):
        shardings = self._shardings()
        out = None if shardings is None else (shardings, None, None)
        # A session owns its state and replaces it with each call's result: donated, so the
        # cache and the output buffers are updated in place.
        return (
            jax.jit(self._empty_impl, out_shardings=shardings),
            jax.jit(self._admit_impl, out_shardings=shardings, donate_argnums=1),
            jax.jit(self._run_impl, out_shardings=out, donate_argnums=1),
            jax.jit(self._take_impl),
        )

    def _shardings(self):
        """``NamedSharding`` of every ``SlotState`` leaf on the mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        mesh = self.mesh
        abstract = jax.eval_shape(
            self._empty_impl,
            jax.eval_shape(lambda: jax.random.key(0)),
            traced_sampling(None),
        )
        cache = NamedSharding(mesh, _sharding.cache_spec(mesh))
        replicated = NamedSharding(mesh, P())

        def rows(ndim, axis=0):
            return NamedSharding(mesh, _sharding.batch_spec(mesh, ndim, axis))

        # Every per-slot array: slots over the batch axes (routing's slot axis is 1).
        per_slot = {
            name: rows(4, 1) if name == "routing" else rows(getattr(abstract, name).ndim)
            for name in SlotState._fields
            if name not in ("cache", "column", "key", "sampling")
        }
        return SlotState(
            cache=LayerCache(cache, cache),
            column=replicated,
            key=replicated,
            sampling=SamplingParams(replicated, replicated, replicated),
            **per_slot,
        )

    def _empty_impl(self, key, sampling) -> SlotState:
        cfg = self.config
        s, p, n = self.num_slots, self.max_prompt_len, self.max_new_tokens
        i32 = jnp.int32
        return SlotState(
            cache=init_cache(cfg, s, self.slot_width),
            kv_mask=jnp.zeros((s, self.slot_width), jnp.bool_),
            column=jnp.zeros((), i32),
            last=jnp.zeros((s,), i32),
            prompt_lengths=jnp.ones((s,), i32),
            limits=jnp.full((s,), n, i32),
            step=jnp.zeros((s,), i32),
            live=jnp.zeros((s,), jnp.bool_),
            sequence_ids=jnp.zeros((s,), i32),
            tokens=jnp.full((s, p + n), self.pad_id, i32),
            input_mask=jnp.zeros((s, p + n), jnp.bool_),
            behavior_logp=jnp.zeros((s, n), jnp.float32),
            cutoffs=jnp.full((s, n), -jnp.inf, jnp.float32),
            versions=jnp.full((s, n), -1, i32),
            routing=jnp.zeros((cfg.num_moe_layers, s, p + n - 1, cfg.num_experts_per_tok), i32),
            key=key,
            sampling=sampling,
        )

    def _admit_impl(self, params, state: SlotState, tokens, mask, lengths, slots, ids, limits):
        """Prefill prompts tokens/mask [m, P] (left-aligned) once each and start their G samples
        in ``slots`` [m·G] (S = padding, dropped), with sequence ids and limits [m·G]."""
        g = self.group_size
        p, n = self.max_prompt_len, self.max_new_tokens
        rows = jnp.repeat(tokens, g, axis=0)
        row_mask = jnp.repeat(mask, g, axis=0)
        width = p + n
        put = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
        kv_row = jnp.zeros((rows.shape[0], self.slot_width), jnp.bool_)
        cache, routing = state.cache, state.routing.at[:, slots].set(0, mode="drop")
        if p > 1:  # the last prompt token is fed by the first decode step
            new_cache, new_routing = self._prefill(params, tokens[:, : p - 1], mask[:, : p - 1])
            # The P − 1 ring columns before the next decode step's.
            cols = (state.column - (p - 1) + jnp.arange(p - 1)) % self.slot_width
            cache = LayerCache(
                *(
                    full.at[:, slots[:, None], cols[None, :]].set(
                        jnp.repeat(new, g, axis=1), mode="drop"
                    )
                    for full, new in zip(cache, new_cache, strict=True)
                )
            )
            kv_row = kv_row.at[:, cols].set(row_mask[:, : p - 1])
            routing = routing.at[:, slots, : p - 1].set(
                jnp.repeat(new_routing, g, axis=1), mode="drop"
            )
        pad = jnp.full((rows.shape[0], width - p), self.pad_id, jnp.int32)
        return state._replace(
            cache=cache,
            kv_mask=put(state.kv_mask, kv_row),
            last=put(state.last, rows[:, p - 1]),
            prompt_lengths=put(state.prompt_lengths, lengths.repeat(g)),
            limits=put(state.limits, limits),
            step=put(state.step, 0),
            live=put(state.live, True),
            sequence_ids=put(state.sequence_ids, ids),
            tokens=put(state.tokens, jnp.concatenate([rows, pad], axis=1)),
            input_mask=put(
                state.input_mask, jnp.concatenate([row_mask, jnp.zeros(pad.shape, bool)], axis=1)
            ),
            behavior_logp=put(state.behavior_logp, 0.0),
            cutoffs=put(state.cutoffs, -jnp.inf),
            versions=put(state.versions, -1),
            routing=routing,
        )

    def _prefill(self, params, tokens, mask):
        """Cache [L, m, T, kv_heads, head_dim] and routing [L, m, T, k] of prompt prefixes
        tokens/mask [m, T], fed ``prefill_chunk`` = c tokens per model call (None: all T in one).

        Chunk i writes cache columns [i·c, i·c + c) at ``cache_index`` = i·c and attends over
        all T columns under the prefix's own mask: columns past a query's are hidden by
        causality, so every query sees the keys it sees in one call. The T // c full chunks
        are one ``lax.scan``; a shorter last chunk of T mod c tokens is one more call. No
        padding is fed, so neither the cache mask nor the routing holds a padding position."""
        cfg = self.config
        m, t = tokens.shape
        c = self.prefill_chunk
        cache = init_cache(cfg, m, t)
        positions = positions_from_mask(mask)

        def call(cache, start, width, part):
            model = nnx.merge(self.graphdef, params)
            out = model(
                part(tokens),
                input_mask=part(mask),
                positions=part(positions),
                cache=cache,
                cache_index=start,
                kv_mask=mask,
                logits_from=width - 1,
            )
            return out.cache, out.routing

        if c is None:
            return call(cache, 0, t, lambda a: a)

        def chunk(cache, start):
            return call(cache, start, c, lambda a: jax.lax.dynamic_slice_in_dim(a, start, c, 1))

        full = t // c
        cache, routing = jax.lax.scan(chunk, cache, jnp.arange(full, dtype=jnp.int32) * c)
        # [full, L, m, c, k] → [L, m, full · c, k]
        routing = jnp.moveaxis(routing, 0, 2).reshape(
            (cfg.num_moe_layers, m, full * c, cfg.num_experts_per_tok)
        )
        if t % c:
            cache, tail = call(cache, full * c, t - full * c, lambda a: a[:, full * c :])
            routing = jnp.concatenate([routing, tail], axis=2)
        return cache, routing

    def _run_impl(self, params, state: SlotState, version):
        """One window: up to h decode steps (fewer once no slot is live), step i writing ring
        column ``state.column`` + i (mod C). Returns (state, steps run, live slot-steps).

        Step i of the window writes column i of [S, h] window buffers (one column for every
        slot, like the cache); after the window they go to each slot's own response positions
        in one scatter."""
        cfg = self.config
        p, n, h = self.max_prompt_len, self.max_new_tokens, self.harvest_every
        s_, width = self.num_slots, self.slot_width
        k = cfg.num_experts_per_tok

        def cond(carry):
            i, s, _ = carry
            return (i < h) & jnp.any(s.live)

        def body(carry):
            i, s, win = carry
            model = nnx.merge(self.graphdef, params)
            col = (state.column + i) % width
            kv_mask = jax.lax.dynamic_update_slice_in_dim(s.kv_mask, s.live[:, None], col, 1)
            out = model(
                s.last[:, None],
                input_mask=jnp.ones((s_, 1), jnp.bool_),
                positions=(s.prompt_lengths - 1 + s.step)[:, None],
                cache=s.cache,
                cache_index=col,
                kv_mask=kv_mask[:, None, :],  # the ring: the mask alone says what is past
            )
            keys = token_keys(s.key, s.sequence_ids, s.step)
            y, logp, cutoff = sample_next(out.logits[:, 0], keys, s.sampling)
            put = lambda a, v, axis=1: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                a, jnp.expand_dims(v, axis), i, axis
            )
            win = {
                "y": put(win["y"], y),
                "live": put(win["live"], s.live),
                "logp": put(win["logp"], logp),
                "cutoff": put(win["cutoff"], cutoff),
                "routing": put(win["routing"], out.routing[:, :, 0], 2),
            }
            step = s.step + s.live
            s = s._replace(
                cache=out.cache,
                kv_mask=kv_mask,
                last=jnp.where(s.live, y, s.last),
                step=step,
                live=s.live & (y != self.eos_id) & (step < s.limits),
            )
            return i + 1, s, win

        zero = jnp.zeros((), jnp.int32)
        win = {
            "y": jnp.zeros((s_, h), jnp.int32),
            "live": jnp.zeros((s_, h), jnp.bool_),
            "logp": jnp.zeros((s_, h), jnp.float32),
            "cutoff": jnp.zeros((s_, h), jnp.float32),
            "routing": jnp.zeros((cfg.num_moe_layers, s_, h, k), jnp.int32),
        }
        first = state.step
        steps, state, win = jax.lax.while_loop(cond, body, (zero, state, win))
        # Response position of window column i: first + i while the slot was live; n (out of
        # range, dropped) for columns it did not decode.
        j = jnp.where(win["live"], first[:, None] + jnp.arange(h)[None], n)
        rows = jnp.arange(s_)[:, None]

        def scatter(a, offset, v):
            return a.at[rows, offset + j].set(v, mode="drop")

        state = state._replace(
            tokens=scatter(state.tokens, p, win["y"]),
            input_mask=scatter(state.input_mask, p, True),
            behavior_logp=scatter(state.behavior_logp, 0, win["logp"]),
            cutoffs=scatter(state.cutoffs, 0, win["cutoff"]),
            versions=scatter(state.versions, 0, version),
            routing=state.routing.at[:, rows, p - 1 + j].set(win["routing"], mode="drop"),
            column=(state.column + steps) % width,
        )
        return state, steps, jnp.sum(win["live"], dtype=jnp.int32)

    def _take_impl(self, state: SlotState, slots) -> SampleOutput:
        """The ``SampleOutput`` rows of ``slots`` [n]."""
        p = self.max_prompt_len
        mask = state.input_mask[slots]
        return SampleOutput(
            tokens=state.tokens[slots],
            input_mask=mask,
            prompt_lengths=state.prompt_lengths[slots],
            behavior_logp=state.behavior_logp[slots],
            response_mask=mask[:, p:],
            response_lengths=state.step[slots],
            routing=state.routing[:, slots],
            cutoffs=state.cutoffs[slots],
            versions=state.versions[slots],
        )


class Session:
    """The host side of one run of the slots: a queue of waiting prompts, the slots' occupants,
    finished samples waiting for their group. Built by ``ContinuousSampler.session``.

    Attributes:
      state: the device ``SlotState``.
      slot_steps: slots × decode steps run so far (the engine's decode work).
      live_steps: slot-steps that decoded a token of a live sequence (the rest: free or
        finished slots waiting for the next harvest).
      windows: windows run.
    """

    def __init__(self, engine: ContinuousSampler, state: SlotState):
        self.engine, self.state = engine, state
        self._waiting: collections.deque = collections.deque()
        self._free = list(range(engine.num_slots))
        self._occupant: dict[int, tuple[int, int]] = {}  # slot -> (prompt id, sample)
        self._partial: dict[int, dict[int, SampleOutput]] = {}  # prompt id -> sample -> row
        self._tags: dict[int, Any] = {}
        self._ids: set[int] = set()
        self.slot_steps = self.live_steps = self.windows = 0

    @property
    def pending(self) -> int:
        """Prompts added and not yet emitted (waiting or decoding)."""
        return len(self._waiting) + len(self._tags)

    @property
    def decoding(self) -> list[int]:
        """Ids of the prompts in the slots (admitted, not yet emitted)."""
        return list(self._tags)

    @property
    def waiting(self) -> int:
        """Prompts added and not yet admitted to slots."""
        return len(self._waiting)

    def add(self, prompts, prompt_lengths, *, prompt_ids, tags=None, max_lengths=None) -> None:
        """Queue prompts (one row each, right-padded; each gets G samples).

        Args:
          prompts: [m, W] int, W ≤ max_prompt_len.
          prompt_lengths: [m] int.
          prompt_ids: [m] distinct ints, new to this session: the key rule's prompt index.
          tags: optional m host objects handed back with each ``FinishedGroup``.
          max_lengths: optional [m · G] per-sequence response limits in [1, max_new_tokens].
        """
        e = self.engine
        g, p = e.group_size, e.max_prompt_len
        tokens, mask, lengths = e.reference._layout(prompts, prompt_lengths)
        m = tokens.shape[0]
        limits = e.reference.check_limits(max_lengths, m * g).reshape(m, g)
        ids = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
        if len(ids) != m or len(set(ids)) != m or set(ids) & self._ids:
            raise ValueError(f"prompt_ids must be {m} ids new to this session, got {ids}")
        if ids and not (min(ids) >= 0 and (max(ids) + 1) * g <= _ID_LIMIT):
            raise ValueError(f"prompt_ids must lie in [0, 2**31 / group_size), got {ids}")
        tags = [None] * m if tags is None else list(tags)
        if len(tags) != m:
            raise ValueError(f"tags must have one entry per prompt ({m}), got {len(tags)}")
        tokens, mask = np.asarray(tokens[:, :p]), np.asarray(mask[:, :p])
        for i in range(m):
            self._ids.add(ids[i])
            self._waiting.append((ids[i], tokens[i], mask[i], int(lengths[i]), limits[i], tags[i]))

    def advance(self, params, version=0) -> list[FinishedGroup]:
        """Admit waiting prompts into free slots, run one window with ``params`` (tokens tagged
        ``version``), harvest; returns the groups completed in this window."""
        e = self.engine
        self._admit_waiting(params)
        if not self._occupant:
            return []
        self.state, steps, busy = e._run(params, self.state, jnp.asarray(version, jnp.int32))
        live, steps, busy = jax.device_get((self.state.live, steps, busy))
        self.windows += 1
        self.slot_steps += int(steps) * e.num_slots
        self.live_steps += int(busy)
        ended = [slot for slot in self._occupant if not live[slot]]
        return self._harvest(ended)

    def _admit_waiting(self, params) -> None:
        e = self.engine
        g = e.group_size
        admit = []
        while self._waiting and len(self._free) >= g * (len(admit) + 1):
            admit.append(self._waiting.popleft())
        for start in range(0, len(admit), e.max_prefill):
            chunk = admit[start : start + e.max_prefill]
            size = _bucket(len(chunk), e.max_prefill)
            padded = chunk + [chunk[0]] * (size - len(chunk))
            slots = np.full((size * g,), e.num_slots, np.int32)  # padding rows: dropped
            seq_ids = np.zeros((size * g,), np.int32)
            for i, (pid, *_rest, tag) in enumerate(chunk):
                self._tags[pid] = tag
                self._partial[pid] = {}
                for j in range(g):
                    slot = self._free.pop(0)
                    slots[i * g + j] = slot
                    seq_ids[i * g + j] = pid * g + j
                    self._occupant[slot] = (pid, j)
            self.state = e._admit(
                params,
                self.state,
                np.stack([c[1] for c in padded]),
                np.stack([c[2] for c in padded]),
                np.array([c[3] for c in padded], np.int32),
                slots,
                seq_ids,
                np.concatenate([c[4] for c in padded]).astype(np.int32),
            )

    def _harvest(self, ended: list[int]) -> list[FinishedGroup]:
        e = self.engine
        g = e.group_size
        finished = []
        if not ended:
            return finished
        size = _bucket(len(ended), e.num_slots)
        rows = jax.device_get(
            e._take(self.state, np.array(ended + [ended[0]] * (size - len(ended)), np.int32))
        )
        for r, slot in enumerate(ended):
            pid, sample = self._occupant.pop(slot)
            self._free.append(slot)
            self._partial[pid][sample] = SampleOutput(
                *(
                    a[:, r : r + 1] if f == "routing" else a[r : r + 1]
                    for f, a in zip(SampleOutput._fields, rows, strict=True)
                )
            )
            if len(self._partial[pid]) == g:
                group = self._partial.pop(pid)
                finished.append(
                    FinishedGroup(
                        pid, self._tags.pop(pid), concat_outputs([group[j] for j in range(g)])
                    )
                )
        self._free.sort()
        return finished

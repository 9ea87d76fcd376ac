"""The continuous-batching engine against the static reference: same tokens, behaviour log-probs,
routing and cut-offs for any slot count, window and prefill chunk; weight swaps at harvest points
recorded per token and equal to a token-by-token recomputation; whole groups, none lost or
repeated; the sharded slot cache on an fsdp × expert mesh; bad input."""

import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax import parallel
from sat_jax.models import ModelConfig, cache_spec, init_model, param_shardings
from sat_jax.models.transformer import init_cache, positions_from_mask
from sat_jax.sampling import ContinuousSampler, Sampler, SamplingParams
from sat_jax.sampling.continuous import concat_outputs

P, N, G = 6, 12, 2
EOS = 5
RNG = np.random.default_rng(0)
LENGTHS = np.array([3, 6, 1, 4, 5, 2])
PROMPTS = RNG.integers(2, 100, size=(len(LENGTHS), P))
LIMITS = np.array([[3, N], [N, 4], [1, N], [N, N], [7, 2], [N, 5]]).reshape(-1)
TRUNCATED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)


def grouped(a):
    return np.repeat(a, G, axis=0)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny(num_layers=2)


@pytest.fixture(scope="module")
def params(cfg):
    return init_model(cfg, seed=0)


@pytest.fixture(scope="module")
def engines(cfg):
    cache = {}

    def get(slots, every, mesh=None, prefill_chunk=None):
        if (slots, every, mesh, prefill_chunk) not in cache:
            cache[slots, every, mesh, prefill_chunk] = ContinuousSampler(
                cfg,
                max_prompt_len=P,
                max_new_tokens=N,
                eos_id=EOS,
                num_slots=slots,
                harvest_every=every,
                group_size=G,
                mesh=mesh,
                prefill_chunk=prefill_chunk,
            )
        return cache[slots, every, mesh, prefill_chunk]

    return get


@pytest.fixture(scope="module")
def static(cfg):
    return Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=EOS)


@pytest.fixture(scope="module")
def reference(params, static):
    return workload(static, params[1])


def workload(engine, params):
    """The test workload: six prompts of G samples, limits and EOS ending rows at many lengths."""
    return engine.generate(
        params,
        grouped(PROMPTS),
        grouped(LENGTHS),
        jax.random.key(1),
        TRUNCATED,
        group_size=G,
        max_lengths=LIMITS,
    )


def assert_same_rollouts(got, want):
    chex.assert_trees_all_equal(got.tokens, want.tokens)
    chex.assert_trees_all_equal(got.input_mask, want.input_mask)
    chex.assert_trees_all_equal(got.response_mask, want.response_mask)
    chex.assert_trees_all_equal(got.response_lengths, want.response_lengths)
    chex.assert_trees_all_equal(got.prompt_lengths, want.prompt_lengths)
    chex.assert_trees_all_equal(got.versions, want.versions)
    chex.assert_trees_all_close(got.behavior_logp, want.behavior_logp, rtol=1e-7, atol=1e-5)
    chex.assert_trees_all_close(got.cutoffs, want.cutoffs, rtol=1e-7, atol=1e-5)
    # Routing of every slot whose next token is real: the ones the trainer's scores depend on.
    # (A response's last token is never fed by the slots; the static engine feeds it, and the
    # padding after it, while other rows of its batch still decode.)
    fed = np.asarray(want.input_mask)[None, :, 1:, None]
    chex.assert_trees_all_equal(np.where(fed, got.routing, -1), np.where(fed, want.routing, -1))


def test_reference_workload_is_not_trivial(reference):
    lengths = np.asarray(reference.response_lengths)
    # Limits, EOS and full-length rows all occur, so slots free up at different windows.
    assert set(lengths) >= {1, 2, 3, N}
    assert bool(np.any(np.isfinite(reference.cutoffs)))


@pytest.mark.parametrize("slots,every", [(12, 1), (4, 3), (2, 5)])
def test_same_outputs_as_the_static_engine(params, engines, reference, slots, every):
    """12 slots hold every sequence; 4 and 2 hold fewer, so prompts wait and slots refill."""
    engine = engines(slots, every)
    out = workload(engine, params[1])
    assert_same_rollouts(out, reference)


# P − 1 = 5 prefill tokens: chunks of 1 (five calls), 2 (two and a last one of 1), 3 (one and a
# last one of 2); 4 and 2 slots hold fewer than the 12 sequences, so later prompts are admitted
# into freed slots.
@pytest.mark.parametrize("chunk,slots,every", [(1, 4, 3), (2, 2, 5), (3, 12, 1)])
def test_chunked_prefill_gives_the_same_outputs(params, engines, reference, chunk, slots, every):
    """Equal to one prefill call: routing and every discrete output exactly; the cache, and so
    log-probs and cut-offs, to float32 rounding: XLA picks the kernel of the attention products
    by shape, and one over c queries rounds differently from one over P − 1, so from the second
    block on keys and values may differ by a few ulps."""
    _, p = params
    whole, chunked = engines(slots, every), engines(slots, every, prefill_chunk=chunk)
    assert chunked.prefill_chunk == chunk and whole.prefill_chunk is None
    # The prefix's cache and routing, written chunk by chunk at cache_index = i · chunk (the
    # left padding's columns too).
    tokens, mask, _ = whole.reference._layout(PROMPTS, LENGTHS)
    tokens, mask = tokens[:, : P - 1], mask[:, : P - 1]
    want_cache, want_routing = jax.jit(whole._prefill)(p, tokens, mask)
    got_cache, got_routing = jax.jit(chunked._prefill)(p, tokens, mask)
    chex.assert_shape([got_routing, want_routing], (2, len(PROMPTS), P - 1, 4))
    chex.assert_trees_all_equal(got_routing, want_routing)
    chex.assert_trees_all_close(got_cache, want_cache, rtol=0, atol=1e-5)
    out, want = workload(chunked, p), workload(whole, p)
    for field, got in out._asdict().items():
        if field in ("behavior_logp", "cutoffs"):
            chex.assert_trees_all_close(got, getattr(want, field), rtol=0, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, getattr(want, field), err_msg=field)
    assert_same_rollouts(out, reference)


def test_a_prefill_chunk_of_the_whole_prefix_is_one_call(cfg, engines):
    kw = dict(max_prompt_len=P, max_new_tokens=N, eos_id=EOS, group_size=G)
    for chunk in (P - 1, P + 3):
        engine = ContinuousSampler(cfg, num_slots=4, harvest_every=3, prefill_chunk=chunk, **kw)
        assert engine.prefill_chunk is None
        assert engine._admit is engines(4, 3)._admit  # the programs of prefill_chunk=None


def _teacher_forced_logp(cfg, graphdef, by_version, out, row):
    """log μ of row ``row``'s response tokens, fed one at a time through a KV cache, each with
    the parameters of the version the engine recorded for it (the prompt with the first
    token's): the engine's computation, written out with the model alone."""
    tokens, mask = out.tokens[row : row + 1], out.input_mask[row : row + 1]
    versions = np.asarray(out.versions[row])
    n = int(out.response_lengths[row])
    plen = int(out.prompt_lengths[row])
    model = nnx.merge(graphdef, by_version[int(versions[0])])
    cache = model(
        tokens[:, : P - 1],
        input_mask=mask[:, : P - 1],
        positions=positions_from_mask(mask[:, : P - 1]),
        cache=init_cache(cfg, 1, P + N),
        cache_index=0,
        kv_mask=mask,
    ).cache
    logps = []
    for j in range(n):
        model = nnx.merge(graphdef, by_version[int(versions[j])])
        res = model(
            tokens[:, P - 1 + j : P + j],
            positions=jnp.array([[plen - 1 + j]]),
            cache=cache,
            cache_index=P - 1 + j,
            kv_mask=mask,
        )
        cache = res.cache
        logps.append(jax.nn.log_softmax(res.logits[0, 0])[int(tokens[0, P + j])])
    return np.array(logps)


def test_weight_swap_at_a_harvest_point(cfg, params, engines, static):
    graphdef, p_old = params
    p_new = jax.tree.map(lambda x: x * 1.5, p_old)
    engine = engines(4, 3)  # two groups at a time
    run = engine.session(jax.random.key(2))
    limits = np.array([3, 3, N, N, N, N])
    run.add(PROMPTS[:3], LENGTHS[:3], prompt_ids=[0, 1, 2], max_lengths=limits)
    first = run.advance(p_old, version=0)  # prompt 0 ends at its limit of 3: its slots free up
    assert [g.prompt_id for g in first] == [0]
    groups = {0: first[0].output}
    while run.pending:
        for group in run.advance(p_new, version=1):
            groups[group.prompt_id] = group.output
    assert sorted(groups) == [0, 1, 2]
    first_three = np.where(np.arange(N) < 3, 0, -1)
    chex.assert_trees_all_equal(groups[0].versions, np.stack([first_three] * G))
    # Prompt 1 decoded across the swap: version 0 for its first window's 3 tokens, then 1.
    want = np.stack([np.where(np.arange(N) < 3, 0, 1)] * G)
    mask1 = np.asarray(groups[1].response_mask)
    assert mask1[:, 3].all()
    chex.assert_trees_all_equal(groups[1].versions, np.where(mask1, want, -1))
    # Prompt 2 waited for prompt 0's slots and is admitted after the swap: version 1 only.
    mask2 = np.asarray(groups[2].response_mask)
    chex.assert_trees_all_equal(groups[2].versions, np.where(mask2, 1, -1))
    by_version = {0: p_old, 1: p_new}
    for pid in (1, 2):
        for r in range(G):
            want_logp = _teacher_forced_logp(cfg, graphdef, by_version, groups[pid], r)
            got = np.asarray(groups[pid].behavior_logp[r, : len(want_logp)])
            chex.assert_trees_all_close(got, want_logp, rtol=1e-7, atol=1e-5)
    # The static engine swapping after the same 3 tokens samples prompt 1's tokens too.
    state = static.init(
        p_old, grouped(PROMPTS[:3]), grouped(LENGTHS[:3]), jax.random.key(2), group_size=G
    )
    state = static.decode(p_new, static.decode(p_old, state, 3, version=0), version=1)
    chunked = static.finalize(state)
    chex.assert_trees_all_equal(groups[1].tokens, chunked.tokens[2:4])
    chex.assert_trees_all_equal(groups[1].versions, chunked.versions[2:4])


def test_the_ring_wraps_through_prompts_and_responses(params, engines, reference):
    """The cache is a ring of P + N − 1 columns written at the session's step count: over the
    workload it wraps several times, admissions land with their prompt columns straddling the
    ring's end, and the rollouts are still the static engine's."""
    engine = engines(2, 5)
    assert engine.slot_width == P + N - 1
    run = engine.session(jax.random.key(1), TRUNCATED)
    ids = np.arange(len(PROMPTS))
    run.add(PROMPTS, LENGTHS, prompt_ids=ids, max_lengths=LIMITS)
    done, admitted_at = {}, []
    while run.pending:
        column, waiting = int(run.state.column), run.waiting
        for group in run.advance(params[1], 0):
            done[group.prompt_id] = group.output
        if run.waiting < waiting:  # admitted before this window, at this column
            admitted_at.append(column)
    steps = run.slot_steps // engine.num_slots
    assert steps > 2 * engine.slot_width
    assert int(run.state.column) == steps % engine.slot_width
    # Some prompt's P − 1 columns run across the end of the ring back to column 0.
    assert any(0 < c < P - 1 for c in admitted_at), admitted_at
    assert_same_rollouts(concat_outputs([done[int(i)] for i in ids]), reference)


def test_groups_whole_none_lost_or_repeated_over_a_long_run(params, engines):
    engine = engines(4, 3)
    run = engine.session(jax.random.key(3), TRUNCATED)
    rng = np.random.default_rng(1)
    total, added, emitted, tokens = 40, 0, [], 0
    limits = {}
    while added < total or run.pending:
        if added < total and run.waiting < 3:  # prompts arrive while slots decode
            ids = list(range(added, added + 5))
            lim = rng.integers(1, N + 1, size=5 * G)
            for i, pid in enumerate(ids):
                limits[pid] = lim[i * G : (i + 1) * G]
            rows = [i % len(PROMPTS) for i in ids]
            run.add(PROMPTS[rows], LENGTHS[rows], prompt_ids=ids, tags=ids, max_lengths=lim)
            added += 5
        for group in run.advance(params[1], version=run.windows):
            assert group.tag == group.prompt_id
            out = group.output
            chex.assert_shape(out.tokens, (G, P + N))
            assert out.routing.shape[1] == G
            row = group.prompt_id % len(PROMPTS)
            n = LENGTHS[row]
            chex.assert_trees_all_equal(
                out.tokens[:, P - n : P], grouped(PROMPTS[row : row + 1, :n])
            )
            assert np.all(out.response_lengths <= limits[group.prompt_id])
            assert np.all(out.response_lengths >= 1)
            emitted.append(group.prompt_id)
            tokens += int(np.sum(out.response_lengths))
    assert sorted(emitted) == list(range(total))  # each prompt once
    assert run.pending == 0 and run.waiting == 0
    # Every live slot-step decoded one token of an emitted response; no window ran past 3 steps.
    assert run.live_steps == tokens < run.slot_steps <= run.windows * 3 * 4


def test_sharded_mesh_with_the_sharded_cache(cfg, params, engines, reference):
    graphdef, p = params
    mesh = parallel.make_mesh(1, fsdp=4, expert=2)
    sharded = jax.device_put(p, param_shardings(cfg, mesh))
    engine = engines(4, 3, mesh)
    run = engine.session(jax.random.key(1), TRUNCATED)
    assert run.state.cache.k.sharding.spec == cache_spec(mesh)
    assert run.state.cache.k.sharding.shard_shape(run.state.cache.k.shape)[1] == 1
    out = workload(engine, sharded)
    assert_same_rollouts(out, reference)


def test_bad_input_is_one_error_before_compute(cfg, params, engines):
    kw = dict(max_prompt_len=P, max_new_tokens=N, eos_id=EOS, group_size=G)
    with pytest.raises(ValueError, match="num_slots"):
        ContinuousSampler(cfg, num_slots=0, harvest_every=2, **kw)
    with pytest.raises(ValueError, match="harvest_every"):
        ContinuousSampler(cfg, num_slots=4, harvest_every=0, **kw)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"prefill_chunk must be a positive int, got {bad!r}"):
            ContinuousSampler(cfg, num_slots=4, harvest_every=2, prefill_chunk=bad, **kw)
    with pytest.raises(ValueError, match="fewer than group_size"):
        ContinuousSampler(cfg, num_slots=1, harvest_every=2, **kw)
    # 4 slots of P + N - 1 = 17 positions need 68; 60 hold 3.
    with pytest.raises(ValueError, match="cache_tokens=60 holds 3 slots"):
        ContinuousSampler(cfg, num_slots=4, harvest_every=3, cache_tokens=60, **kw)
    with pytest.raises(ValueError, match="the batch size"):
        ContinuousSampler(
            cfg, num_slots=6, harvest_every=3, mesh=parallel.make_mesh(1, fsdp=4, expert=2), **kw
        )
    engine = engines(4, 3)
    run = engine.session(jax.random.key(0))
    with pytest.raises(ValueError, match="max_prompt_len"):
        run.add(np.ones((1, P + 1), np.int32), np.array([P + 1]), prompt_ids=[0])
    run.add(PROMPTS[:1], LENGTHS[:1], prompt_ids=[0])
    with pytest.raises(ValueError, match="prompt_ids"):
        run.add(PROMPTS[:1], LENGTHS[:1], prompt_ids=[0])
    with pytest.raises(ValueError, match="max_lengths"):
        run.add(PROMPTS[:1], LENGTHS[:1], prompt_ids=[1], max_lengths=np.zeros(G, int))
    with pytest.raises(ValueError, match="group_size"):
        engine.generate(params[1], PROMPTS, LENGTHS, jax.random.key(0), group_size=1)
    assert run.waiting == 1 and run.windows == 0


def test_stream_mode_fills_the_slots_and_swaps_at_harvest_points(params, engines):
    """``StreamRollouts`` on the slots: batches of whole groups, responses crossing swaps, and
    the behaviour version handed over is the batch's oldest token's (pinned while in flight)."""
    from sat_jax.data import CharTokenizer
    from sat_jax.rl.rollout import RolloutEngine
    from sat_jax.rl.stream import StreamRollouts

    engine = RolloutEngine(
        sampler=engines(4, 3),
        tokenizer=CharTokenizer(),
        reward_fn=lambda text, example: float(len(text) % 2),
        group_size=G,
        sampling=SamplingParams(),
    )
    prompts = iter(lambda: [{"prompt": "1+2="}, {"prompt": "34+5="}], None)
    stream = StreamRollouts(engine, prompts, seed=0, queue_size=1, needs_old=True)
    published = {0: params[1]}
    stream.publish(0, published[0])
    stream.start()
    rollouts = []
    try:
        deadline = time.monotonic() + 600  # the first window compiles
        while len(rollouts) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
            v = len(published)
            published[v] = jax.tree.map(lambda x: x, params[1])  # a new object per version
            stream.publish(v, published[v])
            assert len(stream.store.versions()) <= 1 + 2 + 4 // G
            if not stream.queue.empty() or stream._error is not None:
                rollouts.append(stream.next(v))
    finally:
        stream.close()
    assert len(rollouts) == 3
    crossed = 0
    for r in rollouts:
        versions, mask = np.asarray(r.batch.versions), np.asarray(r.batch.response_mask)
        chex.assert_shape(versions, (2 * G, N))
        live = [row[m] for row, m in zip(versions, mask, strict=True)]
        assert all(np.all(np.diff(x) >= 0) for x in live)
        crossed += sum(len(set(x)) > 1 for x in live)
        assert r.behaviour["old"] is published[int(min(x.min() for x in live))]
    assert crossed > 0 and stream.swaps > 0
    assert 0 < r.metrics["stream/slot_use"] <= 1


def test_stream_checkpoint_keeps_finished_batches_and_counts_groups_in_the_slots(
    params, engines, caplog
):
    """A checkpoint of a continuous stream: every drawn group is in a saved batch or counted as
    discarded (still in the slots), and a restored source serves the saved batches first."""
    import logging

    from sat_jax.data import CharTokenizer
    from sat_jax.rl.rollout import RolloutEngine
    from sat_jax.rl.stream import StreamRollouts

    def make():
        engine = RolloutEngine(
            sampler=engines(4, 3),
            tokenizer=CharTokenizer(),
            reward_fn=lambda text, example: float(len(text) % 2),
            group_size=G,
            sampling=SamplingParams(),
        )
        prompts = iter(lambda: [{"prompt": "1+2="}, {"prompt": "34+5="}], None)
        return StreamRollouts(engine, prompts, seed=0, queue_size=1, needs_old=True)

    stream = make()
    stream.publish(0, params[1])
    stream.start()
    try:
        deadline = time.monotonic() + 600  # the first window compiles
        while stream._finished is None and time.monotonic() < deadline:  # queue full + 1 waiting
            stream._thread.join(0.05)
            assert stream._error is None
        arrays, meta = stream.state()
        drawn = stream._groups_in_flight + 2 * len(meta["queued"])
    finally:
        stream.close()
    assert [q["index"] for q in meta["queued"]] == [0, 1] and meta["next_index"] == 2
    assert meta["inflight"] == 0 and meta["inflight_groups"] >= 0
    assert drawn == meta["inflight_groups"] + 4  # two saved batches of two groups each
    resumed = make()
    resumed.publish(0, params[1])
    with caplog.at_level(logging.WARNING):
        resumed.restore(arrays, meta)
    assert ("still in the continuous engine's slots" in caplog.text) == bool(
        meta["inflight_groups"]
    )
    first = resumed.next(0)  # served from the restored queue, without the worker
    chex.assert_trees_all_equal(first.batch.tokens, arrays["0"]["tokens"])

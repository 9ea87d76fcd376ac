"""Tests of the resumable, shardable prompt iterator."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sat_jax.data import ListSource, PromptIterator


def _source(n):
    return ListSource([{"prompt": f"p{i}", "answer": str(i)} for i in range(n)])


def _ids(batch):
    return [ex["index"] for ex in batch]


def test_unshuffled_batches_in_order_and_remainder_dropped():
    it = PromptIterator(_source(7), batch_size=3, seed=0, shuffle=False)
    # 7 // 3 = 2 batches per epoch; example 6 never appears without shuffling.
    got = [_ids(next(it)) for _ in range(5)]
    assert got == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert it.state()["epoch"] == 2 and it.state()["position"] == 1


def test_shuffled_epochs_are_permutations_and_differ():
    it = PromptIterator(_source(12), batch_size=4, seed=7)
    epochs = [sum((_ids(next(it)) for _ in range(3)), []) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1]
    again = PromptIterator(_source(12), batch_size=4, seed=7)
    assert sum((_ids(next(again)) for _ in range(3)), []) == epochs[0]
    other = PromptIterator(_source(12), batch_size=4, seed=8)
    assert sum((_ids(next(other)) for _ in range(3)), []) != epochs[0]


def test_resume_equals_uninterrupted_run():
    reference = PromptIterator(_source(10), batch_size=3, seed=11)
    uninterrupted = [_ids(next(reference)) for _ in range(12)]

    first = PromptIterator(_source(10), batch_size=3, seed=11)
    for _ in range(5):
        next(first)
    saved = json.loads(json.dumps(first.state()))  # as a checkpoint would store it
    assert saved == {
        "epoch": 1,
        "position": 2,
        "seed": 11,
        "batch_size": 3,
        "num_examples": 10,
        "shuffle": True,
    }
    fresh = PromptIterator(_source(10), batch_size=3, seed=999)  # the state's seed wins
    fresh.restore(saved)
    assert [_ids(next(fresh)) for _ in range(7)] == uninterrupted[5:]


def test_resume_at_epoch_boundary():
    a = PromptIterator(_source(6), batch_size=3, seed=1)
    next(a), next(a)
    b = PromptIterator(_source(6), batch_size=3, seed=1)
    b.restore(a.state())
    assert _ids(next(b)) == _ids(next(a))


@pytest.mark.parametrize("process_count", [2, 4])
def test_shards_are_disjoint_and_concatenate_to_global_batch(process_count):
    glob = PromptIterator(_source(20), batch_size=8, seed=3)
    shards = [
        PromptIterator(_source(20), 8, 3, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for _ in range(6):
        parts = [_ids(next(s)) for s in shards]
        assert all(len(p) == 8 // process_count for p in parts)
        assert len(set(sum(parts, []))) == 8
        assert sum(parts, []) == _ids(next(glob))


def test_state_resumes_with_another_process_count():
    single = PromptIterator(_source(20), batch_size=8, seed=3)
    next(single), next(single)
    halves = [PromptIterator(_source(20), 8, 3, process_index=p, process_count=2) for p in (0, 1)]
    for h in halves:
        h.restore(single.state())
    assert _ids(next(halves[0])) + _ids(next(halves[1])) == _ids(next(single))


def test_global_indices_does_not_advance():
    it = PromptIterator(_source(4), batch_size=2, seed=0, shuffle=False)
    assert list(it.global_indices()) == [0, 1]
    assert _ids(next(it)) == [0, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the source \(10"):
        PromptIterator(_source(10), batch_size=11, seed=0)
    with pytest.raises(ValueError, match="divisible by process_count=4"):
        PromptIterator(_source(10), batch_size=6, seed=0, process_count=4)
    with pytest.raises(ValueError, match="process_index=2 must be < process_count=2"):
        PromptIterator(_source(10), batch_size=4, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptIterator(_source(10), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        PromptIterator(_source(10), batch_size=2, seed=-1)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        PromptIterator(_source(10), batch_size=2.0, seed=0)


def test_restore_rejects_incompatible_state():
    it = PromptIterator(_source(10), batch_size=2, seed=0)
    state = it.state()
    with pytest.raises(ValueError, match="batch_size=2, but this iterator has batch_size=5"):
        PromptIterator(_source(10), batch_size=5, seed=0).restore(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptIterator(_source(12), batch_size=2, seed=0).restore(state)
    with pytest.raises(ValueError, match="no 'position'"):
        it.restore({"epoch": 0, "seed": 0})
    with pytest.raises(ValueError, match="exceeds the 5 batches"):
        it.restore(dict(state, position=6))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 30),
    process_count=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**31),
    stop=st.integers(0, 12),
)
def test_resume_and_sharding_property(n, batch_size, process_count, seed, stop):
    assume(batch_size <= n and batch_size % process_count == 0)
    glob = PromptIterator(_source(n), batch_size, seed)
    expected = [_ids(next(glob)) for _ in range(stop + 4)]
    shards = [
        PromptIterator(_source(n), batch_size, seed, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for step in range(stop):
        assert sum((_ids(next(s)) for s in shards), []) == expected[step]
    resumed = [
        PromptIterator(_source(n), batch_size, 0, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for r, s in zip(resumed, shards, strict=True):
        r.restore(s.state())
    for step in range(stop, stop + 4):
        assert sum((_ids(next(r)) for r in resumed), []) == expected[step]

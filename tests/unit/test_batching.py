"""batching.py: global-batch invariance across world sizes and the deterministic sample order."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotfill.config.batching import (BatchShape, batch_shape, check_elastic_range,
                               rank_micro_batches, rank_positions, rows_to_stream, step_stream_indices, stream_to_rows,
                               valid_world_sizes)
from spotfill.config.errors import ConfigError

FAST = settings(max_examples=150, deadline=None)


@st.composite
def batch_and_world(draw):
    """A global batch and a world size that divides it."""
    world = draw(st.integers(1, 64))
    per_rank = draw(st.integers(1, 64))
    return world * per_rank, world


# -- batch_shape ---------------------------------------------------------------------------------
@FAST
@given(batch_and_world(), st.integers(1, 128))
def test_batch_shape_keeps_global_batch_at_every_valid_world(gw, max_micro):
    global_batch, world = gw
    shape = batch_shape(global_batch, world, max_micro)
    assert shape.micro_batch * shape.accum * shape.world_size == global_batch
    assert shape.global_batch == global_batch and shape.world_size == world
    assert 1 <= shape.micro_batch <= max_micro
    assert shape.per_rank == global_batch // world
    # the largest divisor of the per-rank count that fits under max_micro
    per_rank = global_batch // world
    assert shape.micro_batch == max(d for d in range(1, min(per_rank, max_micro) + 1) if per_rank % d == 0)


@FAST
@given(st.integers(1, 512), st.integers(1, 16), st.integers(1, 16))
def test_every_valid_world_in_range_keeps_global_batch(global_batch, lo, span):
    for world in valid_world_sizes(global_batch, lo, lo + span):
        s = batch_shape(global_batch, world, 8)
        assert s.micro_batch * s.accum * world == global_batch


def test_batch_shape_examples():
    assert batch_shape(16, 4, 8) == BatchShape(16, 4, 4, 1)
    assert batch_shape(16, 1, 8) == BatchShape(16, 1, 8, 2)
    assert batch_shape(12, 2, 4) == BatchShape(12, 2, 3, 2)    # 6 per rank: micro 3 x accum 2
    assert batch_shape(14, 2, 4) == BatchShape(14, 2, 1, 7)    # 7 is prime: micro 1


@pytest.mark.parametrize("global_batch,world", [(16, 3), (10, 4), (7, 2), (1, 2)])
def test_batch_shape_rejects_indivisible(global_batch, world):
    with pytest.raises(ConfigError) as err:
        batch_shape(global_batch, world, 8)
    assert err.value.field == "training.global_batch"
    assert "training.global_batch" in str(err.value)
    assert f"world size {world}" in str(err.value)


def test_batch_shape_rejects_world_zero():
    with pytest.raises(ConfigError):
        batch_shape(16, 0, 8)


# -- elastic range -------------------------------------------------------------------------------
def test_check_elastic_range_accepts_divisible_range():
    check_elastic_range(16, 1, 2)
    check_elastic_range(16, 4, 4)
    check_elastic_range(12, 1, 4)
    check_elastic_range(60, 1, 6)


def test_check_elastic_range_rejects_and_names_bad_sizes():
    with pytest.raises(ConfigError) as err:
        check_elastic_range(16, 1, 4)
    msg = str(err.value)
    assert err.value.field == "training.global_batch"
    assert msg.startswith("training.global_batch:")
    assert "[3]" in msg and "[1, 4]" in msg
    assert "[1, 2, 4]" in msg           # the divisors it may use instead


@FAST
@given(st.integers(1, 256), st.integers(1, 12), st.integers(0, 12))
def test_check_elastic_range_agrees_with_batch_shape(global_batch, lo, span):
    hi = lo + span
    try:
        check_elastic_range(global_batch, lo, hi)
    except ConfigError:
        assert valid_world_sizes(global_batch, lo, hi) != list(range(lo, hi + 1))
    else:
        for w in range(lo, hi + 1):
            batch_shape(global_batch, w, 4)      # never raises


# -- which samples a rank takes --------------------------------------------------------------------
@FAST
@given(batch_and_world(), st.integers(1, 16), st.integers(0, 10_000))
def test_ranks_partition_the_step_exactly(gw, max_micro, step):
    global_batch, world = gw
    shape = batch_shape(global_batch, world, max_micro)
    taken: list[int] = []
    for rank in range(world):
        micro_batches = rank_micro_batches(step, shape, rank)
        assert len(micro_batches) == shape.accum
        assert all(len(mb) == shape.micro_batch for mb in micro_batches)
        taken += [g for mb in micro_batches for g in mb]
    assert len(taken) == len(set(taken)), "overlap between ranks"
    assert sorted(taken) == list(step_stream_indices(step, global_batch)), "gap or stray index"


@FAST
@given(st.sampled_from([12, 24, 60]), st.integers(0, 1000))
def test_step_samples_do_not_depend_on_world_size(global_batch, step):
    def step_set(world):
        shape = batch_shape(global_batch, world, 4)
        return {g for r in range(world) for mb in rank_micro_batches(step, shape, r) for g in mb}

    sets = [step_set(w) for w in (1, 2, 3, 4, 6)]
    assert all(s == sets[0] for s in sets)


def test_steps_are_consecutive_and_disjoint():
    assert list(step_stream_indices(0, 4)) == [0, 1, 2, 3]
    assert list(step_stream_indices(3, 4)) == [12, 13, 14, 15]


# -- stream index -> dataset row ---------------------------------------------------------------------
@pytest.mark.parametrize("n_rows", [1, 7, 50, 1000])
def test_stream_to_rows_is_a_permutation_per_epoch(n_rows):
    for epoch in range(3):
        rows = stream_to_rows(range(epoch * n_rows, (epoch + 1) * n_rows), n_rows, seed=5)
        assert sorted(rows.tolist()) == list(range(n_rows))


def test_stream_to_rows_deterministic_for_a_seed():
    a = stream_to_rows(range(0, 300), 100, seed=7)
    b = stream_to_rows(list(range(0, 300)), 100, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, stream_to_rows(range(0, 300), 100, seed=8))


def test_stream_to_rows_reshuffles_each_epoch():
    n = 100
    epochs = [stream_to_rows(range(e * n, (e + 1) * n), n, seed=0) for e in range(4)]
    for i in range(len(epochs)):
        for j in range(i + 1, len(epochs)):
            assert not np.array_equal(epochs[i], epochs[j])


@FAST
@given(st.lists(st.integers(0, 5000), max_size=50), st.integers(1, 97), st.integers(0, 3))
def test_stream_to_rows_pointwise_matches_whole_epoch(indices, n_rows, seed):
    """Any subset (in any order, across epochs) maps as the full epoch mapping does."""
    rows = stream_to_rows(indices, n_rows, seed)
    assert rows.shape == (len(indices),)
    for g, r in zip(indices, rows):
        e = g // n_rows
        full = stream_to_rows(range(e * n_rows, (e + 1) * n_rows), n_rows, seed)
        assert r == full[g % n_rows]


@FAST
@given(st.lists(st.integers(0, 5000), max_size=50), st.integers(1, 97), st.integers(0, 3))
def test_rows_to_stream_inverts_stream_to_rows(indices, n_rows, seed):
    """The position a row read in an epoch is: back to the index it was read for, in any order."""
    idx = np.asarray(indices, dtype=np.int64)
    rows = stream_to_rows(idx, n_rows, seed)
    assert rows_to_stream(rows, idx // n_rows, n_rows, seed).tolist() == idx.tolist()


def test_rows_to_stream_of_another_row_is_another_position():
    idx = np.arange(30, 40)
    rows = stream_to_rows(idx, 13, 1)
    assert (rows_to_stream((rows + 1) % 13, idx // 13, 13, 1) != idx).all()
    assert (rows_to_stream(stream_to_rows(idx, 13, 2), idx // 13, 13, 1) != idx).any()


# -- rank_positions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_rank_positions_is_rank_micro_batches_flattened(world):
    shape = batch_shape(12, world, 2)
    for step in (0, 5):
        for r in range(world):
            flat = [g for mb in rank_micro_batches(step, shape, r) for g in mb]
            assert rank_positions(step, shape, r).tolist() == flat

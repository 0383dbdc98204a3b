"""sample_ledger.py: the exactly-once ledger catches resumes off by k steps and ranks feeding wrong slices.

The histories below are driven the way the worker drives the ledger: each rank records the positions it
fed, every checkpoint folds the ranks' records into the ledger and keeps its state, a resume restores the
state of the checkpoint it loads. Faults are injected into what is fed (the resume step, a rank's slice);
the expected counts are worked out by hand in each test's comment.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from spotfill.config.batching import batch_shape, rank_positions
from spotfill.train.sample_ledger import FeedRecorder, SampleLedger, normalize, runs


class History:
    """One model lineage: attempts feed steps; checkpoints carry the ledger state."""

    def __init__(self, global_batch: int):
        self.g = global_batch
        self.ledger = SampleLedger()
        self.checkpoints: dict[int, dict] = {}

    def attempt(self, world: int, first: int, last: int, every: int, feed=None, die_after: int | None = None):
        """Run steps first..last-1 at `world`; checkpoint every `every` completed steps and at `last`. `feed`
        (step, rank, positions) -> positions lets a test corrupt what a rank feeds. `die_after`: the attempt
        dies after that many completed steps, without a checkpoint for the steps since the last one."""
        shape = batch_shape(self.g, world, 4)
        recorders = [FeedRecorder() for _ in range(world)]
        for step in range(first, last):
            for r in range(world):
                pos = rank_positions(step, shape, r)
                recorders[r].record(feed(step, r, pos) if feed else pos)
            done = step + 1
            if die_after is not None and done == die_after:
                return
            if done % every == 0 or done == last:
                self.ledger = self.ledger.with_fed(*[rec.take() for rec in recorders])
                self.checkpoints[done] = pickle.loads(pickle.dumps(self.ledger.to_state()))

    def resume(self, from_checkpoint: int) -> None:
        self.ledger = SampleLedger.from_state(self.checkpoints[from_checkpoint])


def test_clean_run_is_one_segment():
    h = History(12)
    h.attempt(world=2, first=0, last=60, every=20)
    assert h.ledger.segments.tolist() == [[0, 720, 1]]
    assert h.ledger.summary(owed=720).as_report() == {"consumed": 720, "duplicates": 0, "missing": 0,
                                                      "source": "checkpoint-ledger"}


def test_rollback_after_a_hard_loss_is_not_a_duplicate():
    # attempt 0 fed steps 0..46 and died; its feeds after the checkpoint at 40 never reached a checkpoint.
    # attempt 1 (3 workers) resumes from 40 and redoes 40..59: every position exactly once.
    h = History(12)
    h.attempt(world=2, first=0, last=60, every=20, die_after=47)
    h.resume(40)
    h.attempt(world=3, first=40, last=60, every=20)
    s = h.ledger.summary(owed=720)
    assert (s.consumed, s.duplicates, s.missing) == (720, 0, 0)


def test_resume_three_steps_late_misses_three_steps():
    # checkpoint at 40, resumed at 43 (G=12): positions 480..515 (36) never fed; 720 - 36 = 684 consumed
    h = History(12)
    h.attempt(world=2, first=0, last=60, every=20, die_after=47)
    h.resume(40)
    h.attempt(world=2, first=43, last=60, every=20)
    s = h.ledger.summary(owed=720)
    assert (s.consumed, s.duplicates, s.missing) == (684, 0, 36)
    assert h.ledger.count(479) == 1 and h.ledger.count(480) == 0 and h.ledger.count(515) == 0
    assert h.ledger.count(516) == 1


def test_resume_three_steps_early_repeats_three_steps():
    # checkpoint at 40, resumed at 37: positions 444..479 (36) fed twice; 720 + 36 = 756 consumed
    h = History(12)
    h.attempt(world=2, first=0, last=60, every=20, die_after=47)
    h.resume(40)
    h.attempt(world=4, first=37, last=60, every=20)
    s = h.ledger.summary(owed=720)
    assert (s.consumed, s.duplicates, s.missing) == (756, 36, 0)
    assert h.ledger.count(443) == 1 and h.ledger.count(444) == 2 and h.ledger.count(479) == 2
    assert h.ledger.count(480) == 1


@pytest.mark.parametrize("k", [-5, -2, -1, 1, 2, 5])
@pytest.mark.parametrize("world_after", [1, 2, 3])
def test_resume_off_by_k_steps(k, world_after):
    # G=6, 30 steps, checkpoint at 10, resumed at 10 + k: |k| * 6 positions repeated (k < 0) or missed
    h = History(6)
    h.attempt(world=2, first=0, last=30, every=10, die_after=14)
    h.resume(10)
    h.attempt(world=world_after, first=10 + k, last=30, every=10)
    s = h.ledger.summary(owed=180)
    expected = (180 - 6 * k, 6 * -k, 0) if k < 0 else (180 - 6 * k, 0, 6 * k)
    assert (s.consumed, s.duplicates, s.missing) == expected


def test_resume_from_the_model_of_one_checkpoint_with_the_ledger_of_another_is_caught():
    # the model resumes from 40 but the ledger restored is the checkpoint at 20's: 20 steps (240) missing
    h = History(12)
    h.attempt(world=2, first=0, last=40, every=20)
    h.resume(20)
    h.attempt(world=2, first=40, last=60, every=20)
    s = h.ledger.summary(owed=720)
    assert (s.consumed, s.duplicates, s.missing) == (480, 0, 240)


def test_a_rank_feeding_its_neighbours_slice():
    # G=8, world 2 (4 per rank): at step 5 rank 1 feeds rank 0's slice 40..43 instead of its own 44..47
    def wrong(step, rank, pos):
        return pos - 4 if (step, rank) == (5, 1) else pos

    h = History(8)
    h.attempt(world=2, first=0, last=10, every=5, feed=wrong)
    s = h.ledger.summary(owed=80)
    assert (s.consumed, s.duplicates, s.missing) == (80, 4, 4)
    assert [h.ledger.count(p) for p in (39, 40, 43, 44, 47, 48)] == [1, 2, 2, 0, 0, 1]


def test_a_rank_feeding_the_next_steps_slice_counts_what_the_schedule_never_owed():
    # G=8, 10 steps: on the last step rank 1 feeds 84..87 (step 10's, beyond the schedule) for 76..79:
    # 76..79 missing (4); 84..87 are fed but never owed -> 4 duplicates
    def ahead(step, rank, pos):
        return pos + 8 if (step, rank) == (9, 1) else pos

    h = History(8)
    h.attempt(world=2, first=0, last=10, every=5, feed=ahead)
    s = h.ledger.summary(owed=80)
    assert (s.consumed, s.duplicates, s.missing) == (80, 4, 4)


def test_a_rank_that_re_reads_within_its_step():
    # rank 0 of world 1 (G=4) feeds [8, 9, 8, 9] at step 2: 8 and 9 twice, 10 and 11 never
    def reread(step, rank, pos):
        return np.array([8, 9, 8, 9]) if step == 2 else pos

    h = History(4)
    h.attempt(world=1, first=0, last=4, every=2, feed=reread)
    s = h.ledger.summary(owed=16)
    assert (s.consumed, s.duplicates, s.missing) == (16, 2, 2)


def test_runs_and_normalize_by_hand():
    # sorted [3, 4, 4, 5, 9]: runs 3..4, 4..5, 9
    assert runs(np.array([5, 3, 4, 4, 9])).tolist() == [[3, 5, 1], [4, 6, 1], [9, 10, 1]]
    assert normalize(runs(np.array([5, 3, 4, 4, 9]))).tolist() == [[3, 4, 1], [4, 5, 2], [5, 6, 1], [9, 10, 1]]
    # touching segments with equal counts join; with different counts they stay apart
    assert normalize(np.array([[0, 5, 1], [5, 8, 1], [8, 9, 2]])).tolist() == [[0, 8, 1], [8, 9, 2]]
    assert runs(np.array([], dtype=np.int64)).shape == (0, 3)
    assert SampleLedger().summary(owed=10).missing == 10


def test_state_round_trip_and_bad_format():
    led = SampleLedger().with_fed(runs(np.arange(0, 10)), runs(np.arange(5, 7)))
    state = led.to_state()
    assert state["segments"] == [[0, 5, 1], [5, 7, 2], [7, 10, 1]]
    assert SampleLedger.from_state(pickle.loads(pickle.dumps(state))) == led
    assert SampleLedger.from_state(None) == SampleLedger()
    with pytest.raises(ValueError, match="unknown format"):
        SampleLedger.from_state({"format": "other", "segments": []})


def test_recorder_take_starts_over():
    rec = FeedRecorder()
    rec.record(np.arange(0, 4))
    rec.record(np.arange(4, 8))
    assert rec.take().tolist() == [[0, 8, 1]]
    assert rec.take().shape == (0, 3)


def test_loader_fault_reaches_the_ledger(tmp_path):
    """End to end on real shards: the positions recorded are the ones the ids stored in the rows read say
    (rows_to_stream over StepBatch.row_ids, as feed.py records them), not the step's; a rank that builds its
    batch from the wrong slice is counted, and the feed's check refuses that batch outright."""
    from spotfill.config.errors import DataMismatch
    from spotfill.storage.base import open_storage
    from spotfill.config.batching import rows_to_stream
    from spotfill.train.data import ShardReader, ShardWriter, read_step
    from spotfill.train.feed import fed_positions

    storage = open_storage(str(tmp_path / "ds"))
    w = ShardWriter(storage, 4, 257, "bytes", rows_per_shard=5)
    w.add(np.arange(13 * 5).reshape(13, 5) % 257)
    w.close()
    reader = ShardReader(storage, str(tmp_path / "cache"))
    shape = batch_shape(4, 2, 2)          # 2 per rank
    ledger = SampleLedger()
    rec = [FeedRecorder(), FeedRecorder()]
    for step in range(8):                 # 32 positions: more than two epochs of 13 rows
        for r in range(2):
            owed = rank_positions(step, shape, r)
            src = 0 if (step, r) == (5, 1) else r          # the fault: rank 1 reads rank 0's slice at step 5
            batch = read_step(reader, step, rank_positions(step, shape, src), shape.accum, seed=3)
            rec[r].record(rows_to_stream(batch.row_ids, owed // 13, 13, seed=3))
            if src != r:
                with pytest.raises(DataMismatch, match="step 5, rank 1: 2 of 2 rows read are not the rows"):
                    fed_positions(reader, step, r, owed, batch.row_ids, seed=3)
    ledger = ledger.with_fed(*[x.take() for x in rec])
    s = ledger.summary(owed=32)
    # step 5 owes 20..23 (all of epoch 1); rank 1 fed 20, 21 again instead of 22, 23
    assert (s.consumed, s.duplicates, s.missing) == (32, 2, 2)
    assert ledger.count(20) == 2 and ledger.count(22) == 0 and ledger.count(23) == 0

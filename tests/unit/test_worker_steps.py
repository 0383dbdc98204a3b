"""worker_loop.run_attempt, the real step loop of one attempt, on real shards: a resume feeds every stream
position exactly once (the ledger it saves says so, and so do the rows the model was fed, read back from
their tokens); a resume off by k steps shows in that ledger; a read of other rows than the schedule owes
stops the attempt before the model sees them, naming the shards; a resume on other data (another seed,
a replaced shard) is refused. No Ray: the engine, the event sink and the checkpointer are stand-ins, the
collectives are a world of one rank (worker_loop._Comms(1)), the reader, feed, ledger and executor real.

The dataset's row r holds tokens [r, r, r, r, r], so what the stand-in engine was fed says which rows the
model saw, independently of the reader's ids and of the ledger."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spotfill.config.errors import DataMismatch
from spotfill.config.job import JobConfig, from_mapping
from spotfill.storage.base import open_storage
from spotfill.train import feed, worker_loop
from spotfill.config.batching import batch_shape
from spotfill.train.data import ShardReader, ShardWriter
from spotfill.train.feed import DATA_KEY, LEDGER_KEY
from spotfill.train.sample_ledger import SampleLedger
from tests.unit.worker_standins import Checkpointer

N, G, STEPS, EVERY = 23, 4, 16, 4        # 64 positions: two whole epochs of 23 rows and 18 rows of a third


class NodeLost(RuntimeError):
    pass


class Engine:
    """DeepSpeed's engine calls over one learnable vector of logits; records the rows of every micro-batch
    and dies (NodeLost) at the forward of micro-batch `die_at` when given."""

    device = torch.device("cpu")

    def __init__(self, die_at: int | None = None):
        self.logits = torch.zeros(257, requires_grad=True)
        self.fed: list[list[int]] = []
        self.die_at = die_at

    def __call__(self, x):
        if len(self.fed) == self.die_at:
            raise NodeLost("the node is gone")
        self.fed.append(x[:, 0].tolist())
        return self.logits.expand(*x.shape, 257)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def get_lr(self):
        return [1e-3]

    def rows(self) -> list[int]:
        return [r for mb in self.fed for r in mb]


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class Sink:
    def __init__(self):
        self.events: list[dict] = []
        self.event = _Remote(lambda kind, **f: self.events.append({"kind": kind, **f}))
        self.log = _Remote(self.events.extend)


@pytest.fixture(autouse=True)
def no_notice_here(monkeypatch):
    monkeypatch.setattr(worker_loop, "local_preemption_info", lambda: None)


def _dataset(root, replace_row: int | None = None) -> str:
    """N rows of [r]*5 in shards of 6, 6, 6, 5; `replace_row`: that row's tokens differ (a replaced shard)."""
    rows = np.repeat(np.arange(N)[:, None], 5, axis=1)
    if replace_row is not None:
        rows[replace_row] = 200
    writer = ShardWriter(open_storage(str(root)), 4, 257, "bytes", rows_per_shard=6)
    writer.add(rows)
    writer.close()
    return str(root)


def _attempt(tmp_path, data: str, engine: Engine, ckpt: Checkpointer, client_state: dict | None,
             attempt: int, seed: int = 0, sink: Sink | None = None) -> dict:
    job = from_mapping(JobConfig, {"name": "x", "run_dir": str(tmp_path), "storage": str(tmp_path),
                                   "data": {"path": data, "seed": seed},
                                   "training": {"steps": STEPS, "global_batch": G, "max_micro_batch": 2,
                                                "checkpoint_every": EVERY, "workers": [1, 1],
                                                "elastic_restarts": "stock"}})
    reader = ShardReader(open_storage(data), str(tmp_path / f"cache-{attempt}"))
    return worker_loop.run_attempt(
        job, sink or Sink(), worker_loop._Comms(1), engine, reader, ckpt, rank=0, world=1, attempt=attempt,
        shape=batch_shape(G, 1, 2), vocab=257, flops={"flops_per_token": 1.0, "hardware_flops_per_token": 1.0},
        device={"peak_flops_per_gpu": None}, client_state=client_state, start_event={"attempt": attempt})


def _lost_after_six_steps(tmp_path, data: str) -> tuple[Checkpointer, Engine]:
    """Attempt 0 saves at step 4 and dies in step 7 (2 micro-batches a step): its steps 5 and 6 are lost."""
    ckpt, engine = Checkpointer(), Engine(die_at=12)
    with pytest.raises(NodeLost):
        _attempt(tmp_path, data, engine, ckpt, None, attempt=0)
    assert [s["step"] for s in ckpt.saves] == [4]
    return ckpt, engine


def test_a_resume_feeds_every_position_once_by_the_ledger_and_by_the_rows_fed(tmp_path):
    data = _dataset(tmp_path / "data")
    ckpt, first = _lost_after_six_steps(tmp_path, data)
    sink, second = Sink(), Engine()
    assert _attempt(tmp_path, data, second, ckpt, ckpt.saves[-1]["state"], attempt=1, sink=sink)["ok"]
    final = ckpt.saves[-1]["state"]
    assert final["step"] == STEPS
    s = SampleLedger.from_state(final[LEDGER_KEY]).summary(owed=STEPS * G)     # the ledger the checkpoint holds
    assert (s.consumed, s.duplicates, s.missing) == (64, 0, 0)
    # the final model's rows: attempt 0's first 4 steps (16 rows), then attempt 1's 12 steps. Each epoch
    # feeds every one of the 23 rows once; the third epoch 18 distinct rows.
    rows = first.rows()[:16] + second.rows()
    assert len(rows) == 64
    assert sorted(rows[:23]) == sorted(rows[23:46]) == list(range(N)) and len(set(rows[46:])) == 18
    start = next(e for e in sink.events if e["kind"] == "resume")
    assert start["step"] == 4 and start["data_check"] == "checked"
    assert final[DATA_KEY]["seed"] == 0 and final[DATA_KEY]["rows"] == N


@pytest.mark.parametrize("k", [3, -3])
def test_a_resume_off_by_k_steps_shows_in_the_ledger_the_loop_saves(tmp_path, monkeypatch, k):
    """The fault injected where the loop takes its first step from the checkpoint: k steps (k x G
    positions) missing (k > 0) or fed twice (k < 0)."""
    real = feed.resume_point

    def off_by_k(client_state, identity):
        step, ledger, check = real(client_state, identity)
        return (step + k, ledger, check) if client_state else (step, ledger, check)

    monkeypatch.setattr(worker_loop, "resume_point", off_by_k)
    data = _dataset(tmp_path / "data")
    ckpt, _ = _lost_after_six_steps(tmp_path, data)
    _attempt(tmp_path, data, Engine(), ckpt, ckpt.saves[-1]["state"], attempt=1)
    s = ckpt.saves[-1]["ledger"].summary(owed=STEPS * G)
    assert (s.duplicates, s.missing) == ((0, k * G) if k > 0 else (-k * G, 0))


@pytest.mark.parametrize("fault", ["offset +7", "another seed"])
def test_reading_other_rows_than_the_schedule_owes_stops_before_the_model_sees_them(tmp_path, monkeypatch, fault):
    real = feed.read_step

    def faulty(reader, step, positions, accum, seed):
        if step == 5:
            positions, seed = (positions + 7, seed) if fault == "offset +7" else (positions, seed + 1)
        return real(reader, step, positions, accum, seed)

    monkeypatch.setattr(feed, "read_step", faulty)
    data = _dataset(tmp_path / "data")
    engine = Engine()
    with pytest.raises(DataMismatch) as err:
        _attempt(tmp_path, data, engine, Checkpointer(), None, attempt=0)
    msg = str(err.value)
    assert msg.startswith("step 5, rank 0: ") and "\n" not in msg, msg
    # step 5 owes stream positions 20..23; the message names the row owed and the row read, with their shards
    assert "rows the schedule owes (data.seed 0): stream position 2" in msg
    assert msg.count("(shard-0000") == 2, msg
    assert len(engine.fed) == 5 * 2            # steps 0..4 only: step 5 never reached the model


def test_a_resume_with_another_data_seed_is_refused(tmp_path):
    data = _dataset(tmp_path / "data")
    ckpt, _ = _lost_after_six_steps(tmp_path, data)
    engine = Engine()
    with pytest.raises(DataMismatch, match=r"the checkpoint at step 4 was trained on other data than this run "
                                           r"reads \(data.seed 0 in the checkpoint, 5 now\)"):
        _attempt(tmp_path, data, engine, ckpt, ckpt.saves[-1]["state"], attempt=1, seed=5)
    assert engine.fed == []


def test_a_resume_on_a_dataset_with_a_replaced_shard_is_refused_naming_it(tmp_path):
    data = _dataset(tmp_path / "data")
    ckpt, _ = _lost_after_six_steps(tmp_path, data)
    other = _dataset(tmp_path / "other", replace_row=14)          # row 14 is in the third shard (12..17)
    with pytest.raises(DataMismatch, match=r"\(shard-00002.npy has sha256 \w{12}, the checkpoint's \w{12}\)"):
        _attempt(tmp_path, other, Engine(), ckpt, ckpt.saves[-1]["state"], attempt=1)


def test_a_checkpoint_from_before_data_identities_resumes_and_says_the_data_was_not_checked(tmp_path):
    data = _dataset(tmp_path / "data")
    ckpt, _ = _lost_after_six_steps(tmp_path, data)
    old = {k: v for k, v in ckpt.saves[-1]["state"].items() if k != DATA_KEY}
    sink = Sink()
    assert _attempt(tmp_path, data, Engine(), ckpt, old, attempt=1, sink=sink)["ok"]
    start = next(e for e in sink.events if e["kind"] == "resume")
    assert start["data_check"].startswith("not checked: the checkpoint records no data identity")
    assert ckpt.saves[-1]["ledger"].summary(owed=STEPS * G).missing == 0


def test_a_notice_held_before_the_first_step_leaves_without_a_step_or_a_save(tmp_path, monkeypatch):
    """A spot notice that reached the group while it started or restored: the group leaves before its first
    step (its state is the checkpoint it restored: nothing to save, nothing lost), instead of stepping into
    a deadline it may no longer save within."""
    import ray

    data = _dataset(tmp_path / "data")
    notice = type("Notice", (), {"deadline_ms": 4_000_000_000_000})()
    monkeypatch.setattr(worker_loop, "local_preemption_info", lambda: notice)
    monkeypatch.setattr(ray, "get", lambda value, **_: value)     # the stand-in sink answers at once
    sink = Sink()
    sink.planned_exit = _Remote(lambda reason, **f: sink.events.append({"kind": "planned_exit", "reason": reason, **f}))
    ckpt, engine = Checkpointer(), Engine()
    with pytest.raises(worker_loop.PlannedExit):
        _attempt(tmp_path, data, engine, ckpt, None, attempt=0, sink=sink)
    assert engine.fed == [] and ckpt.saves == []
    (exit_event,) = [e for e in sink.events if e["kind"] == "planned_exit"]
    assert exit_event["reason"] == "preemption" and exit_event["step"] == 0
    assert "before this group's first step" in exit_event["detail"]

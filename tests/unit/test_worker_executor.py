"""worker_loop._Executor applies the policy's decisions: the ledger folds every rank's feeds into each save,
a flag raised on the last step finishes (final save, no PlannedExit), a notice mid-run saves with the
notice's deadline and leaves. No Ray: the collectives, checkpointer and sink are stand-ins."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from spotfill.config import constants
from spotfill.config.job import JobConfig, from_mapping
from spotfill.train import worker_loop
from spotfill.train.sample_ledger import SampleLedger, runs
from spotfill.train.worker_loop import PlannedExit, _Executor
from tests.unit.worker_standins import Checkpointer

G, STEPS, EVERY = 8, 10, 5


class Comms:
    """Rank 1 of 2: the peer (rank 0) reports `peer_flags[done]` and fed `peer_feeds` since the last save."""

    torch = torch

    def __init__(self):
        self.peer_flags: dict[int, list[float]] = {}
        self.peer_feeds = np.zeros((0, 3), dtype=np.int64)
        self.done = 0

    def gather_flags(self, flags) -> list[list[float]]:
        return [self.peer_flags.get(self.done, [0.5, 0.0, 0.0, 0.0]), flags.tolist()]

    def gather_objects(self, obj) -> list:
        peer, self.peer_feeds = self.peer_feeds, np.zeros((0, 3), dtype=np.int64)
        return [peer, obj]


def _run(comms: Comms, ckpt: Checkpointer) -> int:
    """Steps 0..STEPS-1 as rank 1 (positions 4..7 of each step); returns the last step done."""
    job = from_mapping(JobConfig, {"name": "x", "run_dir": "/tmp/x", "storage": "/tmp/x", "data": {"path": "/tmp/x"},
                                   "training": {"steps": STEPS, "global_batch": G, "checkpoint_every": EVERY,
                                                "workers": [2, 2]}})
    engine = type("E", (), {"device": torch.device("cpu")})()
    ex = _Executor(job, sink=None, comms=comms, engine=engine, rank=1, world=2, attempt=0,
                   ledger=SampleLedger(), ckpt=ckpt)
    for step in range(STEPS):
        ex.recorder.record(np.arange(step * G + 4, step * G + 8))
        comms.peer_feeds = np.concatenate([comms.peer_feeds, runs(np.arange(step * G, step * G + 4))])
        comms.done = step + 1
        facts, loss = ex.gather(step + 1, torch.tensor(0.25, dtype=torch.float64))
        assert loss == pytest.approx(0.75)
        decision = ex.policy.decide(facts)
        ex.apply(decision, step + 1)
        if decision.action == "finish":
            return step + 1
    raise AssertionError("no finish")


@pytest.fixture(autouse=True)
def no_notice_here(monkeypatch):
    monkeypatch.setattr(worker_loop, "local_preemption_info", lambda: None)


def test_each_save_carries_both_ranks_feeds_in_its_ledger():
    ckpt = Checkpointer()
    assert _run(Comms(), ckpt) == STEPS
    assert [(s["step"], s["kind"]) for s in ckpt.saves] == [(5, "periodic"), (10, "final")]
    assert ckpt.saves[0]["ledger"].segments.tolist() == [[0, 40, 1]]
    assert ckpt.saves[1]["ledger"].segments.tolist() == [[0, 80, 1]]


@pytest.mark.parametrize("peer_flags", [[0.5, 1.0, 2e9, 0.0], [0.5, 0.0, 0.0, 2.0]], ids=["notice", "grow"])
def test_a_flag_raised_by_another_rank_on_the_last_step_finishes(peer_flags):
    comms, ckpt = Comms(), Checkpointer()
    comms.peer_flags[STEPS] = peer_flags
    assert _run(comms, ckpt) == STEPS                       # no PlannedExit: the job ends here
    assert ckpt.saves[-1]["kind"] == "final" and ckpt.saves[-1]["ledger"].summary(STEPS * G).missing == 0


def test_a_notice_mid_run_saves_within_its_deadline_and_leaves():
    comms, ckpt = Comms(), Checkpointer()
    deadline = 4e9                                          # far ahead of the real clock: time to save
    comms.peer_flags[7] = [0.5, 1.0, deadline, 0.0]
    with pytest.raises(PlannedExit, match="preemption at step 7"):
        _run(comms, ckpt)
    last = ckpt.saves[-1]
    # the checkpointer gets the notice's own deadline and keeps its margin once (it used to get the notice
    # minus the policy's 1 s and keep its 5 s on top: a save with 5.4 s left was abandoned as "no time")
    assert (last["step"], last["kind"]) == (7, "emergency") and last["deadline"] == pytest.approx(deadline, abs=0.01)
    assert last["ledger"].segments.tolist() == [[0, 56, 1]]


@pytest.mark.parametrize("left_s,saves", [(constants.EMERGENCY_MARGIN_S + 0.5, True),
                                          (constants.EMERGENCY_MARGIN_S - 1.0, False)])
def test_the_policy_and_the_checkpointer_keep_one_margin_before_the_deadline(left_s, saves):
    """A notice with more than the margin left saves (budget = left - margin, the checkpointer's own rule);
    with less, the group leaves without a save, as the checkpointer would abandon it."""
    comms, ckpt = Comms(), Checkpointer()
    comms.peer_flags[7] = [0.5, 1.0, time.time() + left_s, 0.0]
    with pytest.raises(PlannedExit) as exc:
        _run(comms, ckpt)
    emergency = [s for s in ckpt.saves if s["kind"] == "emergency"]
    assert bool(emergency) == saves, exc.value
    if saves:
        assert emergency[0]["deadline"] - time.time() > constants.EMERGENCY_MARGIN_S


def test_each_node_has_its_own_local_root_even_when_node_ids_share_a_long_prefix():
    """Ray's fake multi-node provider (the autoscaled demo) numbers its nodes in the last hex digits of one
    fixed prefix: a root named by the first 12 digits was one folder for every node, and a node's restore
    leader cleared it while another node's leader downloaded there ("downloaded with None bytes": an intact
    checkpoint quarantined, training failed)."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

    from spotfill.train.worker_loop import node_local_root

    ids = [FAKE_HEAD_NODE_ID[:-5] + str(i).zfill(5) for i in range(3)]
    roots = [node_local_root("job", i) for i in ids]
    assert len(set(roots)) == 3, roots
    assert node_local_root("job", ids[1]) == roots[1]          # the same node finds its folder again


def test_a_world_of_one_rank_exchanges_nothing():
    # no process group is initialised here: any torch.distributed collective would raise
    import torch.distributed as dist
    assert not dist.is_initialized()
    comms = worker_loop._Comms(1)
    flags = torch.tensor([2.5, 1.0, 1700000000.0, 3.0], dtype=torch.float64)
    assert comms.gather_flags(flags) == [[2.5, 1.0, 1700000000.0, 3.0]]
    feeds = np.arange(6).reshape(2, 3)
    assert comms.gather_objects(feeds)[0] is feeds and len(comms.gather_objects(feeds)) == 1
    assert comms.bcast({"attempt": 4}) == {"attempt": 4}
    comms.barrier()
    with pytest.raises((RuntimeError, ValueError)):
        worker_loop._Comms(2).gather_flags(flags)     # two ranks do need the process group

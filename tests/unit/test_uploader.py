"""AsyncUploader (coalescing, safe cancellation, submit never blocks) and the Checkpointer's save decisions,
on a local directory store with injected faults (blocked or failing uploads). No Ray, no torch."""
from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from spotfill.config import constants
from spotfill.storage.base import LocalStorage
from spotfill.storage.checkpoint_store import CheckpointStore
from spotfill.storage.checkpoint_store import tag_for as _tag_for
from spotfill.storage.uploader import AsyncUploader, Cancelled
from spotfill.train.checkpointing import Checkpointer, plan_emergency


# -- fault-injecting storage and a stand-in engine -------------------------------------------------------

def tag_for(step: int) -> str:
    """The tag a Checkpointer of attempt "0" (every Checkpointer here) gives `step`."""
    return _tag_for(step, "0")

class GatedStorage(LocalStorage):
    """A local directory whose uploads under a tag can be held (until released) or made to fail, and
    whose listing (commit's last step before the manifest) can be held too."""

    def __init__(self, root):
        super().__init__(root)
        self.hold: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.hold_list: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def _gate(self, gates: dict, key: str) -> None:
        for tag, gate in list(gates.items()):
            if tag in key:
                self.entered.setdefault(tag, threading.Event()).set()
                assert gate.wait(30), f"gate {tag} never released"

    def upload_dir(self, local_dir, key_prefix):
        self._gate(self.hold, key_prefix)
        if any(tag in key_prefix for tag in self.fail):
            raise OSError(f"injected upload failure at {key_prefix}")
        return super().upload_dir(local_dir, key_prefix)

    def list(self, prefix=""):
        self._gate(self.hold_list, prefix)
        return super().list(prefix)


class FakeEngine:
    """What Checkpointer needs of a DeepSpeed engine: save_checkpoint writing this rank's files."""

    device = "cpu"
    module = SimpleNamespace(parameters=lambda: [])

    def __init__(self, rank: int = 0):
        self.rank = rank

    def save_checkpoint(self, root, tag, client_state, save_latest):
        d = os.path.join(root, tag)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"optim_rank{self.rank}.pt"), "wb") as f:
            f.write(repr((tag, self.rank, client_state)).encode() * 100)


class ThreadAllMax:
    """An element-wise MAX all-reduce between threads standing in for ranks."""

    def __init__(self, n: int):
        self.barrier, self.values = threading.Barrier(n, timeout=30), [None] * n

    def rank(self, r: int):
        def all_max(values):
            self.values[r] = values
            self.barrier.wait()
            out = [max(col) for col in zip(*self.values)]
            self.barrier.wait()
            return out
        return all_max


@pytest.fixture
def snaps(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "SNAPSHOT_DIR", str(tmp_path / "snaps"))
    return tmp_path


def manifest_exists(store, step) -> bool:
    return store.storage.exists(f"{store.prefix}/{tag_for(step)}/manifest.json")


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


# -- AsyncUploader ----------------------------------------------------------------------------------------
def test_blocked_upload_never_blocks_submit_and_one_runs_at_a_time():
    up, gate, ran = AsyncUploader(), threading.Event(), []
    running, peak, lock = [0], [0], threading.Lock()

    def job(j, name, nbytes):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        if name == "a":
            assert gate.wait(10)
        ran.append(name)
        with lock:
            running[0] -= 1
        return nbytes

    t0 = time.monotonic()
    a, _ = up.submit("a", job, "a", 100)
    b, replaced = up.submit("b", job, "b", {"bytes": 50})        # "a" is blocked: b waits, submit does not
    assert time.monotonic() - t0 < 0.2 and replaced is None
    assert (a.state, b.state) == ("running", "pending") and up.busy
    gate.set()
    assert up.wait(5) and b.wait(5)
    st = up.stats()
    assert ran == ["a", "b"] and peak[0] == 1 and st["bytes_total"] == 150 and st["failed"] == 0
    up.close()
    with pytest.raises(RuntimeError, match="closed"):
        up.submit("c", job, "c", 1)


def test_coalescing_replaces_the_pending_job_and_reports_it_superseded():
    up, gate, ran = AsyncUploader(), threading.Event(), []

    def job(j, name):
        if name == "a":
            assert gate.wait(10)
        ran.append(name)

    up.submit("a", job, "a")
    b, _ = up.submit("b", job, "b")
    c, replaced = up.submit("c", job, "c")
    assert replaced is b and b.state == "superseded" and "superseded by c while a" in b.reason
    assert up.pending is c
    gate.set()
    assert up.wait(5)
    assert ran == ["a", "c"] and up.stats()["superseded"] == 1      # b never ran
    up.close()


def test_a_failed_job_keeps_its_error_and_the_next_one_runs():
    up = AsyncUploader()

    def boom(j):
        raise OSError("upload exploded")

    bad, _ = up.submit("bad", boom)
    assert bad.wait(5) and bad.state == "failed" and isinstance(bad.error, OSError)
    good, _ = up.submit("good", lambda j: 7)
    assert good.wait(5) and good.state == "done" and good.result == 7
    assert up.stats()["failed"] == 1
    up.close()


def _commit_job(store, tmp_path, step, world_size=1):
    tag = tag_for(step)

    def job(j):
        d = tmp_path / f"part-{step}"
        d.mkdir(exist_ok=True)
        (d / "w.pt").write_bytes(b"x" * 1000)
        store.upload_part(tag, 0, world_size, str(d))
        j.check()
        return store.commit(tag, step, world_size, timeout_s=30, guard=j)
    return job


def test_cancel_while_commit_waits_for_ranks_stops_it_and_it_never_commits(tmp_path):
    store = CheckpointStore(LocalStorage(str(tmp_path / "store")))
    up = AsyncUploader()
    job, _ = up.submit(tag_for(10), _commit_job(store, tmp_path, 10, world_size=2))
    wait_until(lambda: store.storage.exists(f"checkpoints/{tag_for(10)}/rank-0.done.json"))
    time.sleep(0.2)                                   # commit now polls for rank 1's marker
    t0 = time.monotonic()
    assert up.cancel(job, "emergency") and job.wait(5)
    assert time.monotonic() - t0 < 3.0                # the commit gave up at its next poll, not at 30 s
    assert job.state == "cancelled" and not up.busy
    # rank 1's part arrives late: still no manifest (nobody may commit a cancelled tag)
    d = tmp_path / "part-10-r1"
    d.mkdir()
    (d / "w.pt").write_bytes(b"y")
    store.upload_part(tag_for(10), 1, 2, str(d))
    time.sleep(0.3)
    assert not manifest_exists(store, 10) and store.committed() == []


def test_cancel_in_the_last_moment_before_the_manifest_wins(tmp_path):
    """The race cancellation must win: all parts stored, commit about to write the manifest."""
    storage = GatedStorage(tmp_path / "store")
    store = CheckpointStore(storage)
    storage.hold_list[tag_for(20)] = gate = threading.Event()   # commit's listing, right before its claim
    up = AsyncUploader()
    job, _ = up.submit(tag_for(20), _commit_job(store, tmp_path, 20))
    assert storage.entered.setdefault(tag_for(20), threading.Event()).wait(5)
    assert up.cancel(job, "superseded")               # True: guaranteed never to commit
    gate.set()
    assert job.wait(5) and job.state == "cancelled"
    assert not manifest_exists(store, 20) and store.latest() is None


def test_claim_and_cancel_exclude_each_other():
    up, claimed, gate = AsyncUploader(), threading.Event(), threading.Event()

    def job(j):
        j.claim()
        claimed.set()
        assert gate.wait(5)
        return 1

    j, _ = up.submit("t", job)
    assert claimed.wait(5)
    assert not up.cancel(j, "too late") and j.state == "committing"    # it may commit: the caller is told
    gate.set()
    assert j.wait(5) and j.state == "done"
    k, _ = up.submit("k", lambda jj: time.sleep(0.3))
    assert up.cancel(k, "gone")
    with pytest.raises(Cancelled, match="gone"):
        k.claim()
    up.close()


# -- Checkpointer: periodic coalescing, multi-rank consistency, emergency ---------------------------------
def test_periodic_saves_during_a_blocked_upload_coalesce_and_the_newest_commits(snaps):
    storage = GatedStorage(snaps / "store")
    store = CheckpointStore(storage, keep_last=0)
    ckpt = Checkpointer(store, str(snaps / "local"), 0, 1, attempt="0")
    storage.hold[tag_for(10)] = gate = threading.Event()
    eng = FakeEngine()
    results = [ckpt.save(eng, s, {}, kind="periodic") for s in (10, 20, 30, 40)]
    assert [r["path"] for r in results] == ["started", "pending", "pending", "pending"]
    # saves while step 10's upload hangs return at once (the first one paid a one-time import)
    assert max(r["stall_s"] for r in results[1:]) < 0.5 and not any(r["committed"] for r in results)
    skipped = ckpt.pop_skipped()
    assert [s["step"] for s in skipped] == [20, 30] and all("superseded by step" in s["reason"] for s in skipped)
    # local snapshots are bounded: the running one and one pending, the skipped ones deleted
    root = ckpt._roots[2]
    assert root.startswith(str(snaps / "snaps")) and sorted(os.listdir(root)) == [tag_for(10), tag_for(40)]
    gate.set()
    assert ckpt.uploader.wait(10)
    # after the uploads only the newest uploaded snapshot stays on the node (a restore here reads it)
    assert os.listdir(root) == [tag_for(40)]
    committed = ckpt.pop_committed()
    assert [c["step"] for c in committed] == [10, 40]
    # a commit record never carries `kind`: the worker loop logs it as a "checkpoint" event
    assert all("kind" not in c and c["save_kind"] == "periodic" for c in committed)
    assert not manifest_exists(store, 20) and not manifest_exists(store, 30)
    assert store.latest()["step"] == 40
    ckpt.close(wait=False, keep_snapshot=True)          # the attempt ends, training goes on: kept
    assert os.listdir(root) == [tag_for(40)]
    ckpt.close()                                        # training finished: nothing stays
    assert not os.path.exists(root)


def _two_ranks(snaps, storage):
    store = CheckpointStore(storage, keep_last=0)
    reducer = ThreadAllMax(2)
    return store, [Checkpointer(store, str(snaps / f"local{r}"), r, 2, attempt="0", all_max=reducer.rank(r))
                   for r in range(2)]


def _save_all(ckpts, step, **kw):
    out = [None, None]

    def run(r):
        out[r] = ckpts[r].save(FakeEngine(r), step, {}, **kw)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_rank_whose_upload_failed_does_not_hang_rank_0s_commit(snaps):
    """Rank 1's part of step 10 fails; rank 0 waits in commit(10) for it. The next periodic save shares
    the failure, so rank 0 gives step 10 up at once and step 20 commits (not after the 600 s timeout)."""
    storage = GatedStorage(snaps / "store")
    storage.fail.add(f"{tag_for(10)}/rank-1")
    store, ckpts = _two_ranks(snaps, storage)
    _save_all(ckpts, 10, kind="periodic")
    wait_until(lambda: ckpts[1].uploader.active is None)            # rank 1's upload failed
    assert ckpts[0].uploader.active is not None                        # rank 0 still waits for its part
    _save_all(ckpts, 20, kind="periodic")
    for c in ckpts:
        assert c.uploader.wait(10)
    assert [c["step"] for c in ckpts[0].pop_committed()] == [20]
    assert [s["step"] for s in ckpts[0].pop_skipped()] == [10]
    assert not manifest_exists(store, 10) and store.latest()["step"] == 20
    for c in ckpts:
        c.close()


def test_ranks_drop_the_same_tags_when_one_had_not_started_it(snaps):
    """Rank 0 is slow (step 10 held); rank 1 finishes 10 and starts 20, rank 0 still holds 20 pending.
    At step 30 both drop 20 (rank 1 cancels its running upload), and 30 commits when rank 0 catches up."""
    storage = GatedStorage(snaps / "store")
    storage.hold[f"{tag_for(10)}/rank-0"] = gate10 = threading.Event()
    storage.hold[f"{tag_for(20)}/rank-1"] = threading.Event()          # never released: it must be dropped
    store, ckpts = _two_ranks(snaps, storage)
    _save_all(ckpts, 10, kind="periodic")
    wait_until(lambda: ckpts[1].uploader.active is None)
    paths = [r["path"] for r in _save_all(ckpts, 20, kind="periodic")]
    assert paths == ["pending", "started"]
    _save_all(ckpts, 30, kind="periodic")
    skipped = [c.pop_skipped() for c in ckpts]
    assert [s["step"] for s in skipped[0]] == [20] and "its upload had not started" in skipped[0][0]["reason"]
    assert [s["step"] for s in skipped[1]] == [20] and "another rank" in skipped[1][0]["reason"]
    gate10.set()
    for c in ckpts:
        assert c.uploader.wait(10)
    assert [c["step"] for c in ckpts[0].pop_committed()] == [10, 30]
    assert not manifest_exists(store, 20)
    for c in ckpts:
        c.close()


def test_final_save_replaces_outstanding_uploads_and_returns_committed(snaps):
    storage = GatedStorage(snaps / "store")
    store = CheckpointStore(storage, keep_last=0)
    ckpt = Checkpointer(store, str(snaps / "local"), 0, 1, attempt="0")
    storage.hold[tag_for(10)] = gate = threading.Event()
    eng = FakeEngine()
    ckpt.save(eng, 10, {}, kind="periodic")
    ckpt.save(eng, 20, {}, kind="periodic")
    res = ckpt.save(eng, 25, {}, kind="final")
    assert res["committed"] and res["path"] == "sync" and manifest_exists(store, 25)
    assert sorted(s["step"] for s in ckpt.pop_skipped()) == [10, 20]
    gate.set()
    time.sleep(0.3)
    assert not manifest_exists(store, 10) and store.latest()["step"] == 25
    ckpt.close()


def test_emergency_cancels_a_blocked_periodic_upload_and_commits_in_budget(snaps, monkeypatch):
    monkeypatch.setattr(constants, "EMERGENCY_MARGIN_S", 0.5)
    storage = GatedStorage(snaps / "store")
    store = CheckpointStore(storage, keep_last=0)
    ckpt = Checkpointer(store, str(snaps / "local"), 0, 1, attempt="0")
    eng = FakeEngine()
    ckpt.save(eng, 10, {}, kind="periodic")
    assert ckpt.uploader.wait(5)                                # a measured upload: the estimate
    storage.hold[tag_for(20)] = gate = threading.Event()        # a periodic upload that hangs
    ckpt.save(eng, 20, {}, kind="periodic")
    deadline = time.time() + 3.0
    res = ckpt.save(eng, 23, {}, kind="emergency", deadline_unix_s=deadline)
    assert res["committed"] and res["path"] == "fresh" and time.time() < deadline - 0.5
    assert "periodic upload of step 20 is cancelled" in res["reason"] and res["budget_s"] <= 3.0
    assert [s["step"] for s in ckpt.pop_skipped()] == [20]
    gate.set()                                                  # the storage comes back for step 20 ...
    time.sleep(0.5)
    assert not manifest_exists(store, 20) and store.latest()["step"] == 23     # ... it never commits
    ckpt.close()


def test_emergency_that_cannot_commit_in_time_is_abandoned_uncommitted(snaps, monkeypatch):
    monkeypatch.setattr(constants, "EMERGENCY_MARGIN_S", 0.5)
    storage = GatedStorage(snaps / "store")
    store = CheckpointStore(storage, keep_last=0)
    ckpt = Checkpointer(store, str(snaps / "local"), 0, 1, attempt="0")
    storage.hold[tag_for(7)] = gate = threading.Event()
    t0 = time.time()
    res = ckpt.save(FakeEngine(), 7, {}, kind="emergency", deadline_unix_s=t0 + 1.5)
    assert not res["committed"] and "abandoned uncommitted" in res["reason"]
    assert time.time() < t0 + 1.5                               # it returned before the deadline
    gate.set()
    time.sleep(0.5)
    assert not manifest_exists(store, 7) and [s["step"] for s in ckpt.pop_skipped()] == [7]
    res = ckpt.save(FakeEngine(), 8, {}, kind="emergency", deadline_unix_s=time.time() + 0.2)
    assert res["path"] == "abandon" and not res["committed"] and "no time" in res["reason"]
    ckpt.close()


# -- plan_emergency (pure) --------------------------------------------------------------------------------
@pytest.mark.parametrize("fresh_s, inflight, left, path", [
    (4.0, None, 0.0, "fresh"),        # 10 s to the deadline, 2 s margin: 8 s budget, a new one fits
    (4.0, 40, 1.0, "fresh"),          # fits: the running periodic upload is cancelled
    (9.0, 40, 3.0, "inflight"),       # a new one does not fit, the running one does
    (9.0, 40, 9.5, "fresh"),          # neither fits, the new one is closer: best effort with it
    (9.0, 40, 8.5, "inflight"),       # neither fits, the running one is closer: best effort with it
    (9.0, None, 0.0, "fresh"),        # best effort: its snapshot (1 s) fits
    (30.0, None, 0.0, "abandon"),     # not even the snapshot (9 s) fits
])
def test_plan_emergency_paths(fresh_s, inflight, left, path):
    plan = plan_emergency(now=100.0, deadline=110.0, margin_s=2.0, fresh_s=fresh_s, inflight_step=inflight,
                          inflight_left_s=left, snapshot_s=1.0 if fresh_s < 30 else 9.0)
    assert plan.path == path and plan.budget_s == 8.0
    assert ("best effort" in plan.reason) == (fresh_s > 8.0 and (left > 8.0 or inflight is None)
                                              and path != "abandon")


def test_plan_emergency_without_time_abandons():
    plan = plan_emergency(now=100.0, deadline=101.5, margin_s=2.0, fresh_s=0.0, inflight_step=None,
                          inflight_left_s=0.0)
    assert plan.path == "abandon" and plan.budget_s == -0.5

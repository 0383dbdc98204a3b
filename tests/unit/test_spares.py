"""Warm spare processes: tokens say which starting process is a spare, and a spare's warm-up runs in
SCHED_IDLE -- with every thread back in normal scheduling afterwards (a training worker left in SCHED_IDLE
would step only on CPU time nothing else wants)."""
from __future__ import annotations

import os
import threading

import pytest

from spotfill.train.spares import TOKEN_TTL_S, claim, idle_while, offer


def test_each_token_makes_one_spare_on_its_own_node(tmp_path):
    d = str(tmp_path)
    offer("nodeA", 2, now=100.0, directory=d)
    offer("nodeB", 1, now=100.0, directory=d)
    assert not claim("nodeC", now=101.0, directory=d)
    assert [claim("nodeA", now=101.0, directory=d) for _ in range(3)] == [True, True, False]
    assert claim("nodeB", now=101.0, directory=d) and not claim("nodeB", now=101.0, directory=d)
    assert os.listdir(d) == []


def test_a_stale_token_makes_no_spare_and_is_removed(tmp_path):
    d = str(tmp_path)
    offer("nodeA", 1, now=100.0, directory=d)
    offer("nodeB", 1, now=100.0, directory=d)
    assert not claim("nodeA", now=100.0 + TOKEN_TTL_S + 1, directory=d)
    assert os.listdir(d) == []          # nodeB's stale token went too


def test_concurrent_claims_take_each_token_once(tmp_path):
    d = str(tmp_path)
    offer("nodeA", 3, directory=d)
    got: list[bool] = []
    threads = [threading.Thread(target=lambda: got.append(claim("nodeA", directory=d))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [False] * 5 + [True] * 3


def _policy() -> int:
    return os.sched_getscheduler(0)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_warm_up_in_sched_idle_then_every_thread_back_to_normal():
    seen: dict[str, int] = {}
    release = threading.Event()

    def started_inside():
        seen["child"] = _policy()
        release.wait(10)
        seen["child_after"] = _policy()

    with idle_while(True) as used:
        if not used:
            pytest.skip("this process may not leave SCHED_IDLE again (no RLIMIT_NICE): warm-up stays normal")
        seen["inside"] = _policy()
        child = threading.Thread(target=started_inside)
        child.start()
        while "child" not in seen:
            pass
    seen["after"] = _policy()
    release.set()
    child.join()
    assert seen["inside"] == os.SCHED_IDLE and seen["child"] == os.SCHED_IDLE     # inherited by its threads
    assert seen["after"] == os.SCHED_OTHER and seen["child_after"] == os.SCHED_OTHER


def test_no_spare_no_change():
    with idle_while(False) as used:
        assert not used and _policy() == os.SCHED_OTHER


GIB, MIB = 2**30, 2**20


def test_spares_count_against_the_nodes_memory_with_those_already_there():
    from spotfill.train.spares import spares_within_memory
    # 0.25 of 8 GiB = 2 GiB: four spares of 512 MiB
    assert spares_within_memory(2, 8 * GIB, 0, 512 * MIB, 0.25) == (2, "")
    assert spares_within_memory(4, 8 * GIB, 0, 512 * MIB, 0.25) == (4, "")
    n, why = spares_within_memory(4, 8 * GIB, 3, 512 * MIB, 0.25)     # three already warming or ready there
    assert n == 1 and "1 of 4 spare(s)" in why and "3 already held" in why
    assert "SPOTFILL_WARM_SPARE_MEMORY_FRACTION" in why and "SPOTFILL_WARM_SPARE_RSS_MB" in why
    assert spares_within_memory(2, 8 * GIB, 5, 512 * MIB, 0.25)[0] == 0     # over the budget already: none
    assert spares_within_memory(1, 1 * GIB, 0, 512 * MIB, 0.25)[0] == 0     # a small node: not even one
    assert spares_within_memory(3, 8 * GIB, 0, 512 * MIB, 0.0)[0] == 0      # fraction 0: spares off
    assert spares_within_memory(0, 8 * GIB, 0, 512 * MIB, 0.25) == (0, "")


def test_a_node_whose_memory_is_unknown_keeps_its_spares():
    from spotfill.train.spares import spares_within_memory
    assert spares_within_memory(2, 0, 9, 512 * MIB, 0.25) == (2, "")


def test_prestarting_spares_asks_the_raylet_for_no_more_than_the_memory_allows(monkeypatch):
    """The worker loop's ask (train.spare_workers.prestart_spares) goes through the cap: a node with 3 spares
    already and room for 4 gets 1 more, however many its workers ask for."""
    import sys
    import threading
    import types

    from spotfill.config import constants
    from spotfill.train import elastic, spare_workers, spares
    asked: dict = {}
    monkeypatch.setattr(constants, "WARM_SPARE_RSS_MB", 512)
    monkeypatch.setattr(constants, "WARM_SPARE_MEMORY_FRACTION", 0.25)
    monkeypatch.setattr(spares, "host_memory_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(spares, "offer", lambda node, n: asked.update(offered=n))
    monkeypatch.setattr(elastic, "ready_spares", lambda warming=False: {"node-a": 3})
    # patched where it lives: set on the package (whose attributes load lazily) monkeypatch's undo would leave
    # the real one cached there, and later tests patching ray_train would not reach it
    from spotfill.ray_compat import ray_train
    monkeypatch.setattr(ray_train, "prestart_workers", lambda n, keep_alive_s, **_: asked.update(started=n))
    ctx = types.SimpleNamespace(get_node_id=lambda: "node-a")
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get_runtime_context=lambda: ctx))
    threads = []
    monkeypatch.setattr(threading, "Thread", lambda target, **_: threads.append(target) or
                        types.SimpleNamespace(start=lambda: None))
    spare_workers.prestart_spares(5)        # the node should hold 5: 3 are there, room for 1 more
    threads[0]()
    assert asked == {"offered": 1, "started": 1}
    asked.clear()
    spare_workers.prestart_spares(3)        # 3 wanted, 3 there (a grow's reserve): none asked
    threads[1]()
    assert asked == {}
    spare_workers.prestart_spares(0)        # not the node's first rank: no ask at all
    assert len(threads) == 2


# -- a spare warming in SCHED_IDLE is woken the moment its node's training worker is gone ----------------------
def test_the_nodes_training_workers_are_found_by_title_and_job(tmp_path):
    from spotfill.train.spares import group_worker_pids

    def proc(pid, cmdline, env):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(cmdline.encode() + b"\0")
        (d / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")
    proc(11, "ray::RayTrainWorker", ["A=1", "RAY_JOB_ID=01000000"])
    proc(12, "ray::RayTrainWorker.run_train_fn", ["RAY_JOB_ID=01000000"])
    proc(13, "ray::RayTrainWorker", ["RAY_JOB_ID=02000000"])          # another run's
    proc(14, "ray::IDLE", ["RAY_JOB_ID=01000000"])                    # a spare, not a worker
    (tmp_path / "self").mkdir()
    assert group_worker_pids("01000000", "ray::RayTrainWorker", proc=str(tmp_path)) == [11, 12]
    assert group_worker_pids(None, "ray::RayTrainWorker", proc=str(tmp_path)) == []


# A spare stand-in: its main thread enters SCHED_IDLE and then holds the GIL in one long C call (as a C
# extension's load does while torch imports): no thread of its own could get the GIL to wake it.
_SPARE = """
import os, sys
if sys.argv[1] == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
else:
    os.setpriority(os.PRIO_PROCESS, 0, 19)
print("idle", flush=True)
sum(range(10 ** 12))
"""
NICE = os.getpriority(os.PRIO_PROCESS, 0)


def _held(pid: int, mode: str) -> bool:
    if mode == "idle":
        return os.sched_getscheduler(pid) == os.SCHED_IDLE
    return os.getpriority(os.PRIO_PROCESS, pid) == 19


def _spare_and_worker(mode: str = "idle"):
    import subprocess
    import sys
    spare = subprocess.Popen([sys.executable, "-c", _SPARE, mode], stdout=subprocess.PIPE)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert spare.stdout.readline().strip() == b"idle"
    return spare, worker


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
@pytest.mark.parametrize("mode", ["idle", "low"])
def test_a_spare_holding_the_gil_held_back_is_woken_when_its_nodes_worker_is_gone(mode):
    import time

    from spotfill.train.spares import end_wake_watcher, start_wake_watcher
    if mode == "low" and NICE >= 19:
        pytest.skip("this process already runs at nice 19")
    spare, worker = _spare_and_worker(mode)
    try:
        watcher = start_wake_watcher([worker.pid], 0.05, spare_pid=spare.pid, nice=NICE if mode == "low" else None)
        time.sleep(0.5)
        assert _held(spare.pid, mode)                                   # the group still runs: held back
        gone_at = time.time()
        worker.kill()
        worker.wait()
        deadline = time.time() + 20
        while _held(spare.pid, mode) and time.time() < deadline:
            time.sleep(0.05)
        if mode == "idle":
            assert os.sched_getscheduler(spare.pid) == os.SCHED_OTHER, "the spare was left in SCHED_IDLE"
        else:
            assert os.getpriority(os.PRIO_PROCESS, spare.pid) == NICE, "the spare was left at nice 19"
        woke = end_wake_watcher(watcher)
        assert woke is not None and woke[0] >= gone_at and woke[1] >= 1 and woke[2] == "restart"
    finally:
        spare.kill()
        worker.kill()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_while_the_group_runs_the_spare_stays_idle_and_the_watcher_ends_with_its_warm_up():
    import time

    from spotfill.train.spares import end_wake_watcher, start_wake_watcher
    spare, worker = _spare_and_worker()
    try:
        watcher = start_wake_watcher([worker.pid], 0.05, spare_pid=spare.pid)
        time.sleep(0.5)
        assert os.sched_getscheduler(spare.pid) == os.SCHED_IDLE
        assert end_wake_watcher(watcher) is None and watcher.poll() is not None    # stopped, nothing woken
        assert start_wake_watcher([], 0.05) is None                   # no training worker: nothing to watch
    finally:
        spare.kill()
        worker.kill()


def test_a_spare_warms_up_at_nice_19_and_every_thread_gets_its_nice_back():
    import threading as th

    from spotfill.train.spares import low_while
    seen: dict[str, int] = {}
    nice = os.getpriority(os.PRIO_PROCESS, th.get_native_id())

    def inside():
        seen["child"] = os.getpriority(os.PRIO_PROCESS, th.get_native_id())

    def run():
        with low_while(True) as held:
            if held is None:
                return
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, th.get_native_id())
            c = th.Thread(target=inside)
            c.start()
            c.join()
            seen["held"] = held
        seen["after"] = os.getpriority(os.PRIO_PROCESS, th.get_native_id())
    t = th.Thread(target=run)
    t.start()
    t.join()
    if "inside" not in seen:
        pytest.skip("this process may not raise its priority back (no RLIMIT_NICE)")
    assert seen["inside"] == 19 and seen["child"] == 19 and seen["held"] == nice and seen["after"] == nice


def test_the_first_worker_on_a_node_asks_spares_for_the_slots_its_group_does_not_use(monkeypatch):
    """A restart sizes the group to every slot of the nodes that are left: each needs a spare there."""
    from spotfill.config import constants
    from spotfill.train import spare_workers
    monkeypatch.setattr(spare_workers, "node_slots", lambda job, node: 3)
    w, nodes = constants.WARM_SPARES, ["a", "b", "b"]          # rank 0 on a; ranks 1 and 2 on b
    assert spare_workers.spares_to_ask(None, 0, "a", nodes) == 3 * w     # itself + 2 slots lent or free
    assert spare_workers.spares_to_ask(None, 1, "b", nodes) == 3 * w     # the node's first rank: its 3 slots
    assert spare_workers.spares_to_ask(None, 2, "b", nodes) == 0         # one ask per node
    monkeypatch.setattr(spare_workers, "node_slots", lambda job, node: 0)     # unknown: the workers' own only
    assert spare_workers.spares_to_ask(None, 0, "a", nodes) == w
    assert spare_workers.spares_to_ask(None, 1, "b", nodes) == 2 * w


def test_the_process_start_time_is_read_once_and_kept():
    """Read at the process's start and kept (telemetry.process): a later read would date it by a boot time
    that drifts against the wall clock."""
    import time

    from spotfill.telemetry.process import process_start_time
    first = process_start_time()
    time.sleep(0.05)
    assert first is not None and process_start_time() == first and first <= time.time()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
@pytest.mark.parametrize("mode", ["idle", "low"])
def test_a_held_back_spare_is_put_back_after_the_longest_hold_while_the_group_still_runs(mode):
    """SPOTFILL_SPARE_HOLD_MAX_S: held back without bound on a node whose CPUs the steps saturate, a demo's
    spares were still importing when the next grow came 33 s later. With the group still running (its worker
    alive), the watcher ends the hold after hold_max_s and says why; without a bound (0) it does not."""
    import time

    from spotfill.train.spares import end_wake_watcher, start_wake_watcher
    if mode == "low" and NICE >= 19:
        pytest.skip("this process already runs at nice 19")
    spare, worker = _spare_and_worker(mode)
    unbounded, _ = _spare_and_worker(mode)
    try:
        nice = NICE if mode == "low" else None
        started = time.time()
        watcher = start_wake_watcher([worker.pid], 0.05, spare_pid=spare.pid, nice=nice, hold_max_s=1.0)
        other = start_wake_watcher([worker.pid], 0.05, spare_pid=unbounded.pid, nice=nice)
        deadline = time.time() + 20
        while _held(spare.pid, mode) and time.time() < deadline:
            time.sleep(0.05)
        assert not _held(spare.pid, mode), "the hold-back outlived its bound"
        assert worker.poll() is None                                     # nothing restarted
        woke = end_wake_watcher(watcher)
        assert woke is not None and woke[0] - started >= 0.9 and woke[1] >= 1 and woke[2] == "hold_max"
        assert _held(unbounded.pid, mode)                                # no bound: still held back
        assert end_wake_watcher(other) is None
    finally:
        for p in (spare, worker, unbounded):
            p.kill()


def test_the_controllers_helpers_are_prestarted_once_per_group_and_a_failure_only_logs(monkeypatch, caplog):
    """Ray Train's SynchronizationActor and DatasetManager took a new process with every group (2.3-3.1 s of
    a warm grow's start): the callback has the controller's raylet start two idle processes for the next
    group -- after the group's start settled, or at its shutdown when it stops sooner, never both (idle
    processes would pile up over restarts); a refused ask costs the head start only."""
    import logging
    import threading
    import time

    from spotfill.ray_compat import ray_train
    from spotfill.train import spare_workers

    asked = []

    def prestart(n, keep_alive_s, **kw):
        asked.append((n, keep_alive_s, kw))
        return True
    monkeypatch.setattr(ray_train, "prestart_workers", prestart)

    def settle(count):
        deadline = time.time() + 10
        while len(asked) < count and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        return len(asked)

    cb = spare_workers.ControllerHelperSpares(after_s=0.1)
    cb.after_worker_group_start(None)
    assert settle(1) == 1 and asked[0] == (2, spare_workers.constants.WARM_SPARE_KEEP_ALIVE_S, {})
    cb.before_worker_group_shutdown(None)                   # already asked for this group: not again
    assert settle(1) == 1
    slow = spare_workers.ControllerHelperSpares(after_s=60.0)
    slow.after_worker_group_start(None)
    slow.before_worker_group_shutdown(None)                  # stopped before its ask: asks now, once
    assert settle(2) == 2
    slow.before_worker_group_shutdown(None)
    assert settle(2) == 2

    failed = threading.Event()

    def refuse(n, keep_alive_s, **kw):
        failed.set()
        raise RuntimeError("no PrestartWorkers RPC")
    monkeypatch.setattr(ray_train, "prestart_workers", refuse)
    with caplog.at_level(logging.WARNING, logger="spotfill.train.worker_loop"):
        spare_workers.prestart_controller_helpers(2)
        assert failed.wait(10)
        deadline = time.time() + 5
        while time.time() < deadline and not any("helper processes not prestarted" in r.message
                                                 for r in caplog.records):
            time.sleep(0.05)
    assert any("helper processes not prestarted" in r.message for r in caplog.records)

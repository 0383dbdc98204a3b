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
    """The worker loop's ask (train.worker_loop._prestart_spares) goes through the cap: a node with 3 spares
    already and room for 4 gets 1 more, however many its workers ask for."""
    import sys
    import threading
    import types

    from spotfill.config import constants
    from spotfill.train import elastic, spares, worker_loop
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
    worker_loop._prestart_spares(2)
    threads[0]()
    assert asked == {"offered": 1, "started": 1}


# -- a restart wakes spares still warming in SCHED_IDLE (train.warm.watch_wake, train.readiness.woken) -------
def test_the_wake_key_names_only_restarts_after_the_spares_start():
    from spotfill.train.readiness import wake_key, woken
    assert wake_key("01000000").endswith("01000000")
    assert woken(b"105.5", since=100.0) and woken("105.5", since=100.0)
    assert not woken(b"99.0", since=100.0)            # a restart before this spare started: not for it
    assert not woken(None, since=100.0) and not woken(b"garbage", since=100.0)


def _warming_spare(wake_value, since: float):
    """A 'spare' warming up in SCHED_IDLE on a thread (busy, as imports are), a watcher reading `wake_value`;
    returns (the policy its warm-up thread had once the watcher finished or gave up, the watcher's answer)."""
    from spotfill.train import warm
    done, stop, seen = threading.Event(), threading.Event(), {}

    def warm_up():
        with idle_while(True) as used:
            seen["used"] = used
            while not stop.is_set():
                sum(range(1000))                    # holds the GIL most of the time, as an import does
            seen["policy"] = _policy()

    t = threading.Thread(target=warm_up)
    t.start()
    woke = warm.watch_wake(done, since, read=lambda: wake_value, poll_s=0.05) if wake_value is not None \
        else _watch_briefly(done, since)
    stop.set()
    t.join()
    done.set()
    if not seen.get("used"):
        pytest.skip("this process may not leave SCHED_IDLE again (no RLIMIT_NICE)")
    return seen["policy"], woke


def _watch_briefly(done: threading.Event, since: float) -> bool:
    from spotfill.train import warm
    threading.Timer(0.5, done.set).start()        # the warm-up ends after 0.5 s with no restart
    return warm.watch_wake(done, since, read=lambda: b"1.0", poll_s=0.05)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_a_restart_puts_a_spare_still_warming_in_sched_idle_back_to_normal_scheduling():
    import time

    from spotfill.train import warm
    policy, woke = _warming_spare(repr(time.time() + 1), since=time.time())
    assert woke and policy == os.SCHED_OTHER, "the warm-up went on in SCHED_IDLE after the restart began"
    assert warm.marks["warm_woken_t"] > 0 and warm.marks["warm_woken_moved"] >= 1


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_without_a_restart_after_its_start_a_spare_stays_in_sched_idle_while_it_warms():
    import time
    policy, woke = _warming_spare(None, since=time.time())
    assert not woke and policy == os.SCHED_IDLE

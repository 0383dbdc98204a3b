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

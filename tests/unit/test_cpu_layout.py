"""sim.cpu_layout: cores of their own for the embedded cluster's head and nodes (the fill-in bench's layout)."""
import os
import subprocess
import sys

import pytest

from spotfill.sim.cpu_layout import describe, pin_process_tree, plan_layout, thread_affinities


def test_the_head_gets_the_last_core_and_each_node_one_core_per_gpu_slot():
    assert plan_layout([2, 1, 1], cores=list(range(16))) == {"head": [15], "nodes": [[0, 1], [2], [3]]}
    assert plan_layout([1], cores=[4, 7]) == {"head": [7], "nodes": [[4]]}
    # a node without slots still gets a core of its own
    assert plan_layout([0, 1], cores=[0, 1, 2]) == {"head": [2], "nodes": [[0], [1]]}


def test_too_few_cores_for_every_machine_means_no_layout():
    assert plan_layout([2, 1, 1], cores=[0, 1]) is None        # this 2-core machine: 5 needed
    assert plan_layout([2, 1, 1], cores=[0, 1, 2, 3]) is None
    assert "shared" in describe(None, 2) and "apart: head [15]" in describe(plan_layout([1], list(range(16))))


CHILD = ("import subprocess, sys, threading, time\n"
         "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
         "p = subprocess.Popen([sys.executable, '-c', 'import threading, time; "
         "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); print(1, flush=True); "
         "time.sleep(60)'], stdout=subprocess.PIPE)\n"
         "p.stdout.readline()\n"                      # its second thread runs
         "print(p.pid, flush=True)\n"
         "sys.stdin.readline()\n"
         "p.kill()\n")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin onto one of them")
def test_a_process_its_threads_and_its_children_are_all_pinned():
    core = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        before = thread_affinities(proc.pid)
        assert all(len(c) >= 2 for c in before.values())
        assert pin_process_tree([proc.pid], [core]) == 2
        for pid in (proc.pid, grandchild):
            threads = thread_affinities(pid)
            assert len(threads) >= 2, threads              # the main thread and the sleeping one
            assert all(c == {core} for c in threads.values()), (pid, threads)
        # a process that is gone is skipped, not an error
        assert pin_process_tree([2 ** 22 + 12345], [core]) == 0
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(10)


def test_training_apart_gives_the_training_worker_the_first_core_and_the_rest_the_others():
    from spotfill.sim.cpu_layout import as_dict, training_apart
    layout = training_apart(3, cores=[0, 1])
    assert layout == {"head": [1], "nodes": [[1], [1], [1]], "training": [0]}
    assert training_apart(3, cores=[5]) is None
    d = as_dict(layout, pinned=1)
    assert (d["kind"], d["training"], d["others"], d["training_workers_pinned"]) == ("training_apart", [0], [1], 1)
    assert "training worker on core(s) [0]" in d["detail"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_training_worker_process_is_moved_to_its_core_and_nothing_else_is():
    """A child whose process title is a Ray Train worker's goes to the training core (every thread); another
    child stays where it was."""
    from spotfill.sim.cpu_layout import TRAINING_WORKER, pin_training_workers
    core = min(os.sched_getaffinity(0))
    code = ("import sys, threading, time; "
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
            "print(1, flush=True); time.sleep(60)")
    worker = subprocess.Popen(["bash", "-c", f"exec -a '{TRAINING_WORKER}' {sys.executable} -c '{code}'"],
                              stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker.stdout.readline()
        other.stdout.readline()
        done: set[int] = set()
        assert pin_training_workers(os.getpid(), [core], done) == 1 and done == {worker.pid}
        assert {frozenset(c) for c in thread_affinities(worker.pid).values()} == {frozenset({core})}
        assert all(len(c) > 1 for c in thread_affinities(other.pid).values())
        assert pin_training_workers(os.getpid(), [core], done) == 0          # once is enough
    finally:
        worker.kill()
        other.kill()

"""Free-capacity counting, the one-grow-per-capacity-state gate and the raylet reachability probe that the
elastic policy (restart sizing) and rank 0's grow check use."""
from __future__ import annotations

import socket
import time

from spotfill.train.capacity import (GrowGate, NodeCapacity, capacity_state, count_workers, free_resources,
                                     reachable)

PER_WORKER = {"GPU_SLOT": 1, "CPU": 1}


def test_count_workers_per_node_and_capped():
    nodes = {"a": {"GPU": 2.0, "CPU": 8.0}, "b": {"GPU": 1.0, "CPU": 1.0}, "head": {"CPU": 4.0}}
    assert count_workers(nodes, {"GPU": 1, "CPU": 1}, max_workers=8) == 3
    assert count_workers(nodes, {"GPU": 1, "CPU": 2}, max_workers=8) == 2      # b lacks the CPUs
    assert count_workers(nodes, {"GPU": 1, "CPU": 1}, max_workers=2) == 2
    assert count_workers({}, {"GPU": 1}, max_workers=4) == 0


def test_a_slot_held_by_someone_else_is_not_free():
    # two nodes of 2 slots; another actor holds one slot on node b: 3 workers fit, not 4
    nodes = {"a": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 2, "CPU": 2}),
             "b": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 1, "CPU": 1})}
    assert count_workers(free_resources(nodes), PER_WORKER, 4) == 3


def test_restart_sizing_counts_the_runs_own_slots_as_free_but_not_more_than_the_node_has():
    # our 3-worker group holds a:2, b:1; another actor holds b's other slot. Ray Train sizes the next
    # group before it releases ours: 3 fit again, not 0 (available only) and not 4 (totals)
    nodes = {"a": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 0, "CPU": 0}),
             "b": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 0, "CPU": 0})}
    own = {"a": {"GPU_SLOT": 2, "CPU": 2}, "b": {"GPU_SLOT": 1, "CPU": 1}}
    assert count_workers(free_resources(nodes, own), PER_WORKER, 4) == 3
    assert count_workers(free_resources(nodes), PER_WORKER, 4) == 0
    # a stale view (available not yet lowered for our own group) never adds up past the node's total
    stale = {"a": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 2, "CPU": 2})}
    assert free_resources(stale, {"a": {"GPU_SLOT": 2, "CPU": 2}}) == {"a": {"GPU_SLOT": 2, "CPU": 2}}


def test_restart_after_a_node_loss_counts_gpus_lent_to_fill_in_as_available():
    # 4 workers ran on a (2) and b (2); node c's 2 slots were lent to Serve (its CPUs stay free: replicas
    # take none). Node a dies: the restart sees b (its own group's slots) and c -- 2 free without fill-in,
    # 4 (full size) when the lent slots count, since the claim hook takes them back before the group starts
    nodes = {"b": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 0, "CPU": 0}),
             "c": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 0, "CPU": 2})}
    own = {"b": {"GPU_SLOT": 2, "CPU": 2}}
    lent = {"c": {"GPU_SLOT": 2}}
    assert count_workers(free_resources(nodes, own), PER_WORKER, 4) == 2
    assert count_workers(free_resources(nodes, own, lent), PER_WORKER, 4) == 4
    # a lease on the dead node a (not schedulable) gives nothing back; a stale lease record never adds
    # more than the node has
    assert count_workers(free_resources(nodes, own, {**lent, "a": {"GPU_SLOT": 2}}), PER_WORKER, 8) == 4
    stale = {"c": NodeCapacity({"GPU_SLOT": 2, "CPU": 2}, {"GPU_SLOT": 1, "CPU": 2})}
    assert free_resources(stale, None, lent) == {"c": {"GPU_SLOT": 2, "CPU": 2}}


def test_capacity_state_ignores_order_and_leftover_fractions():
    one = {"a": {"GPU_SLOT": 1.0, "CPU": 3.5}, "b": {"GPU_SLOT": 0.0, "CPU": 1.0}}
    two = {"b": {"CPU": 1.9, "GPU_SLOT": 0.5}, "a": {"CPU": 3.0, "GPU_SLOT": 1.2}}
    assert capacity_state(one, PER_WORKER) == capacity_state(two, PER_WORKER)
    assert capacity_state(one, PER_WORKER) != capacity_state({**one, "b": {"GPU_SLOT": 1, "CPU": 1}}, PER_WORKER)


def test_one_grow_attempt_per_capacity_state():
    gate = GrowGate()
    s1 = capacity_state({"a": {"GPU_SLOT": 1, "CPU": 1}}, PER_WORKER)
    first = gate.decide(world=3, fitting=4, state=s1)
    assert first.extra == 1
    # the restart could not get the slot (someone took it): back at 3 workers, the same free capacity is
    # seen again -- no second attempt, however often the check runs
    for _ in range(5):
        assert gate.decide(world=3, fitting=4, state=s1).extra == 0
    assert "already tried" in gate.decide(3, 4, s1).reason
    # capacity changed (a node came): one new attempt
    s2 = capacity_state({"a": {"GPU_SLOT": 1, "CPU": 1}, "c": {"GPU_SLOT": 2, "CPU": 2}}, PER_WORKER)
    assert gate.decide(world=3, fitting=4, state=s2).extra == 1
    assert gate.decide(world=3, fitting=4, state=s2).extra == 0


def test_no_grow_without_free_capacity_and_nothing_remembered():
    gate = GrowGate()
    s = capacity_state({"a": {"GPU_SLOT": 0, "CPU": 0}}, PER_WORKER)
    assert gate.decide(world=3, fitting=3, state=s).extra == 0
    assert gate.tried == set()


def test_reachable_tells_a_listening_port_from_a_closed_one():
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()                              # nothing listens there now: refused at once
    try:
        t0 = time.monotonic()
        found = reachable({"live": live.getsockname(), "dead": ("127.0.0.1", dead_port)}, timeout_s=2.0)
        assert found == {"live"} and time.monotonic() - t0 < 1.5
    finally:
        live.close()
    assert reachable({}, 0.5) == set()


def test_reachable_probes_every_node_with_the_given_connect():
    seen = []

    def connect(addr):
        seen.append(addr)
        return addr[1] % 2 == 0

    assert reachable({f"n{i}": ("10.0.0.1", i) for i in range(6)}, 0.5, connect=connect) == {"n0", "n2", "n4"}
    assert sorted(p for _, p in seen) == list(range(6))

"""Warm standby processes of fill-in tenants (spotfill/fillin/standby.py; Serve's: serving/standby.py, a batch
job's: fillin/batch_standby.py): which nodes a keeper asks standbys for, the records and tokens it counts them
by, the host-memory budget, what an actor takes from a standby, how its start is reported, and the report's
summary of warm and cold starts."""
from __future__ import annotations

import json
import os

import pytest

from spotfill.fillin import standby as sb
from spotfill.serving import standby as serve_sb
from spotfill.telemetry.report import starts_summary


def test_each_node_with_lendable_gpus_gets_its_standbys_and_is_not_asked_twice_while_they_start():
    nodes = {"a": 2, "b": 1, "head": 0}
    assert sb.standby_asks(nodes, {}, {}, 100.0, per_node=1) == {"a": 1, "b": 1}        # never the head
    assert sb.standby_asks(nodes, {"a": 1}, {}, 100.0, per_node=2) == {"a": 1, "b": 1}   # at most its GPUs
    asked = {"a": 95.0, "b": 80.0}
    assert sb.standby_asks(nodes, {}, asked, 100.0, per_node=1, reask_s=15) == {"b": 1}
    assert sb.standby_asks(nodes, {"a": 1, "b": 1}, {}, 100.0, per_node=1) == {}
    assert sb.standby_asks(nodes, {}, {}, 100.0, per_node=0) == {}


def test_records_count_per_node_until_their_keep_alive_ends():
    key = lambda node, pid: f"{serve_sb.RECORD_PREFIX}app:{node}:{pid}"  # noqa: E731
    records = {key("a", 1): json.dumps({"until_t": 200}), key("a", 2): json.dumps({"until_t": 50}),
               key("b", 3): json.dumps({"until_t": 200}), key("b", 4): "not json", key("c", 5): None,
               "other:key": json.dumps({"until_t": 200})}
    assert sb.records_by_node(records, 100.0, serve_sb.RECORD_PREFIX) == {"a": 1, "b": 1}


def test_a_token_is_claimed_once_on_its_own_node_and_stale_ones_are_dropped():
    store = {f"{serve_sb.TOKEN_PREFIX}app:a:90.000:x1": json.dumps({"app": "app", "checkpoint": "file:///r"}),
             f"{serve_sb.TOKEN_PREFIX}app:b:90.000:x2": json.dumps({"app": "app", "checkpoint": "file:///r"}),
             f"{serve_sb.TOKEN_PREFIX}app:a:1.000:x0": json.dumps({"app": "app", "checkpoint": "old"})}

    def keys(prefix):
        return [k for k in store if k.startswith(prefix)]

    def take(k):
        return store.pop(k, None)
    prefix = serve_sb.TOKEN_PREFIX
    assert sb.claim_token(prefix, "a", keys, take, 130.0, owner="other") is None    # another owner's: left
    assert len(store) == 3
    assert sb.claim_token(prefix, "a", keys, take, 130.0) == {"app": "app", "checkpoint": "file:///r"}
    assert sb.claim_token(prefix, "a", keys, take, 130.0) is None            # the stale one was dropped, not used
    assert list(store) == [f"{prefix}app:b:90.000:x2"]     # another node's is left


def test_a_model_over_the_host_memory_budget_is_refused_naming_the_budget():
    ok, why = sb.fits_budget(3 * 2**30, 8 * 2**30, 0.25)
    assert not ok and "budget of 2.00 GiB" in why and "SPOTFILL_STANDBY_HOST_MEMORY_FRACTION" in why
    assert sb.fits_budget(2**30, 8 * 2**30, 0.25) == (True, "")


def test_a_process_with_no_token_is_no_standby_and_take_gives_nothing(monkeypatch):
    monkeypatch.setattr(sb, "_STANDBY", {})
    assert serve_sb.take("app", "file:///r") is None
    standby = {"kind": "serve", "owner": "app", "key": "file:///r", "loaded": "M", "record": "k", "imports_s": 1.0}
    monkeypatch.setattr(sb, "_kv", lambda: (None, None, None, lambda key: 1))
    monkeypatch.setattr(sb, "_STANDBY", dict(standby))
    assert serve_sb.take("other", "file:///r") is None                  # another app's standby: not ours
    assert sb.take("batch", "app", "file:///r") is None                 # another kind's
    got = serve_sb.take("app", "file:///other")                          # ours, holding another checkpoint
    assert got["loaded"] is None and "file:///r" in got["note"]         # the replica loads it, and says why
    monkeypatch.setattr(sb, "_STANDBY", dict(standby))
    got = serve_sb.take("app", "file:///r")
    assert got["loaded"] == "M" and sb._STANDBY["loaded"] is None     # the replica owns the model now


def test_the_start_event_says_warm_or_cold_and_the_report_sums_them():
    class Meter:
        node, lease_id = "n1", "lease-1"
    warm = serve_sb.start_event("serve:a/Generator", Meter(), 0.0, {"loaded": object(), "imports_s": 3.0},
                          {"tag": "t", "wake_s": 0.01, "load_s": 0.5})
    cold = serve_sb.start_event("serve:a/Generator", Meter(), 0.0, None, {"tag": "t", "load_s": 4.0})
    assert warm["warm"] and warm["load_s"] is None and warm["wake_s"] == 0.01 and warm["standby"]
    assert not cold["warm"] and cold["load_s"] == 4.0 and not cold["standby"]
    warm.update(init_s=0.4)
    cold.update(init_s=9.0, lease_id="lease-2")
    leases = [{"lease_id": "lease-1"}, {"lease_id": "lease-2"}, {"lease_id": "lease-3"}]
    out = starts_summary([warm, cold], leases)["serve"]
    assert out["warm"] == 1 and out["cold"] == 1
    assert out["init_s_warm"] == {"median": 0.4, "max": 0.4} and out["init_s_cold"]["median"] == 9.0
    assert out["wake_s"]["median"] == 0.01 and out["load_s"]["median"] == 4.0
    assert [le.get("start_kind") for le in leases] == ["warm", "cold", None]


def test_a_standby_waits_only_while_trainings_spares_start_not_while_they_warm_up():
    """a: a spare began its warm-up 3 s ago (others asked with it may still be starting): no standby yet.
    d: its spare has warmed for 30 s (started long ago): the standby is asked now -- before, it waited for the
    whole warm-up. b: ready; c: keep-alive over; e: an older record without a start time."""
    from spotfill.train.readiness import record_key, record_value
    records = {record_key("job", "a", 1): record_value(None, 500.0, since_t=97.0),
               record_key("job", "b", 2): record_value(90.0, 500.0, since_t=60.0),
               record_key("job", "c", 3): record_value(None, 50.0, since_t=99.0),       # c's keep-alive ran out
               record_key("job", "d", 4): record_value(None, 500.0, since_t=70.0),
               record_key("job", "e", 5): record_value(None, 500.0)}
    assert sb.training_starting(records, 100.0) == {"a"}
    assert sb.training_starting(records, 108.0) == set()


def test_a_woken_standby_computes_only_on_the_gpus_of_its_lease():
    """Ray sets CUDA_VISIBLE_DEVICES to the lease's GPUs when the actor lands on the standby's process; CUDA
    honours it only if the standby never initialised CUDA before (it does not: it holds weights on the CPU)."""
    assert sb.device_visibility([], None, False) == (True, "")                   # the CPU: nothing to check
    assert sb.device_visibility([3], "3", False) == (True, "")
    assert sb.device_visibility(["1", "2"], "1,2", False) == (True, "")
    ok, why = sb.device_visibility([3], "0,1,2,3", False)                          # it would compute on GPU 0
    assert not ok and "CUDA_VISIBLE_DEVICES='0,1,2,3'" in why and "lease is GPU(s) 3" in why
    ok, why = sb.device_visibility([3], "3", True)                                 # CUDA set up before the lease
    assert not ok and "initialised" in why
    assert not sb.device_visibility([3], None, False)[0]


def test_take_refuses_to_wake_a_standby_on_a_device_other_than_its_lease(monkeypatch):
    import pytest

    import spotfill.devices as devices
    monkeypatch.setattr(sb, "_kv", lambda: (None, None, None, lambda key: 1))
    monkeypatch.setattr(devices, "ray_gpu_ids", lambda: [2])
    standby = {"kind": "batch", "owner": "j", "key": "k", "loaded": "M", "record": "r"}
    monkeypatch.setattr(sb, "_STANDBY", dict(standby))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert sb.take("batch", "j", "k")["device"] == {"gpu_ids": ["2"], "cuda_visible_devices": "2"}
    monkeypatch.setattr(sb, "_STANDBY", dict(standby))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(RuntimeError, match="lease is GPU"):
        sb.take("batch", "j", "k")
    monkeypatch.setattr(sb, "_STANDBY", dict(standby))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setattr(sb, "cuda_initialised", lambda: True)
    with pytest.raises(RuntimeError, match="initialised"):
        sb.take("batch", "j", "k")


def test_a_standby_warms_up_in_the_class_it_is_set_to(monkeypatch):
    """SPOTFILL_STANDBY_WARM_CLASS is what the warm-up runs in: `low` at nice 19 in the normal class (a
    bounded share of CPUs training saturates), `idle` (the default) in SCHED_IDLE -- and either is put back
    after the warm-up (a nice of 0 before it once read as "not lowered"). The standby runs on a thread of
    this process: the class is the calling thread's."""
    import json
    import os
    import threading
    import time

    import ray

    from spotfill.config import constants
    from spotfill.train.spares import _nice_round_trip_allowed

    if not _nice_round_trip_allowed(os.getpriority(os.PRIO_PROCESS, 0)):
        import pytest
        pytest.skip("this user may not raise a thread's priority back (no CAP_SYS_NICE)")

    class Ctx:
        def get_node_id(self):
            return "n1"

    def run(cls: str) -> dict:
        store = {f"tok/own:n1:{time.time():.3f}:abcd": json.dumps({"owner": "own"})}
        kv = (store.get, store.__setitem__, lambda p: [k for k in store if k.startswith(p)],
              lambda k: 1 if store.pop(k, None) is not None else 0)
        monkeypatch.setattr(sb, "_kv", lambda: kv)
        monkeypatch.setattr(sb, "_STANDBY", {})
        monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
        monkeypatch.setattr(constants, "STANDBY_WARM_CLASS", cls)
        seen: dict = {}

        def warm(args):
            tid = threading.get_native_id()
            seen.update(nice=os.getpriority(os.PRIO_PROCESS, tid), idle=os.sched_getscheduler(0) == os.SCHED_IDLE,
                        owner=args["owner"])

        def body():
            before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            sb.start("batch", "tok/", "rec/", warm)
            seen.update(after=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before,
                        after_idle=os.sched_getscheduler(0) == os.SCHED_IDLE)
        t = threading.Thread(target=body)
        t.start()
        t.join(30)
        return {**seen, "class": sb._STANDBY.get("warm_class")}

    low = run("low")
    assert low == {"nice": 19, "idle": False, "owner": "own", "after": True, "after_idle": False, "class": "low"}
    idle = run("idle")
    assert idle["idle"] is True and idle["class"] == "idle" and idle["after_idle"] is False


def test_a_constructing_actor_is_placed_on_the_node_of_its_process():
    from types import SimpleNamespace as A

    from spotfill.fillin.job_tenant import constructing_nodes
    actors = [A(actor_id="a1", state="PENDING_CREATION", node_id=None, pid=11),    # constructor runs
              A(actor_id="a2", state="PENDING_CREATION", node_id=None, pid=0),     # waits for resources
              A(actor_id="a3", state="ALIVE", node_id="n2", pid=12),
              A(actor_id="a4", state="PENDING_CREATION", node_id=None, pid=13)]    # pid on two nodes
    workers = [A(pid=11, node_id="n1"), A(pid=12, node_id="n2"), A(pid=13, node_id="n1"), A(pid=13, node_id="n3")]
    assert constructing_nodes(actors, workers) == {"a1": "n1"}


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
@pytest.mark.parametrize("mode", ["idle", "low"])
def test_a_standby_is_held_back_no_longer_than_its_bound(mode):
    """SPOTFILL_STANDBY_HOLD_MAX_S: a tenant's actor Ray hands a standby still warming waits for its warm-up,
    and held back on a node training saturates the warm-up got no CPU (a demo's sweep held a lent GPU 90 s,
    its trial never started). The hold ends after the bound and the marks say so; without a bound (0) it
    lasts the whole warm-up."""
    import threading
    import time

    from spotfill.fillin.standby import held_warm
    if mode == "low" and os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process already runs at nice 19")

    def held() -> bool:
        tid = threading.get_native_id()
        return (os.sched_getscheduler(0) == os.SCHED_IDLE if mode == "idle"
                else os.getpriority(os.PRIO_PROCESS, tid) == 19)

    def warm_up(seen: dict, lasts_s: float):
        def run():
            seen["held_at_start"] = held()
            deadline = time.time() + lasts_s
            while time.time() < deadline:
                if not held():
                    seen.setdefault("back", time.time())
                time.sleep(0.02)
        return run

    seen, t0 = {}, time.time()
    marks = held_warm(mode == "low", 0.5, warm_up(seen, 4.0), {})
    if not marks["idle"]:
        pytest.skip("this process may not leave the held-back class again")
    assert seen["held_at_start"] and marks["warm_class"] == mode
    assert "back" in seen and 0.4 <= seen["back"] - t0 < 3.5, seen
    assert marks["woken_by"] == "hold_max" and marks["woken_t"] >= t0 + 0.4
    seen = {}
    marks = held_warm(mode == "low", 0.0, warm_up(seen, 1.5), {})
    assert "back" not in seen and "woken_by" not in marks, "no bound: held back the whole warm-up"
    assert not held(), "the hold ends with the warm-up"

"""report.json `cluster.nodes` and the autoscaler invariants (spotfill.sim.nodes), and the fake autoscaler's
node types and scenario keys (spotfill.sim.autoscaler_config, spotfill.sim.scenario): pure, no Ray."""
from __future__ import annotations

import pytest

from spotfill.config.errors import ConfigError
from spotfill.sim.autoscaler_config import fake_cluster_config, parse_node_types
from spotfill.sim.nodes import autoscaler_invariants, cluster_section
from spotfill.sim.scenario import parse_scenario

HEAD = {"id": "h", "type": "head", "market": "on-demand", "gpus": 0, "launched_by": "static", "started": 100.0}


def test_nodes_from_records_provider_log_and_ray():
    records = [HEAD, {"id": "s1", "type": None, "market": "on-demand", "gpus": 2, "launched_by": "scenario",
                      "started": 105.0, "ended": 150.0}]
    log = [{"t": 110.0, "event": "launched", "node_id": "a1", "node_type": "gpu_spot", "market": "spot"},
           {"t": 111.0, "event": "launched", "node_id": "a2", "node_type": "gpu_spot", "market": "spot"},
           {"t": 140.0, "event": "unfulfilled", "node_id": "a3", "node_type": "gpu_spot", "market": "spot"},
           {"t": 149.0, "event": "terminated", "node_id": "a3", "node_type": "gpu_spot", "market": "spot"},
           {"t": 150.0, "event": "launched", "node_id": "a4", "node_type": "gpu_od", "market": "on-demand"},
           {"t": 170.0, "event": "terminated", "node_id": "a1", "node_type": "gpu_spot", "market": "spot"}]
    seen = [{"id": "h", "alive": True, "death_reason": None},
            {"id": "s1", "alive": False, "death_reason": "UNEXPECTED_TERMINATION", "death_message": "killed"},
            {"id": "a1", "alive": False, "death_reason": "AUTOSCALER_DRAIN_PREEMPTED",
             "death_message": "spot notice", "dead_at": 160.0},
            {"id": "a2", "alive": False, "death_reason": "AUTOSCALER_DRAIN_IDLE", "death_message": ""},
            {"id": "a4", "alive": True}]
    out = cluster_section(records, log, seen, now=200.0, gpus_by_type={"gpu_spot": 2, "gpu_od": 4})
    by = {n["id"]: n for n in out["nodes"]}
    assert [n["id"] for n in out["nodes"]] == ["h", "s1", "a1", "a2", "a4"]     # by start time
    assert by["h"] == {**HEAD, "ended": None, "death_reason": None}
    assert by["s1"]["launched_by"] == "scenario" and by["s1"]["ended"] == 150.0
    assert by["s1"]["death_reason"] == "UNEXPECTED_TERMINATION: killed"
    # seen dead at 160, terminated by the autoscaler at 170: it ended when it died
    assert by["a1"] == {"id": "a1", "type": "gpu_spot", "market": "spot", "gpus": 2, "launched_by": "autoscaler",
                        "started": 110.0, "ended": 160.0,
                        "death_reason": "AUTOSCALER_DRAIN_PREEMPTED: spot notice"}
    assert by["a2"]["ended"] == 200.0 and by["a2"]["death_reason"] == "AUTOSCALER_DRAIN_IDLE"
    assert by["a4"]["market"] == "on-demand" and by["a4"]["ended"] is None and by["a4"]["death_reason"] is None
    assert by["a4"]["gpus"] == 4 and by["s1"]["gpus"] == 2
    # the unfulfilled spot request never became a node: it is a launch failure, not a node
    assert "a3" not in by
    assert out["launch_failures"] == [{"type": "gpu_spot", "market": "spot", "how": "unfulfilled", "t": 140.0}]


def test_nodes_with_gpus_feed_the_gpu_seconds_ledger():
    from spotfill.telemetry.ledger import nodes_from_report
    log = [{"t": 110.0, "event": "launched", "node_id": "a1", "node_type": "gpu_spot", "market": "spot"}]
    out = cluster_section([HEAD], log, [{"id": "a1", "alive": True}], 200.0, gpus_by_type={"gpu_spot": 2})
    spans = {s.node: s for s in nodes_from_report({"cluster": out})}
    assert spans["a1"].gpus == 2 and spans["a1"].start == 110.0 and spans["a1"].end is None
    assert spans["h"].gpus == 0


def _report(launches, timeline, notices, scale_down=None):
    nodes = [{"id": f"n{i}", "launched_by": "autoscaler", "started": t} for i, t in enumerate(launches)]
    rep = {"cluster": {"nodes": nodes}, "training": {"world_size_timeline": timeline},
           "preemptions": [{"kind": "announced", "affected": True, "at": t} for t in notices]}
    if scale_down is not None:
        rep["autoscaler"] = {"scale_down": scale_down}
    return rep


def test_replaced_and_grown_back_needs_a_launch_after_the_notice_and_the_old_size_again():
    timeline = [[10, 2], [20, 4], [41, 2], [60, 4]]
    ok = autoscaler_invariants(_report([5, 6, 50], timeline, [40]))["replaced_and_grown_back"]
    assert ok["ok"], ok
    # no launch after the notice: the regrow did not come from a replacement
    assert not autoscaler_invariants(_report([5, 6], timeline, [40]))["replaced_and_grown_back"]["ok"]
    # a replacement came but training never reached its size before the notice again
    short = [[10, 2], [20, 4], [41, 2]]
    assert not autoscaler_invariants(_report([5, 6, 50], short, [40]))["replaced_and_grown_back"]["ok"]
    # the runner's own record of the size at the notice wins over the timeline (whose entry for a restart
    # can come a moment after the notice that followed it)
    rep = _report([5, 50], [[10, 2], [40.5, 4], [41, 2], [60, 2]], [40])
    rep["preemptions"][0]["world_size_before"] = 4
    assert not autoscaler_invariants(rep)["replaced_and_grown_back"]["ok"]
    rep["training"]["world_size_timeline"].append([70, 4])
    assert autoscaler_invariants(rep)["replaced_and_grown_back"]["ok"]
        # the replacement was up before the group restarted: straight back at 4, no timeline change
    rep = _report([5, 42], [[10, 2], [20, 4]], [40])
    rep["preemptions"][0].update(world_size_before=4, world_size_after=4, recovery_seconds=12.0)
    assert autoscaler_invariants(rep)["replaced_and_grown_back"]["ok"]
    rep["preemptions"][0].update(recovery_seconds=1.0)          # restarted at 4 before the launch: not it
    assert not autoscaler_invariants(rep)["replaced_and_grown_back"]["ok"]
        # the size that counts is the one at the notice, not the largest ever
    assert autoscaler_invariants(_report([5, 50], [[10, 4], [20, 2], [41, 1], [60, 2]], [30]))[
        "replaced_and_grown_back"]["ok"]


def test_scale_down_and_leftovers():
    clean = {"seconds": 6.0, "nodes_left": 0, "min_workers": 0, "placement_groups": [],
             "actors_on_launched_nodes": [], "request_after": []}
    inv = autoscaler_invariants(_report([], [], [], clean))
    assert inv["idle_nodes_scaled_down"]["ok"] and inv["nothing_left_behind"]["ok"]
    assert "replaced_and_grown_back" not in inv
    assert not autoscaler_invariants(_report([], [], [], {**clean, "nodes_left": 1}))["idle_nodes_scaled_down"]["ok"]
    assert autoscaler_invariants(_report([], [], [], {**clean, "nodes_left": 1, "min_workers": 1}))[
        "idle_nodes_scaled_down"]["ok"]
    for key, value in (("placement_groups", ["pg1"]), ("actors_on_launched_nodes", [{"class": "X"}]),
                       ("request_after", [{"bundle": {"GPU": 1}, "count": 4}])):
        assert not autoscaler_invariants(_report([], [], [], {**clean, key: value}))["nothing_left_behind"]["ok"]


def test_fake_cluster_config_looks_like_cluster_yaml():
    types = parse_node_types({"gpu_spot": {"gpus": 2, "market": "spot", "max_workers": 2, "priority": 10},
                              "gpu_od": {"gpus": 2, "market": "on-demand", "max_workers": 1}})
    cfg = fake_cluster_config(types, "GPU_SLOT", 2, provider={"type": "external", "module": "m.C"},
                              idle_timeout_s=6)
    spot = cfg["available_node_types"]["gpu_spot"]
    assert spot["resources"]["GPU_SLOT"] == 2 and spot["resources"]["CPU"] == 2
    assert spot["labels"] == {"spotfill.io/market-type": "spot", "spotfill.io/role": "gpu-worker"}
    assert spot["priority"] == 10 and cfg["available_node_types"]["gpu_od"]["priority"] == 0
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert "GPU_SLOT" not in head["resources"] and head["max_workers"] == 0
    assert cfg["idle_timeout_minutes"] == pytest.approx(0.1) and cfg["max_workers"] == 3
    assert fake_cluster_config(types, "GPU_SLOT", 2, provider={}, idle_timeout_s=6, max_workers=2)["max_workers"] == 2


@pytest.mark.parametrize("raw, field", [
    ({"t": {"market": "preemptible"}}, "cluster.autoscaler.node_types.t.market"),
    ({"t": {"gpus": 0}}, "cluster.autoscaler.node_types.t.gpus"),
    ({"t": {"min_workers": 3, "max_workers": 2}}, "cluster.autoscaler.node_types.t.min_workers"),
    ({"t": {"zone": "a"}}, "cluster.autoscaler.node_types.t.zone"),
    ({}, "cluster.autoscaler.node_types"),
])
def test_bad_node_types_name_the_field(raw, field):
    with pytest.raises(ConfigError) as err:
        parse_node_types(raw, "cluster.autoscaler.node_types")
    assert err.value.field == field


AUTOSCALED = {"cluster": {"autoscaler": {"node_types": {"gpu_spot": {"gpus": 2, "max_workers": 2}}}},
              "training": {"workers": [1, 4], "global_batch": 12}}


def test_autoscaling_scenario_starts_head_only_and_takes_market_events():
    sc = parse_scenario({**AUTOSCALED, "events": [
        {"at_step": 10, "min_world": 4, "action": "market", "node_type": "gpu_spot", "available": False},
        {"at_step": 10, "min_world": 4, "action": "drain_node", "node": 5}]})
    assert sc.cluster.nodes == []
    market, drain = sc.events
    assert (market.node_type, market.available, market.how, market.min_world) == ("gpu_spot", False, "unfulfilled", 4)
    assert drain.node == 5          # launched nodes take indices in launch order: no bound up front
    assert "once training runs 4 workers" in drain.describe()


@pytest.mark.parametrize("event, field", [
    ({"at_step": 1, "action": "market", "node_type": "gpu_nope", "available": False}, "events[0].node_type"),
    ({"at_step": 1, "action": "market", "node_type": "gpu_spot", "available": "no"}, "events[0].available"),
    ({"at_step": 1, "action": "market", "node_type": "gpu_spot", "available": False, "how": "never"},
     "events[0].how"),
    ({"at_step": 1, "action": "drain_node", "node": 0, "min_world": 0}, "events[0].min_world"),
])
def test_bad_market_events_name_the_field(event, field):
    with pytest.raises(ConfigError) as err:
        parse_scenario({**AUTOSCALED, "events": [event]})
    assert err.value.field == field


def test_autoscaler_keys_are_checked():
    with pytest.raises(ConfigError) as err:
        parse_scenario({"cluster": {"autoscaler": {"node_types": {"a": {}}, "idle": 3}}})
    assert err.value.field == "cluster.autoscaler.idle"
    with pytest.raises(ConfigError) as err:   # a market event needs an autoscaler node type
        parse_scenario({"events": [{"at_step": 1, "action": "market", "node_type": "x", "available": True}]})
    assert err.value.field == "events[0].node_type"
    # the capacity check counts what the autoscaler may launch
    with pytest.raises(ConfigError):
        parse_scenario({"cluster": {"autoscaler": {"max_workers": 1, "node_types": {"a": {"gpus": 1, "max_workers": 4}}}},
                        "training": {"workers": [2, 4], "global_batch": 12}})


def test_builtin_autoscaling_demo_scenario_parses():
    from spotfill.sim.scenario import AUTOSCALING_SCENARIO, DEFAULT_SCENARIO
    sc = parse_scenario(AUTOSCALING_SCENARIO, "demo")
    assert sc.cluster.nodes == [] and {t.name for t in sc.cluster.node_types()} == {"gpu_spot", "gpu_ondemand"}
    assert not any(e.action == "add_node" for e in sc.events)        # the autoscaler brings the capacity
    # the same training, run longer: the story's grow-back and spot notice need steps after capacity returns
    # (840: after the last event the batch job and the sweep still take turns, are taken back and carry on)
    assert AUTOSCALING_SCENARIO["training"] == {**DEFAULT_SCENARIO["training"], "steps": 840}
    assert sc.fillin.require_resumes and sc.fillin.turn_s == 30
    # Serve fill-in runs on the story: node types of 3 slots leave 2 beyond training's max of 4 on 2 nodes
    assert sc.fillin.serve_enabled and not sc.fillin.serve["launch_nodes"]
    assert sc.cluster.autoscaler["max_workers"] * min(t.gpus for t in sc.cluster.node_types()) > sc.training.max_workers
    # every story event fires well before the quick demo's end (300 steps): the last one leaves 200 steps
    assert all(e.at_step is not None and e.at_step <= 100 for e in sc.events)

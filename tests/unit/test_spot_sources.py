"""Pure parts of the notice sources (spot/sources/*, spot/notice.py, spot/early_warning.py): body -> notices,
decide(), detection, early-warning records, and spot-watch's source flags. No Ray, no HTTP."""
from __future__ import annotations

import argparse
import json
from email.utils import formatdate

import pytest

from spotfill.cli import spot_watch as cli
from spotfill.config.errors import ConfigError
from spotfill.spot import early_warning as ew
from spotfill.spot.notice import EARLY_WARNING, PREEMPT, Notice, Reading, decide
from spotfill.spot.sources import REGISTRY, detect, source_class
from spotfill.spot.sources import azure, gcp, kubernetes

NOW = 1_800_000_000.0


# --- GCP -------------------------------------------------------------------------------------------
def test_gcp_preempted_true_is_a_notice_30s_from_first_sight():
    r = gcp.reading("TRUE", "NONE", now=NOW)
    (n,) = r.notices
    assert (n.kind, n.event, n.deadline_s) == (PREEMPT, "preempted", NOW + 30) and not r.problems
    later = gcp.reading("TRUE", "NONE", now=NOW + 5, since={n.key: NOW})
    assert later.notices[0].deadline_s == NOW + 30 and later.notices[0].key == n.key   # same notice, same deadline


def test_gcp_false_and_none_are_no_notice():
    assert gcp.reading("FALSE", "NONE", now=NOW) == Reading()


def test_gcp_maintenance_terminate_drains_migrate_warns():
    (t,) = gcp.reading("FALSE", "TERMINATE_ON_HOST_MAINTENANCE", now=NOW).notices
    assert t.kind == PREEMPT and t.deadline_s == NOW + 60
    (m,) = gcp.reading("FALSE", "MIGRATE_ON_HOST_MAINTENANCE", now=NOW).notices
    assert m.kind == EARLY_WARNING and m.deadline_s is None


@pytest.mark.parametrize("preempted,maintenance", [("<html>oops</html>", "NONE"), ("FALSE", "SOMETHING_NEW")])
def test_gcp_malformed_is_a_problem_not_a_drain(preempted, maintenance):
    r = gcp.reading(preempted, maintenance, now=NOW)
    assert r.notices == () and len(r.problems) == 1


# --- Azure -----------------------------------------------------------------------------------------
def events(*evs, incarnation=2) -> str:
    return json.dumps({"DocumentIncarnation": incarnation, "Events": list(evs)})


def ev(kind="Preempt", event_id="E1", resources=("vm0",), not_before=None):
    nb = formatdate(NOW + 30, usegmt=True) if not_before is None else not_before
    return {"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine", "Resources": list(resources),
            "EventStatus": "Scheduled", "NotBefore": nb, "Description": "", "EventSource": "Platform"}


def test_azure_preempt_deadline_is_not_before_and_carries_its_ack_id():
    (n,) = azure.reading(events(ev()), now=NOW, vm_name="vm0").notices
    assert (n.kind, n.event, n.deadline_s, n.ack_id) == (PREEMPT, "Preempt", NOW + 30, "E1")
    assert azure.parse_not_before("Mon, 19 Sep 2016 18:29:47 GMT") == 1474309787.0


def test_azure_other_vms_events_are_ignored_and_freeze_warns():
    r = azure.reading(events(ev(resources=["vm7"]), ev("Freeze", "E2")), now=NOW, vm_name="vm0")
    assert [(n.kind, n.event) for n in r.notices] == [(EARLY_WARNING, "Freeze")]
    assert len(azure.reading(events(ev(resources=["vm7"])), now=NOW, vm_name=None).notices) == 1


def test_azure_no_events_no_notice():
    assert azure.reading(events(), now=NOW, vm_name="vm0") == Reading()


@pytest.mark.parametrize("body", ["not json", json.dumps({"Events": "x"}), json.dumps([1])])
def test_azure_malformed_body_is_a_problem(body):
    r = azure.reading(body, now=NOW)
    assert r.notices == () and len(r.problems) == 1


def test_azure_unusable_not_before_drains_at_default_and_is_reported():
    r = azure.reading(events(ev(not_before="someday")), now=NOW, vm_name="vm0")
    assert r.notices[0].deadline_s == NOW + azure.DEFAULT_NOTICE_S and len(r.problems) == 1
    unknown = azure.reading(events(ev("Hibernate")), now=NOW, vm_name="vm0")
    assert unknown.notices == () and "unknown EventType" in unknown.problems[0]


def test_azure_ack_body():
    assert json.loads(azure.ack_body("E1")) == {"StartRequests": [{"EventId": "E1"}]}


# --- Kubernetes ------------------------------------------------------------------------------------
def node(*taints, name="n1") -> str:
    return json.dumps({"metadata": {"name": name}, "spec": {"taints": [{"key": k, "effect": "NoSchedule"}
                                                                       for k in taints]}})


def test_kubernetes_sigterm_deadline_is_the_grace_budget():
    (n,) = kubernetes.reading(NOW, None, now=NOW + 1, deadline_s=120).notices
    assert (n.kind, n.event, n.deadline_s) == (PREEMPT, "SIGTERM", NOW + 120)


def test_kubernetes_termination_taint_is_a_notice_other_taints_are_not():
    r = kubernetes.reading(None, node("nvidia.com/gpu", "karpenter.sh/disrupted"), now=NOW, deadline_s=30)
    assert [(n.event, n.deadline_s) for n in r.notices] == [("taint", NOW + 30)]
    assert kubernetes.reading(None, node("nvidia.com/gpu"), now=NOW, deadline_s=30) == Reading()


def test_kubernetes_malformed_node_is_a_problem():
    r = kubernetes.reading(None, "{not json", now=NOW, deadline_s=30)
    assert r.notices == () and len(r.problems) == 1


def test_kubernetes_in_cluster_endpoint():
    assert kubernetes.in_cluster_endpoint({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}) \
        == "https://10.0.0.1:443"
    assert kubernetes.in_cluster_endpoint({}) == ""


# --- decide() --------------------------------------------------------------------------------------
def n(kind, key, deadline=None) -> Notice:
    return Notice("x", kind, "ev", key, deadline, f"msg {key}", "why")


def test_decide_drains_the_earliest_deadline_once():
    r = Reading((n(PREEMPT, "late", NOW + 100), n(PREEMPT, "soon", NOW + 20), n(EARLY_WARNING, "w")))
    d = decide(r, now=NOW)
    assert d.drain and d.key == "soon" and d.remaining_s == 20 and d.reason == "DRAIN_NODE_REASON_PREEMPTION"
    assert decide(r, now=NOW, done={"soon"}).key == "late"
    assert not decide(r, now=NOW, done={"soon", "late"}).drain


def test_decide_early_warning_does_not_drain_unless_asked():
    r = Reading((n(EARLY_WARNING, "w"),))
    assert not decide(r, now=NOW).drain
    drained = decide(r, now=NOW, on_early_warning="drain")
    assert drained.drain and drained.deadline_s is None
    with pytest.raises(ConfigError):
        decide(r, now=NOW, on_early_warning="panic")


# --- detection, registry ---------------------------------------------------------------------------
@pytest.mark.parametrize("env,vendor,product,want", [
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "Amazon EC2", "", "kubernetes"),
    ({}, "Amazon EC2", "g5.12xlarge", "aws"),
    ({}, "Google", "Google Compute Engine", "gcp"),
    ({}, "Microsoft Corporation", "Virtual Machine", "azure"),
    ({}, "", "", "aws"),
])
def test_detect(env, vendor, product, want):
    assert detect(env, vendor, product)[0] == want


def test_every_registered_source_has_the_interface():
    for name in REGISTRY:
        cls = source_class(name)
        assert cls.name == name
        for method in ("read", "wait", "acknowledge", "close"):
            assert callable(getattr(cls, method))


# --- early-warning records -------------------------------------------------------------------------
def test_early_warning_record_stands_until_expiry_or_withdrawal():
    key, value = ew.record("ab" * 28, source="aws", event="rebalance", message="m", now=NOW, ttl_s=60)
    assert key == ew.PREFIX + "ab" * 28
    assert ew.warned_nodes({key: value}, NOW + 1) == {"ab" * 28}
    assert ew.warned_nodes({key: value.encode()}, NOW + 61) == set()
    _, ended = ew.record("ab" * 28, source="aws", event="rebalance", message="m", now=NOW + 5, withdrawn=True)
    assert ew.warned_nodes({key: ended}, NOW + 5) == set()
    assert ew.warned_nodes({key: b"garbage", "k2": None}, NOW) == set()


# --- CLI flags -------------------------------------------------------------------------------------
def args(**kw) -> argparse.Namespace:
    base = dict(source="auto", imds_endpoint=None, endpoint=None, deadline_s=None, node_name=None)
    return argparse.Namespace(**{**base, **kw})


def test_cli_source_choices_and_detection():
    with pytest.raises(ConfigError) as exc:
        cli.validate_source("openstack")
    assert "--source" in str(exc.value) and "gcp" in str(exc.value) and "\n" not in str(exc.value)
    assert cli.resolve_source(args(source="gcp"))[0] == "gcp"
    assert cli.resolve_source(args(imds_endpoint="http://127.0.0.1:1"), env={})[0] == "aws"
    assert cli.resolve_source(args(), env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})[0] == "kubernetes"


def test_cli_build_source_endpoints_and_deadlines():
    src = cli.build_source("gcp", args(endpoint="http://127.0.0.1:9"), 0.5)
    assert src.endpoint == "http://127.0.0.1:9" and src.name == "gcp"
    assert cli.build_source("azure", args(), 0.5).endpoint == azure.DEFAULT_ENDPOINT
    k = cli.build_source("kubernetes", args(deadline_s="120", node_name="n1", endpoint="http://127.0.0.1:9"), 0.5)
    assert (k.deadline_s, k.node_name) == (120.0, "n1")
    assert cli.build_source("aws", args(deadline_s="90"), 0.5).default_deadline_s == 90.0
    for bad in (args(endpoint="http://a", imds_endpoint="http://b"), args(deadline_s="30"),
                args(endpoint="nope"), args(deadline_s="-1")):
        with pytest.raises(ConfigError):
            cli.build_source("gcp", bad, 0.5)


def test_the_30s_notice_scenario_parses_with_30s_drains():
    """examples/scenario-30s-notice.yaml (docs/spot-notices.md: notice -> committed per node) stays a valid
    scenario with two 30 s notices on different nodes."""
    from pathlib import Path

    from spotfill.sim.scenario import load_scenario

    path = Path(__file__).resolve().parents[2] / "examples" / "scenario-30s-notice.yaml"
    drains = [e for e in load_scenario(str(path)).events if e.action == "drain_node"]
    assert [e.deadline_s for e in drains] == [30.0, 30.0] and len({e.node for e in drains}) == 2

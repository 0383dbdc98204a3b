"""Pure spot-watch decisions: parsing IMDS bodies, decide(), node picking, validation. No Ray, no IO."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from spotfill.spot import watcher as spot

from spotfill.cli import spot_watch as spot_cli
from spotfill.config.errors import ConfigError

NOW = datetime(2026, 11, 29, 11, 58, 0, tzinfo=timezone.utc).timestamp()
T_NOTICE = "2026-11-29T12:00:00Z"
T_NOTICE_S = NOW + 120.0


def body(action="terminate", time=T_NOTICE) -> str:
    return json.dumps({"action": action, "time": time})


@pytest.mark.parametrize("text,expected", [
    ("2026-11-29T12:00:00Z", T_NOTICE_S),
    ("2026-11-29T12:00:00.500Z", T_NOTICE_S + 0.5),
    ("2026-11-29T13:00:00+01:00", T_NOTICE_S),
    ("2026-11-29T12:00:00", T_NOTICE_S),              # naive -> UTC
    ("", None), ("soon", None), (None, None), (1234, None),
])
def test_parse_time(text, expected):
    assert spot.parse_time(text) == expected


def test_parse_instance_action_ok_and_garbled():
    a = spot.parse_instance_action(body())
    assert (a.action, a.time_s, a.problem) == ("terminate", T_NOTICE_S, None)
    assert spot.parse_instance_action("<html>").problem == "body is not JSON"
    assert spot.parse_instance_action("[1]").action == "unknown"
    no_time = spot.parse_instance_action(json.dumps({"action": "stop"}))
    assert no_time.action == "stop" and no_time.time_s is None and "no usable time" in no_time.problem


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_instance_action_drains_with_notice_deadline(action):
    d = spot.decide(spot.parse_instance_action(body(action)), None, now=NOW)
    assert d.drain and d.kind == "instance-action"
    assert d.reason == "DRAIN_NODE_REASON_PREEMPTION" == spot.PREEMPTION_REASON
    assert d.deadline_s == T_NOTICE_S and d.remaining_s == pytest.approx(120.0)
    assert action in d.message and T_NOTICE in d.message
    assert d.key


def test_same_notice_drains_once_new_notice_drains_again():
    first = spot.decide(spot.parse_instance_action(body()), None, now=NOW)
    again = spot.decide(spot.parse_instance_action(body()), None, now=NOW + 5, done={first.key})
    assert not again.drain and again.why == "already drained for this notice"
    moved = spot.decide(spot.parse_instance_action(body(time="2026-11-29T12:01:00Z")), None,
                        now=NOW + 5, done={first.key})
    assert moved.drain and moved.deadline_s == T_NOTICE_S + 60


def test_unusable_notice_still_drains_with_default_deadline():
    d = spot.decide(spot.parse_instance_action("not json"), None, now=NOW, default_deadline_s=90)
    assert d.drain and d.deadline_s == NOW + 90 and "default 90s" in d.why


def test_past_deadline_is_kept_as_is():
    d = spot.decide(spot.parse_instance_action(body()), None, now=T_NOTICE_S + 10)
    assert d.drain and d.deadline_s == T_NOTICE_S and d.remaining_s == pytest.approx(-10)


def test_no_notice():
    d = spot.decide(None, None, now=NOW)
    assert not d.drain and d.kind == "none" and d.key is None


def test_rebalance_logs_by_default_and_drains_when_asked():
    rb = spot.parse_rebalance(json.dumps({"noticeTime": T_NOTICE}))
    assert rb.notice_time_s == T_NOTICE_S
    logged = spot.decide(None, rb, now=NOW)
    assert logged.kind == "rebalance" and not logged.drain and "on_rebalance=log" in logged.why
    drained = spot.decide(None, rb, now=NOW, on_rebalance="drain")
    assert drained.drain and drained.deadline_s is None and drained.reason == spot.PREEMPTION_REASON
    assert not spot.decide(None, rb, now=NOW, on_rebalance="drain", done={drained.key}).drain
    with pytest.raises(ConfigError):
        spot.decide(None, rb, now=NOW, on_rebalance="panic")


def test_instance_action_wins_over_rebalance():
    rb = spot.parse_rebalance(json.dumps({"noticeTime": T_NOTICE}))
    d = spot.decide(spot.parse_instance_action(body()), rb, now=NOW, on_rebalance="drain")
    assert d.kind == "instance-action" and d.deadline_s == T_NOTICE_S


@pytest.mark.parametrize("value", ["-1", "0", "abc", "", "inf", "nan", None])
def test_validate_poll_s_rejects(value):
    with pytest.raises(ConfigError) as exc:
        spot_cli.validate_poll_s(value)
    assert "--poll-s" in str(exc.value) and "\n" not in str(exc.value)


def test_validate_poll_s_and_endpoint_accept():
    assert spot_cli.validate_poll_s("0.5") == 0.5
    assert spot_cli.validate_endpoint("http://169.254.169.254") == "http://169.254.169.254"
    for bad in ("169.254.169.254", "ftp://x", ""):
        with pytest.raises(ConfigError):
            spot_cli.validate_endpoint(bad)


NODES = [
    {"node_id": "head", "ip": "10.0.0.1", "is_head": True, "instance_id": "i-head"},
    {"node_id": "w1", "ip": "10.0.0.2", "is_head": False, "instance_id": "i-w1"},
    {"node_id": "w2", "ip": "10.0.0.1", "is_head": False, "instance_id": ""},
]


def test_pick_node():
    assert spot.pick_node(NODES, "10.0.0.2") == "w1"
    assert spot.pick_node(NODES, "10.0.0.9", instance_id="i-w1") == "w1"   # instance id wins
    assert spot.pick_node(NODES, "10.0.0.1") == "w2"                        # head + worker on one IP
    with pytest.raises(spot.DrainError, match="no alive Ray node"):
        spot.pick_node(NODES, "10.9.9.9")
    twins = NODES + [{"node_id": "w3", "ip": "10.0.0.1", "is_head": False, "instance_id": ""}]
    with pytest.raises(spot.DrainError, match="--node-id"):
        spot.pick_node(twins, "10.0.0.1")


def test_outcome_describe():
    d = spot.decide(spot.parse_instance_action(body()), None, now=NOW)
    line = spot.PollOutcome("drained", d, detail="node abc").describe()
    assert "drained node abc" in line and "120s left" in line
    assert spot.PollOutcome("no-notice", spot.decide(None, None, now=NOW)).describe() == "no notice"


def test_module_does_not_import_ray():
    code = ("import sys, spotfill.spot.watcher, spotfill.cli.spot_watch, spotfill.testing.imds, "
            "spotfill.spot.sources.gcp, spotfill.spot.sources.azure, spotfill.spot.sources.kubernetes, "
            "spotfill.spot.early_warning, spotfill.testing.gcp_metadata, spotfill.testing.azure_events, "
            "spotfill.testing.kube_api; print('ray' in sys.modules)")
    platform_dir = os.path.join(os.path.dirname(__file__), "..", "..", "platform")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(platform_dir),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


def test_validate_node_id():
    assert spot_cli.validate_node_id(None) is None
    assert spot_cli.validate_node_id("AB" * 28) == "ab" * 28
    for bad in ("abc", "zz" * 28, "ab" * 29):
        with pytest.raises(ConfigError):
            spot_cli.validate_node_id(bad)

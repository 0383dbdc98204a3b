"""Fill-in's CPU priority (spotfill.fillin.cpu_priority): the nice value is read and checked, and every
thread of a real process -- those running already and those it starts later -- gets it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spotfill.config.errors import ConfigError
from spotfill.fillin.cpu_priority import (ENV, IDLE_ENV, configured_idle, configured_nice, lower_cpu_priority,
                                          thread_nice, thread_policy)

CHILD = r"""
import sys, threading, time
started = threading.Event()
def spin():
    started.set()
    time.sleep(60)
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()                       # the test reniced us: start one more thread
threading.Thread(target=spin, daemon=True).start()
print("more", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("value,env,expected", [
    (None, None, 19), (None, "", 19), (None, "7", 7), (0, "7", 0), (12, None, 12), ("19", None, 19)])
def test_configured_nice(monkeypatch, value, env, expected):
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    assert configured_nice(value) == expected


@pytest.mark.parametrize("value", [-1, 20, 3.5, True, "low", ""])
def test_bad_nice_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^fillin.cpu_nice: .*accepted: an integer from 0"):
        configured_nice(value)


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "high")
    with pytest.raises(ConfigError, match=ENV):
        configured_nice()


@pytest.mark.parametrize("value,env,expected", [
    (None, None, True), (None, "0", False), (None, "true", True), (False, "1", False), ("off", None, False)])
def test_configured_idle(monkeypatch, value, env, expected):
    if env is None:
        monkeypatch.delenv(IDLE_ENV, raising=False)
    else:
        monkeypatch.setenv(IDLE_ENV, env)
    assert configured_idle(value) is expected


def test_bad_idle_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^fillin.cpu_idle: bad value 2; accepted: true or false"):
        configured_idle(2)


def _child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _more_threads(proc) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "more"


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_every_thread_goes_to_sched_idle_and_new_threads_inherit():
    proc = _child()
    try:
        assert set(thread_policy(proc.pid).values()) == {os.SCHED_OTHER}
        out = lower_cpu_priority(19, pid=proc.pid, idle=True)
        assert out["idle"] and out["threads"] == len(thread_policy(proc.pid))
        _more_threads(proc)
        policies = thread_policy(proc.pid)
        assert len(policies) >= 5 and set(policies.values()) == {os.SCHED_IDLE}
        assert set(thread_nice(proc.pid).values()) == {19}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are read from /proc")
def test_every_thread_of_a_process_is_reniced_and_new_threads_inherit():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        before = thread_nice(proc.pid)
        assert len(before) >= 4 and set(before.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}
        out = lower_cpu_priority(17, pid=proc.pid, idle=False)
        assert out["nice"] == 17 and out["threads"] == len(before)
        assert set(thread_nice(proc.pid).values()) == {17}
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "more"
        after = thread_nice(proc.pid)
        assert len(after) == len(before) + 1 and set(after.values()) == {17}
        # a nice value already higher is kept; 0 turns the feature off
        assert lower_cpu_priority(5, pid=proc.pid, idle=False)["threads"] == 0
        assert lower_cpu_priority(0, pid=proc.pid, idle=False) == {"nice": 0, "idle": False, "threads": 0}
        assert set(thread_nice(proc.pid).values()) == {17}
        assert set(thread_policy(proc.pid).values()) == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait()

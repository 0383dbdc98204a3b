"""DeepSpeed JIT op cache: one folder per environment, and stale build locks told from live ones."""
from __future__ import annotations

from spotfill.ray_compat.opcache import (STALE_UNOWNED_S, extensions_dir, owner_record, parse_owner, stale_reason)

HOST, BOOT = "node-a", "boot-1"


def test_each_environment_gets_its_own_cache_folder():
    a = extensions_dir("/c", "/venv-a/bin/python", "3.11.7", "2.13.0+cpu", "0.19.8")
    assert a == extensions_dir("/c", "/venv-a/bin/python", "3.11.7", "2.13.0+cpu", "0.19.8")
    others = {extensions_dir("/c", "/venv-b/bin/python", "3.11.7", "2.13.0+cpu", "0.19.8"),
              extensions_dir("/c", "/venv-a/bin/python", "3.11.7", "2.12.0+cpu", "0.19.8"),
              extensions_dir("/c", "/venv-a/bin/python", "3.11.7", "2.13.0+cpu", "0.18.0"),
              extensions_dir("/c", "/venv-a/bin/python", "3.12.1", "2.13.0+cpu", "0.19.8")}
    assert a not in others and len(others) == 4 and all(p.startswith("/c/spotfill-py3") for p in others | {a})


def test_owner_record_round_trips_and_garbage_is_no_owner():
    owner = parse_owner(owner_record(HOST, BOOT, 1234, 5.0))
    assert owner["pid"] == 1234 and owner["host"] == HOST
    assert parse_owner("") is None and parse_owner("not json") is None and parse_owner("[1]") is None


def test_a_lock_of_a_dead_owner_is_stale_at_once_a_live_ones_never():
    owner = parse_owner(owner_record(HOST, BOOT, 1234, 0.0))
    assert "dead" in stale_reason(owner, 0.5, HOST, BOOT, pid_alive=lambda pid: False)
    assert stale_reason(owner, 10 * STALE_UNOWNED_S, HOST, BOOT, pid_alive=lambda pid: True) is None
    assert "rebooted" in stale_reason(owner, 1.0, HOST, "boot-2", pid_alive=lambda pid: True)


def test_an_unowned_or_foreign_lock_is_stale_only_when_old():
    asked = []

    def alive(pid):
        asked.append(pid)
        return True

    assert stale_reason(None, 5.0, HOST, BOOT, alive) is None                 # a plain torch build, running
    assert "no owner" in stale_reason(None, STALE_UNOWNED_S + 1, HOST, BOOT, alive)
    foreign = parse_owner(owner_record("node-b", "boot-x", 99, 0.0))
    assert stale_reason(foreign, 60.0, HOST, BOOT, alive) is None
    assert asked == []                                                          # never probes a pid it cannot see

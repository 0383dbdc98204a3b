"""The sweep's state keeper is a head start of resumes, never the sweep: a keeper that dies as it starts (its
node lost -- a demo's keeper died with a spot node's hard loss and took the sweep driver with it) is started
again, and after its tries the sweep runs without one (trials resume from storage). Ray stand-ins, no cluster."""
from __future__ import annotations

import sys
import types

from spotfill.fillin import arbiter_handle, sweep_keeper


class _DiedError(Exception):
    pass


def _fake_ray(monkeypatch, outcomes: list[bool]):
    """A `ray` whose keepers answer (True) or die before answering (False), in order."""
    made, killed = [], []

    class _Actor:
        def __init__(self, ok):
            self.ok = ok
            self.stats = types.SimpleNamespace(remote=lambda: self)

    class _Remote:
        def options(self, **options):
            made.append(options["name"])
            return types.SimpleNamespace(remote=lambda *a: _Actor(outcomes[len(made) - 1]))

    def get(ref, timeout=None):
        if not ref.ok:
            raise _DiedError("The actor died because its node has died.")
        return {}

    fake = types.SimpleNamespace(remote=lambda cls: _Remote(), get=get,
                                 kill=lambda actor, no_restart=True: killed.append(actor))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(arbiter_handle, "head_node_strategy", lambda: None)
    return made, killed


def test_a_keeper_that_died_as_it_started_is_started_again(monkeypatch):
    made, killed = _fake_ray(monkeypatch, [False, True])
    actor, name = sweep_keeper.start_keeper("demo-sweep", 1 << 20)
    assert actor is not None and name == made[1] and len(made) == 2 and len(killed) == 1
    assert name.startswith(sweep_keeper.PREFIX + "demo-sweep:")


def test_without_a_keeper_after_its_tries_the_sweep_goes_on(monkeypatch, caplog):
    made, _ = _fake_ray(monkeypatch, [False, False])
    assert sweep_keeper.start_keeper("demo-sweep", 1 << 20) == (None, None)
    assert len(made) == sweep_keeper.START_TRIES
    assert "running without a state keeper" in caplog.text

"""Stand-ins for the worker loop's unit tests (test_worker_executor.py, test_worker_steps.py)."""
from __future__ import annotations

import copy

from spotfill.train.feed import LEDGER_KEY
from spotfill.train.sample_ledger import SampleLedger


class Checkpointer:
    """Commits every save at once. Each entry of `saves`: step, kind, the notice's deadline, the ledger
    saved, and `state`: the client_state as a restore would return it (with its step)."""

    def __init__(self):
        self.saves: list[dict] = []
        self.uploader = type("U", (), {"busy": False})()

    def save(self, engine, step, client_state, *, kind, deadline_unix_s=None):
        self.saves.append({"step": step, "kind": kind, "deadline": deadline_unix_s,
                           "ledger": SampleLedger.from_state(client_state[LEDGER_KEY]),
                           "state": {**copy.deepcopy(client_state), "step": step}})
        return {"tag": f"t{step}", "step": step, "kind": kind, "path": "/x", "reason": kind, "committed": True,
                "snapshot_s": 0.0, "blocked_s": 0.0, "wait_s": 0.0, "stall_s": 0.0}

    def pop_committed(self):
        return []

    def pop_skipped(self):
        return []

    def close(self, wait=True):
        pass

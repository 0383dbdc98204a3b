"""Fill work inside pipeline bubbles: small chunks of a fill-in tenant's queue, run by the training process
on the training GPU while its stage waits (train/bubble_probe.py calls `BubbleFiller.fill` at each point).

The first tenant is a batch job's evaluation units (fillin/batch.py, `training.bubble_fill: <its output>`):
the same plan, pinned model, parts and commit markers as its Ray Data workers, so a unit is exactly once
whoever runs it (a unit done twice is rewritten whole under the same name). Each training rank takes the
units whose index is its rank modulo the world size, and evaluates their rows a chunk at a time; a finished
unit is written and committed by a background thread, in order, off the step.

Training state does not change: the work runs on its own copy of the model, in inference mode (no autograd),
with the RNG states forked around it and around building that model (`torch.random.fork_rng`: the training's
CPU and device generators come back as they were), touches none of the engine's tensors and runs no
collective. A chunk is sized to the
bubble measured at its point in the last steps (train/bubble.py); what ran past that estimate is kept as
its overrun.
"""
from __future__ import annotations

import logging
import queue
from collections import deque
import threading
import time

from spotfill.fillin import batch_plan as bp
from spotfill.train.bubble import chunk_rows, overrun, percentile

log = logging.getLogger(__name__)
COST_WINDOW = 8      # the per-row cost estimate: the lower median of this many recent chunks
REPROBE_EVERY = 16   # points at which no row fits: every this many, one row runs to measure the cost again


class BubbleFiller:
    """Runs `work` in chunks inside a time budget; keeps what it did and how far it overran."""

    def __init__(self, work, sync=None, clock=time.perf_counter, max_rows: int = 64):
        self.work, self._sync, self._clock, self.max_rows = work, sync, clock, max_rows
        self.per_row_s: float | None = None
        self._costs: deque = deque(maxlen=COST_WINDOW)
        self._starved = 0
        self.fill_s, self.rows, self.chunks = 0.0, 0, 0
        self.overruns: list[float] = []

    def fill(self, budget_s: float, estimate_s: float) -> float:
        """Run chunks of work for at most about `budget_s` seconds; returns the seconds it took."""
        if budget_s <= 0 or not self.work.pending():
            return 0.0
        t0 = self._clock()
        first = True
        while True:
            n = chunk_rows(budget_s - (self._clock() - t0), self.per_row_s, self.max_rows)
            if n == 0 and first:
                # the cost estimate says not one row fits: now and then run one anyway, so an estimate
                # from a slow chunk (a first call, a pause) is measured again instead of kept for good
                self._starved += 1
                n = 1 if self._starved % REPROBE_EVERY == 0 else 0
            first = False
            if n == 0:
                break
            tc = self._clock()
            done = self.work.run(n)
            if self._sync is not None:
                self._sync()
            if done == 0:
                break
            # a median, so one slow chunk (a pause, a stopped process) does not stop the filling for good
            self._costs.append((self._clock() - tc) / done)
            self.per_row_s = sorted(self._costs)[(len(self._costs) - 1) // 2]
            self.rows += done
            self.chunks += 1
        used = self._clock() - t0
        self.fill_s += used
        self.overruns.append(overrun(used, estimate_s))
        return used

    def summary(self) -> dict:
        return {"fill_s": self.fill_s, "rows": self.rows, "chunks": self.chunks, "points": len(self.overruns),
                "overrun_s": {"p50": percentile(self.overruns, 50), "p99": percentile(self.overruns, 99)}}


def bubble_filler(output: str, rank: int, world: int, device=None, sync=None) -> BubbleFiller:
    """A training rank's filler for `training.bubble_fill: <output>`: the batch job's evaluation units there.
    Passed to TrainingJob(bubble_filler=...), which hands it to each worker (training sits below fill-in)."""
    return BubbleFiller(EvalUnitsWork(output, rank, world, device=device), sync=sync)


class EvalUnitsWork:
    """A batch job's evaluation units (its output holds the plan and the pinned model) as fill work."""

    def __init__(self, output: str, rank: int, world: int, device=None):
        import json

        import torch

        from spotfill.fillin.batch import committed, plan_model, units_of
        from spotfill.storage.base import open_storage
        from spotfill.train.data import ShardReader

        self.out = open_storage(output)
        self.plan = json.loads(self.out.get_bytes(bp.PLAN_KEY))
        units = [u for u in units_of(self.plan) if u.kind == "eval" and u.index % world == rank]
        done = committed(self.out, units)
        self.todo = [u for u in units if u.unit_id not in done]
        self._devices = [torch.device(device)] if device is not None and torch.device(device).type == "cuda" else []
        import os
        import tempfile
        self.reader = ShardReader(open_storage(self.plan["eval_data"]),
                                  os.path.join(tempfile.gettempdir(), "spotfill-batch-cache"))
        self.committed: list[str] = []
        self._unit, self._tokens, self._next = None, None, 0
        self._nll: list[float] = []
        self._count: list[int] = []
        self._writer: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        # building the model draws from the generators (its initialisation, before the pinned weights load)
        with torch.random.fork_rng(devices=self._devices):
            self.model = plan_model(self.out, self.plan).to(device or "cpu")
            self._warm_up()
        self._load_next()

    def _warm_up(self) -> None:
        """One forward on a row of zeros, outside any bubble: the first call's one-off costs (kernel
        selection, allocator growth) would otherwise be taken for the work's per-row cost."""
        import numpy as np

        from spotfill.fillin.batch import eval_rows
        eval_rows(self.model, np.zeros((1, int(self.reader.seq_len) + 1), dtype=np.int64))

    def _load_next(self) -> None:
        import numpy as np
        self._unit = self.todo.pop(0) if self.todo else None
        if self._unit is not None:
            self._tokens = self.reader.rows(np.arange(self._unit.start, self._unit.stop))
            self._next, self._nll, self._count = 0, [], []

    def pending(self) -> bool:
        return self._unit is not None

    def run(self, rows: int) -> int:
        """Evaluate up to `rows` rows of the current unit; returns how many."""
        import torch

        from spotfill.fillin.batch import eval_rows
        if self._unit is None:
            return 0
        rows = min(rows, len(self._tokens) - self._next)
        with torch.random.fork_rng(devices=self._devices), torch.inference_mode():
            nll, count = eval_rows(self.model, self._tokens[self._next:self._next + rows])
        self._nll += nll
        self._count += count
        self._next += rows
        if self._next == len(self._tokens):
            self._finish(self._unit, self._nll, self._count)
            self._load_next()
        return rows

    def _finish(self, unit: bp.Unit, nll: list[float], count: list[int]) -> None:
        """Queue the unit's part and commit for the writer thread (started on first use): never waits."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="spotfill-bubble-commit", daemon=True)
            self._writer.start()
        self._queue.put((unit, nll, count))

    def _write(self) -> None:
        from spotfill.fillin.batch import commit_unit, eval_table
        while True:
            item = self._queue.get()
            if item is None:
                return
            unit, nll, count = item
            try:
                commit_unit(self.out, unit, eval_table(unit, nll, count))
                self.committed.append(unit.unit_id)
            except Exception as exc:  # noqa: BLE001 -- the unit stays uncommitted: a later run redoes it
                log.warning("bubble fill: unit %s not committed (%s: %s)", unit.unit_id, type(exc).__name__, exc)

    def close(self) -> None:
        """Wait for the queued units to be written."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

"""How a worker group learns of a preemption notice from the moment it is placed, and leaves before its first
step when one comes while it starts or restores.

Ray Train hands a drain on any of the group's nodes to every worker through its PreemptionWatcher, an actor
it starts with each group: a new process, which on a busy node began answering 11 s after the group started
(a 15 s notice then reached training at its first step, too late to save; the steps since the restore were
lost). So rank 0 also reads the drains of its group's nodes itself (`DrainWatch`: the GCS's draining
nodes, as Ray's watcher reads them, every SPOTFILL_DRAIN_POLL_S, the first read before anything else), and
the group looks at the notice -- Ray's or its own -- at each boundary of its start (`StartNotice`: placed,
restored, engine built, and before the first step: StepPolicy.before_first_step) through one small
collective, so every rank sees every rank's notice and they leave together. The group's state is then
still the checkpoint it restored (the newest committed one): nothing was stepped, nothing is saved or lost;
the restart sizes the next group without the draining node. During the steps the same notice travels in the
step's flags (worker_loop).

The decisions here are pure (`drain_notice`, StartNotice.decide with the policy); the reader of the GCS is
handed in.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from spotfill.train.step_policy import StepFacts, StepPolicy

# the phase boundaries of a group's start where every rank looks at its notice (before the first step too)
PHASES = ("placed", "restored", "engine built", "loaded")


class PlannedExit(RuntimeError):
    """Raised by every rank after a committed checkpoint (or before any step) so Ray Train restarts the
    group at a new size."""


@dataclass(frozen=True)
class DrainNotice:
    """A drain of some of the group's nodes, read from the GCS (shaped as Ray Train's PreemptionInfo where
    the loop reads it: `deadline_ms`)."""
    deadline_ms: int | None
    nodes: tuple[str, ...]


def drain_notice(draining: dict[str, int], group_nodes) -> DrainNotice | None:
    """The notice for a group on `group_nodes` from the GCS's draining nodes (node id -> deadline ms, 0: none
    given): the earliest deadline among the group's nodes, None when none of them drains."""
    hit = {n: d for n, d in draining.items() if n in set(group_nodes)}
    if not hit:
        return None
    deadlines = [d for d in hit.values() if d]
    return DrainNotice(min(deadlines) if deadlines else None, tuple(sorted(hit)))


class DrainWatch:
    """Rank 0's own reader of its group's drains: `read()` returns the GCS's draining nodes (node -> deadline
    ms); polled every `poll_s` on a daemon thread, the first time before the constructor returns. A notice,
    once seen, stays (the node may be gone from the GCS's list once its deadline passed)."""

    def __init__(self, group_nodes, read, poll_s: float):
        self.nodes, self.read, self.poll_s = tuple(group_nodes), read, poll_s
        self.notice: DrainNotice | None = None
        self._stop = threading.Event()
        self._poll()
        self._thread = threading.Thread(target=self._run, name="spotfill-drain-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        if self.notice is not None:
            return
        try:
            self.notice = drain_notice(self.read(), self.nodes)
        except Exception:  # noqa: BLE001 -- a GCS hiccup: Ray Train's watcher still tells the workers
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s) and self.notice is None:
            self._poll()

    def close(self) -> None:
        self._stop.set()


def either(first, second):
    """A notice reader: `first()` (Ray Train's, per worker) or else `second` 's notice (None: no watch)."""
    return lambda: first() or (second.notice if second is not None else None)


class StartNotice:
    """One group's look at its notice during the start. `read_notice()` returns this worker's notice (a
    PreemptionInfo, a DrainNotice or None), `gather(obj)` every rank's value of `obj` (the collective)."""

    def __init__(self, policy: StepPolicy, read_notice, gather, rank: int, entered_t: float):
        self.policy, self.read_notice, self.gather = policy, read_notice, gather
        self.rank, self.entered_t = rank, entered_t

    def decide(self, phase: str, done: int):
        """Every rank's notice (one collective) -> the policy's decision (None: start on)."""
        notice = self.read_notice()
        mine = (notice is not None, getattr(notice, "deadline_ms", None) if notice is not None else None)
        rows = self.gather(mine)
        deadlines = [d / 1000.0 for held, d in rows if held and d]
        return self.policy.before_first_step(
            StepFacts(done=done, now=time.time(), preempt_votes=sum(1 for held, _ in rows if held),
                      deadline_unix_s=min(deadlines) if deadlines else None), phase=phase)

    def check(self, phase: str, done: int, sink, on_leave=None) -> None:
        """Leave now (every rank raises PlannedExit) when any rank holds a notice; rank 0 first records the
        planned exit with the phase it came in and how long after the training function started."""
        d = self.decide(phase, done)
        if d is None:
            return
        if on_leave is not None:
            on_leave()
        if self.rank == 0:
            import ray
            ray.get(sink.planned_exit.remote(d.reason, step=done, detail=d.detail,
                                             phase=phase, before_first_step=True,
                                             notice_deadline_unix_s=d.notice_deadline_unix_s,
                                             since_start_s=round(time.time() - self.entered_t, 3)))
        raise PlannedExit(f"{d.reason} at step {done} ({d.detail}); restarting the worker group")

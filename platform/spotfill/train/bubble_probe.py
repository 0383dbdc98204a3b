"""Times every instruction a pipeline stage runs, and runs fill work at its bubble points.

The probe gives one PipelineEngine instance its own instruction map (spotfill.ray_compat.pipe_instruction_map)
whose functions wrap DeepSpeed's: each records its start and end; before each send or receive, and after
the optimizer step, a *fill point* asks the filler (if any) to run work for the bubble measured there in
the last steps (bubble.py). DeepSpeed's own functions run unchanged, in the schedule's order, with the
same arguments: the fill work is the only thing added, and it touches none of the engine's state.

Bubble lengths are measured on *calibration steps*, where no rank fills: the first CALIBRATION_STEPS steps
and every REMEASURE_EVERY-th after (every rank counts the same steps, so all calibrate together). A wait
measured while the peers fill would hold their fill work too -- gloo's send waits for the receiver -- and
each stage would size its next fill on the other's, growing without end (the first bench run slowed
training 2.5x that way).

On a GPU the host runs ahead of the device: a fill point first waits for the device (`sync`), and so does
the end of each send or receive, so host clocks time what the device did. On a CPU `sync` is None.
"""
from __future__ import annotations

import time

from spotfill.train.bubble import END, P2P, BubbleEstimates, Instr, Point, StageStep, account, fill_budget

CALIBRATION_STEPS = 3
REMEASURE_EVERY = 10


def calibrating(step: int) -> bool:
    """Whether the `step`-th step (0-based) of this engine measures bubbles without filling them."""
    return step < CALIBRATION_STEPS or step % REMEASURE_EVERY == 0


class BubbleProbe:
    def __init__(self, engine, filler=None, sync=None, clock=time.perf_counter):
        from spotfill.ray_compat import pipe_instruction_map

        self.filler, self._sync, self._clock = filler, sync, clock
        self.estimates = BubbleEstimates()
        self.last: StageStep | None = None
        self._instrs: list[Instr] = []
        self._points: list[Point] = []
        self._open: tuple | None = None     # (index, before, fill_s, end of the fill)
        self._next = 0
        self.steps = 0                       # steps run under the probe
        self.calibrating = True
        table = pipe_instruction_map(engine)
        for cls, fn in list(table.items()):
            table[cls] = self._wrap(cls.__name__, fn)

    def _wrap(self, kind: str, fn):
        probe, clock = self, self._clock

        def timed(engine, **kwargs):
            if kind in P2P:
                probe._point(kind)
            start = clock()
            fn(engine, **kwargs)
            if kind in P2P and probe._sync is not None:
                probe._sync()
            end = clock()
            probe._instrs.append(Instr(kind, start, end))
            if kind in P2P:
                probe._close(end - start)
            elif kind == "OptimizerStep":
                probe._point(END)

        timed.__wrapped__ = fn
        return timed

    def _point(self, before: str) -> None:
        if self._sync is not None:
            self._sync()
        index, self._next = self._next, self._next + 1
        fill_s = 0.0
        if self.filler is not None and not self.calibrating:
            estimate = self.estimates.estimate(index)
            budget = fill_budget(estimate)
            if budget > 0:
                fill_s = self.filler.fill(budget, estimate)
        self._open = (index, before, fill_s, self._clock())

    def _close(self, wait_s: float) -> None:
        index, before, fill_s, _ = self._open
        self._points.append(Point(index, before, fill_s, max(0.0, wait_s)))
        self._open = None

    def step(self, run):
        """Run one step (`run()` calls engine.train_batch) under the probe; returns what `run` returned.
        The step's accounting is in `self.last`."""
        self._instrs, self._points, self._open, self._next = [], [], None, 0
        self.calibrating = calibrating(self.steps)
        self.steps += 1
        t0 = self._clock()
        out = run()
        if self._sync is not None:
            self._sync()
        t1 = self._clock()
        if self._open is not None:              # the end point: the wait for the step's loss
            self._close(t1 - self._open[3])
        self.last = account(self._instrs, self._points, t0, t1)
        if self.calibrating:
            self.estimates.add(self.last.points)
        return out

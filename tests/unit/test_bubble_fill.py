"""The bubble probe and the fill executor on a fake clock: where fill points are, what a step's bubble is,
that fill work is sized to the measured bubble, and what overran (train/bubble_probe.py,
fillin/bubble_fill.py). DeepSpeed's own TrainSchedule gives the instructions; a fake engine runs them."""
from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule

from spotfill.fillin.bubble_fill import BubbleFiller
from spotfill.train.bubble_probe import BubbleProbe


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


COST = {"ForwardPass": 1.0, "BackwardPass": 2.0, "OptimizerStep": 0.5}


class FakeEngine:
    """Runs a TrainSchedule like PipelineEngine._exec_schedule: each instruction advances the clock by its
    cost, a receive by the wait the test scripts for it."""

    def __init__(self, clock: Clock, waits: dict):
        self.clock, self.waits, self.ran = clock, waits, []

        def make(kind):
            def fn(engine, **kwargs):
                engine.ran.append(kind)
                engine.clock.t += COST.get(kind, 0.0) + engine.waits.get(kind, 0.0)
                if kind == "OptimizerStep":
                    engine.opt_done = engine.clock.t
            return fn
        self._INSTRUCTION_MAP = {cls: make(cls.__name__) for cls in (
            schedule.OptimizerStep, schedule.ReduceGrads, schedule.ReduceTiedGrads, schedule.LoadMicroBatch,
            schedule.ForwardPass, schedule.BackwardPass, schedule.SendActivation, schedule.RecvActivation,
            schedule.SendGrad, schedule.RecvGrad)}
        FakeEngine._INSTRUCTION_MAP = dict(self._INSTRUCTION_MAP)

    def _exec_schedule(self, pipe_schedule):
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

    def train_batch(self, stage: int):
        self._exec_schedule(schedule.TrainSchedule(micro_batches=4, stages=2, stage_id=stage))
        # the step's loss arrives waits["End"] after the optimizer step, whatever ran in between
        self.clock.t = max(self.clock.t, self.opt_done + self.waits.get("End", 0.0))
        return 1.0


class FakeWork:
    """Fill work costing `per_row` seconds a row on the fake clock."""

    def __init__(self, clock: Clock, per_row: float, rows: int = 10 ** 6):
        self.clock, self.per_row, self.left, self.done = clock, per_row, rows, 0

    def pending(self) -> bool:
        return self.left > 0

    def run(self, rows: int) -> int:
        rows = min(rows, self.left)
        self.clock.t += rows * self.per_row
        self.left -= rows
        self.done += rows
        return rows


def test_a_stage_step_is_busy_plus_bubble_and_the_probe_changes_nothing_it_runs():
    clock = Clock()
    engine = FakeEngine(clock, {"RecvActivation": 0.25, "End": 3.0})
    probe = BubbleProbe(engine, clock=clock)
    probe.step(lambda: engine.train_batch(stage=1))
    s = probe.last
    assert s.busy_s == pytest.approx(4 * 1.0 + 4 * 2.0 + 0.5)
    assert s.bubble_s == pytest.approx(4 * 0.25 + 3.0) and s.fill_s == 0.0
    assert s.wall_s == pytest.approx(s.busy_s + s.bubble_s)
    # stage 1 of S=2: a receive of each activation and a send of each gradient, then the end point
    assert [p.before for p in s.points] == ["RecvActivation", "SendGrad"] * 4 + ["End"]
    assert s.points[-1].wait_s == pytest.approx(3.0)
    # the probe's map runs DeepSpeed's functions in the schedule's order, each once
    plain = FakeEngine(Clock(), {})
    plain.train_batch(stage=1)
    assert engine.ran == plain.ran and type(engine)._INSTRUCTION_MAP != engine._INSTRUCTION_MAP


def test_fill_work_is_sized_to_the_measured_bubble_and_keeps_the_step_time():
    """The last stage's end point waits 3 s for the step's loss (it arrives 3 s after its optimizer step,
    filled or not). Measured over 3 steps, it is then filled with at most 85% of it: the step takes no
    longer, the wait shrinks by what was filled, and the bubble (fill + wait) stays 3 s."""
    clock = Clock()
    engine = FakeEngine(clock, {"End": 3.0})
    work = FakeWork(clock, per_row=0.1)
    filler = BubbleFiller(work, clock=clock)
    probe = BubbleProbe(engine, filler=filler, clock=clock)
    walls, ends = [], []
    for _ in range(6):
        t0 = clock.t
        probe.step(lambda: engine.train_batch(stage=1))
        walls.append(clock.t - t0)
        ends.append(probe.last.points[-1])
    assert [e.fill_s > 0 for e in ends] == [False] * 3 + [True] * 3
    for e in ends[3:]:
        assert 2.0 <= e.fill_s <= 0.85 * 3.0 + 1e-9 and e.bubble_s == pytest.approx(3.0)
    assert work.done == filler.rows > 0 and max(filler.overruns) == 0.0       # never past the estimate
    assert all(w == pytest.approx(walls[0]) for w in walls)


def test_an_overrun_is_what_ran_past_the_estimate():
    clock = Clock()
    work = FakeWork(clock, per_row=0.4)
    filler = BubbleFiller(work, clock=clock)
    assert filler.fill(0.5, 0.6) == pytest.approx(0.4)          # unknown cost: one row, then none fits
    filler.per_row_s = 0.1                                        # the work got 4x slower than measured
    assert filler.fill(0.5, 0.6) == pytest.approx(1.6) and filler.overruns[-1] == pytest.approx(1.0)
    assert filler.summary()["overrun_s"]["p50"] == pytest.approx(0.5)


def test_nothing_runs_without_a_budget_or_without_work():
    clock = Clock()
    filler = BubbleFiller(FakeWork(clock, 0.1, rows=0), clock=clock)
    assert filler.fill(1.0, 1.0) == 0.0 and filler.overruns == []
    filler = BubbleFiller(FakeWork(clock, 0.1), clock=clock)
    assert filler.fill(0.0, 1.0) == 0.0 and filler.rows == 0


def test_bubbles_are_measured_on_steps_nobody_fills_so_fill_cannot_feed_on_itself():
    """With gloo a send waits for the receiver: a stage's wait can hold its peer's fill work. Here the end
    point waits 3 s plus whatever was filled there (the peer filled as much): measured on filled steps, the
    estimate would grow with every step. Measured only on calibration steps (the first 3, then every 10th,
    when no rank fills) it stays 3 s, and so does every fill."""
    from spotfill.train.bubble_probe import calibrating
    clock = Clock()
    waits = {"End": 3.0}
    engine = FakeEngine(clock, waits)
    filler = BubbleFiller(FakeWork(clock, per_row=0.1), clock=clock)
    probe = BubbleProbe(engine, filler=filler, clock=clock)
    fills = []
    for step in range(25):
        probe.step(lambda: engine.train_batch(stage=1))
        end = probe.last.points[-1]
        fills.append(end.fill_s)
        waits["End"] = 3.0 + end.fill_s           # the peer's fill shows up in the next wait
    assert [f == 0 for f in fills] == [calibrating(s) for s in range(25)]
    assert probe.estimates.estimate(probe.last.points[-1].index) == pytest.approx(3.0)
    assert 0 < max(fills) <= 0.85 * 3.0 + 1e-9


def test_one_slow_chunk_does_not_stop_the_filling():
    """A chunk that took 1000x its cost (the process was paused in it) must not make every later budget look
    too small for a single row."""
    clock = Clock()
    work = FakeWork(clock, per_row=0.01)
    filler = BubbleFiller(work, clock=clock)
    for _ in range(3):
        filler.fill(0.5, 0.6)
    work.per_row = 10.0                     # paused mid-chunk once
    filler.fill(0.5, 0.6)
    work.per_row = 0.01
    before = work.done
    filler.fill(0.5, 0.6)
    assert work.done - before >= 40


def test_a_cost_estimate_no_row_fits_is_measured_again():
    """The first chunk was slow (a one-off); after it no row fits any budget by the estimate -- every
    REPROBE_EVERY-th such point runs one row anyway, finds the real cost and filling resumes."""
    from spotfill.fillin.bubble_fill import REPROBE_EVERY
    clock = Clock()
    work = FakeWork(clock, per_row=1.0)
    filler = BubbleFiller(work, clock=clock)
    filler.fill(0.5, 0.6)                       # the slow first chunk: 1 row, 1 s
    work.per_row = 0.01
    for _ in range(REPROBE_EVERY + 2):
        filler.fill(0.5, 0.6)
    assert work.done > 40

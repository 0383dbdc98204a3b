"""Pipeline bubbles: the theory, one stage's step accounting, bubble-length estimates and fill-chunk sizing
(pure: no torch).

A 1F1B schedule (DeepSpeed's TrainSchedule) gives each stage M forward and M backward passes in a step of
M + S - 1 slots: (S - 1) / (M + S - 1) of the step is bubble when the stages cost the same -- 20% at S=2,
M=4. bubble_probe.py times every instruction a stage runs. A stage's step splits into
  busy    its compute instructions: loading a micro-batch, forward, backward, the gradient reductions and
          the optimizer step;
  bubble  everything else inside the step: blocked in a pipeline send or receive (gloo's send waits for
          the receiver too), the idle time between instructions, and the wait for the step's loss from the
          last stage -- fill work run inside the bubble counts here, as bubble time put to use.
A *fill point* is where a stage is about to block: before each send or receive, and after its optimizer
step (the last stage then waits for the first one's last backward). The bubble at a point is the fill
work run there plus the wait that followed it; its recent median is the budget of the next fill there.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

COMPUTE = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
P2P = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
END = "End"        # the fill point after the optimizer step


def theory_fraction(stages: int, micro_batches: int) -> float:
    """(S - 1) / (M + S - 1): the share of a step each stage idles in a 1F1B schedule of equal stages."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages {stages} and micro_batches {micro_batches} must be >= 1")
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass(frozen=True)
class Instr:
    """One instruction a stage ran: its type name and host-clock start and end (seconds)."""
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class Point:
    """One fill point of a step: its index in the step, the instruction it precedes, the fill work run
    there and the wait that followed (seconds)."""
    index: int
    before: str
    fill_s: float
    wait_s: float

    @property
    def bubble_s(self) -> float:
        return self.fill_s + self.wait_s


@dataclass(frozen=True)
class StageStep:
    wall_s: float
    busy_s: float
    bubble_s: float
    fill_s: float
    forward_backward_s: float
    optimizer_s: float
    points: tuple[Point, ...] = ()

    @property
    def fraction(self) -> float:
        return self.bubble_s / self.wall_s if self.wall_s > 0 else 0.0


def account(instrs: list[Instr], points: list[Point], t0: float, t1: float) -> StageStep:
    """One stage's step from its instructions, between the step's start `t0` and end `t1`."""
    busy = sum(i.end - i.start for i in instrs if i.kind in COMPUTE)
    fb = sum(i.end - i.start for i in instrs if i.kind in ("LoadMicroBatch", "ForwardPass", "BackwardPass"))
    wall = max(0.0, t1 - t0)
    fill = sum(p.fill_s for p in points)
    return StageStep(wall_s=wall, busy_s=busy, bubble_s=max(0.0, wall - busy), fill_s=fill,
                     forward_backward_s=fb, optimizer_s=max(0.0, busy - fb), points=tuple(points))


@dataclass
class BubbleEstimates:
    """The recent bubble length at each fill point: the median of its last `window` steps."""
    window: int = 5
    _seen: dict = field(default_factory=dict)

    def add(self, points) -> None:
        for p in points:
            self._seen.setdefault(p.index, deque(maxlen=self.window)).append(p.bubble_s)

    def estimate(self, index: int) -> float | None:
        seen = self._seen.get(index)
        if not seen or len(seen) < min(3, self.window):
            return None
        return sorted(seen)[len(seen) // 2]


def fill_budget(estimate_s: float | None, margin: float = 0.15, min_bubble_s: float = 0.002) -> float:
    """Seconds of fill work to run at a point whose bubble is estimated `estimate_s`: the estimate less a
    safety margin (a fraction of it), none below `min_bubble_s` or without an estimate."""
    if estimate_s is None or estimate_s < min_bubble_s:
        return 0.0
    return max(0.0, estimate_s * (1.0 - margin))


def chunk_rows(budget_s: float, per_row_s: float | None, max_rows: int) -> int:
    """Rows of fill work that fit `budget_s` at `per_row_s` each (one row to measure an unknown cost; none
    when even one does not fit)."""
    if max_rows < 1 or budget_s <= 0:
        return 0
    if per_row_s is None or per_row_s <= 0:
        return 1
    return max(0, min(max_rows, int(budget_s // per_row_s)))


def overrun(fill_s: float, estimate_s: float) -> float:
    """How far fill work ran past the bubble it was sized for (0 when it fit)."""
    return max(0.0, fill_s - estimate_s)


def percentile(xs, q: float) -> float | None:
    """The q-th percentile (0..100) of `xs` by linear interpolation; None when empty."""
    v = sorted(float(x) for x in xs)
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def per_stage(values: list[float], stages: int) -> list[float]:
    """Per stage, the mean over replicas of one value per rank (rank = replica x stages + stage)."""
    if stages < 1 or len(values) % stages:
        raise ValueError(f"{len(values)} ranks are not whole replicas of {stages} stages")
    replicas = len(values) // stages
    return [sum(values[r * stages + s] for r in range(replicas)) / replicas for s in range(stages)]

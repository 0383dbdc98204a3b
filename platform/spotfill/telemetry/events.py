"""The run's event log: CONTRACTS' events.jsonl, one JSON object per line with `t` and `kind`.

`EventLog` writes lines to a local file. In a Ray job the workers reach it through the `EventSink` actor
(train/sink.py), which runs on the driver's node and owns the file; `read_events` reads it back.

The log is bounded two ways (docs/report.md, "The event log"):
- rolling: past `roll_bytes` the live file `events.jsonl` is renamed `events-000001.jsonl` (then -000002,
  ...) and a new `events.jsonl` begins. The set, oldest first, is `log_files(path)`; every reader here
  (read_events, EventTail, telemetry.report.load_events) reads the whole set in order, streaming.
- step sampling (`StepSampler`): the first `keep` step events of a run are written as they come; after
  that one step line stands for many. A kept line carries `span` -- the steps it stands for (`steps`,
  `from_step`, `first_t`) and the exact sums of their additive fields (tokens, step_s, data_wait_s, ...)
  -- folded by the writer from every step it received, so totals stay exact. `step_totals(e)` reads a
  step event either way. Spans never cross another event (any other event first writes the pending
  steps), so a span never straddles a checkpoint: a restart rolls a span back whole or not at all.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

# step fields that add up over steps (a span carries their sums)
ADDITIVE = ("tokens", "step_s", "data_wait_s", "compute_s", "forward_backward_s", "optimizer_s",
            "collective_wait_s", "bubble_s")
LOSS_SPIKE = 1.5        # a step whose loss exceeds this many times the running mean is kept as it is


# ---- the set of files -------------------------------------------------------------------------------

def rolled_path(path: str, n: int) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}-{n:06d}{ext}"


def rolled_files(path: str) -> list[str]:
    """The rolled segments of `path` (events-000001.jsonl, ...), oldest first."""
    folder = os.path.dirname(os.path.abspath(path))
    stem, ext = os.path.splitext(os.path.basename(path))
    pat = re.compile(rf"^{re.escape(stem)}-(\d{{6}}){re.escape(ext)}$")
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = sorted((int(m.group(1)), name) for name in names if (m := pat.match(name)))
    return [os.path.join(folder, name) for _, name in found]


def log_files(path: str) -> list[str]:
    """Every file of the log, oldest first: the rolled segments, then the live file (when it exists)."""
    return rolled_files(path) + ([path] if os.path.exists(path) else [])


def log_size(path: str) -> int:
    """Bytes in the whole set: where an appending writer's next event will begin (EventTail offsets)."""
    return sum(os.path.getsize(p) for p in log_files(path))


def remove_log(path: str) -> None:
    """Delete the live file and its rolled segments."""
    for p in log_files(path):
        os.unlink(p)


# ---- step sampling ------------------------------------------------------------------------------------

def step_span(e: dict) -> dict:
    """The steps a step event stands for: its `span`, or the event alone."""
    if e.get("span"):
        return e["span"]
    out = {"steps": 1, "from_step": e.get("step"), "first_t": e.get("t")}
    out.update({k: e[k] for k in ADDITIVE if e.get(k) is not None})
    return out


def step_totals(e: dict, key: str, default: float | None = 0.0):
    """The sum of `key` over the steps a step event stands for (`default` when none measured it)."""
    v = step_span(e).get(key)
    return default if v is None else v


def step_count(e: dict) -> int:
    return int(step_span(e).get("steps", 1))


def first_step(e: dict) -> int:
    """The first step number a step event stands for."""
    s = step_span(e).get("from_step")
    return int(e["step"] if s is None else s)


def _merge(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    out = {"steps": a["steps"] + b["steps"], "from_step": a["from_step"], "first_t": a["first_t"]}
    for k in ADDITIVE:
        if k in a or k in b:
            out[k] = a.get(k, 0.0) + b.get(k, 0.0)
    return out


class StepSampler:
    """Decides which step events are written; `feed(event)` returns the lines to write now, in order.

    The first `keep` steps are written as they come. After that a step is written (carrying the `span` of
    the steps folded into it since the last written line) when it is notable -- the first step after any
    other event (a group's first step, the step after a checkpoint), every `every`-th step number, a loss
    that is not finite or above LOSS_SPIKE x the running mean. The held steps are written as one line
    (the last of them, with the span) before a step that would leave more than `flush_s` of event time
    since the last line written, and before any other event: a group's last step and the step before
    every save are always on record."""

    def __init__(self, keep: int, every: int, flush_s: float):
        self.keep, self.every, self.flush_s = keep, max(1, every), flush_s
        self.seen = 0
        self._held: dict | None = None          # the newest step held back
        self._span: dict | None = None
        self._after_other = True
        self._mean_loss: float | None = None
        self._last_t: float | None = None       # the last line written

    @classmethod
    def from_env(cls) -> "StepSampler":
        from spotfill.config import constants
        return cls(constants.EVENTS_STEPS_KEEP, constants.EVENTS_STEP_EVERY, constants.EVENTS_STEP_FLUSH_S)

    def feed(self, e: dict) -> list[dict]:
        if e.get("kind") != "step":
            out = self.flush()
            self._after_other = True
            return self._wrote(out + [e])
        span = step_span(e)
        self.seen += span["steps"]
        spike = self._spike(e.get("loss"))
        after_other, self._after_other = self._after_other, False
        if self.seen <= self.keep and self._held is None:
            return self._wrote([e])
        if after_other or spike or int(e.get("step", 0)) % self.every == 0:
            merged = _merge(self._span, span)
            self._held, self._span = None, None
            return self._wrote([self._with_span(e, merged)])
        out = []
        if self._held is not None and self._last_t is not None and e.get("t", 0.0) - self._last_t > self.flush_s:
            out = self.flush()
        self._held, self._span = e, _merge(self._span, span)
        return self._wrote(out)

    def _wrote(self, out: list[dict]) -> list[dict]:
        if out:
            self._last_t = out[-1].get("t", self._last_t)
        return out

    def flush(self) -> list[dict]:
        """The held steps as one line (none held: nothing)."""
        if self._held is None:
            return []
        e, span = self._held, self._span
        self._held, self._span = None, None
        return self._wrote([self._with_span(e, span)])

    @staticmethod
    def _with_span(e: dict, span: dict) -> dict:
        if span["steps"] == 1 and not e.get("span"):
            return e
        return {**e, "span": span}

    def _spike(self, loss) -> bool:
        if not isinstance(loss, (int, float)):
            return False
        if not math.isfinite(loss):
            return True
        mean = self._mean_loss
        self._mean_loss = loss if mean is None else 0.9 * mean + 0.1 * loss
        return mean is not None and mean > 0 and loss > LOSS_SPIKE * mean


# ---- writing ------------------------------------------------------------------------------------------

class EventLog:
    """Append-only JSONL writer; thread-safe; flushes every line so a crash loses nothing written (steps
    the sampler holds back are written at the next other event, at a notable step, or at close).
    `on_event(event)`, when given, sees every event -- sampled-out steps included -- after it is taken
    (e.g. telemetry.prometheus.record). `roll_mb` / `sampler` default to the SPOTFILL_EVENTS_* settings;
    `sampler=False` writes every step."""

    def __init__(self, path: str, on_event: Callable[[dict], None] | None = None,
                 roll_mb: float | None = None, sampler: StepSampler | bool | None = None):
        from spotfill.config import constants

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.roll_bytes = int((roll_mb if roll_mb is not None else constants.EVENTS_ROLL_MB) * 2 ** 20)
        self.sampler = StepSampler.from_env() if sampler is None or sampler is True else (sampler or None)
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)
        self._size = os.path.getsize(path)
        self._on_event = on_event
        self.written = {"events": 0, "lines": 0, "bytes": 0, "steps": 0}   # what came in, what went out

    def write(self, kind: str, t: float | None = None, **fields: Any) -> dict:
        event = {"t": time.time() if t is None else t, "kind": kind, **fields}
        self.write_many([event])
        return event

    def write_many(self, events: list[dict]) -> None:
        with self._lock:
            for e in events:
                self.written["events"] += 1
                if e.get("kind") == "step":
                    self.written["steps"] += step_count(e)
                for out in (self.sampler.feed(e) if self.sampler else [e]):
                    self._line(out)
        self._notify(events)

    def _line(self, e: dict) -> None:
        line = json.dumps(e, separators=(",", ":"), default=_jsonable) + "\n"
        n = len(line.encode("utf-8"))
        if self._size and self._size + n > self.roll_bytes:
            self._roll()
        self._f.write(line)
        self._size += n
        self.written["lines"] += 1
        self.written["bytes"] += n

    def _roll(self) -> None:
        """The live file becomes the next rolled segment; a new live file begins."""
        self._f.close()
        done = rolled_files(self.path)
        last = int(os.path.basename(done[-1]).rsplit("-", 1)[1].split(".")[0]) if done else 0
        os.rename(self.path, rolled_path(self.path, last + 1))
        self._f = open(self.path, "a", buffering=1)
        self._size = 0

    def _notify(self, events: list[dict]) -> None:
        if self._on_event is None:
            return
        for e in events:
            if e.get("kind") != "samples":   # per-rank sample ids: no metric needs them
                try:
                    self._on_event(e)
                except Exception as exc:  # an observer never breaks the log
                    log.warning("event observer failed on a %s event: %s", e.get("kind"), exc)

    def flush(self) -> None:
        """Write the steps the sampler holds back."""
        with self._lock:
            for out in (self.sampler.flush() if self.sampler else []):
                self._line(out)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._f.close()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


# ---- reading ------------------------------------------------------------------------------------------

class EventTail:
    """Reads the events appended to a log since the last poll, from byte `offset` of the whole set
    (`log_size(path)` when a run began: a run dir may hold older events). Rolled segments never change, so
    a position stays valid when the live file rolls. A line still being written waits for the next poll;
    a line that is not JSON is skipped, as read_events skips a torn last line."""

    def __init__(self, path: str, offset: int = 0):
        self.path, self.offset = path, offset

    def poll(self) -> list[dict]:
        chunks = []
        while True:
            rolled = rolled_files(self.path)
            sizes = [os.path.getsize(p) for p in rolled]
            try:
                live = open(self.path, "rb")
            except FileNotFoundError:
                live = None
            if rolled_files(self.path) == rolled:     # no roll between the listing and the open
                break
            if live is not None:
                live.close()
        try:
            base = 0
            for p, size in zip(rolled, sizes):
                if self.offset < base + size:
                    with open(p, "rb") as f:
                        f.seek(self.offset - base)
                        chunks.append(f.read())
                    self.offset = base + size
                base += size
            if live is not None and self.offset >= base:
                live.seek(self.offset - base)
                data = live.read()
                end = data.rfind(b"\n") + 1
                chunks.append(data[:end])
                self.offset += end
        finally:
            if live is not None:
                live.close()
        out = []
        for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def read_lines(path: str) -> Iterator[tuple[str, int, str]]:
    """(file, line number, line) over the whole set, oldest first, one line in memory at a time."""
    for p in log_files(path):
        with open(p, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                yield p, i, line


def read_events(path: str, kinds: set[str] | None = None, compact: bool = False) -> Iterator[dict]:
    """Every event of the log (all its files, in order), streaming. A line that is not JSON (a torn last
    line after a crash) is skipped. `compact`: step events are folded as the writer's StepSampler folds
    them (exact totals, bounded memory for a log written without sampling)."""
    sampler = StepSampler.from_env() if compact else None

    def chosen(e: dict) -> Iterator[dict]:
        for x in (sampler.feed(e) if sampler else [e]):
            if kinds is None or x.get("kind") in kinds:
                yield x

    for _, _, line in read_lines(path):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            yield from chosen(event)
    for x in (sampler.flush() if sampler else []):
        if kinds is None or x.get("kind") in kinds:
            yield x

"""The live view of a running job on the user's terminal (`spotfill demo`, jobs/pretrain.py).

On a TTY (and with `rich` installed) one panel redraws in place: step and progress bar, loss, tokens/s,
MFU/HFU (or why not), world size, GPUs by state, the step's split, checkpoints, the last events. Anywhere
else (CI, `ray job submit` logs, a pipe) it prints one plain line per notable event and a step line every
few seconds (progress.Progress decides which). Ray's own output is not routed here: the callers start Ray
with log_to_driver=False, so worker and raylet noise stays in Ray's log files; and while the panel is up,
whatever else this process or its children write to stdout/stderr (a local Ray cluster's processes started
here, library warnings) goes to `console_log` instead of through the panel.

    with LiveView(sys.stderr) as view:          # tty detected from the stream
        view.feed(new_events); view.note("the demo drained node 1")
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from spotfill.telemetry.events import EventTail
from spotfill.telemetry.progress import Progress, _clock, _fmt

PREFIX = "[spotfill]"
CAPACITY_EVERY_S = 5.0


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def plain_line(t: float | None, line: str) -> str:
    return f"{PREFIX} {_clock(t)} {line}"


def render(p: Progress, capacity: float | None = None):
    """The panel (a rich renderable) for a Progress."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    target = p.steps_target or 0
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(1, target), completed=min(p.step, target or p.step), width=32),
                Text(f"{p.step}/{target or '?'}" + (f"  {p.step / target:.0%}" if target else "")))
    grid.add_row("step", bar)
    grid.add_row("loss", _fmt(p.loss, ".4f"))
    grid.add_row("tokens/s", _fmt(p.tokens_per_s, ",.0f"))
    if p.mfu is not None:
        util = f"MFU {p.mfu:.1%}  HFU {_fmt(p.hfu, '.1%')}"
    else:
        util = "n/a (" + ("no known GPU peak" if p.device not in (None, "cpu") else "CPU") + ")"
    if p.gpu.get("gpu_util") is not None:
        util += f"   NVML util {p.gpu['gpu_util']:.0%}, memory {p.gpu.get('gpu_mem_used_gb', 0):.1f} GB"
    grid.add_row("MFU / HFU", util)
    grid.add_row("world size", f"{p.world_size} worker(s), attempt {p.attempt}, {p.restarts} restart(s)")
    g = p.gpus(capacity)
    parts = [f"training {g.get('training', 0):g}", f"recovering {g.get('recovering', 0):g}"]
    parts += [f"fill-in {w} {n:g}" for w, n in sorted((g.get("fillin") or {}).items())]
    if "idle" in g:
        parts.append(f"idle {g['idle']:g}")
    grid.add_row("GPUs", "  ".join(parts))
    shares = p.split_shares()
    if shares:
        grid.add_row("step split", "  ".join(f"{k} {v:.0%}" for k, v in shares.items())
                     + f"   ({p.split.get('step_s', 0) * 1e3:.1f} ms/step)")
    grid.add_row("checkpoints", f"{p.checkpoints} committed, last at step {p.last_checkpoint_step}, "
                                f"last stall {_fmt(p.last_stall_s, '.3f')}s")
    events = Text()
    for i, (t, line) in enumerate(list(p.events)):
        events.append(("\n" if i else "") + f"{_clock(t)} ", style="dim")
        events.append(line)
    title = f"spotfill · {p.job} · {p.state}"
    return Panel(Group(grid, Text("last events", style="bold cyan"), events), title=title, title_align="left")


class LiveView:
    """Feeds events into a Progress and shows it: a rich panel on a TTY, plain lines elsewhere."""

    def __init__(self, stream=None, tty: bool | None = None, capacity: Callable[[], float | None] | None = None,
                 steps_target: int | None = None, job: str | None = None, console_log: str | None = None):
        self.stream = stream or sys.stderr
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.tty = (is_tty if tty is None else tty) and rich_available()
        self.progress = Progress(steps_target=steps_target, job=job or "spotfill")
        self.console_log = console_log
        self._saved_fds: list[tuple[int, int]] = []
        self.capacity_fn, self._capacity, self._capacity_t = capacity, None, 0.0
        self._live = None
        self._lock = threading.Lock()

    def capacity(self) -> float | None:
        if self.capacity_fn is not None and time.monotonic() - self._capacity_t >= CAPACITY_EVERY_S:
            self._capacity_t = time.monotonic()
            try:
                self._capacity = self.capacity_fn()
            except Exception:  # the cluster is going away: keep the last known figure
                pass
        return self._capacity

    def __enter__(self) -> "LiveView":
        if self.tty:
            from rich.console import Console
            from rich.live import Live
            console = Console(file=self._terminal(), force_terminal=True)
            self._live = Live(render(self.progress), console=console, refresh_per_second=4,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def _terminal(self):
        """The stream the panel draws on. With a console_log and a real terminal: a duplicate of the
        terminal's descriptor, and stdout/stderr (descriptors 1 and 2, inherited by child processes)
        pointed at the log until the view closes, so nothing else scribbles over the panel."""
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return self.stream
        if not self.console_log:
            return self.stream
        os.makedirs(os.path.dirname(os.path.abspath(self.console_log)), exist_ok=True)
        terminal = os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(self.stream, "encoding", None))
        log_fd = os.open(self.console_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for std in (sys.stdout, sys.stderr):
            try:
                std.flush()
            except (AttributeError, OSError, ValueError):
                pass
        for target in (1, 2):
            self._saved_fds.append((target, os.dup(target)))
            os.dup2(log_fd, target)
        os.close(log_fd)
        return terminal

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._live is not None:
                self._live.update(render(self.progress, self.capacity()), refresh=True)
                self._live.stop()
                self._live = None
            if self._saved_fds:
                for std in (sys.stdout, sys.stderr):
                    try:
                        std.flush()
                    except (AttributeError, OSError, ValueError):
                        pass
                for target, saved in self._saved_fds:
                    os.dup2(saved, target)
                    os.close(saved)
                self._saved_fds = []
                if self.console_log and os.path.getsize(self.console_log) > 0:
                    print(plain_line(time.time(), f"other output of this run (Ray, libraries): {self.console_log}"),
                          file=self.stream, flush=True)

    def _show(self, t: float | None, line: str | None) -> None:
        if self._live is not None:
            self._live.update(render(self.progress, self.capacity()))
        elif line is not None:
            print(plain_line(t, line), file=self.stream, flush=True)

    def feed(self, events: list[dict]) -> None:
        with self._lock:
            lines = [(e.get("t"), self.progress.update(e)) for e in events]
            if self._live is not None:
                if events:
                    self._show(None, None)
                return
            for t, line in lines:
                if line is not None:
                    self._show(t, line)

    def note(self, text: str) -> None:
        with self._lock:
            t = time.time()
            self.progress.note(text, t)
            self._show(t, text)


class EventFollower:
    """A thread that reads new lines of events.jsonl and feeds them to a LiveView until stopped."""

    def __init__(self, path: str, view: LiveView, poll_s: float = 0.5, offset: int = 0):
        self.path, self.view, self.poll_s = path, view, poll_s
        self._tail = EventTail(path, offset)   # offset: where this run's events begin
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotfill-live-view", daemon=True)

    def poll(self) -> list[dict]:
        return self._tail.poll()

    def _run(self) -> None:
        while not self._stop.is_set():
            new = self.poll()
            if new:
                self.view.feed(new)
            self._stop.wait(self.poll_s)

    def start(self) -> "EventFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        new = self.poll()
        if new:
            self.view.feed(new)

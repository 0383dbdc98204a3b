"""The overhead benchmark's time slices: a slice's rate counts only the steps that ran wholly inside it,
and the slicer really lets one process run at a time (two real processes, SIGSTOP/SIGCONT)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.overhead import RunProgress, Slicer, steps_in, window_rate  # noqa: E402


def test_a_step_cut_by_a_stop_is_left_out_of_the_next_turn():
    # 10 ms steps; the process is stopped at 0.055 (window 1 ends), in the middle of the step that began at
    # 0.05, and resumed at 1.0 (window 2): that step ends at 1.005, inside window 2, after 955 ms
    ends = [0.01 * i for i in range(1, 6)] + [1.005 + 0.01 * i for i in range(0, 10)]
    first, second = (0.0, 0.055), (1.0, 1.1)
    assert window_rate(ends, *first, tokens_per_step=100) == (pytest.approx(100 / 0.01), 4)
    rate, steps = window_rate(ends, *second, tokens_per_step=100)
    assert steps == 9 and rate == pytest.approx(100 / 0.01)     # the 955 ms step is not one of them
    assert 5 not in steps_in(ends, [first, second])               # nor in the step breakdown
    assert steps_in(ends, [first, second]) == [1, 2, 3, 4] + list(range(6, 15))


def test_a_window_edge_leaves_the_step_it_cuts_out():
    ends = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]          # 100 ms steps
    rate, steps = window_rate(ends, 0.25, 0.55, tokens_per_step=10)
    assert steps == 2 and rate == pytest.approx(10 / 0.1)   # 0.3 -> 0.4 -> 0.5: the steps ending 0.4 and 0.5
    assert window_rate(ends, 0.25, 0.35, tokens_per_step=10) is None
    # steps_in: the step index whose previous end and own end lie in one window
    assert steps_in(ends, [(0.25, 0.55)]) == [3, 4]
    assert steps_in(ends, [(0.0, 0.15), (0.15, 0.35)]) == [2]


def test_slicer_lets_one_process_run_at_a_time(tmp_path):
    # two real processes append their clock every 5 ms; each one's marks must fall in its own turns
    code = ("import sys, time\nf = open(sys.argv[1], 'a', buffering=1)\n"
            "while True:\n    f.write(f'{time.time()}\\n')\n    time.sleep(0.005)\n")
    paths = {side: tmp_path / f"{side}.txt" for side in ("plain", "spotfill")}
    procs = {side: subprocess.Popen([sys.executable, "-c", code, str(p)]) for side, p in paths.items()}
    try:
        time.sleep(0.5)
        slicer = Slicer(procs["plain"].pid, procs["spotfill"].pid, slice_s=0.4, rounds=3)
        t0 = time.time()
        slicer.run(lambda: False)
        t1 = time.time()
        time.sleep(0.2)                               # both run again after the turns
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert [len(slicer.windows[s]) for s in ("plain", "spotfill")] == [4, 3]
    turns = sorted((w, side) for side, ws in slicer.windows.items() for w in ws)
    assert [side for _, side in turns] == ["plain", "spotfill"] * 3 + ["plain"]
    for side, path in paths.items():
        marks = [float(x) for x in path.read_text().split()]
        during = [t for t in marks if t0 + 0.02 < t < t1 - 0.02]
        outside = [t for t in during if not any(a - 0.02 <= t <= b + 0.02 for a, b in slicer.windows[side])]
        assert not outside, f"{side} ran outside its turns at {outside[:3]}"
        assert all(sum(a <= t <= b for t in during) >= 20 for a, b in slicer.windows[side]), side
        assert marks[-1] > t1 + 0.1, f"{side} was left stopped"


def test_slicer_ends_early_after_a_plain_turn_and_never_leaves_a_process_stopped(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
             for _ in range(2)]
    try:
        slicer = Slicer(procs[0].pid, procs[1].pid, slice_s=0.05, rounds=10)
        slicer.run(lambda: len(slicer.windows["spotfill"]) == 2)
        assert [len(slicer.windows[s]) for s in ("plain", "spotfill")] == [3, 2]
        for p in procs:           # state R or S, never T (stopped)
            with open(f"/proc/{p.pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] != "T"
        slicer = Slicer(procs[0].pid, procs[1].pid, slice_s=0.05, rounds=5)
        with pytest.raises(RuntimeError):
            slicer.run(lambda: (_ for _ in ()).throw(RuntimeError("progress unreadable")))
        for p in procs:
            with open(f"/proc/{p.pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] != "T"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_slicer_follows_rank_0_and_refuses_a_restarted_group(tmp_path):
    from spotfill.telemetry.events import EventLog
    path = str(tmp_path / "events.jsonl")
    run = RunProgress(path)
    assert (run.poll().pid, run.last) == (None, 0)             # no events yet
    log = EventLog(path)
    log.write("start", step=0, pid=4242)
    log.write_many([{"t": 1.0 + i, "kind": "step", "step": i} for i in range(1, 8)])
    assert (run.poll().pid, run.last) == (4242, 7)
    log.write("resume", step=5, pid=4343)                     # another process: its steps are not comparable
    with pytest.raises(RuntimeError, match="restarted"):
        run.poll()
    log.close()


def test_a_process_that_ends_in_its_own_turn_ends_the_turns_cleanly():
    plain = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    spotfill = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(0.3)"])   # its last step
    try:
        slicer = Slicer(plain.pid, spotfill.pid, slice_s=1.0, rounds=5)
        slicer.run(lambda: spotfill.poll() is not None)
        assert [len(slicer.windows[s]) for s in ("plain", "spotfill")] == [2, 1]
        assert spotfill.wait(timeout=5) == 0
    finally:
        for p in (plain, spotfill):
            p.kill()
            p.wait()


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--seconds", "-3"], ["--global-batch", "0"]])
def test_bench_options_refuse_non_positive_values(argv, capsys):
    from benchmarks.overhead import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "must be a positive number" in capsys.readouterr().err

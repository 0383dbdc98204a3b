"""The event log stays bounded: it rolls into numbered segments that every reader reads in order, and step
events past the first N are sampled with exact sums. Expected totals are computed by hand from how the
synthetic run is built, never read back through the code under test."""
import json
import math
import os

import pytest

from spotfill.telemetry.events import (EventLog, EventTail, StepSampler, log_files, log_size, read_events,
                                       remove_log, step_count)
from spotfill.telemetry.ledger import compute_ledger
from spotfill.telemetry.report import load_events
from spotfill.train.summary import training_section

TOKENS = 64


def run(steps_a0=3000, resume_from=2500, steps_a1=4000, spike_at=3500):
    """A synthetic run: attempt 0 steps 1..steps_a0 (step i ends at t=i, step_s 0.5 + (i % 7) / 10),
    saves at every 500th step, then hangs; attempt 1 resumes from `resume_from` and steps to steps_a1
    (ending at t = steps_a0 + 100 + i - resume_from). One loss spike at step `spike_at` of attempt 1."""
    ev = [{"t": 0.0, "kind": "job_start", "workers": [2, 2]},
          {"t": 0.0, "kind": "attempt", "attempt": 0, "world_size": 2},
          {"t": 0.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 2}]
    for i in range(1, steps_a0 + 1):
        ev.append(_step(float(i), i, 0))
        if i % 500 == 0:
            ev.append({"t": i + 0.1, "kind": "checkpoint_save", "attempt": 0, "step": i, "stall_s": 0.05})
    t1 = steps_a0 + 100.0
    ev.append({"t": t1 - 5, "kind": "attempt", "attempt": 1, "world_size": 2})
    ev.append({"t": t1 - 1, "kind": "resume", "attempt": 1, "step": resume_from, "world_size": 2})
    for i in range(resume_from + 1, steps_a1 + 1):
        ev.append(_step(t1 + i - resume_from, i, 1, loss=50.0 if i == spike_at else 2.0))
    end = t1 + steps_a1 - resume_from
    return ev + [{"t": end + 1, "kind": "finish", "ok": True}, {"t": end + 2, "kind": "job_end"}]


def _step(t, i, attempt, loss=2.0):
    return {"t": t, "kind": "step", "step": i, "attempt": attempt, "world_size": 2, "loss": loss,
            "tokens": TOKENS, "step_s": 0.5 + (i % 7) / 10, "data_wait_s": 0.1}


def step_s(i):
    return 0.5 + (i % 7) / 10


def write(path, events, sampler, roll_mb=64):
    log = EventLog(str(path), roll_mb=roll_mb, sampler=sampler)
    for k in range(0, len(events), 37):          # in batches, as the sink receives them
        log.write_many(events[k:k + 37])
    log.close()
    return log


def test_sampled_steps_keep_every_total_exact(tmp_path):
    ev = run()
    log = write(tmp_path / "events.jsonl", ev, StepSampler(keep=100, every=300, flush_s=1e9))
    kept = list(read_events(str(tmp_path / "events.jsonl")))
    steps = [e for e in kept if e["kind"] == "step"]
    # 3000 + 1500 steps in; the first 100 as they are, then about one line in 300 and the notable ones
    assert log.written["steps"] == 4500 and len(steps) < 100 + 4500 / 300 + 30
    assert sum(step_count(e) for e in steps) == 4500
    # by hand: the final model holds attempt 0's steps 1-2500 and attempt 1's 2501-4000
    lineage = list(range(1, 2501)) + list(range(2501, 4001))
    tr = training_section(kept, 4000, 32)
    assert tr["steps_completed"] == 4000 and tr["final_loss"] == 2.0
    assert tr["step_time_split_s"]["data_wait"] == pytest.approx(0.1 * len(lineage), abs=1e-3)
    compute = sum(step_s(i) for i in lineage) + 5 * 0.05             # + the 5 saves of lineage steps
    assert tr["tokens_per_s"] == pytest.approx(TOKENS * len(lineage) / compute, abs=0.01)
    assert [h["to_step"] for h in tr["attempt_history"]] == [3000, 4000]
    led = compute_ledger(kept)
    # rolled back: attempt 0's steps 2501-3000 ran from the end of step 2500 (t=2500) to 3000 on 2 GPUs,
    # less the 0.05 s the save of step 2500 stalled them
    assert led.gpu_seconds["training_rolled_back"] == pytest.approx(2 * (3000 - 2500 - 0.05), abs=1e-6)
    raw = compute_ledger(ev)
    for k in ("training", "checkpoint_stall", "recovering", "total"):
        assert led.gpu_seconds[k] == pytest.approx(raw.gpu_seconds[k]), k


def test_notable_steps_are_kept_as_they_are(tmp_path):
    write(tmp_path / "events.jsonl", run(), StepSampler(keep=100, every=300, flush_s=1e9))
    steps = {(e["attempt"], e["step"]): e for e in read_events(str(tmp_path / "events.jsonl"), {"step"})}
    assert (1, 3500) in steps and steps[(1, 3500)]["loss"] == 50.0          # the loss spike
    assert (0, 3000) in steps and (1, 4000) in steps                        # each group's last step
    assert (1, 2501) in steps and "span" not in steps[(1, 2501)]            # a group's first step, alone
    assert (0, 2501) in steps and "span" not in steps[(0, 2501)]            # the step after a save
    assert all((0, s) in steps for s in range(500, 3001, 500))              # each saved step ends a span
    assert (0, 2500) in steps and 2500 % 300                                # (not one kept for its number)
    spans = [e["span"] for e in steps.values() if "span" in e]
    assert spans and all(sp["from_step"] <= e_step for sp, e_step in
                         ((e["span"], e["step"]) for e in steps.values() if "span" in e))


def test_time_bound_between_kept_lines():
    s = StepSampler(keep=0, every=10 ** 9, flush_s=30.0)
    out = [x for i in range(1, 200) for x in s.feed(_step(float(i), i, 0))]
    gaps = [b["t"] - a["t"] for a, b in zip(out, out[1:])]
    out += s.flush()
    assert max(gaps) <= 30.0 and len(out) >= 199 // 30 and sum(step_count(e) for e in out) == 199


def test_the_log_rolls_and_readers_read_every_segment_in_order(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, roll_mb=2 / 1024, sampler=False)          # 2 KiB segments
    tail, early = EventTail(path), []
    for i in range(300):
        log.write("tick", t=float(i), n=i)
        if i % 45 == 0:
            early += tail.poll()                                    # a live reader, across the rolls
    log.close()
    files = log_files(path)
    assert len(files) > 3 and files[-1] == path and os.path.basename(files[0]) == "events-000001.jsonl"
    assert all(os.path.getsize(p) <= 2048 for p in files)
    assert [e["n"] for e in read_events(path)] == list(range(300))
    assert [e["n"] for e in early + tail.poll()] == list(range(300))
    assert [e["n"] for e in load_events(path)] == list(range(300))
    # a reader that starts where a later run's events begin sees only those, across a roll
    start = log_size(path)
    again = EventLog(path, roll_mb=2 / 1024, sampler=False)
    for i in range(300, 340):
        again.write("tick", t=float(i), n=i)
    again.close()
    assert [e["n"] for e in EventTail(path, start).poll()] == list(range(300, 340))
    remove_log(path)
    assert log_files(path) == []


def test_a_tail_is_not_fooled_by_a_roll_between_listing_and_opening(tmp_path, monkeypatch):
    import spotfill.telemetry.events as events_mod
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, roll_mb=1, sampler=False)
    for i in range(5):
        log.write("tick", t=float(i), n=i)
    tail = EventTail(path)
    assert [e["n"] for e in tail.poll()] == list(range(5))
    for i in range(5, 8):
        log.write("tick", t=float(i), n=i)
    real, calls = events_mod.rolled_files, []

    def listing_then_roll(p):
        out = real(p)
        calls.append(1)
        if len(calls) == 1:                  # the writer rolls right after the tail listed the segments
            log._roll()
            for i in range(8, 10):
                log.write("tick", t=float(i), n=i)
        return out
    monkeypatch.setattr(events_mod, "rolled_files", listing_then_roll)
    assert [e["n"] for e in tail.poll()] == [5, 6, 7, 8, 9]
    log.close()


def test_a_bad_line_in_a_rolled_segment_is_named(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, roll_mb=1 / 1024, sampler=False)
    for i in range(200):
        log.write("tick", t=float(i), n=i)
    log.close()
    seg = log_files(path)[1]
    with open(seg) as f:
        lines = f.readlines()
    lines[1] = '{"t": 1, "ki\n'
    with open(seg, "w") as f:
        f.writelines(lines)
    from spotfill.config.errors import ConfigError
    with pytest.raises(ConfigError, match="events-000002.jsonl.*line 2 is not an event"):
        load_events(path)


def test_reading_an_unsampled_log_compacts_it_with_the_same_totals(tmp_path):
    ev = run()
    path = str(tmp_path / "events.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in ev)
    from spotfill.config import constants
    assert constants.EVENTS_STEPS_KEEP < 4500
    loaded = load_events(path)
    rest = 4500 - constants.EVENTS_STEPS_KEEP            # steps past the first N, one second apart here
    kept = constants.EVENTS_STEPS_KEEP + rest / constants.EVENTS_STEP_EVERY + rest / constants.EVENTS_STEP_FLUSH_S
    assert len([e for e in loaded if e["kind"] == "step"]) < kept + 30
    a, b = training_section(loaded, 4000, 32), training_section(ev, 4000, 32)
    for k in ("steps_completed", "final_loss", "tokens_per_s", "step_time_split_s", "attempt_history"):
        assert a[k] == b[k], k
    assert math.isclose(compute_ledger(loaded).gpu_seconds["training"], compute_ledger(ev).gpu_seconds["training"])

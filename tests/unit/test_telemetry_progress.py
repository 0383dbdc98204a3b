"""The live view: what a job's events turn into on a terminal (rich panel), in a log (one line per event),
and in `spotfill status` (a published snapshot read back)."""
import io
import json

import pytest

from spotfill.cli.status import live_jobs, market_of, node_rows, render
from spotfill.telemetry import progress as progress_mod
from spotfill.telemetry.liveview import EventFollower, LiveView, plain_line
from spotfill.telemetry.progress import Progress


def run_events():
    ev = [{"t": 1000.0, "kind": "job_start", "name": "tiny", "steps": 40, "workers": [1, 2], "gpus_per_worker": 1},
          {"t": 1001.0, "kind": "attempt", "attempt": 0, "world_size": 2, "cause": "first start"},
          {"t": 1003.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 2, "startup_s": 2.0,
           "device": "cpu", "peak_flops_per_gpu": None}]
    for i in range(1, 31):       # 30 steps, 0.5 s apart
        ev.append({"t": 1003.0 + 0.5 * i, "kind": "step", "step": i, "attempt": 0, "world_size": 2,
                   "loss": 5.0 - 0.1 * i, "tokens": 1024, "step_s": 0.5, "data_wait_s": 0.05,
                   "forward_backward_s": 0.3, "optimizer_s": 0.1, "collective_wait_s": 0.05,
                   "tokens_per_s": 2048.0, "mfu": None, "hfu": None})
    ev += [{"t": 1013.2, "kind": "checkpoint_save", "attempt": 0, "step": 20, "stall_s": 0.04},
           {"t": 1014.0, "kind": "checkpoint", "attempt": 0, "step": 20, "upload_s": 0.8},
           {"t": 1018.1, "kind": "planned_exit", "attempt": 0, "step": 30, "reason": "preemption",
            "detail": "emergency save within 8.00 s"},
           {"t": 1020.0, "kind": "attempt", "attempt": 1, "world_size": 1, "cause": "planned: preemption"},
           {"t": 1022.0, "kind": "resume", "attempt": 1, "step": 30, "world_size": 1, "startup_s": 2.0,
            "device": "cpu"},
           {"t": 1022.5, "kind": "step", "step": 31, "attempt": 1, "world_size": 1, "loss": 1.9, "tokens": 1024,
            "step_s": 0.5, "data_wait_s": 0.1, "forward_backward_s": 0.3, "optimizer_s": 0.1,
            "collective_wait_s": 0.0, "tokens_per_s": 2048.0, "mfu": None, "hfu": None}]
    return ev


def test_plain_lines_one_per_notable_event_and_a_step_line_every_few_seconds():
    out = io.StringIO()
    with LiveView(out, tty=False) as view:
        view.feed(run_events())
        view.note("the demo drained node 1")
    lines = out.getvalue().splitlines()
    assert all(ln.startswith("[spotfill] ") for ln in lines)
    text = "\n".join(lines)
    assert "job tiny started: 40 steps" in text
    assert "attempt 0: start from scratch on 2 workers (cpu" in text
    assert "checkpoint committed at step 20" in text
    assert "planned exit at step 30: preemption (emergency save within 8.00 s)" in text
    assert "restart 1 on 1 workers: planned: preemption" in text
    assert "attempt 1: resume from step 30 on 1 workers" in text
    assert lines[-1].endswith("the demo drained node 1")
    steps = [ln for ln in lines if " step " in ln and "tokens/s" in ln]
    # the first step of each group, then one every STEP_LINE_EVERY_S (10 s) of event time: steps 1, 21, 31
    assert [ln.split(" step ")[1].split("/")[0] for ln in steps] == ["1", "21", "31"]
    assert "step 21/40 loss 2.9000 2,048 tokens/s world 2" in steps[1]
    assert "MFU" not in steps[1]                   # unknown on a CPU: not shown as a number


def test_lease_lines_name_the_node_by_its_distinct_tail_and_say_why_a_lease_ended():
    out = io.StringIO()
    fake = "f" * 51 + "00001"                     # the fake autoscaler's ids share their first 51 digits
    with LiveView(out, tty=False) as view:
        view.feed([{"t": 1.0, "kind": "lease", "lease_id": "l1", "tenant": "serve:app", "node": fake, "gpus": 1},
                   {"t": 2.0, "kind": "reclaim", "lease_id": "l1", "tenant": "serve:app", "node": fake, "gpus": 1,
                    "reclaim_s": 1.384, "cause": "training_claim"},
                   {"t": 3.0, "kind": "lease_end", "lease_id": "l2", "tenant": "batch:b", "node": "ab12" * 14,
                    "gpus": 1, "reason": "node lost: the lease died with it"}])
    text = out.getvalue()
    assert "lent 1 GPU(s) on node ...fff00001 to serve" in text
    assert "reclaim of serve's GPU(s) on node ...fff00001 in 1.38s: training_claim" in text
    assert "lease_end of batch's GPU(s) on node ...ab12ab12: node lost: the lease died with it" in text


def test_tty_panel_renders_the_live_numbers():
    from rich.console import Console

    from spotfill.telemetry.liveview import render as render_panel
    p = Progress()
    for e in run_events()[:33]:                     # up to step 30, before the restart
        p.update(e)
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=110, color_system=None).print(render_panel(p, capacity=4))
    text = buf.getvalue()
    for part in ("spotfill · tiny · training", "30/40", "75%", "loss", "2.0000", "tokens/s", "2,048",
                 "MFU / HFU", "n/a (CPU)", "2 worker(s), attempt 0", "training 2", "idle 2",
                 "data wait 10%", "forward+backward 60%", "optimizer 20%", "collective wait 10%",
                 "last events", "job tiny started"):
        assert part in text, (part, text)


def test_live_view_on_a_tty_draws_a_panel_not_lines():
    out = io.StringIO()
    view = LiveView(out, tty=True)
    assert view.tty
    with view:
        view.feed(run_events())
    text = out.getvalue()
    assert "\x1b[" in text and "spotfill · tiny" in text      # terminal control codes: drawn in place
    assert "[spotfill] " not in text


def test_gpus_by_state_follow_the_group_and_leases():
    p = Progress()
    for e in run_events()[:10]:
        p.update(e)
    assert p.gpus_by_state(capacity=5) == {"training": 2, "recovering": 0, "fillin": {}, "idle": 3}
    p.update({"t": 1010.0, "kind": "lease", "lease_id": "l1", "tenant": "serve:app", "kind_": "serve",
              "node": "n1", "gpus": 1})
    g = p.gpus_by_state(capacity=5)
    assert sum(g["fillin"].values()) == 1 and g["idle"] == 2
    p.update({"t": 1011.0, "kind": "planned_exit", "attempt": 0, "step": 8, "reason": "grow"})
    assert p.gpus_by_state()["recovering"] == 2 and p.state == "recovering"
    p.update({"t": 1012.0, "kind": "attempt", "attempt": 1, "world_size": 3, "cause": "planned: grow"})
    assert p.world_size == 3 and p.restarts == 1


def test_snapshot_round_trip_and_status_text():
    p = Progress()
    for e in run_events():
        p.update(e)
    snap = json.loads(json.dumps({**p.snapshot(), "sink": "spotfill-sink-tiny-abc", "run_dir": "/r"}))
    jobs = live_jobs({"jobs/spotfill-sink-tiny-abc": json.dumps(snap).encode(), "jobs/gone": None},
                     alive=lambda name: name == "spotfill-sink-tiny-abc")
    assert len(jobs) == 1 and jobs[0]["sink_alive"]
    nodes = node_rows([
        {"NodeID": "h" * 28, "Alive": True, "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0},
         "Labels": {"spotfill.io/market-type": "on-demand", "spotfill.io/role": "head"}},
        {"NodeID": "a" * 28, "Alive": True, "Resources": {"CPU": 4.0, "GPU": 4.0},
         "Labels": {"ray.io/market-type": "SPOT"}},
        {"NodeID": "b" * 28, "Alive": False, "Resources": {"CPU": 4.0, "GPU": 4.0}, "Labels": {}}], "GPU")
    assert [(n["market"], n["gpus"], n["alive"]) for n in nodes] == \
        [("on-demand", 0, True), ("spot", 4.0, True), (None, 4.0, False)]
    text = render({"live_jobs": jobs, "cluster_nodes": nodes, "arbiter": False}, now=1030.0)
    assert "training jobs (1):" in text
    assert "job tiny: training, attempt 1, 1 restart(s), last event 8s ago" in text
    assert "step 31/40 loss 1.9000 2,048 tokens/s world 1" in text
    assert "MFU n/a (CPU)" in text
    assert "step split: data wait 20%, forward+backward 60%, optimizer 20%, collective wait 0%" in text
    assert "nodes (2 alive, 1 dead; GPUs 4: on-demand 0, spot 4):" in text
    # GPU-seconds so far, attributed like the Prometheus counter: 30 steps x 0.5 s x 2 GPUs + step 31 on 1
    assert "GPU-seconds so far: " in text and "training 30.5" in text
    assert "fill-in arbiter: none on this cluster" in text
    stale = live_jobs({"jobs/x": json.dumps(snap).encode()}, alive=lambda name: False)
    assert "[STALE" in render({"live_jobs": stale, "cluster_nodes": [], "arbiter": False}, now=1030.0)


def test_market_labels():
    assert market_of({"spotfill.io/market-type": "spot", "ray.io/market-type": "on-demand"}) == "spot"
    assert market_of({"ray.io/market-type": "ON_DEMAND"}) == "on-demand"
    assert market_of({}) is None and market_of(None) is None


def test_follower_reads_only_complete_lines_from_its_offset(tmp_path):
    path = tmp_path / "events.jsonl"
    old = json.dumps({"t": 1.0, "kind": "job_start", "name": "old-run"}) + "\n"
    path.write_text(old)
    out = io.StringIO()
    view = LiveView(out, tty=False)
    f = EventFollower(str(path), view, offset=len(old.encode()))
    with open(path, "a") as fh:
        fh.write(json.dumps({"t": 2.0, "kind": "job_start", "name": "new-run", "steps": 5}) + "\n")
        fh.write('{"t": 3.0, "kind": "chec')          # still being written
    assert [e["name"] for e in f.poll()] == ["new-run"]
    with open(path, "a") as fh:
        fh.write('kpoint", "step": 5}\n')
    assert [e["kind"] for e in f.poll()] == ["checkpoint"]


def test_plain_line_format():
    assert plain_line(None, "x") == "[spotfill] --:--:-- x"
    assert progress_mod.STEP_LINE_EVERY_S > 0


@pytest.mark.parametrize("kind", ["finish"])
def test_finish_line(kind):
    p = Progress()
    p.update({"t": 1.0, "kind": "step", "step": 3, "attempt": 0, "world_size": 1, "tokens": 1, "step_s": 1})
    assert p.update({"t": 2.0, "kind": kind, "ok": True}) == "training finished at step 3"
    assert p.state == "finished"


def test_a_data_mismatch_gets_its_line():
    assert Progress().update({"t": 1.0, "kind": "data_mismatch", "rank": 1, "attempt": 2,
                              "reason": "data shard shard-00000.npy in /d is not the shard its manifest names"}) \
        == "data mismatch on rank 1: data shard shard-00000.npy in /d is not the shard its manifest names"


def test_on_a_real_terminal_other_output_goes_to_the_console_log(tmp_path):
    """A pseudo-terminal stands in for the user's: the panel draws there, while anything written to the
    process's stdout/stderr descriptors (as a local Ray cluster's child processes do) lands in the log."""
    import os
    import pty
    import threading

    master, slave = pty.openpty()
    term = os.fdopen(slave, "w")
    seen = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    log = tmp_path / "run" / "console.log"
    try:
        with LiveView(term, console_log=str(log)) as view:
            assert view.tty
            os.write(1, b"raylet noise on stdout\n")
            os.write(2, b"deepspeed warning on stderr\n")
            view.feed(run_events())
        os.write(2, b"")                     # descriptors are back (a write to them works)
    finally:
        term.close()
        reader.join(timeout=5)
        os.close(master)
    shown = seen.decode("utf-8", "replace")
    assert "spotfill · tiny" in shown and "31/40" in shown
    assert "raylet noise" not in shown and "deepspeed warning" not in shown
    assert "other output of this run (Ray, libraries): " + str(log) in shown
    assert log.read_text() == "raylet noise on stdout\ndeepspeed warning on stderr\n"


def test_a_second_run_over_the_same_store_starts_at_a_later_attempt_without_a_restart():
    p = Progress()
    assert p.update({"t": 1.0, "kind": "attempt", "attempt": 3, "world_size": 2, "cause": "first start",
                     "earlier_attempts": 3}) is None
    assert p.restarts == 0 and p.attempt == 3
    assert p.update({"t": 2.0, "kind": "attempt", "attempt": 4, "world_size": 1,
                     "cause": "unplanned: node died"}) == "restart 4 on 1 workers: unplanned: node died"
    assert p.restarts == 1

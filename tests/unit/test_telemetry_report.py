"""report.json keys, report.html and timeline.png from a hand-made run directory; `spotfill report` errors."""
import json
import os

import pytest
from PIL import Image

from spotfill.cli.main import main
from spotfill.telemetry.report import enrich_report, load_events, write_report
from spotfill.telemetry.timeline import SIZE_PX, STATE_COLORS, WORKLOAD_COLORS
from test_telemetry_ledger import hard_loss_log


def run_events():
    """hard_loss_log with a node timeline (n1 lost at 30), worker placement, commits, and a Serve lease on
    n0's idle GPUs from 60 until reclaimed at 75 (the replica computed 9 s of its 15); the job ends at 80.
    The arbiter saw both nodes' GPUs free until the first group took them at 5 and n0's free again after
    finish (57), until the lease (60); its view after the reclaim did not reach the log."""
    ev = [e for e in hard_loss_log() if e["kind"] != "job_end"]
    for e in ev:
        if e["kind"] == "start":
            e["placement"] = {"n0": 2, "n1": 2}
        if e["kind"] == "resume":
            e["placement"] = {"n0": 2}
    ev += [{"t": 0.0, "kind": "node_up", "node": "n0", "gpus": 2, "market": "spot"},
           {"t": 0.0, "kind": "node_up", "node": "n1", "gpus": 2, "market": "spot"},
           {"t": 30.0, "kind": "node_down", "node": "n1"},
           {"t": 21.5, "kind": "checkpoint", "attempt": 0, "step": 5, "bytes": 10, "upload_s": 0.5},
           {"t": 56.5, "kind": "checkpoint", "attempt": 1, "step": 10, "bytes": 10, "upload_s": 0.5},
           {"t": 60.0, "kind": "lease", "lease_id": "L1", "tenant": "serve:app", "node": "n0", "gpus": 2},
           {"t": 75.0, "kind": "reclaim", "lease_id": "L1", "tenant": "serve:app", "node": "n0", "gpus": 2},
           {"t": 75.0, "kind": "fillin_busy", "tenant": "serve:app", "node": "n0", "gpus": 2, "busy_s": 9.0,
            "t0": 60.0, "t1": 75.0},
           {"t": 80.0, "kind": "job_end"}]
    ev += [{"t": t, "kind": "gpu_free", "node": n, "free": f}
           for t, n, f in ((0.0, "n0", 2), (0.0, "n1", 2), (5.0, "n0", 0), (5.0, "n1", 0), (57.0, "n0", 2),
                           (60.0, "n0", 0))]
    return sorted(ev, key=lambda e: e["t"])


def write_run(path, events=None, report=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as f:
        for e in events if events is not None else run_events():
            f.write(json.dumps(e) + "\n")
    report = report if report is not None else {
        "ok": True, "training": {"steps_target": 10, "steps_completed": 10, "final_loss": 1.0, "mfu": None},
        "preemptions": [{"kind": "hard", "action": "kill_node", "node": 1, "at": 30.0, "affected": True}]}
    with open(os.path.join(path, "report.json"), "w") as f:
        json.dump(report, f)
    return str(path)


def test_enrich_report_adds_ledger_diagnosis_and_recovery_breakdown():
    report = {"preemptions": [{"kind": "hard", "at": 30.0, "affected": True}]}
    enrich_report(report, run_events())
    gs = report["gpu_seconds"]
    # n0 2x80 + n1 2x30 = 220; serve held 2 GPUs x 15 s and computed 2 x 9; idle: n0 57->60 (2x3);
    # unaccounted: n0 75->80 (2x5, nothing seen after the reclaim); recovering: waiting 0->5 and starting
    # 5->10 on 4, the hung group 25->30 on 4 and 30->40 on n0's 2, attempt 1 starting 40->45 on 2
    assert gs["total"] == pytest.approx(220.0) and gs["fillin"] == gs["fillin_reserved"] == pytest.approx(30.0)
    assert gs["fillin_busy"] == pytest.approx(18.0)
    assert gs["recovering"] == pytest.approx(4 * 5 + 4 * 5 + 4 * 5 + 2 * 10 + 2 * 5)
    assert gs["idle"] == pytest.approx(6.0) and gs["unaccounted"] == pytest.approx(10.0)
    spare = 220.0 - 76.0 - 8.0 - 90.0
    assert report["harvest_ratio"] == pytest.approx(18.0 / spare, abs=1e-4)
    assert report["harvest_ratio_reserved"] == pytest.approx(30.0 / spare, abs=1e-4)
    assert report["goodput"] == pytest.approx((4 * 10 + 2 * 10) / (4 * 80), abs=1e-4)
    n1 = report["gpu_seconds_per_node"]["n1"]      # attempt 0 ran 2 workers there, 10->25, stalled 20->21
    assert (n1["training"], n1["checkpoint_stall"], n1["recovering"]) == pytest.approx((2 * 14.0, 2.0, 2 * 15.0))
    assert n1["total"] == pytest.approx(60.0) and n1["idle"] == 0 and n1["unaccounted"] == 0
    rb = report["preemptions"][0]["recovery_breakdown"]
    assert rb["state_load_s"] == pytest.approx(3.0) and rb["total_s"] == pytest.approx(17.0)   # 30 -> 47
    assert {f["cause"] for f in report["diagnosis"]["findings"]} >= {"recovery", "idle_capacity", "unaccounted",
                                                                     "rolled_back"}
    assert json.loads(json.dumps(report))["gpu_seconds"]["total"] == pytest.approx(220.0)   # report.json-ready


def test_timeline_png_has_every_state_band(tmp_path):
    out = write_report(write_run(tmp_path / "run"))
    img = Image.open(out["png"]).convert("RGB")
    assert img.size == SIZE_PX
    counts = {c: n for n, c in img.getcolors(maxcolors=1 << 20)}
    for name, hex_ in {**STATE_COLORS, "serve": WORKLOAD_COLORS["serve"]}.items():
        rgb = tuple(int(hex_[i:i + 2], 16) for i in (1, 3, 5))
        assert counts.get(rgb, 0) > 100, f"{name} band ({hex_}) missing from timeline.png"


def test_timeline_png_lacks_a_band_that_did_not_happen(tmp_path):
    ev = [e for e in run_events() if e["kind"] not in ("lease", "reclaim")]
    out = write_report(write_run(tmp_path / "run", ev))
    counts = {c: n for n, c in Image.open(out["png"]).convert("RGB").getcolors(maxcolors=1 << 20)}
    assert counts.get((0x1f, 0x77, 0xb4), 0) < 50       # no serve band (a few pixels of legend-free text at most)


def test_report_html_is_self_contained(tmp_path):
    out = write_report(write_run(tmp_path / "run"))
    page = open(out["html"]).read()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert 'src="data:image/png;base64,' in page
    for sid in ("summary", "timeline", "gpu-seconds", "per-node", "diagnosis", "recoveries", "checkpoints"):
        assert f'id="{sid}"' in page


def test_cli_writes_both_files(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["report", run]) == 0
    assert os.path.getsize(os.path.join(run, "report.html")) > 1000
    assert os.path.getsize(os.path.join(run, "timeline.png")) > 1000
    assert "goodput 18.8%" in capsys.readouterr().out         # 60 productive GPU-s of 4 GPUs x 80 s


@pytest.mark.parametrize("case,expect", [
    ("missing", "no such directory"), ("no_events", "has no events.jsonl"), ("empty", "holds no timed event"),
    ("garbled", "line 2 is not an event"), ("not_events", "line 1 is not an event"),
    ("bad_report", "report.json: is not valid JSON"),
])
def test_cli_bad_run_dir_is_one_line_exit_2(tmp_path, capsys, case, expect):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    lines = {"empty": "", "garbled": '{"t": 1, "kind": "step"}\n{"t": 2, "ki\n{"t": 3, "kind": "x"}\n',
             "not_events": "[1, 2]\n{\"t\": 1, \"kind\": \"x\"}\n", "bad_report": '{"t": 1, "kind": "x"}\n'}
    if case in lines:
        (run / "events.jsonl").write_text(lines[case])
    if case == "bad_report":
        (run / "report.json").write_text("{nope")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "kind": "job_start"}\n{"t": 2, "kind": "st')
    assert [e["kind"] for e in load_events(str(path))] == ["job_start"]

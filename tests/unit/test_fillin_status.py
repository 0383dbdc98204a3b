"""`spotfill status` renders the arbiter's view: GPUs per node by owner, leases, reclaims, decisions."""
from spotfill.cli.main import main
from spotfill.cli.status import render

STATUS = {
    "gpu_resource": "GPU_SLOT", "order": ["sweep", "batch", "serve"], "since": 0.0, "restored": True,
    "nodes": {"aaaaaaaaaaaaaaaa": {"total": 2, "idle": 0, "training": 1, "serve": 1, "reclaiming": 0},
              "bbbbbbbbbbbbbbbb": {"total": 1, "idle": 0, "training": 0, "reclaiming": 1}},
    "jobs": [{"job": "train", "min_workers": 1, "max_workers": 3, "current_workers": 1, "gpus_per_worker": 1,
              "restarting": False, "pending_gpus": 1}],
    "tenants": [],
    "leases": [{"lease_id": "r1", "tenant": "serve:spotfill-serve/Generator", "kind": "serve",
                "node_id": "aaaaaaaaaaaaaaaa", "gpus": 1, "reclaim_method": "serve_scale", "grace_s": 3.0,
                "granted_at": 10.0, "reclaiming_since": None}],
    "pending_reclaims": [{"lease_id": "r2", "tenant": "serve:spotfill-serve/Generator",
                          "node_id": "bbbbbbbbbbbbbbbb", "gpus": 1, "since": 20.0, "deadline": 23.0}],
    "decisions": [{"action": "reclaim", "tenant": "serve:spotfill-serve/Generator", "gpus": 1, "at": 20.0,
                   "node_id": "bbbbbbbbbbbbbbbb", "lease_id": "r2", "deadline": 23.0,
                   "reason": "training job train claims 2 GPU(s), 1 free"}],
    "handbacks": [{"job": "train", "seconds": 0.42, "leases": 1, "gpus": 1, "ok": True, "at": 21.0}],
}


def test_render_shows_owners_leases_reclaims_and_reasons():
    text = render(STATUS)
    assert "reclaim order sweep > batch > serve" in text and "restored after a restart" in text
    header = next(line for line in text.splitlines() if line.startswith("GPUs per node"))
    assert header.split()[3:] == ["total", "training", "serve", "reclaiming", "idle"]
    assert "  aaaaaaaaaaaa" in text and "1 claimed GPU(s) held for it" in text
    assert "serve:spotfill-serve/Generator on aaaaaaaaaaaa: 1 GPU" in text
    assert "pending reclaims (1):" in text and "train 0.42s (1 lease(s))" in text
    assert "reclaim serve:spotfill-serve/Generator 1 GPU on bbbbbbbbbbbb -- training job train claims 2" in text


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["status", "--last", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "spotfill: error: --last: bad value -1; accepted: an integer >= 0"


def test_an_address_where_nothing_listens_is_refused_in_seconds(capsys):
    """ray.init retried such an address for minutes, printing GCS warnings; now: one line, exit 2."""
    import socket
    import time

    with socket.socket() as s:        # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t0 = time.monotonic()
        assert main(["status", "--address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"spotfill: error: --address: nothing answers there") and "\n" not in err, err

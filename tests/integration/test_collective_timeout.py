"""A rank that goes silent (SIGSTOP: its TCP connections stay open, so no reset tells the others) makes
every collective that needs it fail after SPOTFILL_COLLECTIVE_TIMEOUT_S: the default process group's (Ray
Train's, from the TorchConfig train/job.py builds) and DeepSpeed's own data-parallel group (a clone of the
world group that torch would otherwise give its global 30 minutes). Two real gloo processes, no Ray
cluster: the ranks are set up with Ray Train's process-group function and spotfill's engine builder."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import pytest

from collective_freeze_worker import run
from test_jobs_submit import _free_ports

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("collective") / "rank0.json")
    ctx = mp.get_context("spawn")
    (port,) = _free_ports(1)
    procs = [ctx.Process(target=run, args=(rank, 2, port, TIMEOUT_S, out), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=240)
        assert os.path.exists(out), f"rank 0 wrote nothing (exit code {procs[0].exitcode}): a collective hung"
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:             # rank 1 is stopped: SIGKILL ends it all the same
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)


@pytest.mark.parametrize("collective", ["flags_all_gather", "zero_step"])
def test_a_collective_with_a_silent_peer_fails_after_the_timeout(results, collective):
    r = results[collective]
    assert r["raised"] and "RuntimeError" in r["raised"], r
    assert TIMEOUT_S - 0.5 <= r["after_s"] <= TIMEOUT_S + 10.0, r

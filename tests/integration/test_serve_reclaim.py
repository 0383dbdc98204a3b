"""A request outlives its replica, on a real local cluster (2 nodes x 1 GPU slot, the arbiter lending both to
the Serve app): greedy output with the replica SIGKILLed mid-stream equals the output without, on one
uninterrupted stream; a request whose replicas are all reclaimed and killed under it is counted as lost
(admitted, then failed) by the load generator, not as refused; the hand-back bounds hold (an idle replica
is given back before its 3 s grace, as soon as Serve stops it; busy ones <= 5 s); the replica that generated
reports its busy time on its lease. Measured numbers are printed as `SERVE-METRIC name value` (run with -s)."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from spotfill.sim.cluster import free_port
from spotfill.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(600)
CONTEXT = 1024
LONG = {"prompt": "def main():", "max_tokens": CONTEXT - 24, "temperature": 0, "ignore_eos": True}


def metric(name, value):
    print(f"SERVE-METRIC {name} {value}", flush=True)


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def stream(url, body, on_chunk=None, timeout=120):
    """The SSE data lines of a streamed completion, parsed; `on_chunk(chunks_so_far)` after each."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if on_chunk and out[-1] != "[DONE]":
                on_chunk(out)
    return out


def tiny_checkpoint(uri: str, step: int = 1) -> None:
    """A committed checkpoint of the tiny preset with a 1024-token context (module states only)."""
    import torch

    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
    from spotfill.train.model import GPT, preset
    torch.manual_seed(step)
    local = uri[len("file://"):] + "-part"
    os.makedirs(local)
    torch.save({"module": GPT(preset("tiny", seq_len=CONTEXT)).state_dict()},
               os.path.join(local, "mp_rank_00_model_states.pt"))
    store = CheckpointStore(open_storage(uri))
    store.upload_part(tag_for(step), 0, 1, local)
    store.commit(tag_for(step), step, 1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from spotfill.serving.deploy import deploy_serve
    from spotfill.sim.fillin_cluster import fillin_cluster

    uri = f"file://{tmp_path_factory.mktemp('ckpt')}/run"
    tiny_checkpoint(uri)
    with fillin_cluster(2, 1, str(tmp_path_factory.mktemp("arbiter") / "state.json")) as (cluster, arbiter):
        out = deploy_serve(uri, port=free_port(), max_replicas=2, replicas=0, max_queue_wait_s=10.0, reload_s=30)
        yield {"cluster": cluster, "arbiter": arbiter, "url": out["url"]}


def replica_pids(env) -> dict[str, int]:
    """Running Generator replica id -> its process id (the State API of this test's cluster)."""
    from ray.util.state import list_actors
    dashboard = env["cluster"].cluster.webui_url
    return {a.name.rsplit("#", 1)[-1]: a.pid
            for a in list_actors(address=f"http://{dashboard}", filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name == "ServeReplica:spotfill-serve:Generator"}


def both_running(env) -> bool:
    try:
        with urllib.request.urlopen(env["url"] + "/healthz", timeout=10) as resp:
            return json.loads(resp.read())["replicas"] == 2 and len(replica_pids(env)) == 2
    except OSError:
        return False


def test_idle_handback_does_not_wait_for_the_grace(env):
    """No request in flight: training's claim -> the GPU free before the replica's 3 s graceful-shutdown grace
    (an idle replica stops at once; one that waited out its grace would take >= 3 s). Typically 0.5-1.1 s here;
    the 1 s target is a benchmark figure (`spotfill bench --only fillin`, Serve hand-backs), not a timed test
    on a shared machine. The arbiter's decisions after the claim are printed (and named on failure): when the
    scale call was made, when the lease ended."""
    from spotfill.serving.app import GRACEFUL
    import ray
    wait_for(lambda: both_running(env), 180, "2 Generator replicas on the lent slots")
    time.sleep(1.0)
    t_claim = time.time()
    idle = ray.get(env["arbiter"].claim.remote("idle", 1, 15.0, 1, 1, 1), timeout=30)
    steps = [(d["action"], round(d["at"] - t_claim, 3), d["reason"][:60])
             for d in ray.get(env["arbiter"].status.remote(), timeout=30)["decisions"] if d["at"] >= t_claim - 0.01]
    ray.get(env["arbiter"].release_job.remote("idle"))
    metric("handback_idle_s", idle["waited_s"])
    metric("handback_idle_steps", steps)
    grace = GRACEFUL["graceful_shutdown_timeout_s"]
    dropped = [at for action, at, _ in steps if action == "drop"]
    assert idle["ok"] and dropped and max(dropped) < grace and idle["waited_s"] < grace, (idle, steps)


def test_busy_handback_within_5s(env):
    """Long requests in flight on both replicas: the claim of both GPUs is answered in <= 5 s (the replicas
    are stopped at the 3 s grace at the latest; their requests wait for a replica and are then lost)."""
    import ray

    from spotfill.fillin.load import ServeLoad
    wait_for(lambda: both_running(env), 180, "2 Generator replicas on the lent slots")
    load = ServeLoad(env["url"], rps=4, max_tokens=LONG["max_tokens"], timeout_s=60, max_in_flight=8,
                     extra_body={"ignore_eos": True}).start()
    time.sleep(2.0)
    busy = ray.get(env["arbiter"].claim.remote("busy", 2, 15.0, 1, 1, 2), timeout=30)
    s = load.stop()
    ray.get(env["arbiter"].release_job.remote("busy"))
    metric("handback_busy_s", busy["waited_s"])
    metric("busy_summary", json.dumps({k: s[k] for k in ("requests_ok", "requests_lost", "requests_failed")}))
    assert busy["ok"] and busy["waited_s"] <= 5.0, busy


def busy_reports(env, after: int, leases: set) -> list[dict]:
    """The Generator replicas' busy-time events (fillin/busy.py) the arbiter journaled after `after`, for
    the leases `leases`."""
    import ray
    events = ray.get(env["arbiter"].journal_since.remote(after), timeout=30)["events"] or []
    return [e for e in events if e["kind"] == "fillin_busy" and e["tenant"] == "serve:spotfill-serve/Generator"
            and e["lease_id"] in leases and e["busy_s"] > 0]


def test_greedy_output_survives_a_replica_killed_mid_stream(env):
    """...and the replica that generated reports its generation steps as busy time on its lease."""
    import ray
    wait_for(lambda: both_running(env), 180, "2 Generator replicas on the lent slots")
    opening = ray.get(env["arbiter"].journal_since.remote(None), timeout=30)
    leases = {e["lease_id"] for e in opening["events"] if e["kind"] == "lease"}
    code, whole = post(env["url"] + "/v1/completions", LONG)
    assert code == 200 and whole["usage"]["completion_tokens"] == LONG["max_tokens"], whole
    # sent when 2 s were measured, or by the replica's checkpoint watch (reload_s: 30 s) at the latest
    wait_for(lambda: busy_reports(env, opening["seq"], leases), 45, "the replica's busy time on its lease")
    metric("busy_reported_s", sum(e["busy_s"] for e in busy_reports(env, opening["seq"], leases)))
    pids, killed = replica_pids(env), []

    def kill_after_some_tokens(chunks):
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        if not killed and len(text) >= 40:
            victim = chunks[0]["replica"]
            os.kill(pids[victim], signal.SIGKILL)
            killed.append((victim, len(text)))
    chunks = stream(env["url"], LONG, kill_after_some_tokens)
    assert killed, "the request finished before a replica could be killed under it"
    assert chunks[-1] == "[DONE]" and not any("error" in c for c in chunks[:-1]), chunks[-3:]
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == whole["choices"][0]["text"]
    replicas = [c["replica"] for c in chunks[:-1] if "replica" in c]
    # it began on the killed replica and went on elsewhere, never back to it (a loaded machine's Serve may
    # also stop the second replica for a missed health check: the stream then moves once more)
    assert replicas[0] == killed[0][0] and len(set(replicas)) >= 2 and killed[0][0] not in replicas[1:], replicas
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    metric("killed_after_chars", killed[0][1])


def test_a_request_lost_with_every_replica_is_a_failure_not_a_refusal(env):
    """Training claims both slots and the stopping replicas are killed under their requests (as Serve does
    after the grace): no replica is left to continue on within max_queue_wait_s, so each request in flight
    is lost -- counted failed -- while requests arriving afterwards are refused at once."""
    import ray

    from spotfill.fillin.load import ServeLoad
    wait_for(lambda: both_running(env), 180, "2 Generator replicas on the lent slots")
    pids = replica_pids(env)
    # room for requests beyond the 8 in flight at the claim: those that arrive afterwards are sent (and
    # refused), not skipped by the client (with 8 slots, 2 s at 4 rps filled them all)
    load = ServeLoad(env["url"], rps=4, max_tokens=LONG["max_tokens"], timeout_s=60, max_in_flight=16,
                     extra_body={"ignore_eos": True}).start()
    time.sleep(2.0)                                  # requests in flight on both replicas
    claim = env["arbiter"].claim.remote("train", 2, 15.0, 1, 1, 2)
    # killed once both are told to stop, not after the claim returns: by then a graceful stop may have let
    # every request in flight finish (requests of ~2.5 s inside a 5 s grace), leaving none to lose
    wait_for(lambda: len(ray.get(env["arbiter"].status.remote(0), timeout=30)["pending_reclaims"]) >= 2, 15,
             "both Serve leases reclaiming", every=0.05)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    answer = ray.get(claim, timeout=30)
    time.sleep(5.0)
    s = load.stop()
    metric("lost_summary", json.dumps({k: s[k] for k in ("requests", "requests_ok", "requests_lost",
                                                           "requests_rejected_503", "requests_failed")}))
    assert answer["ok"], answer
    assert s["requests_lost"] >= 1, s
    assert s["requests_failed"] == s["requests_lost"], s["failures"]       # nothing else failed
    assert all(f["status"] == 503 and "lost after" in f["error"] for f in s["failures"]), s["failures"]
    assert s["requests_rejected_503"] >= 1, s            # arriving after the reclaim: refused at once
    ray.get(env["arbiter"].release_job.remote("train"))

"""Batch fill-in (jobs/batch_infer.py) on a local multi-node cluster (2 nodes x 1 GPU slot, one cluster and
one fill-in arbiter for the module): evaluation loss equals an independent forward of the same weights on
the same rows; a job reclaimed twice by training claims ends with every row exactly once (ids read back from
the parquet); a driver killed mid-run is rerun and finishes without duplicates, redoing a damaged part."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from spotfill.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(400)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL_ROWS, PROMPTS = 96, 160


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A committed checkpoint of known weights (a seeded tiny GPT), held-out token shards, a prompt file."""
    import torch

    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
    from spotfill.train.data import ShardWriter
    from spotfill.train.model import build_model

    root = tmp_path_factory.mktemp("batch")
    torch.manual_seed(7)
    state = build_model("tiny").state_dict()
    ckpt = str(root / "run")
    part = root / "part"
    part.mkdir()
    torch.save({"module": state}, part / "mp_rank_00_model_states.pt")
    store = CheckpointStore(open_storage(ckpt))
    store.upload_part(tag_for(40), 0, 1, str(part))
    store.commit(tag_for(40), 40, 1)

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 257, size=(EVAL_ROWS, 65))
    writer = ShardWriter(open_storage(str(root / "heldout")), seq_len=64, vocab_size=257, tokenizer="bytes",
                         rows_per_shard=40)
    writer.add(tokens)
    writer.close()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:03d}", "prompt": f"def f{i}(x):"}) + "\n"
                               for i in range(PROMPTS)))
    return {"root": root, "checkpoint": ckpt, "state": state, "tokens": tokens, "heldout": str(root / "heldout"),
            "prompts": str(prompts)}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.arbiter import ensure_arbiter
    from spotfill.fillin.wiring import runtime_env
    from spotfill.sim.cluster import EmbeddedCluster

    cluster = EmbeddedCluster()
    for _ in range(2):
        cluster.add_node(1)
    ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
    arbiter = ensure_arbiter("GPU", runtime_env=runtime_env(),
                             state_path=str(tmp_path_factory.mktemp("arbiter") / "state.json"))
    try:
        yield {"cluster": cluster, "arbiter": arbiter}
    finally:
        try:
            ray.kill(arbiter, no_restart=True)
        finally:
            cluster.shutdown()


def write_config(path, inputs, output: str, *, units: int = 0, max_tokens: int = 24, eval_rows: int = 0,
                 prompts: bool = True, grace_s: float = 5.0) -> str:
    import yaml
    cfg = {"name": path.stem, "checkpoint": inputs["checkpoint"], "output": output,
           "eval": {"data": inputs["heldout"], "rows": eval_rows, "rows_per_unit": 16, "batch_size": 8},
           "cluster": {"gpu_resource": "GPU", "max_units": 2, "grace_s": grace_s},
           "grant": {"units": units}}
    if prompts:
        cfg["generate"] = {"prompts": inputs["prompts"], "max_tokens": max_tokens, "rows_per_unit": 4}
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def driver(env, config: str) -> subprocess.Popen:
    from spotfill.sim.cluster import LOOPBACK_CLIENT_ENV
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "jobs", "batch_infer.py"), "--config", config],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **LOOPBACK_CLIENT_ENV, "RAY_ADDRESS": env["cluster"].address,
                                 "PYTHONPATH": os.path.join(ROOT, "platform")})


def finish(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"batch driver exit {proc.returncode}:\n{err[-3000:]}"
    from spotfill.sim.fillin_driver import last_json
    return last_json(out)


def committed_count(output: str) -> int:
    from spotfill.storage.base import open_storage
    return len(open_storage(output).list("_commits/"))


def ids_in_output(output: str) -> list[str]:
    """Every id a reader of the output's parquet sees (read here, not by the job)."""
    import pyarrow.parquet as pq

    from spotfill.storage.base import open_storage
    out = open_storage(output)
    ids = []
    for key in out.list():
        if key.endswith(".parquet") and not key.startswith("_"):
            ids += pq.read_table(io.BytesIO(out.get_bytes(key))).column("id").to_pylist()
    return ids


def expected_ids(eval_rows: int, prompts: int) -> list[str]:
    return sorted([f"eval/{r}" for r in range(eval_rows)] + [f"generate/p{i:03d}" for i in range(prompts)])


def test_eval_loss_equals_an_independent_forward_and_every_row_lands_once_on_s3(env, inputs, s3_uri, tmp_path):
    import pyarrow.parquet as pq
    import torch
    import torch.nn.functional as F

    from spotfill.storage.base import open_storage
    from spotfill.train.model import GPT
    from spotfill.config.presets import preset

    cfg = write_config(tmp_path / "evals3.yaml", inputs, s3_uri, units=2, prompts=True, max_tokens=8)
    summary = finish(driver(env, cfg))

    # independent: the weights the test saved, a plain forward over the same rows, token-mean cross-entropy
    net = GPT(preset("tiny", vocab_size=257))
    net.load_state_dict(inputs["state"])
    net.eval()
    with torch.no_grad():
        x = torch.as_tensor(inputs["tokens"], dtype=torch.long)
        logits = net(x[:, :-1])
        want = float(F.cross_entropy(logits.reshape(-1, 257), x[:, 1:].reshape(-1)))
    assert summary["eval"]["loss"] == pytest.approx(want, rel=1e-5), (summary["eval"], want)
    assert summary["eval"]["perplexity"] == pytest.approx(np.exp(want), rel=1e-5)
    assert summary["eval"]["rows"] == EVAL_ROWS and summary["eval"]["tokens"] == EVAL_ROWS * 64

    ids = ids_in_output(s3_uri)
    assert sorted(ids) == expected_ids(EVAL_ROWS, PROMPTS), "every row exactly once"
    assert (summary["rows_target"], summary["rows_written"], summary["duplicates"], summary["missing"]) == (
        EVAL_ROWS + PROMPTS, EVAL_ROWS + PROMPTS, 0, 0)
    assert summary["output"].startswith("s3://") and summary["checkpoint_step"] == 40
    out = open_storage(s3_uri)
    gen = pq.read_table(io.BytesIO(out.get_bytes("generate/part-generate-00000.parquet"))).to_pylist()
    assert [r["prompt_id"] for r in gen] == ["p000", "p001", "p002", "p003"]
    assert all(r["tokens"] <= 8 and r["finish_reason"] in ("stop", "length") for r in gen)


# CI's time budget (`python -m pytest -m slow`); in CI a reclaimed batch job's rows stay exactly once through
# test_jobs_submit (batch via `ray job submit`) and the unit tests of fillin/batch_plan.py
@pytest.mark.slow
def test_a_job_reclaimed_twice_by_training_ends_with_every_row_exactly_once(env, inputs, tmp_path):
    import ray

    output = str(tmp_path / "out")
    proc = driver(env, write_config(tmp_path / "reclaimed.yaml", inputs, output, units=0, max_tokens=48))
    answers = []
    try:
        for round_ in range(2):
            seen = committed_count(output) if os.path.isdir(output) else 0
            wait_for(lambda: proc.poll() is None and os.path.isdir(os.path.join(output, "_commits"))
                     and committed_count(output) >= seen + 3, 120, f"units committed before claim {round_ + 1}")
            answer = ray.get(env["arbiter"].claim.remote(f"train-{round_}", 2, 30.0, 1, 1, 2), timeout=60)
            answers.append(answer)
            assert answer["ok"], answer
            assert proc.poll() is None, "the driver yielded; it was not stopped"
            held = committed_count(output)
            time.sleep(1.5)
            assert committed_count(output) == held, "nothing is committed while training holds every GPU"
            ray.get(env["arbiter"].release_job.remote(f"train-{round_}"), timeout=30)
        summary = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    st = ray.get(env["arbiter"].status.remote(last=200), timeout=30)
    forced = [d for d in st["decisions"] if d["tenant"] == "batch:reclaimed" and d["reason"].startswith("forced")]
    assert not forced, forced
    assert len(summary["stops"]) >= 2 and summary["reclaims"] >= 2, summary
    assert all(s <= 5.0 for s in summary["handback_seconds"]), summary["handback_seconds"]
    assert sorted(ids_in_output(output)) == expected_ids(EVAL_ROWS, PROMPTS)
    assert (summary["duplicates"], summary["missing"], summary["rows_written"]) == (0, 0, EVAL_ROWS + PROMPTS)
    print("\nhand-backs (claim -> GPUs free):", summary["handback_seconds"], "claim waited_s:",
          [a["waited_s"] for a in answers], "driver stop -> released:", [s["released_s"] for s in summary["stops"]])


def test_a_killed_driver_is_rerun_without_duplicates_and_redoes_a_damaged_part(env, inputs, tmp_path):
    from spotfill.storage.base import open_storage

    output = str(tmp_path / "out")
    cfg = write_config(tmp_path / "killed.yaml", inputs, output, units=2, max_tokens=48)
    proc = driver(env, cfg)
    try:
        wait_for(lambda: proc.poll() is None and os.path.isdir(os.path.join(output, "_commits"))
                 and committed_count(output) >= 4, 120, "units committed before the kill")
    finally:
        proc.kill()
        proc.wait(30)
    out = open_storage(output)
    done = committed_count(output)
    assert done < len(range(0, EVAL_ROWS, 16)) + PROMPTS // 4, "killed before the end"
    # a part written without its marker (the driver died between the two) -- here a torn one: redone
    markers = {k.split("/")[-1][:-5] for k in out.list("_commits/")}
    victim = next(f"generate-{i:05d}" for i in range(PROMPTS // 4) if f"generate-{i:05d}" not in markers)
    out.put_bytes(f"generate/part-{victim}.parquet", b"PAR1 torn")
    summary = finish(driver(env, cfg))
    assert summary["resumed"] and summary["units_skipped_at_start"] >= done, summary
    assert sorted(ids_in_output(output)) == expected_ids(EVAL_ROWS, PROMPTS)
    assert (summary["duplicates"], summary["missing"], summary["units_uncommitted"]) == (0, 0, 0)


def _live_map_actors(job_id: str) -> list:
    from ray.util.state import list_actors
    return [a for a in list_actors(filters=[("job_id", "=", job_id), ("state", "!=", "DEAD")], limit=1000)
            if "MapWorker" in (a.class_name or "")]


def test_a_wave_whose_actor_waits_for_a_gpu_no_one_lent_ends_when_its_grant_falls(env, inputs, tmp_path):
    """The GPU a wave was granted is gone before its pool actor is placed (seen in a demo: the node died with
    the lease, and Ray Data started another actor, which waits for a slot). When the grant falls the wave
    must end within its grace -- its waiting actor is killed -- not wait forever while Data's executor spins
    a core; the job then completes exactly once on a later grant."""
    import threading

    import ray

    from spotfill.fillin.batch import run_batch
    from spotfill.config.batch import load_batch_config
    from spotfill.fillin.grant import FixedGrant

    @ray.remote(num_cpus=0, num_gpus=1)
    class Squatter:                              # holds a slot: what the lent GPU's loss leaves the wave
        def ping(self):
            return 1

    squatters = [Squatter.remote() for _ in range(2)]
    ray.get([s.ping.remote() for s in squatters], timeout=60)
    output = str(tmp_path / "out")
    cfg = load_batch_config(write_config(tmp_path / "stuck.yaml", inputs, output, eval_rows=32, prompts=False,
                                         grace_s=8.0), {"grant.units": 1})
    grant, result = FixedGrant(1), {}
    job_id = ray.get_runtime_context().get_job_id()
    thread = threading.Thread(target=lambda: result.update(summary=run_batch(cfg, grant=grant)), daemon=True)
    try:
        thread.start()
        wait_for(lambda: any(a.state == "PENDING_CREATION" for a in _live_map_actors(job_id)), 90,
                 "the wave's actor waiting for a slot")
        t0 = time.monotonic()
        grant.set(0)
        wait_for(lambda: not _live_map_actors(job_id), 30, "the stuck wave's actor gone")
        ended_s = time.monotonic() - t0
        assert thread.is_alive(), "the job waits for a new grant"
    finally:
        for s in squatters:
            ray.kill(s)
        grant.set(1)
    thread.join(180)
    summary = result["summary"]
    # not created yet (it waits for a slot, no unit runs in it): killed at the stop itself, before the
    # grace (8 s here) runs out
    assert ended_s < 8.0, ended_s
    assert summary["stops"] and summary["stops"][0]["killed_actors"] >= 1, summary["stops"]
    assert sorted(ids_in_output(output)) == expected_ids(32, 0)
    assert (summary["duplicates"], summary["missing"]) == (0, 0)

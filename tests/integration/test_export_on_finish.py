"""A real run carries its model to the end: a tiny model trained by one Ray Train worker on an embedded
cluster (the worker loop records the model card in every checkpoint it commits), with
`training.export_on_finish` set -- the finished job's final checkpoint is exported into a Hugging Face folder
that transformers loads, from the card the run carried (not a guess), with report.json's `export` saying so.

Marked slow (about 3 minutes on 2 cores: CI's budget): the same path runs in CI without Ray in
tests/unit/test_export.py::test_a_finished_job_exports_its_final_checkpoint; run this with -m slow.
"""
from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
STEPS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from spotfill.config.job import PrepareConfig, from_mapping
    from spotfill.ray_compat import single_host_loopback
    from spotfill.sim.cluster import LOOPBACK_NODE, worker_env
    from spotfill.train.prepare import prepare

    before = single_host_loopback(True)
    c = Cluster(initialize_head=True, head_node_args={**LOOPBACK_NODE, "num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(**LOOPBACK_NODE, num_cpus=1, resources={"GPU_SLOT": 1})
        ray.init(address=c.address, runtime_env={"env_vars": worker_env()}, log_to_driver=False,
                 logging_level="WARNING")
        data = str(tmp_path_factory.mktemp("data"))
        prepare(from_mapping(PrepareConfig, {"source": os.path.dirname(json.__file__), "output": data,
                                             "seq_len": 64, "suffixes": [".py"]}))
        yield data
    finally:
        ray.shutdown()
        c.shutdown()
        single_host_loopback(before)


def test_a_finished_run_exports_the_model_its_checkpoints_carry(cluster, tmp_path):
    import torch

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.fillin.generate import load_newest
    from spotfill.sim.cluster import worker_env
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    from spotfill.train.job import TrainingJob

    out = tmp_path / "hf"
    cfg = from_mapping(JobConfig, {
        "name": "export-on-finish", "run_dir": str(tmp_path / "run"), "storage": str(tmp_path / "ckpt"),
        "data": {"path": cluster}, "cluster": {"gpu_resource": "GPU_SLOT"},
        "training": {"model": "tiny", "workers": [1, 1], "steps": STEPS, "global_batch": 4,
                     "checkpoint_every": 10, "export_on_finish": str(out)}})
    report = TrainingJob(cfg, runtime_env={"env_vars": worker_env()}).fit()

    run = str(tmp_path / "ckpt" / "export-on-finish")
    store = CheckpointStore(open_storage(run))
    card = store.manifest(store.latest_tag())["meta"]["model"]
    assert (card["kind"], card["preset"], card["tokenizer"]["kind"]) == ("gpt", "tiny", "bytes")
    exp = report["export"]
    assert exp["ok"] and exp["step"] == STEPS and exp["card"] == "carried" and exp["max_abs_diff"] <= 1e-4
    assert json.load(open(os.path.join(cfg.run_dir, "report.json")))["export"]["out"] == str(out)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_newest(store, str(tmp_path / "w")).model
    ids = torch.tensor([tok.encode("def f(x):\n    return x")])
    with torch.no_grad():
        assert float((hf(input_ids=ids).logits - ours(ids)).abs().max()) <= 1e-4

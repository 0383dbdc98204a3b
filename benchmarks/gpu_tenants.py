"""Fill-in tenants on the device Ray assigned them: one batch wave (an evaluation unit and a generation unit),
one sweep trial, and where Ray's assignment puts a process. Ray must be initialised (a cluster whose node
declares `num_gpus`); the GPU check (benchmarks/gpu_check.py) runs this on a real GPU, the integration test
tests/integration/test_tenant_devices.py on a CPU node that declares a GPU.

    batch_wave(root)     BatchJob's real wave (Ray Data, `num_gpus: 1` actors) over a pinned tiny model:
                         each unit's commit marker says where it ran (device, dtype, Ray's gpu_ids)
    sweep_trial(root)    run_sweep with one trial on `GPU` for a few steps: its result says the same
    placements()         a num_gpus=1 and a num_gpus=0 actor: Ray's gpu_ids, CUDA_VISIBLE_DEVICES, and the
                         device and dtype spotfill.devices picks from them
"""
from __future__ import annotations

import io
import json
import os
import time

import numpy as np

SEQ_LEN, ROWS, PROMPTS = 32, 64, ["def f(", "import os\n"]


def write_dataset(path: str, rows: int = ROWS, seq_len: int = SEQ_LEN) -> str:
    """Byte-level token shards of random bytes (train/data.py's format)."""
    from spotfill.storage.base import open_storage
    from spotfill.train.data import BYTE_VOCAB, ShardWriter
    writer = ShardWriter(open_storage(path), seq_len, BYTE_VOCAB, "bytes", rows_per_shard=rows)
    writer.add(np.random.default_rng(0).integers(0, 256, size=(rows, seq_len + 1)))
    writer.close()
    return path


def batch_wave(root: str, max_tokens: int = 8) -> dict:
    """One wave of BatchJob on one `GPU` unit: an eval unit over `ROWS` rows and a generation unit over
    two prompts, with the tiny preset's weights pinned as a training checkpoint would be. Returns the
    commit markers by unit and the summary read back from the output."""
    import torch

    from spotfill.config.job import from_mapping
    from spotfill.fillin import batch, batch_plan as bp
    from spotfill.config.batch import BatchConfig
    from spotfill.fillin.grant import FixedGrant
    from spotfill.storage.base import open_storage
    from spotfill.train.model import build_model

    data = write_dataset(os.path.join(root, "batch-data"))
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS))
    out_uri = os.path.join(root, "batch-out")
    cfg = from_mapping(BatchConfig, {
        "name": "gpu-check", "checkpoint": os.path.join(root, "unused-run"), "output": out_uri,
        "eval": {"data": data, "rows_per_unit": ROWS, "batch_size": 16},
        "generate": {"prompts": prompts, "max_tokens": max_tokens, "rows_per_unit": len(PROMPTS)},
        "cluster": {"gpu_resource": "GPU", "max_units": 1, "grace_s": 30.0}, "grant": {"units": 1}})
    torch.manual_seed(0)
    buf = io.BytesIO()
    torch.save(build_model("tiny", seq_len=SEQ_LEN).state_dict(), buf)
    out = open_storage(out_uri)
    out.put_bytes(bp.MODEL_KEY, buf.getvalue())
    ids, _, sha = batch.read_prompts(prompts)
    plan = {"eval_rows": ROWS, "eval_data": data, "eval_rows_per_unit": ROWS, "generate_rows_per_unit": len(PROMPTS),
            "max_tokens": max_tokens, "temperature": 0.0, "seed": 0, "prompts_sha256": sha, "prompt_ids": ids,
            "checkpoint": cfg.checkpoint, "checkpoint_tag": "pinned-by-test", "checkpoint_step": 0,
            "model": "tiny", "created": time.time(), "name": cfg.name}
    out.put_bytes(bp.PLAN_KEY, json.dumps(plan).encode())
    job = batch.BatchJob(cfg, FixedGrant(1, grace_s=30.0))
    job.plan, job.resumed = plan, False
    t0 = time.perf_counter()
    summary = job.run(wait_timeout_s=60)
    markers = {os.path.basename(k)[:-len(".json")]: json.loads(out.get_bytes(k))
               for k in out.list(f"{bp.COMMITS}/")}
    return {"markers": markers, "rows_written": summary.get("rows_written"), "duplicates": summary.get("duplicates"),
            "missing": summary.get("missing"), "eval": summary.get("eval"), "seconds": round(time.perf_counter() - t0, 2)}


def sweep_trial(root: str, steps: int = 6) -> dict:
    """run_sweep with one trial of the tiny preset on one `GPU` unit (a fixed grant); its result."""
    from spotfill.config.job import from_mapping
    from spotfill.config.sweep import SweepJobConfig
    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import run_sweep

    data = write_dataset(os.path.join(root, "sweep-data"))
    cfg = from_mapping(SweepJobConfig, {
        "name": "gpu-check-sweep", "run_dir": os.path.join(root, "sweep-run"), "storage": os.path.join(root, "sweep-tune"),
        "data": {"path": data},
        "sweep": {"model": "tiny", "steps": steps, "batch": 4, "steps_per_report": steps, "checkpoint_every": steps,
                  "eval_rows": 8, "trials": 1, "search": {"lr": [0.001], "warmup_steps": [0]}, "max_failures": 0},
        "fillin": {"grant": "fixed", "max_units": 1, "grace_s": 30.0},
        "cluster": {"gpu_resource": "GPU", "cpus_per_trial": 1}})
    t0 = time.perf_counter()
    out = run_sweep(cfg, FixedGrant(1, grace_s=30.0))
    r = (out.get("results") or [{}])[0]
    return {"completed": out.get("completed"), "failed": out.get("failed"), "seconds": round(time.perf_counter() - t0, 2),
            **{k: r.get(k) for k in ("device", "dtype", "gpu_ids", "step", "eval_loss", "history_ok", "error")}}


def placements(fake_cuda_devices: int | None = None) -> dict:
    """Where a num_gpus=1 and a num_gpus=0 actor compute. `fake_cuda_devices`: tell torch inside the actors
    that CUDA sees this many devices (tests on a machine without CUDA), so the choice from Ray's
    assignment shows; None: what torch really sees."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self, fake):
            import torch

            from spotfill import devices
            if fake is not None:
                torch.cuda.is_available = lambda: fake > 0
                torch.cuda.device_count = lambda: fake
            device = devices.assigned_device()
            dtype = str(devices.compute_dtype(device)).replace("torch.", "") if fake is None else None
            return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices":
                    os.environ.get("CUDA_VISIBLE_DEVICES"), "device": str(device), "dtype": dtype}

    out = {}
    for name, gpus in (("assigned", 1), ("unassigned", 0)):
        actor = Probe.options(num_gpus=gpus).remote()
        try:
            out[name] = ray.get(actor.where.remote(fake_cuda_devices), timeout=120)
        finally:
            ray.kill(actor)
    return out

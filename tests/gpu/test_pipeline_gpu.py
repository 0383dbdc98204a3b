"""GPU checks of the pipeline path (skipped without CUDA), on one GPU: a one-stage pipeline engine in bf16
under the bubble probe (its CUDA synchronisation at fill points), and bubble fill work on the GPU leaving
the CPU and CUDA RNG states as they were, with the numbers a CPU evaluation gives."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _dist() -> None:
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)


def test_one_stage_pipeline_trains_in_bf16_under_the_probe(tmp_path):
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.pipeline import PipelineRun

    _dist()
    job = from_mapping(JobConfig, {"storage": str(tmp_path), "data": {"path": "/unused"},
                                   "training": {"model": "125m", "global_batch": 8, "steps": 10, "zero_stage": 1,
                                                "pipeline_stages": 1, "micro_batches": 4, "workers": [1]}})
    pipe = PipelineRun(job, 1, 0)
    engine, vocab, _ = pipe.build_engine(job, 512, 32000, "bf16", False, torch.device("cuda", 0))
    assert engine.device.type == "cuda" and pipe.probe._sync is torch.cuda.synchronize
    rows = np.random.default_rng(0).integers(0, vocab, size=(8, 513)).astype(np.int64)
    losses = [pipe.train_step(engine, np.split(rows, pipe.shape.accum)) for _ in range(4)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    last = pipe.probe.last
    assert last.busy_s > 0 and last.bubble_s >= 0 and last.wall_s >= last.busy_s


def test_bubble_fill_on_the_gpu_leaves_rng_states_and_matches_the_cpu(tmp_path):
    from benchmarks.pipeline import make_plan, prepare_local
    from spotfill.fillin.batch import eval_rows, plan_model
    from spotfill.fillin.bubble_fill import BubbleFiller, EvalUnitsWork
    from spotfill.storage.base import open_storage

    data, plan_dir = str(tmp_path / "data"), str(tmp_path / "fill")
    prepare_local(data, min_rows=512)
    make_plan(plan_dir, data, "tiny", rows_per_unit=64)
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    work = EvalUnitsWork(plan_dir, rank=0, world=1, device=torch.device("cuda", 0))
    tokens = work._tokens[:16].copy()
    filler = BubbleFiller(work, sync=torch.cuda.synchronize)
    for _ in range(5):
        filler.fill(0.05, 0.06)
    work.close()
    assert filler.rows >= 16
    assert torch.equal(torch.get_rng_state(), cpu_state) and torch.equal(torch.cuda.get_rng_state(), cuda_state)
    gpu_nll, _ = eval_rows(work.model, tokens)
    cpu_nll, _ = eval_rows(plan_model(open_storage(plan_dir), work.plan), tokens)
    assert np.allclose(gpu_nll, cpu_nll, rtol=1e-3)

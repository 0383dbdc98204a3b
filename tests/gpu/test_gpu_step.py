"""GPU checks (skipped without CUDA): a bf16 DeepSpeed ZeRO-2 step of the 125m preset on one GPU."""
from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bf16_zero2_step_on_gpu():
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.model import build_model
    from spotfill.train.engine import ds_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    job = from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/y"},
                                   "training": {"model": "125m", "global_batch": 8, "steps": 10}})
    model = build_model("125m", seq_len=512)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(job, 8, 1, "bf16", False))
    x = torch.randint(0, 32000, (8, 512), device=engine.device)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(engine(x).float().reshape(-1, 32000), x.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(l == l and l < 20 for l in losses) and losses[-1] < losses[0]


def test_elastic_zero2_checkpoint_loads_into_gpu_tensors(tmp_path):
    """spotfill's elastic ZeRO-2 load (ray_compat.zero_load_elastic) on the GPU: the saved files are read
    memory-mapped on the CPU and copied into the engine's GPU partitions. A fresh engine (other weights)
    loaded from the checkpoint takes the same next step as the engine that saved it; and the window copy the
    other-world-size path uses (train/zero_merge.copy_window) writes into a CUDA tensor."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.engine import build_engine, ds_config, load_checkpoint
    from spotfill.train.model import build_model
    from spotfill.train.zero_merge import copy_window, zero_past

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl", rank=0, world_size=1)
    job = from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/y"},
                                   "training": {"model": "tiny", "global_batch": 4, "steps": 10, "zero_stage": 2}})
    config = ds_config(job, 4, 1, "bf16", False)
    torch.manual_seed(0)
    engine = build_engine(build_model("tiny", vocab_size=257), config)
    x = torch.randint(0, 257, (4, 64), device=engine.device)

    def step(e) -> float:
        loss = F.cross_entropy(e(x).float().reshape(-1, 257), x.reshape(-1))
        e.backward(loss)
        e.step()
        return loss.item()
    step(engine), step(engine)
    engine.save_checkpoint(str(tmp_path), tag="t", client_state={"step": 2}, save_latest=False)
    step(engine)
    expected = step(engine)
    torch.manual_seed(1)
    fresh = build_engine(build_model("tiny", vocab_size=257), config)
    assert load_checkpoint(fresh, str(tmp_path), "t", elastic=True)["step"] == 2
    step(fresh)
    assert step(fresh) == pytest.approx(expected, rel=1e-3)
    dst = torch.full((6,), -1.0, device=engine.device)
    zero_past(dst, 7, 2)
    copy_window(dst, torch.arange(4.0), 0, 2)
    copy_window(dst, torch.arange(4.0, 7.0), 4, 2)
    assert dst.cpu().tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 0.0]

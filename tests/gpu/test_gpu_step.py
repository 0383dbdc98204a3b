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

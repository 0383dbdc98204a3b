"""GPU checks (skipped without CUDA): training's engine (build_engine: DeepSpeed ZeRO-2, bf16, torch's fused
AdamW) trains the 125m preset on one GPU from its first optimizer step, and the device a process is given
follows Ray's assignment (spotfill.devices)."""
from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, BATCH, SEQ = 8, 8, 512


@pytest.fixture(scope="module")
def nccl_world_of_one():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield


def test_bf16_zero2_engine_trains_from_its_first_step(nccl_world_of_one):
    """One batch, repeated: a model that learns memorises it. The first step moves the weights (the warm-up
    gave lr 0 to the first two steps before), and after STEPS steps the loss is down by over a nat from
    ~ln(32000) = 10.4 -- with lr 0 or a broken backward it stays where it started and this fails."""
    import torch.nn.functional as F

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.engine import build_engine, ds_config
    from spotfill.train.model import build_model

    job = from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/y"}, "training": {
        "model": "125m", "global_batch": BATCH, "max_micro_batch": BATCH, "steps": STEPS, "warmup_steps": 2,
        "lr": 1e-3}})
    torch.manual_seed(0)
    engine = build_engine(build_model("125m", seq_len=SEQ), ds_config(job, BATCH, 1, "bf16", False))
    assert engine.device.type == "cuda" and engine.bfloat16_enabled()
    x = torch.randint(0, 32000, (BATCH, SEQ + 1), device=engine.device, generator=torch.Generator(
        device=engine.device).manual_seed(0))
    probe = engine.module.blocks[0].mlp[0].weight
    losses, first_moved = [], None
    for step in range(STEPS):
        before = probe.detach().clone() if step == 0 else None
        loss = F.cross_entropy(engine(x[:, :-1]).float().reshape(-1, 32000), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            first_moved = not torch.equal(before, probe.detach())
    assert all(v == v for v in losses), losses          # no NaN
    assert first_moved, "the first optimizer step left the weights where they were"
    assert losses[-1] < losses[0] - 1.0, losses


def test_a_process_ray_assigned_a_gpu_computes_on_it_in_bf16():
    from spotfill.devices import assigned_device, compute_dtype

    device = assigned_device(gpu_ids=["0"])             # what ray.get_gpu_ids() gives a num_gpus=1 actor
    assert device.type == "cuda" and compute_dtype(device) == torch.bfloat16   # Ampere and newer
    assert assigned_device(gpu_ids=[]).type == "cpu"    # no GPU from Ray: the CPU, though CUDA is here

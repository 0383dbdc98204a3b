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


def test_elastic_zero2_checkpoint_loads_into_gpu_tensors(nccl_world_of_one, tmp_path):
    """spotfill's elastic ZeRO-2 load (ray_compat.zero_load_elastic) on the GPU: the saved files are read
    memory-mapped on the CPU and copied into the engine's GPU partitions. A fresh engine (other weights)
    loaded from the checkpoint takes the same next step as the engine that saved it; and the window copy the
    other-world-size path uses (ray_compat/zero_merge.copy_window) writes into a CUDA tensor."""
    import torch.nn.functional as F

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.engine import build_engine, ds_config, load_checkpoint
    from spotfill.train.model import build_model
    from spotfill.ray_compat.zero_merge import copy_window, zero_past

    job = from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/y"},
                                   "training": {"model": "tiny", "global_batch": 4, "steps": 10, "zero_stage": 2}})
    config = ds_config(job, 4, 1, "bf16", False)
    torch.manual_seed(0)
    engine = build_engine(build_model("tiny", vocab_size=257), config)
    assert engine.device.type == "cuda"
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

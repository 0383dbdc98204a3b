"""GPU check (skipped without CUDA): activation checkpointing on the 125m preset in bf16 -- the same loss
and gradients as without it, less activation memory, and HFU's FLOPs per token count the recomputation."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(recompute: str):
    import torch.nn.functional as F

    from spotfill.train.model import build_model, flops_info

    torch.manual_seed(0)
    model = build_model("125m", seq_len=1024, recompute=recompute).cuda().to(torch.bfloat16)
    x = torch.randint(0, 32000, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = F.cross_entropy(model(x).float().reshape(-1, 32000), x.reshape(-1))
    loss.backward()
    torch.cuda.synchronize()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return loss.item(), grad, torch.cuda.max_memory_allocated() - base, flops_info(model, 1024)


def test_full_recompute_same_step_less_memory_more_hardware_flops():
    loss0, grad0, mem0, info0 = _step("none")
    loss1, grad1, mem1, info1 = _step("full")
    assert loss1 == pytest.approx(loss0, rel=1e-3)
    assert torch.nn.functional.cosine_similarity(grad0, grad1, dim=0).item() > 0.999
    assert mem1 < 0.8 * mem0, (mem0, mem1)
    # 125m: 12 blocks of width 768 -> 12 * (12 * 768^2 + 13 * 768) recomputed parameters, 4*L*h*s attention
    blocks = 12 * (12 * 768 ** 2 + 13 * 768)
    assert info1["hardware_flops_per_token"] - info1["flops_per_token"] == 2 * blocks + 4 * 12 * 768 * 1024
    assert info0["hardware_flops_per_token"] == info0["flops_per_token"]
    print(f"GPU-RECOMPUTE peak activation memory none {mem0 / 2**20:.0f} MiB, full {mem1 / 2**20:.0f} MiB")

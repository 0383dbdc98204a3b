"""training.activation_checkpointing: the model really recomputes what HFU says it does, and HFU counts it.
FLOPs are worked out by hand for the tiny preset; recomputation is counted by hooks on the running model."""
import pytest
import torch
import torch.nn.functional as F

from spotfill.config.errors import ConfigError
from spotfill.config.job import JobConfig, from_mapping
from spotfill.telemetry.throughput import run_utilization
from spotfill.train import model as model_mod
from spotfill.train.model import build_model, flops_info

# tiny preset: vocab V=257, s=64 positions, L=2 layers of width h=64 (4x MLP, untied head).
# One block: 2 LayerNorms 2*(2h) = 256, qkv h*3h+3h = 12,480, proj h*h+h = 4,160, MLP h*4h+4h + 4h*h+h = 33,088
#   -> 49,984; two blocks 99,968.  N = V*h (wte) 16,448 + s*h (wpe) 4,096 + 99,968 + ln_f 128 + V*h (head)
#   16,448 = 137,088.
# model FLOPs/token = 6N + 12*L*h*s with N less the lookups (PaLM): 6 * 116,544 + 98,304 = 797,568
# recompute "full": one more forward of the blocks, 2 x 99,968, and of their attention core, 4*L*h*s = 32,768
# recompute "selective": the attention core alone, 32,768
MODEL_FPT = 797_568.0      # 6N + 12Lhs with N = 116,544: all 137,088 less the lookups wte 16,448, wpe 4,096
HARDWARE_FPT = {"none": MODEL_FPT, "selective": MODEL_FPT + 32_768, "full": MODEL_FPT + 199_936 + 32_768}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_hardware_flops_per_token_by_hand(recompute):
    info = flops_info(build_model("tiny", recompute=recompute), seq_len=64)
    assert info["params"] == 137_088 and info["flops_per_token"] == MODEL_FPT
    assert info["hardware_flops_per_token"] == HARDWARE_FPT[recompute] and info["recompute"] == recompute


def test_hfu_counts_the_recomputed_forward():
    # 1,000 tokens in 0.5 s on 2 GPUs of 1e9 FLOP/s: MFU = 1000 * 797,568 / (0.5 * 2 * 1e9)
    steps = [{"attempt": 0, "tokens": 1000, "step_s": 0.5, "world_size": 2}]
    dev = {"peak_flops_per_gpu": 1e9, "flops_per_token": MODEL_FPT, "hardware_flops_per_token": HARDWARE_FPT["full"]}
    util = run_utilization(steps, {0: dev})
    assert util["mfu"] == pytest.approx(0.797568) and util["hfu"] == pytest.approx(1.030272)


def _one_step(recompute, counts):
    torch.manual_seed(0)
    m = build_model("tiny", recompute=recompute)
    def count_block(*_):        # a pre-hook: checkpoint's recomputation may stop before a block returns
        counts["block"] += 1
    hooks = [b.register_forward_pre_hook(count_block) for b in m.blocks]
    real = model_mod.attention_core

    def counted(q, k, v):
        counts["core"] += 1
        return real(q, k, v)
    model_mod.attention_core = counted
    try:
        x = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(m(x).reshape(-1, 257), x.reshape(-1))
        loss.backward()
    finally:
        model_mod.attention_core = real
        for h in hooks:
            h.remove()
    return loss.item(), [p.grad.clone() for p in m.parameters()]


def test_the_model_recomputes_what_the_flops_count_and_learns_the_same():
    runs = {}
    for recompute in ("none", "selective", "full"):
        counts = {"block": 0, "core": 0}
        runs[recompute] = (counts, *_one_step(recompute, counts))
    # one step, 2 blocks: each block's forward (and its attention core) once, and again in backward when
    # recomputed
    assert runs["none"][0] == {"block": 2, "core": 2}
    assert runs["selective"][0] == {"block": 2, "core": 4}
    assert runs["full"][0] == {"block": 4, "core": 4}
    for recompute in ("selective", "full"):
        assert runs[recompute][1] == pytest.approx(runs["none"][1])
        for g, g0 in zip(runs[recompute][2], runs["none"][2]):
            assert torch.allclose(g, g0, atol=1e-6)


def test_no_recompute_outside_training():
    counts = {"block": 0, "core": 0}
    m = build_model("tiny", recompute="full").eval()
    for b in m.blocks:
        b.register_forward_hook(lambda *_: counts.__setitem__("block", counts["block"] + 1))
    with torch.no_grad():
        m(torch.zeros(1, 8, dtype=torch.long))
    assert counts["block"] == 2


def test_config_accepts_the_modes_and_says_what_is_wrong():
    base = {"storage": "/tmp/x", "data": {"path": "/tmp/y"}}
    cfg = from_mapping(JobConfig, {**base, "training": {"activation_checkpointing": "full"}})
    assert cfg.training.activation_checkpointing == "full"
    assert from_mapping(JobConfig, base).training.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="training.activation_checkpointing.*'some'.*none, selective, full"):
        from_mapping(JobConfig, {**base, "training": {"activation_checkpointing": "some"}})
    with pytest.raises(ConfigError, match="recomputes whole layers"):
        from_mapping(JobConfig, {**base, "training": {"model": "hf:/nowhere", "activation_checkpointing": "selective"}})

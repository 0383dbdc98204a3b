"""Sizing formulas for a decoder-only transformer (pure arithmetic): activations, model states per ZeRO
stage and offload, FLOPs per token, pipeline bubble, checkpoint bytes and IO rates. Their sources are in
planner.py's docstring; planner.py searches configurations with them.
"""
from __future__ import annotations

from spotfill.planning.architecture import Arch

QLORA_BITS_PER_PARAM = 4.127          # 4-bit NF4 + double-quantized constants (QLoRA paper, Sec. 3)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str = "none", flash: bool = False) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit activations, bytes per transformer layer)."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    linear = 34.0 / t if sp else 10.0 + 24.0 / t
    attention = 0.0 if (recompute == "selective" or flash) else 5.0 * a * s / (h * t)
    return s * b * h * (linear + attention)


def activation_bytes(arch: Arch, s: int, b: int, t: int = 1, p: int = 1, m: int = 1, sp: bool = False,
                     recompute: str = "none", flash: bool = False, precision: str = "bf16") -> float:
    """Peak activation bytes on the busiest pipeline stage (1F1B: the first stage holds min(p, m)
    micro-batches of its L/p layers; the last stage holds one plus the 4*s*b*v/t fp32 logits).
    fp32 activations are counted at twice the 16-bit figure."""
    L, h, a = arch.layers, arch.hidden, arch.heads
    per_layer = activation_bytes_per_layer(s, b, h, a, t, sp, recompute, flash)
    working = activation_bytes_per_layer(s, b, h, a, t, sp, "none", flash) if recompute == "full" else 0.0
    logits = 4.0 * s * b * arch.vocab / t
    first = per_layer * (L / p) * min(p, m) + working
    last = per_layer * (L / p) + working + logits
    total = last if p == 1 else max(first, last)
    return total * (2.0 if precision == "fp32" else 1.0)


def model_state_bytes(params: int, arch: Arch, method: str, precision: str, zero: int, offload: str,
                      dp: int, t: int = 1, p: int = 1, n_adapter: int = 0) -> dict:
    """Per-GPU model-state bytes (ZeRO paper Sec. 3-5) plus ZeRO-3 gather buffers and offloaded bytes."""
    w, k = (4, 8) if precision == "fp32" else (2, 12)
    if method == "full":
        par, grad, opt = params * w, params * w, params * k
    else:
        base = params * w
        if method == "qlora":
            quantized = min(params, arch.linear_params_per_layer() * arch.layers)
            base = quantized * QLORA_BITS_PER_PARAM / 8 + (params - quantized) * w
        par, grad, opt = base + n_adapter * w, n_adapter * w, n_adapter * k
    shard = t * p
    par, grad, opt = par / shard, grad / shard, opt / shard
    buffers = 2 * par / max(1, arch.layers // p) if zero == 3 else 0.0  # gathered current + prefetched layer
    opt = opt / dp if zero >= 1 else opt
    grad = grad / dp if zero >= 2 else grad
    par = par / dp if zero >= 3 else par
    host = nvme = 0.0
    if offload != "none":
        # ZeRO-Offload/-Infinity run the optimizer step on the CPU: optimizer states go to `offload`, the
        # gradient partition (ZeRO >= 2) to host memory, and with ZeRO-3 the parameters to `offload`.
        off_gpu, to_host = opt + (par if zero == 3 else 0.0), (grad if zero >= 2 else 0.0)
        opt, par, grad = 0.0, (0.0 if zero == 3 else par), grad - to_host
        host = to_host + (off_gpu if offload == "cpu" else 0.0)
        nvme = off_gpu if offload == "nvme" else 0.0
    return {"params": par, "grads": grad, "optimizer": opt, "buffers": buffers, "host": host, "nvme": nvme}


def flops_per_token(params: int, arch: Arch, seq_len: int, method: str = "full", n_adapter: int = 0,
                    recompute: str = "none", formula: str = "palm") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token. Model: PaLM App. B, 6N + 12*L*h*s (full) or
    4N + 6*N_adapter + 12*L*h*s (LoRA: no weight grads for the frozen base), where N counts the parameters
    that take part in a matmul: `params` less the embedding lookups (arch.lookup_params: the input token
    embedding unless tied to the output layer, a learned position table), which do no multiply-adds;
    formula '6nd' drops the attention term. Hardware adds recompute: one more forward (2N + 2N_adapter +
    4Lhs) with full checkpointing, the attention-core forward (4Lhs) with selective."""
    n = params - arch.lookup_params
    attention = 12.0 * arch.layers * arch.hidden * seq_len if formula == "palm" else 0.0
    dense = 6.0 * n if method == "full" else 4.0 * n + 6.0 * n_adapter
    model = dense + attention
    extra = {"none": 0.0, "selective": attention / 3,
             "full": 2.0 * n + (2.0 * n_adapter if method != "full" else 0.0) + attention / 3}
    return model, model + extra[recompute]


def pipeline_bubble_fraction(p: int, m: int) -> float:
    """Bubble time over ideal compute time for 1F1B/GPipe schedules: (p - 1) / m (Narayanan et al. 2021)."""
    return (p - 1) / m


def checkpoint_bytes(params: int, method: str, precision: str, n_adapter: int = 0) -> float:
    """Full: 16-bit weights + fp32 master + 2 Adam moments = 14 B/param (fp32 training: 4 + 8 = 12).
    LoRA/QLoRA: the adapters and their optimizer states only; the frozen base is not re-saved."""
    per = 12 if precision == "fp32" else 14
    return float((params if method == "full" else n_adapter) * per)


def upload_seconds(nbytes: float, bandwidth_gbps: float) -> float:
    """Seconds to move `nbytes` at `bandwidth_gbps` gigabits/s (1e9 bits/s)."""
    return nbytes * 8 / (bandwidth_gbps * 1e9)


def data_bandwidth_mb_s(tokens_per_s: float, bytes_per_token: float) -> float:
    """Input-pipeline read rate in MB/s (1e6 bytes): tokens/s consumed x bytes per token."""
    return tokens_per_s * bytes_per_token / 1e6

"""Resource planner: memory per GPU, FLOPs, time, cost, pipeline bubble, checkpoint and data IO, and a
DeepSpeed config, for training a decoder-only transformer. Pure arithmetic (no ray/torch/deepspeed).

Formulas and their sources:
* Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3-5): mixed-precision Adam keeps 2 B fp16/bf16
  params + 2 B grads + K=12 B optimizer (fp32 master, momentum, variance) per parameter. ZeRO-1
  partitions the optimizer over the data-parallel degree Nd, ZeRO-2 also the grads, ZeRO-3 also the
  params. Tensor (t) and pipeline (p) parallelism shard the model first; Nd = gpus / (t * p).
  fp32 training: 4 B params + 4 B grads + 8 B Adam moments (no separate master copy).
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 2): per layer s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations; tensor parallel
  without sequence parallel s*b*h*(10 + 24/t + 5*a*s/(h*t)); with sequence parallel
  s*b*h*(34/t + 5*a*s/(h*t)); selective recompute drops the 5as/h term (flash attention likewise);
  full recompute keeps 2*s*b*h per layer (/t with sequence parallel) plus one layer's activations
  for the recompute. 1F1B pipeline: the first stage holds min(p, m) micro-batches of its L/p layers.
  The last stage also holds fp32 logits for the cross-entropy, 4*s*b*v/t bytes (Sec. 4.3).
* FLOPs (Chowdhery et al. 2022, "PaLM", Appendix B): 6N + 12*L*H*Q*T per token (H*Q = hidden,
  T = sequence length). LoRA/QLoRA skip weight gradients of the frozen base: 4N + 6*N_adapter
  + 12*L*h*s. Hardware FLOPs (HFU) add the recomputed forward: 8N (+16*L*h*s) with full
  checkpointing. Chinchilla-optimal tokens = 20 N (Hoffmann et al. 2022).
* Pipeline bubble (Narayanan et al. 2021, Megatron-LM, Sec. 2.2.1): (p - 1) / m.
* QLoRA (Dettmers et al. 2023): NF4 base weights with double quantization, ~4.127 bits/param.
Memory in GB = 1e9 bytes. The model shape (Arch, KNOWN_MODELS, derive_architecture, lora_params) is in
architecture.py; the formulas themselves in sizing.py.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

# Model shape lives in architecture.py; KNOWN_MODELS is re-exported for callers of planner.
from spotfill.planning.architecture import KNOWN_MODELS, Arch, derive_architecture, lora_params  # noqa: F401
from spotfill.config.errors import ConfigError
from spotfill.planning.pipeline_advice import advise, fill_capacity
from spotfill.planning.hardware import GPU, lookup
# The formulas (sources in this docstring) live in sizing.py; re-exported for callers of planner.
from spotfill.planning.sizing import (QLORA_BITS_PER_PARAM, activation_bytes, activation_bytes_per_layer,  # noqa: F401
                             checkpoint_bytes, data_bandwidth_mb_s, flops_per_token, model_state_bytes,
                             pipeline_bubble_fraction, upload_seconds)

GB = 1e9
CHINCHILLA_TOKENS_PER_PARAM = 20      # Hoffmann et al. 2022
OFFLOAD_SLOWDOWN = {"none": 1.0, "cpu": 1.5, "nvme": 2.5}   # assumption: step-time multiplier
DEFAULT_GLOBAL_BATCH = 256            # sequences; rounded up to a multiple of micro_batch * dp
DEFAULT_FINETUNE_TOKENS = 100_000_000  # lora/qlora when --tokens is absent (assumption)
METHODS, PRECISIONS, OFFLOADS = ("full", "lora", "qlora"), ("bf16", "fp16", "fp32"), ("none", "cpu", "nvme")
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64)

DEFAULTS: dict[str, Any] = dict(
    gpu_type="a100-80gb", method="full", precision="bf16", seq_len=2048, tp=1, pp=1, mfu=0.4,
    headroom=0.1, bandwidth_gbps=10.0, bytes_per_token=2, lora_rank=16, lora_targets="all",
    max_gpus=1024, max_hours=720.0, sequence_parallel=False, flash_attention=False,
    flops_formula="palm", nvme_path="/local_nvme")
INPUT_KEYS = set(DEFAULTS) | {
    "params", "gpus", "zero", "offload", "tokens", "micro_batch", "global_batch", "global_batch_tokens",
    "layers", "hidden", "heads", "kv_heads", "vocab", "activation_checkpointing", "micro_batches",
    "price_spot", "price_on_demand"}

_COUNT_RE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmbgt]?)")
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(value: Any, flag: str = "--params") -> int:
    """'7e9', '7B', '7.5B', '350M', '1.3b', '125m', '2T', '70000000000' (or a number) -> positive int."""
    accepted = "a positive count such as 7e9, 7B, 7.5B, 350M, 2T"
    if isinstance(value, bool) or value is None:
        raise ConfigError(flag, value, accepted=accepted)
    if isinstance(value, (int, float)):
        x = float(value)
    else:
        m = _COUNT_RE.fullmatch(str(value).strip().lower().replace("_", "").replace(",", ""))
        if not m:
            raise ConfigError(flag, value, accepted=accepted)
        x = float(m.group(1)) * _SUFFIX[m.group(2)]
    if not math.isfinite(x) or round(x) < 1:
        raise ConfigError(flag, value, reason="must be a positive count", accepted=accepted)
    return int(round(x))


def _number(flag: str, value: Any, kind=int, low: float = 1, high: float = math.inf,
            low_open: bool = False) -> Any:
    """Parse an int/float input; `low`/`high` bound it (low exclusive when low_open)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value)
        if not math.isfinite(x) or (kind is int and x != int(x)):
            raise ValueError
        x = int(x) if kind is int else x
    except (TypeError, ValueError):
        raise ConfigError(flag, value, accepted="an integer" if kind is int else "a number") from None
    if (x <= low if low_open else x < low) or x > high:
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        raise ConfigError(flag, value, reason="out of range",
                          accepted=lo + ("" if high == math.inf else f" and <= {high:g}"))
    return x


def _choice(flag: str, value: Any, choices) -> str:
    v = str(value).strip().lower()
    if v not in choices:
        raise ConfigError(flag, value, accepted=list(choices))
    return v


@dataclass(frozen=True)
class Problem:
    """Everything fixed about the run (resolved, validated)."""

    params: int
    arch: Arch
    gpu: GPU
    method: str
    precision: str
    tokens: int
    seq_len: int
    tp: int
    pp: int
    mfu: float
    headroom: float
    sp: bool
    flash: bool
    n_adapter: int
    global_batch: Optional[int]
    micro_batches: Optional[int]
    max_gpus: int
    max_hours: float
    formula: str


@dataclass(frozen=True)
class Knobs:
    """What the search may choose."""

    zero: Optional[int] = None
    offload: Optional[str] = None
    gpus: Optional[int] = None
    micro_batch: Optional[int] = None
    activation_checkpointing: Optional[str] = None


def _batch(pb: Problem, dp: int, micro: int) -> Optional[tuple[int, int]]:
    """(global batch in sequences, gradient accumulation steps) or None when they do not divide."""
    per_step = micro * dp
    if pb.global_batch is not None:
        if pb.global_batch % per_step:
            return None
        accum = pb.global_batch // per_step
        return (pb.global_batch, accum) if pb.micro_batches in (None, accum) else None
    if pb.micro_batches is not None:
        return per_step * pb.micro_batches, pb.micro_batches
    accum = max(1, -(-DEFAULT_GLOBAL_BATCH // per_step))
    return per_step * accum, accum


def evaluate(pb: Problem, k: Knobs) -> Optional[dict]:
    """Memory, fit, time and cost of one fully chosen configuration; None if the batch cannot split."""
    dp = k.gpus // (pb.tp * pb.pp)
    split = _batch(pb, dp, k.micro_batch)
    if split is None:
        return None
    global_batch, accum = split
    ms = model_state_bytes(pb.params, pb.arch, pb.method, pb.precision, k.zero, k.offload, dp, pb.tp,
                           pb.pp, pb.n_adapter)
    act = activation_bytes(pb.arch, pb.seq_len, k.micro_batch, pb.tp, pb.pp, accum, pb.sp,
                           k.activation_checkpointing, pb.flash, pb.precision)
    states = ms["params"] + ms["grads"] + ms["optimizer"]
    total = states + act + ms["buffers"]
    usable = pb.gpu.memory_gb * GB * (1 - pb.headroom)
    model_fpt, hw_fpt = flops_per_token(pb.params, pb.arch, pb.seq_len, pb.method, pb.n_adapter,
                                        k.activation_checkpointing, pb.formula)
    bubble = pipeline_bubble_fraction(pb.pp, accum)
    peak = pb.gpu.peak_tflops(pb.precision) * 1e12
    seconds = (pb.tokens * hw_fpt / (k.gpus * peak * pb.mfu)) * OFFLOAD_SLOWDOWN[k.offload] * (1 + bubble)
    hours = seconds / 3600
    return {"knobs": k, "dp": dp, "global_batch": global_batch, "accum": accum, "ms": ms, "act": act,
            "states": states, "total": total, "usable": usable, "fits": total <= usable,
            "model_fpt": model_fpt, "hw_fpt": hw_fpt, "bubble": bubble, "seconds": seconds,
            "hours": hours, "gpu_hours": hours * k.gpus, "peak": peak}


def _options(pb: Problem, fixed: Knobs) -> list[Knobs]:
    zeros = [fixed.zero] if fixed.zero is not None else [z for z in range(4) if pb.pp == 1 or z <= 1]
    offloads = [fixed.offload] if fixed.offload is not None else list(OFFLOADS)
    shard = pb.tp * pb.pp
    gpus = [fixed.gpus] if fixed.gpus is not None else \
        [shard * 2 ** i for i in range(64) if shard * 2 ** i <= max(pb.max_gpus, shard)]
    micros = [fixed.micro_batch] if fixed.micro_batch is not None else list(MICRO_BATCH_CHOICES)
    acs = [fixed.activation_checkpointing] if fixed.activation_checkpointing is not None else list(RECOMPUTE)
    return [Knobs(z, o, g, b, a) for z in zeros for o in offloads if _offload_ok(z, o)
            for g in gpus for b in micros for a in acs]


def _offload_ok(zero: int, offload: str) -> bool:
    return offload == "none" or (zero >= 1 and (offload == "cpu" or zero == 3))


def _rank(ev: dict, pb: Problem) -> tuple:
    """Fitting configs: those finishing within max_hours first; then cheapest (spot cost is
    proportional to GPU-hours), then less offload, less recompute, lower ZeRO stage, fewer GPUs,
    larger micro-batch."""
    k = ev["knobs"]
    late = ev["hours"] > pb.max_hours
    return (late, float(f"{ev['hours']:.6g}") if late else 0.0, float(f"{ev['gpu_hours']:.6g}"),
            OFFLOADS.index(k.offload), RECOMPUTE.index(k.activation_checkpointing), k.zero, k.gpus,
            -k.micro_batch)


def search(pb: Problem, fixed: Knobs) -> tuple[Optional[dict], dict, int, int]:
    """(best fitting evaluation or None, closest evaluation by memory, #evaluated, #fitting)."""
    evals = [e for e in (evaluate(pb, k) for k in _options(pb, fixed)) if e is not None]
    if not evals:
        flag = "--micro-batches" if pb.micro_batches else "--global-batch"
        raise ConfigError(flag, pb.micro_batches or pb.global_batch, reason="no micro-batch x data-parallel "
                          "split matches it", accepted="a multiple of micro_batch x dp (dp = gpus / (tp * pp))")
    fitting = [e for e in evals if e["fits"]]
    best = min(fitting, key=lambda e: _rank(e, pb)) if fitting else None
    closest = min(evals, key=lambda e: (e["total"], _rank(e, pb)))
    return best, closest, len(evals), len(fitting)


def deepspeed_config(*, zero: int, offload: str, micro_batch: int, grad_accum: int, dp: int,
                     precision: str = "bf16", activation_checkpointing: str = "none", method: str = "full",
                     total_steps: int = 1000, tp: int = 1, nvme_path: str = "/local_nvme") -> dict:
    """A DeepSpeed JSON config; train_batch_size = micro_batch * grad_accum * dp."""
    zo: dict[str, Any] = {"stage": zero, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": int(5e8)}
    if zero in (1, 2):
        zo["allgather_bucket_size"] = int(5e8)
    if zero == 3:
        zo.update(stage3_prefetch_bucket_size=int(5e7), stage3_param_persistence_threshold=int(1e5),
                  stage3_max_live_parameters=int(1e9), stage3_gather_16bit_weights_on_model_save=False)
    if offload != "none":
        dev = {"device": offload, "pin_memory": True}
        if offload == "nvme":
            dev["nvme_path"] = nvme_path
        zo["offload_optimizer"] = dict(dev)
        if zero == 3:
            zo["offload_param"] = dict(dev)
    warmup = max(1, min(2000, total_steps // 100))
    lr, wd = (3e-4, 0.1) if method == "full" else (2e-4, 0.0)
    cfg: dict[str, Any] = {
        "train_batch_size": micro_batch * grad_accum * dp,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "zero_optimization": zo,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": wd}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    if activation_checkpointing != "none":
        cfg["activation_checkpointing"] = {
            "partition_activations": tp > 1, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
            "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _resolve(inputs: dict) -> tuple[Problem, Knobs, dict]:
    """Validate every input; return the problem, the user-fixed knobs and the echo of inputs."""
    unknown = sorted(set(inputs) - INPUT_KEYS)
    if unknown:
        raise ConfigError("plan", unknown[0], accepted=sorted(INPUT_KEYS))
    given = {k: v for k, v in inputs.items() if v is not None}
    v = {**DEFAULTS, **given}
    if "params" not in given:
        raise ConfigError("--params", None, reason="required", accepted="a count such as 7B, 7e9, 350M")
    params = parse_count(v["params"], "--params")
    gpu = lookup(v["gpu_type"])
    method = _choice("--method", v["method"], METHODS)
    precision = _choice("--precision", v["precision"], PRECISIONS)
    seq_len = _number("--seq-len", v["seq_len"])
    tp, pp = _number("--tp", v["tp"]), _number("--pp", v["pp"])
    mfu = _number("--mfu", v["mfu"], float, 0, 1, low_open=True)
    headroom = _number("--headroom", v["headroom"], float, 0, 0.99)
    opt_int = {k: (_number("--" + k.replace("_", "-"), given[k]) if k in given else None)
               for k in ("layers", "hidden", "heads", "kv_heads", "vocab", "gpus", "micro_batch",
                         "micro_batches", "global_batch")}
    arch = derive_architecture(params, opt_int["layers"], opt_int["hidden"], opt_int["heads"],
                               opt_int["kv_heads"], opt_int["vocab"])
    if arch.hidden % arch.heads:
        raise ConfigError("--heads", arch.heads, reason=f"must divide hidden size {arch.hidden}",
                          accepted=[d for d in range(1, 257) if arch.hidden % d == 0])
    if arch.heads % arch.kv_heads:
        raise ConfigError("--kv-heads", arch.kv_heads, reason=f"must divide heads {arch.heads}")
    if arch.heads % tp:
        raise ConfigError("--tp", tp, reason=f"must divide attention heads {arch.heads}",
                          accepted=[d for d in range(1, arch.heads + 1) if arch.heads % d == 0])
    if pp > arch.layers or arch.layers % pp:
        raise ConfigError("--pp", pp, reason=f"must divide layers {arch.layers}",
                          accepted=[d for d in range(1, arch.layers + 1) if arch.layers % d == 0])
    zero = _choice("--zero", given["zero"], ("0", "1", "2", "3")) if "zero" in given else None
    zero = None if zero is None else int(zero)
    offload = _choice("--offload", given["offload"], OFFLOADS) if "offload" in given else None
    ac = given.get("activation_checkpointing")
    if ac is not None:
        ac = {True: "full", False: "none"}.get(ac, ac) if isinstance(ac, bool) else \
            _choice("--activation-checkpointing", ac, RECOMPUTE)
    if zero is not None and offload is not None and not _offload_ok(zero, offload):
        raise ConfigError("--offload", offload, reason=f"not possible with --zero {zero}: DeepSpeed offloads "
                          "the optimizer from ZeRO-1 up, to NVMe only with ZeRO-3",
                          accepted=[o for o in OFFLOADS if _offload_ok(zero, o)])
    if pp > 1 and zero is not None and zero >= 2:
        raise ConfigError("--zero", zero, reason="DeepSpeed pipeline parallelism (--pp > 1) supports "
                          "ZeRO stage 0 or 1 only", accepted=[0, 1])
    if offload == "nvme" and pp > 1:
        raise ConfigError("--offload", offload, reason="NVMe offload needs ZeRO-3, which --pp > 1 excludes",
                          accepted=["none", "cpu"])
    gpus, shard = opt_int["gpus"], tp * pp
    if gpus is not None and gpus % shard:
        raise ConfigError("--gpus", gpus, reason=f"must be a multiple of tp*pp = {shard}")
    global_batch = opt_int["global_batch"]
    if "global_batch_tokens" in given:
        if global_batch is not None:
            raise ConfigError("--global-batch-tokens", given["global_batch_tokens"],
                              reason="give --global-batch (sequences) or --global-batch-tokens, not both")
        seqs = parse_count(given["global_batch_tokens"], "--global-batch-tokens") / seq_len
        dp = gpus // shard if gpus is not None and gpus % shard == 0 else None   # round to a usable count
        global_batch = max(dp, round(seqs / dp) * dp) if dp else 2 ** max(0, round(math.log2(max(seqs, 1))))
    if gpus is not None and global_batch is not None and global_batch % (gpus // shard):
        raise ConfigError("--global-batch", global_batch, reason=(
            f"must be a multiple of the data-parallel degree {gpus // shard} (gpus / (tp * pp))"))
    n_adapter = 0
    if method != "full":
        n_adapter = lora_params(arch, _number("--lora-rank", v["lora_rank"]),
                                _choice("--lora-targets", v["lora_targets"], ("attention", "all")))
    default_tokens = params * CHINCHILLA_TOKENS_PER_PARAM if method == "full" else DEFAULT_FINETUNE_TOKENS
    tokens = parse_count(given["tokens"], "--tokens") if "tokens" in given else default_tokens
    pb = Problem(params, arch, gpu, method, precision, tokens, seq_len, tp, pp, mfu, headroom,
                 bool(v["sequence_parallel"]), bool(v["flash_attention"]), n_adapter, global_batch,
                 opt_int["micro_batches"], _number("--max-gpus", v["max_gpus"]),
                 _number("--max-hours", v["max_hours"], float, 0, low_open=True),
                 _choice("--flops-formula", v["flops_formula"], ("palm", "6nd")))
    if pb.gpu.peak_tflops(precision) is None:
        raise ConfigError("--precision", precision, reason=f"not supported by {gpu.name}")
    prices = {k: _number("--" + k.replace("_", "-"), v.get(k, getattr(gpu, k)), float, 0)
              for k in ("price_spot", "price_on_demand")}
    echo = {"params": params, "gpu_type": gpu.name, "method": method, "precision": precision,
            "tokens": tokens, "tokens_source": "given" if "tokens" in given else (
                "default: Chinchilla 20 x params" if method == "full" else "default: 1e8 fine-tuning tokens"),
            "seq_len": seq_len, "layers": arch.layers, "hidden": arch.hidden, "heads": arch.heads,
            "kv_heads": arch.kv_heads, "ffn_hidden": arch.ffn, "vocab": arch.vocab, "mlp": arch.mlp,
            "architecture_source": arch.source, "tp": tp, "pp": pp, "sequence_parallel": pb.sp,
            "flash_attention": pb.flash, "mfu": mfu, "headroom": headroom,
            "bandwidth_gbps": _number("--bandwidth-gbps", v["bandwidth_gbps"], float, 0, low_open=True),
            "bytes_per_token": _number("--bytes-per-token", v["bytes_per_token"], float, 0, low_open=True),
            **prices, "price_source": "given" if {"price_spot", "price_on_demand"} <= set(given) else
            "catalogue default (assumption) unless given", "max_gpus": pb.max_gpus, "max_hours": pb.max_hours,
            "flops_formula": pb.formula, "nvme_path": str(v["nvme_path"]),
            "micro_batches": pb.micro_batches, "global_batch_unit": "sequences of seq_len tokens"}
    if method != "full":
        echo.update(lora_rank=int(v["lora_rank"]), lora_targets=str(v["lora_targets"]).lower(),
                    lora_params=n_adapter)
    return pb, Knobs(zero, offload, gpus, opt_int["micro_batch"], ac), echo


def _knobs_dict(ev: dict) -> dict:
    k = ev["knobs"]
    return {"zero": k.zero, "offload": k.offload, "gpus": k.gpus, "micro_batch": k.micro_batch,
            "gradient_accumulation_steps": ev["accum"], "global_batch": ev["global_batch"],
            "activation_checkpointing": k.activation_checkpointing}


def _pipeline_row(ev: dict, pb: Problem) -> dict:
    """A stage-count candidate's row (planning/pipeline_advice.py)."""
    k = ev["knobs"]
    steps = math.ceil(pb.tokens / (ev["global_batch"] * pb.seq_len))
    return {"micro_batches": ev["accum"], "micro_batch": k.micro_batch, "gpus": k.gpus, "zero": k.zero,
            "offload": k.offload, "memory_per_gpu_gb": ev["total"] / GB, "gpu_hours": ev["gpu_hours"],
            "train_time_hours": ev["hours"], "step_seconds": ev["seconds"] / steps, "peak_flops": ev["peak"]}


def _flags(ev: dict) -> str:
    k = ev["knobs"]
    return (f"--zero {k.zero} --offload {k.offload} --gpus {k.gpus} --micro-batch {k.micro_batch} "
            f"--activation-checkpointing {k.activation_checkpointing}")


def plan(**inputs: Any) -> dict:
    """Plan a training run; returns the CONTRACTS "Planner JSON". Keys mirror the CLI flags
    (params, gpus, gpu_type, zero, offload, method, precision, tokens, seq_len, micro_batch,
    global_batch, ...). Knobs left unset (zero, offload, gpus, micro_batch, activation_checkpointing)
    are filled from the cheapest fitting configuration; `recommendation` searches all of them
    (GPU count only when --gpus is unset)."""
    pb, fixed, echo = _resolve(inputs)
    open_knobs = Knobs(gpus=fixed.gpus)
    rec_best, rec_closest, r_eval, r_fit = search(pb, open_knobs)
    # The recommendation searches every knob; the plan only those the caller left unset (often the same).
    best, closest = (rec_best, rec_closest) if fixed == open_knobs else search(pb, fixed)[:2]
    chosen = best or closest
    rec = rec_best or rec_closest
    k = chosen["knobs"]
    ms, act = chosen["ms"], chosen["act"]
    price_spot, price_od = echo["price_spot"], echo["price_on_demand"]
    tokens_per_s = pb.tokens / chosen["seconds"]
    ckpt = checkpoint_bytes(pb.params, pb.method, pb.precision, pb.n_adapter)
    steps = math.ceil(pb.tokens / (chosen["global_batch"] * pb.seq_len))
    echo.update(_knobs_dict(chosen), dp=chosen["dp"], global_batch_tokens=chosen["global_batch"] * pb.seq_len,
                auto_selected=[f for f in ("zero", "offload", "gpus", "micro_batch", "activation_checkpointing")
                               if getattr(fixed, f) is None])
    recompute_factor = chosen["hw_fpt"] / chosen["model_fpt"]
    rec_out = {"found": rec_best is not None, **_knobs_dict(rec), "flags": _flags(rec),
               "memory_per_gpu_gb": rec["total"] / GB, "fits": rec["fits"],
               "train_time_hours": rec["hours"], "gpu_hours": rec["gpu_hours"],
               "cost_usd": {"spot": rec["gpu_hours"] * price_spot, "on_demand": rec["gpu_hours"] * price_od},
               "offload_slowdown": OFFLOAD_SLOWDOWN[rec["knobs"].offload],
               "matches_requested": rec["knobs"] == k, "candidates_evaluated": r_eval, "candidates_fitting": r_fit,
               "searched": f"zero 0-3 (0-1 with --pp > 1) x offload none/cpu/nvme x gpus "
                           f"{fixed.gpus or f'tp*pp*2^k <= {pb.max_gpus}'} x micro-batch 1-64 x recompute none/"
                           "selective/full",
               "ranking": ("fits in usable memory; finishes within --max-hours; lowest GPU-hours (cost); then "
                           "less offload, less recompute, lower ZeRO stage, fewer GPUs, larger micro-batch")}
    if rec_best is None:
        rec_out["reason"] = "no searched configuration fits; the one needing the least memory is shown"
    pipeline = advise(pb, Knobs(zero=fixed.zero, gpus=fixed.gpus, micro_batch=fixed.micro_batch), search,
                      lambda ev: _pipeline_row(ev, pb))
    pipeline["this_plan"] = fill_capacity(pb.pp, chosen["accum"], chosen["gpu_hours"], chosen["seconds"] / steps,
                                          pb.params, chosen["peak"], pb.mfu)
    return {
        "inputs": echo,
        "memory_per_gpu_gb": {"params": ms["params"] / GB, "grads": ms["grads"] / GB,
                              "optimizer": ms["optimizer"] / GB, "model_states": chosen["states"] / GB,
                              "activations": act / GB, "buffers": ms["buffers"] / GB,
                              "total": chosen["total"] / GB},
        "offload_memory_gb": {"host_per_gpu": ms["host"] / GB, "nvme_per_gpu": ms["nvme"] / GB,
                              "host_total": ms["host"] * k.gpus / GB, "nvme_total": ms["nvme"] * k.gpus / GB},
        "fits": chosen["fits"], "gpu_memory_gb": float(pb.gpu.memory_gb),
        "usable_gpu_memory_gb": chosen["usable"] / GB, "headroom_fraction": pb.headroom,
        "fits_rule": f"total <= gpu_memory_gb * (1 - headroom) = {chosen['usable'] / GB:.2f} GB "
                     f"(headroom {pb.headroom:.0%} for CUDA context, allocator fragmentation, comm buffers)",
        "total_flops": pb.tokens * chosen["model_fpt"],
        "flops_formula": ("6*N*D + 12*L*h*s*D (PaLM, Chowdhery et al. 2022, App. B)" if pb.formula == "palm"
                          else "6*N*D (Kaplan et al. 2020)") + ("" if pb.method == "full" else
                                                                 "; LoRA: 4*N*D + 6*N_adapter*D for dense"),
        "flops_6nd": 6.0 * pb.params * pb.tokens, "flops_per_token": chosen["model_fpt"],
        "hardware_flops": pb.tokens * chosen["hw_fpt"],
        "hardware_flops_formula": "model FLOPs + recomputed forward (8N per token with full checkpointing)",
        "tokens": pb.tokens, "chinchilla_tokens": CHINCHILLA_TOKENS_PER_PARAM * pb.params,
        "peak_tflops_per_gpu": chosen["peak"] / 1e12,
        "expected_mfu": pb.tokens * chosen["model_fpt"] / (chosen["seconds"] * k.gpus * chosen["peak"]),
        "slowdowns": {"recompute": recompute_factor, "offload": OFFLOAD_SLOWDOWN[k.offload],
                      "pipeline_bubble": 1 + chosen["bubble"]},
        "train_time_hours": chosen["hours"], "gpu_hours": chosen["gpu_hours"],
        "cost_usd": {"spot": chosen["gpu_hours"] * price_spot, "on_demand": chosen["gpu_hours"] * price_od},
        "tokens_per_second": tokens_per_s, "train_steps": steps,
        "pipeline_bubble_fraction": chosen["bubble"],
        "pipeline": pipeline,
        "checkpoint_size_gb": ckpt / GB,
        "checkpoint_upload_seconds": upload_seconds(ckpt, echo["bandwidth_gbps"]),
        "data_bandwidth_mb_s": data_bandwidth_mb_s(tokens_per_s, echo["bytes_per_token"]),
        "recommendation": rec_out,
        "deepspeed_config": deepspeed_config(
            zero=k.zero, offload=k.offload, micro_batch=k.micro_batch, grad_accum=chosen["accum"],
            dp=chosen["dp"], precision=pb.precision, activation_checkpointing=k.activation_checkpointing,
            method=pb.method, total_steps=steps, tp=pb.tp, nvme_path=echo["nvme_path"]),
        "assumptions": [
            f"time = hardware FLOPs / (gpus x dense peak x mfu {pb.mfu}) x offload slowdown x (1 + bubble); "
            f"offload slowdown assumed {OFFLOAD_SLOWDOWN}",
            "fp32 precision runs on TF32 tensor cores; fp32 activations count double",
            "checkpoint upload uses --bandwidth-gbps as the job's aggregate bandwidth to storage",
            "ZeRO-3 'buffers' = two layers of gathered parameters (current + prefetched)",
            "activations assume standard attention unless --flash-attention (drops the 5as/h term)",
            "CPU/NVMe offload moves optimizer states, ZeRO>=2 gradient partitions (to host memory) and, "
            "with ZeRO-3, parameters off the GPU",
            "qlora: linear layers at 4.127 bits/param, embeddings and norms in 16-bit; optimizer "
            "states counted on GPU (a paged optimizer can spill them to host memory)",
        ],
    }

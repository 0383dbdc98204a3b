"""Throughput and FLOPs utilisation from measured steps (pure: no Ray, torch or clock of its own).

    tokens/s  = tokens of the step / step seconds
    MFU       = tokens/s x model FLOPs per token / (GPUs x dense peak FLOP/s per GPU)
    HFU       = the same with hardware FLOPs per token (model FLOPs + activation recompute)

FLOPs per token are the planner's (spotfill.planning.sizing.flops_per_token: PaLM App. B, 6N + 12*L*h*s
with N the parameters that enter a matmul -- embedding lookups left out -- plus one recomputed forward with
full activation checkpointing); the peak is the GPU catalogue's dense
tensor-core figure (spotfill.planning.hardware) for the detected device and the training precision. On a CPU,
on a GPU the catalogue does not know, or in fp32 without TF32 tensor cores, the peak is unknown and MFU/HFU
are None -- never an invented number.

The step split: rank 0 times each step's phases (worker_loop.py); `split_step` turns the marks into
data_wait / forward_backward / optimizer / collective_wait seconds that add up to the step's wall time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

from spotfill.planning.architecture import Arch
from spotfill.telemetry.events import step_totals
from spotfill.planning.hardware import lookup
from spotfill.planning.sizing import flops_per_token as _planner_flops_per_token


def catalogue_name(device_name: str | None) -> str | None:
    """The GPU catalogue entry for a CUDA device name ("NVIDIA H100 80GB HBM3" -> h100-80gb), else None."""
    if not device_name:
        return None
    n = device_name.lower()
    for key, name in (("h200", "h200"), ("b200", "b200"), ("l40s", "l40s"), ("a10g", "a10g"),
                      ("a6000", "a6000")):
        if key in n:
            return name
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-80gb"
    if "a100" in n:
        return "a100-40gb" if "40gb" in n else "a100-80gb"
    if re.search(r"\bl4\b", n):
        return "l4"
    return None


def peak_precision(precision: str, tf32_allowed: bool) -> str | None:
    """The catalogue column a training precision runs at: bf16/fp16 on their tensor cores; fp32 on TF32
    tensor cores only when torch allows TF32 matmuls (else plain FP32 units, which the catalogue does not
    list: None)."""
    if precision in ("bf16", "fp16", "fp8"):
        return precision
    if precision in ("fp32", "tf32"):
        return "tf32" if tf32_allowed else None
    return None


def peak_flops_per_gpu(device_name: str | None, precision: str, tf32_allowed: bool = False) -> float | None:
    """Dense peak FLOP/s of one GPU for `precision` (None: CPU, unknown GPU or no catalogued peak)."""
    name, column = catalogue_name(device_name), peak_precision(precision, tf32_allowed)
    if name is None or column is None:
        return None
    tflops = lookup(name).peak_tflops(column)
    return None if tflops is None else tflops * 1e12


def flops_per_token(n_params: int, layers: int, hidden: int, heads: int, seq_len: int,
                    recompute: str = "none", vocab: int = 0, positions: int = 0,
                    tied: bool = False) -> tuple[float, float]:
    """(model, hardware) FLOPs per trained token of a decoder, by the planner's formula. `n_params`: all
    its parameters; the lookups of a `vocab` x `hidden` token embedding (unless `tied` to the output
    layer) and of a learned table of `positions` are left out of N."""
    arch = Arch(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab,
                mlp="gelu", source="model", tied=tied, positions=positions)
    return _planner_flops_per_token(n_params, arch, seq_len, recompute=recompute)


def recompute_flops_per_token(recompute: str, recomputed_params: int, layers: int, hidden: int,
                              seq_len: int) -> float:
    """FLOPs per token of the forward that activation checkpointing runs again in backward: "full" reruns
    the checkpointed layers (2 FLOPs per recomputed parameter, `recomputed_params`) and their attention
    core (4*L*h*s, the forward third of the 12*L*h*s attention term); "selective" the attention core only;
    "none" nothing."""
    core = 4.0 * layers * hidden * seq_len
    return {"none": 0.0, "selective": core, "full": 2.0 * recomputed_params + core}[recompute]


def tokens_per_s(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds and seconds > 0 else None


def utilization(tokens: float, seconds: float, flops_per_tok: float | None, gpus: float,
                peak_per_gpu: float | None) -> float | None:
    """Achieved FLOP/s over the GPUs' peak: tokens x FLOPs/token / (seconds x GPUs x peak)."""
    if not (flops_per_tok and peak_per_gpu and gpus and seconds and seconds > 0):
        return None
    return tokens * flops_per_tok / (seconds * gpus * peak_per_gpu)


@dataclass(frozen=True)
class StepSplit:
    step_s: float
    data_wait_s: float
    forward_backward_s: float | None        # None: the device could not time the phases
    optimizer_s: float | None
    collective_wait_s: float | None         # the rest: the step's collective, where ranks wait for the slowest

    def as_event(self) -> dict:
        return {"step_s": self.step_s, "data_wait_s": self.data_wait_s,
                "compute_s": self.step_s - self.data_wait_s, "forward_backward_s": self.forward_backward_s,
                "optimizer_s": self.optimizer_s, "collective_wait_s": self.collective_wait_s}


def split_step(step_s: float, data_wait_s: float, forward_backward_s: float | None,
               optimizer_s: float | None) -> StepSplit:
    """The step's wall time split so the parts add up to it. Forward+backward and optimizer are measured
    (host timers on a CPU, CUDA events on a GPU, where the host runs ahead of the device); collective wait
    is what remains: the step's gather of every rank's flags -- where a rank waits for the slowest one --
    and the host sync that ends the step. Measured parts that overrun the wall time (clock skew between
    device events and host timers) are scaled down to fit, leaving no collective wait."""
    data_wait_s = min(max(0.0, data_wait_s), step_s)
    if forward_backward_s is None or optimizer_s is None:
        return StepSplit(step_s, data_wait_s, None, None, None)
    fb, opt = max(0.0, forward_backward_s), max(0.0, optimizer_s)
    room = step_s - data_wait_s
    if fb + opt > room:
        scale = room / (fb + opt) if fb + opt > 0 else 0.0
        fb, opt = fb * scale, opt * scale
    return StepSplit(step_s, data_wait_s, fb, opt, max(0.0, room - fb - opt))


def step_metrics(tokens: int, split: StepSplit, gpus: float, model_fpt: float | None,
                 hardware_fpt: float | None, peak_per_gpu: float | None) -> dict:
    """A step event's throughput fields: tokens_per_s, mfu, hfu (None where the peak is unknown)."""
    return {"tokens_per_s": tokens_per_s(tokens, split.step_s),
            "mfu": utilization(tokens, split.step_s, model_fpt, gpus, peak_per_gpu),
            "hfu": utilization(tokens, split.step_s, hardware_fpt, gpus, peak_per_gpu)}


def run_utilization(steps: Iterable[dict], devices: dict, gpus_per_worker: float = 1.0) -> dict:
    """MFU and HFU over many steps: sum of FLOPs done / sum of (step seconds x GPUs x peak). `steps`: step
    events (tokens, step_s, world_size, attempt); `devices`: attempt -> its start/resume event (with
    flops_per_token, hardware_flops_per_token, peak_flops_per_gpu). Any step whose device peak or FLOPs
    are unknown makes the whole run's figure None: a partial figure would be invented for the rest."""
    done_m = done_h = capacity = 0.0
    n = 0
    for e in steps:
        d = devices.get(e.get("attempt")) or {}
        peak, fm, fh = d.get("peak_flops_per_gpu"), d.get("flops_per_token"), d.get("hardware_flops_per_token")
        if not (peak and fm and fh and e.get("step_s")):
            return {"mfu": None, "hfu": None}
        n += 1
        tokens = step_totals(e, "tokens")     # an event may stand for many steps (events.step_span)
        done_m += tokens * fm
        done_h += tokens * fh
        capacity += step_totals(e, "step_s") * e["world_size"] * gpus_per_worker * peak
    if not n or capacity <= 0:
        return {"mfu": None, "hfu": None}
    return {"mfu": done_m / capacity, "hfu": done_h / capacity}


def split_totals(steps: Iterable[dict]) -> dict:
    """Seconds per phase summed over step events (phases a step did not measure count as absent)."""
    keys = ("data_wait_s", "forward_backward_s", "optimizer_s", "collective_wait_s", "compute_s", "step_s")
    out: dict[str, Optional[float]] = {k: None for k in keys}
    for e in steps:
        for k in keys:
            v = step_totals(e, k, None)
            if v is not None:
                out[k] = (out[k] or 0.0) + v
    return out

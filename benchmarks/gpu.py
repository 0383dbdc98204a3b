"""Training throughput, MFU and HFU on one CUDA GPU (the "gpu" section; None without CUDA).

    python benchmarks/gpu.py [--preset 1b[,125m]] [--quick] [--baseline] [--json PATH]

The engine training builds (spotfill.train.engine.build_engine: DeepSpeed ZeRO-2, bf16, torch's fused
AdamW as the client optimizer, spotfill's ds_config) at world size 1 over a preset on random tokens at its
sequence length. Micro-batch: the largest of 16, 8, 4, 2, 1 whose memory estimate (`memory_estimate`: the
planner's activations and ZeRO-2 model states, spotfill.planning.sizing, plus the cross-entropy's logits)
fits the device's free memory less 10% headroom, then smaller ones on an out-of-memory; each try builds a
fresh model (a model a failed engine hooked is never reused), an out-of-memory leaves no reference to the
failed try behind (the error is kept as text: its traceback's frames hold the engine and the activations)
and the cached memory goes back before the next try -- any other error surfaces as it is. Each step is the worker loop's own (worker_loop._train_step: a host batch
in, forward, backward, optimizer step). Tokens/s over steady steps (after warm-up, CUDA-synchronised); the step
split (forward+backward, optimizer, the rest) from CUDA events (train.step_timer, as rank 0 times
training's steps); MFU = tokens/s x model FLOPs per token (train.model.model_flops: PaLM App. B, 6N +
12*L*h*s, N without the embedding lookups) / the device's dense bf16 peak (planning.hardware; None when
the device is not catalogued); HFU with hardware FLOPs (= model FLOPs: the presets recompute nothing).
`--baseline`: the same model, batch and fused AdamW in plain PyTorch with bf16 weights (no DeepSpeed, no
fp32 master weights), side by side: the ceiling the engine's MFU is held against.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import emit, free_port, quiet_deepspeed, rnd, scoped_env  # noqa: E402
from spotfill.telemetry.throughput import catalogue_name, peak_flops_per_gpu  # noqa: E402

MICRO_BATCHES = (16, 8, 4, 2, 1)
HEADROOM = 0.10          # of the device's memory, left out of what a micro-batch may use (the planner's default)
# The cross-entropy's logits beyond the planner's fp32 copy (4*s*b*v): the model's bf16 logits (2 B) and the
# fp32 log-softmax kept for backward (4 B) -- 10*s*b*v in all, 10.5 GB at 1b x 16 x 2048 (10-13 GB measured)
EXTRA_LOGIT_BYTES = 6.0


def memory_estimate(preset: str, micro: int, precision: str = "bf16", zero: int = 2) -> dict:
    """Bytes one GPU needs to train `preset` at `micro` x its sequence length alone (world size 1): the
    planner's model states (ZeRO paper: 16 B/param mixed precision) and activations (Korthikanti et al.,
    flash attention: the model's scaled_dot_product_attention keeps no s x s scores) plus the logits the
    planner leaves out. Pure arithmetic: no torch."""
    from spotfill.planning.architecture import Arch
    from spotfill.planning.sizing import activation_bytes, model_state_bytes
    from spotfill.config.presets import preset as preset_cfg

    cfg = preset_cfg(preset)
    h, L, v, s = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    arch = Arch(L, h, cfg.n_head, cfg.n_head, 4 * h, v, "gelu", f"preset {preset}", tied=False, positions=s)
    params = 2 * v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h     # train/model.GPT's parameters
    states = model_state_bytes(params, arch, "full", precision, zero, "none", dp=1)
    act = activation_bytes(arch, s, micro, flash=True, precision=precision)
    logits = EXTRA_LOGIT_BYTES * s * micro * v * (2.0 if precision == "fp32" else 1.0)
    model_states = states["params"] + states["grads"] + states["optimizer"]
    return {"params": params, "model_states": model_states, "activations": act + logits,
            "total": model_states + act + logits}


def fitting_micro_batches(preset: str, memory_bytes: float | None, precision: str = "bf16",
                          choices=MICRO_BATCHES, headroom: float = HEADROOM) -> tuple[int, ...]:
    """`choices` from the largest whose memory_estimate fits `memory_bytes` x (1 - headroom) down (the
    smaller ones are the fallbacks on an out-of-memory); all of them when the memory is unknown, the smallest
    alone when none fits."""
    ordered = tuple(sorted(choices, reverse=True))
    if not memory_bytes:
        return ordered
    usable = memory_bytes * (1 - headroom)
    fits = [m for m in ordered if memory_estimate(preset, m, precision)["total"] <= usable]
    return tuple(fits) or ordered[-1:]


def device_memory_bytes() -> float | None:
    """Free memory of CUDA device 0 (what this process's tries can take; torch already holds a context),
    None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(0)
    return float(free)


def first_that_fits(micro_batches, attempt, free_memory=None) -> tuple[int, dict, list[dict]]:
    """(micro-batch, attempt's result, the out-of-memory tries) for the first of `micro_batches` that
    `attempt(micro)` runs without torch.OutOfMemoryError. A failed try leaves nothing behind: its error is
    kept as text only (the exception's traceback holds the frames of the failed engine, its model and the
    activations), the cycles are collected and `free_memory()` returns the cached blocks to the device
    before the next try. Any other error propagates; when none fits, a RuntimeError names the first error."""
    import torch

    ooms: list[dict] = []
    for micro in micro_batches:
        error = None
        try:
            return micro, attempt(micro), ooms
        except torch.OutOfMemoryError as exc:
            error = f"{type(exc).__name__}: {str(exc)[:400]}"
        # here the exception, its traceback and the failed try's frames are gone
        ooms.append({"micro_batch": micro, "error": error})
        gc.collect()
        if free_memory is not None:
            free_memory()
    first = ooms[0]["error"] if ooms else None
    raise RuntimeError(f"does not fit at any micro-batch of {list(micro_batches)}: first error {first}")


def _job(preset: str, micro: int, steps: int):
    from spotfill.config.job import DataConfig, JobConfig, TrainingConfig
    return JobConfig(name="bench-gpu", storage="unused", data=DataConfig(path="unused"),
                     training=TrainingConfig(model=preset, global_batch=micro, max_micro_batch=micro, steps=steps))


def _timed_steps(step, timer, device, warmup: int, steps: int) -> dict:
    """Run `warmup` then `steps` steps; wall seconds of the steady ones and their device-timed split."""
    import torch
    on_cuda = device.type == "cuda"
    for _ in range(warmup):
        step(None)
    if on_cuda:
        torch.cuda.synchronize()
    fb = opt = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(timer)
        if on_cuda:
            torch.cuda.synchronize()      # each step's events are complete before they are read
        f, o = timer.read()
        fb, opt = fb + (f or 0.0), opt + (o or 0.0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "loss": float(loss.item()), "forward_backward_s": fb / steps,
            "optimizer_s": opt / steps, "other_s": max(0.0, seconds / steps - (fb + opt) / steps)}


def _engine_run(preset: str, micro: int, device, precision: str, steps: int, warmup: int) -> dict:
    """One try at `micro`: a fresh model and engine, the timed steps. OutOfMemoryError propagates."""
    import numpy as np
    import torch

    from spotfill.train import engine as engine_mod
    from spotfill.train.worker_loop import _train_step
    from spotfill.train.model import build_model, count_params, model_flops
    from spotfill.train.step_timer import make_timer

    torch.manual_seed(0)
    model = build_model(preset)
    cfg, n_params = model.cfg, count_params(model)
    engine = None
    try:
        config = engine_mod.ds_config(_job(preset, micro, warmup + steps), micro, 1, precision, False)
        engine = engine_mod.build_engine(model, config, device if device.type == "cuda" else None)
        rng = np.random.default_rng(0)

        def step(timer):          # the step the worker loop runs (host batch in, loss summed on the device)
            return _train_step(engine, [rng.integers(0, cfg.vocab_size, size=(micro, cfg.seq_len + 1))],
                               cfg.vocab_size, timer)

        run = _timed_steps(step, make_timer(engine.device), engine.device, warmup, steps)
        opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
        fm, fh = model_flops(cfg, n_params)
        return {**run, "params": n_params, "seq_len": cfg.seq_len, "flops_per_token": fm,
                "hardware_flops_per_token": fh,
                "optimizer": f"torch.optim.{type(opt).__name__}" + (" (fused)" if opt.defaults.get("fused") else "")}
    finally:
        engine = model = None  # noqa: F841 - drop references before the next try


def train_throughput(preset: str, device: str, precision: str, steps: int, warmup: int = 3,
                     micro_batches=MICRO_BATCHES, runner=None) -> dict:
    """Tokens/s of training's engine at world size 1 on `device` ("cuda" or, for testing, "cpu"): the
    first of `micro_batches` (largest first) that fits (first_that_fits: each try builds a fresh model; an
    out-of-memory moves on to the next size, listed in `oom_at`)."""
    import torch
    import torch.distributed as dist

    quiet_deepspeed()
    on_cuda = device == "cuda"
    runner = runner or _engine_run

    allocated: list[float] = []           # at the start of each try: what the earlier ones left behind

    def attempt(micro: int) -> dict:
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            allocated.append(round(torch.cuda.memory_allocated() / 1e9, 3))
        return runner(preset, micro, torch.device(device), precision, steps, warmup)

    with scoped_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                    LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"):
        if on_cuda:
            torch.cuda.set_device(0)
        if not dist.is_initialized():     # one group for the process: DeepSpeed keeps a handle on it
            dist.init_process_group("nccl" if on_cuda else "gloo", rank=0, world_size=1)
        try:
            micro, r, ooms = first_that_fits(micro_batches, attempt, torch.cuda.empty_cache if on_cuda else None)
        except RuntimeError as exc:
            raise RuntimeError(f"{preset} {exc}") from None
    max_mem = torch.cuda.max_memory_allocated() / 1e9 if on_cuda else None
    gc.collect()                          # the engine's cycles: its memory back before the next model
    if on_cuda:
        torch.cuda.empty_cache()
    return {**r, "preset": preset, "precision": precision, "micro_batch": micro, "steps": steps,
            "step_s": r["seconds"] / steps, "tokens_s": micro * r["seq_len"] * steps / r["seconds"],
            "oom_at": [o["micro_batch"] for o in ooms], "oom_errors": [o["error"] for o in ooms],
            "allocated_at_try_gb": allocated, "max_memory_gb": max_mem}


def plain_bf16_throughput(preset: str, micro: int, steps: int, warmup: int = 3) -> dict:
    """The ceiling: the same model and batch in plain PyTorch on CUDA with bf16 weights and torch's fused
    AdamW (no DeepSpeed, no fp32 master weights)."""
    import torch
    import torch.nn.functional as F

    from spotfill.train.model import build_model, count_params, model_flops
    from spotfill.train.step_timer import make_timer

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    model = build_model(preset).to(device=device, dtype=torch.bfloat16)
    cfg = model.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def step(timer):
        tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=device, generator=gen)
        if timer is not None:
            timer.begin()
            timer.mark()
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        if timer is not None:
            timer.backward_done()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if timer is not None:
            timer.step_done()
        return loss

    try:
        run = _timed_steps(step, make_timer(device), device, warmup, steps)
        fm, _ = model_flops(cfg, count_params(model))
        return {**run, "tokens_s": micro * cfg.seq_len * steps / run["seconds"], "flops_per_token": fm,
                "micro_batch": micro}
    finally:
        model = opt = None  # noqa: F841
        gc.collect()
        torch.cuda.empty_cache()


def bench_gpu(quick: bool = True, preset: str | None = None, baseline: bool = False) -> dict | None:
    """The CONTRACTS "gpu" section for one preset: None when CUDA is unavailable."""
    import torch

    if not torch.cuda.is_available():
        return None
    preset = preset or "1b"
    device_name = torch.cuda.get_device_name(0)
    peak = peak_flops_per_gpu(device_name, "bf16")
    t0 = time.perf_counter()
    free = device_memory_bytes()
    sizes = fitting_micro_batches(preset, free)
    r = train_throughput(preset, "cuda", "bf16", steps=8 if quick else 30, micro_batches=sizes)

    def util(tokens_s, fpt):
        return rnd(tokens_s * fpt / peak, 4) if peak else None

    out = {"device": device_name, "catalogue": catalogue_name(device_name),
           "peak_bf16_tflops": rnd(peak / 1e12, 1) if peak else None,
           "mfu": util(r["tokens_s"], r["flops_per_token"]), "hfu": util(r["tokens_s"], r["hardware_flops_per_token"]),
           "tokens_s": rnd(r["tokens_s"], 1), "params": r["params"], "preset": preset, "precision": "bf16",
           "zero_stage": 2, "micro_batch": r["micro_batch"], "oom_at": r["oom_at"], "oom_errors": r["oom_errors"],
           "allocated_at_try_gb": r["allocated_at_try_gb"], "seq_len": r["seq_len"],
           "sized": {"free_memory_gb": rnd(free / 1e9, 2) if free else None, "headroom": HEADROOM,
                     "micro_batches": list(sizes),
                     "estimate_gb": rnd(memory_estimate(preset, sizes[0])["total"] / 1e9, 2)},
           "step_s": rnd(r["step_s"], 4), "steps": r["steps"], "loss": rnd(r["loss"], 4),
           "split_s": {"forward_backward": rnd(r["forward_backward_s"], 4), "optimizer": rnd(r["optimizer_s"], 4),
                       "other": rnd(r["other_s"], 4)},
           "optimizer": r["optimizer"], "flops_per_token": r["flops_per_token"],
           "max_memory_gb": rnd(r["max_memory_gb"], 2),
           "achieved_tflops": rnd(r["tokens_s"] * r["flops_per_token"] / 1e12, 2)}
    if baseline:                          # at the engine's micro-batch; its failure keeps the engine's figures
        out["allocated_before_baseline_gb"] = rnd(torch.cuda.memory_allocated() / 1e9, 2)
        try:
            b = plain_bf16_throughput(preset, r["micro_batch"], steps=4 if quick else 15)
        except Exception as exc:  # noqa: BLE001 - recorded beside the engine's figures
            out["plain_bf16"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        else:
            out["plain_bf16"] = {"tokens_s": rnd(b["tokens_s"], 1), "micro_batch": b["micro_batch"],
                                 "mfu": util(b["tokens_s"], b["flops_per_token"]),
                                 "step_s": rnd(b["seconds"] / (4 if quick else 15), 4),
                                 "split_s": {"forward_backward": rnd(b["forward_backward_s"], 4),
                                             "optimizer": rnd(b["optimizer_s"], 4)}}
            out["ratio_to_plain_bf16"] = rnd(r["tokens_s"] / b["tokens_s"], 4)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b", help="a preset, or several separated by commas")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--baseline", action="store_true", help="also time plain PyTorch with bf16 weights")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    presets = [p for p in args.preset.split(",") if p]
    if len(presets) == 1:
        return emit(bench_gpu(args.quick, presets[0], args.baseline), args.json)
    return emit({p: bench_gpu(args.quick, p, args.baseline) for p in presets}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

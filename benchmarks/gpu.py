"""Training throughput and MFU on one CUDA GPU (the "gpu" section; None without CUDA).

    python benchmarks/gpu.py [--preset 1b] [--quick] [--json PATH]

One DeepSpeed engine (world size 1, NCCL, ZeRO-2, bf16, spotfill's ds_config) of a model preset on random
tokens at the preset's sequence length. Micro-batch: the largest of 16, 8, 4, 2, 1 that fits. Tokens/s
is timed over steady steps (after warm-up, CUDA-synchronised); MFU = tokens/s x FLOPs/token (model.py's
6N + 12*L*h*s, PaLM appendix B) / the device's dense bf16 peak from spotfill.planning.hardware (None when the device
is not in the catalogue). HFU equals MFU: the presets recompute no activations.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import emit, free_port, quiet_deepspeed, rnd, scoped_env  # noqa: E402
from spotfill.telemetry.throughput import catalogue_name  # noqa: E402,F401 (the device -> catalogue rule)


def train_throughput(preset: str, device: str, precision: str, steps: int, warmup: int = 3,
                     micro_batches=(16, 8, 4, 2, 1)) -> dict:
    """Tokens/s of a ZeRO-2 DeepSpeed engine at world size 1 on `device` ("cuda" or, for testing, "cpu")."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from spotfill.config.job import DataConfig, JobConfig, TrainingConfig
    from spotfill.train.model import build_model, count_params, flops_per_token
    from spotfill.train.engine import ds_config

    quiet_deepspeed()
    on_cuda = device == "cuda"
    last_error = None
    with scoped_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                    LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"):
        own_pg = not dist.is_initialized()
        if on_cuda:
            torch.cuda.set_device(0)
        if own_pg:
            dist.init_process_group("nccl" if on_cuda else "gloo", rank=0, world_size=1)
        try:
            for micro in micro_batches:
                engine = None
                try:
                    torch.manual_seed(0)
                    model = build_model(preset)
                    cfg, n_params = model.cfg, count_params(model)
                    job = JobConfig(name="bench-gpu", storage="unused", data=DataConfig(path="unused"),
                                    training=TrainingConfig(model=preset, global_batch=micro,
                                                            max_micro_batch=micro, steps=warmup + steps))
                    config = ds_config(job, micro, 1, precision, False)
                    optimizer = "spotfill ds_config (DeepSpeed AdamW)"
                    try:
                        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=config)
                    except Exception as exc:  # e.g. FusedAdam's CUDA op cannot be built here (no nvcc)
                        config["optimizer"]["params"]["torch_adam"] = True
                        optimizer = f"torch AdamW (DeepSpeed's op failed: {type(exc).__name__})"
                        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=config)
                    gen = torch.Generator(device=engine.device).manual_seed(0)

                    def step():
                        tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1),
                                               device=engine.device, generator=gen)
                        logits = engine(tokens[:, :-1])
                        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size),
                                               tokens[:, 1:].reshape(-1))
                        engine.backward(loss)
                        engine.step()
                        return loss

                    for _ in range(warmup):
                        step()
                    if on_cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        loss = step()
                    loss = float(loss.item())
                    if on_cuda:
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                    tokens_s = micro * cfg.seq_len * steps / seconds
                    return {"preset": preset, "params": n_params, "precision": precision,
                            "micro_batch": micro, "seq_len": cfg.seq_len, "steps": steps,
                            "step_s": seconds / steps, "tokens_s": tokens_s,
                            "flops_per_token": flops_per_token(cfg, n_params), "loss": loss,
                            "optimizer": optimizer,
                            "max_memory_gb": (torch.cuda.max_memory_allocated() / 1e9) if on_cuda else None}
                except torch.OutOfMemoryError as exc:
                    last_error = exc
                finally:
                    engine = model = None  # noqa: F841 - drop references before the next try
                    if on_cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
        finally:
            if own_pg:
                dist.destroy_process_group()
    raise RuntimeError(f"{preset} does not fit at micro-batch {micro_batches[-1]}: {last_error}")


def bench_gpu(quick: bool = True, preset: str | None = None) -> dict | None:
    """The CONTRACTS "gpu" section: None when CUDA is unavailable."""
    import torch

    if not torch.cuda.is_available():
        return None
    from spotfill.planning import hardware

    preset = preset or "1b"
    device_name = torch.cuda.get_device_name(0)
    name = catalogue_name(device_name)
    peak_tflops = hardware.lookup(name).peak_tflops("bf16") if name else None
    t0 = time.perf_counter()
    r = train_throughput(preset, "cuda", "bf16", steps=8 if quick else 30)
    mfu = r["tokens_s"] * r["flops_per_token"] / (peak_tflops * 1e12) if peak_tflops else None
    return {"device": device_name, "catalogue": name, "peak_bf16_tflops": peak_tflops,
            "mfu": rnd(mfu, 4), "hfu": rnd(mfu, 4), "tokens_s": rnd(r["tokens_s"], 1),
            "params": r["params"], "preset": preset, "precision": "bf16", "zero_stage": 2,
            "micro_batch": r["micro_batch"], "seq_len": r["seq_len"], "step_s": rnd(r["step_s"], 4),
            "steps": r["steps"], "optimizer": r["optimizer"], "max_memory_gb": rnd(r["max_memory_gb"], 2),
            "achieved_tflops": rnd(r["tokens_s"] * r["flops_per_token"] / 1e12, 2),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    return emit(bench_gpu(args.quick, args.preset), args.json)


if __name__ == "__main__":
    raise SystemExit(main())

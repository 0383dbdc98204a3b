"""How many pipeline stages and micro-batches a plan should use, and how much fill work its bubbles can
carry (pure: the planner's own search, no torch).

Stages: every divisor S of the layer count (up to MAX_STAGES) whose tp x S fits the GPUs is searched the
way the planner searches its own plan (ZeRO 0-1 with S > 1, offload, GPUs, micro-batch, recompute): the
planner's time already charges each configuration its bubble, (S-1)/M of compute (Megatron-LM's measure),
so the fitting configuration with the fewest GPU-hours weighs memory against bubble cost; ties go to fewer
stages. Its gradient accumulation steps are the pipeline's micro-batches per step, M.

Bubbles: each stage of a 1F1B schedule idles (S-1)/(M+S-1) of every step (train/bubble.py). The plan's
bubble GPU-hours are that share of its GPU-hours; fill work can use FILL_SHARE of them (the bench's target:
`spotfill bench --only pipeline` measures it) at the plan's MFU, which this page turns into forward tokens
of a model the trained model's size (2N FLOPs a token: evaluation or generation by a fill-in tenant).
"""
from __future__ import annotations

from dataclasses import replace

from spotfill.config.errors import ConfigError

MAX_STAGES = 16
FILL_SHARE = 0.5


def step_share(stages: int, micro_batches: int) -> float:
    """The share of a 1F1B step each stage idles: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1) if stages > 1 else 0.0


def stage_candidates(layers: int, tp: int, gpus: int | None, max_gpus: int) -> list[int]:
    """Stage counts to try: divisors of the layer count, at most MAX_STAGES, whose tp x S GPUs fit (and
    divide `gpus` when it is fixed)."""
    limit = gpus if gpus is not None else max(max_gpus, tp)
    return [s for s in range(1, min(layers, MAX_STAGES) + 1)
            if layers % s == 0 and tp * s <= limit and (gpus is None or gpus % (tp * s) == 0)]


def advise(pb, fixed, search, evaluate_row) -> dict:
    """The recommended stages and micro-batches over the candidates (`search(problem, knobs)` and
    `evaluate_row(evaluation)` are the planner's), with every candidate's row."""
    rows = []
    for stages in stage_candidates(pb.arch.layers, pb.tp, fixed.gpus, pb.max_gpus):
        if stages > 1 and fixed.zero is not None and fixed.zero > 1:
            continue
        try:
            best, closest, _, _ = search(replace(pb, pp=stages), replace(fixed, zero=fixed.zero))
        except ConfigError:          # no batch split at this stage count
            continue
        ev = best or closest
        rows.append({"stages": stages, "fits": best is not None, **evaluate_row(ev),
                     "bubble_fraction": step_share(stages, ev["accum"])})
    fitting = [r for r in rows if r["fits"]]
    chosen = min(fitting, key=lambda r: (round(r["gpu_hours"], 6), r["stages"])) if fitting else None
    out = {"candidates": rows, "recommended": chosen}
    if chosen is not None:
        out["job_config"] = {"training.pipeline_stages": chosen["stages"],
                             "training.micro_batches": chosen["micro_batches"],
                             "training.zero_stage": chosen["zero"]}
        out["why"] = (f"{chosen['stages']} stage(s): the fitting configuration with the fewest GPU-hours "
                      f"({chosen['gpu_hours']:,.0f}; bubble {chosen['bubble_fraction']:.1%} of each step)")
        out["fill"] = fill_capacity(chosen["stages"], chosen["micro_batches"], chosen["gpu_hours"],
                                    chosen["step_seconds"], pb.params, chosen["peak_flops"], pb.mfu)
    else:
        out["why"] = "no stage count fits in GPU memory"
    return out


def fill_capacity(stages: int, micro_batches: int, gpu_hours: float, step_seconds: float, params: int,
                  peak_flops: float, mfu: float, fill_share: float = FILL_SHARE) -> dict:
    """What a plan's bubbles hold: their GPU-hours, each stage's bubble per step, and the forward tokens of
    a model of `params` parameters fill work can run in them at `fill_share` of the bubble time."""
    share = step_share(stages, micro_batches)
    bubble_gpu_s = gpu_hours * 3600 * share
    flops = bubble_gpu_s * peak_flops * mfu * fill_share
    return {"bubble_step_fraction": share, "bubble_gpu_hours": bubble_gpu_s / 3600,
            "bubble_seconds_per_step": step_seconds * share, "assumed_fill_share": fill_share,
            "fill_forward_flops": flops, "fill_forward_tokens": flops / (2 * params) if params else 0.0}

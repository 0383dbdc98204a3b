"""Training overhead: spotfill's elastic Ray Train loop vs a plain `deepspeed.initialize` loop, same run.

    python benchmarks/overhead.py [--preset tiny] [--seconds 30] [--quick] [--json PATH]

Both sides train the same model on the same prepared data (spotfill's prepare() of the stdlib `json`
package's sources), with the same global batch, micro-batch and accumulation, the same DeepSpeed config
(train.engine.ds_config) and the same sample order, at world size 1 on CPU with gloo, and the same number of
torch threads and the same CPU niceness (what Ray gives a worker with one CPU: Ray starts its workers at
niceness 15, so on a machine other work keeps busy a plain loop at 0 would outrun any Ray worker).

  spotfill  TrainingJob.fit() on a local Ray cluster (ray.cluster_utils.Cluster: a head and one node with
            {"GPU_SLOT": 1}; cluster.gpu_resource=GPU_SLOT, workers [1, 1], one checkpoint at the end).
            Steady-state tokens/s comes from RUN_DIR/events.jsonl: the wall time between the step events
            after the first `skip` steps, excluding the last step (its synchronous final checkpoint).
            `spotfill_step_tokens_s` is the same over the events' own step_s (loop body only).
  plain     the same steps in a plain loop (batch built inline, no Ray) in a fresh interpreter, run once
            before the first spotfill run (it also sizes the run to `seconds`) and once after each; the
            step window is the same.

Rounds (`--rounds`, 1 quick, 2 otherwise): plain, spotfill, plain[, spotfill, plain ...]. Each round's ratio
is its spotfill rate over the mean of the two plain runs around it (`rounds`), so the machine's drift over
the bench (this one is shared: plain runs minutes apart differed by up to 9%) cancels; `ratio` is their
median.

Both sides also time each micro-batch's forward+backward and optimizer step (`spotfill_ms`, `plain_ms`;
`plain_optimizer` names what plain DeepSpeed built: FusedAdam for the config's "AdamW"), so a difference in
what the two run shows where it is (spotfill's client optimizer, torch's AdamW, ran its unfused per-tensor
loop on a CPU: 0.937 on the 57M model, all of it in the optimizer step).

ratio = spotfill_tokens_s / plain_deepspeed_tokens_s (1.0 = no overhead). `per_step_overhead_ms` is the
difference in mean step time: a fixed per-step cost matters on a tiny CPU model and vanishes on a GPU model
whose step takes a second.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import REPO, median, quiet_deepspeed, rnd, single_rank_dist, subprocess_env  # noqa: E402


def job_config(preset: str, data: str, storage: str, run_dir: str, steps: int, global_batch: int,
               max_micro_batch: int, name: str = "bench-overhead"):
    """The JobConfig both sides use (the plain loop reads only what a plain loop needs)."""
    from spotfill.config.job import JobConfig, from_mapping

    return from_mapping(JobConfig, {
        "name": name, "run_dir": run_dir, "storage": storage,
        "data": {"path": data},
        "training": {"model": preset, "workers": [1, 1], "steps": steps, "global_batch": global_batch,
                     "max_micro_batch": max_micro_batch, "checkpoint_every": steps,
                     "warmup_steps": min(10, steps)},
        "cluster": {"gpu_resource": "GPU_SLOT", "gpus_per_worker": 1.0, "cpus_per_worker": 1.0},
    })


# -- plain DeepSpeed ------------------------------------------------------------------------------
def plain_loop(job, steps: int | None = None, seconds: float | None = None, warmup: int = 5) -> dict:
    """Train `steps` steps (or until `seconds` pass after `warmup` steps) in a plain deepspeed.initialize
    loop, world size 1, in this process. Returns per-step wall times and the batch shape."""
    import deepspeed
    import numpy as np
    import torch
    import torch.nn.functional as F

    from spotfill.train.batching import batch_shape, rank_micro_batches, stream_to_rows
    from spotfill.train.data import ShardReader
    from spotfill.train.model import build_model, count_params
    from spotfill.storage.base import open_storage
    from spotfill.train.engine import ds_config

    quiet_deepspeed()
    t = job.training
    shape = batch_shape(t.global_batch, 1, t.max_micro_batch)
    cache = tempfile.mkdtemp(prefix="spotfill-bench-plain-")
    try:
        with single_rank_dist():
            torch.manual_seed(t.seed)
            reader = ShardReader(open_storage(job.data.path), cache_dir=cache)
            model = build_model(t.model, seq_len=reader.seq_len, vocab_size=reader.manifest["vocab_size"])
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=ds_config(job, shape.micro_batch, shape.accum, "fp32", False))
            vocab = model.cfg.vocab_size
            times, losses, fbs, opts = [], [], [], []
            limit = steps if steps is not None else t.steps
            t_measure = None
            for step in range(limit):
                ts = time.perf_counter()
                mbs = rank_micro_batches(step, shape, 0)
                rows = reader.rows(stream_to_rows([g for mb in mbs for g in mb], reader.num_samples,
                                                  job.data.seed))
                loss_sum, fb, opt = 0.0, 0.0, 0.0
                for mb in np.split(rows, len(mbs)):
                    tm = time.perf_counter()
                    x = torch.from_numpy(mb[:, :-1])
                    y = torch.from_numpy(mb[:, 1:])
                    loss = F.cross_entropy(engine(x).float().reshape(-1, vocab), y.reshape(-1))
                    engine.backward(loss)
                    tb = time.perf_counter()
                    engine.step()
                    fb, opt = fb + tb - tm, opt + time.perf_counter() - tb
                    loss_sum += loss.item()
                times.append(time.perf_counter() - ts)
                fbs.append(fb)
                opts.append(opt)
                losses.append(loss_sum / shape.accum)
                if step + 1 == warmup:
                    t_measure = time.perf_counter()
                if steps is None and seconds is not None and t_measure is not None and \
                        time.perf_counter() - t_measure >= seconds:
                    break
            base = getattr(engine.optimizer, "optimizer", engine.optimizer)   # under ZeRO's wrapper
            optimizer = type(base).__name__ + (" (fused)" if getattr(base, "defaults", {}).get("fused") else "")
            return {"step_s": times, "forward_backward_s": fbs, "optimizer_s": opts, "optimizer": optimizer,
                    "loss": losses, "micro_batch": shape.micro_batch,
                    "accum": shape.accum, "seq_len": reader.seq_len, "params": count_params(model),
                    "threads": torch.get_num_threads()}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_plain_subprocess(job, threads: int, steps: int | None = None, seconds: float | None = None,
                         warmup: int = 5, timeout_s: float = 600, niceness: int = 0) -> dict:
    """plain_loop in a fresh interpreter with `threads` torch/OpenMP threads, at CPU `niceness`."""
    work = tempfile.mkdtemp(prefix="spotfill-bench-plainrun-")
    try:
        spec, out = os.path.join(work, "spec.json"), os.path.join(work, "out.json")
        import dataclasses
        with open(spec, "w") as f:
            json.dump({"job": dataclasses.asdict(job), "steps": steps, "seconds": seconds,
                       "warmup": warmup}, f)
        env = subprocess_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--plain-spec", spec,
                               "--json", out], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s, preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        if proc.returncode != 0:
            raise RuntimeError(f"plain DeepSpeed loop failed ({proc.returncode}): {proc.stderr[-1500:]}")
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- spotfill -------------------------------------------------------------------------------------
def steady_rates(step_events: list[dict], skip: int) -> dict:
    """tokens/s from step events (sorted by step): wall time between events `skip`..n-2 (the last step
    holds the final synchronous checkpoint), and the same tokens over the events' own step_s."""
    evs = sorted(step_events, key=lambda e: e["step"])[skip:-1]
    if len(evs) < 3:
        raise RuntimeError(f"too few steady steps to measure ({len(evs)})")
    tokens = sum(e["tokens"] for e in evs[1:])
    wall = evs[-1]["t"] - evs[0]["t"]
    return {"wall_tokens_s": tokens / wall, "step_tokens_s": tokens / sum(e["step_s"] for e in evs[1:]),
            "steps": len(evs) - 1, "mean_step_s": wall / (len(evs) - 1),
            "mean_data_wait_s": sum(e["data_wait_s"] for e in evs[1:]) / (len(evs) - 1),
            "mean_compute_s": sum(e["compute_s"] for e in evs[1:]) / (len(evs) - 1),
            "mean_forward_backward_s": _mean(e.get("forward_backward_s") for e in evs[1:]),
            "mean_optimizer_s": _mean(e.get("optimizer_s") for e in evs[1:]),
            "mean_loop_s": sum(e["step_s"] for e in evs[1:]) / (len(evs) - 1)}


def _mean(xs) -> float | None:
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def plain_rates(run: dict, tokens_per_step: int, skip: int, upto: int | None = None) -> dict:
    """The same window as steady_rates: steps skip+1 .. upto-2 (plain step times are whole iterations);
    `run` is plain_loop's result."""
    cut = slice(skip + 1, (upto - 1) if upto else None)
    window = run["step_s"][cut]
    return {"tokens_s": tokens_per_step * len(window) / sum(window), "steps": len(window),
            "mean_step_s": sum(window) / len(window),
            "mean_forward_backward_s": _mean(run.get("forward_backward_s", [None])[cut]),
            "mean_optimizer_s": _mean(run.get("optimizer_s", [None])[cut])}


def worker_probe(gpu_resource: str = "GPU_SLOT") -> tuple[int, int]:
    """torch threads and CPU niceness of a Ray worker holding one CPU and one accelerator slot (what Ray
    Train's worker gets: Ray sets OMP_NUM_THREADS to the CPUs a worker holds, and starts its workers at
    niceness RAY_worker_niceness, 15 by default). The plain loop runs with both: on a busy machine a
    process at niceness 15 gets a fraction of the CPU one at 0 gets, which is Ray's doing, not spotfill's."""
    import ray

    @ray.remote(num_cpus=1, resources={gpu_resource: 1})
    def probe() -> tuple[int, int]:
        import torch
        return torch.get_num_threads(), os.nice(0)

    return ray.get(probe.remote())


def bench_overhead(quick: bool = True, preset: str = "tiny", seconds: float | None = None,
                   global_batch: int = 16, max_micro_batch: int = 8, skip: int = 5,
                   progress=None, rounds: int | None = None) -> dict:
    """The CONTRACTS "overhead" section (plus details)."""
    import ray
    from ray.cluster_utils import Cluster

    from spotfill.config import constants
    from spotfill.config.job import PrepareConfig
    from spotfill.telemetry.events import read_events
    from spotfill.train.prepare import prepare
    from spotfill.train.job import TrainingJob, ray_train_env

    say = progress or (lambda msg: None)
    seconds = seconds or (15.0 if quick else 40.0)
    rounds = rounds or (1 if quick else 2)
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="spotfill-bench-overhead-")
    job_name = f"bench-overhead-{os.path.basename(work).rsplit('-', 1)[-1]}"
    data = os.path.join(work, "data")
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1, resources={"GPU_SLOT": 1})
        cluster.wait_for_nodes()
        # what TrainingJob.fit() would pass to ray.init itself (it reuses an initialised Ray)
        ray.init(address=cluster.address, runtime_env={"env_vars": ray_train_env()},
                 log_to_driver=False)
        source = os.path.dirname(json.__file__)
        manifest = prepare(PrepareConfig(source=source, output=data, seq_len=64))
        threads, niceness = worker_probe()
        say(f"cluster up, data prepared ({manifest['num_samples']} rows), worker torch threads {threads}, "
            f"niceness {niceness}")

        def job_for(steps: int, tag: str):
            return job_config(preset, data, os.path.join(work, f"ckpt-{tag}"), os.path.join(work, tag),
                              steps, global_batch, max_micro_batch, name=job_name)

        # plain #1: also sizes the run so the steady window lasts about `seconds`
        calib = run_plain_subprocess(job_for(10 ** 6, "plain1"), threads, seconds=seconds, warmup=skip + 1,
                                     niceness=niceness)
        step_s = median(calib["step_s"][skip + 1:])
        steps = skip + 2 + max(10, math.ceil(seconds / step_s))
        tokens_per_step = global_batch * calib["seq_len"]
        plains = [plain_rates(calib, tokens_per_step, skip)]
        say(f"plain #1: {tokens_per_step / step_s:.0f} tokens/s ({step_s * 1e3:.1f} ms/step); "
            f"spotfill runs {steps} steps, {rounds} round(s)")
        fits = []
        for r in range(rounds):   # spotfill, then plain again: each spotfill run between two plain ones
            job = job_for(steps, f"spotfill{r}")
            t0 = time.perf_counter()
            report = TrainingJob(job).fit()
            fit_s = time.perf_counter() - t0
            events = list(read_events(os.path.join(job.run_dir, "events.jsonl")))
            start = next((e for e in events if e["kind"] == "start"), {})
            fits.append({"rates": steady_rates([e for e in events if e["kind"] == "step"], skip),
                         "fit_s": fit_s, "startup_s": start.get("startup_s"), "report": report})
            shutil.rmtree(os.path.join(constants.LOCAL_DIR, job_name), ignore_errors=True)
            say(f"spotfill #{r + 1}: {fits[-1]['rates']['wall_tokens_s']:.0f} tokens/s "
                f"({fits[-1]['rates']['mean_step_s'] * 1e3:.1f} ms/step), fit {fit_s:.1f}s")
            last_plain = run_plain_subprocess(job_for(steps, f"plain{r + 2}"), threads, steps=steps,
                                              niceness=niceness)
            plains.append(plain_rates(last_plain, tokens_per_step, skip, upto=steps))
            say(f"plain #{r + 2}: {plains[-1]['tokens_s']:.0f} tokens/s")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.path.join(constants.LOCAL_DIR, job_name), ignore_errors=True)  # workers' node-local dir
    per_round = round_ratios([f["rates"]["wall_tokens_s"] for f in fits], [p["tokens_s"] for p in plains])
    ours = {k: _mean(f["rates"][k] for f in fits) for k in fits[0]["rates"]}   # the mean over rounds
    ours["steps"] = fits[0]["rates"]["steps"]
    report, fit_s = fits[-1]["report"], fits[0]["fit_s"]
    plain_tokens_s = _mean(p["tokens_s"] for p in plains)
    plain_step = _mean(p["mean_step_s"] for p in plains)

    def both(key: str) -> float | None:
        value = _mean(p[key] for p in plains)
        return None if value is None else rnd(value * 1e3, 3)
    return {
        "spotfill_tokens_s": rnd(ours["wall_tokens_s"], 1),
        "plain_deepspeed_tokens_s": rnd(plain_tokens_s, 1),
        "ratio": rnd(median([r["ratio"] for r in per_round]), 4),
        "rounds": [{k: rnd(v, 4 if k == "ratio" else 1) for k, v in r.items()} for r in per_round],
        "spotfill_step_tokens_s": rnd(ours["step_tokens_s"], 1),
        "step_ratio": rnd(ours["step_tokens_s"] / plain_tokens_s, 4),
        "per_step_overhead_ms": rnd((ours["mean_step_s"] - plain_step) * 1e3, 3),
        "model": preset, "params": calib["params"], "global_batch": global_batch,
        "micro_batch": calib["micro_batch"], "accum": calib["accum"], "seq_len": calib["seq_len"],
        "world_size": 1, "torch_threads": threads, "cpu_niceness": niceness, "steps": steps, "skip": skip,
        "steady_steps": ours["steps"],
        "spotfill_ms": {"step": rnd(ours["mean_step_s"] * 1e3, 3),
                        "loop_body": rnd(ours["mean_loop_s"] * 1e3, 3),
                        "data_wait": rnd(ours["mean_data_wait_s"] * 1e3, 3),
                        "compute": rnd(ours["mean_compute_s"] * 1e3, 3),
                        "forward_backward": rnd(_ms(ours["mean_forward_backward_s"]), 3),
                        "optimizer": rnd(_ms(ours["mean_optimizer_s"]), 3)},
        "plain_ms": {"step": rnd(plain_step * 1e3, 3), "forward_backward": both("mean_forward_backward_s"),
                     "optimizer": both("mean_optimizer_s"),
                     "runs": [rnd(p["mean_step_s"] * 1e3, 3) for p in plains]},
        "plain_optimizer": last_plain.get("optimizer"),
        "plain_tokens_s_runs": [rnd(p["tokens_s"], 1) for p in plains],
        "spotfill_startup_s": fits[0]["startup_s"], "spotfill_fit_s": rnd(fit_s, 2),
        "final_loss": {"spotfill": report["training"]["final_loss"],
                       "plain": rnd(last_plain["loss"][-1], 6)},
        "seconds": round(time.perf_counter() - t_start, 1),
    }


def round_ratios(spotfill_tokens_s: list[float], plain_tokens_s: list[float]) -> list[dict]:
    """Round i's spotfill rate over the mean of the plain runs just before and just after it (plain runs
    bracket every spotfill run: len(plain) == len(spotfill) + 1), so a drift of the machine's speed over
    the bench (another tenant, a thermal or frequency change) cancels instead of landing on one side."""
    if len(plain_tokens_s) != len(spotfill_tokens_s) + 1 or not spotfill_tokens_s:
        raise ValueError(f"need one more plain run than spotfill runs (got {len(plain_tokens_s)} plain, "
                         f"{len(spotfill_tokens_s)} spotfill)")
    out = []
    for i, ours in enumerate(spotfill_tokens_s):
        plain = (plain_tokens_s[i] + plain_tokens_s[i + 1]) / 2
        out.append({"spotfill_tokens_s": ours, "plain_tokens_s": plain, "ratio": ours / plain})
    return out


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/overhead.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seconds", type=float, help="steady-state seconds per side (default 15 quick, 40)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--max-micro-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, help="spotfill runs, each between two plain runs (default 1 "
                        "quick, 2)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--plain-spec", help=argparse.SUPPRESS)  # internal: run plain_loop from a spec
    args = parser.parse_args(argv)
    if args.plain_spec:
        from spotfill.config.job import JobConfig, from_mapping
        with open(args.plain_spec) as f:
            spec = json.load(f)
        result = plain_loop(from_mapping(JobConfig, spec["job"]), spec["steps"], spec["seconds"],
                            spec["warmup"])
    else:
        result = bench_overhead(args.quick, args.preset, args.seconds, args.global_batch,
                                args.max_micro_batch, rounds=args.rounds,
                                progress=lambda m: print(f"overhead: {m}", file=sys.stderr, flush=True))
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if not args.plain_spec or not args.json:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

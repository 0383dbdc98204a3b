"""Training overhead: spotfill's elastic Ray Train loop vs a plain `deepspeed.initialize` loop, side by side.

    python benchmarks/overhead.py [--preset tiny] [--seconds 30] [--quick] [--rounds N] [--json PATH]

Both sides train the same model on the same prepared data (spotfill's prepare() of the stdlib `json`
package's sources), with the same global batch, micro-batch and accumulation, the same DeepSpeed config
(train.engine.ds_config) and the same sample order, at world size 1 on CPU with gloo, and the same number of
torch threads and the same CPU niceness (what Ray gives a worker with one CPU: Ray starts its workers at
niceness 15, so on a machine other work keeps busy a plain loop at 0 would outrun any Ray worker).

  spotfill  TrainingJob.fit() on a local Ray cluster (ray.cluster_utils.Cluster: a head and one node with
            {"GPU_SLOT": 1}; cluster.gpu_resource=GPU_SLOT, workers [1, 1], one checkpoint at the end).
  plain     the same steps in a plain loop (batch built inline, no Ray) in a fresh interpreter, started
            first (its first steps size the run).

Time slices: the two processes run at the same time but take turns. The bench stops one with SIGSTOP and
lets the other run for a slice (`slice_s`: 2 s, or 10 plain steps where a step is longer), then swaps:
plain, spotfill, plain, ... plain (`--rounds` spotfill slices, sized from `seconds`). A slice's rate counts
only the steps that ran wholly inside it (from each side's own step end times: spotfill's step events,
the plain loop's clock), so a step cut by a stop is left out. Round i's ratio is spotfill slice i's rate
over the mean of the plain slices just before and after it; `ratio` is their median. Both sides see the
same machine within seconds of each other: this machine's speed drifts by up to 14% between runs minutes
apart, which separate runs (the earlier method) charged to one side or the other. Spotfill's start-up, its
first `skip` steps and its final synchronous checkpoint run outside the slices.

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
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (REPO, log_tail, median, quiet_deepspeed, rnd, single_rank_dist,  # noqa: E402
                               subprocess_env)

SLICE_MIN_S = 2.0     # a time slice lasts at least this long,
SLICE_STEPS = 10      # and at least this many plain steps


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
def plain_loop(job, steps: int | None = None, warmup: int = 5, ready_path: str | None = None,
               stop_path: str | None = None, calib_s: float = 2.0) -> dict:
    """Train in a plain deepspeed.initialize loop, world size 1, in this process: `steps` steps, or until
    `stop_path` exists (checked once `ready_path` is written: `calib_s` after `warmup` steps, with the
    median step time so far). Returns per-step wall times, end times (unix s) and the batch shape."""
    import deepspeed
    import numpy as np
    import torch
    import torch.nn.functional as F

    from spotfill.config.batching import batch_shape, rank_micro_batches, stream_to_rows
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
            times, ends, losses, fbs, opts = [], [], [], [], []
            limit = steps if steps is not None else t.steps
            t_measure, ready = None, ready_path is None
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
                ends.append(time.time())
                fbs.append(fb)
                opts.append(opt)
                losses.append(loss_sum / shape.accum)
                if step + 1 == warmup:
                    t_measure = time.perf_counter()
                if not ready and t_measure is not None and time.perf_counter() - t_measure >= calib_s:
                    _write_json(ready_path, {"step_s": median(times[warmup:])})
                    ready = True
                elif stop_path is not None and ready and os.path.exists(stop_path):
                    break
            base = getattr(engine.optimizer, "optimizer", engine.optimizer)   # under ZeRO's wrapper
            optimizer = type(base).__name__ + (" (fused)" if getattr(base, "defaults", {}).get("fused") else "")
            return {"step_s": times, "end_t": ends, "forward_backward_s": fbs, "optimizer_s": opts,
                    "optimizer": optimizer, "loss": losses, "micro_batch": shape.micro_batch,
                    "accum": shape.accum, "seq_len": reader.seq_len, "params": count_params(model),
                    "threads": torch.get_num_threads()}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class PlainProcess:
    """plain_loop in a fresh interpreter with `threads` torch/OpenMP threads, at CPU `niceness`, stepping
    until stop(): ready() waits for its calibration (the median step time after warm-up)."""

    def __init__(self, job, threads: int, niceness: int = 0, warmup: int = 5, calib_s: float = 2.0):
        import dataclasses
        self._work = tempfile.mkdtemp(prefix="spotfill-bench-plainrun-")
        spec, self._out = os.path.join(self._work, "spec.json"), os.path.join(self._work, "out.json")
        self._ready, self._stop = os.path.join(self._work, "ready.json"), os.path.join(self._work, "stop")
        _write_json(spec, {"job": dataclasses.asdict(job), "warmup": warmup, "calib_s": calib_s,
                           "ready": self._ready, "stop": self._stop})
        env = subprocess_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self._log = open(os.path.join(self._work, "log.txt"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.overhead", "--plain-spec", spec,
                                      "--json", self._out], cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        self.pid = self.proc.pid

    def ready(self, timeout_s: float = 300) -> float:
        """The plain loop's median step time (s) once it has calibrated."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self._ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"plain DeepSpeed loop failed ({self.proc.returncode}): {self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"plain DeepSpeed loop not ready after {timeout_s:.0f}s: {self._tail()}")
            time.sleep(0.1)
        with open(self._ready) as f:
            return json.load(f)["step_s"]

    def stop(self, timeout_s: float = 300) -> dict:
        """Let it run (SIGCONT), tell it to stop after its step, and return plain_loop's result."""
        open(self._stop, "w").close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"plain DeepSpeed loop did not stop in {timeout_s:.0f}s")
        if self.proc.returncode != 0:
            raise RuntimeError(f"plain DeepSpeed loop failed ({self.proc.returncode}): {self._tail()}")
        with open(self._out) as f:
            return json.load(f)

    def _tail(self) -> str:
        return log_tail(self._log)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self._work, ignore_errors=True)


# -- time slices ----------------------------------------------------------------------------------
def window_rate(ends: list[float], start: float, stop: float, tokens_per_step: int) -> tuple[float, int] | None:
    """tokens/s of the steps that ran wholly inside [start, stop]: those whose own start (the previous
    step's end) and end both lie in it; (rate, steps), or None with fewer than 2 such steps. A step cut
    by the window's edge (or a SIGSTOP) is left out, whatever its length."""
    inside = [t for t in sorted(ends) if start <= t <= stop]
    if len(inside) < 3:
        return None
    return tokens_per_step * (len(inside) - 1) / (inside[-1] - inside[0]), len(inside) - 1


def steps_in(ends: list[float], windows: list[tuple[float, float]]) -> list[int]:
    """Indices of the steps (by their end times, in step order) that ran wholly inside one of `windows`:
    the step's end and the previous step's end in the same window."""
    out = []
    for i in range(1, len(ends)):
        if any(a <= ends[i - 1] and ends[i] <= b for a, b in windows):
            out.append(i)
    return out


class Slicer:
    """Takes turns between two processes with SIGSTOP/SIGCONT: plain, spotfill, ..., plain. Each slice's
    window is recorded (unix s). `spotfill_done()` ends the turns early (after a plain slice) once spotfill
    nears its last steps. Both processes are left running, whatever happens."""

    def __init__(self, plain_pid: int, spotfill_pid: int, slice_s: float, rounds: int):
        self.pids = {"plain": plain_pid, "spotfill": spotfill_pid}
        self.slice_s, self.rounds = slice_s, rounds
        self.windows: dict[str, list[tuple[float, float]]] = {"plain": [], "spotfill": []}

    def run(self, spotfill_done) -> None:
        try:
            for side in ("plain", "spotfill"):
                os.kill(self.pids[side], signal.SIGSTOP)
            for r in range(self.rounds):
                self._slice("plain")
                self._slice("spotfill")
                if spotfill_done():
                    break
            self._slice("plain")
        finally:
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def _slice(self, side: str) -> None:
        pid = self.pids[side]
        os.kill(pid, signal.SIGCONT)
        start = time.time()
        time.sleep(self.slice_s)
        stop = time.time()
        with contextlib.suppress(ProcessLookupError):   # it ended in its turn (spotfill after its last step)
            os.kill(pid, signal.SIGSTOP)
        self.windows[side].append((start, stop))


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
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="spotfill-bench-overhead-")
    job_name = f"bench-overhead-{os.path.basename(work).rsplit('-', 1)[-1]}"
    data = os.path.join(work, "data")
    cluster, plain = None, None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1, resources={"GPU_SLOT": 1})
        cluster.wait_for_nodes()
        # what TrainingJob.fit() would pass to ray.init itself (it reuses an initialised Ray); the slices are
        # cut from every step's end time, so the event sink writes every step (no step sampling)
        ray.init(address=cluster.address, runtime_env={"env_vars": {**ray_train_env(),
                                                                    "SPOTFILL_EVENTS_STEPS_KEEP": str(10 ** 9)}},
                 log_to_driver=False)
        source = os.path.dirname(json.__file__)
        manifest = prepare(PrepareConfig(source=source, output=data, seq_len=64))
        threads, niceness = worker_probe()
        say(f"cluster up, data prepared ({manifest['num_samples']} rows), worker torch threads {threads}, "
            f"niceness {niceness}")

        def job_for(steps: int, tag: str):
            return job_config(preset, data, os.path.join(work, f"ckpt-{tag}"), os.path.join(work, tag),
                              steps, global_batch, max_micro_batch, name=job_name)

        plain = PlainProcess(job_for(10 ** 7, "plain"), threads, niceness, warmup=skip + 1)
        step_s = plain.ready()
        os.kill(plain.pid, signal.SIGSTOP)      # spotfill starts up alone
        slice_s = max(SLICE_MIN_S, SLICE_STEPS * step_s)
        rounds = rounds or max(3, math.ceil(seconds / slice_s))
        # spotfill's steps: its warm-up, the slices (25% slack for a slower side) and the final checkpoint
        steps = skip + 3 + math.ceil(1.25 * rounds * slice_s / step_s) + 5
        say(f"plain: {step_s * 1e3:.1f} ms/step; spotfill runs {steps} steps; {rounds} rounds of "
            f"{slice_s:.1f} s slices")
        job = job_for(steps, "spotfill")
        slicer_out: dict = {}
        turns = threading.Thread(target=_take_turns, args=(job.run_dir, plain.pid, slice_s, rounds, skip,
                                                           steps, slicer_out), daemon=True)
        turns.start()
        report = TrainingJob(job).fit()
        turns.join(timeout=60)
        plain_run = plain.stop()
        if "error" in slicer_out:
            raise RuntimeError(f"time slices failed: {slicer_out['error']}")
        events = list(read_events(os.path.join(job.run_dir, "events.jsonl")))
        result = slice_results(events, plain_run, slicer_out["windows"], global_batch)
        say(f"spotfill {result['spotfill_tokens_s']:.0f} tokens/s vs plain {result['plain_deepspeed_tokens_s']:.0f}"
            f" over {len(result['rounds'])} rounds: ratio {result['ratio']:.3f}")
    finally:
        if plain is not None:
            plain.close()
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.path.join(constants.LOCAL_DIR, job_name), ignore_errors=True)  # workers' node-local dir
    start = next((e for e in events if e["kind"] == "start"), {})
    return {**result, "model": preset, "params": plain_run["params"], "global_batch": global_batch,
            "micro_batch": plain_run["micro_batch"], "accum": plain_run["accum"], "seq_len": plain_run["seq_len"],
            "world_size": 1, "torch_threads": threads, "cpu_niceness": niceness, "steps": steps, "skip": skip,
            "slice_s": rnd(slice_s, 3), "plain_optimizer": plain_run.get("optimizer"),
            "spotfill_startup_s": start.get("startup_s"),
            "final_loss": {"spotfill": report["training"]["final_loss"], "plain": rnd(plain_run["loss"][-1], 6)},
            "seconds": round(time.perf_counter() - t_start, 1)}


def _take_turns(run_dir: str, plain_pid: int, slice_s: float, rounds: int, skip: int, steps: int,
                out: dict) -> None:
    """The slicer's thread: wait for spotfill's rank 0 to pass its first `skip` steps (its pid from the
    start event), then take turns; out["windows"] or out["error"]."""
    try:
        run = RunProgress(os.path.join(run_dir, "events.jsonl"))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (run.poll().pid is None or run.last <= skip + 1):
            time.sleep(0.05)
        if run.pid is None or run.last <= skip + 1:
            raise RuntimeError("spotfill's worker did not reach its steady steps in 600 s")
        slicer = Slicer(plain_pid, run.pid, slice_s, rounds)
        slicer.run(lambda: run.poll().last >= steps - 3)
        out["windows"] = slicer.windows
    except Exception as exc:  # noqa: BLE001 -- reported by bench_overhead after fit() returns
        out["error"] = f"{type(exc).__name__}: {exc}"


class RunProgress:
    """Rank 0's pid and the newest step of a spotfill run, from its events as they are written (each poll
    reads only the new lines); a second worker group is an error: its steps are not comparable."""

    def __init__(self, path: str):
        from spotfill.telemetry.events import EventTail
        self._tail = EventTail(path)
        self.pid: int | None = None
        self.last = 0

    def poll(self) -> "RunProgress":
        for e in self._tail.poll():
            if e["kind"] in ("start", "resume"):
                if self.pid is not None and e.get("pid") != self.pid:
                    raise RuntimeError("spotfill's worker group restarted during the bench")
                self.pid = e.get("pid")
            elif e["kind"] == "step":
                self.last = max(self.last, e["step"])
        return self


def slice_results(events: list[dict], plain_run: dict, windows: dict, global_batch: int) -> dict:
    """Rates per slice and per round (round_ratios), and each side's step breakdown over the steps that ran
    inside its slices."""
    # the last step holds the final synchronous checkpoint: not a step of the loop's steady state
    steps = sorted((e for e in events if e["kind"] == "step"), key=lambda e: e["step"])[:-1]
    tokens = global_batch * plain_run["seq_len"]
    sf_ends, pl_ends = [e["t"] for e in steps], plain_run["end_t"]
    sf = [window_rate(sf_ends, a, b, tokens) for a, b in windows["spotfill"]]
    pl = [window_rate(pl_ends, a, b, tokens) for a, b in windows["plain"]]
    if any(r is None for r in sf + pl):
        raise RuntimeError(f"a slice held fewer than 2 whole steps (spotfill {sf}, plain {pl})")
    per_round = round_ratios([r[0] for r in sf], [r[0] for r in pl])
    sf_idx, pl_idx = steps_in(sf_ends, windows["spotfill"]), steps_in(pl_ends, windows["plain"])
    ours = [steps[i] for i in sf_idx]
    sf_rate, pl_rate = _mean(r[0] for r in sf), _mean(r[0] for r in pl)

    def plain_ms(key: str) -> float:
        return rnd(_mean(plain_run[key][i] for i in pl_idx) * 1e3, 3)

    def ours_ms(key: str) -> float | None:
        return rnd(_ms(_mean(e.get(key) for e in ours)), 3)
    loop_s = _mean(e["step_s"] for e in ours)
    return {
        "spotfill_tokens_s": rnd(sf_rate, 1),
        "plain_deepspeed_tokens_s": rnd(pl_rate, 1),
        "ratio": rnd(median([r["ratio"] for r in per_round]), 4),
        "rounds": [{k: rnd(v, 4 if k == "ratio" else 1) for k, v in r.items()} for r in per_round],
        "spotfill_step_tokens_s": rnd(tokens / loop_s, 1),
        "step_ratio": rnd(tokens / loop_s / pl_rate, 4),
        "per_step_overhead_ms": rnd((tokens / sf_rate - tokens / pl_rate) * 1e3, 3),
        "steady_steps": len(ours), "plain_steady_steps": len(pl_idx),
        "spotfill_ms": {"step": rnd(tokens / sf_rate * 1e3, 3), "loop_body": rnd(loop_s * 1e3, 3),
                        "data_wait": ours_ms("data_wait_s"), "compute": ours_ms("compute_s"),
                        "forward_backward": ours_ms("forward_backward_s"), "optimizer": ours_ms("optimizer_s")},
        "plain_ms": {"step": rnd(tokens / pl_rate * 1e3, 3), "loop_body": plain_ms("step_s"),
                     "forward_backward": plain_ms("forward_backward_s"), "optimizer": plain_ms("optimizer_s")},
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


def _mean(xs) -> float | None:
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/overhead.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seconds", type=float, help="seconds of time slices per side (default 15 quick, 40)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--max-micro-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, help="spotfill time slices, each between two plain ones (default: "
                        "as many as --seconds fills, at least 3)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--plain-spec", help=argparse.SUPPRESS)  # internal: run plain_loop from a spec
    args = parser.parse_args(argv)
    for name in ("seconds", "rounds", "global_batch", "max_micro_batch"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be a positive number")
    if args.plain_spec:
        from spotfill.config.job import JobConfig, from_mapping
        with open(args.plain_spec) as f:
            spec = json.load(f)
        result = plain_loop(from_mapping(JobConfig, spec["job"]), warmup=spec["warmup"], ready_path=spec["ready"],
                            stop_path=spec["stop"], calib_s=spec["calib_s"])
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

"""Pipeline bubbles: the measured bubble against (S-1)/(M+S-1), and fill work inside them, side by side.

    python benchmarks/pipeline.py [--quick] [--stages 2] [--micro-batches 4] [--json PATH]

Two pipelines train the same model on the same data in the same order, on this machine's CPU with gloo:
S ranks each (one process per stage, one torch thread each), through spotfill's own pipeline path
(train/pipeline.PipelineRun: DeepSpeed's PipelineEngine with the bubble probe). One of them fills its
bubbles with a batch job's evaluation units (fillin/bubble_fill.py), the other does not. They take turns
in time slices (SIGSTOP/SIGCONT of each side's process group, as benchmarks/overhead.py does): plain,
filled, plain, ..., plain; a slice counts only the steps wholly inside it.

  bubble_fraction_measured  the unfilled side's share of each stage's step spent outside compute (blocked
                            in sends and receives, between instructions, waiting for the step's loss),
                            median over its sliced steps, all stages together (bubble_stage per stage)
  bubble_fraction_theory    (S-1)/(M+S-1)
  fill_share                fill rows per bubble second on the filled side over the same work's rows per
                            second standalone (one process per stage running it alone on an idle core,
                            before and after the slices)
  slowdown                  the filled side's step time over the unfilled side's around it, median over
                            rounds, minus 1
  loss_identical            both sides' losses and every stage's parameter digest equal at every step
                            both ran (the filled side's training state is bit-identical)
  overrun_s                 how far fill work ran past the bubble estimate it was sized for, p50/p99 over
                            the fill points
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import REPO, free_port, log_tail, median, quiet_deepspeed, rnd, subprocess_env  # noqa: E402
from benchmarks.overhead import _write_json, steps_in, window_rate  # noqa: E402

SLICE_MIN_S, SLICE_STEPS = 2.0, 10
WARMUP_STEPS = 8           # before the slices: the bubble estimates need a few steps at every point
ROWS_PER_UNIT = 256
CHUNK = 64                 # rows a standalone run evaluates at once


# -- data and the fill work: a batch job's plan over the bench's data -----------------------------------
def prepare_local(output: str, seq_len: int = 64, min_rows: int = 4096) -> dict:
    """Byte-tokenised sources of the stdlib `json` package (repeated up to `min_rows` rows) as token shards,
    in this process: no Ray (the bench's pipelines run without one)."""
    from spotfill.storage.base import open_storage
    from spotfill.train.data import BYTE_VOCAB, ShardWriter, byte_encode, iter_corpus_files, pack

    docs = [byte_encode(open(p, encoding="utf-8", errors="replace").read())
            for p in iter_corpus_files(os.path.dirname(json.__file__), (".py",))]
    rows = pack(docs, seq_len)
    writer = ShardWriter(open_storage(output), seq_len, BYTE_VOCAB, "bytes", rows_per_shard=2048)
    for _ in range(max(1, math.ceil(min_rows / len(rows)))):
        writer.add(rows)
    return writer.close()


def make_plan(output: str, data: str, preset: str, seed: int = 1, rows_per_unit: int = ROWS_PER_UNIT) -> dict:
    """A batch job's plan (fillin/batch.py's layout) evaluating every row of `data` with a `preset` model
    initialised from `seed` (the bench has no training checkpoint to pin)."""
    import torch

    from spotfill.storage.base import open_storage
    from spotfill.train.data import read_manifest
    from spotfill.train.model import build_model

    out, manifest = open_storage(output), read_manifest(open_storage(data))
    torch.manual_seed(seed)
    model = build_model(preset, seq_len=manifest["seq_len"], vocab_size=manifest["vocab_size"])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    from spotfill.fillin import batch_plan as bp
    out.put_bytes(bp.MODEL_KEY, buf.getvalue())
    plan = {"eval_rows": int(manifest["num_samples"]), "eval_data": data, "eval_rows_per_unit": rows_per_unit,
            "generate_rows_per_unit": 1, "max_tokens": 0, "temperature": 0.0, "seed": 0, "prompts_sha256": None,
            "prompt_ids": [], "model": preset, "checkpoint": None, "checkpoint_tag": None, "name": "bench-bubbles"}
    out.put_bytes(bp.PLAN_KEY, json.dumps(plan).encode())
    return plan


# -- one side: S ranks of a pipeline, in their own process group --------------------------------------
def side_rank(rank: int, spec: dict) -> None:
    """One stage: train until rank 0 sees the stop file (or spec["steps"] steps); every step's record into
    spec["out"]-<rank>."""
    world = spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    quiet_deepspeed()
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.storage.base import open_storage
    from spotfill.train.data import ShardReader, read_step
    from spotfill.fillin.bubble_fill import bubble_filler
    from spotfill.train.pipeline import PipelineRun

    job = from_mapping(JobConfig, spec["job"])
    reader = ShardReader(open_storage(job.data.path), cache_dir=os.path.join(spec["work"], f"cache-{rank}"))
    pipe = PipelineRun(job, world, rank, bubble_filler=bubble_filler)
    engine, _, _ = pipe.build_engine(job, reader.seq_len, reader.manifest["vocab_size"], "fp32", False)
    params = [p for p in engine.module.parameters()]
    stop = torch.zeros(1)
    recs, step = [], 0
    while True:
        batch = read_step(reader, step, pipe.positions(step), pipe.shape.accum, job.data.seed)
        ts = time.perf_counter()
        loss = pipe.train_step(engine, batch.micro_batches)
        step_s = time.perf_counter() - ts
        last = pipe.probe.last
        digest = hashlib.md5(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
        recs.append({"step": step + 1, "end_t": time.time(), "step_s": step_s, "loss": loss,
                     "bubble_s": last.bubble_s, "fill_s": last.fill_s, "wall_s": last.wall_s,
                     "fill_rows": pipe.filler.rows if pipe.filler else 0, "digest": digest})
        step += 1
        if rank == 0 and step == WARMUP_STEPS:
            _write_json(spec["ready"], {"step_s": median(r["step_s"] for r in recs[2:])})
        stop[0] = 1.0 if rank == 0 and (step == spec.get("steps") or step >= WARMUP_STEPS and
                                         os.path.exists(spec["stop"])) else 0.0
        dist.all_reduce(stop)              # both sides run this same tiny collective every step
        if stop[0] > 0:
            break
    pipe.close()
    _write_json(f"{spec['out']}-{rank}", {"steps": recs, "stage": pipe.layout.stage,
                                          "filler": pipe.filler.summary() if pipe.filler else None,
                                          "overruns": pipe.filler.overruns if pipe.filler else [],
                                          "micro_batch": pipe.shape.micro_batch, "seq_len": reader.seq_len})
    dist.destroy_process_group()


def _side_main(spec_path: str) -> int:
    import torch.multiprocessing as mp
    with open(spec_path) as f:
        spec = json.load(f)
    mp.spawn(alone_rank if spec.get("plan") else side_rank, args=(spec,), nprocs=spec["world"], join=True)
    return 0


class Side:
    """A pipeline of `world` ranks in a fresh process group (SIGSTOP/SIGCONT reach every rank at once)."""

    def __init__(self, name: str, work: str, job: dict | None, world: int, plan: str | None = None):
        self.name, self.world = name, world
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.spec = {"job": job, "plan": plan, "world": world, "port": free_port(), "work": self.dir,
                     "ready": os.path.join(self.dir, "ready.json"), "stop": os.path.join(self.dir, "stop"),
                     "out": os.path.join(self.dir, "out")}
        spec_path = os.path.join(self.dir, "spec.json")
        _write_json(spec_path, self.spec)
        self._log = open(os.path.join(self.dir, "log.txt"), "w")
        env = subprocess_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.pipeline", "--side", spec_path],
                                     cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.group = -self.proc.pid          # os.kill on the negative id signals the whole group

    def ready(self, timeout_s: float = 600) -> float:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.spec["ready"]):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} side did not reach its steady steps: {self._tail()}")
            time.sleep(0.1)
        with open(self.spec["ready"]) as f:
            return json.load(f)["step_s"]

    def finish(self, timeout_s: float = 300) -> list[dict]:
        open(self.spec["stop"], "w").close()
        os.kill(self.group, signal.SIGCONT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.name} side did not stop in {timeout_s:.0f}s") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} side failed ({self.proc.returncode}): {self._tail()}")
        out = []
        for rank in range(self.world):
            with open(f"{self.spec['out']}-{rank}") as f:
                out.append(json.load(f))
        return out

    def _tail(self) -> str:
        return log_tail(self._log)

    def close(self) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.group, sig)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self._log.close()


class Turns:
    """Takes turns between process groups with SIGSTOP/SIGCONT, `slice_s` each, in `order` (names), and
    records each slice's window (unix s) under its name."""

    def __init__(self, groups: dict[str, int], slice_s: float):
        self.groups, self.slice_s = groups, slice_s
        self.windows: dict[str, list[tuple[float, float]]] = {name: [] for name in groups}

    def run(self, order: list[str]) -> None:
        try:
            for group in self.groups.values():
                os.kill(group, signal.SIGSTOP)
            for name in order:
                os.kill(self.groups[name], signal.SIGCONT)
                start = time.time()
                time.sleep(self.slice_s)
                stop = time.time()
                os.kill(self.groups[name], signal.SIGSTOP)
                self.windows[name].append((start, stop))
        finally:
            for group in self.groups.values():
                os.kill(group, signal.SIGSTOP)


# -- the same work standalone: one process per stage, in its own process group ------------------------
def alone_rank(rank: int, spec: dict) -> None:
    """Run the fill work alone, `CHUNK` rows at a time, until the stop file; chunk end times to out-<rank>."""
    import torch

    from spotfill.fillin.bubble_fill import EvalUnitsWork
    torch.set_num_threads(1)
    output = f"{spec['plan']}-alone-{rank}"
    shutil.copytree(spec["plan"], output, dirs_exist_ok=True)
    work = EvalUnitsWork(output, rank=0, world=1)
    work.run(CHUNK)
    if rank == 0:
        _write_json(spec["ready"], {"step_s": 0.0})
    ends = []
    while not os.path.exists(spec["stop"]) and work.pending():
        work.run(CHUNK)
        ends.append(time.time())
    work.close()
    _write_json(f"{spec['out']}-{rank}", {"end_t": ends, "exhausted": not work.pending()})


# -- results -------------------------------------------------------------------------------------------
def per_step(ranks: list[dict]) -> list[dict]:
    """One record per step over the ranks: rank 0's end time and step time, the loss, bubble, fill and
    schedule seconds summed over ranks, per-stage bubble fractions, fill rows so far and the digests."""
    n = min(len(r["steps"]) for r in ranks)
    out = []
    for i in range(n):
        recs = [r["steps"][i] for r in ranks]
        out.append({"step": recs[0]["step"], "end_t": recs[0]["end_t"], "step_s": recs[0]["step_s"],
                    "loss": recs[0]["loss"], "bubble_s": sum(x["bubble_s"] for x in recs),
                    "fill_s": sum(x["fill_s"] for x in recs), "wall_s": sum(x["wall_s"] for x in recs),
                    "stage_fraction": [x["bubble_s"] / x["wall_s"] if x["wall_s"] else 0.0 for x in recs],
                    "fill_rows": sum(x["fill_rows"] for x in recs), "digests": [x["digest"] for x in recs]})
    return out


def results(plain: list[dict], filled: list[dict], alone: list[dict], windows: dict, stages: int,
            micro_batches: int, tokens_per_step: int) -> dict:
    """The section from both sides' step records, the standalone chunks and the slices' windows. Round i
    is plain slice i, filled slice i, standalone slice i (and plain slice i + 1 after it)."""
    from spotfill.train.bubble import percentile, theory_fraction

    p_steps, f_steps = per_step(plain), per_step(filled)
    common = min(len(p_steps), len(f_steps))
    identical = common > 0 and all(p_steps[i]["loss"] == f_steps[i]["loss"] and
                                   p_steps[i]["digests"] == f_steps[i]["digests"] for i in range(common))
    p_ends, f_ends = [s["end_t"] for s in p_steps], [s["end_t"] for s in f_steps]
    p_in = [p_steps[i] for i in steps_in(p_ends, windows["plain"])]
    if not p_in:
        raise RuntimeError("no plain step ran wholly inside a slice")
    rounds, skipped = [], []
    for i, (a, b) in enumerate(windows["filled"]):
        f_idx = steps_in(f_ends, [(a, b)])
        rate_p = [window_rate(p_ends, *w, tokens_per_step) for w in windows["plain"][i:i + 2]]
        rate_f = window_rate(f_ends, a, b, tokens_per_step)
        alone_rates = [window_rate(r["end_t"], *windows["alone"][i], CHUNK) for r in alone]
        if not f_idx or rate_f is None or None in rate_p or None in alone_rates:
            skipped.append(i)        # a slice the machine's other load starved of whole steps
            continue
        rows = sum(f_steps[j]["fill_rows"] - f_steps[j - 1]["fill_rows"] for j in f_idx)
        bubble_s = sum(f_steps[j]["bubble_s"] for j in f_idx)
        fill_s = sum(f_steps[j]["fill_s"] for j in f_idx)
        alone_s = sum(r[0] for r in alone_rates) / len(alone_rates)
        rounds.append({"step_ratio": (rate_p[0][0] + rate_p[1][0]) / 2 / rate_f[0],
                       "fill_rows_per_bubble_s": rows / bubble_s if bubble_s else 0.0,
                       "standalone_rows_s": alone_s, "fill_time_share": fill_s / bubble_s if bubble_s else 0.0,
                       "fill_share": rows / bubble_s / alone_s if bubble_s and alone_s else 0.0,
                       "filled_steps": len(f_idx)})
    if not rounds:
        raise RuntimeError(f"no round's slices held 2 whole steps and chunks ({len(skipped)} rounds)")
    overruns = [x for r in filled for x in r["overruns"]]
    return {
        "stages": stages, "micro_batches": micro_batches,
        "bubble_fraction_measured": rnd(median(s["bubble_s"] / s["wall_s"] for s in p_in), 4),
        "bubble_fraction_theory": rnd(theory_fraction(stages, micro_batches), 4),
        "bubble_stage": [rnd(median(s["stage_fraction"][k] for s in p_in), 4) for k in range(stages)],
        "fill_share": rnd(median(r["fill_share"] for r in rounds), 4),
        "slowdown": rnd(median(r["step_ratio"] for r in rounds) - 1.0, 4),
        "loss_identical": bool(identical), "steps_compared": common,
        "overrun_s": {"p50": rnd(percentile(overruns, 50), 6), "p99": rnd(percentile(overruns, 99), 6)},
        "fill_time_share": rnd(median(r["fill_time_share"] for r in rounds), 4),
        "fill_points": len(overruns),
        "rounds": [{k: rnd(v, 4) for k, v in r.items()} for r in rounds], "rounds_skipped": skipped,
        "plain_step_s": rnd(median(s["step_s"] for s in p_in), 5),
        "sliced_steps": {"plain": len(p_in), "filled": sum(r["filled_steps"] for r in rounds)},
    }


def bench_pipeline(quick: bool = True, progress=None, stages: int = 2, micro_batches: int = 4,
                   global_batch: int = 128, preset: str = "tiny", seconds: float | None = None,
                   rounds: int | None = None) -> dict:
    """The CONTRACTS "pipeline" section (plus details)."""
    say = progress or (lambda msg: None)
    seconds = seconds or (15.0 if quick else 60.0)
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="spotfill-bench-pipeline-")
    sides: list[Side] = []
    try:
        data, plan_dir = os.path.join(work, "data"), os.path.join(work, "fill")
        manifest = prepare_local(data, min_rows=40000)   # more fill work than the slices can use
        make_plan(plan_dir, data, preset)
        job = {"name": "bench-pipeline", "storage": os.path.join(work, "ckpt"), "data": {"path": data},
               "training": {"model": preset, "workers": [stages], "steps": 10 ** 6, "global_batch": global_batch,
                            "pipeline_stages": stages, "micro_batches": micro_batches, "zero_stage": 1,
                            "warmup_steps": 5}}
        filled_job = {**job, "training": {**job["training"], "bubble_fill": plan_dir}}
        plain, filled = Side("plain", work, job, stages), Side("filled", work, filled_job, stages)
        sides = [plain, filled]
        step_s = max(plain.ready(), filled.ready())
        for side in sides:
            os.kill(side.group, signal.SIGSTOP)
        alone = Side("alone", work, None, stages, plan=plan_dir)
        sides.append(alone)
        alone.ready()
        say(f"{manifest['num_samples']} rows; both sides steady ({step_s * 1e3:.0f} ms/step at once)")
        slice_s = max(SLICE_MIN_S, SLICE_STEPS * step_s)
        rounds = rounds or max(3, math.ceil(seconds / slice_s))
        turns = Turns({s.name: s.group for s in sides}, slice_s)
        turns.run(["plain", "filled", "alone"] * rounds + ["plain"])
        outs = {s.name: s.finish() for s in sides}
        result = results(outs["plain"], outs["filled"], outs["alone"], turns.windows, stages, micro_batches,
                         global_batch * outs["plain"][0]["seq_len"])
        say(f"bubble {result['bubble_fraction_measured']} measured vs {result['bubble_fraction_theory']} theory; "
            f"fill share {result['fill_share']}, slowdown {result['slowdown']}, "
            f"loss identical {result['loss_identical']}")
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(work, ignore_errors=True)
    return {**result, "model": preset, "global_batch": global_batch, "micro_batch": outs["plain"][0]["micro_batch"],
            "slice_s": rnd(slice_s, 3), "seconds": round(time.perf_counter() - t_start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/pipeline.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--seconds", type=float, help="seconds of time slices per side (default 15 quick, 60)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--side", help=argparse.SUPPRESS)     # internal: run one side from its spec
    args = parser.parse_args(argv)
    if args.side:
        return _side_main(args.side)
    for name in ("stages", "micro_batches", "global_batch", "seconds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be a positive number")
    result = bench_pipeline(args.quick, stages=args.stages, micro_batches=args.micro_batches,
                            global_batch=args.global_batch, seconds=args.seconds,
                            progress=lambda m: print(f"pipeline: {m}", file=sys.stderr, flush=True))
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

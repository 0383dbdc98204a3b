"""All benchmark sections -> the CONTRACTS "Benchmarks JSON" (what `spotfill bench` runs).

    python benchmarks/run.py [--quick] [--json PATH] [--only checkpoint,overhead,gpu,upload]

Each section runs in a fresh interpreter (its own torch.distributed group, DeepSpeed globals, Ray cluster
and memory), one after the other on this machine, in the same run. A section whose capability is not
built here is left out; "gpu" is null without
CUDA. A section that fails is left out too and named under "errors" with its one-line reason.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import REPO, machine, subprocess_env  # noqa: E402

# name -> (module, function); called as fn(quick) in the child, or fn(quick, progress=...) when it takes one
SECTIONS: dict[str, tuple[str, str]] = {
    "checkpoint": ("benchmarks.checkpoint", "bench_checkpoint"),
    "overhead": ("benchmarks.overhead", "bench_overhead"),
    "gpu": ("benchmarks.gpu", "bench_gpu"),
    "upload": ("benchmarks.upload", "bench_upload_section"),
    "recovery": ("benchmarks.recovery", "bench_recovery"),
    "preemption": ("benchmarks.recovery", "bench_preemption"),
    "fillin": ("benchmarks.fillin", "bench_fillin"),
    "eventlog": ("benchmarks.eventlog", "bench_eventlog"),
    "pipeline": ("benchmarks.pipeline", "bench_pipeline"),
    "elastic_load": ("benchmarks.elastic_load_memory", "bench_elastic_load"),
    "serve": ("benchmarks.serve", "bench_serve"),
}
DEFAULT_SECTIONS = ("recovery", "preemption", "checkpoint", "overhead", "gpu", "fillin", "pipeline", "serve")
# a section's time limit (quick, full) where the default (900, 3600 s) is too short: fillin runs eight
# scenarios (Serve warm and cold, no fill-in, no load, batch + sweep warm and cold, interleaved ratio pairs)
SECTION_TIMEOUT_S = {"fillin": (2700, 7200)}
TARGETS = {("checkpoint", "stall_ratio"): ("<=", 0.10), ("checkpoint", "upload_ratio"): (">=", 0.70),
           ("overhead", "ratio"): (">=", 0.97), ("recovery", "speedup"): (">=", 8.0),
           ("recovery", "speedup_vs_tuned"): (">=", 2.0),
           ("preemption", "lost_steps"): ("<=", 0),
           ("fillin", "handback_s_max"): ("<=", 5.0), ("fillin", "harvest_ratio"): (">=", 0.9),
           ("fillin", "training_tokens_ratio"): (">=", 0.98),
           ("pipeline", "slowdown"): ("<=", 0.02), ("pipeline", "fill_share"): (">=", 0.5)}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": sys.version.split()[0]}
    for pkg in ("ray", "torch", "deepspeed", "boto3", "moto"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _run_child(name: str, quick: bool, say: Callable[[str], None], timeout_s: float) -> tuple[object, str | None]:
    """Run one section in a fresh interpreter; (result, None) or (None, one-line error)."""
    work = tempfile.mkdtemp(prefix=f"spotfill-bench-{name}-")
    out, progress, logpath = (os.path.join(work, f) for f in ("out.json", "progress.txt", "log.txt"))
    cmd = [sys.executable, "-m", "benchmarks.run", "--child", name, "--out", out, "--progress", progress]
    if quick:
        cmd.append("--quick")
    seen = 0
    with open(logpath, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            done = proc.poll() is not None
            if os.path.exists(progress):
                with open(progress) as f:
                    lines = f.read().splitlines()
                for line in lines[seen:]:
                    say(f"{name}: {line}")
                seen = len(lines)
            if done:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                return None, f"timed out after {timeout_s:.0f}s (log: {logpath})"
            time.sleep(0.5)
    if proc.returncode != 0 or not os.path.exists(out):
        with open(logpath, errors="replace") as f:
            tail = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
        return None, f"exit {proc.returncode}: {reason[:300]} (log: {logpath})"
    with open(out) as f:
        result = json.load(f)
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    return result, None


def run_all(quick: bool, sections=None, progress: Callable[[str], None] | None = None,
            timeout_s: float | None = None) -> dict:
    """Run `sections` (default: checkpoint, overhead, gpu) and return the benchmark JSON dict."""
    sections = list(sections or DEFAULT_SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; accepted: {list(SECTIONS)}")
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    result: dict = {"machine": machine(),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "quick": bool(quick), "versions": _versions()}
    errors = {}
    for name in sections:
        say(f"{name}: running")
        t1 = time.perf_counter()
        limit = SECTION_TIMEOUT_S.get(name, (900, 3600))[0 if quick else 1]
        value, error = _run_child(name, quick, say, timeout_s or limit)
        if error:
            errors[name] = error
            say(f"{name}: FAILED {error}")
            continue
        result[name] = value
        say(f"{name}: done in {time.perf_counter() - t1:.0f}s")
    if errors:
        result["errors"] = errors
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def targets(result: dict) -> dict[str, bool]:
    """"section.key" -> whether the measured value meets its target, for the sections present."""
    out = {}
    for (section, key), (op, bound) in TARGETS.items():
        value = (result.get(section) or {}).get(key)
        if isinstance(value, (int, float)):
            out[f"{section}.{key}"] = value <= bound if op == "<=" else value >= bound
    return out


def _breakdown_lines(section: dict) -> list[str]:
    """One line per side: where the recovery seconds went."""
    return [f"  {side:<12} " + ", ".join(f"{k} {v}" for k, v in parts.items())
            for side, parts in (section.get("recovery_breakdown") or {}).items() if parts]


def summary(result: dict) -> str:
    """A readable multi-line summary of a benchmark JSON dict."""
    met = targets(result)

    def mark(key: str) -> str:
        op, bound = TARGETS[tuple(key.split("."))]
        return f"(target {op} {bound:g}: {'ok' if met[key] else 'MISSED'})" if key in met else ""

    lines = [f"spotfill bench{' --quick' if result.get('quick') else ''}  {result.get('date', '')}",
             f"  machine: {result.get('machine', '')}"]
    r = result.get("recovery")
    if r:
        lines.append(f"recovery    hard node loss -> stepping again: spotfill {r['spotfill_s']}s vs stock Ray "
                     f"{r['stock_ray_s']}s -> {r['speedup']}x {mark('recovery.speedup')}; lost "
                     f"{r['lost_steps']} steps")
        if r.get("stock_tuned_s") is not None:
            lines.append(f"  vs stock Ray with spotfill's Ray timeouts {r['stock_tuned_s']}s -> "
                         f"{r['speedup_vs_tuned']}x {mark('recovery.speedup_vs_tuned')}")
        lines += _breakdown_lines(r)
        f = r.get("with_fillin")
        if f:
            lines.append(f"  with Serve fill-in on the other GPUs: spotfill {f['spotfill_s']}s, lost {f['lost_steps']} "
                         f"steps, world size after {f['world_size_after']}, warm {f['warm']}")
    p = result.get("preemption")
    if p:
        lines.append(f"preemption  drain with {p['deadline_s']}s deadline: lost {p['lost_steps']} steps "
                     f"{mark('preemption.lost_steps')}, stepping again after {p['resume_s']}s vs stock "
                     f"{p['stock_resume_s']}s" + (f", stock-tuned {p['stock_tuned_resume_s']}s"
                                                   if p.get("stock_tuned_resume_s") is not None else ""))
        lines += _breakdown_lines(p)
    c = result.get("checkpoint")
    if c:
        lines += [f"checkpoint  {c['params'] / 1e6:.1f}M params ({c.get('preset')}), {c['bytes'] / 1e6:.0f} MB "
                  f"per checkpoint, median of {c.get('repeats')}",
                  f"  stall per save {c['stall_s']:.3f}s (snapshot to {c.get('snapshot_dir')}) vs sync "
                  f"save+upload {c['sync_save_upload_s']:.2f}s -> stall_ratio {c['stall_ratio']:.3f} "
                  f"{mark('checkpoint.stall_ratio')}",
                  f"  upload {c['upload_mb_s']:.1f} MB/s vs raw boto3 {c['raw_boto3_mb_s']:.1f} MB/s -> "
                  f"upload_ratio {c['upload_ratio']:.2f} {mark('checkpoint.upload_ratio')}"]
        if c.get("snapshot_s_by_dir"):
            lines.append("  snapshot by folder: " + ", ".join(
                f"{k} {v:.3f}s" for k, v in c["snapshot_s_by_dir"].items()))
    o = result.get("overhead")
    if o:
        lines += [f"overhead    {o.get('model')} ({o.get('params')} params), global batch {o.get('global_batch')}"
                  f" = {o.get('micro_batch')} x {o.get('accum')}, {o.get('steady_steps')} steady steps",
                  f"  spotfill {o['spotfill_tokens_s']:.0f} tokens/s vs plain DeepSpeed "
                  f"{o['plain_deepspeed_tokens_s']:.0f} tokens/s -> ratio {o['ratio']:.3f} "
                  f"{mark('overhead.ratio')}",
                  f"  per-step overhead {o.get('per_step_overhead_ms')} ms on a "
                  f"{(o.get('plain_ms') or {}).get('step')} ms step"]
    if "gpu" in result:
        g = result["gpu"]
        if g is None:
            lines.append("gpu         none (CUDA unavailable)")
        else:
            mfu = f"{g['mfu']:.3f}" if g.get("mfu") is not None else "n/a (device not in catalogue)"
            lines.append(f"gpu         {g['device']}: {g['preset']} ({g['params'] / 1e9:.2f}B params) "
                         f"{g['tokens_s']:.0f} tokens/s, MFU {mfu}")
    f = result.get("fillin")
    if f:
        sv = f.get("serve") or {}
        lines += [f"fillin      hand-back worst {f['handback_s_max']}s {mark('fillin.handback_s_max')} "
                  f"({len(f.get('handback_seconds') or [])} reclaims); harvest ratio {f['harvest_ratio']} "
                  f"{mark('fillin.harvest_ratio')}",
                  f"  training {f['training_tokens_s_with_fillin']} tokens/s with fill-in vs "
                  f"{f['training_tokens_s_without']} without -> {f['training_tokens_ratio']} "
                  f"{mark('fillin.training_tokens_ratio')} (Serve shares this machine's CPU cores); "
                  f"{f.get('training_tokens_ratio_no_load')} with Serve deployed and no load",
                  f"  serve: {sv.get('requests_ok')} ok, {sv.get('requests_rejected_503')} x 503, "
                  f"{sv.get('requests_failed')} failed; p50 {sv.get('p50_ms')} ms, p99 {sv.get('p99_ms')} ms"]
        lines += [f"  lend -> busy {w}: median {v.get('median')} s, worst {v.get('max')} s (lend -> held "
                  f"{v.get('to_hold_median')} s, held -> computing {v.get('hold_to_busy_median')} s; "
                  f"{v.get('never_busy')} of {v.get('leases')} leases never computed)"
                  for w, v in sorted((f.get("lend_to_busy_s") or {}).items())]
    pl = result.get("pipeline")
    if pl:
        lines += [f"pipeline    {pl['stages']} stages x {pl['micro_batches']} micro-batches ({pl.get('model')}, "
                  f"gloo): bubble {pl['bubble_fraction_measured']} measured vs {pl['bubble_fraction_theory']} "
                  f"theory (per stage {pl.get('bubble_stage')})",
                  f"  fill share {pl['fill_share']} {mark('pipeline.fill_share')}, slowdown {pl['slowdown']} "
                  f"{mark('pipeline.slowdown')}, losses identical {pl['loss_identical']}, overrun p50 "
                  f"{pl['overrun_s']['p50']} s / p99 {pl['overrun_s']['p99']} s"]
    sv = result.get("serve")
    if sv:
        sd = sv.get("specdec") or {}
        tps, toy, spec = sv["tokens_per_s"], sv.get("toy_loop_tokens_per_s") or {}, sd.get("tokens_per_s") or {}
        lines += [f"serve       {sv.get('model')} ({sv.get('weights')} weights) on {sv.get('device')}: engine "
                  f"{tps['batch1']} / {tps['batch8']} tokens/s at batch 1 / 8 vs the old loop {toy.get('batch1')} / "
                  f"{toy.get('batch8')}",
                  f"  draft {sd.get('draft')} (k <= {sd.get('num_draft_tokens')}, adaptive): {spec.get('batch1')} / "
                  f"{spec.get('batch8')} tokens/s; acceptance {sd.get('acceptance_rate')}, mean accepted length "
                  f"{sd.get('mean_accepted_length')} (theory {sd.get('expected_tokens_per_step')})"]
    u = result.get("upload")
    if u:
        lines.append(f"upload      {u['bytes'] / 1e6:.0f} MB synthetic: {u['upload_mb_s']:.1f} MB/s vs raw "
                     f"boto3 {u['raw_boto3_mb_s']:.1f} MB/s -> {u['upload_ratio']:.2f}")
    for name, err in (result.get("errors") or {}).items():
        lines.append(f"{name:<11} FAILED: {err}")
    lines.append(f"total {result.get('seconds', 0):.0f}s")
    return "\n".join(lines)


def _child(name: str, quick: bool, out: str, progress_path: str | None) -> int:
    import importlib
    import inspect

    module, fn_name = SECTIONS[name]
    fn = getattr(importlib.import_module(module), fn_name)
    kwargs = {}
    if progress_path and "progress" in inspect.signature(fn).parameters:
        def progress(msg: str) -> None:
            with open(progress_path, "a") as f:
                f.write(msg + "\n")
        kwargs["progress"] = progress
    result = fn(quick, **kwargs)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, fewer repeats (~4 min)")
    parser.add_argument("--json", metavar="PATH", help="write the benchmark JSON here")
    parser.add_argument("--only", metavar="SECTION,...", help=f"run only these of {', '.join(SECTIONS)}")
    parser.add_argument("--child", choices=list(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.quick, args.out, args.progress)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    if sections and any(s not in SECTIONS for s in sections):
        parser.error(f"--only: unknown section in {args.only!r}; accepted: {', '.join(SECTIONS)}")
    result = run_all(args.quick, sections, progress=lambda m: print(m, file=sys.stderr, flush=True))
    return finish(result, args.json)


def finish(result: dict, json_path: str | None) -> int:
    """Print the summary, write the JSON when asked; exit code 1 when a section failed."""
    print(summary(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {json_path}")
    if result.get("errors"):
        print(f"spotfill: failed: {len(result['errors'])} section(s) failed: {', '.join(result['errors'])}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

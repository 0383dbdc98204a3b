"""The GPU check: everything spotfill does on a GPU, in one run with one JSON file (benchmarks/gpu_check.sh
installs the carried wheels and calls this on the lent machine).

    python3 -m benchmarks.gpu_check --out gpu_check.json [--budget-s 360] [--only a,b] [--cpu-dry-run]

Sections, each in its own process under its own time limit (the rest of the budget caps it), each with a
record in the JSON even when it fails or runs out of time -- the file is rewritten after every section:
  env         the machine: GPU, driver, torch/CUDA, Ray and DeepSpeed versions, TORCH_CUDA_ARCH_LIST
  pytest_gpu  `pytest tests/gpu`: training's engine trains from its first step; devices on a real GPU
  bench_gpu   benchmarks/gpu.py for 125m and 1b (1b with plain PyTorch bf16 side by side): tokens/s, MFU,
              HFU, the step split
  ray_train   the real training path: a local Ray with one GPU, spotfill's TrainingJob (Ray Train worker,
              build_engine, the worker loop) on the 1b preset, one worker on the GPU; MFU from its step
              events. One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so a two-worker
              group is not run here.
  tenants     where Ray's assignment puts a process (a num_gpus=1 and a num_gpus=0 actor), one batch wave
              (an eval unit and a generation unit) and one sweep trial on the GPU
  serve       the generation engine on the GPU (no Ray, no Serve): greedy output with and without a self-
              speculative draft in fp32 and bf16 (divergences counted, benchmarks/serve_gpu_check.py), then
              benchmarks/serve.py on the 125m preset: tokens/s at batch 1 and 8, the first loop vs the engine,
              with and without the draft self:4, acceptance and mean accepted length
`--cpu-dry-run`: the same wiring on a machine without CUDA (tiny models, the CPU) -- to check that the
carried packages import and every section runs, before device time is spent.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# in this order, each with its cap in seconds (the budget left caps it further)
SECTIONS = {"env": 30, "pytest_gpu": 75, "bench_gpu": 110, "ray_train": 150, "tenants": 90, "serve": 100}
GPU_FREE_WAIT_S = 30       # before a section: wait this long at most for the last one's GPU processes to end
RAY_TRAIN_STEPS = 30
FINAL_SAVE_WAIT_S = 45     # after the last step: how long the ray_train section waits for the final checkpoint


def _write(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    os.replace(tmp, path)


# -- sections (each runs in a child process: `--section NAME --result FILE`) -------------------------
def section_env(dry: bool) -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
           "install_s": float(os.environ["GPU_CHECK_INSTALL_S"]) if os.environ.get("GPU_CHECK_INSTALL_S") else None}
    for mod in ("ray", "deepspeed", "pydantic", "numpy", "pyarrow"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - what is missing is the finding
            out[mod] = f"missing: {type(exc).__name__}: {exc}"[:200]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   memory_gb=round(p.total_memory / 1e9, 1), multiprocessors=p.multi_processor_count)
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return out


def section_pytest_gpu(dry: bool) -> dict:
    import re
    target = "tests/gpu" if not dry else "tests/gpu tests/unit/test_engine_start.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *target.split()],
                          cwd=REPO, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1]
                                                  if text.strip() else "")}
    return {"exit_code": proc.returncode, **counts, "tail": text[-3000:]}


def section_bench_gpu(dry: bool) -> dict:
    from benchmarks import gpu
    if dry:
        r = gpu.train_throughput("tiny", "cpu", "fp32", steps=2, warmup=1, micro_batches=(4,))
        return {"tiny_cpu": {k: r[k] for k in ("tokens_s", "micro_batch", "optimizer", "flops_per_token")}}
    return {"125m": gpu.bench_gpu(quick=True, preset="125m"), "1b": gpu.bench_gpu(quick=True, preset="1b", baseline=True)}


def _ray_init(dry: bool) -> None:
    """A local Ray whose one node holds the machine's one GPU (`GPU`; a dry run also declares GPU_SLOT: Ray
    Train on `GPU` means NCCL, which a machine without CUDA cannot run)."""
    import ray
    ray.init(num_cpus=min(12, os.cpu_count() or 2) if not dry else 2, num_gpus=1, include_dashboard=False,
             resources={"GPU_SLOT": 1} if dry else None, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})


def _steady(steps: list[dict], skip: int = 3) -> dict:
    import statistics
    rows = [s for s in steps if s.get("step", 0) > skip] or steps
    def med(key):
        vals = [s[key] for s in rows if s.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None
    return {"steps": len(steps), "steady_steps": len(rows), "mfu_median": med("mfu"), "hfu_median": med("hfu"),
            "tokens_per_s_median": med("tokens_per_s"), "step_s_median": med("step_s"),
            "forward_backward_s_median": med("forward_backward_s"), "optimizer_s_median": med("optimizer_s"),
            "data_wait_s_median": med("data_wait_s"), "collective_wait_s_median": med("collective_wait_s"),
            "gpu_util_median": med("gpu_util"),
            # a step event's lr is the engine's after that step: the lr step 2 trains at (0.0 before the fix)
            "lr_after_first_step": steps[0].get("lr") if steps else None}


def section_ray_train(dry: bool, deadline: float) -> dict:
    """TrainingJob.fit on a thread; at the deadline, what the step events say so far."""
    import threading

    import numpy as np

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.storage.base import open_storage
    from spotfill.train.data import ShardWriter
    from spotfill.train.job import TrainingJob
    from spotfill.train.presets import preset

    model = "tiny" if dry else "1b"
    cfg = preset(model)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.statvfs("/dev/shm").f_bavail * os.statvfs(
        "/dev/shm").f_frsize > 60e9 else None      # the final 1b checkpoint (17 GB) twice: snapshot + storage
    root = tempfile.mkdtemp(prefix="gpu-check-train-", dir=shm)
    os.environ["SPOTFILL_LOCAL_DIR"] = os.path.join(root, "local")
    batch = 4 if dry else 16
    writer = ShardWriter(open_storage(os.path.join(root, "data")), cfg.seq_len, cfg.vocab_size, "random",
                         rows_per_shard=4096)
    writer.add(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(RAY_TRAIN_STEPS * batch, cfg.seq_len + 1)))
    writer.close()
    job = from_mapping(JobConfig, {
        "name": "gpu-check", "run_dir": os.path.join(root, "run"), "storage": os.path.join(root, "storage"),
        "data": {"path": os.path.join(root, "data")},
        "training": {"model": model, "workers": [1, 1], "steps": RAY_TRAIN_STEPS, "global_batch": batch,
                     "max_micro_batch": batch, "zero_stage": 2, "precision": "fp32" if dry else "bf16",
                     "warmup_steps": 5, "checkpoint_every": 10 * RAY_TRAIN_STEPS},
        "cluster": {"gpu_resource": "GPU_SLOT" if dry else "GPU", "gpus_per_worker": 1,
                    "cpus_per_worker": 1 if dry else 8}})
    _ray_init(dry)
    training = TrainingJob(job)
    done: dict = {}

    def fit():
        try:
            done["report"] = training.fit()
        except BaseException as exc:  # noqa: BLE001 - recorded
            done["error"] = f"{type(exc).__name__}: {exc}"[:1000]

    from spotfill.telemetry.events import read_events

    def step_events() -> list[dict]:
        if not os.path.exists(training.events_path):
            return []
        return [e for e in read_events(training.events_path) if e.get("kind") in ("step", "start", "resume")]

    t0, last_step_at = time.time(), None
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    while thread.is_alive() and time.time() < deadline:
        thread.join(2.0)
        if last_step_at is None and sum(e["kind"] == "step" for e in step_events()) >= RAY_TRAIN_STEPS:
            last_step_at = time.time()       # then the final checkpoint (17 GB on 1b): waited for a while
        if last_step_at is not None and time.time() - last_step_at > FINAL_SAVE_WAIT_S:
            break
    events = step_events()
    steps = [e for e in events if e.get("kind") == "step"]
    start = next((e for e in events if e.get("kind") in ("start", "resume")), {})
    out = {"finished": not thread.is_alive(), "seconds": round(time.time() - t0, 1), "model": model,
           "workers": 1, "global_batch": batch, "seq_len": cfg.seq_len, "checkpoint_dir": shm or "tmp",
           "device": start.get("device"), "precision": start.get("precision"), "params": start.get("params"),
           "flops_per_token": start.get("flops_per_token"), "peak_flops_per_gpu": start.get("peak_flops_per_gpu"),
           "startup_s": start.get("startup_s"), **_steady(steps), "error": done.get("error")}
    report = done.get("report")
    if report:
        tr = report.get("training", {})
        out["report"] = {k: tr.get(k) for k in ("steps_completed", "final_loss", "tokens_per_s", "mfu", "hfu")}
        out["checkpoints"] = {k: (report.get("checkpoints") or {}).get(k) for k in ("committed", "stall_seconds_max",
                                                                                   "bytes_last")}
    out["losses"] = [round(s["loss"], 4) for s in steps[:3] + steps[-3:] if s.get("loss") is not None]
    return out


def section_tenants(dry: bool) -> dict:
    import torch

    from benchmarks import gpu_tenants
    _ray_init(dry)
    root = tempfile.mkdtemp(prefix="gpu-check-tenants-")
    out = {"placements": gpu_tenants.placements()}
    for name, fn in (("batch", gpu_tenants.batch_wave), ("sweep", gpu_tenants.sweep_trial)):
        try:
            out[name] = fn(root)
        except Exception as exc:  # noqa: BLE001 - the other tenant still runs
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    want = ("cuda:0", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    got = [(m.get("device"), m.get("dtype")) for m in (out["batch"].get("markers") or {}).values()]
    got.append((out["sweep"].get("device"), out["sweep"].get("dtype")))
    out["on_assigned_gpu"] = bool(got) and all(g == want for g in got) and \
        out["placements"]["assigned"]["device"] == want[0] and out["placements"]["unassigned"]["device"] == "cpu"
    return out


def section_serve(dry: bool) -> dict:
    from benchmarks import serve_gpu_check
    from benchmarks.serve import bench_serve
    preset, device = ("tiny", "cpu") if dry else ("125m", "cuda:0")
    out = {"greedy_identity": serve_gpu_check.run(preset, device, 16 if dry else 64)}
    out["bench"] = bench_serve(True, preset=None if dry else preset, device=device,
                               draft=None if dry else "self:4", new_tokens=8 if dry else 128)
    out["bench"].pop("runs", None)
    return out


def _stop_ray(timeout_s: float = 30.0) -> None:
    """Stop the local Ray this section started (its GPU worker with it), so the next section has the GPU."""
    if "ray" not in sys.modules:
        return
    import threading

    import ray
    if ray.is_initialized():
        t = threading.Thread(target=ray.shutdown, daemon=True)
        t.start()
        t.join(timeout_s)


def _wait_gpu_free(timeout_s: float = GPU_FREE_WAIT_S) -> float | None:
    """Seconds waited until no process holds the GPU (nvidia-smi's compute apps), so a section does not
    start beside the last one's leftovers (a Ray worker still writing its final checkpoint); None without
    nvidia-smi."""
    t0 = time.time()
    while True:
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return None
        if not apps or time.time() - t0 > timeout_s:
            return round(time.time() - t0, 1)
        time.sleep(1.0)


def run_section(name: str, dry: bool, deadline: float) -> dict:
    fn = globals()[f"section_{name}"]
    return fn(dry, deadline) if name == "ray_train" else fn(dry)


# -- the driver ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 360)))
    parser.add_argument("--only", default="", help="sections to run, separated by commas")
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:                                   # a child: one section, its result to --result
        t0 = time.time()
        try:
            res = {"ok": True, **run_section(args.section, args.cpu_dry_run, args.deadline or time.time() + 3600)}
        except BaseException as exc:  # noqa: BLE001 - every failure is a record
            import traceback
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        res["section_s"] = round(time.time() - t0, 1)
        _write(args.result, res)
        _stop_ray()
        sys.stdout.flush()
        os._exit(0)                                    # no waiting on Ray's or Tune's leftover threads
    names = [s for s in (args.only.split(",") if args.only else SECTIONS) if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        print(f"--only: unknown section(s) {unknown}; accepted: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    t_start = time.time()
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.cpu_dry_run, "budget_s": args.budget_s,
           "sections": {}}
    _write(args.out, doc)
    for name in names:
        left = args.budget_s - (time.time() - t_start)
        cap = min(SECTIONS[name] * float(os.environ.get("GPU_CHECK_CAP_SCALE", "1")), left - 5)
        if cap < 20:
            doc["sections"][name] = {"ok": False, "error": f"skipped: {left:.0f}s of the budget left"}
            _write(args.out, doc)
            continue
        waited = _wait_gpu_free() if name != "env" else None
        print(f"[gpu_check] {name}: up to {cap:.0f}s", flush=True)
        result = args.out + f".{name}.part"
        t0 = time.time()
        # a child that overruns is killed `grace` after its cap; ray_train ends itself at the cap
        deadline = t0 + cap - 15
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--section", name, "--result", result,
               "--deadline", str(deadline)] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=cap, capture_output=True, text=True)
            tail, rc = (proc.stdout + proc.stderr)[-2500:], proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or b""
            tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-2500:]
            rc = "timeout"
        if os.path.exists(result):
            with open(result) as f:
                rec = json.load(f)
            os.remove(result)
        else:
            rec = {"ok": False, "error": f"no result ({'ran past ' + str(round(cap)) + 's' if rc == 'timeout' else 'exit ' + str(rc)})"}
        rec["wall_s"] = round(time.time() - t0, 1)
        rec["gpu_free_wait_s"] = waited
        if not rec.get("ok"):
            rec["log_tail"] = tail
        doc["sections"][name] = rec
        doc["total_s"] = round(time.time() - t_start, 1)
        _write(args.out, doc)
        print(f"[gpu_check] {name}: {'ok' if rec.get('ok') else 'FAILED'} in {rec['wall_s']}s -- "
              f"{_headline(name, rec)}", flush=True)
    print(json.dumps(_summary(doc), indent=1), flush=True)
    return 0


def _headline(name: str, rec: dict) -> str:
    if not rec.get("ok"):
        return (rec.get("error") or "")[:200]
    if name == "bench_gpu":
        return "; ".join(f"{k}: {(v or {}).get('tokens_s')} tok/s MFU {(v or {}).get('mfu')}" for k, v in rec.items()
                         if isinstance(v, dict))
    if name == "ray_train":
        return f"{rec.get('steps')} steps, MFU median {rec.get('mfu_median')}, {rec.get('tokens_per_s_median')} tok/s"
    if name == "pytest_gpu":
        return f"passed {rec.get('passed', 0)} failed {rec.get('failed', 0)} skipped {rec.get('skipped', 0)}"
    if name == "tenants":
        return f"on the assigned GPU: {rec.get('on_assigned_gpu')}"
    return ""


def _summary(doc: dict) -> dict:
    s = doc["sections"]
    b, r = s.get("bench_gpu") or {}, s.get("ray_train") or {}
    return {"sections_ok": {k: v.get("ok") for k, v in s.items()},
            "bench_mfu": {k: (v or {}).get("mfu") for k, v in b.items() if isinstance(v, dict)},
            "ray_train_mfu_median": r.get("mfu_median"), "total_s": doc.get("total_s")}


if __name__ == "__main__":
    raise SystemExit(main())

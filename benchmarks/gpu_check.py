"""The GPU check: everything spotfill does on a GPU, in one run with one JSON file (benchmarks/gpu_check.sh
installs the carried wheels and calls this on the lent machine).

    python3 -m benchmarks.gpu_check --out gpu_check.json [--budget-s 480] [--only a,b] [--cpu-dry-run]

Sections, each in a process group of its own under its own cap -- its weight's share of the budget left
(benchmarks/gpu_sections.py: the shares add to the budget) -- killed whole (pytest, Ray's processes) when it
overruns; each with a record in the JSON even when it fails or runs out of time (a section saves what it has
as it goes), the file rewritten after every section; each section's scratch folder is removed after it:
  env         the machine: GPU, driver, torch/CUDA, Ray and DeepSpeed versions, TORCH_CUDA_ARCH_LIST; every
              module on the check's path imported, every private hook resolved (benchmarks/gpu_dry_run.py)
  pytest_gpu  `pytest tests/gpu`: training's engine trains from its first step; devices on a real GPU
  bench_gpu   benchmarks/gpu.py for 125m and 1b (1b with plain PyTorch bf16 side by side): tokens/s, MFU,
              HFU, the step split; the micro-batch sized from the device's free memory
  ray_train   the real training path: a local Ray with one GPU, spotfill's TrainingJob (Ray Train worker,
              build_engine, the worker loop) on the 1b preset, one worker on the GPU, at the micro-batch
              benchmarks/gpu.py sizes from the GPU's free memory (the next smaller one after an
              out-of-memory); MFU from its step events. One GPU holds one NCCL rank (NCCL refuses two ranks
              on one device), so a two-worker group is not run here.
  tenants     where Ray's assignment puts a process (a num_gpus=1 and a num_gpus=0 actor), one batch wave
              (an eval unit and a generation unit) and one sweep trial on the GPU
  serve       the generation engine on the GPU (no Ray, no Serve): greedy output with and without a self-
              speculative draft in fp32 and bf16 (divergences counted, benchmarks/serve_gpu_check.py), then
              benchmarks/serve.py on the 125m preset: tokens/s at batch 1 and 8, the first loop vs the engine,
              with and without the draft self:4, acceptance and mean accepted length
  vllm        (only with `--only vllm`: a device command of its own) where vLLM imports (the [llm] extra): a
              tiny Llama served by Ray Serve LLM as `spotfill serve --engine vllm` deploys it -- lent, one chat
              completion, reclaimed by a training claim, device memory freed (benchmarks/gpu_vllm.py); the
              default run records it as skipped, saying why
After the sections, `comparison`: Ray Train's MFU against DeepSpeed's and plain PyTorch bf16's on the same
preset and micro-batch (the target: Ray Train >= 0.9 x plain PyTorch bf16).
`--cpu-dry-run`: the same wiring on a machine without CUDA (tiny models, the CPU) -- to check that the
carried packages import and every section runs, before device time is spent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_sections import caps, run_process_group, share  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# in this order, each with its weight: its cap is its weight's share of the budget left (gpu_sections.share);
# with the default budget and every section running to its cap, the caps are these seconds
SECTIONS = {"env": 30, "pytest_gpu": 65, "bench_gpu": 120, "ray_train": 140, "tenants": 50, "serve": 75}
# run only when named (`--only vllm`): vLLM's start (engine, CUDA graphs) needs a device command of its own
OPT_IN = {"vllm": 1}
DEFAULT_BUDGET_S = 480     # sections only; the wheels' install (~40 s) before: one 600 s device command in all
GPU_FREE_WAIT_S = 30       # before a section: wait this long at most for the last one's GPU processes to end
RAY_TRAIN_STEPS = 30
FINAL_SAVE_WAIT_S = 30     # after the last step: how long the ray_train section waits for the final checkpoint
RAY_TRAIN_RETRY_MIN_S = 60  # after an out-of-memory, the next smaller micro-batch runs if this much is left
RAY_TRAIN_TARGET = 0.9      # Ray Train's MFU over plain PyTorch bf16's at the same micro-batch
SCRATCH_BIG_BYTES = 60e9    # ray_train's final 1b checkpoint (17 GB) twice: on /dev/shm when it has this much


def _write(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    os.replace(tmp, path)


# -- sections (each runs in a child process: `--section NAME --result FILE`) -------------------------
def _save_partial(rec: dict) -> None:
    """What a section has so far, to --result: a section killed at its cap still leaves it."""
    path = os.environ.get("GPU_CHECK_RESULT")
    if path:
        _write(path, {"ok": False, "partial": True, **rec})


def section_env(dry: bool) -> dict:
    import torch

    from benchmarks.gpu_dry_run import import_check
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
    _save_partial(out)                  # the machine's figures stay if the imports run past the cap
    out["imports"] = import_check()
    if out["imports"]["failed"] or out["imports"]["hooks_unresolved"]:
        out.update(ok=False, error=f"imports failed: {sorted(out['imports']['failed'])[:5]}, hooks unresolved: "
                                   f"{sorted(out['imports']['hooks_unresolved'])[:5]}")
    return out


def section_pytest_gpu(dry: bool, deadline: float) -> dict:
    """pytest stopped at the section's deadline keeps its output (the group kill at the cap would not)."""
    import re
    target = "tests/gpu" if not dry else "tests/gpu tests/unit/test_engine_start.py"
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *target.split()],
                              cwd=REPO, capture_output=True, text=True, timeout=max(5.0, deadline - time.time()))
    except subprocess.TimeoutExpired as exc:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))
        return {"ok": False, "error": "pytest ran past the section's deadline", "tail": text[-3000:]}
    text = proc.stdout + proc.stderr
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1]
                                                  if text.strip() else "")}
    return {"exit_code": proc.returncode, **counts, "tail": text[-3000:]}


def section_bench_gpu(dry: bool) -> dict:
    """125m, then 1b with the plain bf16 baseline; each preset's figures (or its error) kept as it ends."""
    from benchmarks import gpu
    runs = [("tiny_cpu", None)] if dry else [("125m", False), ("1b", True)]
    out: dict = {}
    for name, baseline in runs:
        try:
            if dry:
                r = gpu.train_throughput("tiny", "cpu", "fp32", steps=2, warmup=1, micro_batches=(4,))
                out[name] = {k: r[k] for k in ("tokens_s", "micro_batch", "optimizer", "flops_per_token")}
            else:
                out[name] = gpu.bench_gpu(quick=True, preset=name, baseline=baseline)
        except Exception as exc:  # noqa: BLE001 - the other preset's figures stay
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        _save_partial(out)
    failed = [k for k, v in out.items() if "error" in (v or {})]
    if failed:
        out.update(ok=False, error=f"failed: {', '.join(failed)}")
    return out


def _ray_init(dry: bool) -> None:
    """A local Ray whose one node holds the machine's one GPU (`GPU`; a dry run also declares GPU_SLOT: Ray
    Train on `GPU` means NCCL, which a machine without CUDA cannot run). Always a new one (address
    "local"): never a cluster another section or process left, whose address Ray would otherwise find."""
    import ray
    ray.init(address="local", num_cpus=min(12, os.cpu_count() or 2) if not dry else 2, num_gpus=1, include_dashboard=False,
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


def _gpu_free_bytes() -> float | None:
    """Free memory of GPU 0 from nvidia-smi (this process makes no CUDA context for a Ray worker to share
    the GPU with); None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return float(out.splitlines()[0]) * 2 ** 20
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def section_ray_train(dry: bool, deadline: float) -> dict:
    """TrainingJob.fit at the micro-batch sized from the GPU's free memory (global batch = micro-batch: one
    micro-batch a step, as benchmarks/gpu.py times the engine and plain PyTorch); training.max_failures 0,
    so an out-of-memory ends the run at once, and the next smaller size runs if time is left."""
    from benchmarks import gpu

    model = "tiny" if dry else "1b"
    free = None if dry else _gpu_free_bytes()
    sizes = (4,) if dry else gpu.fitting_micro_batches(model, free)
    out: dict = {"sized": {"free_memory_gb": round(free / 1e9, 2) if free else None, "headroom": gpu.HEADROOM,
                           "micro_batches": list(sizes)}, "attempts": []}
    _ray_init(dry)
    for i, micro in enumerate(sizes):
        run = _ray_train_run(dry, model, micro, os.path.join(os.environ.get("GPU_CHECK_SCRATCH") or
                                                             tempfile.mkdtemp(prefix="gpu-check-train-"), f"try{i}"),
                             deadline)
        out["attempts"].append({"micro_batch": micro, "steps": run["steps"], "error": run["error"]})
        out.update(run)
        _save_partial(out)
        oom = "OutOfMemory" in (run["error"] or "") or "out of memory" in (run["error"] or "")
        if not (oom and run["steps"] == 0 and deadline - time.time() > RAY_TRAIN_RETRY_MIN_S):
            break
    if out.get("error"):
        out["ok"] = False
    return out


def _ray_train_run(dry: bool, model: str, batch: int, root: str, deadline: float) -> dict:
    """One TrainingJob.fit on a thread under `root`; at the deadline, what the step events say so far."""
    import threading

    import numpy as np

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.storage.base import open_storage
    from spotfill.telemetry.events import read_events
    from spotfill.train.data import ShardWriter
    from spotfill.train.job import TrainingJob
    from spotfill.config.presets import preset

    cfg = preset(model)
    os.makedirs(root, exist_ok=True)
    os.environ["SPOTFILL_LOCAL_DIR"] = os.path.join(root, "local")
    writer = ShardWriter(open_storage(os.path.join(root, "data")), cfg.seq_len, cfg.vocab_size, "random",
                         rows_per_shard=4096)
    writer.add(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(RAY_TRAIN_STEPS * batch, cfg.seq_len + 1)))
    writer.close()
    job = from_mapping(JobConfig, {
        "name": "gpu-check", "run_dir": os.path.join(root, "run"), "storage": os.path.join(root, "storage"),
        "data": {"path": os.path.join(root, "data")},
        "training": {"model": model, "workers": [1, 1], "steps": RAY_TRAIN_STEPS, "global_batch": batch,
                     "max_micro_batch": batch, "zero_stage": 2, "precision": "fp32" if dry else "bf16",
                     "warmup_steps": 5, "checkpoint_every": 10 * RAY_TRAIN_STEPS, "max_failures": 0},
        "cluster": {"gpu_resource": "GPU_SLOT" if dry else "GPU", "gpus_per_worker": 1,
                    "cpus_per_worker": 1 if dry else 8}})
    training = TrainingJob(job)
    done: dict = {}

    def fit():
        try:
            done["report"] = training.fit()
        except BaseException as exc:  # noqa: BLE001 - recorded
            done["error"] = f"{type(exc).__name__}: {exc}"[:1000]

    def step_events() -> list[dict]:
        if not os.path.exists(training.events_path):
            return []
        return [e for e in read_events(training.events_path) if e.get("kind") in ("step", "start", "resume",
                                                                                  "controller_state")]

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
    failure = next((e for e in events if e.get("kind") == "controller_state" and e.get("error")), {})
    out = {"finished": not thread.is_alive(), "seconds": round(time.time() - t0, 1), "model": model,
           "workers": 1, "global_batch": batch, "micro_batch": batch, "seq_len": cfg.seq_len,
           "checkpoint_dir": os.path.dirname(root), "device": start.get("device"),
           "precision": start.get("precision"), "params": start.get("params"),
           "flops_per_token": start.get("flops_per_token"), "peak_flops_per_gpu": start.get("peak_flops_per_gpu"),
           "startup_s": start.get("startup_s"), **_steady(steps),
           "error": done.get("error") or (str(failure["error"])[:1000] if failure and not steps else None)}
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
    root = tempfile.mkdtemp(prefix="gpu-check-tenants-", dir=os.environ.get("GPU_CHECK_SCRATCH"))
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


def section_vllm(dry: bool, deadline: float) -> dict:
    from benchmarks import gpu_vllm
    return gpu_vllm.run(dry, deadline)


def vllm_skip_reason() -> str:
    """Why the default run leaves the vLLM section out."""
    from spotfill.serving.llm import EXTRA, vllm_missing
    missing = vllm_missing()
    return (f"skipped: {missing} ({EXTRA})" if missing else
            "skipped: vLLM imports here; run it as a device command of its own: "
            "bash benchmarks/gpu_check.sh --only vllm")


def run_section(name: str, dry: bool, deadline: float) -> dict:
    fn = globals()[f"section_{name}"]
    return fn(dry, deadline) if name in ("ray_train", "pytest_gpu", "vllm") else fn(dry)


# -- the driver ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--budget-s", type=float,
                        default=float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)))
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
    if not args.budget_s > 0:
        print(f"--budget-s: {args.budget_s:g}; accepted: seconds > 0 (default {DEFAULT_BUDGET_S})", file=sys.stderr)
        return 2
    names = [s for s in (args.only.split(",") if args.only else SECTIONS) if s]
    weights = {**SECTIONS, **OPT_IN}
    unknown = [s for s in names if s not in weights]
    if unknown:
        print(f"--only: unknown section(s) {unknown}; accepted: {', '.join(weights)}", file=sys.stderr)
        return 2
    t_start = time.time()
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.cpu_dry_run, "budget_s": args.budget_s,
           "caps_if_each_ran_to_its_cap": {k: round(v, 1) for k, v in caps({n: weights[n] for n in names},
                                                                            args.budget_s).items()},
           "sections": {}}
    if not args.only:
        doc["sections"]["vllm"] = {"ok": True, "skipped": vllm_skip_reason()}
    _write(args.out, doc)
    for i, name in enumerate(names):
        left = args.budget_s - (time.time() - t_start)
        cap = share(name, names[i:], weights, left) * float(os.environ.get("GPU_CHECK_CAP_SCALE", "1"))
        if cap < 15:
            doc["sections"][name] = {"ok": False, "error": f"skipped: {left:.0f}s of the budget left"}
            _write(args.out, doc)
            continue
        t0 = time.time()
        waited = _wait_gpu_free(min(GPU_FREE_WAIT_S, cap / 4)) if name != "env" else None
        cap_left = cap - (time.time() - t0)
        print(f"[gpu_check] {name}: up to {cap_left:.0f}s", flush=True)
        rec = run_child(name, args, cap_left)
        rec["cap_s"], rec["wall_s"], rec["gpu_free_wait_s"] = round(cap, 1), round(time.time() - t0, 1), waited
        doc["sections"][name] = rec
        doc["total_s"] = round(time.time() - t_start, 1)
        doc["comparison"] = comparison(doc["sections"])
        _write(args.out, doc)
        print(f"[gpu_check] {name}: {'ok' if rec.get('ok') else 'FAILED'} in {rec['wall_s']}s -- "
              f"{_headline(name, rec)}", flush=True)
    print(json.dumps(_summary(doc), indent=1), flush=True)
    return 0


def _scratch_parent(name: str) -> str | None:
    """ray_train's checkpoints go to /dev/shm when it has room for the 1b one twice (snapshot + storage)."""
    if name == "ray_train" and os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > SCRATCH_BIG_BYTES:
            return "/dev/shm"
    return None


def run_child(name: str, args, cap_s: float) -> dict:
    """One section in a process group of its own (gpu_sections.run_process_group) with a scratch folder of
    its own, both gone when it returns: the group killed whole, the folder removed (checkpoints on /tmp or
    /dev/shm included) -- also when it overran its cap. A record always: the section's own, what it saved
    before it was stopped, or why there is none."""
    scratch = tempfile.mkdtemp(prefix=f"gpu-check-{name}-", dir=_scratch_parent(name))
    result = args.out + f".{name}.part"
    # ray_train ends itself 15 s before the cap: its record, then Ray's shutdown
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--section", name, "--result", result,
           "--deadline", str(time.time() + cap_s - 15)] + (["--cpu-dry-run"] if args.cpu_dry_run else [])
    env = {**os.environ, "GPU_CHECK_SCRATCH": scratch, "GPU_CHECK_RESULT": result}
    try:
        ran = run_process_group(cmd, cap_s, cwd=REPO, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rec = None
    if os.path.exists(result):
        with open(result) as f:
            rec = json.load(f)
        os.remove(result)
    over = f"ran past its {round(cap_s)}s cap" if ran["rc"] == "timeout" else None
    if rec is None:
        rec = {"ok": False, "error": f"no result ({over or 'exit ' + str(ran['rc'])})"}
    elif over:
        rec.update(ok=False, error=f"{over}; what it saved before: " + (rec.get("error") or "ok so far"))
    rec["killed_after"] = ran["killed"]
    rec["scratch_removed"] = not os.path.exists(scratch)
    if not rec.get("ok"):
        rec["log_tail"] = ran["tail"]
    return rec


def _ratio(a, b) -> float | None:
    return round(a / b, 4) if a and b else None


def comparison(sections: dict) -> dict:
    """Ray Train's MFU (median of its steady steps) against the engine alone (DeepSpeed, benchmarks/gpu.py)
    and plain PyTorch bf16 on the 1b preset, with the micro-batch each ran at."""
    b = (sections.get("bench_gpu") or {}).get("1b") or {}
    r = sections.get("ray_train") or {}
    plain = b.get("plain_bf16") or {}
    ray_mfu, ds_mfu, plain_mfu = r.get("mfu_median"), b.get("mfu"), plain.get("mfu")
    to_plain = _ratio(ray_mfu, plain_mfu)
    return {"ray_train_mfu": ray_mfu, "deepspeed_mfu": ds_mfu, "plain_bf16_mfu": plain_mfu,
            "micro_batch": {"ray_train": r.get("micro_batch"), "deepspeed": b.get("micro_batch"),
                            "plain_bf16": plain.get("micro_batch")},
            "same_micro_batch": r.get("micro_batch") is not None and r.get("micro_batch") == b.get("micro_batch")
            == plain.get("micro_batch"),
            "ray_train_to_plain_bf16": to_plain, "ray_train_to_deepspeed": _ratio(ray_mfu, ds_mfu),
            "deepspeed_to_plain_bf16": _ratio(ds_mfu, plain_mfu), "target_ray_train_to_plain_bf16": RAY_TRAIN_TARGET,
            "meets_target": None if to_plain is None else to_plain >= RAY_TRAIN_TARGET}


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
    if name == "vllm":
        return rec.get("skipped") or (f"answered {(rec.get('answer') or {}).get('text')!r}, reclaimed in "
                                      f"{rec.get('reclaim_s')}s, memory freed: {rec.get('memory_freed_s') is not None}")
    return ""


def _summary(doc: dict) -> dict:
    s = doc["sections"]
    b, r = s.get("bench_gpu") or {}, s.get("ray_train") or {}
    return {"sections_ok": {k: v.get("ok") for k, v in s.items()},
            "bench_mfu": {k: (v or {}).get("mfu") for k, v in b.items() if isinstance(v, dict)},
            "ray_train_mfu_median": r.get("mfu_median"), "comparison": doc.get("comparison"),
            "total_s": doc.get("total_s")}


if __name__ == "__main__":
    raise SystemExit(main())

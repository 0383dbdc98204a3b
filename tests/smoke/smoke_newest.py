"""CI's smoke test against the newest torch and DeepSpeed pip resolves within pyproject.toml's ranges.

    python tests/smoke/smoke_newest.py        # in an environment made by `pip install -e .` (.ci/run does)

Not a pytest file (the main run, on the pinned versions, does not collect it). Each stage prints one line;
the first failure prints its traceback and exits 1:
  1. every module of the spotfill package, jobs/*.py, serving/app.py and benchmarks/*.py import, and every
     CLI and job-script parser builds (a moved private name must never break an import);
  2. the private hooks against the installed versions (`python -m spotfill.ray_compat`): a REQUIRED hook
     that is missing fails the smoke (that feature cannot work on these versions); a robustness hook that
     is off is printed, and the product works without it;
  3. one tiny training step: the tiny preset, a ZeRO-2 engine built by spotfill.train.engine.build_engine
     on CPU (gloo, world size 1) -- DeepSpeed's CPU comm op builds through torch's JIT loader, with a build
     lock a killed builder left in its folder -- its parameters move, a checkpoint in DeepSpeed's elastic
     layout is saved and loaded back through spotfill's ZeRO elastic load, and the weights match;
  4. `spotfill plan --params 7B --gpus 8 --gpu-type a100-80gb --json` through the installed console script.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import pkgutil
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JIT_OP = "deepspeed_shm_comm"         # the op DeepSpeed's CPU comm backend loads at every engine start
STEP_TIMEOUT_S = 1500                 # a JIT build lock that hangs turns into a failure (a build under load: minutes)


def stage(name: str):
    def wrap(fn):
        def run(*args):
            t0 = time.time()
            try:
                detail = fn(*args)
            except BaseException:  # noqa: BLE001 - every failure fails the smoke, loudly
                traceback.print_exc()
                print(f"SMOKE FAIL {name} ({time.time() - t0:.1f}s)", flush=True)
                sys.exit(1)
            print(f"smoke ok   {name} ({time.time() - t0:.1f}s){': ' + detail if detail else ''}", flush=True)
        return run
    return wrap


def _load_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@stage("import every entry point")
def imports() -> str:
    import spotfill
    from spotfill.cli.main import build_parser

    names = [m.name for m in pkgutil.walk_packages(spotfill.__path__, "spotfill.")
             if not m.name.endswith(".__main__")]          # those run a command
    for name in names:
        importlib.import_module(name)
    build_parser()
    sys.path.insert(0, REPO)                         # serving and benchmarks import as packages
    importlib.import_module("serving.app")
    scripts = sorted(glob.glob(os.path.join(REPO, "jobs", "*.py")))
    for path in scripts:
        _load_file(path, f"smoke_job_{os.path.basename(path)[:-3]}").build_parser()
    benches = [f"benchmarks.{os.path.basename(p)[:-3]}" for p in sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))
               if not p.endswith("__init__.py")]
    for name in benches:
        importlib.import_module(name)
    return f"{len(names)} spotfill modules, {len(scripts)} job scripts, serving.app, {len(benches)} benchmark modules"


@stage("private hooks")
def hooks() -> str:
    from spotfill.ray_compat import status

    rows = status()
    missing = [r for r in rows if r["problem"] and r["kind"] == "required"]
    off = [r for r in rows if r["problem"] and r["kind"] == "robustness" and not r["not_needed"]]
    for r in rows:
        if r["problem"]:
            state = "not needed" if r["not_needed"] else ("MISSING" if r in missing else "OFF")
            print(f"           {r['hook']} ({r['kind']}): {state}: {r['not_needed'] or r['problem']}")
    if missing:
        raise AssertionError(f"required hooks missing on these versions: {[r['hook'] for r in missing]}")
    return f"{len(rows)} hooks, {len(off)} robustness hook(s) off, none required missing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEP = r"""
import os, sys
from spotfill.testing.tiny_step import init_single_process, save_and_reload, take_step, tiny_engine
init_single_process(int(sys.argv[1]))
engine = tiny_engine()
loss, moved = take_step(engine)
assert moved, "no parameter moved"
assert save_and_reload(engine, sys.argv[2]), "the checkpoint did not load back as saved"
op_dir = os.path.join(os.environ['TORCH_EXTENSIONS_DIR'], "deepspeed_shm_comm")
by_engine = sorted(f for f in os.listdir(op_dir) if f != "lock")   # the engine skips the op (empty)
# the dead builder's lock is still in the op's folder: a guarded load of the op gets past it
from spotfill.ray_compat import guard_jit_op_builds
guard_jit_op_builds()
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
print(f"STEP loss={loss:.3f} built_by_the_engine={by_engine} "
      f"jit_ops={sorted(os.listdir(os.environ['TORCH_EXTENSIONS_DIR']))}")
"""


def _leave_a_killed_builders_lock(ext_dir: str) -> str:
    """The lock a builder killed mid-build leaves in the op's folder (owner: a process that is gone)."""
    from spotfill.ray_compat.opcache import boot_id, owner_record

    os.makedirs(os.path.join(ext_dir, JIT_OP), exist_ok=True)
    proc = subprocess.Popen(["true"])
    proc.wait()
    path = os.path.join(ext_dir, JIT_OP, "lock")
    with open(path, "w") as f:
        f.write(owner_record(socket.gethostname(), boot_id(), proc.pid, time.time()))
    return path


@stage("one tiny training step (ZeRO-2 on CPU, gloo, world size 1; elastic checkpoint save and load)")
def train_step() -> str:
    work = tempfile.mkdtemp(prefix="spotfill-smoke-")
    try:
        ext_dir = os.path.join(work, "torch_extensions")      # a fresh JIT cache: the op is built here
        lock = _leave_a_killed_builders_lock(ext_dir)
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": ext_dir}
        proc = subprocess.run([sys.executable, "-c", STEP, str(_free_port()), os.path.join(work, "ckpt")],
                              env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STEP ")), None)
        if proc.returncode != 0 or line is None:
            raise AssertionError(f"training step failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-6000:]}")
        warned = [ln for ln in proc.stderr.splitlines() if "spotfill: " in ln and " is off " in ln]
        return f"{line[5:]}; a dead builder's lock was in the way ({os.path.basename(os.path.dirname(lock))}); " \
               f"degraded-hook warnings: {warned or 'none'}"
    finally:
        shutil.rmtree(work, ignore_errors=True)


@stage("spotfill plan --params 7B --gpus 8 --gpu-type a100-80gb --json")
def plan() -> str:
    exe = shutil.which("spotfill", path=os.path.dirname(sys.executable))     # this environment's console script
    cmd = [exe] if exe else [sys.executable, "-m", "spotfill"]
    proc = subprocess.run(cmd + ["plan", "--params", "7B", "--gpus", "8", "--gpu-type", "a100-80gb", "--json"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    if not isinstance(out, dict) or not out:
        raise AssertionError(f"not a plan: {proc.stdout[:500]}")
    return f"{cmd[0]}: JSON with {len(out)} keys"


def main() -> int:
    from importlib.metadata import version

    versions = {p: version(p) for p in ("torch", "deepspeed", "ray")}
    print("smoke: testing " + ", ".join(f"{p} {v}" for p, v in versions.items())
          + f", python {sys.version.split()[0]}", flush=True)
    t0 = time.time()
    imports()
    hooks()
    train_step()
    plan()
    print(f"smoke: PASSED on " + ", ".join(f"{p} {v}" for p, v in versions.items())
          + f" in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Private Ray/torch/DeepSpeed hooks: a moved name never breaks an import; a robustness hook turns itself off
with one warning and the product keeps working; a required hook fails the feature that uses it, when it is
used, with one line. Faults are injected by removing or changing the real private name in a fresh
interpreter (sys.executable) before spotfill touches it."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib

import pytest

from spotfill import ray_compat
from spotfill.ray_compat import catalog, hooks

REPO = pathlib.Path(__file__).resolve().parents[2]
PLATFORM = REPO / "platform"
# what each entry point imports when it starts (CLI, job scripts' mains, Serve app, workers, autoscaler)
ENTRY_MODULES = ["spotfill.cli.main", "spotfill.cli.demo", "spotfill.cli.serve", "spotfill.cli.spot_watch",
                 "spotfill.cli.status", "spotfill.cli.bench", "spotfill.train.job", "spotfill.train.worker_loop",
                 "spotfill.train.elastic", "spotfill.train.sink", "spotfill.train.teardown", "spotfill.train.engine",
                 "spotfill.train.fillin_claims", "spotfill.fillin.arbiter", "spotfill.fillin.sweep",
                 "spotfill.fillin.batch", "spotfill.spot.watcher", "spotfill.sim.cluster", "spotfill.sim.autoscaling",
                 "spotfill.testing.fake_market", "spotfill.train.pipeline", "spotfill.train.bubble_probe",
                 "spotfill.train.backend", "spotfill.fillin.wiring", "spotfill.fillin.cluster_kind", "serving.app"]
IMPORT_ALL = "import importlib\nfor _m in %r:\n    importlib.import_module(_m)\n" % ENTRY_MODULES


def _run(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO), env={**os.environ, "PYTHONPATH": f"{PLATFORM}:{REPO}"})


def _spotfill_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("spotfill")]


# -- the catalog against the installed versions ----------------------------------------------------------
def test_every_hook_resolves_against_the_installed_versions():
    """Every name in the catalog exists with its signature here (a misspelt name, or a Ray/torch/DeepSpeed
    the pins no longer match, fails this) -- or, for a robustness hook, this version needs none."""
    assert len(catalog.HOOKS) >= 20
    for name, hook in catalog.HOOKS.items():
        found = hooks.problem(name)
        assert found is None or (hook.not_needed and hook.not_needed()), (name, found)


def test_every_gate_in_the_code_names_a_hook_of_its_class():
    """usable()/require() with a name not in the catalog would raise KeyError when the feature runs."""
    src = "\n".join(p.read_text() for p in [*PLATFORM.glob("spotfill/**/*.py"), REPO / "serving" / "app.py"])
    gated = {(kind, name) for kind, name in re.findall(r"\b(usable|require)\(\"([a-z_]+)\"\)", src)}
    assert len(gated) >= 20
    for kind, name in gated:
        assert name in catalog.HOOKS, name
        assert catalog.HOOKS[name].kind == (hooks.ROBUSTNESS if kind == "usable" else hooks.REQUIRED), name


def test_a_missing_name_or_signature_is_named():
    assert hooks._resolve("json:dumps(obj)") == (None, __import__("json").dumps)
    assert hooks._resolve("json:no_such")[0] == "json.no_such (missing)"
    assert hooks._resolve("json:dumps(fp)")[0].startswith("json.dumps(fp) (it takes (obj, ")
    assert "cannot import" in hooks._resolve("spotfill_no_such_module:x")[0]


def test_pyproject_declares_the_tested_ranges():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[\[<>=!~ ]", d, 1)[0]: re.sub(r"^[A-Za-z0-9_.-]+(\[[^]]*\])?", "", d).replace(" ", "")
                for d in deps}
    for package, spec in hooks.TESTED.items():
        assert declared[package] == spec, (package, declared[package], spec)


def test_the_docs_list_every_hook_with_its_class():
    doc = (REPO / "docs" / "compatibility.md").read_text()
    for name, hook in catalog.HOOKS.items():
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{name}` |")), "")
        assert hook.kind in row, (name, row)


# -- the mechanism, with hooks made up for the test ------------------------------------------------------
def _fake(monkeypatch, name: str, kind: str, names=("json:spotfill_absent",)) -> hooks.Hook:
    hook = hooks.Hook(name, kind, "ray", "ray 2.60", "does a thing", "the thing", "a test", names=names)
    monkeypatch.setitem(catalog.HOOKS, name, hook)
    return hook


def test_a_missing_robustness_hook_is_off_with_one_warning_per_process(monkeypatch, caplog):
    _fake(monkeypatch, "t_robust", hooks.ROBUSTNESS)
    with caplog.at_level(logging.INFO, logger="spotfill.ray_compat"):
        assert [ray_compat.usable("t_robust") for _ in range(3)] == [False, False, False]
    (record,) = [r for r in caplog.records if "t_robust" in r.getMessage()]
    assert record.levelno == logging.WARNING
    msg = record.getMessage()
    assert "\n" not in msg and "t_robust is off" in msg and "json.spotfill_absent (missing)" in msg
    assert "ray 2.60 has it" in msg and "Lost: the thing" in msg
    with pytest.raises(ValueError):
        ray_compat.require("t_robust")          # the class is part of the contract


def test_a_missing_required_hook_raises_one_line_naming_the_feature_and_the_versions(monkeypatch):
    _fake(monkeypatch, "t_required", hooks.REQUIRED)
    with pytest.raises(ray_compat.RayCompatError) as err:
        ray_compat.require("t_required")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("the thing needs ray's json.spotfill_absent (missing)")
    assert "ray 2.60 has" in msg and "tested with ray>=2.60,<2.61" in msg
    from spotfill.config.errors import SpotfillError
    assert isinstance(err.value, SpotfillError) and err.value.exit_code == 1    # the CLI: one line, exit 1


def test_a_missing_base_class_can_be_subclassed_but_using_it_raises_the_feature_error(monkeypatch):
    _fake(monkeypatch, "t_base", hooks.REQUIRED, names=("json:SpotfillAbsentBase",))
    base = hooks.stand_in_base("json:SpotfillAbsentBase", "t_base")

    class Mine(base):              # what sink.py does at import
        def __init__(self, x):
            self.x = x

    with pytest.raises(ray_compat.RayCompatError, match="the thing needs"):
        Mine(1)
    assert hooks.stand_in_base("json:JSONDecoder", "t_base") is __import__("json").JSONDecoder


DRIVER_CHECKS = {   # training section -> (hook, what the one line starts with, what it names)
    "zero_elastic_load": ({"zero_stage": 2}, "resuming a ZeRO-1/2 run", "runtime/engine.py defining _get_all_zero"),
    "pipe_bubble_probe": ({"zero_stage": 0, "pipeline_stages": 2, "workers": [2]}, "pipeline-parallel training",
                          "runtime/pipe/engine.py with def _exec_schedule("),
}


def test_the_deepspeed_file_name_and_zero_window_checks_read_the_installed_source(monkeypatch):
    """restore_node_files reads how DeepSpeed builds its checkpoint file names, zero_elastic_load that the
    ZeRO optimizer sets the alignment the merge window is cut with: each finds one form gone (here, the
    installed source with one form edited away) and names it."""
    real = catalog.deepspeed_source
    assert catalog._checkpoint_names() is None and catalog._zero_elastic_files() is None
    cases = [(catalog._checkpoint_names, "runtime/engine.py", "zero_pp_rank_{}", "zero_rank_{}"),
             (catalog._zero_elastic_files, "runtime/zero/stage_1_and_2.py", "self.nccl_start_alignment_factor =",
              "self.alignment =")]
    for check, rel, form, edited in cases:
        def source(r, rel=rel, form=form, edited=edited):
            path, text = real(r)
            return path, text.replace(form, edited) if r == rel else text
        monkeypatch.setattr(catalog, "deepspeed_source", source)
        found = check()
        assert found and found.startswith(rel) and form.split(" =")[0].replace("self.", "") in found, found
    monkeypatch.setattr(catalog, "deepspeed_source", real)


@pytest.mark.parametrize("hook", sorted(DRIVER_CHECKS))
def test_the_driver_refuses_a_job_whose_deepspeed_lacks_an_internal_it_needs(monkeypatch, hook):
    """preflight: before any worker starts (Ray not touched), one line naming the feature: a DeepSpeed whose
    source lacks what ZeRO-1/2 resumes, or pipeline stages run, through."""
    import ray

    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.preflight import preflight

    def no_ray(*args, **kwargs):
        raise AssertionError("preflight reached Ray: the check did not come first")

    training, starts, names = DRIVER_CHECKS[hook]
    monkeypatch.setattr(ray, "is_initialized", no_ray)
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(catalog, "deepspeed_source", lambda rel: (f"/x/{rel}", "def load_checkpoint(self):\n"))
    cfg = from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/d"}, "training": training})
    hooks._problems.pop(hook, None)
    try:
        with pytest.raises(ray_compat.RayCompatError) as err:
            preflight(cfg, {"seq_len": 10 ** 6})
    finally:
        hooks._problems.pop(hook, None)     # the next check reads the real DeepSpeed again
    msg = str(err.value)
    assert msg.startswith(starts) and names in msg and "deepspeed 0.19 has" in msg and "\n" not in msg, msg


def test_the_pipeline_map_is_refused_in_one_line_where_deepspeed_dispatches_otherwise():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class Moved(PipelineEngine):       # a DeepSpeed whose schedule no longer dispatches through the map
        def _exec_schedule(self, pipe_schedule):
            return None

    engine = object.__new__(Moved)
    with pytest.raises(ray_compat.RayCompatError, match=r"^pipeline-parallel training .* needs deepspeed's "
                       r"Moved._exec_schedule dispatching through self._INSTRUCTION_MAP\[type\(cmd\)\]"):
        ray_compat.pipe_instruction_map(engine)
    real = object.__new__(PipelineEngine)
    table = ray_compat.pipe_instruction_map(real)
    assert table == PipelineEngine._INSTRUCTION_MAP and table is not PipelineEngine._INSTRUCTION_MAP


# -- faults injected into the real libraries, in a fresh interpreter -------------------------------------
def test_a_torch_without_filebaton_imports_every_entry_point_with_one_warning():
    """torch 2.14 dropped cpp_extension.FileBaton (issue 21): every entry point used to die at import.
    Now: everything imports, the JIT lock guard is off with one warning, `spotfill plan` runs."""
    code = ("import torch.utils.cpp_extension as c\ndel c.FileBaton\n" + IMPORT_ALL +
            "from spotfill.train.engine import build_engine\n"
            "from spotfill.ray_compat import guard_jit_op_builds\n"
            "print('GUARD', guard_jit_op_builds(), guard_jit_op_builds(), getattr(c.load, '_spotfill_guarded', False))\n"
            "from spotfill.cli.main import main\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['plan', '--params', '7B', '--gpus', '8', '--gpu-type', 'a100-80gb', '--json'])\n"
            "print('PLAN', rc)\n")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GUARD False False False" in proc.stdout and "PLAN 0" in proc.stdout, proc.stdout
    (warning,) = _spotfill_lines(proc.stderr)
    assert "jit_build_lock_guard is off" in warning and "torch.utils.cpp_extension.FileBaton (missing)" in warning
    assert "torch 2.11 to 2.13 has it" in warning and "Lost: a JIT op build lock left by a killed process" in warning


def test_a_required_ray_name_gone_fails_only_its_command_with_one_line():
    """`spotfill spot-watch` cannot drain without Ray's GCS client helpers: it exits 1 with one line
    naming the feature and the Ray versions that have them -- at start, not at the first notice; every
    entry point still imports and `spotfill plan` still works."""
    code = ("import ray._private.services as s\ndel s.canonicalize_bootstrap_address_or_die\n" + IMPORT_ALL +
            "import contextlib, io, sys\nfrom spotfill.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    plan = main(['plan', '--params', '7B', '--gpus', '8', '--gpu-type', 'a100-80gb', '--json'])\n"
            "print('PLAN', plan, flush=True)\n"
            "sys.exit(main(['spot-watch', '--once', '--imds-endpoint', 'http://127.0.0.1:9']))\n")
    proc = _run(code)
    assert proc.returncode == 1 and "PLAN 0" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith("spotfill: failed: `spotfill spot-watch` (draining this node in Ray on a spot notice) "
                           "needs ray's ray._private.services.canonicalize_bootstrap_address_or_die (missing), "
                           "which ray 2.60 has; installed: ray "), line



C10D_FAULTS = {   # how torch could move the default new process groups take -> what the warning names
    "default_gone": ("del c.default_pg_timeout\n", "torch.distributed.distributed_c10d.default_pg_timeout (missing)"),
    "read_elsewhere": ("_kept = c._get_default_timeout\n\ndef _get_default_timeout(backend):\n    return _kept(backend)\n\n"
                       "c._get_default_timeout = _get_default_timeout\n",
                       "torch.distributed.distributed_c10d._get_default_timeout reading default_pg_timeout"),
}


@pytest.mark.parametrize("fault", sorted(C10D_FAULTS))
def test_a_torch_that_keeps_the_new_group_default_elsewhere_leaves_deepspeeds_groups_alone_with_one_warning(
        tmp_path, fault):
    """deepspeed_group_timeout (robustness): where torch no longer takes new groups' default from the module
    names new_groups_timeout sets, every entry point imports, new_groups_timeout sets nothing and says so
    once (the default group's timeout is TorchConfig's, public, and unaffected)."""
    change, names = C10D_FAULTS[fault]
    script = tmp_path / "c10d.py"
    script.write_text("import torch.distributed.distributed_c10d as c\n" + change + IMPORT_ALL +
                      "from spotfill.ray_compat import new_groups_timeout\n"
                      "before = c._get_default_timeout(c.Backend.GLOO) if hasattr(c, 'default_pg_timeout') else None\n"
                      "print('SET', new_groups_timeout(5.0), new_groups_timeout(5.0))\n"
                      "if before is not None:\n"
                      "    print('UNCHANGED', c._get_default_timeout(c.Backend.GLOO) == before)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": f"{PLATFORM}:{REPO}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SET False False" in proc.stdout, proc.stdout
    if fault == "read_elsewhere":
        assert "UNCHANGED True" in proc.stdout, proc.stdout
    (warning,) = _spotfill_lines(proc.stderr)
    assert "deepspeed_group_timeout is off" in warning and names in warning, warning
    assert "torch 2.11 to 2.13 has it" in warning and "Lost: DeepSpeed's groups keep torch's global default" in warning


REQUIRED_GONE = {
    "tune_fillin_sweep": (
        "from ray.tune.execution.tune_controller import TuneController as T\ndel T._unstage_trial_with_resources\n",
        "from spotfill.fillin import sweep\nsweep._searcher_class()\n",
        "the fill-in Tune sweep (jobs/sweep.py) needs ray's ray.tune.execution.tune_controller.TuneController."
        "_unstage_trial_with_resources (missing), which ray 2.60 has"),
    "fake_multinode_cluster": (   # the class testing.fake_market subclasses at import
        "import ray.autoscaler._private.fake_multi_node.node_provider as p\ndel p.FakeMultiNodeProvider\n",
        "from spotfill.testing.fake_market import MarketFakeProvider\nMarketFakeProvider({}, 'c')\n",
        "the autoscaling local cluster (`spotfill demo` without --static, scenarios with autoscaling) needs "
        "ray's ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider (missing)"),
}


@pytest.mark.parametrize("hook", sorted(REQUIRED_GONE))
def test_a_required_name_gone_fails_its_feature_when_used_not_at_import(hook):
    remove, use, says = REQUIRED_GONE[hook]
    code = (remove + IMPORT_ALL + "from spotfill.ray_compat import RayCompatError\nprint('IMPORTED', flush=True)\n"
            "try:\n" + "".join(f"    {ln}\n" for ln in use.splitlines()) +
            "except RayCompatError as e:\n    print('REFUSED', e)\n")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED" in proc.stdout and f"REFUSED {says}" in proc.stdout, proc.stdout
    assert _spotfill_lines(proc.stderr) == []         # nothing said at import


_ENGINE_STEP = r"""
import sys
if sys.argv[2] == "moved-baton":   # a torch whose FileBaton takes another first parameter
    import torch.utils.cpp_extension as c, torch.utils.file_baton as fb
    class FileBaton(fb.FileBaton):
        def __init__(self, path, wait_seconds=0.1):
            super().__init__(path, wait_seconds)
    fb.FileBaton = c.FileBaton = FileBaton
from spotfill.testing.tiny_step import init_single_process, save_and_reload, take_step, tiny_engine
init_single_process(int(sys.argv[1]))
engine = tiny_engine()
moved = take_step(engine)[1]
muon = sys.modules["deepspeed.runtime.zero.muon.original_muon"]
try:
    muon.MuonWithAuxAdam([])
    refused = False
except RuntimeError as exc:
    refused = "AdamW" in str(exc)
fused = engine.optimizer.optimizer.defaults.get("fused")    # torch's fused AdamW under ZeRO-2's wrapper
import torch.utils.cpp_extension as c
print("RESULT", moved, "torch._inductor.compile_fx" in sys.modules, refused, fused,
      getattr(c.load, "_spotfill_guarded", False))
# the ZeRO elastic load (a required hook) works, and without a DeepSpeed internal it is refused in one line
print("LOADED", save_and_reload(engine, sys.argv[3]))
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
del DeepSpeedZeroOptimizer._link_all_hp_params
from spotfill.ray_compat import RayCompatError
from spotfill.train.engine import load_checkpoint
try:
    load_checkpoint(engine, sys.argv[3], "s1", elastic=True)
except RayCompatError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.parametrize("torch_lock", ["stock", "moved-baton"])
def test_engine_builds_and_steps_without_torch_inductor_and_with_or_without_the_lock_guard(tmp_path, torch_lock):
    """DeepSpeed's Muon modules (torch.compile at import: torch._inductor) stay out of a spotfill worker:
    a ZeRO-2 engine builds and takes a real step (its parameters move) without them, with torch's fused
    AdamW as its optimizer (train.engine.client_optimizer), and a Muon optimizer built anyway is refused
    with a clear message. Building the engine loads DeepSpeed's CPU comm op through torch's JIT loader:
    with torch's FileBaton as checked, behind spotfill's lock guard; with one whose constructor changed,
    unguarded after one warning -- the engine steps either way. The ZeRO elastic load works, and a
    DeepSpeed without one of its internals is refused with one line. Run in a fresh interpreter."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "step.py"
    script.write_text(_ENGINE_STEP)
    proc = subprocess.run([sys.executable, str(script), str(port), torch_lock, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{PLATFORM}:{REPO}"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    guarded = torch_lock == "stock"
    assert line == f"RESULT True False True True {guarded}", (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "LOADED True" in proc.stdout, proc.stdout[-2000:]
    refused = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED"))
    assert refused.startswith("REFUSED resuming a ZeRO-1/2 run (training.zero_stage 1 or 2) from its checkpoint "
                              "needs deepspeed's deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer."
                              "_link_all_hp_params (missing), which deepspeed 0.19 has"), refused
    warnings = _spotfill_lines(proc.stderr)
    if guarded:
        assert warnings == [], warnings
    else:
        (warning,) = warnings
        assert "jit_build_lock_guard is off" in warning and "FileBaton.__init__(lock_file_path, wait_seconds) " \
            "(it takes (path, wait_seconds))" in warning, warning


# -- Ray Serve: the replica watch, pushed or (fallback) polled -------------------------------------------
def test_the_replica_watch_reads_the_running_replicas_from_serves_push():
    """The Ingress's replica watch (serving/app.py): Serve's long poll of DEPLOYMENT_TARGETS, whose update
    is a DeploymentTargetInfo; the watch reports how many replicas it lists and their ids."""
    from ray.serve._private.common import DeploymentID, DeploymentTargetInfo, ReplicaID, RunningReplicaInfo
    from ray.serve._private.long_poll import LongPollNamespace

    assert ray_compat.check_serve_hooks() is True
    seen, made = [], {}

    class FakeClient:
        def __init__(self, host_actor, key_listeners, call_in_event_loop, client_id):
            made.update(host=host_actor, listeners=key_listeners, loop=call_in_event_loop)

    loop = asyncio.new_event_loop()
    try:
        with pytest.MonkeyPatch.context() as mp:
            import ray
            import ray.serve._private.long_poll as long_poll
            mp.setattr(long_poll, "LongPollClient", FakeClient)
            mp.setattr(ray, "get_actor", lambda name, namespace: (name, namespace))
            ray_compat.watch_running_replicas("app", "Generator", lambda n, ids: seen.append((n, ids)), loop)
    finally:
        loop.close()
    assert made["host"] == ("SERVE_CONTROLLER_ACTOR", "serve") and made["loop"] is loop
    ((key, listener),) = made["listeners"].items()
    assert key == (LongPollNamespace.DEPLOYMENT_TARGETS, DeploymentID(name="Generator", app_name="app"))
    dep = DeploymentID(name="Generator", app_name="app")
    running = [RunningReplicaInfo(replica_id=ReplicaID(unique_id=u, deployment_id=dep), node_id=None, node_ip=None,
                                  availability_zone=None, actor_name=f"replica-{u}", max_ongoing_requests=8)
               for u in ("r1", "r2")]
    listener(DeploymentTargetInfo(is_available=True, running_replicas=running))
    listener(DeploymentTargetInfo(is_available=True, running_replicas=[]))
    assert seen == [(2, ["r1", "r2"]), (0, [])]


def test_without_serves_push_the_replica_watch_polls_serve_status(monkeypatch):
    """serve_replica_watch off (Serve's long poll moved): the watch still reports each change of the running
    count, from the public serve.status() (naming no replica: ids None), and ends (is_running False) when serve.status() fails."""
    from types import SimpleNamespace

    from ray import serve
    from spotfill.ray_compat import ray_serve

    monkeypatch.setitem(hooks._problems, "serve_replica_watch", "ray.serve._private.long_poll (missing)")
    monkeypatch.setattr(hooks, "_announced", set(hooks._announced) | {"serve_replica_watch"})
    counts = iter([None, 0, 2, 2, 1, 0])          # None: the app is not deployed yet

    def status():
        n = next(counts, "gone")
        if n == "gone":
            raise ConnectionError("controller gone")
        deps = {} if n is None else {"Generator": SimpleNamespace(replica_states={"RUNNING": n, "STARTING": 1})}
        return SimpleNamespace(applications={"app": SimpleNamespace(deployments=deps)})

    monkeypatch.setattr(serve, "status", status)

    def no_controller(*args, **kwargs):
        raise AssertionError("the watch asked for Serve's controller: it did not fall back to serve.status()")

    import ray
    monkeypatch.setattr(ray, "get_actor", no_controller)
    seen = []
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        watch = ray_serve.watch_running_replicas("app", "Generator", lambda n, ids: seen.append((n, ids)), loop)
        assert isinstance(watch, ray_serve.StatusPoller)
        watch.poll_s = 0.01
        deadline = time.time() + 10
        while watch.is_running and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert not watch.is_running and seen == [(2, None), (1, None), (0, None)]


# -- Ray Train -------------------------------------------------------------------------------------------
def test_scaling_policy_swap_keeps_the_trainer_a_trainer():
    from ray.train.torch import TorchTrainer

    from spotfill.train.elastic import SpotfillTorchTrainer
    assert issubclass(SpotfillTorchTrainer, TorchTrainer)
    assert SpotfillTorchTrainer.__name__ == "SpotfillTorchTrainer"


def test_the_gcs_checked_cleaner_pickles_by_reference():
    import pickle

    cls = ray_compat.GcsCheckedPlacementGroupCleanerCallback
    assert cls is ray_compat.GcsCheckedPlacementGroupCleanerCallback
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_callbacks_marked_first_run_ahead_of_rays_own_order_kept():
    class Mark:
        spotfill_runs_first = True

    ray_backend, ray_pg, ours_restart, reaper = object(), object(), object(), Mark()
    assert ray_compat.callbacks_first([ray_backend, ray_pg, ours_restart, reaper]) == \
        [reaper, ray_backend, ray_pg, ours_restart]

"""The story without the simulator: only the commands a user runs, against a head this module starts with
`ray start --head --num-gpus 3` (Ray's own GPU resource on this CPU machine: Ray assigns GPUs, the code
follows Ray's assignment and computes on the CPU). `serve deploy serving/config.yaml` (the shipped file, its
checkpoint pointed at the run) registers the generation app with the fill-in arbiter, which lends it the idle
GPUs; `ray job submit -- python jobs/prepare_data.py`, then `jobs/pretrain.py` (workers [1, 2] on `GPU`):
training's start claims its GPUs back from Serve (a hand-back), Serve answers real completions from the run's
checkpoints on the GPU training does not use while training runs, and report.json lists the leases and the
hand-back. Then batch_infer.py (every parquet row exactly once) and sweep.py (every trial completed) on GPUs
the arbiter lends them. No `spotfill demo` code on this path.

The head runs with its own --temp-dir, ports and auth token (RAY_AUTH_MODE=token, as Ray 2.60 turns on
for local clusters when ~/.ray/auth_token exists), so it never touches other Ray clusters on the machine.
Its processes inherit a marker environment variable; teardown ends only the processes that carry it or
name the temp dir (`ray stop` would end every Ray process of the user; agents rename themselves, so the
command line alone misses some). The jobs are submitted from a small staged copy of the repo
(platform/spotfill, jobs/, examples/, pyproject.toml) and every process of the head runs with a
sitecustomize that removes the editable install's `platform/` from sys.path: spotfill is "not installed",
so the driver must import the copy in its working dir and the Ray workers the one shipped as py_modules.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal

import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from spotfill.testing.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
PLATFORM = str(REPO / "platform")
RAY = str(Path(sys.executable).with_name("ray")) if Path(sys.executable).with_name("ray").exists() \
    else (shutil.which("ray") or "ray")
HIDE_INSTALL = """\
# test only: hide the editable spotfill install from every process of this Ray head
import os, sys
_hide = {p for p in os.environ.get("SPOTFILL_TEST_HIDE", "").split(os.pathsep) if p}
sys.path[:] = [p for p in sys.path if not (p and os.path.abspath(p) in _hide)]
"""


def _free_ports(n: int) -> list[int]:
    return free_ports(n, "127.0.0.1")


MARK = "SPOTFILL_TEST_RAY_HEAD"
GPUS = 3                  # the head's GPUs: training takes up to 2, Serve may hold 2 (max_replicas)


def _head_processes(temp_dir: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "environ", "status"]):
        try:
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if (p.info["environ"] or {}).get(MARK) == temp_dir or temp_dir in cmd \
                    or (p.info["cwd"] or "").startswith(temp_dir):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _stop_head(temp_dir: str) -> list[int]:
    """End this head's processes only (marker env var, cmdline or cwd under temp_dir): TERM, then KILL."""
    import psutil

    ended = []
    for _ in range(3):              # a second pass catches what was spawned while the first one ran
        procs = _head_processes(temp_dir)
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=4)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        ended += [p.pid for p in procs]
    return ended


def _installed_platforms() -> list[str]:
    """This checkout's platform/ and the one the editable install points at (another checkout's, when
    these tests run from a git worktree): both are hidden from the head."""
    found = subprocess.run([sys.executable, "-c", "import os, spotfill; "
                            "print(os.path.dirname(os.path.dirname(os.path.abspath(spotfill.__file__))))"],
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd=tempfile.gettempdir(),
                           capture_output=True, text=True).stdout.strip()
    return sorted({PLATFORM, *([os.path.abspath(found)] if found else [])})


@pytest.fixture(scope="module")
def head():
    """A real Ray head: 2 CPUs, 3 GPUs (Ray's resource), dashboard on 127.0.0.1; yields (job API address, env)."""
    temp_dir = tempfile.mkdtemp(prefix="sfray-", dir="/tmp")   # short: unix socket paths have a limit
    hook = os.path.join(temp_dir, "hook")
    os.makedirs(hook)
    Path(hook, "sitecustomize.py").write_text(HIDE_INSTALL)
    token = uuid.uuid4().hex + uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")])),
               SPOTFILL_TEST_HIDE=os.pathsep.join(_installed_platforms()), RAY_USAGE_STATS_ENABLED="0", PYTHONNOUSERSITE="1",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, **{MARK: temp_dir})
    hidden = subprocess.run([sys.executable, "-c", "import spotfill"], env=env, cwd=temp_dir,
                            capture_output=True).returncode != 0
    gcs, dash, client, nm, om, agent, agent_grpc, renv, metrics = _free_ports(9)
    cmd = [RAY, "start", "--head", f"--port={gcs}", "--num-cpus=2", f"--num-gpus={GPUS}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={renv}", f"--metrics-export-port={metrics}",
           "--object-store-memory=200000000", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        out = subprocess.run(cmd, env=env, cwd=temp_dir, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        address = f"http://127.0.0.1:{dash}"
        _wait_jobs_api(address, env)
        yield {"address": address, "env": env, "hidden": hidden, "temp_dir": temp_dir,
               "headers": {"Authorization": f"Bearer {token}"}}
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_jobs_api(address: str, env: dict, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while True:
        r = subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True, text=True)
        if r.returncode == 0:
            return
        assert time.time() < deadline, f"jobs API at {address} not up: {r.stderr[-500:]}"
        time.sleep(1)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The files a user's `--working-dir .` needs, without tests/, .git, runs/ or caches."""
    root = tmp_path_factory.mktemp("repo")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "platform" / "spotfill", root / "platform" / "spotfill", ignore=skip)
    shutil.copytree(REPO / "jobs", root / "jobs", ignore=skip)
    shutil.copytree(REPO / "serving", root / "serving", ignore=skip)
    shutil.copytree(REPO / "examples", root / "examples", ignore=skip)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    bad = (root / "examples" / "tiny-cpu.yaml").read_text().replace("workers: [1, 2]", "workers: [3, 1]")
    assert "workers: [3, 1]" in bad
    (root / "examples" / "bad-workers.yaml").write_text(bad)
    return root


def submit(head, staged, *entrypoint: str, wait: bool = True, timeout: float = 300):
    job_id = f"sf-{uuid.uuid4().hex[:8]}"
    cmd = [RAY, "job", "submit", "--address", head["address"], "--submission-id", job_id,
           "--working-dir", str(staged), *([] if wait else ["--no-wait"]), "--", "python", *entrypoint]
    r = subprocess.run(cmd, env=head["env"], cwd=str(staged), capture_output=True, text=True, timeout=timeout)
    return job_id, r


def summary_line(output: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith('{"ok"')]
    assert lines, f"no JSON summary line in:\n{output[-3000:]}"
    return json.loads(lines[-1])


def job_info(head, job_id: str, wait_s: float = 120) -> tuple[str, str]:
    """(status, message) once the job is terminal."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head["address"], headers=head["headers"])
    deadline = time.time() + wait_s
    while True:
        info = client.get_job_info(job_id)
        if info.status.is_terminal() or time.time() > deadline:
            return str(info.status), info.message or ""
        time.sleep(1)


def serve_cli(head, *args: str, timeout: float = 120):
    serve = str(Path(RAY).with_name("serve")) if Path(RAY).with_name("serve").exists() else "serve"
    return subprocess.run([serve, *args], env=head["env"], capture_output=True, text=True, timeout=timeout)


def serve_config(staged: Path, checkpoint: str, port: int, out: Path) -> Path:
    """serving/config.yaml as shipped, with what a user changes: the run's checkpoint URI, the port, the
    checkout's location and at most 2 replicas. cluster.yaml installs spotfill on every node and points the
    app's working_dir at the checkout; the head here hides the installed spotfill, so the working_dir holds
    serving/ and the staged spotfill package side by side (links into the staged copy)."""
    import yaml

    cfg = yaml.safe_load((REPO / "serving" / "config.yaml").read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = cfg["applications"]
    assert app["runtime_env"]["working_dir"].startswith("local://"), app["runtime_env"]
    wd = staged / "serve-wd"
    wd.mkdir(exist_ok=True)
    for name, target in (("serving", staged / "serving"), ("spotfill", staged / "platform" / "spotfill")):
        if not (wd / name).exists():
            (wd / name).symlink_to(target)
    app["runtime_env"] = {"working_dir": f"local://{wd}"}
    app["args"].update(checkpoint=checkpoint, max_replicas=2, reload_s=1)
    assert app["external_scaler_enabled"] is True and app["args"]["replicas"] == 0 and app["args"]["gpu_resource"] == "GPU"
    out.write_text(yaml.safe_dump(cfg))
    return out


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:           # the proxy's own answers (no app on the route yet) are plain text
            return e.code, {}
    except (urllib.error.URLError, OSError, ValueError) as exc:    # no HTTP answer: code 0, and why
        return 0, {"client_error": repr(exc)}


def job_logs(head, job_id: str) -> str:
    return subprocess.run([RAY, "job", "logs", "--address", head["address"], job_id], env=head["env"],
                          capture_output=True, text=True).stdout


TRAIN_STEPS = 60


@pytest.fixture(scope="module")
def trained(head, staged, tmp_path_factory):
    """prepare_data.py; `serve deploy` of the generation app over the run's checkpoints (the arbiter lends it
    the idle GPUs); then pretrain.py submitted while completions are asked for every 0.5 s. A bad config is
    submitted alongside, not waited for."""
    from spotfill.fillin.load import CLIENT_TIMEOUT_S
    root = tmp_path_factory.mktemp("trained")
    data, ckpt, run_dir = root / "data", root / "ckpt", root / "run"
    t0 = time.time()
    bad_id, bad = submit(head, staged, "jobs/pretrain.py", "--config", "examples/bad-workers.yaml",
                         "--storage", str(ckpt), "--run-dir", str(root / "bad"), wait=False)
    _, prep = submit(head, staged, "jobs/prepare_data.py", "--config", "examples/prepare-stdlib.yaml",
                     "--output", str(data))
    t_prep = time.time() - t0
    out = {"data": data, "ckpt": ckpt, "run_dir": run_dir, "bad_id": bad_id, "bad": bad, "prep": prep,
           "train_id": None, "train": None, "t_prep": t_prep, "completions": [], "replicas_before": []}
    if prep.returncode != 0:
        return out
    (port,) = _free_ports(1)
    url = f"http://127.0.0.1:{port}"
    out["serve"] = serve_cli(head, "deploy", str(serve_config(staged, f"file://{ckpt / 'tiny-cpu'}", port,
                                                              root / "serve.yaml")), "--address", head["address"])
    deadline = time.time() + 150
    while time.time() < deadline:          # the app registered itself; the arbiter lent it 2 idle GPUs
        code, body = http_json("GET", url + "/healthz", timeout=5)
        out["replicas_before"].append(body.get("replicas") if code == 200 else None)
        if code == 200 and body.get("replicas") == 2:
            break
        time.sleep(1)
    out["serve_status"] = serve_cli(head, "status", "--address", head["address"]).stdout
    # 60 steps: Serve must load one of the run's checkpoints (held against retention, keep_last 2) while it
    # trains; with 30 (4.5 s of steps here) a CI run ended before the idle-priority replica had loaded one
    out["train_id"], _ = submit(head, staged, "jobs/pretrain.py", "--config", "examples/tiny-cpu.yaml", "--steps",
                                str(TRAIN_STEPS), "--storage", str(ckpt), "--run-dir", str(run_dir),
                                "--data", str(data), wait=False)
    from ray.job_submission import JobSubmissionClient
    client = JobSubmissionClient(head["address"], headers=head["headers"])
    while True:
        status = client.get_job_info(out["train_id"]).status
        if status.is_terminal() or time.time() - t0 > 600:
            break
        # the client waits longer than the app may hold a request for a starting replica (max_queue_wait_s,
        # 15 s in serving/config.yaml) plus its generation: the load generator's timeout, for the same reason
        t_req = time.time()
        code, body = http_json("POST", url + "/v1/completions", {"prompt": "def ", "max_tokens": 8},
                               timeout=CLIENT_TIMEOUT_S)
        t_answer = time.time()
        out["completions"].append({"t": t_answer, "took_s": round(t_answer - t_req, 2), "code": code,
                                   "job": str(status), "checkpoint": (body.get("checkpoint") or {}).get("tag"),
                                   "text": (body.get("choices") or [{}])[0].get("text"),
                                   "error": body.get("error") or body.get("client_error") if code != 200 else None})
        time.sleep(0.5)
    out["train_status"], out["train_logs"] = str(client.get_job_info(out["train_id"]).status), \
        job_logs(head, out["train_id"])
    out["serve_url"], out["t_total"] = url, time.time() - t0
    return out


def test_prepare_then_pretrain_through_ray_job_submit(head, trained):
    data, run_dir, bad, prep = (trained[k] for k in ("data", "run_dir", "bad", "prep"))
    assert bad.returncode == 0, bad.stdout + bad.stderr
    assert prep.returncode == 0, prep.stdout[-4000:] + prep.stderr[-2000:]
    p = summary_line(prep.stdout)
    assert p["samples"] >= 160 and (data / "manifest.json").is_file()
    assert p["shipped"] and p["spotfill"].startswith(head["temp_dir"]), p   # the working-dir copy

    assert trained["train_status"] == "SUCCEEDED", trained["train_logs"][-6000:]
    s = summary_line(trained["train_logs"])
    assert s["ok"] and s["steps_completed"] == TRAIN_STEPS and s["checkpoints"] >= 2, s
    assert s["spotfill"].startswith(head["temp_dir"]) and "working_dir" in s["spotfill"], s
    report = json.loads((run_dir / "report.json").read_text())
    assert report["ok"] is True and report["training"]["steps_completed"] == TRAIN_STEPS
    assert (run_dir / "events.jsonl").is_file()
    if not head["hidden"]:
        pytest.fail("could not hide the installed spotfill from the head; the job may have used it")

    status, message = job_info(head, trained["bad_id"])
    assert status == "FAILED" and "exit code 2" in message, (status, message)
    logs = job_logs(head, trained["bad_id"])
    errors = [ln for ln in logs.splitlines() if "error:" in ln]
    assert errors == ["pretrain.py: error: training.workers: min > max (got [3, 1]); "
                      "accepted: [min, max] with min <= max"], logs
    assert "Traceback" not in logs
    print(f"\nprepare job {trained['t_prep']:.1f}s, prepare+serve+pretrain {trained['t_total']:.1f}s")


def test_serve_deploy_registers_with_the_arbiter_and_gets_the_idle_gpus(trained):
    """`serve deploy serving/config.yaml` alone (0 replicas, external scaler): the app registered itself and
    the arbiter lent it GPUs -- before, nothing registered it and every request got 503."""
    assert trained["serve"].returncode == 0, trained["serve"].stdout + trained["serve"].stderr
    assert trained["replicas_before"] and trained["replicas_before"][-1] == 2, \
        (trained["replicas_before"], trained["serve_status"])


def test_serve_answers_from_the_run_while_it_trains_on_the_gpu_training_leaves(trained):
    answered = [c for c in trained["completions"] if c["code"] == 200 and c["job"] == "RUNNING"]
    codes = [c["code"] for c in trained["completions"]]
    print(f"completions while training ran: {len(codes)}, {codes.count(200)} x 200, {codes.count(503)} x 503, "
          f"longest {max((c['took_s'] for c in trained['completions']), default=None)} s; answered from "
          f"{sorted({c['checkpoint'] for c in answered})}")
    assert answered, trained["completions"][-20:]
    assert all(c["checkpoint"].startswith("step-") for c in answered) and any(c["text"] for c in answered), answered
    # after the hand-back one replica stays: the GPU beyond training's max of 2 on this 3-GPU head
    assert not [c for c in trained["completions"] if c["code"] not in (200, 503)], \
        [c for c in trained["completions"] if c["code"] != 200]


def test_training_took_its_gpus_back_and_the_report_lists_lease_and_hand_back(trained):
    report = json.loads((trained["run_dir"] / "report.json").read_text())
    fillin = report.get("fillin") or {}
    serve_leases = [le for le in fillin.get("leases", []) if le["workload"] == "serve"]
    assert serve_leases, fillin
    reclaimed = [le for le in serve_leases if le["ended_by"] == "reclaim" and le.get("cause") == "training_claim"]
    assert reclaimed and fillin["handback_seconds"], fillin
    assert all(0 <= h <= 5 for h in fillin["handback_seconds"]), fillin["handback_seconds"]
    assert report["training"]["world_size_timeline"][0][1] == 2, report["training"]["world_size_timeline"]


def last_json_line(output: str) -> dict:
    """The job's summary: the last output line that is a JSON object (`ray job submit` prints its own too)."""
    for line in reversed(output.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise AssertionError(f"no JSON summary line in:\n{output[-3000:]}")


def parquet_ids(folder: Path) -> list[str]:
    """Every id a reader of the job's parquet output sees (read here, not by the job)."""
    import pyarrow.parquet as pq
    return [i for f in sorted(folder.rglob("*.parquet")) if not any(p.startswith("_") for p in f.parts)
            for i in pq.read_table(f).column("id").to_pylist()]


def test_batch_infer_through_ray_job_submit(head, staged, trained, tmp_path):
    import yaml

    assert trained["train_status"] == "SUCCEEDED", "pretrain did not run"
    t0 = time.time()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}("}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    cfg = tmp_path / "batch.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "batch-submit", "checkpoint": str(trained["ckpt"] / "tiny-cpu"), "output": str(out),
        "eval": {"data": str(trained["data"]), "rows": 32, "rows_per_unit": 16, "batch_size": 8},
        "generate": {"prompts": str(prompts), "max_tokens": 8, "rows_per_unit": 2},
        "cluster": {"gpu_resource": "GPU", "max_units": 2, "grace_s": 5.0},
        "grant": {"units": 0}}))            # only GPUs the arbiter (started by the Serve app) lends
    job_id, r = submit(head, staged, "jobs/batch_infer.py", "--config", str(cfg))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    s = last_json_line(r.stdout)
    assert (s["rows_target"], s["rows_written"], s["duplicates"], s["missing"]) == (36, 36, 0, 0), s
    ids = parquet_ids(out)
    assert sorted(ids) == sorted([f"eval/{i}" for i in range(32)] + [f"generate/p{i}" for i in range(4)]), ids
    assert s["eval"]["loss"] > 0 and job_info(head, job_id)[0] == "SUCCEEDED"
    print(f"\nbatch job {time.time() - t0:.1f}s")


def test_sweep_through_ray_job_submit(head, staged, trained, tmp_path):
    import yaml

    t0 = time.time()
    run_dir = tmp_path / "run"
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "sweep-submit", "run_dir": str(run_dir), "storage": str(tmp_path / "tune"),
        "data": {"path": str(trained["data"])},
        "sweep": {"model": "tiny", "steps": 8, "batch": 4, "steps_per_report": 4, "checkpoint_every": 4,
                  "eval_rows": 32, "trials": 2, "search": {"lr": [0.001, 0.003], "warmup_steps": [0]}},
        "fillin": {"grant": "arbiter", "max_units": 2, "grace_s": 5.0},   # only GPUs the arbiter lends
        "cluster": {"gpu_resource": "GPU", "cpus_per_trial": 0}}))
    job_id, r = submit(head, staged, "jobs/sweep.py", "--config", str(cfg))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    s = last_json_line(r.stdout)
    assert s["ok"] and s["trials"] == 2 and s["completed"] == 2, s
    assert s["shipped"] and s["spotfill"].startswith(head["temp_dir"]), s
    report = json.loads((run_dir / "report.json").read_text())["fillin"]["sweep"]
    assert report["restored"] is False and report["failed"] == 0, report
    assert [(x["step"], x["history_ok"]) for x in report["results"]] == [(8, True), (8, True)], report["results"]
    assert job_info(head, job_id)[0] == "SUCCEEDED"
    print(f"\nsweep job {time.time() - t0:.1f}s")


@pytest.mark.parametrize("content, field", [
    (None, "--config: no such file"),
    ("name: x\nstorage: /tmp/x\nbogus: 1\n", "bogus: unknown key"),
    ("training: {workers: [3, 1]}\nstorage: /tmp/x\ndata: {path: /tmp/x}\n", "training.workers: min > max"),
])
def test_pretrain_config_errors_exit_2_one_line(tmp_path, content, field):
    cfg = tmp_path / "job.yaml"
    if content is not None:
        cfg.write_text(content)
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), "--config", str(cfg)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"pretrain.py: error: {field}"), r.stderr


@pytest.mark.parametrize("args, field", [
    (["--config", "missing.yaml"], "--config: no such file"),
    ([], "--config: required"),
    (["--config", "x.yaml", "--seq-len", "many"], "--seq-len: invalid int value: 'many'"),
    (["--config", "job.yaml"], "training: unknown key"),
])
def test_prepare_usage_errors_exit_2_one_line(tmp_path, args, field):
    (tmp_path / "job.yaml").write_text("training: {steps: 3}\n")
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "prepare_data.py"), *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"prepare_data.py: error: {field}"), r.stderr

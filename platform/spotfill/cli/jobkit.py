"""What every `ray job submit -- python jobs/<x>.py` entrypoint shares: find and ship the library, start
Ray with a runtime_env that merges with the job's, and run `main` under the CLI's exit-code contract.

How spotfill travels with a job
    `ray job submit --working-dir . -- python jobs/pretrain.py --config FILE` uploads the checkout and runs
    the entrypoint inside that copy. Each script first puts `<repo>/platform` (repo = the parent of jobs/)
    at the front of sys.path, so the driver imports the spotfill that was submitted; where the script sits
    outside a checkout, the installed spotfill is used. `runtime_env()` then lists the imported package
    folder in `py_modules` whenever it does not come from site-packages: Ray uploads it once and puts it
    ahead of site-packages on every worker's PYTHONPATH (tasks, actors, Ray Train workers). Driver and
    workers thus run the same spotfill whether or not the cluster has it installed.

Environment
    Every numeric SPOTFILL_* variable is validated before the job's `main` runs (a bad value is one line
    on stderr, exit 2), so `spotfill.config.constants` is imported only inside `run_main`. The S3 endpoint
    and region variables set on the driver (never credentials) go into the runtime_env's env_vars: the
    Ray workers on other nodes do not inherit the driver's environment.

Runtime-env merging
    Inside a Ray job, ray.init() merges the job's runtime_env (`--runtime-env-json`, `--working-dir`) with
    the driver's and fails on a field or environment variable set by both. `runtime_env()` leaves out what
    the job already sets, so the submitter's settings win and nothing conflicts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
from typing import Callable, Sequence

import spotfill
from spotfill.config.errors import ConfigError, SpotfillError

# Ray Jobs hands the job-level runtime_env to the entrypoint in this variable (ray.init merges it).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
log = logging.getLogger("spotfill.jobs")


def library_dir() -> str:
    """The folder of the spotfill package this process imported."""
    return os.path.dirname(os.path.abspath(spotfill.__file__))


def shipped() -> bool:
    """True when spotfill comes from a source tree (checkout, working dir), not an installed copy."""
    installed = {os.path.abspath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    return os.path.dirname(library_dir()) not in installed


def job_runtime_env() -> dict:
    """The runtime_env of the Ray job this process is the entrypoint of ({} outside a Ray job)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    try:
        return json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return {}


def in_ray_job() -> bool:
    return JOB_CONFIG_ENV in os.environ


def runtime_env(env_vars: dict[str, str] | None = None) -> dict:
    """Driver runtime_env: ship the library (py_modules) and set `env_vars` plus the driver's S3 endpoint
    settings (constants.storage_endpoint_env), minus what the job sets."""
    from spotfill.config import constants

    env_vars = {**constants.storage_endpoint_env(), **(env_vars or {})}
    job = job_runtime_env()
    env: dict = {}
    if shipped():
        if "py_modules" in job:
            log.warning("the job sets py_modules; spotfill from %s is not added to it", library_dir())
        else:
            env["py_modules"] = [library_dir()]
    taken = job.get("env_vars") or {}
    own = {k: v for k, v in (env_vars or {}).items() if k not in taken}
    if own:
        env["env_vars"] = own
    return env


def init_ray(env: dict) -> None:
    """Connect to the job's cluster (RAY_ADDRESS inside a Ray job) or start a local one."""
    from spotfill.fillin.wiring import connect_ray
    connect_ray(env)


def absolute(name: str, value: str) -> str:
    """`value` with a relative local path made absolute against the driver's cwd, so that the driver and
    the Ray workers (whose cwd may differ) mean the same place. Inside a Ray job that cwd is a temporary
    copy of the working dir, so a warning says where the path went."""
    if not value or "://" in value:
        return value
    if os.path.isabs(os.path.expanduser(value)):
        return os.path.expanduser(value)
    resolved = os.path.abspath(value)
    if in_ray_job():
        log.warning("%s %r is relative: inside a Ray job it resolves to %s, in the job's temporary working "
                    "dir; give an absolute path or s3:// URI to keep it", name, value, resolved)
    return resolved


def setup_logging() -> None:
    from spotfill.config import constants

    logging.basicConfig(level=getattr(logging, constants.LOG_LEVEL.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """argparse that reports usage errors as one line and exit code 2 (ConfigError)."""
    from spotfill.cli.main import OneLineParser

    return OneLineParser(prog=prog, description=description)


def second_on_cpu() -> dict:
    """A fill-in driver (batch, sweep) runs second to training on its node's CPU, as its workers do: nice
    `fillin.cpu_nice` (SPOTFILL_FILLIN_CPU_NICE, default 19) -- a Ray Data executor waiting for a GPU spins
    a core -- but not SCHED_IDLE: the driver must see a reclaim and yield within its grace."""
    from spotfill.fillin.cpu_priority import lower_cpu_priority
    return lower_cpu_priority(idle=False)


def run_main(main: Callable[[argparse.Namespace], dict], ap: argparse.ArgumentParser,
             argv: Sequence[str] | None = None) -> int:
    """Parse, run `main`, print its summary dict as one JSON line on stdout. Exit codes per CONTRACTS:
    0 success, 1 the job ran and failed (JobFailed), 2 bad usage/config/input (one line, no traceback)."""
    try:
        args = ap.parse_args(argv)
        from spotfill.config import constants

        constants.check_env()           # importing it already validates; check_env reads the variables now
        setup_logging()
        summary = main(args)
    except ConfigError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except SpotfillError as exc:
        print(f"{ap.prog}: failed: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{ap.prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    print(json.dumps(summary, default=str), flush=True)
    return 0

"""Helpers the benchmark modules share: paths, env scoping, an out-of-process S3 endpoint, gloo init."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform as _stdlib_platform  # noqa: F401 - the stdlib one: platform/ has no __init__.py
import statistics
import subprocess
import sys
import time
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORM = os.path.join(REPO, "platform")
for _p in (PLATFORM, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from spotfill.config.constants import scoped_env  # noqa: E402,F401 - re-exported for the benchmark modules
from spotfill.testing.ports import free_port  # noqa: E402,F401  (re-exported to the benchmarks)

log = logging.getLogger("spotfill.bench")


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


def rnd(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repo's `platform/` and root first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PLATFORM, REPO] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env.update(extra)
    return env


class S3Process:
    """`python -m spotfill.testing.s3local` in a child process: a loopback S3 endpoint that, like a real one, does
    not share the trainer's interpreter (an in-process moto server would compete for its GIL)."""

    def __init__(self, bucket: str = "spotfill-bench", start_timeout_s: float = 60.0):
        self.bucket = bucket
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "spotfill.testing.s3local", "--bucket", bucket], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=subprocess_env())
        deadline = time.monotonic() + start_timeout_s
        line = ""
        while not line and time.monotonic() < deadline and self._proc.poll() is None:
            line = self._proc.stdout.readline().strip()
        if not line:
            self.close()
            raise RuntimeError("local S3 endpoint did not start")
        info = json.loads(line)
        self.endpoint_url, self._env = info["endpoint_url"], info["env"]

    def uri(self, prefix: str = "") -> str:
        path = f"{self.bucket}/{prefix.strip('/')}" if prefix.strip("/") else self.bucket
        return f"s3://{path}?endpoint_override={self.endpoint_url}"

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "S3Process":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def s3_endpoint(target=None) -> Iterator[tuple[object, dict[str, str]]]:
    """(server-or-URI, AWS env to apply). `target`: None (start an S3Process), an object with .uri()
    (e.g. a LocalS3 or S3Process), or an s3:// URI string."""
    if target is None:
        with S3Process() as server:
            yield server, {k: v for k, v in server.env().items() if not k.startswith("AWS_ENDPOINT_URL")}
        return
    env = {k: v for k, v in target.env().items() if not k.startswith("AWS_ENDPOINT_URL")} \
        if hasattr(target, "env") else {}
    yield target, env


@contextlib.contextmanager
def single_rank_dist() -> Iterator[None]:
    """torch.distributed with gloo, world size 1, in this process (reused if already initialised)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with scoped_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                    LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"):
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                destroy_dist()


def destroy_dist() -> None:
    """Tear down this process's torch.distributed world, through DeepSpeed's comm where an engine used it:
    deepspeed.comm.destroy_process_group also drops the groups DeepSpeed cached (its data-parallel group). Torch's
    alone leaves them, and the next engine in the same process fails with 'Group ... is not registered'."""
    import sys

    import torch.distributed as dist
    ds_comm = sys.modules.get("deepspeed.comm.comm")        # the module whose global `cdb` is the live backend
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()


def log_tail(log, chars: int = 1500) -> str:
    """The last `chars` characters a child process wrote to `log` (an open file), flushed first."""
    log.flush()
    with open(log.name, errors="replace") as f:
        return f.read()[-chars:]


def quiet_deepspeed() -> None:
    """DeepSpeed logs every initialize/save at INFO on stdout; the benchmarks print their own summary."""
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.suppress(Exception):
        from deepspeed.utils import logger
        logger.setLevel(logging.WARNING)


def machine() -> str:
    """One line: host, OS, CPU model and count, memory."""
    cpu = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    mem = ""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
            mem = f", {kb / 1e6:.0f} GB RAM"
    u = _stdlib_platform.uname()
    return f"{u.node}: {u.system} {u.release} {u.machine}, {cpu or 'cpu'} x{os.cpu_count()}{mem}"


def emit(result, json_path: str | None) -> int:
    """Print a benchmark result as JSON and also write it to `json_path` when given; exit code 0."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    return 0

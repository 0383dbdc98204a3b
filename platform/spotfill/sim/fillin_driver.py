"""A fill-in job in a scenario, run as its own Ray job: a subprocess driver (as `ray job submit` would run
it) started at training's first step, so the arbiter sees what it holds as one tenant and can stop that
driver, never the runner. Batch (sim/fillin_batch.py) and sweep (sim/fillin_sweep.py) fill-in build on it:
they write the job's config and read its result; this module starts, waits for and stops the driver.
"""
from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)
FINISH_S = 180.0          # after training: how long the runner waits for the job to finish
# after training on an autoscaled cluster: fill-in lends only on nodes training uses, and those go idle and
# away once training ends -- the job finishes the units it is running within this, then is stopped; what it
# leaves is the next run's (a rerun resumes it), and its pending GPU request never keeps a node alive
AUTOSCALED_FINISH_S = 20.0
MAX_RERUNS = 2            # a driver stopped by force while training runs is started again at most this often
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def last_json(text: str) -> dict:
    """The driver's summary: the last stdout line that is a JSON object (Ray may print lines of its own)."""
    for line in reversed((text or "").strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return {}


class DriverFillin(ABC):
    """Subclasses set `kind` ("batch", "sweep") and `script` (under jobs/), and write `_config()`."""

    kind = ""
    script = ""

    def __init__(self, cluster, scenario, name: str, out_dir: str, env: dict, say):
        self.cluster, self.scenario, self.name = cluster, scenario, f"{name}-{self.kind}"
        self.out_dir, self.env, self.say = out_dir, dict(env), say
        self.dir = os.path.join(out_dir, self.kind)
        self.log_path = os.path.join(self.dir, "driver.log")
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None
        self.arbiter = None                 # the capacity arbiter's handle (set by the subclass's start())
        self.reruns = 0                     # times the driver was started again after a forced stop
        self._finishing = threading.Event()
        self._cmd: list[str] = []
        self._env: dict = {}
        self._thread: threading.Thread | None = None
        self._held = False
        self._asked = 0.0
        self.left: str | None = None        # why the job stopped unfinished, its rest left for its rerun

    @abstractmethod
    def _config(self) -> str:
        """Write the job's YAML config; returns its path."""

    def _started(self) -> str:
        """The line the scenario prints when the driver started."""
        return f"{self.kind} fill-in started on lent GPUs"

    def start(self) -> None:
        """Training steps: start the driver (once, on a thread: the step loop does not wait for it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._start, name=f"{self.kind}-fillin", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        from spotfill.sim.cluster import LOOPBACK_CLIENT_ENV
        try:
            os.makedirs(self.dir, exist_ok=True)
            env = {**os.environ, **self.env, **LOOPBACK_CLIENT_ENV, "RAY_ADDRESS": self.cluster.address}
            self._cmd = [sys.executable, os.path.join(REPO, "jobs", self.script), "--config", self._config()]
            self._env = env
            self.proc = self._launch()
            self.say(self._started())
            threading.Thread(target=self._watch, name=f"{self.kind}-fillin-watch", daemon=True).start()
        except Exception as exc:  # noqa: BLE001 - reported in the job's report section, never breaks the run
            self.error = f"{self.kind} fill-in did not start: {type(exc).__name__}: {exc}"
            log.exception("%s fill-in did not start", self.kind)

    def _launch(self) -> subprocess.Popen:
        return subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=open(self.log_path, "a"), text=True,
                                env=self._env, cwd=REPO)

    def _watch(self) -> None:
        """While training runs: a driver the arbiter stopped by force (it held a reclaimed GPU past its
        grace: killed by a signal) is started again, up to MAX_RERUNS times -- the rerun resumes the job
        (batch: committed inputs are skipped; sweep: the experiment is restored) -- and the scenario says so."""
        while not self._finishing.wait(1.0):
            proc = self.proc
            code = proc.poll() if proc is not None else None
            if code is None or code >= 0:
                if code is not None:
                    return              # exited by itself: wait() reads its summary
                continue
            if self.reruns >= MAX_RERUNS or self._finishing.is_set():
                return
            self.reruns += 1
            self.say(f"{self.kind} fill-in driver stopped by signal {-code} (the arbiter stops a job that holds "
                     f"a reclaimed GPU past its grace): started again, it resumes ({self.reruns}/{MAX_RERUNS})")
            self.proc = self._launch()

    @property
    def tenant(self) -> str:
        """The driver's tenant name at the arbiter (its Ray job's GPU actors and placement groups)."""
        return f"{self.kind}:{self.name}"

    def holding(self) -> bool:
        """The scenario's timeline gate (wait_for_fillin): true once the job holds a lent GPU -- read from the
        arbiter's leases, which it rebuilds from what the job's actors and placement groups hold in Ray's
        state, not from what the driver says -- or once it cannot (it failed, or its driver exited)."""
        if self._held or self.error or (self.proc is not None and self.proc.poll() is not None):
            return True
        now = time.time()
        if self.arbiter is None or now - self._asked < 1.0:
            return False
        self._asked = now
        import ray
        try:
            leases = ray.get(self.arbiter.status.remote(0), timeout=10)["leases"]
        except Exception as exc:  # noqa: BLE001 - asked again a second later
            log.warning("%s fill-in: the arbiter's leases not read: %s", self.kind, exc)
            return False
        self._held = any(le.get("tenant") == self.tenant for le in leases)
        if self._held:
            self.say(f"{self.kind} fill-in holds lent GPUs")
        return self._held

    def wait(self, timeout_s: float = FINISH_S, after: str = "", left_ok: bool = False) -> dict:
        """After training: wait for the driver (bounded; stopped at the timeout) and return its summary. A
        driver stopped at the timeout is an error, or with `left_ok` a job left for its rerun (`self.left`)."""
        if self._thread is not None:
            self._thread.join(30)
        self._finishing.set()               # no rerun from here on: a driver stopped now stays stopped
        if self.proc is None:
            return {}
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
            if left_ok:
                self.left = f"not finished {timeout_s:.0f}s after training; stopped{after}"
                self.say(f"{self.kind} fill-in {self.left}")
            else:
                self.error = f"{self.kind} job not finished {timeout_s:.0f}s after training; stopped{after}"
            return {}
        with open(os.path.join(self.dir, "driver.out"), "w") as f:
            f.write(out or "")
        if self.proc.returncode != 0:
            self.error = f"{self.kind} driver exited {self.proc.returncode} (see {self.log_path})"
        return last_json(out)

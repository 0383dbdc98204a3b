"""Every environment variable spotfill reads, with its default, in one place."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator

# Where workers keep node-local snapshots and caches (checkpoint staging, data shards).
LOCAL_DIR = os.environ.get("SPOTFILL_LOCAL_DIR", "/tmp/spotfill")
# Where checkpoint snapshots are staged before their background upload: "auto" (tmpfs /dev/shm when it has
# room for two snapshots per local rank with margin, else under LOCAL_DIR), or a folder path.
SNAPSHOT_DIR = os.environ.get("SPOTFILL_SNAPSHOT_DIR", "auto")
# Logging level for spotfill's own loggers.
LOG_LEVEL = os.environ.get("SPOTFILL_LOG_LEVEL", "INFO")


class EnvNumber:
    """One numeric spotfill environment variable: its type and the lowest accepted value."""

    def __init__(self, name: str, kind: type, minimum: float = 0, strict: bool = False):
        self.name, self.kind, self.minimum, self.strict = name, kind, minimum, strict

    @property
    def accepted(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        return f"{what} {'>' if self.strict else '>='} {self.minimum:g}"

    def parse(self, raw: str):
        """The value of `raw`, or a ConfigError naming the variable, the value and what is accepted."""
        try:
            value = self.kind(raw.strip())
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < self.minimum \
                or (self.strict and value == self.minimum):
            from spotfill.config.errors import ConfigError
            raise ConfigError(self.name, raw, accepted=self.accepted)
        return value

    def read(self, default):
        """The value set in the environment now, `default` when unset or empty."""
        raw = os.environ.get(self.name, "")
        return self.parse(raw) if raw.strip() else default


# Every numeric SPOTFILL_* variable, registered where it is read: check_env() validates them all.
ENV_NUMBERS: dict[str, EnvNumber] = {}


def _env_number(name: str, default, kind, minimum: float, strict: bool):
    spec = ENV_NUMBERS[name] = EnvNumber(name, kind, minimum, strict)
    return spec.read(default)


def env_float(name: str, default: float, minimum: float = 0.0, strict: bool = False) -> float:
    """A number from the environment (>= minimum, or > minimum when strict); ConfigError when malformed."""
    return _env_number(name, default, float, minimum, strict)


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer from the environment (>= minimum); ConfigError when malformed."""
    return _env_number(name, default, int, minimum, False)


# Every SPOTFILL_* variable with a fixed set of values: name -> the values accepted.
ENV_CHOICES: dict[str, tuple[str, ...]] = {}


def env_choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    """One of `accepted` from the environment (`default` when unset or empty); ConfigError otherwise."""
    ENV_CHOICES[name] = accepted
    raw = os.environ.get(name, "").strip()
    if raw and raw not in accepted:
        from spotfill.config.errors import ConfigError
        raise ConfigError(name, raw, accepted=" or ".join(accepted))
    return raw or default


def check_env() -> None:
    """Validate every spotfill environment variable with a checked value as set now: the first bad one
    raises a ConfigError naming it, its value and what is accepted. Every entrypoint calls this first."""
    for spec in ENV_NUMBERS.values():
        spec.read(None)
    for name, accepted in ENV_CHOICES.items():
        env_choice(name, accepted[0], accepted)


# --- Object storage (storage.py, checkpoint_store.py) ---------------------------------------------
# The standard AWS variables are read when a Storage is opened (not at import), so a process may set
# them late (tests, the demo's local S3). Credentials come from boto3's chain and are never read here.
AWS_ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")   # first set one wins
AWS_REGION_ENV_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")            # first set one wins
AWS_REGION_DEFAULT = "us-east-1"
# Attempts (first try included) for a storage operation that hits a transient fault, before StorageError.
STORAGE_RETRIES = env_int("SPOTFILL_STORAGE_RETRIES", 8, minimum=1)
# Exponential backoff between those attempts: base seconds, cap per sleep, and a total deadline.
STORAGE_RETRY_BASE_S = env_float("SPOTFILL_STORAGE_RETRY_BASE_S", 0.25)
STORAGE_RETRY_MAX_S = env_float("SPOTFILL_STORAGE_RETRY_MAX_S", 8.0)
STORAGE_RETRY_DEADLINE_S = env_float("SPOTFILL_STORAGE_RETRY_DEADLINE_S", 120.0, strict=True)
# Parallel transfers: worker threads (parts and files share one pool) and the multipart part size.
STORAGE_CONCURRENCY = env_int("SPOTFILL_STORAGE_CONCURRENCY", 16, minimum=1)
STORAGE_CHUNK_MB = env_int("SPOTFILL_STORAGE_CHUNK_MB", 16, minimum=1)
# Storage.check(): connect/read timeout in seconds (it tries once, it must answer fast).
STORAGE_CHECK_TIMEOUT_S = env_float("SPOTFILL_STORAGE_CHECK_TIMEOUT_S", 3.0, strict=True)
# Checkpoint retention: committed checkpoints kept (older ones are deleted after each commit).
CHECKPOINT_KEEP_LAST = env_int("SPOTFILL_CHECKPOINT_KEEP_LAST", 3, minimum=1)
# A reader's hold on the checkpoint it downloads (Serve, batch, export): retention keeps a held tag until the
# reader releases it or this many seconds pass (a reader that died holds nothing longer).
CHECKPOINT_READ_HOLD_S = env_float("SPOTFILL_CHECKPOINT_READ_HOLD_S", 900.0, strict=True)
# How long commit() waits for every rank's done marker.
CHECKPOINT_COMMIT_TIMEOUT_S = env_float("SPOTFILL_CHECKPOINT_COMMIT_TIMEOUT_S", 600.0, strict=True)
# Emergency checkpoint (preemption notice): seconds kept free before the deadline, so the save must be
# committed by deadline - margin. It covers what still runs after the commit and before Ray Train tears the
# workers down (rank 0's commit polls the other ranks' markers up to 2 s apart, the manifest + `latest` PUTs,
# the planned-exit report to the event sink, Ray's ~1 s preemption poll), plus clock skew between nodes.
EMERGENCY_MARGIN_S = env_float("SPOTFILL_EMERGENCY_MARGIN_S", 5.0, strict=True)


def aws_endpoint_url() -> str | None:
    """The S3 endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (read now), or None for AWS itself."""
    for name in AWS_ENDPOINT_ENV_VARS:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return None


def storage_endpoint_env() -> dict[str, str]:
    """The non-secret S3 endpoint settings set in this process's environment (AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION), for the Ray workers' runtime_env: a worker on
    another node does not inherit the driver's environment. Credentials are never included."""
    return {name: os.environ[name].strip() for name in (*AWS_ENDPOINT_ENV_VARS, *AWS_REGION_ENV_VARS)
            if os.environ.get(name, "").strip()}


def aws_region() -> str:
    """The region from AWS_REGION / AWS_DEFAULT_REGION (read now), default us-east-1."""
    for name in AWS_REGION_ENV_VARS:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return AWS_REGION_DEFAULT


# --- Spot watcher (`spotfill spot-watch`, spot.py) --------------------------------------------------
# Kept as strings: the CLI validates them (a bad value is a one-line ConfigError, not an import crash).
# Instance-metadata endpoint; poll interval (s); timeout per IMDS request (s); what an EC2 rebalance
# recommendation does: "log" (early warning only) or "drain" (drain without deadline).
IMDS_ENDPOINT = os.environ.get("SPOTFILL_IMDS_ENDPOINT", "http://169.254.169.254")
SPOT_POLL_S = os.environ.get("SPOTFILL_SPOT_POLL_S", "2")
IMDS_TIMEOUT_S = os.environ.get("SPOTFILL_IMDS_TIMEOUT_S", "1")
SPOT_ON_REBALANCE = os.environ.get("SPOTFILL_SPOT_ON_REBALANCE", "log")
# Notice source of `spotfill spot-watch --source`: auto (detect), aws, gcp, azure, kubernetes.
SPOT_SOURCE = os.environ.get("SPOTFILL_SPOT_SOURCE", "auto")
# Registered (not parsed here: the CLI flags they default override them): check_env() validates them too.
ENV_NUMBERS["SPOTFILL_SPOT_POLL_S"] = EnvNumber("SPOTFILL_SPOT_POLL_S", float, 0, strict=True)
ENV_NUMBERS["SPOTFILL_IMDS_TIMEOUT_S"] = EnvNumber("SPOTFILL_IMDS_TIMEOUT_S", float, 0, strict=True)

# --- elastic training ---
# Ray Train waits this long for a worker group to start before it gives up on that size (stock: 60 s).
# spotfill lowers it so a group that asks for a lost node's slots falls back to the live size quickly.
WORKER_GROUP_START_TIMEOUT_S = env_float("SPOTFILL_WORKER_GROUP_START_TIMEOUT_S", 8.0, strict=True)
# Ray Train's controller polls its workers this often (stock: 2 s): a worker that exited or died is seen
# at the next poll, so every restart waits up to one interval (a planned exit, two).
HEALTH_CHECK_INTERVAL_S = env_float("SPOTFILL_HEALTH_CHECK_INTERVAL_S", 0.5, strict=True)
# Collectives of a training run (the default process group, TorchConfig(timeout_s), and DeepSpeed's groups:
# ray_compat.new_groups_timeout) give up after this many seconds without their peers: a rank that hangs
# while its node stays up (no health check sees it) fails the group, and Ray Train restarts it. A node that
# goes silent is found sooner, by the GCS's health checks (config/failure_detection.py). It must outlast the
# longest legitimate wait in a collective: the ranks wait in one while rank 0 converts a checkpoint to the
# universal format on a restore at another world size (minutes for a large model), for the emergency
# checkpoint of a notice (120 s on AWS), and while a rank waits on its own checkpoint upload, up to
# SPOTFILL_CHECKPOINT_COMMIT_TIMEOUT_S, before it reaches the next collective: so the default is that
# timeout plus a minute (660 s; Ray Train's default is 1800 s, torch's own for NCCL 600 s). NCCL honours it
# through its watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, which Ray Train sets to 1 when unset: the process
# that timed out aborts); gloo raises in the waiting collective.
COLLECTIVE_TIMEOUT_S = env_float("SPOTFILL_COLLECTIVE_TIMEOUT_S", CHECKPOINT_COMMIT_TIMEOUT_S + 60.0, strict=True)
# spotfill runs: each training worker has its node's raylet start this many spare worker processes, which
# import torch and DeepSpeed while the group trains; the group after a restart starts on them (0: off).
WARM_SPARES = env_int("SPOTFILL_WARM_SPARES", 1)
# While a grow waits for ready spares, the group's own nodes also warm this many more sets of the spares
# the grown group runs there (not waited for, in SCHED_IDLE until a restart wakes them): the grow takes the
# spares it uses, and its first restart (a loss or a notice right after it) finds these (train.readiness.
# GrowPlanner.reserve). Off by default: on the 2-core development machine, where the steps leave no CPU
# idle, they made the demo's restarts slower, not faster (docs/metrics.md); for GPU nodes whose CPUs idle.
WARM_SPARE_RESERVE = env_int("SPOTFILL_WARM_SPARE_RESERVE", 0)
# How long (s) a spare nobody took is kept idle above Ray's idle-worker soft limit.
WARM_SPARE_KEEP_ALIVE_S = env_int("SPOTFILL_WARM_SPARE_KEEP_ALIVE_S", 3600)
# A grow onto a node new to the run waits for that node's spares to warm up (train.readiness) at most this
# long (s); then it grows cold, and the planned exit says so.
WARM_GROW_BOUND_S = env_float("SPOTFILL_WARM_GROW_BOUND_S", 90.0)
# Spares count against their node's memory (train.spares.spares_within_memory): each is taken to hold this
# many MiB resident (torch, DeepSpeed and Ray Train imported: 391 MiB measured, plus Ray's worker), and a node's
# spares together stay within this fraction of its memory; a node gets fewer spares than asked beyond it.
WARM_SPARE_RSS_MB = env_int("SPOTFILL_WARM_SPARE_RSS_MB", 512, minimum=1)
WARM_SPARE_MEMORY_FRACTION = env_float("SPOTFILL_WARM_SPARE_MEMORY_FRACTION", 0.25)
# How a spare on a node where the run's group steps warms up (train.spares, train.warm): "low" (nice 19 in the
# normal class: a bounded share of a CPU the steps saturate, so it is ready by the next restart) or "idle"
# (SCHED_IDLE: only CPU time nothing else wants -- on a node whose CPUs training saturates, none, and the
# restart then waits for the imports). Either way a restart wakes it to the workers' priority at once.
SPARE_WARM_CLASS = env_choice("SPOTFILL_SPARE_WARM_CLASS", "low", ("low", "idle"))
# A fill-in tenant's standby (fillin/standby.py) warms up in `idle` (SCHED_IDLE: CPU time training leaves;
# the default -- training first) or `low` (nice 19: a bounded share of CPUs training saturates; measured in
# the demo: standbys ready sooner, harvest 0.12 against 0.09, but training's steps 30% slower while they warm).
STANDBY_WARM_CLASS = env_choice("SPOTFILL_STANDBY_WARM_CLASS", "idle", ("idle", "low"))
# ... and is held back at most this long (s; 0: until its warm-up ends): a tenant's actor Ray hands a standby
# still warming waits for that warm-up (the worker runs its setup hook first), and held back on a node whose
# CPUs training saturates the warm-up got no CPU -- a demo's sweep held a lent GPU 90 s and its trial never
# started. After the bound the standby warms at the priority of Ray's workers, once per standby.
STANDBY_HOLD_MAX_S = env_float("SPOTFILL_STANDBY_HOLD_MAX_S", 20.0)
# Its wake watcher looks this often (s) whether a training worker of its node is gone (train.spares).
SPARE_WAKE_POLL_S = env_float("SPOTFILL_SPARE_WAKE_POLL_S", 0.2, strict=True)
# ... and ends the hold-back after this long (s; 0: only a restart ends it): a spare held back on a node whose
# CPUs the steps saturate got almost none (nice 19 against Ray's nice-15 workers), and a grow 33 s later found
# its node's spares still importing (a demo here: the grown group's actors there waited 6-10 s for them). A
# bounded hold costs the steps one warm-up's CPU per group; a restart after it finds the spares ready.
SPARE_HOLD_MAX_S = env_float("SPOTFILL_SPARE_HOLD_MAX_S", 15.0)
# spotfill runs: rank 0 reads the drains of its group's nodes from the GCS this often (s), from the moment the
# training function starts (train.notice_watch): Ray Train's own watcher is an actor started with each group,
# which on a busy node began answering 11 s after the group started -- past a 15 s notice's save.
DRAIN_POLL_S = env_float("SPOTFILL_DRAIN_POLL_S", 1.0, strict=True)
# Universal-checkpoint conversion runs in-process below this size (bytes), in a subprocess pool above.
UNIVERSAL_INPROCESS_MAX_BYTES = env_int("SPOTFILL_UNIVERSAL_INPROCESS_MAX_BYTES", 1 << 30)


# --- The run's event log (telemetry/events.py) -----------------------------------------------------
# events.jsonl rolls into events-NNNNNN.jsonl past this many MiB (readers read the set in order).
EVENTS_ROLL_MB = env_int("SPOTFILL_EVENTS_ROLL_MB", 64, minimum=1)
# Step events: the first N of a run are all kept; after that one line in K (plus every notable step: the
# first after any other event, the last before one, a loss spike), each carrying the exact sums of the
# steps it stands for; and at most this many seconds of event time pass between two lines written.
EVENTS_STEPS_KEEP = env_int("SPOTFILL_EVENTS_STEPS_KEEP", 2000)
EVENTS_STEP_EVERY = env_int("SPOTFILL_EVENTS_STEP_EVERY", 100, minimum=1)
EVENTS_STEP_FLUSH_S = env_float("SPOTFILL_EVENTS_STEP_FLUSH_S", 10.0)

def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def scoped_env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables inside the block; restore them after."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(old)


# --- Autoscaler config (train/preflight.py) -------------------------------------------------------
# Where preflight reads the node types an autoscaler may add: `ray up` leaves its config at
# ~/ray_bootstrap_config.yaml on the head; the embedded autoscaling cluster (sim/autoscaling.py) points this
# at its own. Read at call time.
AUTOSCALER_CONFIG_ENV = "SPOTFILL_AUTOSCALER_CONFIG"


def autoscaler_config_path(default: str) -> str:
    return os.environ.get(AUTOSCALER_CONFIG_ENV) or default

"""Every environment variable spotfill reads, with its default, in one place."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

# Where workers keep node-local snapshots and caches (checkpoint staging, data shards).
LOCAL_DIR = os.environ.get("SPOTFILL_LOCAL_DIR", "/tmp/spotfill")
# Where checkpoint snapshots are staged before their background upload: "auto" (tmpfs /dev/shm when it has
# room for two snapshots per local rank with margin, else under LOCAL_DIR), or a folder path.
SNAPSHOT_DIR = os.environ.get("SPOTFILL_SNAPSHOT_DIR", "auto")
# Logging level for spotfill's own loggers.
LOG_LEVEL = os.environ.get("SPOTFILL_LOG_LEVEL", "INFO")


def _env_number(name: str, default, kind, accepted: str):
    """Read a number from the environment, `default` when unset or empty. A malformed value is a
    ConfigError naming the variable (one line, exit 2 at the CLI)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError:
        from spotfill.config.errors import ConfigError
        raise ConfigError(name, raw, accepted=accepted) from None


def env_float(name: str, default: float) -> float:
    return _env_number(name, default, float, "a number")


def env_int(name: str, default: int) -> int:
    return _env_number(name, default, int, "an integer")


# --- Object storage (storage.py, checkpoint_store.py) ---------------------------------------------
# The standard AWS variables are read when a Storage is opened (not at import), so a process may set
# them late (tests, the demo's local S3). Credentials come from boto3's chain and are never read here.
AWS_ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")   # first set one wins
AWS_REGION_ENV_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")            # first set one wins
AWS_REGION_DEFAULT = "us-east-1"
# Attempts (first try included) for a storage operation that hits a transient fault, before StorageError.
STORAGE_RETRIES = env_int("SPOTFILL_STORAGE_RETRIES", 8)
# Exponential backoff between those attempts: base seconds, cap per sleep, and a total deadline.
STORAGE_RETRY_BASE_S = env_float("SPOTFILL_STORAGE_RETRY_BASE_S", 0.25)
STORAGE_RETRY_MAX_S = env_float("SPOTFILL_STORAGE_RETRY_MAX_S", 8.0)
STORAGE_RETRY_DEADLINE_S = env_float("SPOTFILL_STORAGE_RETRY_DEADLINE_S", 120.0)
# Parallel transfers: worker threads (parts and files share one pool) and the multipart part size.
STORAGE_CONCURRENCY = env_int("SPOTFILL_STORAGE_CONCURRENCY", 16)
STORAGE_CHUNK_MB = env_int("SPOTFILL_STORAGE_CHUNK_MB", 16)
# Storage.check(): connect/read timeout in seconds (it tries once, it must answer fast).
STORAGE_CHECK_TIMEOUT_S = env_float("SPOTFILL_STORAGE_CHECK_TIMEOUT_S", 3.0)
# Checkpoint retention: committed checkpoints kept (older ones are deleted after each commit).
CHECKPOINT_KEEP_LAST = env_int("SPOTFILL_CHECKPOINT_KEEP_LAST", 3)
# How long commit() waits for every rank's done marker.
CHECKPOINT_COMMIT_TIMEOUT_S = env_float("SPOTFILL_CHECKPOINT_COMMIT_TIMEOUT_S", 600.0)


def aws_endpoint_url() -> str | None:
    """The S3 endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (read now), or None for AWS itself."""
    for name in AWS_ENDPOINT_ENV_VARS:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return None


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

# --- elastic training ---
# Ray Train waits this long for a worker group to start before it gives up on that size (stock: 60 s).
# spotfill lowers it so a group that asks for a lost node's slots falls back to the live size quickly.
WORKER_GROUP_START_TIMEOUT_S = env_float("SPOTFILL_WORKER_GROUP_START_TIMEOUT_S", 8.0)
# Ray Train's controller polls its workers this often (stock: 2 s): a worker that exited or died is seen
# at the next poll, so every restart waits up to one interval (a planned exit, two).
HEALTH_CHECK_INTERVAL_S = env_float("SPOTFILL_HEALTH_CHECK_INTERVAL_S", 0.5)
# Universal-checkpoint conversion runs in-process below this size (bytes), in a subprocess pool above.
UNIVERSAL_INPROCESS_MAX_BYTES = env_int("SPOTFILL_UNIVERSAL_INPROCESS_MAX_BYTES", 1 << 30)


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

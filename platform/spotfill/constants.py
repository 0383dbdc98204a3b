"""Every environment variable spotfill reads, with its default, in one place."""
from __future__ import annotations

import os

# Where workers keep node-local snapshots and caches (checkpoint staging, data shards).
LOCAL_DIR = os.environ.get("SPOTFILL_LOCAL_DIR", "/tmp/spotfill")
# Logging level for spotfill's own loggers.
LOG_LEVEL = os.environ.get("SPOTFILL_LOG_LEVEL", "INFO")


def env_float(name: str, default: float) -> float:
    """Read a float environment variable, falling back to `default` when unset or empty."""
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default

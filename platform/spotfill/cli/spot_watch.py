"""`spotfill spot-watch`: AWS spot notice -> Ray drain (PREEMPTION, deadline).

Runs as a daemon on every GPU worker (cluster.yaml starts it after `ray start`). `--once` polls once, prints
what it saw and did, and exits 0 (no notice, notice drained) or 1 (IMDS unreachable, drain failed).
"""
from __future__ import annotations

import argparse
import logging
import re
import signal
import threading
from typing import Any, Optional
from urllib.parse import urlparse

from spotfill.config import constants
from spotfill.config.errors import ConfigError, JobFailed


def register(sub) -> None:
    p = sub.add_parser("spot-watch", help="watch the instance-metadata service for a spot notice and drain this Ray node")
    p.add_argument("--imds-endpoint", metavar="URL", default=constants.IMDS_ENDPOINT,
                   help="instance-metadata endpoint (default: %(default)s; env SPOTFILL_IMDS_ENDPOINT)")
    p.add_argument("--poll-s", metavar="S", default=str(constants.SPOT_POLL_S),
                   help="poll interval in seconds, > 0 (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="poll once, print what was done, and exit")
    p.add_argument("--address", metavar="ADDR", default=None,
                   help="Ray cluster (GCS) address to drain through (default: auto, the cluster this node joined)")
    p.add_argument("--node-id", metavar="HEX", default=None,
                   help="Ray node to drain (default: the node started for this instance, "
                        "RAY_CLOUD_INSTANCE_ID, else the alive node with this machine's IP)")
    p.add_argument("--node-ip", metavar="IP", default=None, help="IP used to find this machine's Ray node")
    p.add_argument("--timeout-s", metavar="S", default=str(constants.IMDS_TIMEOUT_S),
                   help="timeout per IMDS request in seconds (default: %(default)s)")
    p.add_argument("--on-rebalance", choices=("log", "drain"), default=constants.SPOT_ON_REBALANCE,
                   help="what a rebalance recommendation does: log (default) or drain without deadline")
    p.set_defaults(func=run)


def validate_poll_s(value: Any, field: str = "--poll-s") -> float:
    """A finite number of seconds > 0, or ConfigError."""
    try:
        poll = float(value)
    except (TypeError, ValueError):
        raise ConfigError(field, value, "a number of seconds > 0") from None
    if not (poll > 0 and poll != float("inf")):
        raise ConfigError(field, value, "a number of seconds > 0")
    return poll


def validate_node_id(value: Optional[str], field: str = "--node-id") -> Optional[str]:
    """None, or a Ray node id: 56 hex digits (lower-cased)."""
    if value is None:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{56}", value):
        raise ConfigError(field, value, "a Ray node id (56 hex digits)")
    return value.lower()


def validate_endpoint(url: str, field: str = "--imds-endpoint") -> str:
    """An http:// or https:// URL with a host, or ConfigError."""
    parsed = urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(field, url, "an http:// URL such as http://169.254.169.254")
    return url


def run(args: argparse.Namespace) -> int:
    from spotfill.spot import watcher as spot

    poll_s = validate_poll_s(args.poll_s, "--poll-s")
    timeout_s = validate_poll_s(args.timeout_s, "--timeout-s")
    endpoint = validate_endpoint(args.imds_endpoint)
    node_id = validate_node_id(args.node_id)
    logging.basicConfig(level=getattr(logging, constants.LOG_LEVEL.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    drainer = spot.RayNodeDrainer(address=args.address, node_id=node_id, node_ip=args.node_ip)
    watcher = spot.SpotWatcher(spot.ImdsClient(endpoint, timeout_s=timeout_s), drainer,
                               on_rebalance=args.on_rebalance)
    if args.once:
        outcome = watcher.poll_once()
        print(f"spot-watch: {outcome.describe()}")
        if outcome.status in ("imds-error", "drain-failed"):
            raise JobFailed(f"spot-watch --once: {outcome.status}: {outcome.detail}")
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=drainer.prepare, name="spot-watch-prepare", daemon=True).start()
    watcher.run(poll_s, stop)
    return 0

"""`spotfill spot-watch`: a spot notice (AWS, GCP, Azure or Kubernetes: --source) -> Ray drain (PREEMPTION,
deadline); an early warning -> a record that keeps training from growing onto this node.

Runs as a daemon on every GPU worker (cluster.yaml and examples/cluster-{gcp,azure}.yaml start it after
`ray start`; deploy/kuberay runs it as a sidecar). `--once` polls once, prints what it saw and did, and exits
0 (no notice, notice drained) or 1 (metadata server unreachable, drain failed). docs/spot-notices.md.
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
    p.add_argument("--source", metavar="NAME", default=constants.SPOT_SOURCE,
                   help="where notices come from: auto (detect: a pod -> kubernetes, else the cloud the machine's "
                        "DMI names, else aws), aws, gcp, azure, kubernetes (default: %(default)s; env "
                        "SPOTFILL_SPOT_SOURCE)")
    p.add_argument("--imds-endpoint", metavar="URL", default=None,
                   help="metadata endpoint of the source (default: the source's own; for aws "
                        f"{constants.IMDS_ENDPOINT}, env SPOTFILL_IMDS_ENDPOINT)")
    p.add_argument("--endpoint", metavar="URL", default=None,
                   help="the same as --imds-endpoint (for kubernetes: the API server, default in-cluster)")
    p.add_argument("--deadline-s", metavar="S", default=None,
                   help="seconds a notice that carries no time leaves (default per source: aws 120, gcp 30 / 60 "
                        "for maintenance, azure 30, kubernetes 30 after SIGTERM)")
    p.add_argument("--node-name", metavar="NAME", default=None,
                   help="kubernetes: the Kubernetes node whose taints to watch (default: env NODE_NAME)")
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


def validate_source(value: str, field: str = "--source") -> str:
    from spotfill.spot.sources import CHOICES

    if value not in CHOICES:
        raise ConfigError(field, value, CHOICES)
    return value


def resolve_source(args: argparse.Namespace, env=None) -> tuple[str, str]:
    """(source name, why): --source, or detected for auto; an --imds-endpoint/--endpoint disagreement is bad
    usage."""
    import os

    from spotfill.spot.sources import DMI_PRODUCT, DMI_VENDOR, detect, read_dmi

    name = validate_source(args.source)
    if name != "auto":
        return name, "--source"
    if args.imds_endpoint:
        return "aws", "--imds-endpoint given (the AWS instance-metadata flag)"
    env = os.environ if env is None else env
    return detect(env, read_dmi(DMI_VENDOR), read_dmi(DMI_PRODUCT))


def build_source(name: str, args: argparse.Namespace, timeout_s: float):
    """The source ``name`` with the CLI's endpoint, deadline and node name applied."""
    import os

    from spotfill.spot.sources import default_endpoint, source_class
    from spotfill.spot.sources.kubernetes import in_cluster_endpoint

    if args.imds_endpoint and args.endpoint and args.imds_endpoint != args.endpoint:
        raise ConfigError("--endpoint", args.endpoint, f"the same URL as --imds-endpoint ({args.imds_endpoint})")
    given = args.endpoint or args.imds_endpoint
    deadline = validate_poll_s(args.deadline_s, "--deadline-s") if args.deadline_s is not None else None
    cls = source_class(name)
    if name == "kubernetes":
        endpoint = validate_endpoint(given, "--endpoint") if given else in_cluster_endpoint()
        kw = {"deadline_s": deadline} if deadline is not None else {}
        return cls(endpoint, node_name=args.node_name or os.environ.get("NODE_NAME") or None, timeout_s=timeout_s,
                   **kw)
    fallback = constants.IMDS_ENDPOINT if name == "aws" else default_endpoint(name)
    endpoint = validate_endpoint(given or fallback, "--endpoint" if args.endpoint else "--imds-endpoint")
    if name == "aws":
        return cls(endpoint, timeout_s=timeout_s, **({"default_deadline_s": deadline} if deadline else {}))
    if deadline is not None:
        raise ConfigError("--deadline-s", args.deadline_s, "only with --source aws or kubernetes (gcp and azure "
                          "notices have their own times)")
    return cls(endpoint, timeout_s=timeout_s)


def run(args: argparse.Namespace) -> int:
    from spotfill.spot import watcher as spot

    poll_s = validate_poll_s(args.poll_s, "--poll-s")
    timeout_s = validate_poll_s(args.timeout_s, "--timeout-s")
    node_id = validate_node_id(args.node_id)
    name, why = resolve_source(args)
    source = build_source(name, args, timeout_s)
    logging.basicConfig(level=getattr(logging, constants.LOG_LEVEL.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    drainer = spot.RayNodeDrainer(address=args.address, node_id=node_id, node_ip=args.node_ip)
    logging.getLogger(__name__).info("notice source %s (%s)", name, why)
    watcher = spot.SpotWatcher(source, drainer, on_rebalance=args.on_rebalance, warn=drainer.warn,
                               left=drainer.has_left)
    if args.once:
        outcome = watcher.poll_once()
        source.close()
        print(f"spot-watch: {outcome.describe()}")
        if outcome.status in ("imds-error", "drain-failed"):
            raise JobFailed(f"spot-watch --once: {outcome.status}: {outcome.detail}")
        return 0
    stop = threading.Event()
    on_term = getattr(source, "on_sigterm", None)      # kubernetes: SIGTERM is the notice, not a stop
    signal.signal(signal.SIGTERM, on_term if on_term is not None else (lambda *_: stop.set()))
    threading.Thread(target=drainer.prepare, name="spot-watch-prepare", daemon=True).start()
    watcher.run(poll_s, stop)
    return 0

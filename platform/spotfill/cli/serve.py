"""`spotfill serve --checkpoint STORAGE_URI [--port N]`: generation from a run's newest committed checkpoint
on a local embedded cluster (fill-in: the arbiter lends the cluster's idle GPU slots to Serve replicas)."""
from __future__ import annotations

import argparse
import time

from spotfill.config.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve generation from a run's newest checkpoint on a local cluster")
    p.add_argument("--checkpoint", required=True, metavar="STORAGE_URI",
                   help="the run's storage URI (file:///path or s3://bucket/prefix), checkpoints/ inside")
    p.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    p.add_argument("--nodes", type=int, default=2, help="local worker nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPU slots per local node (default 1)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: Ctrl-C)")
    p.set_defaults(func=run)


def check(args: argparse.Namespace) -> None:
    from spotfill.storage.base import open_storage
    if not 1 <= args.port <= 65535:
        raise ConfigError("--port", args.port, accepted="1..65535")
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), accepted="an integer >= 1")
    if args.duration < 0:
        raise ConfigError("--duration", args.duration, accepted="seconds >= 0")
    open_storage(args.checkpoint)


def run(args: argparse.Namespace) -> int:
    check(args)
    import ray

    from spotfill.fillin.wiring import deploy_serve, runtime_env
    from spotfill.sim.cluster import EmbeddedCluster, quiet_expected_node_deaths
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore

    latest = CheckpointStore(open_storage(args.checkpoint)).latest()
    cluster = EmbeddedCluster()
    try:
        for _ in range(args.nodes):
            cluster.add_node(args.gpus_per_node)
        ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
        quiet_expected_node_deaths()
        out = deploy_serve(args.checkpoint, port=args.port, max_replicas=args.nodes * args.gpus_per_node)
        url = out["url"]
        print(f"spotfill serve: {url}/v1/completions (OpenAI) and {url}/generate (JSON); checkpoint "
              f"{latest['tag'] if latest else 'none committed yet (503 until one is)'} of {args.checkpoint}; "
              f"`spotfill status --address {cluster.address}` shows the lent GPUs; Ctrl-C stops", flush=True)
        t_end = time.monotonic() + args.duration if args.duration else None
        while t_end is None or time.monotonic() < t_end:
            time.sleep(0.5)
    finally:
        from ray import serve
        try:
            serve.shutdown()
        finally:
            cluster.shutdown()
    return 0

"""`spotfill serve --checkpoint STORAGE_URI [--draft URI|self:L] [--num-draft-tokens K] [--port N]`: generation
from a run's newest committed checkpoint on a local embedded cluster (fill-in: the arbiter lends the cluster's
idle GPU slots to Serve replicas; Serve deploys none of its own).
`spotfill serve --engine vllm --model-dir DIR ...`: vLLM through Ray Serve LLM over an exported folder, on
GPUs, lent the same way (cli/serve_vllm.py)."""
from __future__ import annotations

import argparse
import time

from spotfill.config.errors import ConfigError

MAX_NEAREST = 5
# flags that are the Serve app's own args (serving/args.py ServeArgs): arg name -> flag
APP_FLAGS = {"checkpoint": "--checkpoint", "draft": "--draft", "num_draft_tokens": "--num-draft-tokens",
             "max_queue_wait_s": "--max-queue-wait-s", "floor_replicas": "--floor-replicas",
             "standby_per_node": "--standby-per-node"}


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve generation from a run's newest checkpoint on a local cluster, or "
                                     "an exported folder with vLLM on GPUs (--engine vllm)")
    p.add_argument("--engine", choices=("spotfill", "vllm"), default="spotfill",
                   help="spotfill (default): spotfill's engine over --checkpoint on a local embedded cluster; "
                        "vllm: Ray Serve LLM's OpenAI app over --model-dir on this machine's or --address's GPUs "
                        "(needs pip install 'spotfill[llm]')")
    p.add_argument("--checkpoint", default="", metavar="STORAGE_URI",
                   help="--engine spotfill (required there): the run's storage URI (file:///path or "
                        "s3://bucket/prefix), checkpoints/ inside")
    p.add_argument("--draft", default="", metavar="URI|self:L",
                   help="speculative decoding: a run with the same tokenizer, or self:L (the model's first L "
                        "layers and its head); off by default")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="the most tokens the draft proposes per verify step (default 4; fewer when they are "
                        "rejected, none when speculation does not pay)")
    p.add_argument("--max-queue-wait-s", type=float, default=15.0, metavar="S",
                   help="how long a request waits for a replica that is starting or replacing a lost one "
                        "before it gets 503 (default 15; 0: 503 at once)")
    p.add_argument("--floor-replicas", type=int, default=0, metavar="N",
                   help="replicas on the head's CPU that answer while no lent replica runs (training holds every "
                        "GPU, or none was lent yet); default 0")
    p.add_argument("--standby-per-node", type=int, default=1, metavar="N",
                   help="warm standby processes per node whose GPUs may be lent: the replica's imports done and "
                        "the checkpoint in host memory, no GPU held, so a lent GPU answers within a second "
                        "(default 1; 0: every lent replica starts cold)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    p.add_argument("--nodes", type=int, default=2, help="local worker nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPU slots per local node (default 1)")
    p.add_argument("--wait-for-checkpoint", action="store_true",
                   help="start although no checkpoint is committed there yet (requests get 503 until one is)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: Ctrl-C)")
    from spotfill.cli import serve_vllm
    serve_vllm.add_flags(p)
    p.set_defaults(func=run)


def committed_runs(uri: str, limit: int = MAX_NEAREST, depth: int = 4) -> list[str]:
    """Storage URIs of runs with a committed checkpoint (RUN/checkpoints/latest) under `uri`, nearest first;
    none there: under its parent (a typo in the run's name). Local folders are searched `depth` levels deep."""
    from urllib.parse import urlsplit
    base = uri.split("?", 1)[0].rstrip("/")
    for root in (base, base.rsplit("/", 1)[0]):
        parts = urlsplit(root)
        if parts.scheme not in ("", "file", "s3") or (parts.scheme != "s3" and parts.path in ("", "/")):
            continue                                  # never the whole file system
        try:
            runs = _local_runs(parts.path, depth) if parts.scheme != "s3" else _s3_runs(root)
        except (OSError, ConfigError):
            continue
        runs = sorted(runs, key=lambda r: (r.count("/"), r))
        if runs:
            return [f"{root}/{r}" if r else root for r in runs[:limit]]
    return []


def _local_runs(path: str, depth: int) -> list[str]:
    import os
    out = []
    for folder, dirs, files in os.walk(path):
        rel = os.path.relpath(folder, path)
        level = 0 if rel == "." else rel.count(os.sep) + 1
        if os.path.basename(folder) == "checkpoints" and "latest" in files:
            out.append(os.path.dirname(rel).replace(os.sep, "/") if rel != "checkpoints" else "")
        if level >= depth:
            dirs[:] = []
    return out


def _s3_runs(root: str) -> list[str]:
    from spotfill.storage.base import open_storage
    return [k[:-len("checkpoints/latest")].rstrip("/") for k in open_storage(root).list("")
            if k == "checkpoints/latest" or k.endswith("/checkpoints/latest")]


def check(args: argparse.Namespace) -> dict | None:
    """Every flag, and a committed checkpoint at --checkpoint (unless --wait-for-checkpoint): one line and
    exit 2 otherwise. Returns the checkpoint's `latest` pointer."""
    from spotfill.serving.args import ServeArgs, check_deployable
    from spotfill.cli.serve_vllm import refuse_flags
    refuse_flags(args)
    if not args.checkpoint:
        raise ConfigError("--checkpoint", reason="required with --engine spotfill",
                          accepted="a run's storage URI (file:///path or s3://bucket/prefix)")
    check_port(args.port)
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), accepted="an integer >= 1")
    if args.duration < 0:
        raise ConfigError("--duration", args.duration, accepted="seconds >= 0")
    try:
        latest = check_deployable(ServeArgs.parse({name: getattr(args, name) for name in APP_FLAGS}))
    except ConfigError as exc:
        key = exc.field.rsplit(" ", 1)[-1]
        raise ConfigError(APP_FLAGS.get(key, exc.field), exc.value, reason=exc.reason, accepted=exc.accepted) from None
    if latest is None and not args.wait_for_checkpoint:
        near = committed_runs(args.checkpoint)
        raise ConfigError("--checkpoint", args.checkpoint, reason="no committed checkpoint there "
                          "(no checkpoints/latest)" + (f"; committed runs nearby: {', '.join(near)}" if near else
                                                       "; none found nearby"),
                          accepted="a run's storage URI with a committed checkpoint, or add --wait-for-checkpoint")
    return latest


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError("--port", port, accepted="1..65535")
    if not port_free(port):
        raise ConfigError("--port", port, reason="in use on 127.0.0.1 (another spotfill serve, or another "
                          "server, listens there)", accepted=f"a free port, e.g. --port {port_free(0) or 8001}")


def port_free(port: int, host: str = "127.0.0.1") -> int:
    """`port` (0: one the system picks) when a server can listen on it at `host` now, else 0. SO_REUSEADDR as
    a server sets it (Serve's proxy does): a port whose last connections are closing counts as free. The
    local cluster's own ports need no such check: Ray picks free ones (sim/cluster.py HEAD_DASHBOARD)."""
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return 0
        return s.getsockname()[1]


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM end the command through its cleanup (Serve and the local cluster shut down), also
    when it was started in the background, where SIGINT arrives ignored."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from spotfill.cli.serve_vllm import run as run_vllm
        return run_vllm(args)
    latest = check(args)
    _stop_on_signals()
    import ray

    from spotfill.fillin.wiring import runtime_env
    from spotfill.serving.deploy import deploy_serve
    from spotfill.sim.cluster import EmbeddedCluster, quiet_expected_node_deaths

    cluster = EmbeddedCluster()
    try:
        for _ in range(args.nodes):
            cluster.add_node(args.gpus_per_node)
        ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
        quiet_expected_node_deaths()
        # replicas=0: the arbiter's lends create the replicas (no replica of Serve's own beside them)
        out = deploy_serve(port=args.port, max_replicas=args.nodes * args.gpus_per_node, replicas=0,
                           **{name: getattr(args, name) for name in APP_FLAGS})
        url = out["url"]
        print(f"spotfill serve: {url}/v1/completions and {url}/v1/chat/completions (OpenAI), {url}/-/ready; "
              f"checkpoint {latest['tag'] if latest else 'none committed yet (503 until one is)'} of "
              f"{args.checkpoint}" + (f"; draft {args.draft}, up to {args.num_draft_tokens} tokens" if args.draft
                                     else "") +
              f"; `spotfill status --address {cluster.address}` shows the lent GPUs; Ctrl-C stops", flush=True)
        t_end = time.monotonic() + args.duration if args.duration else None
        while t_end is None or time.monotonic() < t_end:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("spotfill serve: stopping", flush=True)
    finally:
        from ray import serve
        try:
            serve.shutdown()
        finally:
            cluster.shutdown()
    return 0

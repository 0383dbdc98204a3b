"""`spotfill serve --engine vllm --model-dir DIR [--model-id ID] [--max-model-len N] [--max-replicas N]
[--address ADDR] [--port N] [--duration S] [--print-config]`: Ray Serve LLM's OpenAI app (vLLM) over a folder
`spotfill export` wrote, on the GPUs of the Ray cluster at --address (default: RAY_ADDRESS, else a Ray started
here on this machine's GPUs), with the external scaler on and registered with the fill-in arbiter
(serving/llm.py): replicas run only on GPUs the arbiter lends. --print-config writes the same deployment as a
`serve deploy` config instead (no vLLM needed). Without vLLM: exit 2, one line naming the extra."""
from __future__ import annotations

import argparse
import os
import time

from spotfill.config.errors import ConfigError

# flags of --engine spotfill only, with their defaults (cli/serve.py)
SPOTFILL_ONLY = {"checkpoint": "", "draft": "", "num_draft_tokens": 4, "max_queue_wait_s": 15.0,
                 "floor_replicas": 0, "standby_per_node": 1, "nodes": 2, "gpus_per_node": 1,
                 "wait_for_checkpoint": False}
# flags of --engine vllm only, with their defaults
VLLM_ONLY = {"model_dir": "", "model_id": "", "max_model_len": None, "max_replicas": None, "address": "",
             "print_config": False}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default="", metavar="DIR",
                   help="--engine vllm (required there): a Hugging Face folder (`spotfill export RUN --out DIR`), "
                        "at this path on every GPU node")
    p.add_argument("--model-id", default="", metavar="ID",
                   help="--engine vllm: the model name clients send (default: the folder's name); the server "
                        "deployment is LLMServer:<ID> ('/' -> '--', '.' -> '_')")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="--engine vllm: context length cap in tokens (default: the model's)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="--engine vllm: the most replicas (one GPU each) the arbiter lends (default: the "
                        "cluster's GPUs; the printed config: 4)")
    p.add_argument("--address", default="", metavar="ADDR",
                   help="--engine vllm: a running Ray cluster (default: RAY_ADDRESS, else Ray is started here "
                        "on this machine's GPUs)")
    p.add_argument("--print-config", action="store_true",
                   help="--engine vllm: print the `serve deploy` config for this folder and exit (no vLLM needed)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refuse_flags(args: argparse.Namespace) -> None:
    """A flag of the other engine, given: one line naming it."""
    other = SPOTFILL_ONLY if args.engine == "vllm" else VLLM_ONLY
    for name, default in other.items():
        if getattr(args, name) != default:
            raise ConfigError(_flag(name), getattr(args, name), reason=f"not used with --engine {args.engine}",
                              accepted=f"--engine {'spotfill' if args.engine == 'vllm' else 'vllm'} with it, or leave it out")


def check(args: argparse.Namespace) -> dict:
    """Every flag, then vLLM's presence (unless --print-config): one line and exit 2 otherwise. Returns the
    resolved {"model_dir", "model_id"}."""
    from spotfill.cli.serve import check_port
    from spotfill.serving import llm
    refuse_flags(args)
    model_dir = llm.check_model_dir(args.model_dir)
    model_id = llm.check_model_id(args.model_id) if args.model_id else llm.default_model_id(model_dir)
    llm.engine_kwargs(args.max_model_len)
    if args.max_replicas is not None and args.max_replicas < 1:
        raise ConfigError("--max-replicas", args.max_replicas, accepted="an integer >= 1")
    if args.duration < 0:
        raise ConfigError("--duration", args.duration, accepted="seconds >= 0")
    if not args.print_config:
        check_port(args.port)
        llm.require_vllm()
    return {"model_dir": model_dir, "model_id": model_id}


def run(args: argparse.Namespace) -> int:
    resolved = check(args)
    from spotfill.serving import llm
    if args.print_config:
        import yaml
        cfg = llm.serve_config(resolved["model_dir"], resolved["model_id"], port=args.port,
                               max_replicas=args.max_replicas or llm.DEFAULT_MAX_REPLICAS,
                               max_model_len=args.max_model_len)
        print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    from spotfill.cli.serve import _stop_on_signals
    _stop_on_signals()
    import ray

    from spotfill.fillin.wiring import runtime_env
    started_here = not (args.address or os.environ.get("RAY_ADDRESS"))
    ray.init(address=args.address or None, runtime_env=runtime_env(), logging_level="WARNING")
    names = llm.deployment_names(resolved["model_id"])
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < 1:
            raise ConfigError("--engine", "vllm", reason="the Ray cluster has no GPU (vLLM runs on GPUs only)",
                              accepted="a cluster with GPUs (--address), or --engine spotfill")
        out = llm.deploy_llm(resolved["model_dir"], resolved["model_id"], port=args.port,
                             max_replicas=args.max_replicas or gpus, max_model_len=args.max_model_len)
        url = out["url"]
        print(f"spotfill serve: {url}/v1/chat/completions and {url}/v1/completions (OpenAI, model "
              f"{resolved['model_id']!r}) by vLLM through Ray Serve LLM over {resolved['model_dir']}; the arbiter "
              f"lends up to {args.max_replicas or gpus} GPUs to {names.app}/{names.server}; Ctrl-C stops",
              flush=True)
        t_end = time.monotonic() + args.duration if args.duration else None
        while t_end is None or time.monotonic() < t_end:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("spotfill serve: stopping", flush=True)
    finally:
        _stop(names, started_here)
    return 0


def _stop(names, started_here: bool) -> None:
    """The tenant leaves the arbiter and the app goes (Serve itself too, and Ray, when started here)."""
    import ray
    from ray import serve

    from spotfill.fillin.wiring import get_arbiter
    try:
        arbiter = get_arbiter()
        if arbiter is not None:
            ray.get(arbiter.unregister_tenant.remote(names.tenant), timeout=30)
        serve.shutdown() if started_here else serve.delete(names.app)
    finally:
        if started_here:
            ray.shutdown()

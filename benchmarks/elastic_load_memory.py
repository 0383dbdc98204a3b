"""Peak memory of loading a ZeRO-1/2 checkpoint at another world size (elastic layout), per rank, on CPU.

    spotfill bench --only elastic_load            # both directions (2 -> 1 and 1 -> 2 ranks), 50m preset
    python -m benchmarks.elastic_load_memory [--preset 50m] [--save 2 --load 1] [--json PATH]

Saves a checkpoint with `--save` ranks (gloo, one process each, one training step, spotfill's Checkpointer
into a local store), then restores it with `--load` ranks on one "node" (spotfill's restore and
load_checkpoint), and reports per loading rank its resident memory before the load and the peak during it
(VmHWM after resetting it through /proc/self/clear_refs; Linux). No Ray.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rank(rank: int, world: int, port: int, mode: str, preset: str, store_uri: str, work: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    from spotfill.config.batching import batch_shape
    from spotfill.train.checkpointing import Checkpointer
    from spotfill.train.engine import build_engine, ds_config, load_checkpoint
    from spotfill.train.model import build_model
    from spotfill.train.restore import RestorePlan, restore_on_workers

    class Comms:
        def __init__(self):
            self.dist = dist

        def bcast(self, obj):
            buf = [obj]
            dist.broadcast_object_list(buf, src=0)
            return buf[0]

        def barrier(self):
            dist.barrier()

    job = from_mapping(JobConfig, {"storage": store_uri, "data": {"path": "/unused"},
                                   "training": {"workers": [1, 2], "global_batch": 4, "zero_stage": 2,
                                                "steps": 10, "warmup_steps": 1, "max_micro_batch": 1}})
    shape = batch_shape(4, world, 1)
    store = CheckpointStore(open_storage(store_uri))
    plan = RestorePlan()
    if mode == "load":
        plan = restore_on_workers(store, Comms(), rank, world, "one-node", os.path.join(work, "node"), 2)
    torch.manual_seed(0)
    model = build_model(preset)
    engine = build_engine(model, ds_config(job, shape.micro_batch, shape.accum, "fp32", plan.universal))
    result = {}
    if mode == "save":
        x = torch.randint(0, 257, (shape.micro_batch, 64))
        for _ in range(shape.accum):
            loss = F.cross_entropy(engine(x).reshape(-1, 257), x.reshape(-1))
            engine.backward(loss)
            engine.step()
        ckpt = Checkpointer(store, os.path.join(work, f"save-r{rank}"), rank, world, attempt="0")
        ckpt.save(engine, 1, {}, kind="final")
        ckpt.close()
    else:
        import gc
        def reset_peak() -> int:
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:     # VmHWM (the peak) back to the current RSS
                f.write("5")
            return _status_kb("VmRSS")

        # the module, scheduler and client state alone (DeepSpeed's own load, what every path does first)
        before = reset_peak()
        engine.load_checkpoint(plan.load_dir, tag=plan.load_tag, load_optimizer_states=False,
                               load_lr_scheduler_states=True)
        module_peak = _status_kb("VmHWM") - before
        before = reset_peak()
        load_checkpoint(engine, plan.load_dir, plan.load_tag, plan.elastic)
        result = {"rank": rank, "rss_before_mb": round(before / 1024, 1),
                  "module_load_extra_peak_mb": round(module_peak / 1024, 1),
                  "peak_during_load_mb": round(_status_kb("VmHWM") / 1024, 1),
                  "load_extra_peak_mb": round((_status_kb("VmHWM") - before) / 1024, 1),
                  "elastic": plan.elastic, "saved_world": plan.world_size}
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, *args) -> None:
    import torch.multiprocessing as mp
    mp.start_processes(_rank, args=(world, _free_port(), *args), nprocs=world, join=True, start_method="spawn")


def measure(preset: str, save: int, load: int) -> dict:
    """Save with `save` ranks, load with `load`: the checkpoint's size and each loading rank's memory."""
    with tempfile.TemporaryDirectory(prefix="spotfill-elastic-mem-") as work:
        store = os.path.join(work, "store")
        _spawn(save, "save", preset, store, os.path.join(work, "s"), work)
        _spawn(load, "load", preset, store, os.path.join(work, "l"), work)
        ranks = [json.load(open(os.path.join(work, f"rank-{r}.json"))) for r in range(load)]
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(store) for f in files)
    return {"preset": preset, "save_world": save, "load_world": load, "checkpoint_mb": round(size / 1e6, 1),
            "ranks": ranks, "node_extra_peak_mb": round(sum(r["load_extra_peak_mb"] for r in ranks), 1)}


def bench_elastic_load(quick: bool, progress=None) -> dict:
    """`spotfill bench --only elastic_load` (not in the default sections: four process groups of the 50m
    preset, a few minutes on 2 cores): shrinking 2 -> 1 and growing 1 -> 2 ranks. --quick: the tiny preset."""
    say = progress or (lambda msg: None)
    preset, out = ("tiny" if quick else "50m"), {}
    for name, save, load in (("shrink", 2, 1), ("grow", 1, 2)):
        say(f"{name}: save {save} ranks, load {load} ({preset})")
        out[name] = measure(preset, save, load)
    return {"preset": preset, **out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--save", type=int, default=2)
    ap.add_argument("--load", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = measure(args.preset, args.save, args.load)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.path[:0] = [p for p in ("platform", ".") if p not in sys.path]
    main()

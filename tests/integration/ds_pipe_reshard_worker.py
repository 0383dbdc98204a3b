"""Child process body for the pipeline resharding test: one rank of a DeepSpeed pipeline on gloo (spawned by
torch.multiprocessing), through spotfill's own pipeline run, checkpointer and restore."""
from __future__ import annotations

import os
import pickle

from ds_reshard_worker import _Comms, full_state

GLOBAL_BATCH, SEQ, VOCAB = 8, 32, 257


def _job(storage_uri: str, stages: int, world: int):
    from spotfill.config.job import JobConfig, from_mapping
    return from_mapping(JobConfig, {"storage": storage_uri, "data": {"path": "/unused"},
                                    "training": {"workers": [world], "global_batch": GLOBAL_BATCH, "zero_stage": 1,
                                                 "steps": 20, "warmup_steps": 2, "pipeline_stages": stages,
                                                 "micro_batches": 2}})


def run(rank: int, world: int, port: int, stages: int, mode: str, train_steps: int, save_step: int,
        storage_uri: str, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import numpy as np
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    from spotfill.train.checkpointing import Checkpointer
    from spotfill.train.engine import load_checkpoint
    from spotfill.train.pipeline import PipelineRun
    from spotfill.train.restore import RestorePlan, restore_on_workers

    job = _job(storage_uri, stages, world)
    store = CheckpointStore(open_storage(storage_uri))
    plan = RestorePlan()
    if mode == "load":     # every rank plays its own node: node leaders restore in parallel, one converts
        plan = restore_on_workers(store, _Comms(dist), rank, world, f"node-{rank}",
                                  os.path.join(work, f"node-s{stages}-r{rank}"), 1, stages=stages)
    pipe = PipelineRun(job, world, rank)
    engine, _, _ = pipe.build_engine(job, SEQ, VOCAB, "fp32", plan.universal)
    step = 0
    if plan.tag:
        step = int(load_checkpoint(engine, plan.load_dir, plan.load_tag, plan.elastic)["step"])
    loaded = _gather_state(engine, rank, world) if plan.tag else None
    losses = []
    for s in range(step, step + train_steps):
        rows = np.random.default_rng([7, s]).integers(0, VOCAB, size=(GLOBAL_BATCH, SEQ + 1)).astype(np.uint16)
        mine = rows[pipe.positions(s) - s * GLOBAL_BATCH]
        losses.append(pipe.train_step(engine, np.split(mine, pipe.shape.accum) if len(mine) else
                                      [mine] * pipe.shape.accum))
    if train_steps:
        ckpt = Checkpointer(store, os.path.join(work, f"save-s{stages}-r{rank}"), rank, world, attempt="0",
                            meta=pipe.checkpoint_meta())
        ckpt.save(engine, step + train_steps, {"note": "test"}, kind="final")
        ckpt.close()
    state = _gather_state(engine, rank, world)
    if rank == 0:
        out = {"loaded": loaded, "state": state, "losses": losses, "universal": plan.universal,
               "from_stages": plan.stages, "timings": plan.timings, "step": step}
        with open(os.path.join(work, f"{mode}-s{stages}.pkl"), "wb") as f:
            pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _gather_state(engine, rank: int, world: int) -> dict:
    """Every parameter's full fp32 weights and Adam moments (by global layer name, so any stage count
    compares), the module's own weights, the step and the learning rate, merged over all stages."""
    import torch.distributed as dist

    mine = {"params": {n: {**v, "module": p.detach().clone()} for (n, v), (_, p) in
                       zip(full_state(engine).items(), engine.module.named_parameters())},
            "global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "sched": engine.lr_scheduler.state_dict()}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    merged = {k: parts[0][k] for k in ("global_steps", "lr", "sched")}
    merged["params"] = {n: v for p in parts for n, v in p["params"].items()}
    assert all(p[k] == merged[k] for p in parts for k in ("global_steps", "lr", "sched"))
    return merged

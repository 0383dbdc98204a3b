"""Child process body for the resharding test: one DeepSpeed rank on gloo (spawned by torch.multiprocessing)."""
from __future__ import annotations

import os
import pickle


def full_state(engine) -> dict:
    """Full (gathered) fp32 params and Adam moments per parameter name, on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO 1/2: after a plain (non-universal) load the debug API's optimizer-state links are stale;
        # rebuild them the way DeepSpeed does after a universal load.
        opt._link_all_hp_params()
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"param": safe_get_full_fp32_param(p).detach().clone(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()}
    return out


class _Comms:
    def __init__(self, dist):
        self.dist = dist

    def bcast(self, obj):
        buf = [obj]
        self.dist.broadcast_object_list(buf, src=0)
        return buf[0]

    def barrier(self):
        self.dist.barrier()


def run(rank: int, world: int, port: int, mode: str, stage: int, storage_uri: str, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed

    from spotfill.config.batching import batch_shape
    from spotfill.train.checkpointing import Checkpointer
    from spotfill.train.restore import RestorePlan, restore_on_workers
    from spotfill.storage.checkpoint_store import CheckpointStore
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.model import build_model
    from spotfill.storage.base import open_storage
    from spotfill.train.engine import build_engine, ds_config, load_checkpoint

    job = from_mapping(JobConfig, {"storage": storage_uri, "data": {"path": "/unused"},
                                   "training": {"workers": [1, 3], "global_batch": 6, "zero_stage": stage,
                                                "steps": 20, "warmup_steps": 2, "max_micro_batch": 1}})
    shape = batch_shape(6, world, 1)
    store = CheckpointStore(open_storage(storage_uri))
    plan = RestorePlan()
    if mode == "load":
        # every rank plays its own node (own folder): node leaders restore in parallel, one converts
        node_dir = os.path.join(work, f"node-w{world}-r{rank}")
        plan = restore_on_workers(store, _Comms(dist), rank, world, f"node-{rank}", node_dir, stage)
    torch.manual_seed(0)
    model = build_model("tiny")
    # the production engine (train.engine.build_engine: torch AdamW client optimizer)
    config = ds_config(job, shape.micro_batch, shape.accum, "fp32", plan.universal)
    if mode == "save-rigid":    # DeepSpeed's default layout (checkpoints saved before the elastic one)
        config["zero_optimization"].pop("elastic_checkpoint", None)
    engine = build_engine(model, config)
    if mode.startswith("save"):
        g = torch.Generator().manual_seed(1234 + rank)
        for _ in range(3):
            for _ in range(shape.accum):
                x = torch.randint(0, 257, (shape.micro_batch, 64), generator=g)
                loss = F.cross_entropy(engine(x).reshape(-1, 257), x.reshape(-1))
                engine.backward(loss)
                engine.step()
        ckpt = Checkpointer(store, os.path.join(work, f"save-r{rank}"), rank, world, attempt="0")
        ckpt.save(engine, 3, {"note": "test"}, kind="final")
        ckpt.close()
    else:
        client = load_checkpoint(engine, plan.load_dir, plan.load_tag, plan.elastic)
        assert client["step"] == 3, client
    state = full_state(engine)
    if rank == 0:
        result = {"state": state, "global_steps": engine.global_steps, "lr": engine.get_lr()[0],
                  "sched": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                  "universal": plan.universal, "elastic": plan.elastic, "timings": plan.timings}
        with open(os.path.join(work, f"{mode.split('-')[0]}-w{world}.pkl"), "wb") as f:
            pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()

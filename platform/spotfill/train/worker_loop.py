"""The Ray Train worker loop: one DeepSpeed engine per worker, elastic and preemption-aware.

Every optimizer step consumes the stream indices [step*G, (step+1)*G) whatever the world size; each rank
takes its slice as micro-batches (batching.py). After each step one all-reduce carries the loss and two
flags: "a node of ours got a preemption notice" (ray.train.get_preemption_info) and "more workers fit now".
Either flag makes every rank take a checkpoint at the same step, commit it, and leave with PlannedExit, so
Ray Train restarts the group at the size the cluster now holds -- with no step lost. Other checkpoints are
every `checkpoint_every` steps and upload in the background.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from spotfill.config import constants
from spotfill.train.batching import batch_shape, rank_micro_batches, stream_to_rows
from spotfill.train.checkpointing import Checkpointer
from spotfill.train.restore import restore_on_workers
from spotfill.config.errors import NoIntactCheckpoint
from spotfill.storage.checkpoint_store import CheckpointStore
from spotfill.config.job import JobConfig, from_mapping
from spotfill.ray_compat import local_preemption_info
from spotfill.train.engine import build_engine, ds_config, resolve_precision
from spotfill.train.data import Prefetcher, ShardReader, StepBatch
from spotfill.storage.base import open_storage

log = logging.getLogger(__name__)


class PlannedExit(RuntimeError):
    """Raised by every rank after a committed checkpoint so Ray Train restarts the group at a new size."""


class _Comms:
    """Tiny helpers over torch.distributed (already initialised by Ray Train's TorchConfig)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist

    def bcast(self, obj):
        buf = [obj]
        self.dist.broadcast_object_list(buf, src=0)
        return buf[0]

    def barrier(self):
        self.dist.barrier()


def train_loop_per_worker(loop_config: dict) -> None:
    import ray
    import ray.train
    import torch
    import torch.nn.functional as F

    from spotfill.train.elastic import GrowCheck
    from spotfill.train.model import build_model

    job: JobConfig = from_mapping(JobConfig, loop_config["job"])
    t = job.training
    sink = ray.get_actor(loop_config["sink"], namespace=loop_config["namespace"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    comms = _Comms()
    t_start = time.time()

    info = ray.get(sink.begin_attempt.remote(world)) if rank == 0 else None
    info = comms.bcast(info)
    if info["give_up"]:
        if rank == 0:
            ray.get(sink.finish.remote({"ok": False, "reason": f"{info['unplanned_failures']} unplanned "
                                        f"failures exceed training.max_failures={t.max_failures}"}))
        return
    attempt = info["attempt"]
    shape = batch_shape(t.global_batch, world, t.max_micro_batch)
    store = CheckpointStore(open_storage(job.storage).child(job.name), keep_last=t.keep_checkpoints)
    local_root = os.path.join(constants.LOCAL_DIR, job.name, f"node-{node_id[:12]}")
    node_dir = os.path.join(local_root, "restore")

    t0 = time.perf_counter()
    try:
        plan = restore_on_workers(store, comms, rank, world, node_id, node_dir, t.zero_stage,
                                  on_no_intact=t.on_no_intact_checkpoint,
                                  emit=lambda kind, **f: sink.event.remote(kind, attempt=attempt, **f))
    except NoIntactCheckpoint as exc:
        return None if rank else ray.get(sink.finish.remote({"ok": False, "reason": str(exc)}))
    prep_s = time.perf_counter() - t0

    on_gpu = torch.cuda.is_available() and job.cluster.gpu_resource == "GPU"
    precision = resolve_precision(t.precision, on_gpu)
    torch.manual_seed(t.seed)
    reader = ShardReader(open_storage(job.data.path), cache_dir=os.path.join(local_root, "data"))
    model = build_model(t.model, seq_len=reader.seq_len, vocab_size=None if t.model.startswith("hf:")
                        else reader.manifest["vocab_size"])
    engine = build_engine(model, ds_config(job, shape.micro_batch, shape.accum, precision, plan.universal))
    start_step = 0
    t1 = time.perf_counter()
    if plan.tag:
        load_dir = os.path.join(node_dir, "ds")
        _, client_state = engine.load_checkpoint(load_dir, tag=plan.load_tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        start_step = int(client_state["step"])
    load_s = time.perf_counter() - t1
    if rank == 0:
        sink.event.remote("resume" if plan.tag else "start", attempt=attempt, step=start_step,
                          world_size=world, micro_batch=shape.micro_batch, accum=shape.accum,
                          from_world_size=plan.world_size or None, universal=plan.universal,
                          restore_prep_s=round(prep_s, 3), load_s=round(load_s, 3), **plan.timings,
                          startup_s=round(time.time() - t_start, 3), precision=precision)

    def make(step: int) -> StepBatch:
        mbs = rank_micro_batches(step, shape, rank)
        flat = [g for mb in mbs for g in mb]
        rows = reader.rows(stream_to_rows(flat, reader.num_samples, job.data.seed))
        return StepBatch(step, np.split(rows, len(mbs)), flat)

    ckpt = Checkpointer(store, local_root, rank, world, attempt=f"{attempt}")

    def record_commits() -> None:
        """Send the checkpoints committed since the last call (fire-and-forget, in order)."""
        if ckpt.committed:
            sink.log.remote([{"kind": "checkpoint", "attempt": attempt, **c} for c in ckpt.pop_committed()])
    prefetch = Prefetcher(make, start_step, t.steps, depth=job.data.prefetch)
    device = engine.device
    vocab = model.cfg.vocab_size
    events: list[dict] = []
    last_grow_check, grow_every = time.monotonic(), t.resize_check_s
    per_worker = {job.cluster.gpu_resource: job.cluster.gpus_per_worker, "CPU": job.cluster.cpus_per_worker}
    grow_check = GrowCheck(per_worker, t.max_workers)
    tokens_per_step = t.global_batch * reader.seq_len
    try:
        for step in range(start_step, t.steps):
            ts = time.perf_counter()
            batch = prefetch.get(step)
            td = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)   # no host sync per micro-batch
            for mb in batch.micro_batches:
                x = torch.from_numpy(mb[:, :-1]).to(device)
                y = torch.from_numpy(mb[:, 1:]).to(device)
                logits = engine(x)
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().double()
            preempt = local_preemption_info()
            grow = 0
            if (rank == 0 and t.elastic_restarts == "spotfill" and world < t.max_workers
                    and time.monotonic() - last_grow_check > grow_every):
                last_grow_check = time.monotonic()
                grow = grow_check.extra_workers(world, time.monotonic())
            flags = torch.tensor([0.0, 1.0 if preempt else 0.0, float(grow)], dtype=torch.float64, device=device)
            flags[0] = loss_sum / shape.accum
            comms.dist.all_reduce(flags)
            loss_total, preempt_votes, grow_votes = flags.tolist()   # the step's one host sync
            tc = time.perf_counter()
            done = step + 1
            emergency, grow_now = preempt_votes > 0, grow_votes > 0
            events.append({"t": time.time(), "kind": "samples", "attempt": attempt, "step": step,
                           "rank": rank, "ids": batch.stream_indices})
            if rank == 0:
                # Sent now (fire-and-forget, ordered): a step is on record even if the node dies next,
                # and always before a checkpoint that contains it commits.
                sink.log.remote([{"t": time.time(), "kind": "step", "step": done, "attempt": attempt,
                                  "loss": loss_total / world, "world_size": world,
                                  "tokens": tokens_per_step, "lr": engine.get_lr()[0],
                                  "step_s": tc - ts, "data_wait_s": td - ts, "compute_s": tc - td}])
            if emergency or grow_now or done % t.checkpoint_every == 0 or done == t.steps:
                ray.get(sink.log.remote(events))          # sample records land before the commit
                events = []
                sync = emergency or grow_now or done == t.steps
                stall = ckpt.save(engine, done, {"attempt": attempt}, sync=sync)
                if rank == 0:  # sent now, like steps: a hard loss during the upload must find it on record
                    sink.log.remote([{"t": time.time(), "kind": "checkpoint_save", "attempt": attempt,
                                      "emergency": emergency, "grow": grow_now, **stall,
                                      "deadline_ms": getattr(preempt, "deadline_ms", None)}])
            if rank == 0:  # commits too go on record at once (a kill may come next)
                record_commits()
            if len(events) >= 32:
                sink.log.remote(events)
                events = []
            if emergency or grow_now:
                if rank == 0:
                    ray.get(sink.planned_exit.remote("preemption" if emergency else "grow", step=done,
                                                     world_size=world))
                raise PlannedExit(f"{'preemption notice' if emergency else 'capacity for more workers'}"
                                  f" at step {done}: checkpoint committed; restarting the worker group")
        ckpt.uploader.wait()
        if rank == 0:
            record_commits()
    finally:
        prefetch.close()
        if events:
            ray.get(sink.log.remote(events))
        ckpt.close(wait=False)
    if rank == 0:
        ray.get(sink.finish.remote({"ok": True, "steps_completed": t.steps, "attempt": attempt}))

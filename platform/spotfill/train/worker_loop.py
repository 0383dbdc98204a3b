"""The Ray Train worker loop: one DeepSpeed engine per worker, elastic and preemption-aware.

The loop is an executor. After each step it gathers the step's facts -- its loss, whether this rank holds
a preemption notice (and its deadline), whether more workers fit (rank 0 asks every resize_check_s) -- in
the step's one collective, so every rank sees every rank's facts; it asks the pure StepPolicy
(step_policy.py) what to do, and applies the decision: continue, a periodic checkpoint, a checkpoint and a
planned exit (Ray Train restarts the group at the size the cluster now holds), or the final save.

Every optimizer step consumes the stream positions [step*G, (step+1)*G) whatever the world size; each rank
takes its slice as micro-batches (batching.py). Every rank records the positions it actually fed, as the
row ids stored in the shards say (feed.py: a read that is not what the schedule owes fails the job with one
line); at each checkpoint the ranks' records are combined into the exactly-once ledger (sample_ledger.py),
which travels in the checkpoint with the model state and the identity of the data it counts.
"""
from __future__ import annotations

import collections
import logging
import os
import time

from spotfill.config import constants
from spotfill.config.errors import DataMismatch, NoIntactCheckpoint, WriterFenced
from spotfill.config.job import JobConfig, from_mapping
from spotfill.ray_compat import draining_node_ids, local_preemption_info, usable
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore
from spotfill.storage.fence import WriterFence
from spotfill.config.batching import BatchShape, batch_shape
from spotfill.train.checkpointing import Checkpointer, checkpoint_events
from spotfill.train.data import Prefetcher, ShardReader
from spotfill.train.engine import build_engine, ds_config, load_checkpoint, resolve_precision
from spotfill.train.restore import restore_on_workers
from spotfill.train.model_card import for_checkpoints
from spotfill.train.feed import DATA_KEY, LEDGER_KEY, StepFeed, data_identity, resume_point
from spotfill.train.sample_ledger import FeedRecorder, SampleLedger
from spotfill.train.notice_watch import DrainWatch, PlannedExit, StartNotice, either
from spotfill.train.step_policy import CONTINUE, FINISH, StepDecision, StepFacts, StepPolicy
from spotfill.telemetry.process import process_start_time
from spotfill.telemetry.throughput import split_step, step_metrics
from spotfill.train.spare_workers import prestart_spares, spares_to_ask, warm_state

log = logging.getLogger(__name__)

# Rank 0 sends step events at most this often (and before every save or exit, so a step is on record
# before any checkpoint containing it): one actor call per step was the loop's largest fixed cost on a
# small model. A hard loss can leave up to this much of the newest steps off the record.
STEP_EVENTS_FLUSH_S = 0.25
NVML_EVERY_S = 2.0              # rank 0 reads its GPU's NVML utilisation and memory at most this often
_F_LOSS, _F_PREEMPT, _F_DEADLINE, _F_GROW = range(4)
_F_FENCED = -1                  # last: after the step's values (a pipeline's, read at 4 + i)


class _Comms:
    """Tiny helpers over torch.distributed (already initialised by Ray Train's TorchConfig)."""

    def __init__(self, world: int):
        import torch
        import torch.distributed as dist
        self.dist, self.torch, self.world = dist, torch, world
        self._gathered: list | None = None

    # A world of one rank has no peer to exchange with: each collective returns its own value (a gloo
    # all_gather at world size 1 cost 0.11 ms of a 25 ms tiny-model step).
    def bcast(self, obj):
        if self.world == 1:
            return obj
        buf = [obj]
        self.dist.broadcast_object_list(buf, src=0)
        return buf[0]

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()

    def gather_flags(self, flags) -> list[list[float]]:
        """Every rank's flags row; the step's one collective and its one host sync."""
        if self.world == 1:
            return [flags.tolist()]
        if self._gathered is None or self._gathered[0].shape != flags.shape:   # a pipeline's rows are longer
            self._gathered = [self.torch.empty_like(flags) for _ in range(self.world)]
        self.dist.all_gather(self._gathered, flags)
        return self.torch.stack(self._gathered).tolist()

    def gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


def train_loop_per_worker(loop_config: dict) -> None:
    import ray
    import ray.train
    import torch

    job: JobConfig = from_mapping(JobConfig, loop_config["job"])
    t = job.training
    sink = ray.get_actor(loop_config["sink"], namespace=loop_config["namespace"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    t_start = time.time()
    comms = _Comms(world)
    from spotfill.train.warm import withdraw
    withdraw()          # this process is the group's now, no spare: its readiness record goes (train.readiness)
    # per rank: its node, its process's start (before the restart: a warm spare) and the GPUs Ray assigned it
    # -- summed, the group's GPUs in the attempt event: the ledger and goodput count them, not the plan
    placed = comms.gather_objects((node_id, process_start_time(), _assigned_gpus(job.cluster.gpu_resource),
                                   warm_state()))
    # rank 0 reads its group's drains itself from here on (Ray Train's watcher may start seconds later); the
    # thread ends with this process (Ray Train ends the group's actors with the attempt): train.notice_watch
    watch = (DrainWatch({p[0] for p in placed}, draining_node_ids, constants.DRAIN_POLL_S)
             if rank == 0 and t.elastic_restarts == "spotfill" and usable("drain_aware_restarts") else None)
    notice = either(lambda: local_preemption_info(), watch)
    info = comms.bcast(ray.get(sink.begin_attempt.remote(world, gpus=sum(p[2] for p in placed)))
                       if rank == 0 else None)
    if info["give_up"]:
        return _finish(sink, rank, {"ok": False, "reason": info.get("reason") or f"{info['unplanned_failures']} "
                                    f"unplanned failures exceed training.max_failures={t.max_failures}"})
    attempt = info["attempt"]
    # a notice that reaches the group while it starts: looked at at each phase boundary (train.notice_watch)
    start = StartNotice(StepPolicy(t.steps, t.checkpoint_every, margin_s=constants.EMERGENCY_MARGIN_S),
                        notice, comms.gather_objects, rank, t_start)
    start.check("placed", 0, sink)
    store = CheckpointStore(open_storage(job.storage).child(job.name), keep_last=t.keep_checkpoints)
    local_root = node_local_root(job.name, node_id)
    node_dir = os.path.join(local_root, "restore")
    warm = _warm_imports()      # DeepSpeed and torch._dynamo load while the checkpoint downloads
    t0 = time.perf_counter()
    try:
        _take_generation(store, comms, rank, sink, attempt)
        plan = restore_on_workers(store, comms, rank, world, node_id, node_dir, t.zero_stage,
                                  stages=t.pipeline_stages, local_root=local_root,
                                  on_no_intact=t.on_no_intact_checkpoint,
                                  emit=lambda kind, **f: sink.event.remote(kind, attempt=attempt, **f))
    except NoIntactCheckpoint as exc:
        return _finish(sink, rank, {"ok": False, "reason": str(exc)})
    except WriterFenced as exc:
        return _fenced(sink, rank, attempt, [exc.record()])
    prep_s = time.perf_counter() - t0
    start.check("restored", plan.step, sink)
    pipe = _pipeline(job, world, rank, plan.stages, node_id,    # None without pipeline stages
                     loop_config.get("bubble_filler"))
    shape = pipe.shape if pipe else batch_shape(t.global_batch, world, t.max_micro_batch)

    # the device Ray Train assigned this worker (Ray's GPU resource -> CUDA_VISIBLE_DEVICES; the CPU where
    # CUDA sees none, or on a logical resource), and the precision that device supports (spotfill.devices)
    device = _assigned_device(job.cluster.gpu_resource)
    precision = resolve_precision(t.precision, device)
    torch.manual_seed(t.seed)
    try:
        reader = ShardReader(open_storage(job.data.path), cache_dir=os.path.join(local_root, "data"))
        t_restored = time.time()
        warm.join()
        t_imported = time.time()
        engine, vocab, flops = (pipe.build_engine(job, reader.seq_len, reader.manifest["vocab_size"], precision,
                                                  plan.universal, device) if pipe else
                                _engine(job, reader, shape, precision, plan.universal, device))
        t_engine = time.time()
        start.check("engine built", plan.step, sink, on_leave=pipe.close if pipe else None)
        device = _device_info(engine, precision) if rank == 0 else {}
        client_state, load_s = None, 0.0
        if plan.tag:
            t1 = time.perf_counter()
            client_state = load_checkpoint(engine, plan.load_dir, plan.load_tag, plan.elastic)
            load_s = time.perf_counter() - t1
        start_event = {} if rank else dict(
            attempt=attempt, world_size=world, micro_batch=shape.micro_batch, accum=shape.accum,
            from_world_size=plan.world_size or None, universal=plan.universal, zero_elastic=plan.elastic,
            restore_prep_s=round(prep_s, 3), load_s=round(load_s, 3), **plan.timings,
            startup_s=round(time.time() - t_start, 3), pid=os.getpid(), precision=precision, **flops, **device,
            workers=[[n, round(started, 3) if started else None] for n, started, *_ in placed],
            workers_warm=[p[3] for p in placed],
            **(pipe.start_fields() if pipe else {}), **_start_marks(t_start, t_restored, t_imported, t_engine))
        card, card_files = for_checkpoints(t.model, reader.manifest, rank)    # checkpoints carry their model
        ckpt = Checkpointer(store, local_root, rank, world, attempt=f"{attempt}",
                            meta={**(pipe.checkpoint_meta() if pipe else {}), "model": card}, part_files=card_files)
        try:
            verdict = run_attempt(job, sink, comms, engine, reader, ckpt, rank=rank, world=world, attempt=attempt,
                                  shape=shape, vocab=vocab, flops=flops, device=device, client_state=client_state,
                                  start_event=start_event, pipe=pipe, notice=notice,
                                  group=collections.Counter(n for n, *_ in placed),
                                  spares_here=spares_to_ask(job, rank, node_id, [p[0] for p in placed]))
        finally:
            if pipe:
                pipe.close()
    except DataMismatch as exc:
        # A restart would read the same data: the sink ends the job with this line at the next attempt
        ray.get(sink.data_mismatch.remote(str(exc), rank=rank, attempt=attempt))
        raise
    _finish(sink, rank, verdict)


def run_attempt(job: JobConfig, sink, comms, engine, reader: ShardReader, ckpt, *, rank: int, world: int,
                attempt: int, shape: BatchShape, vocab: int, flops: dict, device: dict, client_state: dict | None,
                start_event: dict, pipe=None, group: dict | None = None, notice=None,
                spares_here: int | None = None) -> dict:
    """One attempt's steps, from the state its checkpoint gave (`client_state`; None: a fresh start) to the
    last step or a planned exit (PlannedExit): the data path (feed.py: rows read, checked against the
    schedule, their positions recorded in the ledger) and the executor; `pipe` (train/pipeline.py) runs the
    step through DeepSpeed's pipeline engine and owes the replica's positions. Needs no Ray: tests drive it with a
    stand-in engine, sink and checkpointer on real shards (tests/unit/test_worker_steps.py)."""
    t = job.training
    identity = data_identity(reader, job.data.seed)
    start_step, ledger, data_check = resume_point(client_state, identity)
    if rank == 0:
        sink.event.remote("resume" if client_state is not None else "start", step=start_step,
                          data_check=data_check, **start_event)

    # Spares for the next group, after this group's first step (which ends a start or a recovery: the
    # spares' imports must not share the CPUs with it). They warm up in SCHED_IDLE (train.spares), on CPU
    # time the steps leave unused, once per node and group.
    spares = t.elastic_restarts == "spotfill" and constants.WARM_SPARES > 0
    spare_step = start_step + 1

    run = _Executor(job, sink, comms, engine, rank, world, attempt, ledger, ckpt, data=identity,
                    group=group, notice=notice)
    prefetch = Prefetcher(StepFeed(reader, shape, rank, job.data.seed, positions=pipe.positions if pipe else None),
                          start_step, t.steps,
                          depth=job.data.prefetch)
    tokens_per_step = t.global_batch * reader.seq_len
    gpus = world * job.cluster.gpus_per_worker
    timer = run.timer        # rank 0 only (None elsewhere): phases of the step
    try:
        early = run.policy.before_first_step(run.gather(start_step, 0.0)[0])   # a notice while it started
        if early is not None:
            run.apply(early, start_step)
        for step in range(start_step, t.steps):
            ts = time.perf_counter()
            batch = prefetch.get(step)
            td = time.perf_counter()
            if pipe:
                loss_mean = pipe.train_step(engine, batch.micro_batches)
            else:
                loss_mean = _train_step(engine, batch.micro_batches, vocab, timer) / shape.accum
            if pipe is None or pipe.records_feeds:
                run.recorder.record(batch.fed)      # the positions the rows fed are, by the ids stored in them
            facts, loss = run.gather(step + 1, loss_mean, pipe.step_values() if pipe else ())
            if run.fenced:      # a newer writer took the checkpoint store: this attempt is stale and stops
                break
            tc = time.perf_counter()
            if rank == 0:
                split = split_step(tc - ts, td - ts, *(pipe.split() if pipe else timer.read()))
                run.step_event({"t": time.time(), "kind": "step", "step": step + 1, "attempt": attempt,
                                "loss": loss / world, "world_size": world, "tokens": tokens_per_step,
                                "lr": engine.get_lr()[0], **split.as_event(),
                                **step_metrics(tokens_per_step, split, gpus, flops["flops_per_token"],
                                               flops["hardware_flops_per_token"], device["peak_flops_per_gpu"]),
                                **run.gpu_sample(), **(pipe.step_fields(run.rows) if pipe else {})})
            if spares and step + 1 == spare_step:
                prestart_spares(constants.WARM_SPARES if spares_here is None else spares_here)
            decision = run.policy.decide(facts)
            run.apply(decision, step + 1)
            if decision.action == FINISH:
                run.finished = True
                break
    except WriterFenced as exc:     # a final, grow or emergency save refused
        log.warning("rank %d stops: %s", rank, exc)
        run.fenced = True       # rank 0's checkpointer recorded the refusal; run.close() reports it
    finally:
        prefetch.close()
        run.close()
    if run.fenced:
        return fenced_verdict(attempt)
    return {"ok": True, "steps_completed": t.steps, "attempt": attempt}


def _take_generation(store: CheckpointStore, comms: _Comms, rank: int, sink, attempt: int) -> None:
    """Rank 0 takes this attempt's writer generation before it restores (storage/fence.py); every rank's
    store holds it, so a rank waiting for rank 0's commit notices when a newer writer took the store."""
    from spotfill.storage.fence import Generation

    if rank == 0:
        fence = store.take_generation(attempt=attempt)
        sink.event.remote("writer_generation", attempt=attempt, generation=str(fence.generation),
                          mechanism=fence.mechanism)
    held = comms.bcast((str(store.fence.generation), store.fence.mechanism) if rank == 0 else None)
    if rank != 0:
        store.fence = WriterFence(store.storage, store.prefix, Generation.parse(held[0]), held[1], {"attempt": attempt})


def fenced_verdict(attempt: int) -> dict:
    """The verdict of an attempt whose checkpoint writes were refused: a newer writer took the store. It
    stops without a restart (a restart would take a newer generation and fence the live writer in turn)."""
    return {"ok": False, "fenced": True, "attempt": attempt, "reason": "a newer writer took the checkpoint "
            "store (writer generation fenced); this attempt stopped writing and exited"}


def _fenced(sink, rank: int, attempt: int, refused: list[dict]) -> None:
    """Report the restore's refused writes (rank 0) and stop this attempt (fenced_verdict)."""
    if rank == 0:
        sink.log.remote([{**r, "t": r.get("t", time.time()), "kind": "checkpoint_fenced", "attempt": attempt}
                         for r in refused])
    _finish(sink, rank, fenced_verdict(attempt))


def node_local_root(job_name: str, node_id: str) -> str:
    """This node's folder for the job (restore staging, snapshots, data cache), shared by its workers only.
    Named by the whole node id: Ray's fake multi-node nodes (the autoscaled demo, one machine) share their
    first 51 hex digits, and a prefix made every node's restore leader clear the others' downloads."""
    return os.path.join(constants.LOCAL_DIR, job_name, f"node-{node_id}")


def _start_marks(entered: float, restored: float, imported: float, engine: float) -> dict:
    """When (unix s) this worker process started, entered the training function, finished the restore,
    had DeepSpeed imported and its engine built: the recovery breakdown splits worker start-up with them."""
    marks = {"loop_entered_t": round(entered, 3), "restored_t": round(restored, 3),
             "imported_t": round(imported, 3), "engine_t": round(engine, 3)}
    started = process_start_time()
    if started is not None:
        marks["process_started_t"] = round(started, 3)
    import torch

    from spotfill.train.spares import idle_threads
    from spotfill.train.warm import marks as warm_marks
    return {**marks, **warm_marks, "idle_threads": idle_threads(), "torch_threads": torch.get_num_threads()}


def _warm_imports():
    """Import what building the engine needs (DeepSpeed; torch._dynamo, which torch's optimizers load on
    first use) on a thread, so the imports overlap the restore's downloads and actor calls instead of
    following them. The thread is joined before the engine is built; an import error surfaces there."""
    import threading

    def load():
        import importlib

        from spotfill.ray_compat import DYNAMO_MODULE, skip_deepspeed_muon, skip_deepspeed_shm_comm
        skip_deepspeed_muon()
        import deepspeed  # noqa: F401
        skip_deepspeed_shm_comm()
        importlib.import_module(DYNAMO_MODULE)

    thread = threading.Thread(target=load, name="spotfill-warm-imports", daemon=True)
    thread.start()
    return thread


def _finish(sink, rank: int, verdict: dict) -> None:
    """Rank 0 hands the job's verdict to the sink; every rank returns."""
    if rank == 0:
        import ray
        ray.get(sink.finish.remote(verdict))


def _pipeline(job: JobConfig, world: int, rank: int, saved_stages: int, node_id: str, bubble_filler=None):
    """The pipeline path (train/pipeline.py) with training.pipeline_stages; with 1 stage too when the run's
    checkpoint was saved by a pipeline (its weights are per layer); None otherwise."""
    if job.training.pipeline_stages <= 1 and not saved_stages:
        return None
    from spotfill.train.pipeline import PipelineRun
    return PipelineRun(job, world, rank, node_id, bubble_filler=bubble_filler)


def _assigned_gpus(gpu_resource: str) -> float:
    """How much of the GPU resource (Ray's GPU, or a logical one such as GPU_SLOT) Ray assigned this worker."""
    import ray
    return float(ray.get_runtime_context().get_assigned_resources().get(gpu_resource, 0.0))


def _assigned_device(gpu_resource: str):
    """The device Ray Train assigned this worker (devices.choose_train_device)."""
    import torch

    from spotfill.devices import choose_train_device
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ray_device = None
    if gpu_resource == "GPU" and cuda:
        import ray.train.torch
        ray_device = str(ray.train.torch.get_device())
    return torch.device(choose_train_device(gpu_resource, cuda, ray_device))


def _engine(job: JobConfig, reader: ShardReader, shape: BatchShape, precision: str, universal: bool, device):
    from spotfill.train.model import build_model

    t = job.training
    model = build_model(t.model, seq_len=reader.seq_len, vocab_size=None if t.model.startswith("hf:")
                        else reader.manifest["vocab_size"], recompute=t.activation_checkpointing)
    config = ds_config(job, shape.micro_batch, shape.accum, precision, universal)
    from spotfill.train.model import flops_info

    # FLOPs per token at the trained sequence length: model FLOPs, and hardware FLOPs with the forward that
    # activation checkpointing runs again (HFU)
    flops = flops_info(model, reader.seq_len)
    return build_engine(model, config, device), model.cfg.vocab_size, flops


def _device_info(engine, precision: str) -> dict:
    from spotfill.train.step_timer import device_info
    return device_info(engine.device, precision)


def _train_step(engine, micro_batches, vocab: int, timer=None):
    """Forward, backward and step over the micro-batches; the summed loss stays on the device. `timer`
    (rank 0) marks each micro-batch's forward+backward and optimizer step."""
    import torch
    import torch.nn.functional as F

    device = engine.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)   # no host sync per micro-batch
    if timer is not None:
        timer.begin()
    for mb in micro_batches:
        if timer is not None:
            timer.mark()
        x = torch.from_numpy(mb[:, :-1]).to(device)
        y = torch.from_numpy(mb[:, 1:]).to(device)
        loss = F.cross_entropy(engine(x).float().reshape(-1, vocab), y.reshape(-1))
        engine.backward(loss)
        if timer is not None:
            timer.backward_done()
        engine.step()
        if timer is not None:
            timer.step_done()
        loss_sum += loss.detach().double()
    return loss_sum


class _Executor:
    """Gathers a step's facts and applies the policy's decisions for one rank of one attempt."""

    def __init__(self, job: JobConfig, sink, comms: _Comms, engine, rank: int, world: int, attempt: int,
                 ledger: SampleLedger, ckpt: Checkpointer, data: dict | None = None, group: dict | None = None,
                 notice=None):
        t = job.training
        self.notice = notice or (lambda: local_preemption_info())   # this rank's notice (train.notice_watch)
        self.data = data         # what the ledger's positions refer to (feed.data_identity), saved with it
        self.sink, self.comms, self.engine, self.ckpt = sink, comms, engine, ckpt
        self.rank, self.world, self.attempt, self.global_batch = rank, world, attempt, t.global_batch
        # one margin before a notice's deadline: the checkpointer's (its budget and the policy's agree)
        self.policy = StepPolicy(t.steps, t.checkpoint_every, margin_s=constants.EMERGENCY_MARGIN_S)
        self.ledger, self.recorder = ledger, FeedRecorder()
        self.flags = comms.torch.zeros(5, dtype=comms.torch.float64, device=engine.device)
        self.rows: list[list[float]] = []     # the last step's gathered rows (every rank's flags and values)
        self.fenced = False          # some rank's write was refused: a newer writer took the store
        self.finished = False        # the final checkpoint is committed: no restore will follow
        self._grow = None
        if rank == 0 and t.elastic_restarts == "spotfill" and world < t.max_workers:
            from spotfill.train.elastic import GrowCheck
            self._grow = GrowCheck({job.cluster.gpu_resource: job.cluster.gpus_per_worker,
                                    "CPU": job.cluster.cpus_per_worker}, t.max_workers,
                                   multiple=t.pipeline_stages, group=group, check_every_s=t.resize_check_s)
        self._grow_every, self._last_grow = t.resize_check_s, time.monotonic()
        self._steps: list[dict] = []
        self._steps_sent = time.monotonic()
        self.timer, self._gpu, self._gpu_next = None, None, 0.0
        if rank == 0:
            from spotfill.train.step_timer import make_timer
            self.timer = make_timer(engine.device)
            if getattr(engine.device, "type", "") == "cuda":
                from spotfill.telemetry.nvml import GpuSampler
                uuid = getattr(comms.torch.cuda.get_device_properties(engine.device), "uuid", None)
                self._gpu = GpuSampler.open(uuid=str(uuid) if uuid else None)

    def gpu_sample(self) -> dict:
        """Rank 0's NVML reading, at most every NVML_EVERY_S ({} without NVML or off a GPU)."""
        if self._gpu is None or time.monotonic() < self._gpu_next:
            return {}
        self._gpu_next = time.monotonic() + NVML_EVERY_S
        return self._gpu.sample() or {}

    def step_event(self, event: dict) -> None:
        """Rank 0: queue a step event; send the queue every STEP_EVENTS_FLUSH_S (fire-and-forget, ordered)."""
        self._steps.append(event)
        if time.monotonic() - self._steps_sent >= STEP_EVENTS_FLUSH_S:
            self._flush_steps()

    def _flush_steps(self) -> None:
        if self._steps:
            self.sink.log.remote(self._steps)
            self._steps = []
        self._steps_sent = time.monotonic()

    def gather(self, done: int, loss, values=()) -> tuple[StepFacts, float]:
        """The step's one collective: every rank's loss, preemption notice (deadline) and grow count,
        `values` (e.g. a pipeline stage's bubble seconds) after them in `self.rows`, and last whether its
        checkpoint writes were refused (a newer writer took the store)."""
        notice = self.notice()
        deadline_ms = getattr(notice, "deadline_ms", None) if notice is not None else None
        if len(self.flags) != _F_GROW + 2 + len(values):
            self.flags = self.comms.torch.zeros(_F_GROW + 2 + len(values), dtype=self.flags.dtype,
                                                device=self.flags.device)
        f = self.flags
        for i, v in enumerate(values):
            f[_F_GROW + 1 + i] = v
        f[_F_LOSS] = loss
        f[_F_PREEMPT] = 1.0 if notice is not None else 0.0
        f[_F_DEADLINE] = deadline_ms / 1000.0 if deadline_ms else 0.0
        f[_F_GROW] = self._grow_workers()
        f[_F_FENCED] = 1.0 if self.ckpt.stale else 0.0
        rows = self.rows = self.comms.gather_flags(f)
        self.fenced = self.fenced or any(r[_F_FENCED] for r in rows)
        deadlines = [r[_F_DEADLINE] for r in rows if r[_F_PREEMPT] and r[_F_DEADLINE] > 0]
        return StepFacts(done=done, now=time.time(), preempt_votes=int(sum(r[_F_PREEMPT] for r in rows)),
                         deadline_unix_s=min(deadlines) if deadlines else None,
                         grow_workers=int(max(r[_F_GROW] for r in rows)),
                         upload_in_flight=self.ckpt.uploader.busy), sum(r[_F_LOSS] for r in rows)

    def _grow_workers(self) -> int:
        if self._grow is None or time.monotonic() - self._last_grow < self._grow_every:
            return 0
        self._last_grow = time.monotonic()
        extra = self._grow.extra_workers(self.world, self._last_grow)
        said = self._grow.news()            # a new reason to wait (warming spares), once: into the events
        if said:
            self.sink.event.remote("grow_waiting", attempt=self.attempt, world_size=self.world, reason=said)
        return extra

    def apply(self, d: StepDecision, done: int) -> None:
        """Save, record commits (rank 0: a kill may come next) and leave, as `d` says."""
        if self.rank == 0 and d.action != CONTINUE:
            self._flush_steps()                 # the steps land before the save and commit that hold them
        if d.saves:
            self._save(d, done)
        if self.rank == 0:
            self._record_checkpoints()
        if d.leaves:
            if self.rank == 0:
                import ray
                grown = self._grow.exit_fields() if (self._grow and d.reason == "grow") else {}
                ray.get(self.sink.planned_exit.remote(d.reason, step=done, world_size=self.world,
                                                      detail=d.detail, budget_s=d.budget_s, **grown))
            raise PlannedExit(f"{d.reason} at step {done} ({d.detail}); restarting the worker group")

    def _save(self, d: StepDecision, done: int) -> None:
        """Fold every rank's feeds since the last checkpoint into the ledger (one collective), then save
        the ledger with the model state."""
        self.ledger = self.ledger.with_fed(*self.comms.gather_objects(self.recorder.take()))
        state = {"attempt": self.attempt, LEDGER_KEY: self.ledger.to_state(),
                 **({DATA_KEY: self.data} if self.data is not None else {})}
        out = self.ckpt.save(self.engine, done, state, kind=d.save_kind, deadline_unix_s=d.notice_deadline_unix_s)
        if self.rank == 0:  # sent now: a hard loss during the upload must find it on record
            summary = self.ledger.summary(owed=done * self.global_batch)
            self.sink.log.remote([{
                "t": time.time(), "kind": "checkpoint_save", "attempt": self.attempt, "step": done,
                "save_kind": out["kind"], "reason": out.get("reason") or d.reason, "decision": d.reason,
                "detail": d.detail, "emergency": d.save_kind == "emergency", "grow": d.save_kind == "grow",
                "tag": out["tag"], "path": out["path"], "committed": out["committed"],
                "budget_s": d.budget_s, "save_deadline_unix_s": d.save_deadline_unix_s,
                "ledger": {"consumed": summary.consumed, "duplicates": summary.duplicates,
                           "missing": summary.missing, "owed": summary.owed},
                **{k: out[k] for k in ("snapshot_s", "blocked_s", "wait_s", "stall_s")}}])

    def _record_checkpoints(self) -> None:
        """Send the checkpoints committed, skipped or refused since the last call (fire-and-forget, in order)."""
        events = checkpoint_events(self.ckpt, self.attempt)
        if events:
            self.sink.log.remote(events)

    def close(self) -> None:
        if self.rank == 0:
            self._flush_steps()
            self._record_checkpoints()
        self.ckpt.close(wait=False, keep_snapshot=not self.finished)

"""The Generator deployment of spotfill's Serve app (spotfill/serving/app.py): one lent GPU each (Ray's
`gpu_resource`); it loads the run's newest committed checkpoint onto the device Ray assigned -- or takes
the model a warm standby holds (spotfill/serving/standby.py) -- hot-reloads newer ones, and runs
spotfill/generation's engine: KV-cached continuous batching, optional speculative decoding (`draft`). The
floor deployment (GeneratorFloor) runs the same class on capacity the app owns."""

import collections
import logging
import tempfile
import threading
import time

from ray import serve

from spotfill.serving.args import ServeArgs

log = logging.getLogger("spotfill.serving")
GENERATOR = "Generator"
MODEL_ID = "spotfill"
GRACEFUL = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 3.0}
NO_CHECKPOINT, NO_CHECKPOINT_REASON = "no_checkpoint", "no committed checkpoint yet"


def _metric(kind: str, name: str, description: str, tags: tuple[str, ...] = (), **kw):
    from ray.util import metrics
    return getattr(metrics, kind)(name, description=description, tag_keys=tags, **kw)


@serve.deployment(name=GENERATOR, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64, **GRACEFUL)
class Generator:
    def __init__(self, args: ServeArgs, floor: bool = False):
        t_init = time.time()
        from spotfill.fillin.cpu_priority import lower_cpu_priority
        lower_cpu_priority(args.cpu_nice, idle=args.cpu_idle)    # fill-in: the CPU time training leaves
        from spotfill.generation.replica import replica_device
        from spotfill.storage.base import open_storage
        from spotfill.storage.checkpoint_store import CheckpointStore

        self.args, self.floor = args, floor
        self.device, self.dtype = replica_device()             # what Ray assigned: cuda:0, or the CPU
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        # busy time for the fill-in ledger: each engine step is the lent GPU computing (fillin/busy.py); a
        # floor replica computes on capacity the app owns, which is no fill-in and reports nothing
        from spotfill.fillin.busy import serve_reporter
        self.busy_meter = None if floor else serve_reporter(ctx.app_name, GENERATOR, gpu_resource=args.gpu_resource)
        self.store = CheckpointStore(open_storage(args.checkpoint))
        self.work = tempfile.mkdtemp(prefix="spotfill-serve-")
        self.loaded, self.engine, self.draft_loaded = None, None, None
        self.draining: list = []                               # engines of older checkpoints, finishing
        self.holding = collections.Counter()                   # engine -> stream() calls that took it
        self.lock = threading.Lock()
        self.reloads: list[dict] = []
        self.metrics = {
            "tokens": _metric("Counter", "spotfill_serve_generated_tokens", "tokens generated"),
            "drafted": _metric("Counter", "spotfill_serve_spec_drafted_tokens", "tokens a draft proposed"),
            "accepted": _metric("Counter", "spotfill_serve_spec_accepted_tokens", "drafted tokens accepted"),
            "accepted_length": _metric("Histogram", "spotfill_serve_spec_accepted_length",
                                       "tokens per verify step, per request", boundaries=[1, 1.5, 2, 3, 4, 6, 9]),
            "acceptance": _metric("Gauge", "spotfill_serve_spec_acceptance_rate",
                                  "accepted / drafted tokens of the last finished request with a draft")}
        from spotfill.serving.standby import take
        standby = None if floor else take(ctx.app_name, args.checkpoint)     # a warm standby's process?
        self._reload(standby)
        self._report_start(t_init, standby)
        threading.Thread(target=self._watch, daemon=True, name="checkpoint-reload").start()

    def _report_start(self, t_init: float, standby: dict | None) -> None:
        """How this lent replica started, to the arbiter's journal (serving/standby.start_event)."""
        if self.busy_meter is not None:
            from spotfill.serving.standby import start_event
            event = start_event(f"serve:{serve.get_replica_context().app_name}/{GENERATOR}", self.busy_meter.meter,
                                t_init, standby, self.reloads[0] if self.reloads else {})
            self.busy_meter.send([event])

    def _reload(self, standby: dict | None = None) -> None:
        from spotfill.fillin.generate import load_newest
        from spotfill.generation.replica import build_engine
        spec = self.args.draft_spec
        wake_s = None
        try:
            if standby is not None and standby.get("loaded") is not None:
                new, t0 = standby["loaded"], time.perf_counter()
                new.model.to(device=self.device, dtype=self.dtype)       # wake: the weights to the device
                wake_s = round(time.perf_counter() - t0, 3)
            else:
                new = load_newest(self.store, self.work, self.args.model, newer_than=self.loaded.tag
                                  if self.loaded else None, device=self.device, dtype=self.dtype)
            if new is None:
                return
            draft_model = None
            if spec.kind == "uri":
                from spotfill.storage.base import open_storage
                from spotfill.storage.checkpoint_store import CheckpointStore
                self.draft_loaded = load_newest(CheckpointStore(open_storage(spec.uri)), self.work, "auto",
                                                device=self.device, dtype=self.dtype)
                draft_model = self.draft_loaded.model
            engine = build_engine(new.model, spec, draft_model, self.args.num_draft_tokens,
                                  self.args.max_batch, meter=self.busy_meter, tokenizer=new.tokenizer).start()
        except Exception as exc:  # noqa: BLE001 - keep serving the model we have
            log.warning("checkpoint reload failed, keeping %s: %s", self.loaded and self.loaded.tag, exc)
            if self.loaded is None and type(exc).__name__ == "ConfigError":
                raise                                         # a draft that cannot fit this model: at start
            return
        old, old_engine = (self.loaded.tag if self.loaded else None), self.engine
        with self.lock:
            self.loaded, self.engine = new, engine
            if old_engine is not None:
                self.draining.append(old_engine)              # its requests finish on the weights they began
        self.reloads.append({"tag": new.tag, "step": new.step, "load_s": round(new.load_s, 3), "from": old,
                             "wake_s": wake_s})
        log.info("serving checkpoint %s (step %d) on %s (%s), loaded in %.2fs (was %s)", new.tag, new.step,
                 self.device, self.dtype, new.load_s, old)

    def _watch(self) -> None:
        while True:
            time.sleep(self.args.reload_s)
            if self.busy_meter is not None:
                self.busy_meter.flush()     # what an engine measured before it went idle (no-op when nothing)
            self._reload()
            with self.lock:       # not one a stream() took and has not submitted to yet (busy 0 there)
                for eng in [e for e in self.draining if not e.busy and not self.holding[e]]:
                    eng.stop()
                    self.draining.remove(eng)

    def __del__(self):
        """Serve stops this replica (its GPU reclaimed, or scaled down): the busy time not sent yet goes now."""
        busy = getattr(self, "busy_meter", None)
        if busy is not None:
            busy.flush()

    def info(self) -> dict:
        m = self.loaded
        out = {"replica": self.replica, "floor": self.floor, "device": str(self.device),
               "dtype": str(self.dtype).replace("torch.", ""),
               "draft": str(self.args.draft_spec) or None, "reloads": self.reloads[-10:]}
        out["busy"] = self.engine.busy if self.engine is not None else 0
        if m is None:
            return {**out, "tag": None}
        return {**out, "tag": m.tag, "step": m.step, "load_s": round(m.load_s, 3), "loaded_at": m.loaded_at,
                "context": m.model.cfg.seq_len}

    def _finished(self, update) -> None:
        # Ray's Counter.inc refuses 0: a request may end with no token, a draft may have every token rejected
        for name, value in (("tokens", update.completion_tokens), ("drafted", update.drafted),
                            ("accepted", update.accepted)):
            if value > 0:
                self.metrics[name].inc(value)
        if update.verify_steps:
            self.metrics["acceptance"].set(update.accepted / max(1, update.drafted))
            self.metrics["accepted_length"].observe((update.accepted + update.verify_steps) / update.verify_steps)

    async def stream(self, job: dict):
        """A job's chunks (spotfill/generation/relay.py): admitted, then the engine's updates."""
        from spotfill.generation.replica import job_request, stream_job
        with self.lock:
            loaded, engine = self.loaded, self.engine
            if loaded is not None:
                self.holding[engine] += 1      # a reload now drains it, but stops it only once we let go
        if loaded is None:
            yield {"error": NO_CHECKPOINT_REASON, "code": NO_CHECKPOINT}
            return
        try:
            req = job_request(job, engine.tokenizer, loaded.model.cfg.seq_len)
            if self.args.max_tokens:
                from dataclasses import replace
                req.params = replace(req.params, max_tokens=min(req.params.max_tokens, self.args.max_tokens))
            yield {"admitted": True, "replica": self.replica, "floor": self.floor, "model": MODEL_ID,
                   "checkpoint": {"tag": loaded.tag, "step": loaded.step}}
            async for chunk in stream_job(engine, req, on_finish=self._finished):
                yield chunk
        finally:
            with self.lock:
                self.holding[engine] -= 1
                if self.holding[engine] <= 0:
                    del self.holding[engine]

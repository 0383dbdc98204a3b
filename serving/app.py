"""Ray Serve fill-in application: text generation from a run's newest committed checkpoint.

    serve run serving.app:app checkpoint=file:///runs/demo        # one replica, for a first look
    serve deploy serving/config.yaml                             # replicas set by the fill-in arbiter
    spotfill serve --checkpoint file:///runs/demo --port 8000    # a local embedded cluster + arbiter

Two deployments:
  * Ingress (CPU only, on the head node, always up): the HTTP routes -- `POST /v1/completions`
    (OpenAI-compatible), `GET /v1/models`, `POST /generate` (plain JSON), `GET /healthz`. It watches how
    many Generator replicas run; with none (their GPUs went back to training) a request gets HTTP 503 with
    `Retry-After` at once instead of queueing in Serve's router. A forwarded request that no replica has
    picked up when none runs any more is cancelled and also answered 503 (it was never admitted).
  * Generator (one lent GPU each, `gpu_resource`): loads the newest committed checkpoint, hot-reloads newer
    ones, and generates at most `max_tokens` tokens and for at most `max_generation_s`, so a request in
    flight when its replica is reclaimed finishes within the graceful-shutdown grace.

The application is deployed with `external_scaler_enabled`: the arbiter sets the Generator's replica count
through Serve's scale endpoint (spotfill/fillin/serve_tenant.py).
"""

import asyncio
import logging
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from spotfill import ray_compat     # light: each private hook loads when first used
from spotfill.config.errors import ConfigError

log = logging.getLogger("spotfill.serving")
APP_NAME = "spotfill-serve"
GENERATOR = "Generator"
GRACEFUL = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 3.0}
# running-request metrics from the replicas, not the Ingress's handle: a stopping replica's requests in
# flight are not counted as load with no replica running
NO_HANDLE_METRICS = {"RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE": "0"}
# Serve's replicas and routers export their cached request metrics every 0.1 s by default (a timer in every
# replica, all day, lent GPUs or not): once a second is enough for the dashboards (Ray 2.60:
# serve/_private/replica.py, router.py _report_cached_metrics_forever)
QUIET_METRICS = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# a replica that died (its node was lost outright) or cannot be reached under a request: the request was
# not answered and nothing was generated, so it is sent once more to another replica, else answered 503
REPLICA_LOST = (RayActorError, ActorUnavailableError)
WATCH_CHECK_S = 1.0        # how often the Ingress checks its replica watch still runs (a local check)
# Serve's cold-start rule (Ray 2.60 ray/serve/autoscaling_policy.py, applied before any custom policy) scales
# a deployment with no running replica to 1 while its handles report queued requests: requests the Ingress
# forwarded in the ~0.1 s before it saw the last replica stop (measured: 3 of 4 scale-downs to 0 under load
# got a replica back within 0.3 s). The Ingress cancels such requests at once (never admitted: 503) and the
# arbiter asks for its own count again; these settings make the controller see the queue empty again within
# about a second (handle report every 1 s instead of 10 s, points every 0.4 s) and let a lone spike of
# queued requests not hold the rule on ("min" over a 2 s window instead of the mean over 30 s).
COLD_START_METRICS = {"metrics_interval_s": 1.0, "look_back_period_s": 2.0, "aggregation_function": "min"}


@dataclass(frozen=True)
class ServeArgs:
    checkpoint: str = ""                 # a run's storage URI (file://, s3://); checkpoints/ inside
    model: str = "auto"                  # preset name, or auto (from the weights' shape)
    gpu_resource: str = "GPU"            # Ray's GPU resource (a logical one such as GPU_SLOT on test clusters)
    replicas: int = 1                    # Generator replicas at deploy: 1 for `serve run` alone; 0 under
                                         # the fill-in arbiter, which sets the count (only its lends
                                         # create replicas: no GPU request it did not grant)
    max_replicas: int = 64               # with replicas 0: the most the arbiter may ask Serve for
    fillin: str = "auto"                 # register with the fill-in arbiter (started if absent), which sets
                                         # the Generator's count: auto = when replicas is 0; true; false
    max_tokens: int = 64                 # cap on tokens per request
    max_generation_s: float = 1.5        # cap on seconds per request: below the 3 s shutdown grace
    reload_s: float = 2.0                # how often to look for a newer checkpoint
    retry_after_s: int = 1
    cpu_nice: int = 19                   # CPU priority of the replicas' processes: 19 lowest, 0 off
    cpu_idle: bool = True                # ... and the SCHED_IDLE policy (spotfill/fillin/cpu_priority.py:
                                         # training's host work first)

    @classmethod
    def parse(cls, args: dict | None) -> "ServeArgs":
        args = dict(args or {})
        unknown = sorted(set(args) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"serving.app args {unknown[0]}", accepted=", ".join(f.name for f in fields(cls)))
        out = {}
        for f in fields(cls):
            if f.name in args:
                kind = type(getattr(cls, f.name))
                if kind is bool:
                    from spotfill.fillin.cpu_priority import configured_idle
                    out[f.name] = configured_idle(args[f.name], f"serving.app args {f.name}")
                    continue
                try:
                    out[f.name] = kind(args[f.name])
                except ValueError:
                    raise ConfigError(f"serving.app args {f.name}", args[f.name],
                                      accepted=f"a {kind.__name__}") from None
        if "fillin" in out:
            out["fillin"] = str(out["fillin"]).lower()
        parsed = cls(**out)
        if not parsed.checkpoint:
            raise ConfigError("serving.app args checkpoint", reason="required",
                              accepted="a run's storage URI, e.g. file:///runs/demo or s3://bucket/run")
        if parsed.replicas < 0:
            raise ConfigError("serving.app args replicas", parsed.replicas,
                              accepted="an integer >= 0 (0 under the fill-in arbiter, which sets the count)")
        from spotfill.fillin.cpu_priority import configured_nice
        configured_nice(parsed.cpu_nice, "serving.app args cpu_nice")
        if parsed.fillin not in ("auto", "true", "false"):
            raise ConfigError("serving.app args fillin", parsed.fillin, accepted="auto, true, false")
        if parsed.max_replicas < 1:
            raise ConfigError("serving.app args max_replicas", parsed.max_replicas, accepted="an integer >= 1")
        if parsed.max_generation_s >= GRACEFUL["graceful_shutdown_timeout_s"]:
            raise ConfigError("serving.app args max_generation_s", parsed.max_generation_s,
                              accepted=f"< graceful_shutdown_timeout_s={GRACEFUL['graceful_shutdown_timeout_s']}")
        return parsed

    @property
    def under_arbiter(self) -> bool:
        """The fill-in arbiter sets the Generator's replica count (the app registers itself with it)."""
        return self.fillin == "true" or (self.fillin == "auto" and self.replicas == 0)


@serve.deployment(name=GENERATOR, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=8, **GRACEFUL)
class Generator:
    def __init__(self, args: ServeArgs):
        from spotfill.fillin.cpu_priority import lower_cpu_priority
        lower_cpu_priority(args.cpu_nice, idle=args.cpu_idle)    # fill-in: the CPU time training leaves
        from spotfill.storage.base import open_storage
        from spotfill.storage.checkpoint_store import CheckpointStore

        self.args = args
        self.store = CheckpointStore(open_storage(args.checkpoint))
        self.work = tempfile.mkdtemp(prefix="spotfill-serve-")
        self.loaded = None
        self.lock = threading.Lock()
        self.reloads: list[dict] = []
        self._reload()
        threading.Thread(target=self._watch, daemon=True, name="checkpoint-reload").start()

    def _reload(self) -> None:
        from spotfill.fillin.generate import load_newest
        try:
            new = load_newest(self.store, self.work, self.args.model,
                              newer_than=self.loaded.tag if self.loaded else None)
        except Exception as exc:  # noqa: BLE001 - keep serving the model we have
            log.warning("checkpoint reload failed, keeping %s: %s", self.loaded and self.loaded.tag, exc)
            return
        if new is not None:
            old = self.loaded.tag if self.loaded else None
            with self.lock:
                self.loaded = new
            self.reloads.append({"tag": new.tag, "step": new.step, "load_s": round(new.load_s, 3), "from": old})
            log.info("serving checkpoint %s (step %d), loaded in %.2fs (was %s)", new.tag, new.step,
                     new.load_s, old)

    def _watch(self) -> None:
        while True:
            time.sleep(self.args.reload_s)
            self._reload()

    def info(self) -> dict:
        m = self.loaded
        return {"tag": m.tag, "step": m.step, "load_s": round(m.load_s, 3), "loaded_at": m.loaded_at,
                "reloads": self.reloads[-10:]} if m else {"tag": None, "reloads": self.reloads[-10:]}

    async def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> dict:
        from spotfill.fillin.generate import generate
        with self.lock:
            loaded = self.loaded
        if loaded is None:
            return {"error": "no committed checkpoint yet"}
        n = max(1, min(int(max_tokens), self.args.max_tokens))
        text, count, reason = await asyncio.to_thread(generate, loaded.model, prompt, n, float(temperature),
                                                      int(seed), self.args.max_generation_s)
        return {"text": text, "tokens": count, "prompt_tokens": len(prompt.encode("utf-8")),
                "finish_reason": reason, "checkpoint": {"tag": loaded.tag, "step": loaded.step}}


api = FastAPI(title="spotfill fill-in generation")


def _retrieve(task: asyncio.Future) -> None:
    """Done-callback: a cancelled forward's exception is read here, not logged as never retrieved."""
    if not task.cancelled():
        task.exception()


def unavailable(message: str, retry_after_s: int) -> JSONResponse:
    return JSONResponse(status_code=503, headers={"Retry-After": str(retry_after_s)},
                        content={"error": {"message": message, "type": "unavailable", "code": 503}})


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256, **GRACEFUL)
@serve.ingress(api)
class Ingress:
    def __init__(self, generator, args: ServeArgs, app_name: str = APP_NAME):
        from spotfill.fillin.cpu_priority import lower_cpu_priority
        lower_cpu_priority(args.cpu_nice, idle=args.cpu_idle)
        self.generator, self.args, self.app_name = generator, args, app_name
        self.live = 0
        self.admit_timeout_s = args.max_generation_s + 2.0
        threading.Thread(target=self._watch_replicas, daemon=True, name="replica-watch").start()
        if args.under_arbiter:
            # a deployed app registers itself -- `serve deploy`, `serve run`, `spotfill serve` and the demo
            # alike -- so the arbiter lends it GPUs training does not use (fillin/wiring.py)
            from spotfill.fillin.wiring import register_in_background
            register_in_background(app_name, GENERATOR, gpu_resource=args.gpu_resource,
                                   max_replicas=args.max_replicas, grace_s=GRACEFUL["graceful_shutdown_timeout_s"])

    def _set_live(self, live: int) -> None:
        self.live = live

    def _watch_replicas(self) -> None:
        """Keep `live` (running Generator replicas) current from the Serve controller's push of the running
        set -- the long poll Serve's own routers use: an update as soon as a replica runs or is told to stop,
        and no call at all while nothing changes (serve.status() every 0.1 s cost this replica and the
        controller about 10% of a core on a 2-core node, beside training). A watch that ended (a new
        controller) is started again; `live` keeps its last count meanwhile. Where Ray lacks the push, the
        watch polls serve.status() (ray_compat.ray_serve, after one warning)."""
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="replica-watch-loop").start()
        watch = None
        while True:
            if watch is None or not watch.is_running:
                try:
                    watch = ray_compat.watch_running_replicas(self.app_name, GENERATOR, self._set_live, loop)
                except Exception as exc:  # noqa: BLE001 - the controller may be restarting; keep the last count
                    log.warning("replica watch not started (retrying): %s", exc)
            time.sleep(WATCH_CHECK_S)

    async def _forward(self, prompt: str, max_tokens: int, temperature: float, seed: int):
        """The Generator's answer, or a 503 when no replica runs. A request forwarded just as the last
        replica stopped sits in Serve's router with nowhere to go: a request no replica has taken (Serve's
        DeveloperAPI `_to_object_ref` resolves when the router assigns one) was never admitted -- once no
        replica runs, or after `admit_timeout_s`, it is cancelled and answered 503. A request a replica took
        is never cancelled: it finishes within max_generation_s, inside the stopping replica's grace."""
        if self.live <= 0:
            return None, unavailable("no generation replica: its GPUs went back to training; retry later",
                                     self.args.retry_after_s)
        for attempt in range(2):                 # a replica lost under it (a hard loss) generated nothing
            if attempt and self.live <= 0:
                break
            try:
                return await self._forward_once(prompt, max_tokens, temperature, seed)
            except REPLICA_LOST:
                continue
        return None, unavailable("the replica generating it was lost with its node before it answered; "
                                 "retry later", self.args.retry_after_s)

    async def _forward_once(self, prompt: str, max_tokens: int, temperature: float, seed: int):
        response = self.generator.generate.remote(prompt, max_tokens, temperature, seed)
        assigned = asyncio.ensure_future(ray_compat.request_taken(response))
        assigned.add_done_callback(_retrieve)
        t0 = time.monotonic()
        while not assigned.done():
            await asyncio.wait({assigned}, timeout=0.02)
            if not assigned.done() and (self.live <= 0 or time.monotonic() - t0 > self.admit_timeout_s):
                response.cancel()
                assigned.cancel()
                return None, unavailable("no generation replica picked the request up; retry later",
                                         self.args.retry_after_s)
        out = await assigned.result()
        if "error" in out:
            return None, unavailable(out["error"], self.args.retry_after_s)
        return out, None

    @api.post("/generate")
    async def generate(self, request: Request):
        body = await request.json()
        out, err = await self._forward(str(body.get("prompt", "")), int(body.get("max_tokens", 32)),
                                       float(body.get("temperature", 0.0)), int(body.get("seed", 0)))
        return err or out

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body = await request.json()
        prompt = body.get("prompt", "")
        prompt = prompt[0] if isinstance(prompt, list) and prompt else str(prompt)
        out, err = await self._forward(prompt, int(body.get("max_tokens") or 16),
                                       float(body.get("temperature") or 0.0), int(body.get("seed") or 0))
        if err:
            return err
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or out["checkpoint"]["tag"],
                "choices": [{"text": out["text"], "index": 0, "logprobs": None,
                             "finish_reason": "length" if out["finish_reason"] == "time" else out["finish_reason"]}],
                "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["tokens"],
                          "total_tokens": out["prompt_tokens"] + out["tokens"]},
                "checkpoint": out["checkpoint"]}

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": "spotfill", "object": "model", "created": 0,
                                            "owned_by": "spotfill"}]}

    @api.get("/healthz")
    async def healthz(self):
        info = await self.generator.info.remote() if self.live > 0 else None
        return {"replicas": self.live, "checkpoint": info}


def keep_external_target(ctx):
    """Serve autoscaling policy of the fill-in Generator: no decision of its own -- the replica count stays
    what the arbiter set through the external scaler (Serve still scales a deployment with 0 running
    replicas to 1 when requests wait for it, before this policy runs; the Ingress answers 503 instead of
    forwarding then, and the arbiter asks for its own count again)."""
    return ctx.target_num_replicas, {}


def build(args: ServeArgs):
    """The application graph for these arguments."""
    from spotfill.ray_compat import check_serve_hooks
    check_serve_hooks()                  # the Ingress's replica watch: said once at deploy if it must poll
    env = dict(QUIET_METRICS)
    if args.replicas == 0:
        env.update(NO_HANDLE_METRICS)
    actor = {"num_cpus": 0, "runtime_env": {"env_vars": dict(env)}}
    actor.update({"num_gpus": 1} if args.gpu_resource == "GPU" else {"resources": {args.gpu_resource: 1}})
    if args.replicas > 0:
        generator = Generator.options(num_replicas=args.replicas, ray_actor_options=actor)
    else:
        # Serve refuses num_replicas=0 (Ray 2.60: .options() and the config schema want > 0); an autoscaling
        # config may start at 0. Its policy keeps the count the external scaler (the arbiter) set. Serve's
        # cold-start rule still adds a replica when requests wait at a handle while none runs (see
        # COLD_START_METRICS): the arbiter stops such a replica within a second (Arbiter._stop_extra_replicas).
        generator = Generator.options(ray_actor_options=actor, autoscaling_config={
            "min_replicas": 0, "initial_replicas": 0, "max_replicas": args.max_replicas,
            "policy": {"policy_function": keep_external_target}, **COLD_START_METRICS})
    generator = generator.bind(args)
    ingress_actor = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001},
                     "runtime_env": {"env_vars": dict(env)}}
    ingress = Ingress.options(ray_actor_options=ingress_actor)
    return ingress.bind(generator, args)


def app(args: dict):
    """Application builder for `serve run serving.app:app checkpoint=...` and serving/config.yaml."""
    return build(ServeArgs.parse(args))


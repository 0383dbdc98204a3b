"""Ray Serve fill-in application: text generation from a run's newest committed checkpoint.

    serve run serving.app:app checkpoint=file:///runs/demo        # one replica, for a first look
    serve deploy serving/config.yaml                             # replicas set by the fill-in arbiter
    spotfill serve --checkpoint file:///runs/demo --port 8000    # a local embedded cluster + arbiter

Two deployments:
  * Ingress (CPU only, on the head node, always up): the HTTP routes -- `POST /v1/completions` and
    `POST /v1/chat/completions` (OpenAI-compatible, `stream: true` as server-sent events), `GET /v1/models`,
    `GET /-/ready`, `POST /generate` (plain JSON), `GET /healthz`. It knows which Generator replicas run
    (Serve's push of the running set). A request waits up to `max_queue_wait_s` for a replica that is
    starting; with none starting after replicas were reclaimed it gets 503 + Retry-After at once. A request
    whose replica is lost (node gone, killed after the grace) or stopped (GPU reclaimed) continues on another
    replica from the tokens generated so far (spotfill/generation/relay.py): one uninterrupted answer.
  * Generator (one lent GPU each, `gpu_resource`): loads the newest committed checkpoint onto the device Ray
    assigned (bf16 where supported), hot-reloads newer ones, and runs spotfill/generation's engine:
    KV-cached continuous batching, optional speculative decoding (`draft`).

The application is deployed with `external_scaler_enabled`: the arbiter sets the Generator's replica count
through Serve's scale endpoint (spotfill/fillin/serve_tenant.py).
"""

import asyncio
import logging
import random
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from spotfill import ray_compat     # light: each private hook loads when first used
from spotfill.serving.args import ServeArgs, check_deployable  # noqa: F401 - ServeArgs re-exported
# the Generator's Serve policy: the arbiter's count, no decision of Serve's own (re-exported)
from spotfill.serving.scaling import keep_external_target  # noqa: F401
from spotfill.generation import protocol
from spotfill.generation.relay import GenerationFailed, Lost, NotAdmitted, Relay
from spotfill.serving.generator import (  # noqa: F401 - Generator, _metric re-exported
    GENERATOR, GRACEFUL, MODEL_ID, NO_CHECKPOINT, NO_CHECKPOINT_REASON, Generator, _metric)

log = logging.getLogger("spotfill.serving")
APP_NAME = "spotfill-serve"
FLOOR = "GeneratorFloor"       # replicas on capacity the app owns (ServeArgs.floor_replicas): never lent
# running-request metrics from the replicas, not the Ingress's handle: a stopping replica's requests in
# flight are not counted as load with no replica running
NO_HANDLE_METRICS = {"RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE": "0"}
# Serve's replicas and routers export their cached request metrics every 0.1 s by default (a timer in every
# replica, all day, lent GPUs or not): once a second is enough for the dashboards (Ray 2.60:
# serve/_private/replica.py, router.py _report_cached_metrics_forever)
QUIET_METRICS = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# a replica that died (its node was lost outright, or Serve killed it after the grace) under a request
REPLICA_LOST = (RayActorError, ActorUnavailableError)
WATCH_CHECK_S = 1.0        # how often the Ingress checks its replica watch still runs (a local check)
STATUS_TTL_S = 0.5         # how long the Ingress trusts one read of the deployment's replica states
# Serve's cold-start rule (Ray 2.60 ray/serve/autoscaling_policy.py, applied before any custom policy) scales
# a deployment with no running replica to 1 while its handles report queued requests. The Ingress forwards
# only while a replica runs and cancels a forwarded request no replica took once none runs (never admitted);
# these settings make the controller see the queue empty again within about a second.
COLD_START_METRICS = {"metrics_interval_s": 1.0, "look_back_period_s": 2.0, "aggregation_function": "min"}
# why a request was not answered: metric label and OpenAI error code
STARTING, RECLAIMED, NOT_LENT, LOST, NOT_PICKED = (
    "replica_starting", "replicas_reclaimed", "no_replica_lent", "replica_lost", "not_picked_up")
REASONS = {
    STARTING: "no generation replica ready: one is starting and did not come up within max_queue_wait_s",
    RECLAIMED: "no generation replica: their GPUs were reclaimed (training claimed them, or their node "
               "drained); retry later",
    NOT_LENT: "no generation replica: none has been lent a GPU yet",
    NOT_PICKED: "no generation replica picked the request up; retry later",
    NO_CHECKPOINT: NO_CHECKPOINT_REASON,
}


api = FastAPI(title="spotfill fill-in generation")


# Serve's ingress decorator pickles the Ingress class with the module's globals as they are then: whatever
# its methods call is defined above it
def error_response(err: protocol.ApiError) -> JSONResponse:
    return JSONResponse(status_code=err.status, headers=err.headers(), content=err.body())


def result_of(relay, chunks: list[dict]) -> dict:
    """The whole answer from a relay's chunks."""
    last = chunks[-1]
    out = {"text": "".join(c.get("text") or "" for c in chunks), "finish_reason": last.get("finish_reason"),
           "prompt_tokens": last.get("prompt_tokens", 0), "completion_tokens": last.get("completion_tokens", 0),
           "model": relay.info.get("model", MODEL_ID), "checkpoint": relay.info.get("checkpoint"),
           "replica": relay.replica, "served_by": "floor" if relay.info.get("floor") else "lent", "continued": len(relay.continuations)}
    if relay.counts["verify_steps"]:
        out["spec_decode"] = {"drafted": relay.counts["drafted"], "accepted": relay.counts["accepted"]}
    return out


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256, **GRACEFUL)
@serve.ingress(api)
class Ingress:
    def __init__(self, generator, args: ServeArgs, app_name: str = APP_NAME, floor=None):
        from spotfill.fillin.cpu_priority import lower_cpu_priority
        lower_cpu_priority(args.cpu_nice, idle=args.cpu_idle)
        self.generator, self.args, self.app_name = generator, args, app_name
        self.floor = floor                   # the floor deployment's handle (None: no floor)
        self.n_running = 0                   # running Generator replicas
        self.running: list[str] | None = []  # their ids (None: the watch polls serve.status(), which names none)
        self.ever_ran = False
        self.relays: set = set()
        self.loop = None
        self._states: tuple[float, dict] = (0.0, {})
        self.admit_timeout_s = args.max_queue_wait_s + 5.0
        self.requests = _metric("Counter", "spotfill_serve_requests",
                                "requests by outcome (ok, rejected, lost, bad_request, failed) and reason",
                                ("outcome", "reason"))
        self.continued = _metric("Counter", "spotfill_serve_requests_continued",
                                 "requests continued on another replica", ("why",))
        threading.Thread(target=self._watch_replicas, daemon=True, name="replica-watch").start()
        if args.under_arbiter:
            # a deployed app registers itself -- `serve deploy`, `serve run`, `spotfill serve` and the demo
            # alike -- so the arbiter lends it GPUs training does not use (fillin/wiring.py)
            from spotfill.fillin.wiring import register_in_background
            register_in_background(app_name, GENERATOR, gpu_resource=args.gpu_resource,
                                   max_replicas=args.max_replicas, grace_s=GRACEFUL["graceful_shutdown_timeout_s"])
            if args.standby_per_node:        # warm standbys on the nodes whose GPUs may be lent
                from spotfill.serving.standby import StandbyKeeper
                self.keeper = StandbyKeeper(app_name, args.checkpoint, args.model, args.gpu_resource,
                                            args.standby_per_node)
                threading.Thread(target=self.keeper.run, daemon=True, name="standby-keeper").start()

    lent_target: int | None = None      # the count the arbiter last set (fillin.serve_tenant; None: unknown)

    @property
    def live(self) -> int:
        """Running Generator replicas to forward to: none while the arbiter's count is 0 and a floor answers
        -- a replica then runs only by Serve's cold-start rule and is being stopped; forwarding to it queued
        requests at its handle, and Serve started another (fillin.serve_tenant.TARGET_KEY)."""
        if self.lent_target == 0 and self.floor is not None:
            return 0
        return self.n_running

    # -- which replicas run ---------------------------------------------------------------------------
    def _set_running(self, n: int, ids: list[str] | None) -> None:
        self.n_running, self.running = n, None if ids is None else list(ids)
        self.ever_ran = self.ever_ran or n > 0
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._migrate_off_stopped)

    def _migrate_off_stopped(self) -> None:
        """Requests on a replica that left the running set (told to stop: its GPU was reclaimed, or lost)
        continue on another now -- when another runs; else they keep their replica for its grace."""
        if self.running is None or (not self.n_running and self.floor is None):
            return
        for relay in list(self.relays):
            if (relay.replica is not None and not relay.info.get("floor") and relay.replica not in self.running
                    and relay.migrate()):          # to a running lent replica, else to the floor
                self.continued.inc(tags={"why": "replica_stopped"})

    def _watch_replicas(self) -> None:
        """Keep `live` and `running` (the running Generator replicas and their ids) current from the Serve
        controller's push of the running set -- the long poll Serve's own routers use: an update as soon as a
        replica runs or is told to stop, and no call at all while nothing changes (serve.status() every 0.1 s
        cost this replica and the controller about 10% of a core on a 2-core node, beside training). A watch
        that ended (a new controller) is started again; the last set is kept meanwhile. Where Ray lacks the
        push, the watch polls serve.status() (ray_compat.ray_serve, after one warning), which counts the
        running replicas but names none: requests then stay on a stopped replica for its grace and continue
        on another only once it is lost."""
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="replica-watch-loop").start()
        watch = None
        while True:
            if watch is None or not watch.is_running:
                try:
                    watch = ray_compat.watch_running_replicas(self.app_name, GENERATOR, self._set_running, loop)
                except Exception as exc:  # noqa: BLE001 - the controller may be restarting; keep the last set
                    log.warning("replica watch not started (retrying): %s", exc)
            if self.args.under_arbiter and self.floor is not None:
                self._read_lent_target()
            time.sleep(WATCH_CHECK_S)

    def _read_lent_target(self) -> None:
        """The arbiter's count for the Generator (one GCS read a second; the last reading kept on a failure)."""
        try:
            from spotfill.fillin.serve_tenant import lent_target
            self.lent_target = lent_target(self.app_name, GENERATOR)
        except Exception as exc:  # noqa: BLE001 - the GCS may be restarting
            log.debug("the arbiter's replica count not read: %s", exc)

    async def _replica_states(self) -> dict:
        """The Generator's replica states from Serve ({"STARTING": n, ...}), read at most every 0.5 s and
        only while no replica runs."""
        t, states = self._states
        if time.monotonic() - t > STATUS_TTL_S:
            def read() -> dict:
                app = serve.status().applications.get(self.app_name)
                dep = app.deployments.get(GENERATOR) if app else None
                return {str(getattr(k, "value", k)): n for k, n in (dep.replica_states if dep else {}).items()}
            try:
                states = await asyncio.to_thread(read)
            except Exception as exc:  # noqa: BLE001 - the controller is restarting: nothing known
                log.warning("serve status not read: %s", exc)
                states = {}
            self._states = (time.monotonic(), states)
        return states

    async def state(self) -> str:
        """"ready" | STARTING | RECLAIMED | NOT_LENT. With a floor, always ready: the floor answers while no
        lent replica runs."""
        if self.live > 0 or self.floor is not None:
            return "ready"
        states = await self._replica_states()
        if any(states.get(s) for s in ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")):
            return STARTING
        return RECLAIMED if self.ever_ran else NOT_LENT

    async def _await_replica(self, new: bool = True) -> str | None:
        """None once a replica runs; else why not (after waiting up to max_queue_wait_s for one that is
        starting or not lent yet; a new request whose replicas were reclaimed is answered at once)."""
        t_end = time.monotonic() + self.args.max_queue_wait_s
        while True:
            state = await self.state()
            if state == "ready":
                return None
            if (new and state == RECLAIMED) or time.monotonic() >= t_end:
                return state
            await asyncio.sleep(0.05)

    def _unavailable(self, reason: str, message: str | None = None) -> protocol.ApiError:
        outcome = "lost" if reason == LOST else "rejected"
        self.requests.inc(tags={"outcome": outcome, "reason": reason})
        return protocol.ApiError(503, message or REASONS[reason], type="unavailable", code=reason,
                                 retry_after_s=self.args.retry_after_s)

    # -- one request ------------------------------------------------------------------------------------
    def _target(self):
        """Where a request (or its continuation) goes: a running lent replica, else the floor (if any)."""
        return self.generator if (self.live > 0 or self.floor is None) else self.floor

    def _open(self, job: dict):
        return self._target().options(stream=True).stream.remote(job)

    async def _start(self, call: protocol.Call):
        """(relay, its iterator, the first chunk) once a replica took the request; raises ApiError."""
        self.loop = self.loop or asyncio.get_running_loop()
        why = await self._await_replica(new=True)
        if why:
            raise self._unavailable(why)
        params = call.params()
        if params["seed"] is None:          # fixed now: a continuation elsewhere draws the same numbers
            params["seed"] = random.getrandbits(63)
        job = call.job(params)           # a chat keeps its messages: the replica's tokenizer renders them

        async def ready() -> bool:
            return await self._await_replica(new=False) is None
        relay = Relay(job, self._open, is_lost=lambda exc: isinstance(exc, REPLICA_LOST), replica_ready=ready,
                      placeable=lambda: self.live > 0 or self.floor is not None,
                      admit_timeout_s=self.admit_timeout_s)
        self.relays.add(relay)
        it = relay.__aiter__()
        try:
            return relay, it, await it.__anext__()
        except BaseException as exc:
            self.relays.discard(relay)
            raise self._failure(exc, relay) from None

    def _failure(self, exc: BaseException, relay) -> BaseException:
        if isinstance(exc, NotAdmitted):
            return self._unavailable(NOT_PICKED)
        if isinstance(exc, Lost):
            return self._unavailable(LOST, str(exc))
        if isinstance(exc, GenerationFailed):
            if exc.code == "context_length_exceeded":
                self.requests.inc(tags={"outcome": "bad_request", "reason": exc.code})
                return protocol.ApiError(400, str(exc), param="prompt", code=exc.code)
            return self._unavailable(NO_CHECKPOINT, str(exc)) if exc.code == NO_CHECKPOINT else \
                protocol.ApiError(500, str(exc), type="server_error", code=exc.code)
        return exc

    def _done(self, relay) -> None:
        self.relays.discard(relay)
        for c in relay.continuations:
            if "lost" in c["why"]:
                self.continued.inc(tags={"why": "replica_lost"})

    async def _collect(self, call: protocol.Call) -> dict:
        relay, it, first = await self._start(call)
        chunks = [first]
        try:
            async for c in it:
                chunks.append(c)
        except BaseException as exc:
            raise self._failure(exc, relay) from None
        finally:
            self._done(relay)
        self.requests.inc(tags={"outcome": "ok", "reason": ""})
        return result_of(relay, chunks)

    async def _sse(self, call: protocol.Call, relay, it, first: dict):
        created, model = int(time.time()), relay.info.get("model", MODEL_ID)
        last = first
        try:
            if call.chat:
                yield protocol.sse(protocol.chunk(call, model, created, role=True))
            c, shown = first, None
            while True:
                if c.get("text") or c.get("finish_reason"):
                    out = protocol.chunk(call, model, created, c.get("text"), c.get("finish_reason"))
                    if relay.replica != shown:        # extension: the replica generating, when it changes
                        out["replica"] = shown = relay.replica
                    yield protocol.sse(out)
                last = c
                if c.get("finish_reason"):
                    break
                c = await it.__anext__()
            if call.include_usage:
                yield protocol.sse(protocol.chunk(call, model, created, usage_of=result_of(relay, [last])))
            self.requests.inc(tags={"outcome": "ok", "reason": ""})
        except StopAsyncIteration:
            pass
        except Exception as exc:  # noqa: BLE001 - told to the client in the stream, OpenAI's way
            err = self._failure(exc, relay)
            body = err.body() if isinstance(err, protocol.ApiError) else {
                "error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
            yield protocol.sse(body)
        finally:
            self._done(relay)
            await it.aclose()                 # a client that went away: the replica stops generating
        yield protocol.SSE_DONE

    async def _answer(self, call_of, request: Request):
        try:
            try:
                body = await request.json()
            except ValueError:
                raise protocol.ApiError(400, "the body is not valid JSON", code="invalid_json") from None
            call = call_of(body)
            if not call.stream:
                result = await self._collect(call)
                return protocol.response(call, result)
            relay, it, first = await self._start(call)
            return StreamingResponse(self._sse(call, relay, it, first), media_type="text/event-stream")
        except protocol.ApiError as err:
            if err.status == 400 and err.code != "context_length_exceeded":
                self.requests.inc(tags={"outcome": "bad_request", "reason": err.code or ""})
            return error_response(err)
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body with the cause, not a bare 500
            return self._server_error(exc)

    def _server_error(self, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        self.requests.inc(tags={"outcome": "failed", "reason": type(exc).__name__})
        return error_response(protocol.ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._answer(protocol.parse_completion, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._answer(protocol.parse_chat, request)

    @api.post("/generate")
    async def generate(self, request: Request):
        """Plain JSON: {prompt, max_tokens (32), temperature (0), seed (0)} -> {text, tokens, ...}."""
        async def call_of(body) -> protocol.Call:
            return protocol.parse_completion({"max_tokens": 32, "temperature": 0, "seed": 0, **body, "stream": False})
        try:
            try:
                body = await request.json()
            except ValueError:
                raise protocol.ApiError(400, "the body is not valid JSON", code="invalid_json") from None
            out = await self._collect(await call_of(body))
        except protocol.ApiError as err:
            return error_response(err)
        except Exception as exc:  # noqa: BLE001
            return self._server_error(exc)
        return {"text": out["text"], "tokens": out["completion_tokens"], "prompt_tokens": out["prompt_tokens"],
                "finish_reason": out["finish_reason"], "checkpoint": out["checkpoint"],
                "replica": out["replica"], "continued": out["continued"], **(
                    {"spec_decode": out["spec_decode"]} if out.get("spec_decode") else {})}

    async def _status(self) -> dict:
        state = await self.state()
        info = None
        if state == "ready":
            try:
                info = await self._target().info.remote()
            except REPLICA_LOST:
                info = None
        if state == "ready" and (info is None or info.get("tag") is None):
            state = NO_CHECKPOINT if info is not None else STARTING
        return {"state": state, "replicas": self.live, "floor_replicas": self.args.floor_replicas,
                "checkpoint": info}

    @api.get("/v1/models")
    async def models(self):
        st = await self._status()
        ckpt = st["checkpoint"] or {}
        return {"object": "list", "data": [{
            "id": MODEL_ID, "object": "model", "created": int(ckpt.get("loaded_at") or 0), "owned_by": "spotfill",
            "ready": st["state"] == "ready", "state": st["state"], "replicas": st["replicas"],
            "checkpoint": ckpt.get("tag"), "max_model_len": ckpt.get("context")}]}

    @api.get("/-/ready")
    async def ready(self):
        st = await self._status()
        if st["state"] == "ready":
            return {"ready": True, **st}
        return JSONResponse(status_code=503, headers={"Retry-After": str(self.args.retry_after_s)},
                            content={"ready": False, **st, "message": REASONS.get(st["state"], st["state"])})

    @api.get("/healthz")
    async def healthz(self):
        st = await self._status()
        return {"replicas": st["replicas"], "state": st["state"], "checkpoint": st["checkpoint"]}


def build(args: ServeArgs):
    """The application graph for these arguments."""
    from spotfill.ray_compat import check_serve_hooks
    check_serve_hooks()                  # the Ingress's replica watch: said once at deploy if it must poll
    env = dict(QUIET_METRICS)
    if args.replicas == 0:
        env.update(NO_HANDLE_METRICS)
    if args.standby_per_node and args.under_arbiter:
        # the Ingress and the Generator share one runtime_env: the Ingress's keeper prestarts standbys with
        # it, and Ray hands a Generator replica an idle process of the same job and runtime_env
        from spotfill.ray_compat import worker_setup_hook_env
        from spotfill.serving.standby import HOOK
        env = worker_setup_hook_env(HOOK, env)
    actor = {"num_cpus": 0, "runtime_env": {"env_vars": dict(env)}}
    actor.update({"num_gpus": 1} if args.gpu_resource == "GPU" else {"resources": {args.gpu_resource: 1}})
    ongoing = max(16, 4 * args.max_batch)        # the engine queues what its batch cannot take yet
    if args.replicas > 0:
        generator = Generator.options(num_replicas=args.replicas, ray_actor_options=actor,
                                      max_ongoing_requests=ongoing)
    else:
        # Serve refuses num_replicas=0 (Ray 2.60: .options() and the config schema want > 0); an autoscaling
        # config may start at 0. Its policy keeps the count the external scaler (the arbiter) set. Serve's
        # cold-start rule still adds a replica when requests wait at a handle while none runs (see
        # COLD_START_METRICS): the arbiter stops such a replica within a second (Arbiter._stop_extra_replicas).
        generator = Generator.options(ray_actor_options=actor, max_ongoing_requests=ongoing, autoscaling_config={
            "min_replicas": 0, "initial_replicas": 0, "max_replicas": args.max_replicas,
            "policy": {"policy_function": keep_external_target}, **COLD_START_METRICS})
    generator = generator.bind(args)
    ingress_actor = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001},
                     "runtime_env": {"env_vars": dict(env)}}
    ingress = Ingress.options(ray_actor_options=ingress_actor)
    return ingress.bind(generator, args, floor=floor_deployment(args, ongoing))


def floor_deployment(args: ServeArgs, ongoing: int):
    """The floor: `floor_replicas` Generator replicas on capacity the app owns (the head node's CPU by
    default), a deployment the arbiter neither lends nor reclaims; None without one."""
    if args.floor_replicas <= 0:
        return None
    actor = {"num_cpus": args.floor_cpus, "runtime_env": {"env_vars": dict(QUIET_METRICS)}}
    if args.floor_device == "gpu":
        actor["num_gpus"] = 1
    if args.floor_node == "head":
        actor["resources"] = {"node:__internal_head__": 0.001}
    return Generator.options(name=FLOOR, num_replicas=args.floor_replicas, ray_actor_options=actor,
                             max_ongoing_requests=ongoing).bind(args, floor=True)


def app(args: dict):
    """Application builder for `serve run serving.app:app checkpoint=...` and serving/config.yaml: the
    arguments are checked here, at deploy (the storage and, on a running cluster, the GPU resource)."""
    import ray
    parsed = ServeArgs.parse(args)
    check_deployable(parsed, ray.cluster_resources() if ray.is_initialized() else None)
    return build(parsed)

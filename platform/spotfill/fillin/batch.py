"""Batch fill-in: evaluation and generation over a checkpoint as a Ray Data job on lent GPUs, exactly once.

The driver (jobs/batch_infer.py -> `BatchJob.run`) pins one checkpoint when it first starts (consolidated
weights under `<output>/_plan/model.pt`, so training's checkpoint cleanup cannot pull it away), plans the
units (fillin/batch_plan.py) and then runs *waves*: each wave is a Ray Data pipeline over the units not yet
committed, mapped by an actor pool of `{gpu_resource: 1}` actors whose size is the grant at that moment.
Ray Data cannot shrink a running pipeline, so when the grant drops below what the wave holds the driver
stops consuming it: leaving the iterator shuts the streaming executor down (force) and its actors go, well
inside the grace. The driver leaves on the next unit done, so a unit must take well under the grace
(`rows_per_unit`); a driver that still holds GPUs after its grace is stopped by the arbiter, and a rerun
resumes on what remains. The next wave starts when the grant allows, on what remains. Each actor writes a unit's parquet part whole and
then its commit marker; a unit without a valid marker is redone under the same name. An actor computes on
the GPU Ray assigned it, in bf16 where the GPU has it (fp16 before Ampere), on the CPU in fp32 when Ray
assigned none or CUDA is absent (spotfill.devices); its commit markers say where (`device`, `dtype`,
`gpu_ids`). A generation unit's rows run together on the actor's KV-cached engine (spotfill/generation,
continuous batching), greedy rows giving what one-at-a-time decoding gives.

`read_back` computes the report's `fillin.batch` from the output itself.
"""
from __future__ import annotations

import hashlib
import importlib
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time

from spotfill.config.errors import ConfigError
from spotfill.fillin import batch_plan as bp

log = logging.getLogger("spotfill.fillin.batch")
REGROW_AFTER_S = 2.0     # a grant larger than the wave for this long: start a wave on it
GENERATE_MAX_BATCH = 16  # prompts an actor generates for at once (its KV cache: this many rows)
STOPS_DIR = "_stops"     # <output>/_stops/<t>.json: each wave stopped with units to do (every run of the job)


# -- inputs -------------------------------------------------------------------------------------------
def _read_uri(uri: str, field: str) -> bytes:
    from spotfill.storage.base import open_storage
    if "://" not in uri or uri.startswith("file://"):
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        if not os.path.isfile(path):
            raise ConfigError(field, uri, reason="no such file")
        with open(path, "rb") as f:
            return f.read()
    head, _, name = uri.split("?")[0].rpartition("/")
    query = uri[len(uri.split("?")[0]):]
    try:
        return open_storage(head + query).get_bytes(name)
    except FileNotFoundError:
        raise ConfigError(field, uri, reason="no such object") from None


def read_prompts(uri: str) -> tuple[list[str], list[str], str]:
    """(ids, prompts, sha256) of a jsonl prompt file: one {"prompt": str, "id": optional str|int} per line;
    a line without an id gets its line number."""
    raw = _read_uri(uri, "generate.prompts")
    ids, prompts = [], []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise ConfigError("generate.prompts", f"{uri} line {n}", reason="not JSON",
                              accepted='one {"prompt": "...", "id": ...} object per line') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ConfigError("generate.prompts", f"{uri} line {n}", reason="no string 'prompt' field",
                              accepted='one {"prompt": "...", "id": ...} object per line')
        pid = obj.get("id", n - 1)
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise ConfigError("generate.prompts", f"{uri} line {n}", reason="'id' must be a string or integer")
        ids.append(str(pid))
        prompts.append(obj["prompt"])
    dups = bp.duplicate_prompt_ids(ids)
    if dups:
        raise ConfigError("generate.prompts", uri, reason=f"duplicate ids {dups[:5]}", accepted="unique ids")
    if not ids:
        raise ConfigError("generate.prompts", uri, reason="no prompts in it")
    return ids, prompts, hashlib.sha256(raw).hexdigest()


# -- the plan -----------------------------------------------------------------------------------------
def _inputs(cfg) -> dict:
    from spotfill.storage.base import open_storage
    from spotfill.train.data import read_manifest
    out = {"eval_rows": 0, "eval_data": cfg.eval.data or None, "eval_rows_per_unit": cfg.eval.rows_per_unit,
           "generate_rows_per_unit": cfg.generate.rows_per_unit, "max_tokens": cfg.generate.max_tokens,
           "temperature": cfg.generate.temperature, "seed": cfg.generate.seed, "prompts_sha256": None,
           "prompt_ids": []}
    if cfg.eval.data:
        n = int(read_manifest(open_storage(cfg.eval.data))["num_samples"])
        out["eval_rows"] = min(n, cfg.eval.rows) if cfg.eval.rows else n
    if cfg.generate.prompts:
        out["prompt_ids"], _, out["prompts_sha256"] = read_prompts(cfg.generate.prompts)
    return out


def units_of(plan: dict) -> list[bp.Unit]:
    return (bp.split("eval", plan["eval_rows"], plan["eval_rows_per_unit"])
            + bp.split("generate", len(plan["prompt_ids"]), plan["generate_rows_per_unit"]))


def load_or_make_plan(cfg, out) -> tuple[dict, bool]:
    """The job's plan at `out` (a resumed job: the inputs must be the same), or a new one: the checkpoint
    is pinned (its weights copied into the output) before the plan is written. Returns (plan, resumed)."""
    new = _inputs(cfg)
    if out.exists(bp.PLAN_KEY):
        plan = json.loads(out.get_bytes(bp.PLAN_KEY))
        if cfg.checkpoint_tag:
            new["checkpoint_tag"] = cfg.checkpoint_tag
        else:
            new["checkpoint_tag"] = plan.get("checkpoint_tag")
        diff = bp.same_plan(plan, new)
        if diff:
            raise ConfigError("output", out.uri, reason=f"holds the plan of a different job (differs in "
                              f"{', '.join(diff)})", accepted="the same inputs to resume, or a new output")
        return plan, True
    state, tag, step, card, tok_files = _pinned_checkpoint(cfg)
    buf = io.BytesIO()
    import torch
    torch.save(state, buf)
    out.put_bytes(bp.MODEL_KEY, buf.getvalue())
    for name, data in tok_files.items():
        out.put_bytes(f"{bp.TOKENIZER_DIR}/{name}", data)
    plan = {**new, "checkpoint": cfg.checkpoint, "checkpoint_tag": tag, "checkpoint_step": step,
            "model": cfg.model, "model_card": card, "created": time.time(), "name": cfg.name}
    out.put_bytes(bp.PLAN_KEY, json.dumps(plan).encode())
    return plan, False


def _pinned_checkpoint(cfg) -> tuple[dict, str, int, dict | None, dict[str, bytes]]:
    """(weights, tag, step, the model card its manifest carries or None, {name: bytes} of the tokenizer
    files it carries) of the checkpoint to pin."""
    from spotfill.train.model_card import MODEL_DIR
    from spotfill.fillin.generate import consolidate
    from spotfill.train.model_card import card_of
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    store = CheckpointStore(open_storage(cfg.checkpoint))
    work = tempfile.mkdtemp(prefix="spotfill-batch-ckpt-")
    try:
        t_end = time.monotonic() + cfg.checkpoint_wait_s
        while not cfg.checkpoint_tag and store.latest_tag() is None and time.monotonic() < t_end:
            time.sleep(1.0)                # a run that has just started: its first commit comes soon
        manifest = store.restore(work, tag=cfg.checkpoint_tag, resume=False)   # a reader, never training's
        if manifest is None:
            raise ConfigError("checkpoint", cfg.checkpoint, reason="no committed checkpoint in it")
        src = os.path.join(manifest["path"], "rank-0", MODEL_DIR)
        files = {}
        if os.path.isdir(src):
            for name in sorted(os.listdir(src)):
                with open(os.path.join(src, name), "rb") as f:
                    files[name] = f.read()
        return (consolidate(manifest["path"], manifest["tag"]), manifest["tag"], int(manifest["step"]),
                card_of(manifest.get("meta")), files)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def committed(out, units: list[bp.Unit]) -> set[str]:
    parts = {k: v for kind in bp.KINDS for k, v in out.list(f"{kind}/").items()}
    markers = {}
    for key in out.list(f"{bp.COMMITS}/"):
        try:
            markers[os.path.basename(key)[: -len(".json")]] = json.loads(out.get_bytes(key))
        except (ValueError, FileNotFoundError):
            continue                       # a marker is written whole; an unreadable one commits nothing
    return bp.committed_units(units, markers, parts)


# -- the Ray Data map stage (one actor per granted GPU) -----------------------------------------------
class UnitWorker:
    """Runs units: evaluation (per-row token loss) or generation; writes each unit's part, then commits it."""

    def __init__(self, output: str, plan: dict, eval_batch: int, prompts: list[str] | None,
                 tenant: str = "batch", gpu_resource: str = "GPU"):
        t_init = time.time()
        import torch

        from spotfill.fillin.busy import BusyReporter
        from spotfill.fillin.cpu_priority import lower_cpu_priority
        lower_cpu_priority()         # fill-in: lowest CPU priority ($SPOTFILL_FILLIN_CPU_NICE, default 19)
        # its compute time, measured here and sent to the arbiter (gpu_seconds.fillin_busy: fillin/busy.py)
        self.busy = BusyReporter(tenant, "batch", 1, gpu_resource)

        from spotfill.devices import assigned_device, compute_dtype, ray_gpu_ids
        from spotfill.storage.base import open_storage
        torch.set_num_threads(1)
        self.out, self.plan, self.eval_batch, self.prompts = open_storage(output), plan, eval_batch, prompts
        # the GPU Ray assigned this actor (its `gpu_resource: 1`), in the precision it supports; the CPU when
        # Ray assigned none or CUDA is absent (spotfill.devices)
        self.device = assigned_device()
        self.dtype = compute_dtype(self.device)
        self.where = {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                      "gpu_ids": [str(g) for g in ray_gpu_ids()]}
        self._take_or_load(output, plan, t_init)
        self.engine = None             # generation's KV-cached engine, made by the first generation unit
        self.reader = None
        if plan["eval_rows"]:
            from spotfill.train.data import ShardReader
            self.reader = ShardReader(open_storage(plan["eval_data"]), os.path.join(
                tempfile.gettempdir(), "spotfill-batch-cache"))

    def _take_or_load(self, output: str, plan: dict, t_init: float) -> None:
        """The model and tokenizer: a warm standby's (fillin/batch_standby.py; wake: weights to this actor's
        device) or read from the plan (cold); how it started goes to the arbiter's journal (`fillin_start`)."""
        from spotfill.fillin.batch_standby import take
        from spotfill.fillin.standby import start_event
        standby = take(output, plan)
        t0 = time.perf_counter()
        if standby is not None and standby.get("loaded") is not None:
            model, self.tokenizer = standby["loaded"]
            self.model = model.to(self.device, self.dtype).eval()
            load = {"wake_s": round(time.perf_counter() - t0, 3)}
        else:
            self.model = plan_model(self.out, plan, self.device, self.dtype)
            self.tokenizer = plan_tokenizer(self.out, plan)
            load = {"load_s": round(time.perf_counter() - t0, 3)}
        self.start = start_event(self.busy.meter.tenant, "batch", self.busy.meter, t_init, standby,
                                 {**load, "tag": plan.get("checkpoint_tag")})
        self.busy.send([self.start])
        # each commit marker says how its actor started too (the GPU check reads wake_s on a real device)
        self.where["start"] = {k: self.start.get(k) for k in ("warm", "init_s", "wake_s", "load_s")}

    def __call__(self, batch: dict) -> dict:
        done, rows = [], []
        for raw in batch["unit"]:
            unit = bp.Unit(**{k: v for k, v in json.loads(raw).items() if k in ("kind", "index", "start", "stop")})
            with self.busy.meter.measure():         # the unit's compute; its commit is storage, not GPU work
                table = self._eval(unit) if unit.kind == "eval" else self._generate(unit)
            self._commit(unit, table)
            self.busy.flush()                       # each unit's: a wave can be stopped at any unit
            done.append(unit.unit_id)
            rows.append(unit.rows)
        return {"unit_id": done, "rows": rows}

    def _eval(self, unit: bp.Unit):
        import numpy as np
        tokens = self.reader.rows(np.arange(unit.start, unit.stop))
        nll, count = [], []
        for i in range(0, len(tokens), self.eval_batch):
            a, b = eval_rows(self.model, tokens[i:i + self.eval_batch])
            nll.extend(a)
            count.extend(b)
        return eval_table(unit, nll, count)

    def _generate(self, unit: bp.Unit):
        """The unit's rows together on the actor's KV-cached engine (continuous batching, up to
        GENERATE_MAX_BATCH rows at once: fillin/generate.py generate_rows)."""
        import pyarrow as pa

        from spotfill.fillin.generate import batch_engine, generate_rows
        if self.engine is None:        # its cache is allocated once, for the rows of a unit
            per_unit = self.plan.get("generate_rows_per_unit") or GENERATE_MAX_BATCH    # (a plan from before it)
            self.engine = batch_engine(self.model, min(GENERATE_MAX_BATCH, per_unit), self.tokenizer)
        rows = range(unit.start, unit.stop)
        results = generate_rows(self.model, [self.prompts[r] for r in rows], self.plan["max_tokens"],
                                self.plan["temperature"], seeds=[self.plan["seed"] + r for r in rows],
                                engine=self.engine, tokenizer=self.tokenizer)
        cols = {"id": [], "prompt_id": [], "prompt": [], "text": [], "tokens": [], "finish_reason": []}
        for r, (text, n, reason) in zip(rows, results):
            pid = self.plan["prompt_ids"][r]
            for k, v in zip(cols, (f"generate/{pid}", pid, self.prompts[r], text, n, reason)):
                cols[k].append(v)
        return pa.table(cols)

    def _commit(self, unit: bp.Unit, table) -> None:
        commit_unit(self.out, unit, table, self.where)


def plan_model(out, plan: dict, device=None, dtype=None):
    """The job's pinned model (`<output>/_plan/model.pt`) on `device` (default: the CPU) in `dtype`, in eval
    mode: the model its checkpoint's card describes (the plan keeps it; a plan or checkpoint from before
    cards: the logged guess from the weights, `model` naming the preset)."""
    import torch

    from spotfill.train.model_card import model_from_state
    device = device or torch.device("cpu")
    state = torch.load(io.BytesIO(out.get_bytes(bp.MODEL_KEY)), map_location=device, weights_only=False)
    model, _ = model_from_state(state, {"model": plan.get("model_card")}, plan.get("model", "auto"),
                                where=f"batch plan of checkpoint {plan.get('checkpoint_tag')}")
    return model.to(device, dtype).eval()


def plan_tokenizer(out, plan: dict):
    """The pinned checkpoint's tokenizer: its own Hugging Face one (files under `_plan/tokenizer/`, written to
    a local folder), or the byte tokenizer of spotfill's presets (fillin/generate.tokenizer_of)."""
    from spotfill.fillin.generate import tokenizer_of
    card = plan.get("model_card")
    folder = None
    if ((card or {}).get("tokenizer") or {}).get("kind") == "hf":
        folder = tempfile.mkdtemp(prefix="spotfill-batch-tok-")
        for key in out.list(f"{bp.TOKENIZER_DIR}/"):
            with open(os.path.join(folder, os.path.basename(key)), "wb") as f:
                f.write(out.get_bytes(key))
    return tokenizer_of(card, folder)


def eval_rows(model, tokens) -> tuple[list[float], list[int]]:
    """Per row of token rows [rows, seq+1] (numpy): the summed next-token loss and the tokens it covers,
    with no autograd, on the model's device."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    device = next(model.parameters()).device
    with torch.no_grad():
        chunk = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        logits = model(x).float()
        per_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        per_row = per_tok.view(y.shape).double().sum(dim=1)
        return per_row.tolist(), [y.shape[1]] * y.shape[0]


def eval_table(unit: bp.Unit, nll: list[float], count: list[int]):
    """An evaluation unit's output part: one row per input row, with its id."""
    import numpy as np
    import pyarrow as pa
    return pa.table({"id": bp.row_ids("eval", unit.start, unit.stop),
                     "row": np.arange(unit.start, unit.stop).astype("int64"),
                     "tokens": pa.array(count, pa.int64()), "nll": pa.array(nll, pa.float64()),
                     "loss": pa.array([a / b for a, b in zip(nll, count)], pa.float64())})


def commit_unit(out, unit: bp.Unit, table, where: dict | None = None) -> None:
    """Write a unit's part whole (a rename locally, one PUT on S3), then its commit marker."""
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    pq.write_table(table, buf)
    data = buf.getvalue()
    out.put_bytes(unit.key, data)
    marker = {"key": unit.key, "rows": table.num_rows, "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest(), "at": time.time(), "pid": os.getpid(), **(where or {})}
    out.put_bytes(unit.marker, json.dumps(marker).encode())


# -- the driver ---------------------------------------------------------------------------------------
class BatchJob:
    def __init__(self, cfg, grant, runtime_env: dict | None = None):
        from spotfill.storage.base import open_storage
        self.cfg, self.grant, self.runtime_env = cfg, grant, runtime_env
        self.out = open_storage(cfg.output)
        self.waves: list[dict] = []
        self.stops: list[dict] = []
        self.actor_env, self.keeper = None, None      # warm standbys (fillin/batch_standby.py), set by run()

    def prepare(self) -> tuple[dict, bool]:
        """Inputs checked, checkpoint pinned, units planned (no Ray needed): ConfigError on bad input."""
        self.plan, self.resumed = load_or_make_plan(self.cfg, self.out)
        return self.plan, self.resumed

    def run(self, wait_timeout_s: float | None = None) -> dict:
        """Run waves until every unit is committed; returns the summary read back from the output.
        `wait_timeout_s`: give up (JobFailed) when nothing is lent for that long (None: wait forever)."""
        from spotfill.config.errors import JobFailed
        t0 = time.time()
        plan, resumed = getattr(self, "plan", None), getattr(self, "resumed", False)
        if plan is None:
            plan, resumed = self.prepare()
        units = units_of(plan)
        prompts = read_prompts(self.cfg.generate.prompts)[1] if plan["prompt_ids"] else None
        skipped_at_start = None
        from spotfill.fillin.batch_standby import start_standbys, stop_keeper
        self.actor_env, self.keeper = start_standbys(self.cfg)
        # Ray Data's import before the first demand, not after the first lend: a demo's first wave started
        # 15 s after its grant, importing it on a busy machine (the next waves: 0.3-3 s)
        importlib.import_module("ray.data")
        try:
            while True:
                todo = bp.remaining(units, committed(self.out, units))
                if skipped_at_start is None:
                    skipped_at_start = len(units) - len(todo)
                    log.info("batch %s: %d unit(s), %d already committed%s", self.cfg.name, len(units),
                             skipped_at_start, " (resumed)" if resumed else "")
                self.grant.demand(bp.wave_size(self.cfg.cluster.max_units, self.cfg.cluster.max_units, len(todo)))
                if not todo:
                    break
                granted = self.grant.wait(1, timeout=wait_timeout_s)
                n = bp.wave_size(granted, self.cfg.cluster.max_units, len(todo))
                if n < 1:
                    raise JobFailed(f"batch {self.cfg.name}: no GPU lent for {wait_timeout_s:.0f}s; "
                                    f"{len(todo)} unit(s) left (rerun to resume)")
                self._wave(bp.next_wave(todo, n, self.cfg.cluster.units_per_actor), n, plan, prompts)
        finally:
            self.grant.demand(0)
            stop_keeper(self.keeper)
        summary = read_back(self.out, plan)
        summary.update({"waves": len(self.waves), "stops": self.stops, "resumed": resumed,
                        "units": len(units), "units_skipped_at_start": skipped_at_start,
                        "checkpoint_tag": plan["checkpoint_tag"], "wall_s": round(time.time() - t0, 3)})
        return summary

    def _wave(self, units: list[bp.Unit], n: int, plan: dict, prompts: list[str] | None) -> None:
        import ray
        from ray.data import ActorPoolStrategy

        res = self.cfg.cluster.gpu_resource
        gpu = {"num_gpus": 1} if res == "GPU" else {"resources": {res: 1}}
        ds = ray.data.from_items([{"unit": json.dumps(u.as_dict())} for u in units],
                                 override_num_blocks=len(units))
        if self.actor_env is not None:        # the standbys' runtime_env: Ray hands the actors their processes
            gpu["runtime_env"] = self.actor_env
        ds = ds.map_batches(UnitWorker, batch_size=1, compute=ActorPoolStrategy(size=n), num_cpus=0,
                            max_restarts=0, fn_constructor_kwargs={
                                "output": self.cfg.output, "plan": plan, "eval_batch": self.cfg.eval.batch_size,
                                "prompts": prompts, "tenant": f"batch:{self.cfg.name}", "gpu_resource": res},
                            **gpu)
        wave = {"actors": n, "units": len(units), "started": time.time(), "done": 0, "stopped": None}
        self.waves.append(wave)
        stop, errors = threading.Event(), []

        def consume():
            try:
                for batch in ds.iter_batches(batch_size=None, prefetch_batches=0):
                    wave["done"] += len(batch["unit_id"])
                    if stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - a stopped or broken wave: its units are redone
                errors.append(exc)

        log.info("batch %s: wave %d on %d GPU actor(s), %d unit(s)", self.cfg.name, len(self.waves), n, len(units))
        thread = threading.Thread(target=consume, name="batch-wave", daemon=True)
        thread.start()
        stopped_at = more_since = None
        killed: list[str] | None = None
        early: list[str] = []
        while thread.is_alive():
            thread.join(0.1)
            if not thread.is_alive():
                continue
            if stopped_at is not None:
                if killed is None and time.monotonic() - stopped_at > self.cfg.cluster.grace_s:
                    killed = self._kill_stuck_actors(wave)
                continue
            allowed = self.grant.allowed()
            if allowed < n:
                stopped_at = time.monotonic()
                stop.set()
                log.info("batch %s: grant fell below %d: stopping the wave (%d of %d unit(s) done)",
                         self.cfg.name, n, wave["done"], len(units))
                # an actor still being created (its process starting, its constructor loading the model)
                # runs no unit: nothing to finish, so it goes now, not after the grace (a demo's hand-backs
                # of waves stopped while their actor started cold: 6.6-12.6 s)
                early = self._kill_stuck_actors(wave, not_alive_only=True)
            elif bp.regrow(n, allowed, self.cfg.cluster.max_units, len(units) - wave["done"]):
                more_since = more_since or time.monotonic()
                if time.monotonic() - more_since >= REGROW_AFTER_S:
                    wave["regrow"] = True
                    stop.set()             # not a reclaim: the next wave runs on the larger grant
                    log.info("batch %s: grant rose to %d: the next wave takes it", self.cfg.name, allowed)
                    break
            else:
                more_since = None
        if wave.get("regrow"):
            thread.join(self.cfg.cluster.grace_s)
        if stopped_at is not None:
            released_s = self._wait_released(stopped_at)
            stop_rec = {"at": time.time(), "done": wave["done"], "units": len(units),
                        "stop_s": round(time.monotonic() - stopped_at, 3), "released_s": released_s,
                        "killed_actors": len(early) + len(killed or [])}
            wave["stopped"] = stop_rec
            self.stops.append(stop_rec)
            try:     # on the output too: the job's own record survives a driver stopped before its summary
                self.out.put_bytes(f"{STOPS_DIR}/{stop_rec['at']:.3f}.json", json.dumps(stop_rec).encode())
            except Exception as exc:  # noqa: BLE001 -- the summary still has it
                log.warning("batch %s: wave stop not recorded on the output: %s", self.cfg.name, exc)
            log.info("batch %s: wave stopped; its GPUs free %.2fs after the grant fell", self.cfg.name,
                     released_s if released_s is not None else -1)
        elif errors:
            log.warning("batch %s: wave ended with %s: %s (its uncommitted units are redone)", self.cfg.name,
                        type(errors[0]).__name__, errors[0])
        wave["ended"] = time.time()

    def _kill_stuck_actors(self, wave: dict, not_alive_only: bool = False) -> list[str]:
        """The wave was told to stop a grace ago and its reader still waits: its pool actor is not running a
        unit that would end it (one waits for a GPU no one lent -- its node died with the lease, Data
        started another -- while Data's executor spins a core). Kill the wave's map actors: the reader then
        fails at once and the wave's uncommitted units are redone. `not_alive_only`: at the stop itself,
        only the actors not created yet (no unit runs in them). Returns the ids killed."""
        from spotfill.ray_compat import kill_actor_id
        try:
            actors = self._wave_actors()
        except Exception as exc:  # noqa: BLE001 - the state API is best effort; tried again next wave
            log.warning("batch %s: cannot list the stuck wave's actors: %s", self.cfg.name, exc)
            return []
        if not_alive_only:
            actors = [a for a in actors if str(a.state) != "ALIVE"]
            if not actors:
                return []
        killed = []
        for a in actors:
            try:
                if kill_actor_id(a.actor_id):
                    killed.append(a.actor_id)
            except Exception as exc:  # noqa: BLE001 - gone meanwhile
                log.debug("kill %s: %s", a.actor_id, exc)
        if not_alive_only:
            log.info("batch %s: wave %d stopped while %d of its actor(s) were still being created (%s): killed "
                     "at once, no unit ran in them", self.cfg.name, len(self.waves), len(killed),
                     sorted({str(a.state) for a in actors}))
            return killed
        log.warning("batch %s: wave %d did not stop %.0fs after its grant fell (%d of %d unit(s) done; "
                    "actors %s): killed %d map actor(s), its uncommitted units are redone", self.cfg.name,
                    len(self.waves), self.cfg.cluster.grace_s, wave["done"], wave["units"],
                    sorted({str(a.state) for a in actors}) or "none", len(killed))
        return killed

    def _wave_actors(self) -> list:
        from ray.util.state import list_actors
        import ray
        job = ray.get_runtime_context().get_job_id()
        return [a for a in list_actors(filters=[("job_id", "=", job), ("state", "!=", "DEAD")], limit=1000)
                if "MapWorker" in (a.class_name or "")]

    def _wait_released(self, since: float, timeout: float = 30.0) -> float | None:
        """Seconds from the stop until no map actor of this job is alive (None: not within `timeout`)."""
        while time.monotonic() - since < timeout:
            try:
                if not self._wave_actors():
                    return round(time.monotonic() - since, 3)
            except Exception as exc:  # noqa: BLE001 - the state API is best effort here
                log.debug("state API: %s", exc)
                return None
            time.sleep(0.1)
        return None


def run_batch(cfg, runtime_env: dict | None = None, wait_timeout_s: float | None = None, grant=None) -> dict:
    """jobs/batch_infer.py: plan (exit 2 on bad input before Ray starts), connect, take the grant (the
    arbiter's, or a fixed one with `grant.units`), run, and add the arbiter's reclaims of this tenant."""
    from spotfill.fillin.grant import ArbiterGrant, FixedGrant
    from spotfill.fillin.wiring import connect_ray

    job = BatchJob(cfg, None, runtime_env)
    job.prepare()
    connect_ray(runtime_env or {})
    own = grant is None
    if grant is None:
        grant = (FixedGrant(cfg.grant.units, cfg.cluster.grace_s) if cfg.grant.units else
                 ArbiterGrant("batch", cfg.name, max_units=cfg.cluster.max_units, grace_s=cfg.cluster.grace_s,
                              gpu_resource=cfg.cluster.gpu_resource, runtime_env=runtime_env,
                              demand=0))   # its wave loop states the demand once it can start a wave
    job.grant = grant
    try:
        summary = job.run(wait_timeout_s)
    finally:
        if own:
            grant.close()
    arbiter = getattr(grant, "arbiter", None)
    if arbiter is not None:
        try:
            rec = tenant_reclaims(arbiter, getattr(grant, "tenant", f"batch:{cfg.name}"))
            summary["reclaims"] = len(rec)
            summary["handback_seconds"] = [r.get("reclaim_s") for r in rec]
        except Exception as exc:  # noqa: BLE001 - the summary stands without the arbiter's view
            log.warning("batch %s: the arbiter's reclaims were not read: %s", cfg.name, exc)
    return summary


# -- the result, read back ----------------------------------------------------------------------------
def read_back(out, plan: dict | None = None) -> dict:
    """report.json's fillin.batch from what the output holds: every parquet part a reader of the output
    sees (committed or not), its ids against the plan's targets; eval loss/perplexity from the rows."""
    import pyarrow.parquet as pq
    plan = plan or json.loads(out.get_bytes(bp.PLAN_KEY))
    units = units_of(plan)
    ids, nll, tok = [], [], []
    parts = {k: v for kind in bp.KINDS for k, v in out.list(f"{kind}/").items() if k.endswith(".parquet")}
    for key in sorted(parts):
        table = pq.read_table(io.BytesIO(out.get_bytes(key)))
        ids.extend(table.column("id").to_pylist())
        if key.startswith("eval/"):
            nll.extend(table.column("nll").to_pylist())
            tok.extend(table.column("tokens").to_pylist())
    result = bp.tally(bp.target_ids(units, plan["prompt_ids"]), ids)
    done = committed(out, units)
    result.update({"output": out.uri, "parts": len(parts), "units_committed": len(done),
                   "units_uncommitted": len(units) - len(done), "checkpoint_step": plan.get("checkpoint_step")})
    result["stops"] = [json.loads(out.get_bytes(k)) for k in sorted(out.list(f"{STOPS_DIR}/"))]
    if plan["eval_rows"]:
        m = bp.eval_metrics(nll, tok)
        result["eval"] = {"rows": len(nll), "tokens": m["tokens"], "loss": m["loss"], "perplexity": m["perplexity"]}
    if plan["prompt_ids"]:
        result["generate"] = {"rows": sum(1 for i in ids if i.startswith("generate/"))}
    return result


def tenant_reclaims(arbiter, tenant: str) -> list[dict]:
    """The arbiter's reclaim events for `tenant` (claim -> its GPUs free, reclaim_s), from its journal."""
    import ray
    events = ray.get(arbiter.journal_since.remote(0), timeout=30)["events"]
    return [{k: e.get(k) for k in ("t", "node_id", "reclaim_s", "cause", "job", "forced") if k in e}
            for e in events if e.get("kind") == "reclaim" and e.get("tenant") == tenant]

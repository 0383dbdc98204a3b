"""Scenario files (CONTRACTS): the timeline `spotfill demo --scenario` runs on the embedded cluster (pure).

    cluster:  {gpu_resource: GPU, nodes: [{gpus: 2}, {gpus: 2}]}
    training: {model: tiny, workers: [1, 4], steps: 200, global_batch: 16, checkpoint_every: 20, ...}
    fillin:   {serve: {enabled: true, load_rps: 2}}          # Serve on the GPUs training leaves spare
              # also batch: {enabled, rows, prompts}, sweep: {enabled, trials, steps} and reclaim_order: [sweep, batch, serve] (sim/fillin_spec.py)
    events:   [{at_step: 30, action: drain_node, node: 1, deadline_s: 20}, ...]

Actions: drain_node, remove_node, kill_node, freeze_node (SIGSTOP every process of the node: it goes silent,
no TCP reset, as a host that vanished), add_node, storage_outage, corrupt_checkpoint (flip a byte in every file
of the newest committed checkpoint in storage; a restore that reads it from storage must quarantine it and go
past it), stale_writer (the previous attempt's writer commits, moves `latest` and deletes: every write refused)
swap_shards (two data shards exchange their contents in storage; a worker that reads one fails the job
with one line naming it: sim/data_faults.py) and preempt_nodes (several nodes at once, with or without
notice: sim/mass_spec.py).
A node event's `node` is an index, or (with fill-in on) a pick made when the event fires: `most_training`
(the node where training holds the most GPUs) or `most_lent` (where fill-in holds the most).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotfill.config.job import TrainingConfig, from_mapping, load_yaml
from spotfill.config.errors import ConfigError
from spotfill.sim.mass_spec import MASS_ACTION, MASS_KEYS, check_mass_refs, parse_mass

ACTIONS = {
    # action: (required keys, optional keys)
    "drain_node": ({"node"}, {"deadline_s", "remove"}),
    "add_node": (set(), {"gpus"}),
    "kill_node": ({"node"}, set()),
    "freeze_node": ({"node"}, set()),       # SIGSTOP every process of the node: no TCP reset, no answer
    "remove_node": ({"node"}, {"deadline_s"}),
    "storage_outage": ({"duration_s"}, set()),
    "corrupt_checkpoint": (set(), set()),   # flip a byte in every file of the newest committed checkpoint
    "stale_writer": (set(), set()),         # the previous attempt's writer commits (sim/stale_writer.py)
    "swap_shards": (set(), {"shards"}),     # two data shards exchange their contents in storage
    # autoscaling clusters: close (available: false) or reopen the fake cloud's market for a node type
    "market": ({"node_type", "available"}, {"how"}),
    # several nodes in one pass: `nodes` or `count`, with a notice each (drain + deadline) or killed at once
    MASS_ACTION: (set(), MASS_KEYS),
}
TRIGGERS = {"at", "at_step"}
# Any event may also wait until training runs on at least this many workers (e.g. grown onto new nodes),
# until an earlier event of the list (its index) has fired: `after`, and until every node training runs on
# (the event's own node aside) has a warm spare (started) for each of its workers: `spares_ready` (a loss timed
# onto a run whose survivors can restart warm; waited for at most SPARES_WAIT_S, then it fires and says so),
# and until the next worker group has begun its start (its `attempt` event: placed, training function entered)
# and has not stepped yet: `during_restart` (a notice or loss timed into a restart's start or restore).
MODIFIERS = {"min_world", "after", "spares_ready", "during_restart"}
SPARES_WAIT_S = 120.0
MARKET_HOW = ("unfulfilled", "refuse")
# `node` of a node event: an index, or one of these picks, made from the arbiter's GPUs-by-owner view when
# the event fires (where Ray places workers and replicas is not known up front)
NODE_PICKS = ("most_training", "most_lent")


@dataclass(frozen=True)
class Event:
    index: int
    action: str
    at: float | None = None
    at_step: int | None = None
    node: int | str | None = None
    deadline_s: float = 20.0
    remove: bool = True
    gpus: int = 2
    duration_s: float = 0.0
    node_type: str | None = None
    available: bool = True
    how: str = "unfulfilled"
    min_world: int | None = None
    after: int | None = None            # fires only once the event at this index of the list has fired
    spares_ready: bool = False          # fires only once the group's other nodes have ready warm spares
    during_restart: bool = False        # fires only while a group that began after it was due has not stepped
    picked: str | None = None           # the pick (NODE_PICKS) `node` was resolved from when it fired
    shards: tuple[int, int] = (0, 1)    # swap_shards: the two shards (indices in the dataset's manifest)
    nodes: tuple[int, ...] | None = None  # preempt_nodes: these node indices ...
    count: int | None = None            # ... or the `count` alive nodes training's group uses most
    notice: bool = True                 # preempt_nodes: a drain with deadline_s each (false: killed at once)
    allow_all: bool = False             # preempt_nodes: may leave no GPU node

    def describe(self) -> str:
        when = f"at step {self.at_step}" if self.at_step is not None else f"at {self.at:g}s"
        if self.min_world:
            when += f" once training runs {self.min_world} workers"
        if self.after is not None:
            when += f", after event {self.after}"
        if self.spares_ready:
            when += ", once the other nodes' spares are ready"
        if self.during_restart:
            when += ", while the next worker group starts (before its first step)"
        picks = {"most_training": "the node training uses most", "most_lent": "the node fill-in uses most"}
        node = picks.get(self.node) if isinstance(self.node, str) else f"node {self.node}" + (
            f" ({picks[self.picked]})" if self.picked else "")
        what = {"drain_node": f"drain {node} (deadline {self.deadline_s:g}s)",
                "add_node": f"add a node with {self.gpus} GPUs",
                "kill_node": f"kill {node}",
                "freeze_node": f"freeze {node} (SIGSTOP, no TCP reset)",
                "remove_node": f"remove {node}",
                "storage_outage": f"storage outage for {self.duration_s:g}s",
                "corrupt_checkpoint": "corrupt the newest committed checkpoint",
                "stale_writer": "a stale writer of the previous attempt commits",
                "swap_shards": f"swap the contents of data shards {self.shards[0]} and {self.shards[1]}",
                "market": f"{'open' if self.available else 'close'} the market for {self.node_type}"
                          + ("" if self.available else f" ({self.how})"),
                MASS_ACTION: self._describe_mass()}[self.action]
        return f"{what} {when}"

    def _describe_mass(self) -> str:
        if self.action != MASS_ACTION:
            return ""
        which = (f"nodes {', '.join(map(str, self.nodes))}" if self.nodes is not None
                 else f"the {self.count} nodes training uses most")
        how = f"each with a notice, deadline {self.deadline_s:g}s" if self.notice else "no notice: killed"
        return f"preempt {which} at once ({how})"


AUTOSCALER_KEYS = {"node_types", "idle_timeout_s", "allocate_timeout_s", "max_workers"}


@dataclass
class ClusterSpec:
    gpu_resource: str = "GPU"
    nodes: list[dict] = field(default_factory=lambda: [{"gpus": 2}, {"gpus": 2}])
    # Ray's autoscaler (v2, fake multi-node provider) adds nodes of these types on demand:
    # {node_types: {name: {gpus, market, min_workers, max_workers, priority}}, idle_timeout_s, allocate_timeout_s,
    #  max_workers (worker nodes of all types together)}
    autoscaler: dict = field(default_factory=dict)

    def node_types(self) -> list:
        from spotfill.sim.autoscaler_config import parse_node_types
        return parse_node_types(self.autoscaler.get("node_types"), "cluster.autoscaler.node_types") \
            if self.autoscaler else []

    def gpu_slots(self) -> int:
        """The most GPU slots the cluster can have: its static nodes' and what the autoscaler may launch."""
        types = self.node_types()
        static = sum(n.get("gpus", 1) for n in self.nodes)
        if types and "max_workers" in self.autoscaler:
            return static + self.autoscaler["max_workers"] * max(t.gpus for t in types)
        return static + sum(t.gpus * t.max_workers for t in types)

    def validate(self, path: str) -> None:
        if not isinstance(self.autoscaler, dict):
            raise ConfigError(f"{path}.autoscaler", self.autoscaler, accepted="a mapping")
        for key in self.autoscaler:
            if key not in AUTOSCALER_KEYS:
                raise ConfigError(f"{path}.autoscaler.{key}", self.autoscaler[key], reason="unknown key",
                                  accepted=sorted(AUTOSCALER_KEYS))
        for key in ("idle_timeout_s", "allocate_timeout_s"):
            if key in self.autoscaler:
                _number(f"{path}.autoscaler.{key}", self.autoscaler[key], 1)
        if "max_workers" in self.autoscaler:
            _number(f"{path}.autoscaler.max_workers", self.autoscaler["max_workers"], 1, integer=True)
        self.node_types()
        if not self.nodes and not self.autoscaler:
            raise ConfigError(f"{path}.nodes", self.nodes, accepted="at least one node (or an autoscaler)")
        for i, node in enumerate(self.nodes):
            if not isinstance(node, dict) or set(node) - {"gpus"}:
                raise ConfigError(f"{path}.nodes[{i}]", node, accepted="{gpus: N}")
            gpus = node.get("gpus", 1)
            if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
                raise ConfigError(f"{path}.nodes[{i}].gpus", gpus, accepted="an integer >= 1")


SERVE_KEYS = {"enabled": False, "load_rps": 2.0, "max_replicas": None, "launch_nodes": False, "floor_replicas": 0,
              "standby_per_node": 1}


@dataclass
class FillinSpec:
    """`fillin.serve`: Ray Serve generation on the GPUs training leaves spare, under a steady HTTP load of
    `load_rps` requests per second for the whole scenario (0: Serve deployed, no load; `max_replicas`:
    default every GPU slot). `launch_nodes` (autoscaled clusters only, default false): let fill-in make the
    autoscaler launch nodes for Serve; by default it never does (docs/cluster-lifecycle.md). `floor_replicas`
    (default 0): replicas on the head node's CPU that answer while no lent replica runs (serving/app.py).
    `standby_per_node` (default 1, 0 off): warm standby processes per GPU node (serving/standby.py).
    `fillin.batch`, `fillin.sweep` and `fillin.reclaim_order`: sim/fillin_spec.py. `cpu_nice` (default 19,
    0 off) and `cpu_idle` (default true: SCHED_IDLE): fill-in processes run at this CPU priority, so
    training's host-side work is not slowed by them (fillin/cpu_priority.py). `turn_s` (default: the
    arbiter's, 300 s): with fewer spare GPUs than tenants, how long a batch job or sweep keeps a unit another
    tenant waits for (fillin/lending.py take_turns). `require_resumes` (default false): the invariant
    `fillin_reclaimed_and_resumed` -- each tenant gave GPUs back and carried on (sim/fillin_resumes.py)."""
    serve: dict = field(default_factory=dict)
    batch: dict = field(default_factory=dict)
    sweep: dict = field(default_factory=dict)
    reclaim_order: list | None = None
    cpu_nice: int = 19
    cpu_idle: bool = True
    turn_s: float | None = None
    require_resumes: bool = False

    def validate(self, path: str) -> None:
        if not isinstance(self.serve, dict):
            raise ConfigError(f"{path}.serve", self.serve, accepted="a mapping {enabled, load_rps, max_replicas}")
        for key in self.serve:
            if key not in SERVE_KEYS:
                raise ConfigError(f"{path}.serve.{key}", self.serve[key], reason="unknown key",
                                  accepted=sorted(SERVE_KEYS))
        serve = {**SERVE_KEYS, **self.serve}
        if not isinstance(serve["enabled"], bool):
            raise ConfigError(f"{path}.serve.enabled", serve["enabled"], accepted="true or false")
        rps = serve["load_rps"]
        if isinstance(rps, bool) or not isinstance(rps, (int, float)) or not 0 <= rps <= 100:
            raise ConfigError(f"{path}.serve.load_rps", rps, accepted="a number >= 0 and <= 100")
        mr = serve["max_replicas"]
        if mr is not None and (isinstance(mr, bool) or not isinstance(mr, int) or mr < 1):
            raise ConfigError(f"{path}.serve.max_replicas", mr, accepted="an integer >= 1")
        fl = serve["floor_replicas"]
        if isinstance(fl, bool) or not isinstance(fl, int) or not 0 <= fl <= 4:
            raise ConfigError(f"{path}.serve.floor_replicas", fl, accepted="an integer from 0 to 4")
        sb = serve["standby_per_node"]
        if isinstance(sb, bool) or not isinstance(sb, int) or not 0 <= sb <= 8:
            raise ConfigError(f"{path}.serve.standby_per_node", sb, accepted="an integer from 0 to 8 (0: none)")
        if not isinstance(serve["launch_nodes"], bool):
            raise ConfigError(f"{path}.serve.launch_nodes", serve["launch_nodes"], accepted="true or false")
        self.serve = serve
        from spotfill.sim.fillin_spec import batch_spec, reclaim_order, sweep_spec
        self.batch = batch_spec(self.batch, f"{path}.batch")
        self.sweep = sweep_spec(self.sweep, f"{path}.sweep")
        self.reclaim_order = reclaim_order(self.reclaim_order, f"{path}.reclaim_order")
        from spotfill.fillin.cpu_priority import configured_idle, configured_nice
        self.cpu_nice = configured_nice(self.cpu_nice, f"{path}.cpu_nice")
        self.cpu_idle = configured_idle(self.cpu_idle, f"{path}.cpu_idle")
        t = self.turn_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 5 <= t <= 86400):
            raise ConfigError(f"{path}.turn_s", t, accepted="seconds from 5 to 86400 (default: 300)")
        if not isinstance(self.require_resumes, bool):
            raise ConfigError(f"{path}.require_resumes", self.require_resumes, accepted="true or false")

    @property
    def serve_enabled(self) -> bool:
        return bool(self.serve.get("enabled"))

    @property
    def batch_enabled(self) -> bool:
        return bool(self.batch.get("enabled"))

    @property
    def sweep_enabled(self) -> bool:
        return bool(self.sweep.get("enabled"))


@dataclass
class Scenario:
    cluster: ClusterSpec
    training: TrainingConfig
    fillin: FillinSpec
    events: list[Event]
    name: str = "scenario"
    data_tokenizer: str = "bytes"       # `data.tokenizer`: what the corpus is prepared with (bytes, hf:/dir)

    def needs_controlled_storage(self) -> bool:
        return any(e.action == "storage_outage" for e in self.events)


def _number(path: str, value: Any, minimum: float = 0.0, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(path, value, accepted=f"{kind} >= {minimum:g}")
    return value


def parse_event(i: int, raw: Any) -> Event:
    path = f"events[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(path, raw, accepted="a mapping with `action` and `at` or `at_step`")
    action = raw.get("action")
    if action not in ACTIONS:
        raise ConfigError(f"{path}.action", action, accepted=sorted(ACTIONS))
    required, optional = ACTIONS[action]
    allowed = {"action"} | TRIGGERS | MODIFIERS | required | optional
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", raw[key], reason=f"unknown key for {action}", accepted=sorted(allowed))
    for key in required:
        if key not in raw:
            raise ConfigError(f"{path}.{key}", None, reason=f"required for {action}")
    triggers = TRIGGERS & set(raw)
    if len(triggers) != 1:
        raise ConfigError(path, raw, reason="needs exactly one trigger", accepted=sorted(TRIGGERS))
    kwargs: dict[str, Any] = {"index": i, "action": action}
    if "at" in raw:
        kwargs["at"] = float(_number(f"{path}.at", raw["at"]))
    else:
        kwargs["at_step"] = _number(f"{path}.at_step", raw["at_step"], 1, integer=True)
    if "node" in raw:
        if isinstance(raw["node"], str):
            if raw["node"] not in NODE_PICKS:
                raise ConfigError(f"{path}.node", raw["node"], accepted=f"an integer >= 0 or one of {list(NODE_PICKS)}")
            kwargs["node"] = raw["node"]
        else:
            kwargs["node"] = _number(f"{path}.node", raw["node"], 0, integer=True)
    if "deadline_s" in raw:
        kwargs["deadline_s"] = float(_number(f"{path}.deadline_s", raw["deadline_s"], 1))
    if "gpus" in raw:
        kwargs["gpus"] = _number(f"{path}.gpus", raw["gpus"], 1, integer=True)
    if "duration_s" in raw:
        kwargs["duration_s"] = float(_number(f"{path}.duration_s", raw["duration_s"], 0.1))
    if "min_world" in raw:
        kwargs["min_world"] = _number(f"{path}.min_world", raw["min_world"], 1, integer=True)
    if "after" in raw:
        kwargs["after"] = _number(f"{path}.after", raw["after"], 0, integer=True)
        if kwargs["after"] >= i:
            raise ConfigError(f"{path}.after", raw["after"], accepted=f"the index of an earlier event ({f'0..{i - 1}' if i else 'none: this is the first'})")
    if "spares_ready" in raw:
        if not isinstance(raw["spares_ready"], bool):
            raise ConfigError(f"{path}.spares_ready", raw["spares_ready"], accepted="true or false")
        kwargs["spares_ready"] = raw["spares_ready"]
    if "during_restart" in raw:
        if not isinstance(raw["during_restart"], bool):
            raise ConfigError(f"{path}.during_restart", raw["during_restart"], accepted="true or false")
        kwargs["during_restart"] = raw["during_restart"]
    if "node_type" in raw:
        if not isinstance(raw["node_type"], str) or not raw["node_type"]:
            raise ConfigError(f"{path}.node_type", raw["node_type"], accepted="a node type name")
        kwargs["node_type"] = raw["node_type"]
    if "available" in raw:
        if not isinstance(raw["available"], bool):
            raise ConfigError(f"{path}.available", raw["available"], accepted="true or false")
        kwargs["available"] = raw["available"]
    if "how" in raw:
        if raw["how"] not in MARKET_HOW:
            raise ConfigError(f"{path}.how", raw["how"], accepted=list(MARKET_HOW))
        kwargs["how"] = raw["how"]
    if "remove" in raw:
        if not isinstance(raw["remove"], bool):
            raise ConfigError(f"{path}.remove", raw["remove"], accepted="true or false")
        kwargs["remove"] = raw["remove"]
    if action == MASS_ACTION:
        kwargs.update(parse_mass(path, raw))
    if "shards" in raw:
        pair = raw["shards"]
        if not isinstance(pair, list) or len(pair) != 2 or any(isinstance(i, bool) or not isinstance(i, int)
                                                               or i < 0 for i in pair) or pair[0] == pair[1]:
            raise ConfigError(f"{path}.shards", pair, accepted="two different shard indices [a, b], integers >= 0 "
                              "(default [0, 1])")
        kwargs["shards"] = tuple(pair)
    return Event(**kwargs)


def _check_node_refs(events: list[Event], n_nodes: int, node_types: list | None = None) -> None:
    """Node indices: position in cluster.nodes; each add_node gets the next index, in firing order. With an
    autoscaler, nodes it launches get the next indices too, in launch order (up to the types' max_workers)."""
    names = {t.name for t in node_types or []}
    for e in events:
        if e.action == "market" and e.node_type not in names:
            raise ConfigError(f"events[{e.index}].node_type", e.node_type,
                              accepted=sorted(names) or "an autoscaler node type (cluster.autoscaler.node_types)")
    known = n_nodes + sum(1 for e in events if e.action == "add_node")
    if node_types:   # every launch (replacements too) takes a new index: no upper bound known up front
        known = 10 ** 6
    check_mass_refs(events, known, bool(node_types))
    for e in events:
        if isinstance(e.node, int) and e.node >= known:
            raise ConfigError(f"events[{e.index}].node", e.node,
                              accepted=f"0..{known - 1} (cluster.nodes plus added nodes)")


def parse_scenario(data: dict, name: str = "scenario") -> Scenario:
    if not isinstance(data, dict):
        raise ConfigError("scenario", data, accepted="a mapping")
    allowed = ["cluster", "training", "fillin", "events", "data"]
    for key in data:
        if key not in allowed:
            raise ConfigError(str(key), data[key], reason="unknown key", accepted=allowed)
    cluster = from_mapping(ClusterSpec, data.get("cluster"), "cluster")
    training = from_mapping(TrainingConfig, data.get("training"), "training")
    fillin = from_mapping(FillinSpec, data.get("fillin"), "fillin")
    raw_events = data.get("events") or []
    if not isinstance(raw_events, list):
        raise ConfigError("events", raw_events, accepted="a list")
    if isinstance(data.get("cluster"), dict) and "autoscaler" in data["cluster"] and "nodes" not in data["cluster"]:
        cluster.nodes = []     # an autoscaling cluster starts head-only unless static nodes are listed
        cluster.validate("cluster")
    events = [parse_event(i, e) for i, e in enumerate(raw_events)]
    if not (fillin.serve_enabled or fillin.batch_enabled or fillin.sweep_enabled):
        for e in events:
            if isinstance(e.node, str):
                raise ConfigError(f"events[{e.index}].node", e.node, reason="a pick needs fill-in on (the "
                                  "arbiter's view of who holds each node's GPUs)", accepted="a node index")
    node_types = cluster.node_types()
    for e in events:
        if e.action == "freeze_node" and cluster.autoscaler:
            raise ConfigError(f"events[{e.index}].action", e.action, reason="freezes a node of cluster.nodes: "
                              "not available with cluster.autoscaler", accepted=sorted(set(ACTIONS) - {"freeze_node"}))
    _check_node_refs(events, len(cluster.nodes), node_types)
    total = cluster.gpu_slots()
    if training.min_workers > total:
        raise ConfigError("training.workers", training.workers,
                          reason=f"min workers exceed the cluster's {total} GPUs")
    data_cfg = data.get("data") or {}
    if not isinstance(data_cfg, dict) or set(data_cfg) - {"tokenizer"}:
        raise ConfigError("data", data_cfg, accepted="a mapping {tokenizer: bytes | hf:/local/tokenizer}")
    tokenizer = data_cfg.get("tokenizer", "bytes")
    if not isinstance(tokenizer, str) or not (tokenizer == "bytes" or tokenizer.startswith("hf:")):
        raise ConfigError("data.tokenizer", tokenizer, accepted="bytes, or hf:/a/local/tokenizer/folder")
    return Scenario(cluster, training, fillin, events, name, tokenizer)


def pick_node(pick: str, owners: dict[str, dict], node_ids: list[str | None], alive) -> int | None:
    """The scenario index of the alive node `pick` names, from GPUs by owner per node id (the arbiter's
    `ownership` rows: training, serve / batch / sweep, reclaiming, idle): `most_training` -- the most GPUs
    held by training; `most_lent` -- the most held by fill-in (reclaiming ones included). Ties go to the
    lowest index; None when no alive node has any."""
    def held(row: dict) -> int:
        if pick == "most_training":
            return int(row.get("training", 0))
        return sum(int(v) for k, v in row.items() if k not in ("total", "idle", "training"))
    best, best_held = None, 0
    for index, node_id in enumerate(node_ids):
        if node_id is None or node_id not in owners or not alive(index):
            continue
        n = held(owners[node_id])
        if n > best_held:
            best, best_held = index, n
    return best


def load_scenario(path: str) -> Scenario:
    import os
    return parse_scenario(load_yaml(path, "--scenario"), name=os.path.splitext(os.path.basename(path))[0])


DEFAULT_SCENARIO = {
    # 5 GPU slots, training at most 4: the 5th (and any training cannot use) is lent to Serve, which
    # generates from the run's own checkpoints under a steady load; training takes it back when it needs it
    "cluster": {"gpu_resource": "GPU", "nodes": [{"gpus": 2}, {"gpus": 2}, {"gpus": 1}]},
    "training": {"model": "tiny", "workers": [1, 4], "steps": 240, "global_batch": 12,
                 "max_micro_batch": 3, "checkpoint_every": 20, "zero_stage": 2, "warmup_steps": 10},
    # batch (evaluation + generation over the run's checkpoint) and a 2-trial sweep share what Serve leaves
    # serve's floor: one replica on the head's CPU answers while training holds every GPU (its restarts)
    "fillin": {"serve": {"enabled": True, "load_rps": 2, "max_replicas": 2, "floor_replicas": 1},
               "batch": {"enabled": True, "rows": 96, "prompts": 16},
               "sweep": {"enabled": True, "trials": 2, "steps": 20},
               # the GPU slots are logical here: Serve generates on the CPUs training keeps busy, and in
               # SCHED_IDLE (the product default, right where the GPUs do the work) its replicas got no CPU
               # at all (a default demo answered 3 of 549 requests); nice 19 keeps them second
               "cpu_idle": False},
    "events": [
        {"at_step": 30, "action": "drain_node", "node": 1, "deadline_s": 30},
        {"at_step": 100, "action": "add_node", "gpus": 2},
        {"at_step": 170, "action": "kill_node", "node": 0},
    ],
}


def chaos_scenario(seed: int, steps: int = 180, n_events: int = 4, nodes: int = 2, gpus: int = 2,
                   outage: bool = True) -> dict:
    """A seeded random timeline of drains, hard kills, returning nodes and (optionally) a storage outage.

    Events are spaced evenly over the run; node choices keep at least one node alive, and the node
    numbering follows the scenario rules (added nodes get the next index in firing order)."""
    import random

    rng = random.Random(seed)
    alive, next_index = list(range(nodes)), nodes
    events: list[dict] = []
    gap = steps // (n_events + 1)
    for i in range(n_events):
        at_step = gap * (i + 1)
        choices = ["add_node"] + (["drain_node", "kill_node"] if len(alive) > 1 else [])
        if outage and not any(e["action"] == "storage_outage" for e in events):
            choices.append("storage_outage")
        action = rng.choice(choices)
        if action == "add_node":
            events.append({"at_step": at_step, "action": action, "gpus": gpus})
            alive.append(next_index)
            next_index += 1
        elif action == "storage_outage":
            events.append({"at_step": at_step, "action": action, "duration_s": rng.choice([5, 10])})
        else:
            node = rng.choice(alive)
            alive.remove(node)
            event = {"at_step": at_step, "action": action, "node": node}
            if action == "drain_node":
                event["deadline_s"] = rng.choice([15, 30])
            events.append(event)
    return {
        "cluster": {"gpu_resource": "GPU", "nodes": [{"gpus": gpus}] * nodes},
        "training": {"model": "tiny", "workers": [1, 4], "steps": steps, "global_batch": 12,
                     "max_micro_batch": 3, "checkpoint_every": 20, "seed": seed},
        "events": events,
    }


# The default `spotfill demo` story on an autoscaling cluster: DEFAULT_SCENARIO's training (and its three
# fill-in tenants) on a head-only cluster that Ray's autoscaler (v2, fake multi-node provider) scales with
# cluster.yaml-like spot and on-demand types of 3 GPU slots. Training asks for 4 workers: the autoscaler
# launches 2 nodes (6 slots); training runs 3 workers on one and 1 on the other, whose 2 other slots are lent
# to Serve, the batch job and the sweep (fill-in never makes the autoscaler launch a node, nor keeps one from
# scaling down). Then:
# 1. the cloud runs out of capacity (both markets closed) and the node training uses most is lost outright:
#    the autoscaler can replace nothing, so training restarts at 3 on the node it has left, on the GPUs it
#    takes back from fill-in there (a hand-back from each tenant: a sweep trial pauses with a checkpoint,
#    a batch wave stops, a Serve replica drains);
# 2. capacity returns: the autoscaler replaces the node, training grows back to 4, fill-in gets the spare
#    slots again (the paused trial resumes from its checkpoint);
# 3. a spot notice for the node fill-in uses most: its leases are reclaimed at once, training takes an
#    emergency checkpoint and restarts, and the autoscaler replaces the node.
# Nodes are picked when the event fires (`most_training`, `most_lent`): where Ray places workers and
# replicas is not known up front. No node is added by the scenario.
AUTOSCALING_SCENARIO = {
    **DEFAULT_SCENARIO,
    # Training on 3 workers after the loss steps ~11 steps/s here: from the markets' reopening (step 45) it
    # must outlast the autoscaler's launch (6-11 s measured) and the grow, or the story's last part -- grown
    # back to 4, then the spot notice -- has no steps left to happen in (a quick run of 180 steps grew back
    # at its step 179 and the notice came after its last step); 840: the sweep's two long trials finish
    # while training runs (below)
    "training": {**DEFAULT_SCENARIO["training"], "steps": 840},
    # All three tenants, sized to finish while training runs: on an autoscaled cluster fill-in lends only on
    # nodes training uses, so what they have not finished when training ends waits for the next run
    # (docs/cluster-lifecycle.md)
    "fillin": {**DEFAULT_SCENARIO["fillin"], "serve": {**DEFAULT_SCENARIO["fillin"]["serve"], "max_replicas": 1},
               "batch": {"enabled": True, "rows": 6000, "prompts": 8},
               # trials long next to a trial's start (setup 14-23 s here): with 3 trials of 100 steps (5-12 s
               # of compute each) every reclaim in two demos found the sweep starting or finishing a trial,
               # none paused one (the invariant failed); 2 of 200 are mostly computing while they hold a GPU.
               # 6000 rows: ~34 s of compute here, more than one 30 s turn, so the job is always taken back
               # at least once (with 2000 rows a demo's job, started warm, finished inside its first turn and
               # was never reclaimed); what it has not written when training ends is left for its rerun
               # (sim/fillin_batch.py: on an autoscaled cluster no GPU is lent after training)
               "sweep": {"enabled": True, "trials": 2, "steps": 200},
               # two spare GPUs, three tenants: the batch job and the sweep take turns of 30 s of computing (a
               # unit's start, 10-25 s here, comes on top), and each must be taken back and carry on (the invariant)
               "turn_s": 30, "require_resumes": True},
    "cluster": {"gpu_resource": "GPU", "autoscaler": {
        "max_workers": 2, "idle_timeout_s": 5, "allocate_timeout_s": 8, "node_types": {
            "gpu_spot": {"gpus": 3, "market": "spot", "max_workers": 2, "priority": 10},
            "gpu_ondemand": {"gpus": 3, "market": "on-demand", "max_workers": 1, "priority": 0}}}},
    "events": [
        {"at_step": 25, "min_world": 4, "action": "market", "node_type": "gpu_spot", "available": False},
        {"at_step": 25, "min_world": 4, "action": "market", "node_type": "gpu_ondemand", "available": False},
        {"at_step": 25, "min_world": 4, "action": "kill_node", "node": "most_training"},
        # after the loss (event 2): the first grow to 4 waits for the new node's warm spares, so the loss can
        # come after step 45
        {"at_step": 45, "after": 2, "action": "market", "node_type": "gpu_spot", "available": True},
        {"at_step": 45, "after": 2, "action": "market", "node_type": "gpu_ondemand", "available": True},
        # 15 s: the save commits by deadline - 5 s, and the notice reaches training seconds after the drain
        # while the autoscaler starts the replacement node on the same cores
        {"at_step": 100, "min_world": 4, "action": "drain_node", "node": "most_lent", "deadline_s": 15},
    ],
}


def missing_spares(group: dict[str, int], ready: dict[str, int], leaving: str | None) -> dict[str, int]:
    """Per node training runs on (`group`: node -> workers; the event's node `leaving` aside), the warm
    spares it lacks for a restart there ({} when every one has a spare for each of its workers)."""
    return {node: n - ready.get(node, 0) for node, n in group.items()
            if node != leaving and ready.get(node, 0) < n}


def in_restart(starting: dict | None, due_since: float) -> bool:
    """Whether an event with `during_restart`, due since `due_since` (unix s), fires now: `starting` is the
    newest `attempt` event while its group has not stepped yet (None once it stepped), and that group began
    after the event became due -- a start the event was timed into, not the one running when it came due."""
    return starting is not None and starting["t"] >= due_since

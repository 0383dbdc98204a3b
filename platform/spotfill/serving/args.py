"""The arguments of the Serve generation app (spotfill/serving/app.py: `serve run serving.app:app k=v`, the `args` of
serving/config.yaml, `spotfill serve`), checked when the app is built: a bad value is one line naming the key,
the value and what is accepted -- at deploy, never later as 503s.

Checks that need the cluster or the storage (`check_deployable`): the checkpoint URI opens and its newest
committed checkpoint (if any) is readable; a custom GPU resource is declared by some node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from spotfill.config.errors import ConfigError

FIELD = "serving.app args"


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
    max_tokens: int = 0                  # cap on tokens per request; 0: up to the model's context
    max_batch: int = 8                   # requests decoded together per replica (continuous batching)
    max_queue_wait_s: float = 15.0       # a request waits this long for a replica starting or replacing
                                         # a lost one (then 503); 0: answer 503 at once
    draft: str = ""                      # speculative decoding: "" (off), self:L, or a run's storage URI
    num_draft_tokens: int = 4            # the most tokens drafted per verify step (k adapts below it)
    reload_s: float = 2.0                # how often to look for a newer checkpoint
    retry_after_s: int = 1
    cpu_nice: int = 19                   # CPU priority of the replicas' processes: 19 lowest, 0 off
    cpu_idle: bool = True                # ... and the SCHED_IDLE policy (spotfill/fillin/cpu_priority.py:
                                         # training's host work first)
    floor_replicas: int = 0              # replicas on capacity the app owns, not lent (FLOOR deployment):
                                         # they answer while no lent replica runs (training restarting or
                                         # growing, nothing lent yet); lent replicas add throughput above
    floor_device: str = "cpu"            # what a floor replica computes on: cpu, or gpu (Ray's GPU resource
                                         # on a node the app owns, e.g. an on-demand node type)
    floor_cpus: float = 1.0              # Ray CPUs a floor replica asks for (0: none reserved)
    floor_node: str = "head"             # head (the head node: on-demand in cluster.yaml) or any
    standby_per_node: int = 1            # warm standby processes per node with lendable GPUs (serving/
                                         # standby.py): imports done, the checkpoint in host memory, no GPU
                                         # held; a lend there starts its replica on one. 0: cold starts only

    @classmethod
    def parse(cls, args: dict | None) -> "ServeArgs":
        args = dict(args or {})
        unknown = sorted(set(args) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{FIELD} {unknown[0]}", accepted=", ".join(f.name for f in fields(cls)))
        out = {}
        for f in fields(cls):
            if f.name not in args:
                continue
            kind = type(getattr(cls, f.name))
            if kind is bool:
                from spotfill.fillin.cpu_priority import configured_idle
                out[f.name] = configured_idle(args[f.name], f"{FIELD} {f.name}")
                continue
            if f.name == "fillin" and isinstance(args[f.name], bool):     # YAML's true / false
                out[f.name] = str(args[f.name]).lower()
                continue
            try:
                out[f.name] = _coerce(kind, args[f.name])
            except (ValueError, TypeError, OverflowError):
                raise ConfigError(f"{FIELD} {f.name}", args[f.name],
                                  accepted={int: "an integer", float: "a number", str: "a string"}[kind]) from None
        parsed = cls(**out)
        parsed._check()
        return parsed

    def _check(self) -> None:
        def need(ok: bool, name: str, accepted: str) -> None:
            if not ok:
                raise ConfigError(f"{FIELD} {name}", getattr(self, name), accepted=accepted)
        if not self.checkpoint:
            raise ConfigError(f"{FIELD} checkpoint", reason="required",
                              accepted="a run's storage URI, e.g. file:///runs/demo or s3://bucket/run")
        self._storage("checkpoint", self.checkpoint)
        from spotfill.config.presets import PRESETS
        need(self.model == "auto" or self.model in PRESETS, "model", f"auto, {', '.join(PRESETS)}")
        need(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_:\-]*", self.gpu_resource)), "gpu_resource",
             "GPU, or the name of a custom resource the GPU nodes declare (e.g. GPU_SLOT)")
        need(self.replicas >= 0, "replicas", "an integer >= 0 (0 under the fill-in arbiter, which sets the count)")
        need(self.max_replicas >= 1, "max_replicas", "an integer >= 1")
        need(self.fillin.lower() in ("auto", "true", "false"), "fillin", "auto, true, false")
        need(self.max_tokens >= 0, "max_tokens", "an integer >= 1, or 0 for the model's context")
        need(1 <= self.max_batch <= 256, "max_batch", "an integer from 1 to 256")
        need(0 <= self.max_queue_wait_s <= 600, "max_queue_wait_s", "seconds from 0 to 600")
        need(1 <= self.num_draft_tokens <= 16, "num_draft_tokens", "an integer from 1 to 16")
        need(self.reload_s >= 0.5, "reload_s", "seconds >= 0.5 (each look lists the storage)")
        need(self.retry_after_s >= 1, "retry_after_s", "whole seconds >= 1")
        need(0 <= self.floor_replicas <= 64, "floor_replicas", "an integer from 0 to 64")
        need(self.floor_device in ("cpu", "gpu"), "floor_device", "cpu, gpu")
        need(0 <= self.floor_cpus <= 256, "floor_cpus", "a number of CPUs from 0 to 256")
        need(self.floor_node in ("head", "any"), "floor_node", "head, any")
        need(0 <= self.standby_per_node <= 8, "standby_per_node", "an integer from 0 to 8 (0: no standby)")
        from spotfill.fillin.cpu_priority import configured_nice
        configured_nice(self.cpu_nice, f"{FIELD} cpu_nice")
        from spotfill.generation.replica import DraftSpec
        try:
            DraftSpec.parse(self.draft, f"{FIELD} draft")
        except ConfigError as exc:
            raise ConfigError(f"{FIELD} draft", self.draft, reason=exc.reason,
                              accepted="self:L (the model's first L layers), or a run's storage URI") from None

    @property
    def under_arbiter(self) -> bool:
        """The fill-in arbiter sets the Generator's replica count (the app registers itself with it)."""
        fillin = self.fillin.lower()
        return fillin == "true" or (fillin == "auto" and self.replicas == 0)

    @staticmethod
    def _storage(name: str, uri: str):
        from spotfill.storage.base import open_storage
        try:
            return open_storage(uri)
        except ConfigError as exc:
            raise ConfigError(f"{FIELD} {name}", exc.value, reason=exc.reason, accepted=exc.accepted) from None

    @property
    def draft_spec(self):
        from spotfill.generation.replica import DraftSpec
        return DraftSpec.parse(self.draft)


def _coerce(kind, value):
    """`value` as `kind`; strings too (`serve run app key=value` passes strings)."""
    if isinstance(value, bool):
        raise ValueError
    if kind is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    number = float(value)
    if kind is int:
        if number != int(number):
            raise ValueError
        return int(number)
    return number


def check_deployable(args: ServeArgs, cluster_resources: dict | None = None) -> dict | None:
    """The checks that read the storage (and the cluster, when given): the newest committed checkpoint of
    `checkpoint` and of a URI draft is readable (None when none is committed yet); a custom `gpu_resource`
    is declared by a node. Returns the checkpoint's manifest."""
    from spotfill.storage.checkpoint_store import CheckpointStore
    if cluster_resources is not None and args.gpu_resource != "GPU" and args.gpu_resource not in cluster_resources:
        declared = sorted(k for k in cluster_resources if not k.startswith("node:") and k not in
                          ("CPU", "memory", "object_store_memory") and not k.startswith("accelerator_type"))
        raise ConfigError(f"{FIELD} gpu_resource", args.gpu_resource, reason="no node of the cluster declares it",
                          accepted=", ".join(["GPU", *declared]))
    latest = None
    for name, uri in (("checkpoint", args.checkpoint), ("draft", args.draft if args.draft_spec.kind == "uri" else "")):
        if not uri:
            continue
        store = CheckpointStore(ServeArgs._storage(name, uri))
        try:
            found = store.latest()
        except Exception as exc:  # noqa: BLE001 - unreadable: say so at deploy, not as 503s later
            raise ConfigError(f"{FIELD} {name}", uri, reason=f"its committed checkpoint cannot be read "
                              f"({type(exc).__name__}: {str(exc)[:120]})") from None
        if name == "checkpoint":
            latest = found
        elif found is None:
            raise ConfigError(f"{FIELD} draft", uri, reason="no committed checkpoint there",
                              accepted="a run's storage URI with a committed checkpoint, or self:L")
    return latest

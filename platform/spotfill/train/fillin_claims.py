"""Training first: claim GPUs from the fill-in arbiter before Ray Train starts, restarts or grows a group.

Ray Train's controller calls `before_controller_execute_resize_decision(decision)` (a ControllerCallback
DeveloperAPI, Ray 2.60) right before it starts a worker group of `decision.num_workers` workers. The
callback asks the arbiter for those GPUs; the arbiter reclaims fill-in leases and answers when they are
free (bounded by `deadline_s`). A broken or missing arbiter never stops training: every error is swallowed
and logged, and the group starts as it would have without fill-in.

Use: `RunConfig(callbacks=training_callbacks(job_config))` (train/job.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from spotfill.ray_compat import ControllerCallback, require
from spotfill.train.arbiter_link import get_arbiter
from spotfill.train.elastic import pinned_nodes

log = logging.getLogger("spotfill.train.fillin_claims")
CLAIM_DEADLINE_S = 10.0


@dataclass(frozen=True)
class ClaimSpec:
    job: str
    min_workers: int
    max_workers: int
    gpus_per_worker: int
    gpu_resource: str
    deadline_s: float = CLAIM_DEADLINE_S


def claim_via_arbiter(spec: ClaimSpec, gpus: int, gpus_per_worker: int,
                      nodes: tuple[str, ...] | None = None) -> dict | None:
    """The arbiter's answer to a claim (on `nodes` only, when the group is pinned there), or None when no
    arbiter runs on this cluster."""
    import ray

    arbiter = get_arbiter()
    if arbiter is None:
        return None
    return ray.get(arbiter.claim.remote(spec.job, gpus, spec.deadline_s, gpus_per_worker, spec.min_workers,
                                        spec.max_workers, list(nodes) if nodes else None),
                   timeout=spec.deadline_s + 5.0)


def release_via_arbiter(spec: ClaimSpec) -> None:
    import ray

    arbiter = get_arbiter()
    if arbiter is not None:
        ray.get(arbiter.release_job.remote(spec.job), timeout=10)


class FillinClaimCallback(ControllerCallback):
    """Claims a group's GPUs from the arbiter before Ray Train executes a resize decision."""

    def __init__(self, spec: ClaimSpec, claim: Callable[..., dict | None] = claim_via_arbiter,
                 release: Callable[[ClaimSpec], None] = release_via_arbiter,
                 pinned: Callable[[], tuple[str, ...] | None] = pinned_nodes):
        require("fillin_claims")                 # one line (RayCompatError) where Ray moved the hook
        self.spec, self._claim, self._release, self._pinned = spec, claim, release, pinned
        self.answers: list[dict] = []

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        try:
            gpw = int(round(float((resize_decision.resources_per_worker or {}).get(
                self.spec.gpu_resource, self.spec.gpus_per_worker))))
            gpus = int(resize_decision.num_workers) * gpw
            if gpus <= 0:
                return
            nodes = self._pinned()            # the warm nodes the group goes on: claimed there
            answer = self._claim(self.spec, gpus, max(1, gpw), nodes) if nodes else \
                self._claim(self.spec, gpus, max(1, gpw))
            if answer is None:
                log.info("fill-in: no arbiter on this cluster; %s starts %d workers without claiming",
                         self.spec.job, resize_decision.num_workers)
                return
            self.answers.append(answer)
            log.log(logging.INFO if answer.get("ok") else logging.WARNING,
                    "fill-in: %s claimed %d GPU(s) for %d workers: %s", self.spec.job, gpus,
                    resize_decision.num_workers, answer.get("reason"))
        except Exception as exc:  # noqa: BLE001 - fill-in must never stop training
            log.warning("fill-in: claim for %s failed (%s: %s); training goes on without it", self.spec.job,
                        type(exc).__name__, exc)

    def after_controller_finish(self, result) -> None:
        try:
            self._release(self.spec)
        except Exception as exc:  # noqa: BLE001
            log.warning("fill-in: releasing %s failed (%s); the arbiter's claim hold expires by itself",
                        self.spec.job, exc)


def training_callbacks(job_config) -> list:
    """Ray Train callbacks that put training first on a cluster with fill-in (RunConfig(callbacks=...))."""
    t, c = job_config.training, job_config.cluster
    spec = ClaimSpec(job=job_config.name, min_workers=t.min_workers, max_workers=t.max_workers,
                     gpus_per_worker=max(1, int(round(c.gpus_per_worker))), gpu_resource=c.gpu_resource)
    return [FillinClaimCallback(spec)]

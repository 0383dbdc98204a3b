"""Where each rank sits in a pipeline job, and the batch arithmetic with replicas (pure: no torch).

W ranks (Ray Train workers, one GPU each) with S pipeline stages form R = W / S data-parallel replicas.
Rank r is stage r mod S of replica r // S: a replica's stages are consecutive ranks, which Ray Train places
on one node when the node holds a multiple of S workers -- a node loss then removes whole replicas.

The global batch G is fixed. The micro-batch size is fixed too: m = G / (R_max x M), with M the configured
micro-batches per step at the full width (R_max = max workers / S). With fewer replicas each one runs more
micro-batches, M' = G / (m x R) -- activation memory per GPU does not grow after a node loss, and the
bubble shrinks. Which samples a step consumes depends on the step only (batching.py): replica d takes the
stream positions [step x G + d x m x M', ...), its first stage feeds them as inputs and its last stage
reads the same rows as labels; only the first stage records them in the sample ledger.
"""
from __future__ import annotations

from dataclasses import dataclass

from spotfill.config.errors import ConfigError
from spotfill.config.batching import BatchShape


@dataclass(frozen=True)
class PipeLayout:
    stages: int
    world: int
    rank: int

    @property
    def replicas(self) -> int:
        return self.world // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def feeds_inputs(self) -> bool:
        return self.stage == 0

    @property
    def reads_data(self) -> bool:
        """The first stage reads the inputs, the last the labels (the same rows); the middle ones nothing."""
        return self.stage in (0, self.stages - 1)

    def ranks_of_replica(self, replica: int) -> list[int]:
        return list(range(replica * self.stages, (replica + 1) * self.stages))


def layout(stages: int, world: int, rank: int) -> PipeLayout:
    if stages < 1 or world % stages:
        raise ConfigError("training.workers", world, reason=f"not a multiple of training.pipeline_stages={stages}",
                          accepted=f"a multiple of {stages}")
    return PipeLayout(stages, world, rank)


def micro_batch_size(global_batch: int, max_replicas: int, micro_batches: int, max_micro_batch: int) -> int:
    """The fixed micro-batch size: G / (R_max x M), or with M unset (0) the largest divisor of G / R_max
    that is at most max_micro_batch (what batching.batch_shape picks at the full width)."""
    per_replica, rem = divmod(global_batch, max_replicas)
    if rem:
        raise ConfigError("training.global_batch", global_batch,
                          reason=f"not divisible by the {max_replicas} pipeline replicas of the full width",
                          accepted=f"a multiple of {max_replicas}")
    if micro_batches:
        if per_replica % micro_batches:
            raise ConfigError("training.micro_batches", micro_batches,
                              reason=f"does not divide the {per_replica} samples per replica "
                                     f"(global_batch {global_batch} / {max_replicas} replicas)",
                              accepted=f"a divisor of {per_replica}")
        return per_replica // micro_batches
    return max(d for d in range(1, min(per_replica, max_micro_batch) + 1) if per_replica % d == 0)


def pipeline_batch_shape(global_batch: int, replicas: int, micro: int) -> BatchShape:
    """The shape at `replicas` replicas: BatchShape(world_size=replicas, micro_batch=micro, accum=M')."""
    samples, rem = divmod(global_batch, micro * replicas)
    if rem or samples < 1:
        raise ConfigError("training.global_batch", global_batch,
                          reason=f"cannot be split into micro-batches of {micro} over {replicas} replicas",
                          accepted=f"a multiple of {micro * replicas}")
    return BatchShape(global_batch, replicas, micro, samples)


def check_pipeline_range(global_batch: int, stages: int, min_workers: int, max_workers: int,
                         micro_batches: int, max_micro_batch: int) -> int:
    """Reject, before any GPU time is spent, a worker range or batch a pipeline cannot run at every size:
    both bounds multiples of S, and G split into fixed micro-batches over every replica count. Returns the
    micro-batch size."""
    for name, w in (("min", min_workers), ("max", max_workers)):
        if w % stages:
            raise ConfigError("training.workers", [min_workers, max_workers],
                              reason=f"the {name} {w} is not a multiple of training.pipeline_stages={stages} "
                                     "(workers count ranks: replicas x stages)",
                              accepted=f"bounds that are multiples of {stages}")
    micro = micro_batch_size(global_batch, max_workers // stages, micro_batches, max_micro_batch)
    for replicas in range(max(1, min_workers // stages), max_workers // stages + 1):
        pipeline_batch_shape(global_batch, replicas, micro)
    return micro


def round_to_replicas(workers: int, stages: int) -> int:
    """The most workers <= `workers` that make whole replicas."""
    return workers - workers % stages if stages > 1 else workers

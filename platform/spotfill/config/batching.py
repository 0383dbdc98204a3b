"""Global-batch invariance and a deterministic sample order (pure: numpy only).

The global batch G is fixed. At world size W each rank takes G/W samples per optimizer step, split into
`accum` micro-batches of `micro` samples: micro x accum x W == G at every W in [min, max].

Samples are addressed by their *stream index* (stream position): step s consumes stream indices [s*G, (s+1)*G). Stream index
g maps to dataset row perm_e[g mod N] where e = g // N is the epoch and perm_e a seeded permutation. Which
samples a step consumes depends only on the step, never on the world size, so after any resize or restart
no sample is repeated or skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from spotfill.config.errors import ConfigError


@dataclass(frozen=True)
class BatchShape:
    global_batch: int
    world_size: int
    micro_batch: int
    accum: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accum


def batch_shape(global_batch: int, world_size: int, max_micro_batch: int) -> BatchShape:
    """Largest micro-batch <= max_micro_batch with micro x accum x world == global_batch."""
    if world_size < 1:
        raise ConfigError("world_size", world_size, accepted=">= 1")
    if global_batch % world_size:
        raise ConfigError("training.global_batch", global_batch,
                          reason=f"not divisible by world size {world_size}",
                          accepted="a multiple of every worker count in the elastic range")
    per_rank = global_batch // world_size
    micro = max(d for d in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % d == 0)
    return BatchShape(global_batch, world_size, micro, per_rank // micro)


def valid_world_sizes(global_batch: int, min_workers: int, max_workers: int) -> list[int]:
    return [w for w in range(min_workers, max_workers + 1) if global_batch % w == 0]


def check_elastic_range(global_batch: int, min_workers: int, max_workers: int) -> None:
    """Reject, before any GPU time is spent, a range holding a size that cannot keep the global batch."""
    bad = [w for w in range(min_workers, max_workers + 1) if global_batch % w]
    if bad:
        ok = [w for w in range(1, max_workers + 1) if global_batch % w == 0]
        raise ConfigError("training.global_batch", global_batch,
                          reason=f"cannot be split evenly over {bad} workers in the elastic range "
                                 f"[{min_workers}, {max_workers}]",
                          accepted=f"a global batch divisible by every size in the range, or a range "
                                   f"within the divisors {ok}")


def step_stream_indices(step: int, global_batch: int) -> range:
    """Stream indices consumed by optimizer step `step` (0-based)."""
    return range(step * global_batch, (step + 1) * global_batch)


def rank_micro_batches(step: int, shape: BatchShape, rank: int) -> list[list[int]]:
    """The stream indices rank `rank` consumes at `step`, as `accum` micro-batches."""
    start = step * shape.global_batch + rank * shape.per_rank
    return [list(range(start + i * shape.micro_batch, start + (i + 1) * shape.micro_batch))
            for i in range(shape.accum)]


def rank_positions(step: int, shape: BatchShape, rank: int) -> np.ndarray:
    """The stream positions rank `rank` consumes at `step`, in micro-batch order (rank_micro_batches,
    flattened, as one array)."""
    start = step * shape.global_batch + rank * shape.per_rank
    return np.arange(start, start + shape.per_rank, dtype=np.int64)


@lru_cache(maxsize=4)
def _epoch_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def stream_to_rows(indices: list[int] | range, n_rows: int, seed: int) -> np.ndarray:
    """Dataset rows for stream indices (reshuffled each epoch, deterministically)."""
    idx = np.asarray(indices, dtype=np.int64)
    rows = np.empty_like(idx)
    epochs = idx // n_rows
    for e in np.unique(epochs):
        mask = epochs == e
        rows[mask] = _epoch_permutation(n_rows, seed, int(e))[idx[mask] % n_rows]
    return rows


@lru_cache(maxsize=4)
def _inverse_permutation(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    perm = _epoch_permutation(n_rows, seed, epoch)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(n_rows, dtype=perm.dtype)
    return inverse


def rows_to_stream(rows: np.ndarray, epochs: np.ndarray, n_rows: int, seed: int) -> np.ndarray:
    """The stream index at which dataset row `rows[i]` is read in epoch `epochs[i]`: stream_to_rows's
    inverse. Applied to the ids stored in the rows a worker read, it says which stream positions were fed."""
    rows = np.asarray(rows, dtype=np.int64)
    epochs = np.broadcast_to(np.asarray(epochs, dtype=np.int64), rows.shape)
    out = np.empty_like(rows)
    for e in np.unique(epochs):
        mask = epochs == e
        out[mask] = e * n_rows + _inverse_permutation(n_rows, seed, int(e))[rows[mask]]
    return out

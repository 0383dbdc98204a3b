"""What one rank feeds the model, checked: the worker loop's data path (numpy only: no Ray, no torch).

At each step a rank owes the stream positions batching.rank_positions gives (they depend on the step, never
on the world size). `StepFeed(step)` reads the rows for them; every row read comes with the dataset row id
prepare stored in it (data.py). Mapped back through the schedule's permutation (batching.rows_to_stream),
those ids say which stream positions the rows are: that is what the sample ledger records
(`StepBatch.fed`), not the positions the step number gives. When they are not the positions the step owes
-- other rows read (an offset, another seed), a row-mapping fault -- the step is never fed: DataMismatch,
one line naming the shards and what differed.

A checkpoint carries, next to the ledger, the identity of the data its positions refer to (`DATA_KEY`: the
dataset's fingerprint, its rows, the data seed and each shard's sha256); `resume_point` refuses to resume
on other data, naming the shard or setting that differs.
"""
from __future__ import annotations

import numpy as np

from spotfill.config.errors import DataMismatch
from spotfill.config.batching import BatchShape, rank_positions, rows_to_stream, stream_to_rows
from spotfill.train.data import ShardReader, StepBatch, read_step
from spotfill.train.sample_ledger import SampleLedger

LEDGER_KEY = "sample_ledger"    # in every checkpoint's client_state: the ledger of the model state
DATA_KEY = "sample_data"        # beside it: the data the ledger's positions refer to (data_identity)


class StepFeed:
    """`feed(step)`: this rank's rows of `step` (the Prefetcher's `make`), checked against the schedule,
    with the positions the rows read are (`StepBatch.fed`)."""

    def __init__(self, reader: ShardReader, shape: BatchShape, rank: int, seed: int, positions=None):
        """`positions(step)`: the stream positions this rank owes at `step` (a pipeline replica's, from
        train/pipeline.py); rank_positions by default."""
        self.reader, self.shape, self.rank, self.seed = reader, shape, rank, seed
        self.positions = positions

    def __call__(self, step: int) -> StepBatch:
        owed = self.positions(step) if self.positions else rank_positions(step, self.shape, self.rank)
        batch = read_step(self.reader, step, owed, self.shape.accum, self.seed)
        batch.fed = fed_positions(self.reader, step, self.rank, owed, batch.row_ids, self.seed)
        return batch


def fed_positions(reader: ShardReader, step: int, rank: int, owed: np.ndarray, stored_ids: np.ndarray,
                  seed: int) -> np.ndarray:
    """The stream positions the rows with `stored_ids` are (in the epochs of the `owed` positions); raises
    DataMismatch unless they are the `owed` positions, in order."""
    owed = np.asarray(owed, dtype=np.int64)
    stored_ids = np.asarray(stored_ids, dtype=np.int64)
    if stored_ids.shape != owed.shape:
        raise DataMismatch(f"step {step}, rank {rank}: {stored_ids.size} rows read where the schedule owes "
                           f"{owed.size}")
    n = reader.num_samples
    fed = rows_to_stream(np.clip(stored_ids, 0, n - 1), owed // n, n, seed)
    bad = np.flatnonzero((fed != owed) | (stored_ids < 0) | (stored_ids >= n))
    if bad.size:
        i = int(bad[0])
        want, got = int(stream_to_rows(owed[i:i + 1], n, seed)[0]), int(stored_ids[i])
        raise DataMismatch(f"step {step}, rank {rank}: {bad.size} of {owed.size} rows read are not the rows the "
                           f"schedule owes (data.seed {seed}): stream position {owed[i]} owes dataset row {want} "
                           f"({reader.shard_key(want)}), the row read holds id {got} ({reader.shard_key(got)})")
    return fed


def data_identity(reader: ShardReader, seed: int) -> dict:
    """What the ledger's stream positions refer to: this dataset, read in this seed's order."""
    return {"dataset": reader.fingerprint, "rows": reader.num_samples, "seed": seed,
            "shards": [[s["key"], s["sha256"][:16]] for s in reader.manifest["shards"]]}


def resume_point(client_state: dict | None, identity: dict) -> tuple[int, SampleLedger, str]:
    """(first step, ledger, data check) for an attempt starting from a checkpoint's `client_state` (None:
    a fresh start). The check is "checked" (the checkpoint names this data), "fresh", or says why the data
    could not be checked (a checkpoint from before data identities were recorded). Other data than the
    checkpoint's raises DataMismatch: its ledger names rows of that data."""
    if client_state is None:
        return 0, SampleLedger(), "fresh"
    step = int(client_state["step"])
    ledger = SampleLedger.from_state(client_state.get(LEDGER_KEY))
    recorded = client_state.get(DATA_KEY)
    if recorded is None:
        return step, ledger, "not checked: the checkpoint records no data identity (written before they were)"
    differs = _differences(recorded, identity)
    if differs:
        raise DataMismatch(f"the checkpoint at step {step} was trained on other data than this run reads "
                           f"({differs}): its sample ledger names rows of that data; train on the dataset and "
                           "data.seed it was trained with, or start a new job")
    return step, ledger, "checked"


def _differences(recorded: dict, current: dict) -> str:
    if recorded.get("seed") != current["seed"]:
        return f"data.seed {recorded.get('seed')} in the checkpoint, {current['seed']} now"
    if recorded.get("dataset") == current["dataset"]:
        return ""
    was, now = dict(map(tuple, recorded.get("shards") or [])), dict(map(tuple, current["shards"]))
    changed = [k for k in now if k in was and was[k] != now[k]]
    if changed:
        return (f"{changed[0]} has sha256 {now[changed[0]][:12]}, the checkpoint's {was[changed[0]][:12]}"
                + (f", and {len(changed) - 1} more shards differ" if len(changed) > 1 else ""))
    gone, new = [k for k in was if k not in now], [k for k in now if k not in was]
    if gone or new:
        return (f"shard {(gone or new)[0]} {'is gone' if gone else 'is new'}: {len(was)} shards in the "
                f"checkpoint's dataset, {len(now)} now")
    return f"dataset fingerprint {recorded.get('dataset', '')[:12]} in the checkpoint, {current['dataset'][:12]} now"

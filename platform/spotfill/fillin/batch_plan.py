"""A batch fill-in job's plan and ledger (pure: no Ray, no torch, no storage client).

A batch job (jobs/batch_infer.py) splits its inputs into deterministic *units*: contiguous row ranges of the
held-out token dataset (evaluation) and of the prompt file (generation), each with a stable id
(`eval-00003`, `generate-00001`). A unit's output is one parquet file under a name that depends only on the
unit (`eval/part-eval-00003.parquet`), written whole (an atomic rename locally, one PUT of the final key on
S3) and then *committed* by a marker (`_commits/eval-00003.json`) that records its rows and bytes. The job
runs in waves sized by its grant; after a stop (a reclaim, a killed driver) the next wave takes only the
units that are not committed. A unit whose part exists without a marker, or whose part does not match its
marker, is redone: it overwrites the same name, so no row can appear twice.

Every output row carries an `id` (`eval/<row>` or `generate/<prompt id>`). The summary (`tally`) is computed
from the ids read back from the output, never from the writer's counters.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

KINDS = ("eval", "generate")
COMMITS = "_commits"
PLAN_KEY = "_plan/plan.json"
MODEL_KEY = "_plan/model.pt"
TOKENIZER_DIR = "_plan/tokenizer"       # the checkpoint's own tokenizer files (a Hugging Face run's), pinned


@dataclass(frozen=True)
class Unit:
    kind: str              # "eval" | "generate"
    index: int             # position among this kind's units
    start: int             # first input row (eval: dataset row; generate: line of the prompt file)
    stop: int              # one past the last

    @property
    def unit_id(self) -> str:
        return f"{self.kind}-{self.index:05d}"

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """Where its parquet part lives, relative to the job's output."""
        return f"{self.kind}/part-{self.unit_id}.parquet"

    @property
    def marker(self) -> str:
        return f"{COMMITS}/{self.unit_id}.json"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "index": self.index, "start": self.start, "stop": self.stop,
                "unit_id": self.unit_id, "key": self.key, "marker": self.marker}


def split(kind: str, n_rows: int, rows_per_unit: int) -> list[Unit]:
    """Rows [0, n_rows) of `kind` cut into units of `rows_per_unit` rows (the last may be shorter)."""
    if kind not in KINDS:
        raise ValueError(f"unknown unit kind {kind!r}; accepted: {', '.join(KINDS)}")
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be >= 1, got {rows_per_unit}")
    return [Unit(kind, i, start, min(start + rows_per_unit, n_rows))
            for i, start in enumerate(range(0, max(0, n_rows), rows_per_unit))]


def row_ids(kind: str, start: int, stop: int, prompt_ids: list[str] | None = None) -> list[str]:
    """The output ids of input rows [start, stop): eval rows by dataset row, prompts by their id."""
    if kind == "eval":
        return [f"eval/{r}" for r in range(start, stop)]
    if prompt_ids is None:
        raise ValueError("generate ids need the prompt ids")
    return [f"generate/{prompt_ids[r]}" for r in range(start, stop)]


def target_ids(units: Iterable[Unit], prompt_ids: list[str] | None = None) -> list[str]:
    return [i for u in units for i in row_ids(u.kind, u.start, u.stop, prompt_ids)]


def duplicate_prompt_ids(ids: Iterable[str]) -> list[str]:
    return sorted(k for k, n in Counter(ids).items() if n > 1)


def committed_units(units: Iterable[Unit], markers: Mapping[str, dict], parts: Mapping[str, int]) -> set[str]:
    """Units that are done: a marker for the unit naming its part, with the rows the unit owes, and that part
    present with the size the marker recorded (`parts`: key -> bytes, as listed in the output)."""
    done = set()
    for u in units:
        m = markers.get(u.unit_id)
        if not m or m.get("key") != u.key or int(m.get("rows", -1)) != u.rows:
            continue
        if u.key in parts and int(parts[u.key]) == int(m.get("bytes", -1)):
            done.add(u.unit_id)
    return done


def remaining(units: Iterable[Unit], done: set[str]) -> list[Unit]:
    """What is left, in plan order (evaluation first, then generation, each by index)."""
    return [u for u in units if u.unit_id not in done]


def next_wave(todo: list[Unit], grant: int, units_per_actor: int = 0) -> list[Unit]:
    """The units of the next wave: `units_per_actor` for each granted unit (GPU actor) from the front, or
    (0) everything left: a wave ends early when the grant falls (a reclaim) or rises (`regrow`)."""
    if grant < 1:
        return []
    return list(todo) if units_per_actor <= 0 else todo[: grant * units_per_actor]


def regrow(running: int, allowed: int, max_units: int, left: int) -> bool:
    """Worth ending a wave to restart it larger: the grant allows more actors than it runs, the job may use
    them, and the work left in the wave is more than its actors have in hand."""
    return allowed > running and running < max_units and left > 2 * running


def wave_size(grant: int, max_units: int, todo: int) -> int:
    """How many GPU actors the next wave runs: the grant, capped by the job's max and the work left."""
    return max(0, min(grant, max_units, todo))


def tally(target: Iterable[str], seen: Iterable[str]) -> dict:
    """Exactly-once accounting from the ids read back: rows_written counts every row in the output
    (duplicates included), duplicates = rows beyond the first of an id, missing = targets never seen,
    unexpected = ids the plan does not owe."""
    want = set(target)
    counts = Counter(seen)
    return {"rows_target": len(want), "rows_written": sum(counts.values()),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "missing": len(want - set(counts)), "unexpected": len(set(counts) - want)}


def eval_metrics(nll_sums: Iterable[float], token_counts: Iterable[int]) -> dict:
    """Mean token loss and perplexity over every evaluated token: sum(nll) / sum(tokens)."""
    nll, tokens = 0.0, 0
    for a, b in zip(nll_sums, token_counts):
        nll += float(a)
        tokens += int(b)
    if tokens == 0:
        return {"loss": None, "perplexity": None, "tokens": 0}
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": tokens}


def same_plan(old: Mapping, new: Mapping) -> list[str]:
    """Fields in which a resumed job's inputs differ from the plan it started (empty: the same job)."""
    keys = ("checkpoint_tag", "eval_rows", "eval_rows_per_unit", "eval_data", "prompts_sha256",
            "generate_rows_per_unit", "max_tokens", "temperature", "seed")
    return [k for k in keys if old.get(k) != new.get(k)]

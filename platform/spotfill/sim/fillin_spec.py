"""Scenario keys for batch fill-in and the reclaim order (pure; used by sim/scenario.py's FillinSpec).

    fillin:
      batch: {enabled: true, rows: 256, prompts: 16, max_units: null, standby_per_node: 1}
      sweep: {enabled: true, trials: 4, steps: 40, max_units: null, standby_per_node: 1}
      reclaim_order: [sweep, batch, serve]        # the default: sweeps first, serving (user-facing) last

`batch.rows`: held-out rows the batch job evaluates (the loss and perplexity of the run's checkpoint over the
scenario's prepared token shards, capped by what the data holds); `batch.prompts`: prompts it generates for
(taken from the same corpus); report.json's fillin.batch.rows_target is their sum. `max_units`: most GPUs
it holds at once (default: every GPU slot). `standby_per_node` (default 1, 0 off): the job's warm standbys per
GPU node (fillin/batch_standby.py).

`sweep.trials`: trials of jobs/sweep.py's learning-rate x warm-up grid of the tiny GPT (the grid's first
N), `sweep.steps`: optimizer steps per trial, `max_units`: most trials at once (default: every GPU slot),
`standby_per_node` (default 1, 0 off): warm trial processes per GPU node (fillin/sweep_standby.py).
"""
from __future__ import annotations

from spotfill.config.errors import ConfigError
from spotfill.fillin.policy import DEFAULT_ORDER

BATCH_KEYS = {"enabled": False, "rows": 256, "prompts": 16, "max_units": None, "standby_per_node": 1}
SWEEP_KEYS = {"enabled": False, "trials": 4, "steps": 40, "max_units": None, "standby_per_node": 1}
TENANT_KINDS = DEFAULT_ORDER       # every kind in the registry (config/tenant_kinds.py)


def batch_spec(spec, path: str) -> dict:
    if not isinstance(spec, dict):
        raise ConfigError(path, spec, accepted="a mapping {enabled, rows, prompts, max_units}")
    for key in spec:
        if key not in BATCH_KEYS:
            raise ConfigError(f"{path}.{key}", spec[key], reason="unknown key", accepted=sorted(BATCH_KEYS))
    out = {**BATCH_KEYS, **spec}
    if not isinstance(out["enabled"], bool):
        raise ConfigError(f"{path}.enabled", out["enabled"], accepted="true or false")
    for key, low in (("rows", 0), ("prompts", 0)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{path}.{key}", v, accepted=f"an integer >= {low}")
    if out["enabled"] and out["rows"] + out["prompts"] == 0:
        raise ConfigError(f"{path}.rows", out["rows"], reason="nothing to do with rows: 0 and prompts: 0",
                          accepted="rows and/or prompts > 0")
    mu = out["max_units"]
    if mu is not None and (isinstance(mu, bool) or not isinstance(mu, int) or mu < 1):
        raise ConfigError(f"{path}.max_units", mu, accepted="an integer >= 1")
    _check_standbys(out, path)
    return out


def _check_standbys(out: dict, path: str) -> None:
    sb = out["standby_per_node"]
    if isinstance(sb, bool) or not isinstance(sb, int) or not 0 <= sb <= 8:
        raise ConfigError(f"{path}.standby_per_node", sb, accepted="an integer from 0 to 8 (0: none)")


def sweep_spec(spec, path: str) -> dict:
    if not isinstance(spec, dict):
        raise ConfigError(path, spec, accepted="a mapping {enabled, trials, steps, max_units}")
    for key in spec:
        if key not in SWEEP_KEYS:
            raise ConfigError(f"{path}.{key}", spec[key], reason="unknown key", accepted=sorted(SWEEP_KEYS))
    out = {**SWEEP_KEYS, **spec}
    if not isinstance(out["enabled"], bool):
        raise ConfigError(f"{path}.enabled", out["enabled"], accepted="true or false")
    for key, low, high in (("trials", 1, 8), ("steps", 5, 100000)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ConfigError(f"{path}.{key}", v, accepted=f"an integer from {low} to {high}"
                              + (" (the grid: 4 learning rates x 2 warm-ups)" if key == "trials" else ""))
    mu = out["max_units"]
    if mu is not None and (isinstance(mu, bool) or not isinstance(mu, int) or mu < 1):
        raise ConfigError(f"{path}.max_units", mu, accepted="an integer >= 1")
    _check_standbys(out, path)
    return out


def reclaim_order(order, path: str) -> list[str]:
    """The order training's claims reclaim fill-in tenants in: a permutation of sweep, batch, serve."""
    if order is None:
        return list(DEFAULT_ORDER)
    if not isinstance(order, list) or sorted(order) != sorted(TENANT_KINDS):
        raise ConfigError(path, order, accepted=f"a list ordering each of {', '.join(TENANT_KINDS)} once "
                          f"(default {list(DEFAULT_ORDER)})")
    return list(order)

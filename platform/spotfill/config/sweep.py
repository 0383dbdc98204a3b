"""What jobs/sweep.py takes: a Ray Tune sweep of a small model on lent GPUs (YAML, unknown keys rejected).

    name: sweep-tiny
    run_dir: /tmp/spotfill/runs/sweep-tiny     # report.json (fillin.sweep) + events.jsonl, driver-local
    storage: /tmp/spotfill/sweeps/sweep-tiny   # Tune's storage_path (trial checkpoints): path or s3://
    data: {path: /tmp/spotfill/data/stdlib-json}   # prepared shards (jobs/prepare_data.py)
    sweep:
      model: tiny
      steps: 60                  # optimizer steps per trial
      batch: 8                   # rows per step
      steps_per_report: 5        # steps per Tune result (a pause waits for at most one report)
      checkpoint_every: 10       # steps between Tune checkpoints (a pause always checkpoints)
      eval_rows: 64              # held-out rows (the dataset's last rows) for the final metric
      search: {lr: [0.001, 0.003], warmup_steps: [0, 10]}   # grid: every combination is one trial
      trials: 0                  # 0: the whole grid; N: the grid's first N combinations
      seed: 0
      max_failures: 3            # restarts of a trial whose actor died (from its last checkpoint)
      keep_in_memory_mb: 1024    # host memory for paused trials' states (a resume reads no storage); 0: off
    fillin:
      grant: arbiter             # arbiter: GPUs the fill-in arbiter lends; fixed: `max_units` of one's own
      max_units: 4               # trials at once (1 GPU unit each)
      grace_s: 5.0               # a reclaim's deadline: trials beyond the grant are paused within it
      standby_per_node: 1        # warm trial processes per GPU node, imports done (0 to 8; 0: trials start cold)
    cluster: {gpu_resource: GPU_SLOT, cpus_per_trial: 1}
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from spotfill.config.errors import ConfigError
from spotfill.config.job import apply_overrides, check_choice, check_positive, from_mapping, join_path, load_yaml

SEARCH_KEYS = ("lr", "warmup_steps", "weight_decay", "batch")


@dataclass
class SweepDataConfig:
    path: str = ""

    def validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(join_path(path, "path"), self.path, accepted="a local path or s3:// URI of prepared shards")


@dataclass
class SweepSpec:
    model: str = "tiny"
    steps: int = 60
    batch: int = 8
    steps_per_report: int = 5
    checkpoint_every: int = 10
    eval_rows: int = 64
    search: dict = field(default_factory=lambda: {"lr": [1e-3, 3e-3], "warmup_steps": [0, 10]})
    trials: int = 0
    seed: int = 0
    max_failures: int = 3
    keep_in_memory_mb: int = 1024

    def validate(self, path: str) -> None:
        from spotfill.config.presets import PRESETS

        check_choice(path, "model", self.model, list(PRESETS))
        for name in ("steps", "batch", "steps_per_report", "checkpoint_every", "eval_rows"):
            check_positive(path, name, getattr(self, name))
        for name in ("trials", "max_failures", "keep_in_memory_mb"):
            check_positive(path, name, getattr(self, name), allow_zero=True)
        if not self.search:
            raise ConfigError(join_path(path, "search"), self.search, accepted=f"a mapping of {', '.join(SEARCH_KEYS)} "
                              "to lists of values")
        for key, values in self.search.items():
            where = join_path(join_path(path, "search"), str(key))
            if key not in SEARCH_KEYS:
                raise ConfigError(where, values, reason="unknown key", accepted=SEARCH_KEYS)
            if not isinstance(values, list) or not values:
                raise ConfigError(where, values, accepted="a non-empty list of numbers")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (key in ("lr", "batch") and v <= 0):
                    raise ConfigError(where, v, accepted="numbers > 0" if key in ("lr", "batch") else "numbers >= 0")
                if key in ("warmup_steps", "batch") and int(v) != v:
                    raise ConfigError(where, v, accepted="integers")

    def grid(self) -> list[dict]:
        """The trials' configurations: every combination of `search`, in file order, `trials` first ones."""
        keys = list(self.search)
        combos = [dict(zip(keys, values)) for values in itertools.product(*(self.search[k] for k in keys))]
        return combos[: self.trials] if self.trials else combos


@dataclass
class SweepFillin:
    grant: str = "arbiter"
    max_units: int = 4
    grace_s: float = 5.0
    standby_per_node: int = 1

    def validate(self, path: str) -> None:
        check_choice(path, "grant", self.grant, ["arbiter", "fixed"])
        check_positive(path, "max_units", self.max_units)
        check_positive(path, "grace_s", self.grace_s)
        sb = self.standby_per_node
        if isinstance(sb, bool) or not isinstance(sb, int) or not 0 <= sb <= 8:
            raise ConfigError(join_path(path, "standby_per_node"), sb, accepted="an integer from 0 to 8 (0: no standby)")


@dataclass
class SweepCluster:
    gpu_resource: str = "GPU"
    cpus_per_trial: float = 1.0

    def validate(self, path: str) -> None:
        check_positive(path, "cpus_per_trial", self.cpus_per_trial, allow_zero=True)
        if not self.gpu_resource or not self.gpu_resource.replace("_", "").isalnum():
            raise ConfigError(join_path(path, "gpu_resource"), self.gpu_resource, accepted="a Ray resource name")


@dataclass
class SweepJobConfig:
    name: str = "sweep"
    run_dir: str = "runs/sweep"
    storage: str = ""
    data: SweepDataConfig = field(default_factory=SweepDataConfig)
    sweep: SweepSpec = field(default_factory=SweepSpec)
    fillin: SweepFillin = field(default_factory=SweepFillin)
    cluster: SweepCluster = field(default_factory=SweepCluster)

    def validate(self, path: str) -> None:
        if not self.storage:
            raise ConfigError("storage", self.storage, accepted="a local path or s3://bucket/prefix")
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", self.name, accepted="letters, digits, '-' and '_'")


def load_sweep_config(path: str | None = None, overrides: dict | None = None) -> SweepJobConfig:
    """SweepJobConfig from YAML; `overrides` are dotted field names (CLI > file > defaults)."""
    return from_mapping(SweepJobConfig, apply_overrides(load_yaml(path) if path else {}, overrides))

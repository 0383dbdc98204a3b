"""What jobs/batch_infer.py takes (validated; unknown keys rejected; CLI > file > defaults).

    name: eval-tiny
    checkpoint: /tmp/spotfill/ckpt/tiny        # a run's storage (its checkpoints/); local path or s3://
    checkpoint_tag: null                       # null: the newest committed one when the job first starts
    checkpoint_wait_s: 0                       # wait up to this long for a first commit (a run just started)
    output: s3://bucket/batch/eval-tiny        # parquet parts + commit markers (fillin/batch_plan.py)
    eval: {data: /tmp/spotfill/data/heldout, rows: 0, rows_per_unit: 32, batch_size: 16}
    generate: {prompts: /path/prompts.jsonl, max_tokens: 32, temperature: 0.0, seed: 0, rows_per_unit: 4}
    cluster: {gpu_resource: GPU_SLOT, max_units: 2, grace_s: 5.0, units_per_actor: 0, standby_per_node: 1}
    grant: {units: 0}                          # 0: GPUs lent by the fill-in arbiter; N: N GPUs of its own
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spotfill.config.errors import ConfigError
from spotfill.config.job import apply_overrides, check_positive, from_mapping, join_path, load_yaml


@dataclass
class EvalSection:
    data: str = ""               # prepared token shards (jobs/prepare_data.py's format); "" = no evaluation
    rows: int = 0                # evaluate the first N rows; 0 = all
    rows_per_unit: int = 32
    batch_size: int = 16

    def validate(self, path: str) -> None:
        check_positive(path, "rows", self.rows, allow_zero=True)
        check_positive(path, "rows_per_unit", self.rows_per_unit)
        check_positive(path, "batch_size", self.batch_size)


@dataclass
class GenerateSection:
    prompts: str = ""            # jsonl, one {"prompt": "...", "id": optional} per line; "" = no generation
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    rows_per_unit: int = 4

    def validate(self, path: str) -> None:
        check_positive(path, "max_tokens", self.max_tokens)
        check_positive(path, "temperature", self.temperature, allow_zero=True)
        check_positive(path, "rows_per_unit", self.rows_per_unit)


@dataclass
class BatchCluster:
    gpu_resource: str = "GPU"
    max_units: int = 2           # most GPU actors it runs at once
    grace_s: float = 5.0         # how long it has to let go after its grant drops
    units_per_actor: int = 0     # work units per GPU actor in one wave; 0: all that is left (a wave ends
                                 # early when the grant falls, or rises for 2 s: the next wave takes it)
    standby_per_node: int = 1    # warm standby processes per GPU node holding the pinned model in host
                                 # memory (fillin/batch_standby.py); 0: every lent actor starts cold

    def validate(self, path: str) -> None:
        check_positive(path, "max_units", self.max_units)
        if isinstance(self.standby_per_node, bool) or not isinstance(self.standby_per_node, int) \
                or not 0 <= self.standby_per_node <= 8:
            raise ConfigError(join_path(path, "standby_per_node"), self.standby_per_node,
                              accepted="an integer from 0 to 8 (0: no standby)")
        check_positive(path, "grace_s", self.grace_s)
        check_positive(path, "units_per_actor", self.units_per_actor, allow_zero=True)
        if not self.gpu_resource or not self.gpu_resource.replace("_", "").isalnum():
            raise ConfigError(join_path(path, "gpu_resource"), self.gpu_resource, accepted="a Ray resource name")


@dataclass
class GrantSection:
    units: int = 0               # 0: the fill-in arbiter lends GPUs; N > 0: a fixed grant of N (own GPUs)

    def validate(self, path: str) -> None:
        check_positive(path, "units", self.units, allow_zero=True)


@dataclass
class BatchConfig:
    name: str = "batch"
    checkpoint: str = ""
    checkpoint_tag: str | None = None
    checkpoint_wait_s: float = 0.0       # wait this long for the run's first committed checkpoint (0: none)
    output: str = ""
    model: str = "auto"
    eval: EvalSection = field(default_factory=EvalSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    cluster: BatchCluster = field(default_factory=BatchCluster)
    grant: GrantSection = field(default_factory=GrantSection)

    def validate(self, path: str) -> None:
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", self.name, accepted="letters, digits, '-' and '_'")
        if not self.checkpoint:
            raise ConfigError("checkpoint", self.checkpoint, accepted="a run's storage: local path or s3:// URI")
        check_positive(path, "checkpoint_wait_s", self.checkpoint_wait_s, allow_zero=True)
        if not self.output:
            raise ConfigError("output", self.output, accepted="a local path or s3://bucket/prefix")
        if not self.eval.data and not self.generate.prompts:
            raise ConfigError("eval.data", self.eval.data, reason="nothing to do",
                              accepted="eval.data (token shards) and/or generate.prompts (a jsonl file)")


def load_batch_config(path: str | None = None, overrides: dict | None = None) -> BatchConfig:
    return from_mapping(BatchConfig, apply_overrides(load_yaml(path) if path else {}, overrides))


__all__ = ["BatchConfig", "load_batch_config"]

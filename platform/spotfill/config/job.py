"""Validated config dataclasses and YAML loading. Precedence: CLI > file > defaults.

Every error is a ConfigError naming the dotted field, the bad value and what is accepted.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from spotfill.config.errors import ConfigError


def _check_type(path: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(path, value, arg)
            except ConfigError:
                continue
        raise ConfigError(path, value, accepted=" or ".join(getattr(a, "__name__", str(a)) for a in args))
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, value, accepted="a list")
        return [_check_type(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, accepted="a mapping")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, accepted="true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, accepted="an integer")
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(path, value, accepted="a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, value, accepted="a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, accepted="a string")
        return value
    return value


def from_mapping(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, data, accepted="a mapping")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise ConfigError(f"{path}.{key}" if path else str(key), data[key],
                              reason="unknown key", accepted=names)
    kwargs = {k: _check_type(f"{path}.{k}" if path else k, v, hints[k]) for k, v in data.items()}
    for name in names:   # a nested section left out is validated too (e.g. data.path must be set)
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = from_mapping(hints[name], {}, f"{path}.{name}" if path else name)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate:
        validate(path)
    return obj


def load_yaml(path: str, field: str = "--config") -> dict:
    if not os.path.isfile(path):
        raise ConfigError(field, path, reason="no such file")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except UnicodeDecodeError:
        raise ConfigError(field, path, reason="not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(field, path, reason=f"not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(field, path, reason="top level must be a mapping")
    return data


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_positive(path: str, name: str, value: float | int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(join_path(path, name), value, accepted=">= 0" if allow_zero else "> 0")


def check_choice(path: str, name: str, value: Any, choices: list[Any]) -> None:
    if value not in choices:
        raise ConfigError(join_path(path, name), value, accepted=choices)


@dataclass
class ClusterConfig:
    """Which Ray resource is the accelerator: Ray's `GPU` (on CPU-only test machines too: Ray assigns it
    there and the workers compute on the CPU), or a logical one such as GPU_SLOT."""
    gpu_resource: str = "GPU"
    # one DeepSpeed rank drives one device: a worker given two GPUs would leave one idle (and DeepSpeed's
    # cuda:LOCAL_RANK would put the next worker on it), and fractions share a GPU without memory isolation
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 1.0

    def validate(self, path: str) -> None:
        if self.gpus_per_worker != 1:
            raise ConfigError(join_path(path, "gpus_per_worker"), self.gpus_per_worker,
                              reason="each worker is one DeepSpeed rank on one whole GPU",
                              accepted="1 (scale with training.workers)")
        check_positive(path, "cpus_per_worker", self.cpus_per_worker, allow_zero=True)
        if not self.gpu_resource or not self.gpu_resource.replace("_", "").isalnum():
            raise ConfigError(join_path(path, "gpu_resource"), self.gpu_resource, accepted="a Ray resource name")


@dataclass
class TrainingConfig:
    model: str = "tiny"
    seq_len: int | None = None
    workers: list[int] = field(default_factory=lambda: [1, 1])
    steps: int = 100
    global_batch: int = 16
    max_micro_batch: int = 8
    zero_stage: int = 2
    precision: str = "auto"          # auto: bf16 on GPUs with bf16 tensor cores, fp16 on older ones, fp32 on CPU
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 20
    keep_checkpoints: int = 3
    seed: int = 0
    max_failures: int = 10
    # "spotfill": restarts size the group from alive, non-draining nodes and grow gracefully;
    # "stock": Ray Train's defaults; "stock-tuned": stock Ray Train with the Ray timeouts spotfill sets
    # (both kept for side-by-side benchmarks).
    elastic_restarts: str = "spotfill"
    # How often rank 0 checks whether more workers fit now (graceful grow), seconds.
    resize_check_s: float = 1.0
    # Committed checkpoints exist but none is intact: "fail" the job (exit 1, naming the damaged tags) or
    # "restart" from step 0 (recorded as a `fresh_start` event with the cause).
    on_no_intact_checkpoint: str = "fail"
    # Activation checkpointing: "none", "selective" (recompute the attention core), "full" (recompute each
    # transformer block's forward in backward). Less activation memory for more compute; HFU counts it.
    activation_checkpointing: str = "none"
    # Pipeline parallelism (train/pipeline.py): S stages per replica, `workers` still counts ranks (GPUs), so
    # there are workers / S data-parallel replicas; 1 = no pipeline. `micro_batches`: M per step at the full
    # width (0: from max_micro_batch); the micro-batch size stays fixed when replicas are lost.
    pipeline_stages: int = 1
    micro_batches: int = 0
    # A batch job's output (fillin/batch.py: its plan and pinned model): its evaluation units run in the
    # pipeline's bubbles, inside the training processes (fillin/bubble_fill.py). "" = no bubble fill.
    bubble_fill: str = ""
    # When the job finishes, `spotfill export` its final checkpoint into this local folder (new or empty):
    # a Hugging Face folder (docs/export.md). "" = no export.
    export_on_finish: str = ""

    @property
    def min_workers(self) -> int:
        return self.workers[0]

    @property
    def max_workers(self) -> int:
        return self.workers[-1]

    def validate(self, path: str) -> None:
        from spotfill.config.batching import check_elastic_range
        from spotfill.config.presets import PRESETS

        if len(self.workers) not in (1, 2) or any(w < 1 for w in self.workers):
            raise ConfigError(join_path(path, "workers"), self.workers, accepted="[n] or [min, max] with 1 <= min")
        if self.min_workers > self.max_workers:
            raise ConfigError(join_path(path, "workers"), self.workers, reason="min > max",
                              accepted="[min, max] with min <= max")
        if not self.model.startswith("hf:") and self.model not in PRESETS:
            raise ConfigError(join_path(path, "model"), self.model, accepted=[*PRESETS, "hf:/local/path"])
        for name in ("steps", "global_batch", "max_micro_batch", "checkpoint_every", "keep_checkpoints", "lr"):
            check_positive(path, name, getattr(self, name))
        check_positive(path, "resize_check_s", self.resize_check_s)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "min_lr", "max_failures"):
            check_positive(path, name, getattr(self, name), allow_zero=True)
        check_positive(path, "seq_len", self.seq_len)
        check_choice(path, "zero_stage", self.zero_stage, [0, 1, 2, 3])
        check_choice(path, "elastic_restarts", self.elastic_restarts, ["spotfill", "stock", "stock-tuned"])
        check_choice(path, "on_no_intact_checkpoint", self.on_no_intact_checkpoint, ["fail", "restart"])
        check_choice(path, "precision", self.precision, ["auto", "bf16", "fp16", "fp32"])
        from spotfill.config.presets import RECOMPUTE
        check_choice(path, "activation_checkpointing", self.activation_checkpointing, list(RECOMPUTE))
        if self.model.startswith("hf:") and self.activation_checkpointing == "selective":
            raise ConfigError(join_path(path, "activation_checkpointing"), "selective",
                              reason="a Hugging Face model recomputes whole layers",
                              accepted="none or full with an hf: model")
        check_positive(path, "pipeline_stages", self.pipeline_stages)
        check_positive(path, "micro_batches", self.micro_batches, allow_zero=True)
        if self.export_on_finish:
            check_export_dir(join_path(path, "export_on_finish"), self.export_on_finish, self.pipeline_stages)
        if self.pipeline_stages == 1:
            if self.bubble_fill:
                raise ConfigError(join_path(path, "bubble_fill"), self.bubble_fill,
                                  reason="bubbles come with pipeline stages", accepted="training.pipeline_stages > 1")
            check_elastic_range(self.global_batch, self.min_workers, self.max_workers)
            return
        from spotfill.config.pipe_layout import check_pipeline_range
        if self.activation_checkpointing != "none":
            raise ConfigError(join_path(path, "activation_checkpointing"), self.activation_checkpointing,
                              reason="pipeline stages run their layers without recomputation",
                              accepted="none with training.pipeline_stages > 1")
        if self.zero_stage > 1:
            raise ConfigError(join_path(path, "zero_stage"), self.zero_stage,
                              reason="DeepSpeed's pipeline engine does not run ZeRO-2/3",
                              accepted="0 or 1 with training.pipeline_stages > 1")
        if self.model.startswith("hf:"):
            raise ConfigError(join_path(path, "model"), self.model, reason="pipeline stages cut the GPT presets only",
                              accepted=[*PRESETS])
        layers = PRESETS[self.model].n_layer + 2      # embeddings, the blocks, the head
        if self.pipeline_stages > layers:
            raise ConfigError(join_path(path, "pipeline_stages"), self.pipeline_stages,
                              reason=f"more stages than the {layers} layers of {self.model}",
                              accepted=f"1..{layers}")
        check_pipeline_range(self.global_batch, self.pipeline_stages, self.min_workers, self.max_workers,
                             self.micro_batches, self.max_micro_batch)


def check_export_dir(field: str, value: Any, stages: int = 1) -> None:
    """training.export_on_finish: a local folder that is new or empty (train/export.py checks it again when
    it writes), for a run without pipeline stages."""
    import os
    if not isinstance(value, str) or ("://" in value and not value.startswith("file://")):
        raise ConfigError(field, value, accepted="a local folder path (new or empty), or \"\" for no export")
    local = value[7:] if value.startswith("file://") else value
    if os.path.exists(local) and (not os.path.isdir(local) or os.listdir(local)):
        raise ConfigError(field, value, reason="exists and is not an empty folder", accepted="a new or empty folder")
    if stages > 1:
        raise ConfigError(field, value, reason="export reads checkpoints saved without pipeline stages",
                          accepted="training.pipeline_stages: 1 with export_on_finish")


@dataclass
class DataConfig:
    path: str = ""               # prepared token shards (output of jobs/prepare_data.py)
    seed: int = 0
    prefetch: int = 2

    def validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(join_path(path, "path"), self.path, accepted="a local path or s3:// URI of prepared shards")
        check_positive(path, "prefetch", self.prefetch)


@dataclass
class JobConfig:
    """What jobs/pretrain.py and `TrainingJob` take."""
    name: str = "spotfill-run"
    run_dir: str = "runs/spotfill-run"   # events.jsonl and report.json (driver-local)
    storage: str = ""                    # checkpoints: local path or s3://bucket/prefix
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self, path: str) -> None:
        if not self.storage:
            raise ConfigError("storage", self.storage, accepted="a local path or s3://bucket/prefix")
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", self.name, accepted="letters, digits, '-' and '_'")


@dataclass
class PrepareConfig:
    """What jobs/prepare_data.py takes."""
    source: str = ""                 # text / jsonl / parquet files: a file, a folder, or s3:// prefix
    format: str = "auto"
    text_field: str = "text"
    output: str = ""                 # where shards + manifest go
    seq_len: int = 64
    tokenizer: str = "bytes"
    rows_per_shard: int = 8192
    suffixes: list[str] = field(default_factory=lambda: [".txt", ".py", ".md", ".jsonl", ".json", ".parquet"])

    def __post_init__(self) -> None:
        self.source = stdlib_path(self.source)

    def validate(self, path: str) -> None:
        if not self.source:
            raise ConfigError(join_path(path, "source"), self.source, accepted="a local path or s3:// URI")
        if not self.output:
            raise ConfigError(join_path(path, "output"), self.output, accepted="a local path or s3:// URI")
        check_choice(path, "format", self.format, ["auto", "text", "jsonl", "parquet"])
        check_positive(path, "seq_len", self.seq_len)
        check_positive(path, "rows_per_shard", self.rows_per_shard)


STDLIB_SCHEME = "stdlib:"


def stdlib_path(source: str) -> str:
    """`stdlib:SUB` -> <this Python's standard library>/SUB, a corpus every node has (examples use it);
    any other source unchanged."""
    if not isinstance(source, str) or not source.startswith(STDLIB_SCHEME):
        return source
    import sysconfig

    return os.path.join(sysconfig.get_paths()["stdlib"], source[len(STDLIB_SCHEME):])


def apply_overrides(data: dict, overrides: dict | None) -> dict:
    """Set dotted field names (`training.steps`) in a config mapping: CLI > file > defaults."""
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            if node.get(p) is None:
                node[p] = {}
            elif not isinstance(node[p], dict):
                raise ConfigError(".".join(parents[: i + 1]), node[p], reason=f"cannot set {dotted}: not a mapping")
            node = node[p]
        node[leaf] = value
    return data


def load_job_config(path: str | None = None, overrides: dict | None = None) -> JobConfig:
    return from_mapping(JobConfig, apply_overrides(load_yaml(path) if path else {}, overrides))


def load_prepare_config(path: str | None = None, overrides: dict | None = None) -> PrepareConfig:
    """PrepareConfig from a YAML file whose only top-level key is `data:` (fields as in PrepareConfig);
    `overrides` are PrepareConfig field names (CLI > file > defaults). Errors name `data.<field>`."""
    doc = load_yaml(path) if path else {}
    for key in doc:
        if key != "data":
            raise ConfigError(str(key), doc[key], reason="unknown key", accepted=["data"])
    data = doc.get("data")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError("data", data, accepted="a mapping")
    return from_mapping(PrepareConfig, {**data, **(overrides or {})}, "data")

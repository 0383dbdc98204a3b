"""config.py: validated dataclasses, YAML loading, dotted overrides; errors name the field and the choices."""
from __future__ import annotations

import os

import pytest

from spotfill.config.job import (ClusterConfig, DataConfig, JobConfig, PrepareConfig, TrainingConfig, from_mapping,
                             load_job_config, load_prepare_config, load_yaml)
from spotfill.config.errors import ConfigError


def job(**sections) -> dict:
    """A minimal valid job mapping, with `sections` merged in."""
    base = {"storage": "/tmp/spotfill-ckpt", "data": {"path": "/tmp/spotfill-data"}}
    base.update(sections)
    return base


def error(cls, data) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        from_mapping(cls, data)
    assert "\n" not in str(err.value)
    return err.value


# -- from_mapping --------------------------------------------------------------------------------
def test_valid_job_and_defaults():
    cfg = from_mapping(JobConfig, job(training={"workers": [1, 4], "global_batch": 24, "steps": 5}))
    assert isinstance(cfg.training, TrainingConfig) and isinstance(cfg.data, DataConfig)
    assert isinstance(cfg.cluster, ClusterConfig) and cfg.cluster.gpu_resource == "GPU"
    assert (cfg.training.min_workers, cfg.training.max_workers) == (1, 4)
    assert cfg.training.steps == 5 and cfg.training.lr == 1e-3
    single = from_mapping(JobConfig, job(training={"workers": [2]}))
    assert single.training.min_workers == single.training.max_workers == 2


def test_unknown_top_level_key_lists_accepted_keys():
    e = error(JobConfig, job(trainig={}))
    assert e.field == "trainig"
    for key in ("name", "run_dir", "storage", "data", "training", "cluster"):
        assert key in str(e)


def test_unknown_nested_key_names_the_dotted_path():
    e = error(JobConfig, job(training={"stpes": 10}))
    assert e.field == "training.stpes"
    assert str(e).startswith("training.stpes: unknown key")
    assert "steps" in e.accepted and "global_batch" in e.accepted


@pytest.mark.parametrize("section,value,field,accepted", [
    ({"training": {"steps": "10"}}, "10", "training.steps", "an integer"),
    ({"training": {"steps": 2.5}}, 2.5, "training.steps", "an integer"),
    ({"training": {"steps": True}}, True, "training.steps", "an integer"),
    ({"training": {"lr": "fast"}}, "fast", "training.lr", "a number"),
    ({"training": {"lr": False}}, False, "training.lr", "a number"),
    ({"training": {"model": 7}}, 7, "training.model", "a string"),
    ({"training": {"workers": 4}}, 4, "training.workers", "a list"),
    ({"training": {"workers": [1, "4"]}}, "4", "training.workers[1]", "an integer"),
    ({"training": 5}, 5, "training", "a mapping"),
    ({"cluster": {"gpus_per_worker": "one"}}, "one", "cluster.gpus_per_worker", "a number"),
    ({"name": 3}, 3, "name", "a string"),
])
def test_wrong_types(section, value, field, accepted):
    e = error(JobConfig, job(**section))
    assert e.field == field and e.value == value and accepted in e.accepted
    assert str(e).startswith(field + ":")


def test_numbers_given_as_strings_and_ints_become_floats():
    cfg = from_mapping(JobConfig, job(training={"lr": "3e-4", "grad_clip": 2}))
    assert cfg.training.lr == 3e-4 and isinstance(cfg.training.grad_clip, float)


def test_optional_int_accepts_null():
    assert from_mapping(JobConfig, job(training={"seq_len": None})).training.seq_len is None
    assert from_mapping(JobConfig, job(training={"seq_len": 128})).training.seq_len == 128
    assert error(JobConfig, job(training={"seq_len": "128"})).field == "training.seq_len"


def test_min_greater_than_max_workers():
    e = error(JobConfig, job(training={"workers": [4, 2]}))
    assert e.field == "training.workers" and "min > max" in str(e)


@pytest.mark.parametrize("workers", [[0, 2], [], [1, 2, 3], [-1]])
def test_bad_worker_ranges(workers):
    assert error(JobConfig, job(training={"workers": workers})).field == "training.workers"


def test_unknown_model_lists_presets():
    e = error(JobConfig, job(training={"model": "gpt-17"}))
    assert e.field == "training.model" and "tiny" in e.accepted and "hf:/local/path" in e.accepted
    assert from_mapping(JobConfig, job(training={"model": "hf:/models/x"})).training.model == "hf:/models/x"


def test_zero_stage_4_rejected():
    e = error(JobConfig, job(training={"zero_stage": 4}))
    assert e.field == "training.zero_stage" and e.value == 4 and "0, 1, 2, 3" in str(e)


def test_bad_precision_and_non_positive_numbers():
    assert error(JobConfig, job(training={"precision": "int8"})).field == "training.precision"
    assert error(JobConfig, job(training={"steps": 0})).field == "training.steps"
    assert error(JobConfig, job(training={"lr": -1.0})).field == "training.lr"
    assert error(JobConfig, job(training={"warmup_steps": -1})).field == "training.warmup_steps"
    assert from_mapping(JobConfig, job(training={"warmup_steps": 0})).training.warmup_steps == 0
    assert error(JobConfig, job(data={"path": "/d", "prefetch": 0})).field == "data.prefetch"


def test_impossible_global_batch_for_the_elastic_range():
    e = error(JobConfig, job(training={"workers": [1, 4], "global_batch": 10}))
    assert e.field == "training.global_batch" and e.value == 10
    assert "[3, 4]" in str(e)


def test_cluster_section_validated():
    assert error(JobConfig, job(cluster={"gpu_resource": "GPU SLOT"})).field == "cluster.gpu_resource"
    assert error(JobConfig, job(cluster={"gpus_per_worker": 0})).field == "cluster.gpus_per_worker"


@pytest.mark.parametrize("gpus", [2, 0.5, 1.5])
def test_a_worker_is_one_rank_on_one_whole_gpu(gpus):
    # two GPUs per worker left one idle (DeepSpeed drives one device per rank) and divided MFU by two;
    # a fraction shares a GPU without memory isolation
    e = error(JobConfig, job(cluster={"gpus_per_worker": gpus}))
    assert e.field == "cluster.gpus_per_worker" and e.value == gpus
    assert "one whole GPU" in str(e) and "accepted: 1" in str(e)
    assert from_mapping(JobConfig, job(cluster={"gpu_resource": "GPU_SLOT"})).cluster.gpu_resource == "GPU_SLOT"


def test_job_level_fields():
    assert error(JobConfig, {"data": {"path": "/d"}}).field == "storage"
    assert error(JobConfig, job(name="my run!")).field == "name"
    assert error(JobConfig, ["storage"]).field == "JobConfig"


def test_missing_data_section_is_still_validated():
    e = error(JobConfig, {"storage": "/tmp/ckpt"})
    assert e.field == "data.path"


def test_top_level_dataclass_fields_have_no_leading_dot():
    assert error(TrainingConfig, {"workers": [3, 1]}).field == "workers"
    assert error(TrainingConfig, {"zero_stage": 4}).field == "zero_stage"
    assert error(DataConfig, {}).field == "path"


# -- PrepareConfig -------------------------------------------------------------------------------
def test_prepare_config_valid_and_defaults():
    cfg = from_mapping(PrepareConfig, {"source": "/corpus", "output": "s3://b/data"})
    assert cfg.format == "auto" and cfg.tokenizer == "bytes" and cfg.seq_len == 64
    assert ".txt" in cfg.suffixes


@pytest.mark.parametrize("data,field", [
    ({"output": "/out"}, "source"),
    ({"source": "/c"}, "output"),
    ({"source": "/c", "output": "/o", "format": "csv"}, "format"),
    ({"source": "/c", "output": "/o", "seq_len": 0}, "seq_len"),
    ({"source": "/c", "output": "/o", "rows_per_shard": -5}, "rows_per_shard"),
    ({"source": "/c", "output": "/o", "suffixes": ".txt"}, "suffixes"),
    ({"source": "/c", "output": "/o", "suffixes": [".txt", 3]}, "suffixes[1]"),
    ({"source": "/c", "output": "/o", "colour": "red"}, "colour"),
])
def test_prepare_config_validation(data, field):
    assert error(PrepareConfig, data).field == field


def test_prepare_config_format_lists_choices():
    e = error(PrepareConfig, {"source": "/c", "output": "/o", "format": "csv"})
    for f in ("auto", "text", "jsonl", "parquet"):
        assert f in e.accepted


# -- load_yaml -----------------------------------------------------------------------------------
def test_load_yaml_missing_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_yaml(str(tmp_path / "nope.yaml"))
    assert err.value.field == "--config" and "no such file" in str(err.value)


def test_load_yaml_invalid_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("training:\n  steps: 5\n  workers: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(str(p))
    assert err.value.field == "--config" and "not valid YAML" in str(err.value)
    assert "line" in str(err.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "", "42\n"])
def test_load_yaml_non_mapping(tmp_path, text):
    p = tmp_path / "list.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(str(p))
    assert err.value.field == "--config" and "mapping" in str(err.value)


def test_load_yaml_binary_file(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(ConfigError) as err:
        load_yaml(str(p))
    assert err.value.field == "--config"


def test_load_yaml_mapping(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("storage: /x\ntraining:\n  steps: 3\n")
    assert load_yaml(str(p)) == {"storage": "/x", "training": {"steps": 3}}


# -- load_job_config -----------------------------------------------------------------------------
def test_load_job_config_file_and_dotted_overrides(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("storage: /ckpt\ndata: {path: /data}\ntraining:\n  steps: 50\n  workers: [1, 2]\n")
    cfg = load_job_config(str(p), {"training.steps": 7, "training.workers": [2, 4], "training.global_batch": 24,
                                   "name": "r1", "cluster.gpu_resource": "GPU_SLOT"})
    assert cfg.training.steps == 7 and cfg.training.workers == [2, 4] and cfg.training.global_batch == 24
    assert cfg.name == "r1" and cfg.cluster.gpu_resource == "GPU_SLOT"
    assert cfg.storage == "/ckpt" and cfg.data.path == "/data"
    assert load_job_config(str(p)).training.steps == 50        # the file itself is left as it was


def test_load_job_config_overrides_only():
    cfg = load_job_config(None, {"storage": "/c", "data.path": "/d", "training.zero_stage": 3})
    assert cfg.training.zero_stage == 3 and cfg.data.path == "/d"


def test_load_job_config_override_into_an_empty_section(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("storage: /ckpt\ndata: {path: /data}\ntraining:\n")
    assert load_job_config(str(p), {"training.steps": 9}).training.steps == 9


def test_load_job_config_override_through_a_scalar(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("storage: /ckpt\ndata: {path: /data}\ntraining: 3\n")
    with pytest.raises(ConfigError) as err:
        load_job_config(str(p), {"training.steps": 9})
    assert err.value.field == "training"


def test_load_job_config_bad_override_is_validated():
    with pytest.raises(ConfigError) as err:
        load_job_config(None, {"storage": "/c", "data.path": "/d", "training.zero_stage": 4})
    assert err.value.field == "training.zero_stage"
    with pytest.raises(ConfigError) as err:
        load_job_config(None, {"storage": "/c", "data.path": "/d", "training.nope": 1})
    assert err.value.field == "training.nope"


@pytest.mark.parametrize("reader, raw, accepted", [("env_float", "fast", "a number >= 0"),
                                                   ("env_float", "nan", "a number >= 0"),
                                                   ("env_float", "-1", "a number >= 0"),
                                                   ("env_int", "2.5", "an integer >= 0")])
def test_bad_numeric_environment_variables_are_one_line_config_errors(monkeypatch, reader, raw, accepted):
    from spotfill.config import constants
    monkeypatch.setattr(constants, "ENV_NUMBERS", dict(constants.ENV_NUMBERS))  # the test knob stays local
    monkeypatch.setenv("SPOTFILL_TEST_KNOB", raw)
    with pytest.raises(ConfigError, match=f"^SPOTFILL_TEST_KNOB: bad value '{raw}'; accepted: {accepted}$"):
        getattr(constants, reader)("SPOTFILL_TEST_KNOB", 1)
    monkeypatch.setenv("SPOTFILL_TEST_KNOB", " ")
    assert getattr(constants, reader)("SPOTFILL_TEST_KNOB", 7) == 7


# Every numeric SPOTFILL_* variable constants.py reads (an independent list: a new one must be added here).
ENV_NUMBERS = {
    "SPOTFILL_STORAGE_RETRIES": ("0", "an integer >= 1"),
    "SPOTFILL_STORAGE_RETRY_BASE_S": ("-0.5", "a number >= 0"),
    "SPOTFILL_STORAGE_RETRY_MAX_S": ("x", "a number >= 0"),
    "SPOTFILL_STORAGE_RETRY_DEADLINE_S": ("0", "a number > 0"),
    "SPOTFILL_STORAGE_CONCURRENCY": ("1.5", "an integer >= 1"),
    "SPOTFILL_STORAGE_CHUNK_MB": ("0", "an integer >= 1"),
    "SPOTFILL_STORAGE_CHECK_TIMEOUT_S": ("inf", "a number > 0"),
    "SPOTFILL_CHECKPOINT_KEEP_LAST": ("abc", "an integer >= 1"),
    "SPOTFILL_CHECKPOINT_COMMIT_TIMEOUT_S": ("nan", "a number > 0"),
    "SPOTFILL_SPOT_POLL_S": ("0", "a number > 0"),
    "SPOTFILL_IMDS_TIMEOUT_S": ("1s", "a number > 0"),
    "SPOTFILL_WORKER_GROUP_START_TIMEOUT_S": ("-3", "a number > 0"),
    "SPOTFILL_UNIVERSAL_INPROCESS_MAX_BYTES": ("1GB", "an integer >= 0"),
}


def test_check_env_knows_every_numeric_variable_read_in_constants():
    import re
    from pathlib import Path

    from spotfill.config import constants
    source = Path(constants.__file__).read_text()
    read = set(re.findall(r'env_(?:int|float)\("(SPOTFILL_[A-Z0-9_]+)"', source))
    assert read <= set(constants.ENV_NUMBERS), read - set(constants.ENV_NUMBERS)
    assert set(ENV_NUMBERS) <= set(constants.ENV_NUMBERS)


@pytest.mark.parametrize("name", sorted(ENV_NUMBERS))
def test_check_env_rejects_each_bad_variable_in_one_line(monkeypatch, name):
    from spotfill.config import constants
    raw, accepted = ENV_NUMBERS[name]
    constants.check_env()                          # the test environment itself is fine
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as err:
        constants.check_env()
    assert str(err.value) == f"{name}: bad value {raw!r}; accepted: {accepted}"


def test_check_env_accepts_good_values(monkeypatch):
    from spotfill.config import constants
    for name, good in (("SPOTFILL_STORAGE_RETRIES", " 3 "), ("SPOTFILL_SPOT_POLL_S", "0.5"),
                       ("SPOTFILL_STORAGE_RETRY_BASE_S", "0"), ("SPOTFILL_CHECKPOINT_KEEP_LAST", "")):
        monkeypatch.setenv(name, good)
    constants.check_env()


def test_storage_endpoint_env_is_endpoint_and_region_only(monkeypatch):
    from spotfill.config import constants
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", " http://127.0.0.1:9000 ")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "t0ken")
    assert constants.storage_endpoint_env() == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3.local:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert constants.storage_endpoint_env() == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                                "AWS_ENDPOINT_URL_S3": "http://s3.local:1", "AWS_REGION": "eu-west-1"}


def test_prepare_source_stdlib_scheme_resolves_to_this_pythons_stdlib(tmp_path):
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    cfg = load_prepare_config(None, {"source": "stdlib:json", "output": str(tmp_path)})
    assert cfg.source == os.path.join(stdlib, "json") and os.path.isfile(os.path.join(cfg.source, "decoder.py"))
    assert load_prepare_config(None, {"source": "stdlib:", "output": "/o"}).source.rstrip("/") == stdlib.rstrip("/")
    assert load_prepare_config(None, {"source": "s3://b/stdlib:x", "output": "/o"}).source == "s3://b/stdlib:x"

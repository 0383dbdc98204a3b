"""jobkit.py (the jobs/*.py bootstrap) and load_prepare_config, without Ray."""
from __future__ import annotations

import json
import os

import pytest

from spotfill.cli import jobkit
from spotfill.config.job import load_prepare_config
from spotfill.config.errors import ConfigError, JobFailed


def set_job_env(monkeypatch, runtime_env: dict) -> None:
    monkeypatch.setenv(jobkit.JOB_CONFIG_ENV, json.dumps({"runtime_env": runtime_env, "metadata": {}}))


@pytest.fixture(autouse=True)
def no_endpoint_env(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)


def test_source_tree_is_shipped_as_py_modules(monkeypatch):
    monkeypatch.delenv(jobkit.JOB_CONFIG_ENV, raising=False)
    assert jobkit.shipped()                    # the tests import spotfill from platform/, not site-packages
    env = jobkit.runtime_env({"A": "1"})
    assert env == {"py_modules": [jobkit.library_dir()], "env_vars": {"A": "1"}}
    assert os.path.isfile(os.path.join(env["py_modules"][0], "__init__.py"))


def test_fields_the_job_sets_are_left_to_the_job(monkeypatch):
    # ray.init inside a job refuses a field or env var set by both the job and the driver
    set_job_env(monkeypatch, {"working_dir": "gcs://x.zip", "py_modules": ["gcs://m.zip"],
                              "env_vars": {"A": "job"}})
    assert jobkit.in_ray_job()
    assert jobkit.runtime_env({"A": "mine", "B": "2"}) == {"env_vars": {"B": "2"}}
    set_job_env(monkeypatch, {"working_dir": "gcs://x.zip"})
    assert jobkit.runtime_env() == {"py_modules": [jobkit.library_dir()]}


def test_driver_s3_endpoint_reaches_the_workers_but_no_secret(monkeypatch):
    monkeypatch.delenv(jobkit.JOB_CONFIG_ENV, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    env = jobkit.runtime_env({"A": "1"})
    assert env["env_vars"] == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1", "A": "1"}
    assert "s3cr3t" not in json.dumps(env) and "AKIDEXAMPLE" not in json.dumps(env)
    # inside a Ray job that sets the endpoint itself, the job's value stands (ray.init refuses both)
    set_job_env(monkeypatch, {"env_vars": {"AWS_ENDPOINT_URL": "http://job:1"}})
    assert jobkit.runtime_env()["env_vars"] == {"AWS_REGION": "eu-west-1"}


def test_absolute_paths(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(jobkit.JOB_CONFIG_ENV, raising=False)
    assert jobkit.absolute("storage", "ckpt") == str(tmp_path / "ckpt")
    for uri in ("/abs/x", "s3://b/p?endpoint_override=http://h:1", "file:///x", ""):
        assert jobkit.absolute("storage", uri) == uri
    assert jobkit.absolute("run_dir", "~/runs") == os.path.expanduser("~/runs")
    set_job_env(monkeypatch, {})
    with caplog.at_level("WARNING"):
        assert jobkit.absolute("run_dir", "runs/x") == str(tmp_path / "runs" / "x")
    assert "temporary working dir" in caplog.text


@pytest.mark.parametrize("exc, code, stderr", [
    (ConfigError("training.steps", 0, accepted="> 0"), 2,
     "x.py: error: training.steps: bad value 0; accepted: > 0\n"),
    (JobFailed("training did not finish"), 1, "x.py: failed: training did not finish\n"),
])
def test_run_main_exit_codes(capsys, exc, code, stderr):
    def main(args):
        raise exc
    assert jobkit.run_main(main, jobkit.parser("x.py", "test"), []) == code
    out, err = capsys.readouterr()
    assert out == "" and err == stderr


def test_run_main_prints_one_json_line(capsys):
    ap = jobkit.parser("x.py", "test")
    ap.add_argument("--config", required=True)
    assert jobkit.run_main(lambda a: {"ok": True, "config": a.config}, ap, ["--config", "c.yaml"]) == 0
    assert capsys.readouterr().out == '{"ok": true, "config": "c.yaml"}\n'
    assert jobkit.run_main(lambda a: {}, ap, []) == 2
    assert capsys.readouterr().err == "x.py: error: --config: required; accepted: see `x.py --help`\n"


def test_load_prepare_config(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("data: {source: /corpus, output: /out, seq_len: 32}\n")
    cfg = load_prepare_config(str(f), {"seq_len": 128})
    assert (cfg.source, cfg.output, cfg.seq_len) == ("/corpus", "/out", 128)
    f.write_text("data: {source: /corpus, output: /out, bogus: 1}\n")
    with pytest.raises(ConfigError, match=r"^data.bogus: unknown key"):
        load_prepare_config(str(f))
    f.write_text("training: {}\n")
    with pytest.raises(ConfigError, match=r"^training: unknown key .*accepted: data"):
        load_prepare_config(str(f))
    f.write_text("data: {source: /corpus}\n")
    with pytest.raises(ConfigError, match=r"^data.output: "):
        load_prepare_config(str(f))


def test_usage_errors_name_the_argument_first():
    from spotfill.cli.main import main, usage_error

    assert str(usage_error("spotfill plan", "argument --gpus: invalid int value: 'x'")) == (
        "--gpus: invalid int value: 'x'; accepted: see `spotfill plan --help`")
    assert str(usage_error("x.py", "argument -o/--out: expected one argument")).startswith("--out: expected")
    assert str(usage_error("spotfill", "the following arguments are required: COMMAND")).startswith(
        "COMMAND: required")
    assert main(["plan", "--no-such-flag"]) == 2

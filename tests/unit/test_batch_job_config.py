"""jobs/batch_infer.py's input checks, before any Ray starts: the config (unknown keys, bad values), the
prompt file, and a resume against an output that holds another job's plan -- one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from spotfill.config.errors import ConfigError
from spotfill.config.batch import load_batch_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_example_config_parses():
    cfg = load_batch_config(os.path.join(ROOT, "examples", "batch-tiny.yaml"))
    assert cfg.grant.units == 0 and cfg.cluster.gpu_resource == "GPU" and cfg.eval.rows == 256
    assert cfg.cluster.standby_per_node == 1          # warm standbys by default (fillin/batch_standby.py)


@pytest.mark.parametrize("doc, field", [
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d", "rowz": 3}}, "eval.rowz"),
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d", "rows_per_unit": 0}}, "eval.rows_per_unit"),
    ({"checkpoint": "/c", "output": "/o"}, "eval.data"),
    ({"output": "/o", "eval": {"data": "/d"}}, "checkpoint"),
    ({"checkpoint": "/c", "eval": {"data": "/d"}}, "output"),
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d"}, "cluster": {"grace_s": 0}}, "cluster.grace_s"),
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d"}, "grant": {"units": -1}}, "grant.units"),
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d"}, "cluster": {"standby_per_node": 9}},
     "cluster.standby_per_node"),
    ({"checkpoint": "/c", "output": "/o", "eval": {"data": "/d"}, "cluster": {"standby_per_node": True}},
     "cluster.standby_per_node"),
])
def test_bad_config_names_the_field(tmp_path, doc, field):
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        load_batch_config(str(path))
    assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)


def test_the_entrypoint_answers_bad_input_with_one_line_and_exit_2(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n')
    cfg = tmp_path / "b.yaml"
    cfg.write_text(yaml.safe_dump({"checkpoint": str(tmp_path / "none"), "output": str(tmp_path / "out"),
                                   "generate": {"prompts": str(prompts)}}))
    for args, words in ((["--config", str(tmp_path / "missing.yaml")], "--config"),
                        (["--config", str(cfg)], "generate.prompts"),      # duplicate prompt ids
                        (["--config", str(cfg), "--units", "x"], "--units")):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "batch_infer.py"), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("text, why", [
    ('{"prompt": "a"}\nnot json\n', "line 2"),
    ('{"text": "a"}\n', "prompt"),
    ('{"prompt": "a", "id": [1]}\n', "id"),
    ("\n\n", "no prompts"),
])
def test_bad_prompt_files_name_the_line(tmp_path, text, why):
    from spotfill.fillin.batch import read_prompts
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_prompts(str(path))
    assert str(err.value).startswith("generate.prompts") and why in str(err.value)


def test_prompts_without_ids_get_their_line_number(tmp_path):
    from spotfill.fillin.batch import read_prompts
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "id": "x"}\n{"prompt": "c"}\n')
    ids, prompts, sha = read_prompts(str(path))
    assert ids == ["0", "x", "2"] and prompts == ["a", "b", "c"] and len(sha) == 64


def test_a_resume_with_other_inputs_is_refused(tmp_path):
    from spotfill.fillin import batch_plan as bp
    from spotfill.fillin.batch import load_or_make_plan
    from spotfill.storage.base import open_storage
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    out = open_storage(str(tmp_path / "out"))
    out.put_bytes(bp.PLAN_KEY, json.dumps({"checkpoint_tag": "step-00000010", "eval_rows": 0, "eval_data": None,
                                           "eval_rows_per_unit": 32, "prompts_sha256": "other",
                                           "generate_rows_per_unit": 4, "max_tokens": 32, "temperature": 0.0,
                                           "seed": 0, "prompt_ids": ["0"]}).encode())
    cfg = load_batch_config(None, {"checkpoint": "/c", "output": str(tmp_path / "out"),
                                   "generate.prompts": str(prompts)})
    with pytest.raises(ConfigError) as err:
        load_or_make_plan(cfg, out)
    assert str(err.value).startswith("output:") and "prompts_sha256" in str(err.value)

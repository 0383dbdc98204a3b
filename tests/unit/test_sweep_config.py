"""jobs/sweep.py's config (spotfill.config.sweep) and its command line: bad input is one line, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from spotfill.config.errors import ConfigError
from spotfill.config.sweep import load_sweep_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, doc) -> str:
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


BASE = {"storage": "/tmp/x", "data": {"path": "/tmp/d"}}


def test_grid_is_every_combination_in_file_order_and_trials_caps_it(tmp_path):
    cfg = load_sweep_config(write(tmp_path, {**BASE, "sweep": {"search": {"lr": [0.1, 0.2], "warmup_steps": [0, 5, 9]}}}))
    grid = cfg.sweep.grid()
    assert len(grid) == 6 and grid[0] == {"lr": 0.1, "warmup_steps": 0} and grid[-1] == {"lr": 0.2, "warmup_steps": 9}
    cfg = load_sweep_config(write(tmp_path, {**BASE, "sweep": {"trials": 2}}), {"sweep.steps": 7})
    assert len(cfg.sweep.grid()) == 2 and cfg.sweep.steps == 7


@pytest.mark.parametrize("doc, field", [
    ({**BASE, "sweep": {"search": {"momentum": [0.9]}}}, "sweep.search.momentum"),
    ({**BASE, "sweep": {"search": {"lr": []}}}, "sweep.search.lr"),
    ({**BASE, "sweep": {"search": {"lr": [0]}}}, "sweep.search.lr"),
    ({**BASE, "sweep": {"search": {"warmup_steps": [1.5]}}}, "sweep.search.warmup_steps"),
    ({**BASE, "sweep": {"steps": 0}}, "sweep.steps"),
    ({**BASE, "sweep": {"model": "huge"}}, "sweep.model"),
    ({**BASE, "fillin": {"grant": "maybe"}}, "fillin.grant"),
    ({**BASE, "fillin": {"max_units": 0}}, "fillin.max_units"),
    ({**BASE, "extra": 1}, "extra"),
    ({"data": {"path": "/tmp/d"}}, "storage"),
    ({"storage": "/tmp/x"}, "data.path"),
])
def test_bad_fields_are_named(tmp_path, doc, field):
    with pytest.raises(ConfigError) as err:
        load_sweep_config(write(tmp_path, doc))
    assert str(err.value).startswith(f"{field}: ")


def test_cli_bad_config_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, {**BASE, "sweep": {"search": {"lr": ["fast"]}}})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "sweep.py"), "--config", path],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "sweep.search.lr" in r.stderr and "Traceback" not in r.stderr


def test_cli_missing_dataset_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, {**BASE, "data": {"path": str(tmp_path / "nothing")}})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "sweep.py"), "--config", path],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "data.path" in r.stderr and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0

"""sweep_state: a sweep experiment's saved state files checked before Tune restores them -- a file an
earlier driver was killed while copying to storage (empty or cut short) is set aside, never deleted, and
the restore goes on from the newest intact state."""
from __future__ import annotations

import json
import os
import pickle

import pytest

from spotfill.fillin import sweep_state as ss

CONFIGS = [{"lr": 0.001, "warmup_steps": 0}, {"lr": 0.001, "warmup_steps": 4}, {"lr": 0.003, "warmup_steps": 0}]


def experiment_state(trials: dict[str, dict]) -> bytes:
    """Tune's experiment_state-*.json shape: trial_data = [[trial json, run metadata json], ...]."""
    data = [[json.dumps({"trial_id": t, "config": c, "status": "TERMINATED"}), json.dumps({"last_result": {}})]
            for t, c in trials.items()]
    return json.dumps({"trial_data": data, "runner_data": {}, "stats": {}}).encode()


def searcher_state(handed_out: int) -> bytes:
    return json.dumps({"configs": CONFIGS, "job": {"steps": 40}, "handed_out": handed_out, "config_of": {}}).encode()


def write(root, name: str, data: bytes) -> None:
    with open(os.path.join(root, name), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("data, whole", [
    (b"", False),
    (b'{"trial_data": [["{\\"trial_id', False),                       # JSON cut short
    (b'{"a": 1}', True),
    (pickle.dumps({"counter": 2, "finished": False, "x": list(range(100))}, protocol=5), True),
    (pickle.dumps({"counter": 2, "finished": False, "x": list(range(100))}, protocol=5)[:-1], False),   # no STOP
    (pickle.dumps({"counter": 2, "finished": False, "x": list(range(100))}, protocol=5)[:40], False),
])
def test_a_state_file_is_whole_only_when_it_parses_to_its_end(data, whole):
    assert ss.intact(data) is whole


def test_a_damaged_newest_file_is_set_aside_and_the_restore_goes_on_from_the_newest_intact_state(tmp_path):
    root = str(tmp_path)
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    old, new = "2026-12-02_18-27-06", "2026-12-02_18-29-40"
    write(root, f"experiment_state-{old}.json", experiment_state({"a1": CONFIGS[0]}))
    write(root, f"searcher-state-{old}.pkl", searcher_state(1))
    write(root, f"search_gen_state-{old}.json", pickle.dumps({"counter": 1}))
    write(root, f"experiment_state-{new}.json", experiment_state({"a1": CONFIGS[0], "b2": CONFIGS[1]}))
    write(root, f"searcher-state-{new}.pkl", b"")                        # the killed driver's copy
    write(root, f"search_gen_state-{new}.json", pickle.dumps({"counter": 2})[:5])
    os.makedirs(os.path.join(root, "SweepTrainable_a1"))                 # trial folders are not state files

    check = ss.check_experiment(root)

    assert sorted(f["file"] for f in check.set_aside) == [f"search_gen_state-{new}.json", f"searcher-state-{new}.pkl"]
    assert all(f["as"] == f["file"] + ".damaged" for f in check.set_aside)
    names = set(os.listdir(root))
    assert f"searcher-state-{new}.pkl" not in names and f"searcher-state-{new}.pkl.damaged" in names
    assert open(os.path.join(root, f"search_gen_state-{new}.json.damaged"), "rb").read() == pickle.dumps({"counter": 2})[:5]
    # the trials come from the newest experiment state, though the newest intact searcher state is older
    assert check.trials == {"a1": CONFIGS[0], "b2": CONFIGS[1]} and check.searcher["handed_out"] == 1
    assert check.restorable and ss.handed_out(check.trials, CONFIGS) == 2

    # a second damaged copy of the same name is set aside beside the first, not over it
    write(root, f"searcher-state-{new}.pkl", b"{")
    again = ss.check_experiment(root)
    assert [f["as"] for f in again.set_aside] == [f"searcher-state-{new}.pkl.damaged.1"]
    assert again.trials == check.trials


def test_with_no_intact_experiment_state_or_tuner_file_nothing_is_restorable(tmp_path):
    root = str(tmp_path)
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    write(root, "experiment_state-2026-12-02_18-27-06.json", experiment_state({"a1": CONFIGS[0]})[:30])
    check = ss.check_experiment(root)
    assert check.trials is None and check.tuner_intact and not check.restorable
    write(root, "experiment_state-2026-12-02_18-28-00.json", experiment_state({"a1": CONFIGS[0]}))
    write(root, "tuner.pkl", b"\x80\x05")
    check = ss.check_experiment(root)
    assert check.trials == {"a1": CONFIGS[0]} and not check.tuner_intact and not check.restorable
    assert [f["file"] for f in check.set_aside] == ["tuner.pkl"]


def test_trials_account_for_the_first_configurations_of_the_same_grid_only():
    assert ss.handed_out({}, CONFIGS) == 0
    assert ss.handed_out({"b": CONFIGS[1], "a": CONFIGS[0]}, CONFIGS) == 2       # order of trials is free
    assert ss.handed_out({"a": CONFIGS[0], "c": CONFIGS[2]}, CONFIGS) is None    # not the first two
    assert ss.handed_out({"a": {"lr": 0.5, "warmup_steps": 0}}, CONFIGS) is None
    assert ss.handed_out({str(i): c for i, c in enumerate(CONFIGS + CONFIGS[:1])}, CONFIGS) is None


def test_on_s3_a_damaged_file_is_set_aside_as_an_object_of_its_own(s3_server, s3_uri):
    """Sweeps keep their experiments on S3 too: the set-aside is a copy and a delete there."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(s3_uri)
    bucket, prefix = root.split("/", 1)
    for name, data in (("tuner.pkl", pickle.dumps({"tuner": 1})),
                       ("experiment_state-2026-12-02_18-27-06.json", experiment_state({"a1": CONFIGS[0]})),
                       ("searcher-state-2026-12-02_18-27-06.pkl", b"")):
        s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    check = ss.check_experiment(s3_uri)
    assert [f["as"] for f in check.set_aside] == ["searcher-state-2026-12-02_18-27-06.pkl.damaged"]
    assert check.trials == {"a1": CONFIGS[0]} and check.searcher is None and check.restorable
    names = {i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(root))}
    assert "searcher-state-2026-12-02_18-27-06.pkl" not in names
    assert "searcher-state-2026-12-02_18-27-06.pkl.damaged" in names


def control_for(root: str, events: list):
    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import SweepControl

    c = SweepControl(FixedGrant(1), CONFIGS, emit=lambda kind, **f: events.append({"kind": kind, **f}))
    c.experiment, c.job = root, {"steps": 40}
    return c


def test_a_rerun_goes_on_from_the_trials_and_reports_each_file_it_set_aside(tmp_path):
    from spotfill.fillin.sweep import JOB_KEYS, _prepare_restore

    root, events = str(tmp_path), []
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    write(root, "experiment_state-2026-12-02_18-27-06.json", experiment_state({"a1": CONFIGS[0], "b2": CONFIGS[1]}))
    write(root, "searcher-state-2026-12-02_18-27-06.pkl", b"")
    c = control_for(root, events)
    assert _prepare_restore(c) is True
    assert (c.restore_handed_out, c.restore_trials) == (2, {"a1": CONFIGS[0], "b2": CONFIGS[1]})
    assert c.tally.as_report()["state_set_aside"] == ["searcher-state-2026-12-02_18-27-06.pkl"]
    assert [(e["kind"], e["file"], e["cause"]) for e in events] == [
        ("sweep_state_damaged", "searcher-state-2026-12-02_18-27-06.pkl", "partial_write")]

    # the settings the intact searcher state saved are checked against this sweep's
    write(root, "searcher-state-2026-12-02_18-27-06.pkl",
          json.dumps({"configs": CONFIGS, "job": {k: (41 if k == "steps" else None) for k in JOB_KEYS}}).encode())
    with pytest.raises(ValueError, match=r"^storage: holds an experiment of this name with another sweep settings"):
        _prepare_restore(control_for(root, []))


def test_trials_of_another_grid_are_refused_even_with_no_searcher_state_left(tmp_path):
    from spotfill.config.errors import ConfigError
    from spotfill.fillin.sweep import _prepare_restore

    root = str(tmp_path)
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    write(root, "experiment_state-2026-12-02_18-27-06.json", experiment_state({"z9": {"lr": 0.5, "warmup_steps": 0}}))
    with pytest.raises(ConfigError, match=r"another search grid \(\[\{'lr': 0.5"):
        _prepare_restore(control_for(root, []))


def test_nothing_restorable_left_starts_the_sweep_anew_and_says_why(tmp_path):
    from spotfill.fillin.sweep import _prepare_restore

    root, events = str(tmp_path), []
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    write(root, "experiment_state-2026-12-02_18-27-06.json", b'{"trial_data": [')
    assert _prepare_restore(control_for(root, events)) is False
    assert [e["kind"] for e in events] == ["sweep_state_damaged", "sweep_start_over"]
    assert events[-1]["cause"] == "no_restorable_state" and events[-1]["detail"] == "no intact experiment state saved"


def test_the_backup_is_written_whole_under_its_own_name(tmp_path):
    staging, storage = tmp_path / "staging", tmp_path / "exp"
    staging.mkdir()
    state = experiment_state({"a1": CONFIGS[0]})
    write(str(staging), "experiment_state-2026-12-02_18-27-06.json", state)
    assert ss.back_up(str(staging), "2026-12-02_18-27-06", str(storage)) == "experiment_state-2026-12-02_18-27-06.json.last"
    assert os.listdir(storage) == ["experiment_state-2026-12-02_18-27-06.json.last"]      # no temporary left
    assert (storage / "experiment_state-2026-12-02_18-27-06.json.last").read_bytes() == state
    assert ss.back_up(str(staging), "2026-12-02_18-30-00", str(storage)) is None          # no such session


@pytest.mark.parametrize("main", [b"", None], ids=["cut-short", "never-copied"])
def test_an_experiment_state_damaged_or_missing_is_put_back_from_its_whole_copy(tmp_path, main):
    root, name = str(tmp_path), "experiment_state-2026-12-02_18-27-06.json"
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    if main is not None:
        write(root, name, main)
    write(root, name + ss.BACKUP_SUFFIX, experiment_state({"a1": CONFIGS[0]}))
    check = ss.check_experiment(root)
    assert check.restored_from == [{"file": name, "from": name + ".last"}]
    assert [f["file"] for f in check.set_aside] == ([name] if main is not None else [])
    assert check.trials == {"a1": CONFIGS[0]} and check.restorable
    assert open(os.path.join(root, name), "rb").read() == experiment_state({"a1": CONFIGS[0]})


def test_a_damaged_backup_is_not_put_back(tmp_path):
    root, name = str(tmp_path), "experiment_state-2026-12-02_18-27-06.json"
    write(root, "tuner.pkl", pickle.dumps({"tuner": 1}))
    write(root, name, b"{")
    write(root, name + ss.BACKUP_SUFFIX, experiment_state({"a1": CONFIGS[0]})[:20])
    check = ss.check_experiment(root)
    assert check.restored_from == [] and check.trials is None and not check.restorable

"""Model cards and `spotfill export` without DeepSpeed: checkpoints laid out as DeepSpeed saves a module
without ZeRO partitions (rank-0/mp_rank_00_model_states.pt = {"module": state}), committed through the
checkpoint store with the card worker_loop records (tests/integration/test_export.py saves through a real
engine). The CLI's bad inputs exit 2 with one line; an old checkpoint without a card still loads, and says
its shape was guessed; training.export_on_finish is validated and runs at the end of a job."""
from __future__ import annotations

import json
import logging
import os

import pytest

from spotfill.config.errors import ConfigError
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.train.model_card import for_checkpoints

transformers = pytest.importorskip("transformers")
DATA = {"seq_len": 64, "vocab_size": 257, "tokenizer": "bytes"}


def _commit(run: str, tmp_path, step: int, state: dict, meta: dict | None) -> None:
    import torch
    part = tmp_path / f"part-{step}"
    part.mkdir()
    torch.save({"module": state}, part / "mp_rank_00_model_states.pt")
    store = CheckpointStore(open_storage(run))
    store.upload_part(tag_for(step), 0, 1, str(part))
    store.commit(tag_for(step), step, 1, meta=meta)


@pytest.fixture
def tiny_run(tmp_path):
    """A run with checkpoints at steps 10 and 20 of a seeded tiny GPT, each carrying its card."""
    import torch

    from spotfill.train.model import build_model
    torch.manual_seed(3)
    model = build_model("tiny", seq_len=64, vocab_size=257).eval()
    with torch.no_grad():   # weights off their initial scale, as trained ones are: GELU's tails and every
        for p in model.parameters():            # other term of the mapping then move the logits
            p.add_(torch.randn_like(p) * 0.2)
    card, _ = for_checkpoints("tiny", DATA, rank=0)
    run = str(tmp_path / "runs" / "job")
    for step in (10, 20):
        _commit(run, tmp_path, step, model.state_dict(), {"model": card})
    return run, model


def _cli(capsys, *argv) -> tuple[int, str]:
    from spotfill.cli.main import main
    rc = main(["export", *argv])
    return rc, capsys.readouterr().err


def test_bad_input_exits_2_with_one_line(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    empty_run = str(tmp_path / "runs" / "nothing")
    os.makedirs(empty_run)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("taken")
    for argv, field in (([empty_run, "--out", str(tmp_path / "o1")], "RUN_URI"),
                        ([str(tmp_path / "no-such-run"), "--out", str(tmp_path / "o2")], "RUN_URI"),
                        ([run, "--step", "15", "--out", str(tmp_path / "o3")], "--step"),
                        ([run, "--out", str(full)], "--out"),
                        ([run, "--step", "x", "--out", str(tmp_path / "o4")], "--step"),
                        ([run], "--out")):
        rc, err = _cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err and f"error: {field}" in err, err
    assert "accepted: one of 10, 20" in _cli(capsys, run, "--step", "15", "--out", str(tmp_path / "o5"))[1]
    assert not any(os.path.exists(tmp_path / f"o{i}") for i in range(1, 6))
    assert os.listdir(full) == ["x"]


def test_export_at_a_step_writes_the_folder_transformers_loads(tiny_run, tmp_path, capsys):
    import torch
    run, model = tiny_run
    out = tmp_path / "empty-out"
    out.mkdir()                                    # an empty folder is fine
    rc, _ = _cli(capsys, run, "--step", "10", "--out", str(out))
    assert rc == 0
    rec = json.loads((out / "spotfill_export.json").read_text())
    assert rec["tag"] == tag_for(10) and rec["card"] == "carried" and rec["architecture"] == "GPT2LMHeadModel"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 257, (3, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert float((hf(input_ids=ids).logits - model(ids)).abs().max()) <= 1e-4
    assert not any(n.startswith(".spotfill-export-") for n in os.listdir(tmp_path))   # no staging left


def test_the_byte_tokenizer_round_trips_ascii_and_utf8(tmp_path):
    from spotfill.train.data import byte_encode
    from spotfill.train.export import byte_tokenizer
    byte_tokenizer(64).save_pretrained(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("plain ASCII, 0123 ~!@#", "tabs\tand\nlines \r\n", "é ü ß 日本語 🙂 — «»", "<|endoftext|>", ""):
        ids = tok.encode(text)
        assert ids == byte_encode(text)[:-1]           # spotfill's ids (its data adds the end-of-document)
        assert tok.decode(ids) == text
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (256, 256, 257)


def test_a_checkpoint_without_a_card_is_guessed_and_says_so(tmp_path, caplog):
    import torch

    from spotfill.fillin.generate import load_newest
    from spotfill.train.export import export_run
    from spotfill.train.model import build_model
    torch.manual_seed(1)
    model = build_model("tiny", seq_len=64, vocab_size=257).eval()
    run = str(tmp_path / "old")
    _commit(run, tmp_path, 5, model.state_dict(), meta=None)      # written before cards existed
    with caplog.at_level(logging.WARNING):
        loaded = load_newest(CheckpointStore(open_storage(run)), str(tmp_path / "w"))
        rec = export_run(run, str(tmp_path / "hf"))
    assert loaded.card["guessed"] and loaded.model.cfg.n_head == 2
    assert rec["card"] == "guessed" and "carries no model card" in caplog.text


def test_a_tokenizer_the_checkpoint_does_not_carry_is_refused_in_one_line(tmp_path):
    from spotfill.train.export import export_run
    from spotfill.train.model import build_model
    card, files = for_checkpoints("tiny", {**DATA, "tokenizer": f"hf:{tmp_path / 'gone'}"}, rank=0)
    assert files == {} and card["tokenizer"]["missing"]
    run = str(tmp_path / "run")
    _commit(run, tmp_path, 5, build_model("tiny", seq_len=64, vocab_size=257).state_dict(), {"model": card})
    with pytest.raises(ConfigError, match="does not carry its files"):
        export_run(run, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_a_failed_logit_check_leaves_nothing_at_out(tiny_run, tmp_path, monkeypatch):
    from spotfill.config.errors import JobFailed
    from spotfill.train import export
    monkeypatch.setattr(export, "ATOL", -1.0)             # no difference passes: the check must refuse
    with pytest.raises(JobFailed, match="logits differ"):
        export.export_run(tiny_run[0], str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
    assert not any(n.startswith(".spotfill-export-") for n in os.listdir(tmp_path))   # nor a staging folder


@pytest.mark.parametrize("value,stages,why", [
    ("s3://bucket/models/x", 1, "a local folder"),
    ("FULL", 1, "not an empty folder"),
    ("NEW", 2, "pipeline stages"),
])
def test_export_on_finish_is_validated(tmp_path, value, stages, why):
    from spotfill.config.job import TrainingConfig
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("taken")
    value = {"FULL": str(full), "NEW": str(tmp_path / "new")}.get(value, value)
    t = TrainingConfig(export_on_finish=value, pipeline_stages=stages, workers=[2], global_batch=8,
                       zero_stage=1)
    with pytest.raises(ConfigError, match=why) as exc:
        t.validate("training")
    assert str(exc.value).startswith("training.export_on_finish:")
    TrainingConfig(export_on_finish=str(tmp_path / "new")).validate("training")      # a new folder is fine


def test_a_finished_job_exports_its_final_checkpoint(tiny_run, tmp_path):
    from spotfill.config.job import JobConfig, TrainingConfig
    from spotfill.train.job import TrainingJob
    run, _ = tiny_run
    storage, name = os.path.split(run)
    out = tmp_path / "final"
    cfg = JobConfig(name=name, storage=storage, run_dir=str(tmp_path / "rd"),
                    training=TrainingConfig(export_on_finish=str(out)))
    os.makedirs(cfg.run_dir)
    report = TrainingJob(cfg)._export({"ok": True})
    assert report["ok"] and report["export"]["ok"] and report["export"]["tag"] == tag_for(20)
    assert json.load(open(os.path.join(cfg.run_dir, "report.json")))["export"]["step"] == 20
    assert (out / "model.safetensors").exists()
    again = TrainingJob(cfg)._export({"ok": True})       # the folder is taken now: the job fails, saying why
    assert not again["ok"] and "not an empty folder" in again["error"]

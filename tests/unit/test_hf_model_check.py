"""`hf:/dir` models are checked against the dataset from their config.json before any worker starts."""
from __future__ import annotations

import json

import pytest

from spotfill.config.errors import ConfigError
from spotfill.config.presets import check_hf_model


def _model_dir(tmp_path, **conf):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    return f"hf:{d}"


def test_a_model_that_covers_the_dataset_passes(tmp_path):
    spec = _model_dir(tmp_path, vocab_size=320, max_position_embeddings=128, model_type="llama")
    assert check_hf_model(spec, vocab_size=257, seq_len=64)["model_type"] == "llama"


@pytest.mark.parametrize("conf, match", [
    ({"vocab_size": 200, "max_position_embeddings": 128}, "vocab_size 200 is smaller than the dataset's 257"),
    ({"vocab_size": 320, "max_position_embeddings": 32}, "takes 32 positions.*need 64"),
    ({"vocab_size": 320, "n_positions": 32}, "takes 32 positions"),
])
def test_mismatches_are_one_line_config_errors(tmp_path, conf, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_hf_model(_model_dir(tmp_path, **conf), vocab_size=257, seq_len=64)
    assert str(err.value).startswith("training.model: ") and "\n" not in str(err.value)


def test_missing_folder_or_config(tmp_path):
    with pytest.raises(ConfigError, match="not a local directory"):
        check_hf_model(f"hf:{tmp_path}/nope", 257, 64)
    with pytest.raises(ConfigError, match="no readable config.json"):
        check_hf_model(f"hf:{tmp_path}", 257, 64)

"""Fill-in sits above training: a TrainingJob gets its bubble work passed in (bubble_filler), and one with
`training.bubble_fill` but no filler is refused at validation, naming the field -- never a pipeline that
silently runs its bubbles empty."""
import pytest

from spotfill.config.errors import ConfigError
from spotfill.config.job import load_job_config
from spotfill.train.job import TrainingJob


def _config(tmp_path):
    return load_job_config("examples/pipeline-cpu.yaml", {
        "training.bubble_fill": str(tmp_path / "eval-out"), "storage": str(tmp_path / "ckpt"),
        "data.path": str(tmp_path / "data"), "run_dir": str(tmp_path / "run")})


def test_bubble_fill_without_a_filler_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="^training.bubble_fill") as err:
        TrainingJob(_config(tmp_path)).validate()
    assert "bubble_filler" in str(err.value)



def test_the_sdks_training_job_brings_spotfills_bubble_filler(tmp_path):
    """`spotfill.TrainingJob` (the SDK users import) fills bubbles without being told how."""
    import spotfill
    from spotfill.fillin.bubble_fill import bubble_filler
    job = spotfill.TrainingJob(_config(tmp_path))
    assert isinstance(job, TrainingJob) and job.bubble_filler is bubble_filler
    mine = object()
    assert spotfill.TrainingJob(_config(tmp_path), bubble_filler=mine).bubble_filler is mine

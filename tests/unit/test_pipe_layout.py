"""Pipeline layout and batch arithmetic (config/pipe_layout.py), and the job config's pipeline checks."""
from __future__ import annotations

import numpy as np
import pytest

from spotfill.config.errors import ConfigError
from spotfill.config.job import JobConfig, from_mapping
from spotfill.config.batching import rank_positions
from spotfill.config.pipe_layout import (check_pipeline_range, layout, micro_batch_size, pipeline_batch_shape,
                                        round_to_replicas)


def test_a_replicas_stages_are_consecutive_ranks():
    ranks = [layout(2, 4, r) for r in range(4)]
    assert [(x.replica, x.stage) for x in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ranks[0].ranks_of_replica(1) == [2, 3]
    # first and last stage read the rows (inputs, labels); only the first feeds (records the ledger)
    three = [layout(3, 3, r) for r in range(3)]
    assert [x.reads_data for x in three] == [True, False, True]
    assert [x.feeds_inputs for x in three] == [True, False, False]


def test_micro_batch_stays_fixed_and_micro_batches_grow_when_replicas_are_lost():
    micro = micro_batch_size(16, 2, 4, 8)            # G 16 over 2 replicas x M 4
    assert micro == 2
    full, half = pipeline_batch_shape(16, 2, micro), pipeline_batch_shape(16, 1, micro)
    assert (full.micro_batch, full.accum) == (2, 4) and (half.micro_batch, half.accum) == (2, 8)
    for shape in (full, half):
        assert shape.micro_batch * shape.accum * shape.world_size == 16


def test_unset_micro_batches_take_the_largest_micro_batch_allowed():
    assert micro_batch_size(24, 2, 0, 8) == 6 and micro_batch_size(24, 2, 0, 4) == 4


def test_every_step_consumes_the_same_positions_at_any_replica_count():
    """Global sample ids depend on the step, never on the width: one step's positions over the replicas
    (first stages) are the step's [s*G, (s+1)*G) exactly once, at 2 replicas and at 1."""
    for replicas in (1, 2):
        shape = pipeline_batch_shape(16, replicas, 2)
        got = np.concatenate([rank_positions(5, shape, d) for d in range(replicas)])
        assert sorted(got.tolist()) == list(range(80, 96))


@pytest.mark.parametrize("args, field", [
    ((16, 2, 3, 4, 4, 8), "training.workers"),       # min 3 is not a multiple of 2 stages
    ((16, 2, 2, 5, 4, 8), "training.workers"),       # max 5 neither
    ((16, 2, 2, 4, 3, 8), "training.micro_batches"),  # 8 samples per replica do not split into 3
    ((12, 2, 2, 6, 0, 8), "training.global_batch"),  # 3 replicas at most, micro 4: 1 or 2 replicas cannot
])
def test_ranges_a_pipeline_cannot_run_at_every_size_are_refused(args, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        check_pipeline_range(*args)


def test_workers_round_down_to_whole_replicas():
    assert [round_to_replicas(w, 2) for w in range(6)] == [0, 0, 2, 2, 4, 4]
    assert round_to_replicas(3, 1) == 3


def _training(**kw):
    return from_mapping(JobConfig, {"storage": "/s", "data": {"path": "/d"}, "training": kw}).training


def test_config_accepts_a_pipeline_and_defaults_to_none():
    assert _training().pipeline_stages == 1
    t = _training(pipeline_stages=2, micro_batches=4, workers=[2, 4], global_batch=16, zero_stage=1)
    assert (t.pipeline_stages, t.micro_batches) == (2, 4)


@pytest.mark.parametrize("kw, message", [
    ({"pipeline_stages": 2, "workers": [1, 4], "zero_stage": 1}, "training.workers: the min 1 is not a multiple"),
    ({"pipeline_stages": 2, "workers": [2, 4], "zero_stage": 2}, "training.zero_stage: DeepSpeed's pipeline"),
    ({"pipeline_stages": 2, "workers": [2], "zero_stage": 1, "model": "hf:/x"}, "training.model: pipeline"),
    ({"pipeline_stages": 5, "workers": [5], "zero_stage": 1}, "training.pipeline_stages: more stages"),
    ({"pipeline_stages": 0}, "training.pipeline_stages"),
    ({"pipeline_stages": 2, "workers": [2], "zero_stage": 1, "micro_batches": -1}, "training.micro_batches"),
])
def test_config_refuses_what_a_pipeline_cannot_run_in_one_line(kw, message):
    with pytest.raises(ConfigError) as err:
        _training(**kw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value) and err.value.exit_code == 2


def test_a_rank_deepspeeds_grid_places_elsewhere_than_the_layout_is_refused():
    """The layout decides what a rank reads (inputs, labels, which replica's rows); DeepSpeed's grid decides
    what it computes. Pipe-major (DeepSpeed's default topology) puts rank 1 of 2 x 2 at stage 0 of replica
    1, the layout at stage 1 of replica 0: it would train on another replica's labels -- refused."""
    from types import SimpleNamespace

    from spotfill.train.pipeline import PipelineRun
    job = from_mapping(JobConfig, {"storage": "/s", "data": {"path": "/d"},
                                   "training": {"pipeline_stages": 2, "workers": [4], "zero_stage": 1}})
    run = PipelineRun(job, 4, 1)
    grid = SimpleNamespace(get_data_parallel_id=lambda: 1, get_stage_id=lambda: 0)
    with pytest.raises(RuntimeError, match=r"grid has it at \(replica, stage\) \(1, 0\)"):
        run._check_grid(grid)

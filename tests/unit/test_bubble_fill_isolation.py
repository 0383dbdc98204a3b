"""Fill work leaves training as it was (fillin/bubble_fill.py, `EvalUnitsWork.run`): a training loop that draws
random numbers at every step (dropout on) computes bit-identical losses and parameters whether or not fill
work ran at its bubble points -- fill work that draws random numbers too (its model with dropout on), so a
fill that moved the training's generator would change every later dropout mask.

The GPT presets draw no random numbers after their initialisation (no dropout), and the pinned model of a
batch job runs in eval mode: on them the two-pipeline comparison (tests/integration/
test_bubble_fill_identical.py) cannot see the RNG fork removed. Here it can. Filling during the probe's
calibration steps is caught by tests/unit/test_bubble_fill.py (bubbles measured on steps nobody fills), not
by either comparison: the integration run's steps that calibrate have no bubble estimate to fill yet.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spotfill.fillin.bubble_fill import EvalUnitsWork

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from benchmarks.pipeline import prepare_local
    path = str(tmp_path_factory.mktemp("isolation") / "data")
    prepare_local(path, min_rows=64)
    return path


class _DropoutOn(nn.Module):
    """The batch job's pinned model with dropout on at its output: each forward draws random numbers, and
    records whether autograd was on and whether it ran in inference mode."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return F.dropout(self.inner(idx), p=0.1, training=True)


def _train(start_fill=None) -> tuple[list[float], list[torch.Tensor]]:
    """STEPS SGD steps of a small model with dropout on. `start_fill()`, called once the model is built (where
    the pipeline builds its fill work), returns the fill, run at two bubble points of each step: before its
    forward and between its forward and its backward (the autograd graph alive)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fill = start_fill() if start_fill else None
    x = torch.randn(8, 16)
    losses = []
    for _ in range(STEPS):
        if fill:
            fill()
        loss = model(x).pow(2).mean()
        if fill:
            fill()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_fill_work_that_draws_random_numbers_leaves_a_dropout_training_bit_identical(data, tmp_path):
    from benchmarks.pipeline import make_plan
    make_plan(str(tmp_path), data, "tiny", rows_per_unit=4)
    works = []

    def start_fill():
        work = EvalUnitsWork(str(tmp_path), rank=0, world=1)     # builds (initialises) a model of its own
        work.model = _DropoutOn(work.model)
        works.append(work)
        return lambda: work.run(2)
    plain_losses, plain_params = _train()
    losses, params = _train(start_fill)
    (work,) = works
    work.close()
    assert len(work.model.seen) == 2 * STEPS, "the fill work ran at every bubble point"
    assert len(work.committed) == STEPS, "whole units were evaluated and committed"
    # the comparison can fail: the same training with the fill's draws taken from its generator differs
    assert _train(lambda: (lambda: torch.rand(1)))[0] != plain_losses
    assert losses == plain_losses, "the fill moved the training's random number generator"
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert set(work.model.seen) == {(False, True)}, "the fill ran with autograd on, or outside inference mode"

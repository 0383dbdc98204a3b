"""The batch job's generation (fillin/generate.py generate_rows, UnitWorker._generate) runs a unit's rows
together on spotfill/generation's KV-cached engine: greedy output is exactly the one-prompt-at-a-time,
no-cache path's (`generate`), row for row -- prompts that end in end-of-text, non-ASCII ones, an empty one,
more rows than the engine has cache rows (continuous batching), a prompt that just fits the context with
max_tokens and one that needs the sliding window (which still runs alone, as before); each token of a fitting
row goes through the model once (the cache is used), none is recomputed by the full forward."""
from __future__ import annotations

import pytest
import torch

from spotfill.fillin import batch_plan as bp
from spotfill.fillin.batch import UnitWorker
from spotfill.fillin.generate import batch_engine, fits_engine, generate, generate_rows
from spotfill.train.model import GPT, preset

MAX_TOKENS = 16
# "q" * 48 and "q" * 49: prompt + max_tokens is the context (64), one more (the engine stops at its context a
# token earlier than the one-at-a-time path slides: that row runs alone), both generating all 16 tokens
PROMPTS = ["hello", "", "the quick brown fox", "héllo wörld 漢字", "x" * 40, "q" * 48, "q" * 49, "y" * 60,
           "def f(x):", "import os", "zz", "return x + 1", "    pass", "print('hi')"]


@pytest.fixture(scope="module")
def model():
    """The tiny preset (context 64), its end-of-text logit raised to the most likely byte's so that some
    rows stop before max_tokens."""
    torch.manual_seed(0)
    m = GPT(preset("tiny")).eval()
    with torch.no_grad():
        x = torch.tensor([list(b"zz")])
        top = int(m(x)[0, -1].argmax())
        m.head.weight[256] = m.head.weight[top] * 1.05
    return m


@pytest.fixture(scope="module")
def one_at_a_time(model):
    return [generate(model, p, MAX_TOKENS) for p in PROMPTS]


def test_the_prompts_cover_both_paths_and_both_endings(model, one_at_a_time):
    fits = [fits_engine(list(p.encode()) or [256], MAX_TOKENS, model.cfg.seq_len) for p in PROMPTS]
    assert fits.count(False) == 2 and fits[PROMPTS.index("q" * 48)] and not fits[PROMPTS.index("q" * 49)]
    assert {r for _, _, r in one_at_a_time} == {"stop", "length"}
    assert one_at_a_time[PROMPTS.index("q" * 48)][1:] == one_at_a_time[PROMPTS.index("q" * 49)][1:] == (16, "length")


@pytest.mark.parametrize("max_batch", [3, 16])
def test_greedy_rows_are_the_one_at_a_time_output(model, one_at_a_time, max_batch):
    assert generate_rows(model, PROMPTS, MAX_TOKENS, engine=batch_engine(model, max_batch)) == one_at_a_time


def test_each_token_goes_through_the_model_once(model, monkeypatch):
    """The full forward (recomputing the context) runs only for the rows that need the sliding window, a
    token each; every other token is fed once to the cached decode, in batched steps."""
    calls = {"forward": 0, "decode": 0, "fed": 0}
    forward, decode = model.forward, model.decode

    def counted_forward(idx):
        calls["forward"] += 1
        return forward(idx)

    def counted_decode(idx, *a, **k):
        calls["decode"] += 1
        calls["fed"] += idx.numel()
        return decode(idx, *a, **k)

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(model, "decode", counted_decode)
    engine = batch_engine(model, 4)
    out = generate_rows(model, PROMPTS, MAX_TOKENS, engine=engine)
    fit = [i for i, p in enumerate(PROMPTS) if fits_engine(list(p.encode()) or [256], MAX_TOKENS, 64)]
    slid = [i for i in range(len(PROMPTS)) if i not in fit]
    # a sliding row: one full forward per token chosen (the last one may be end-of-text)
    assert calls["forward"] == sum(out[i][1] + (out[i][2] == "stop") for i in slid)
    # a fitting row: its prompt once, then each generated token but the last (which nothing follows), and
    # that one too when end-of-text came after it
    assert calls["fed"] == sum(len(PROMPTS[i].encode() or b"x") + out[i][1] - (out[i][2] == "length") for i in fit)
    assert calls["decode"] == len(fit) + engine.stats["plain_steps"]
    assert engine.stats["plain_steps"] < sum(out[i][1] for i in fit) / 2      # rows share steps


def test_sampled_rows_are_reproducible_and_follow_their_seeds(model):
    a = generate_rows(model, PROMPTS, MAX_TOKENS, temperature=1.0, seeds=list(range(len(PROMPTS))))
    b = generate_rows(model, PROMPTS[::-1], MAX_TOKENS, temperature=1.0, seeds=list(range(len(PROMPTS)))[::-1],
                      engine=batch_engine(model, 2))
    assert a == b[::-1]
    c = generate_rows(model, PROMPTS, MAX_TOKENS, temperature=1.0, seeds=list(range(100, 100 + len(PROMPTS))))
    assert a != c


def test_a_generation_unit_writes_the_one_at_a_time_rows(model, one_at_a_time):
    """UnitWorker._generate over units of 5 rows with an engine of its own (its cache made once)."""
    worker = UnitWorker.__new__(UnitWorker)
    worker.model, worker.engine, worker.prompts, worker.tokenizer = model, None, PROMPTS, None  # bytes
    worker.plan = {"prompt_ids": [f"p{i}" for i in range(len(PROMPTS))], "max_tokens": MAX_TOKENS,
                   "temperature": 0.0, "seed": 0, "generate_rows_per_unit": 5}
    rows = []
    for unit in bp.split("generate", len(PROMPTS), 5):
        rows.extend(worker._generate(unit).to_pylist())
    engine = worker.engine
    assert engine is not None and engine.max_batch == 5
    assert [(r["text"], r["tokens"], r["finish_reason"]) for r in rows] == one_at_a_time
    assert [r["id"] for r in rows] == [f"generate/p{i}" for i in range(len(PROMPTS))]
    assert [r["prompt"] for r in rows] == PROMPTS

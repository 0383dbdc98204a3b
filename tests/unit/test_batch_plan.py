"""The batch fill-in plan and ledger (fillin/batch_plan.py): deterministic units, what counts as committed,
what a resume redoes, and the exactly-once tally from ids read back."""
from __future__ import annotations

import math

import pytest

from spotfill.fillin import batch_plan as bp


def test_units_cover_every_row_once_with_stable_ids_and_names():
    units = bp.split("eval", 103, 10)
    assert [u.rows for u in units] == [10] * 10 + [3]
    covered = [r for u in units for r in range(u.start, u.stop)]
    assert covered == list(range(103))
    assert units[3].unit_id == "eval-00003" and units[3].key == "eval/part-eval-00003.parquet"
    assert units[3].marker == "_commits/eval-00003.json"
    assert bp.split("eval", 103, 10) == units, "the same inputs give the same units"
    assert bp.split("generate", 0, 4) == []
    with pytest.raises(ValueError):
        bp.split("train", 10, 2)
    with pytest.raises(ValueError):
        bp.split("eval", 10, 0)


def test_row_ids_name_eval_rows_and_prompts():
    assert bp.row_ids("eval", 5, 8) == ["eval/5", "eval/6", "eval/7"]
    assert bp.row_ids("generate", 1, 3, ["a", "b", "c"]) == ["generate/b", "generate/c"]
    units = bp.split("eval", 5, 2) + bp.split("generate", 3, 2)
    assert bp.target_ids(units, ["x", "y", "z"]) == [f"eval/{i}" for i in range(5)] + [
        "generate/x", "generate/y", "generate/z"]
    assert bp.duplicate_prompt_ids(["a", "b", "a", "c", "b"]) == ["a", "b"]


def _marker(u: bp.Unit, size: int = 100, rows: int | None = None) -> dict:
    return {"key": u.key, "rows": u.rows if rows is None else rows, "bytes": size}


def test_a_unit_is_committed_only_with_its_marker_and_its_part_as_the_marker_recorded():
    a, b, c, d, e = bp.split("eval", 10, 2)
    markers = {a.unit_id: _marker(a), b.unit_id: _marker(b), d.unit_id: _marker(d, rows=1),
               e.unit_id: {**_marker(e), "key": "eval/part-other.parquet"}}
    parts = {a.key: 100, b.key: 99,            # b: the part is not the one the marker recorded
             c.key: 100,                        # c: written, never committed (driver killed in between)
             d.key: 100, e.key: 100}
    assert bp.committed_units([a, b, c, d, e], markers, parts) == {a.unit_id}
    # the marker without its part (deleted, or listed before the part became visible) commits nothing
    assert bp.committed_units([a], markers, {}) == set()


def test_a_resume_redoes_exactly_the_uncommitted_units_in_plan_order():
    units = bp.split("eval", 8, 2) + bp.split("generate", 4, 2)
    done = {"eval-00001", "generate-00000"}
    todo = bp.remaining(units, done)
    assert [u.unit_id for u in todo] == ["eval-00000", "eval-00002", "eval-00003", "generate-00001"]
    assert bp.next_wave(todo, 2, 1) == todo[:2]
    assert bp.next_wave(todo, 0, 4) == []
    assert bp.next_wave(todo, 3, 4) == todo
    assert bp.wave_size(grant=3, max_units=2, todo=10) == 2
    assert bp.wave_size(grant=3, max_units=4, todo=1) == 1
    assert bp.wave_size(grant=0, max_units=4, todo=5) == 0


def test_tally_counts_duplicates_missing_and_unexpected_ids_from_what_was_read():
    target = ["eval/0", "eval/1", "eval/2", "generate/a"]
    assert bp.tally(target, ["eval/0", "eval/1", "eval/2", "generate/a"]) == {
        "rows_target": 4, "rows_written": 4, "duplicates": 0, "missing": 0, "unexpected": 0}
    got = bp.tally(target, ["eval/0", "eval/0", "eval/0", "eval/2", "generate/zz"])
    assert got == {"rows_target": 4, "rows_written": 5, "duplicates": 2, "missing": 2, "unexpected": 1}


def test_eval_metrics_weight_every_token_not_every_row():
    m = bp.eval_metrics([6.0, 2.0], [3, 1])       # rows of 3 and 1 tokens: mean 2.0 per token
    assert m["loss"] == pytest.approx(2.0) and m["tokens"] == 4
    assert m["perplexity"] == pytest.approx(math.e ** 2)
    assert bp.eval_metrics([], []) == {"loss": None, "perplexity": None, "tokens": 0}


def test_a_resume_with_other_inputs_is_named_field_by_field():
    plan = {"checkpoint_tag": "step-00000040", "eval_rows": 100, "eval_rows_per_unit": 10, "eval_data": "/d",
            "prompts_sha256": "abc", "generate_rows_per_unit": 4, "max_tokens": 8, "temperature": 0.0, "seed": 0}
    assert bp.same_plan(plan, dict(plan)) == []
    assert bp.same_plan(plan, {**plan, "eval_rows": 50, "prompts_sha256": "def"}) == ["eval_rows", "prompts_sha256"]


def test_a_wave_takes_everything_left_unless_capped_and_regrows_only_when_it_pays():
    todo = bp.split("eval", 40, 4)
    assert bp.next_wave(todo, 1) == todo
    assert bp.next_wave(todo, 2, 3) == todo[:6]
    assert bp.regrow(running=1, allowed=2, max_units=4, left=10)
    assert not bp.regrow(running=2, allowed=2, max_units=4, left=10), "the grant did not rise"
    assert not bp.regrow(running=2, allowed=3, max_units=2, left=10), "the job's max"
    assert not bp.regrow(running=2, allowed=3, max_units=4, left=4), "too little left to pay for a new wave"

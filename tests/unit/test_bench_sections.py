"""`spotfill bench --only` names the same sections benchmarks/run.py runs (the CLI checks them without
importing the benchmarks), and the slow opt-in ones stay out of the default run."""
from __future__ import annotations

import pytest

from benchmarks import run as bench_run
from spotfill.cli.bench import SECTIONS, parse_sections
from spotfill.config.errors import ConfigError


def test_the_cli_accepts_exactly_the_sections_the_runner_has():
    assert set(SECTIONS) == set(bench_run.SECTIONS)


def test_the_elastic_load_memory_benchmark_is_a_section_run_only_when_asked():
    assert parse_sections("elastic_load") == ["elastic_load"]
    assert bench_run.SECTIONS["elastic_load"] == ("benchmarks.elastic_load_memory", "bench_elastic_load")
    assert "elastic_load" not in bench_run.DEFAULT_SECTIONS
    with pytest.raises(ConfigError):
        parse_sections("elastic-load")


def test_the_fillin_training_ratio_is_the_median_of_interleaved_rounds_with_its_spread():
    from benchmarks.fillin import ratio_rounds
    got = ratio_rounds([(112.0, 100.0), (90.0, 100.0), (99.0, 100.0), (None, 100.0)])
    assert got == {"ratios": [1.12, 0.9, 0.99], "median": 0.99, "min": 0.9, "max": 1.12, "rounds": 4}

"""The fake cloud's market file (spotfill.testing.fake_market): what the provider reads at every launch."""
from __future__ import annotations

from spotfill.testing.fake_market import read_market, write_market


def test_market_file_round_trip_and_missing_or_broken_file(tmp_path):
    path = str(tmp_path / "market.json")
    assert read_market(path) == {} and read_market(None) == {}       # no file: everything can be had
    write_market(path, {"gpu_spot": "unfulfilled"})
    assert read_market(path) == {"gpu_spot": "unfulfilled"}
    write_market(path, {})
    assert read_market(path) == {}
    (tmp_path / "market.json").write_text("{not json")
    assert read_market(path) == {}

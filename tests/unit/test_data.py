"""data.py: byte tokenizer, packing, shard files + manifest + reader, the prefetcher, corpus listing."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spotfill.train.data import (BYTE_VOCAB, EOD, FORMAT, Prefetcher, ShardReader, ShardWriter, StepBatch, byte_encode, read_step,
                           iter_corpus_files, load_tokenizer, pack, read_manifest, token_dtype)
from spotfill.config.errors import ConfigError, DataMismatch
from spotfill.storage.base import open_storage


# -- tokenizer -----------------------------------------------------------------------------------
# code points straight from integers: st.text() builds a Unicode table on first use (seconds)
_TEXT = st.lists(st.one_of(st.integers(0, 0x7F), st.integers(0x80, 0xD7FF), st.integers(0xE000, 0x10FFFF)),
                 max_size=40).map(lambda cps: "".join(map(chr, cps)))


@settings(max_examples=100, deadline=None)
@given(_TEXT)
@example("h\u00e9llo \u2713 \U0001d11e\n\x00")
def test_byte_encode_round_trip_and_eod(text):
    toks = byte_encode(text)
    assert toks[-1] == EOD
    assert all(0 <= t < 256 for t in toks[:-1])
    assert bytes(toks[:-1]).decode("utf-8") == text


def test_byte_tokenizer_spec():
    encode, vocab = load_tokenizer("bytes")
    assert encode is byte_encode and vocab == BYTE_VOCAB == EOD + 1
    assert load_tokenizer("")[1] == BYTE_VOCAB
    with pytest.raises(ConfigError) as err:
        load_tokenizer("sentencepiece")
    assert err.value.field == "data.tokenizer"
    with pytest.raises(ConfigError):
        load_tokenizer("hf:/no/such/dir")


# -- pack ----------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 256), max_size=40), max_size=20), st.integers(1, 16))
def test_pack_rows_are_contiguous_and_tail_dropped(docs, seq_len):
    rows = pack(docs, seq_len)
    flat = [t for d in docs for t in d]
    n = len(flat) // (seq_len + 1)
    assert rows.shape == (n, seq_len + 1)
    assert rows.reshape(-1).tolist() == flat[: n * (seq_len + 1)]     # contiguous, in order
    assert len(flat) - rows.size < seq_len + 1                          # only an incomplete tail dropped


def test_pack_example():
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=3)
    assert rows.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]                # 9 is the dropped tail
    assert pack([], 4).shape == (0, 5)


def test_token_dtype():
    assert token_dtype(BYTE_VOCAB) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(128256) == np.uint32


# -- shards + manifest + reader ------------------------------------------------------------------
def _write(tmp_path, n_rows=10, seq_len=5, rows_per_shard=3, chunks=(4, 1, 5)):
    """Shards of `rows_per_shard` rows (3, 3, 3, 1 by default) of random tokens; (storage, rows, manifest)."""
    storage = open_storage(str(tmp_path / "ds"))
    rng = np.random.default_rng(0)
    data = rng.integers(0, BYTE_VOCAB, size=(n_rows, seq_len + 1))
    w = ShardWriter(storage, seq_len, BYTE_VOCAB, "bytes", rows_per_shard=rows_per_shard)
    start = 0
    for c in chunks:
        w.add(data[start:start + c])
        start += c
    assert start == n_rows
    return storage, data, w.close()


def test_shard_round_trip(tmp_path):
    storage, data, manifest = _write(tmp_path)
    assert manifest["format"] == FORMAT and manifest["num_samples"] == 10
    assert [s["num_samples"] for s in manifest["shards"]] == [3, 3, 3, 1]
    assert manifest["dtype"] == "uint16" and manifest["seq_len"] == 5 and manifest["tokenizer"] == "bytes"
    assert read_manifest(storage) == json.loads(json.dumps(manifest))
    assert set(storage.list()) == {"manifest.json"} | {s["key"] for s in manifest["shards"]}

    reader = ShardReader(storage, str(tmp_path / "cache"))
    assert reader.num_samples == 10 and reader.seq_len == 5
    assert np.array_equal(reader.rows(np.arange(10)), data)
    ids = np.array([9, 0, 3, 3, 7, 2])
    out = reader.rows(ids)
    assert out.dtype == np.int64 and np.array_equal(out, data[ids])
    # a second reader uses the local cache (the same rows)
    again = ShardReader(open_storage(str(tmp_path / "ds")), str(tmp_path / "cache"))
    assert np.array_equal(again.rows(ids), data[ids])


def test_read_returns_each_rows_identity_across_shards(tmp_path):
    storage, data, _ = _write(tmp_path)                     # shards of 3, 3, 3, 1 rows
    reader = ShardReader(storage, str(tmp_path / "cache"))
    ids = np.array([9, 0, 3, 3, 7, 2, 5])
    tokens, read_ids = reader.read(ids)
    assert np.array_equal(tokens, data[ids]) and read_ids.tolist() == [9, 0, 3, 3, 7, 2, 5]
    with pytest.raises(IndexError):
        reader.read(np.array([10]))


def test_each_row_carries_the_id_prepare_stored_with_it(tmp_path):
    """The ids come from the shard files (np.load, not the reader): rows 0..9 in shard order."""
    storage, data, manifest = _write(tmp_path)
    stored = [np.load(os.path.join(storage.root, s["key"])) for s in manifest["shards"]]
    assert [a["id"].tolist() for a in stored] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert np.array_equal(np.concatenate([a["tokens"] for a in stored]), data)
    assert [s["first_id"] for s in manifest["shards"]] == [0, 3, 6, 9]
    assert len(manifest["fingerprint"]) == 64


def test_the_same_rows_give_the_same_fingerprint_and_other_rows_another(tmp_path):
    one = _write(tmp_path / "a")[2]["fingerprint"]
    assert _write(tmp_path / "b")[2]["fingerprint"] == one            # prepare is deterministic
    assert _write(tmp_path / "c", rows_per_shard=5)[2]["fingerprint"] != one   # same rows, other shards
    assert _write(tmp_path / "d", n_rows=9, chunks=(9,))[2]["fingerprint"] != one


def test_a_row_mapping_fault_in_the_reader_is_caught_naming_the_shard(tmp_path):
    storage, _, _ = _write(tmp_path)
    reader = ShardReader(storage, str(tmp_path / "cache"))
    reader._starts = reader._starts.copy()
    reader._starts[2] -= 1                  # the fault: shard 2 thought to start a row early
    with pytest.raises(DataMismatch, match=r"data shard shard-00002.npy: row 2 holds dataset row 8, not row 7"):
        reader.read(np.array([0, 7]))


def _swap_files(a: str, b: str) -> None:
    da, db = open(a, "rb").read(), open(b, "rb").read()
    open(a, "wb").write(db)
    open(b, "wb").write(da)


def test_shards_swapped_in_storage_are_caught_naming_the_shard_and_whose_rows_it_holds(tmp_path):
    storage, _, manifest = _write(tmp_path)
    _swap_files(*(os.path.join(storage.root, s["key"]) for s in manifest["shards"][1:3]))
    with pytest.raises(DataMismatch) as err:
        ShardReader(storage, str(tmp_path / "cache"))
    msg = str(err.value)
    assert msg.startswith("data shard shard-00001.npy in ") and "\n" not in msg
    assert "it holds rows 6..8, shard-00002.npy's by the manifest" in msg and "re-run prepare" in msg


def test_a_cached_copy_replaced_on_disk_is_caught(tmp_path):
    storage, _, manifest = _write(tmp_path)
    cache = tmp_path / "cache"
    ShardReader(storage, str(cache))
    copies = sorted(os.listdir(cache), key=lambda n: n.split("-", 1)[1])
    _swap_files(str(cache / copies[0]), str(cache / copies[1]))        # shard-00000's copy holds 3..5
    with pytest.raises(DataMismatch, match=r"data shard shard-00000.npy: the copy cached at .* holds rows 3..5, "
                                           r"shard-00001.npy's by the manifest, where the manifest places rows 0..2"):
        ShardReader(storage, str(cache))


def test_a_reordered_or_edited_manifest_is_refused(tmp_path):
    storage, _, manifest = _write(tmp_path)
    reordered = {**manifest, "shards": [manifest["shards"][1], manifest["shards"][0], *manifest["shards"][2:]]}
    storage.put_bytes("manifest.json", json.dumps(reordered).encode())
    with pytest.raises(ConfigError, match="places shard-00001.npy at row 3 where the shards before it end at row 0"):
        read_manifest(storage)
    storage.put_bytes("manifest.json", json.dumps({**manifest, "num_samples": 9}).encode())
    with pytest.raises(ConfigError, match="does not match its fingerprint"):
        read_manifest(storage)


def test_a_dataset_without_stored_ids_is_refused_with_what_to_do(tmp_path):
    storage = open_storage(str(tmp_path / "old"))
    storage.put_bytes("manifest.json", json.dumps({"format": "spotfill-tokens/1", "seq_len": 4, "shards": []}).encode())
    with pytest.raises(ConfigError) as err:
        read_manifest(storage)
    assert err.value.field == "data.path" and "re-run prepare" in str(err.value) and FORMAT in str(err.value)


def test_read_step_keeps_rows_and_their_positions_together(tmp_path):
    from spotfill.config.batching import stream_to_rows

    storage, data, _ = _write(tmp_path)
    reader = ShardReader(storage, str(tmp_path / "cache"))
    positions = np.array([13, 14, 15, 16])                 # epoch 1 of a 10-row dataset
    b = read_step(reader, step=3, positions=positions, accum=2, seed=7)
    rows = stream_to_rows(positions, 10, 7)
    assert b.step == 3 and b.positions.tolist() == [13, 14, 15, 16] and b.row_ids.tolist() == rows.tolist()
    assert len(b.micro_batches) == 2 and np.array_equal(np.concatenate(b.micro_batches), data[rows])


def test_shard_round_trip_through_file_uri(tmp_path):
    _write(tmp_path)
    reader = ShardReader(open_storage(f"file://{tmp_path / 'ds'}"), str(tmp_path / "cache2"))
    assert reader.num_samples == 10


def test_tampered_shard_fails_its_checksum(tmp_path):
    storage, _, manifest = _write(tmp_path)
    key = manifest["shards"][1]["key"]
    path = os.path.join(storage.root, key)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)
    cache = tmp_path / "cache"
    with pytest.raises(DataMismatch, match=f"data shard {key} .* is not the shard its manifest names "
                                           r"\(it holds its own rows 3..5, with other bytes; sha256"):
        ShardReader(storage, str(cache))
    assert not [n for n in os.listdir(cache) if key in n]     # neither cached nor left as a partial file


def test_read_manifest_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        read_manifest(open_storage(str(tmp_path / "empty")))
    assert err.value.field == "data.path" and "prepare_data" in str(err.value)


def test_read_manifest_unknown_format(tmp_path):
    storage = open_storage(str(tmp_path / "ds"))
    storage.put_bytes("manifest.json", json.dumps({"format": "other/9"}).encode())
    with pytest.raises(ConfigError) as err:
        read_manifest(storage)
    assert err.value.field == "data.path" and FORMAT in str(err.value)


def test_writer_with_no_complete_row_is_a_config_error(tmp_path):
    w = ShardWriter(open_storage(str(tmp_path / "ds")), 8, BYTE_VOCAB, "bytes")
    w.add(pack([[1, 2, 3]], 8))
    with pytest.raises(ConfigError) as err:
        w.close()
    assert err.value.field == "data.source"


# -- prefetcher ----------------------------------------------------------------------------------
def _batch(step: int) -> StepBatch:
    return StepBatch(step, [np.full((1, 3), step)], np.array([step]))


def test_prefetcher_yields_steps_in_order():
    p = Prefetcher(_batch, first_step=5, last_step=25, depth=3)
    try:
        for step in range(5, 25):
            assert p.get(step).step == step
    finally:
        p.close()


def test_prefetcher_measures_wait():
    def slow_first(step):
        if step == 0:
            time.sleep(0.3)
        return _batch(step)

    p = Prefetcher(slow_first, 0, 3, depth=2)
    try:
        assert p.get(0).step == 0
        assert 0.1 <= p.wait_s < 5           # the consumer waited for step 0's batch
    finally:
        p.close()


def test_prefetcher_propagates_exceptions_from_make():
    def make(step):
        if step == 2:
            raise RuntimeError("shard read failed")
        return _batch(step)

    p = Prefetcher(make, 0, 5)
    try:
        assert p.get(0).step == 0 and p.get(1).step == 1
        with pytest.raises(RuntimeError, match="shard read failed"):
            p.get(2)
    finally:
        p.close()


def test_prefetcher_close_stops_the_thread():
    made = []

    def make(step):
        made.append(step)
        return _batch(step)

    p = Prefetcher(make, 0, 10 ** 9, depth=2)
    assert p.get(0).step == 0
    p.close()
    p._thread.join(timeout=2)
    assert not p._thread.is_alive()
    n = len(made)
    time.sleep(0.15)
    assert len(made) == n and n <= 5     # it stopped a few steps ahead, not at the end


# -- corpus listing ------------------------------------------------------------------------------
def _tree(root, order):
    for rel in order:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)


def test_iter_corpus_files_sorted_and_deterministic(tmp_path):
    files = ["b.txt", "a.py", "z/readme.md", "c/d/e.txt", "c/a.txt", "skip.bin", "c/d/notes.rst", "a.md"]
    _tree(tmp_path / "one", files)
    _tree(tmp_path / "two", list(reversed(files)))
    got = [os.path.relpath(p, tmp_path / "one") for p in iter_corpus_files(str(tmp_path / "one"))]
    other = [os.path.relpath(p, tmp_path / "two") for p in iter_corpus_files(str(tmp_path / "two"))]
    assert got == other
    assert got == ["a.md", "a.py", "b.txt", "c/a.txt", "c/d/e.txt", "z/readme.md"]
    assert [os.path.relpath(p, tmp_path / "one") for p in iter_corpus_files(str(tmp_path / "one"), (".md",))] \
        == ["a.md", "z/readme.md"]
    assert list(iter_corpus_files(str(tmp_path / "missing"))) == []

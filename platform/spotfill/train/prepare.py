"""Corpus -> token shards with Ray Data (read, tokenize, pack), then shards + manifest to storage.

Reads text files (one document per file), JSON lines or parquet (a `text_field` column) from a local path
or s3:// prefix. Tokenizing and packing run as a streaming Ray Data `map_batches` with order preserved, so
the same corpus always gives the same shards; the driver writes shards of `rows_per_shard` rows.
"""
from __future__ import annotations

import logging
import os
import time


from spotfill.config.job import PrepareConfig
from spotfill.train.data import ShardWriter, load_tokenizer, pack
from spotfill.config.errors import ConfigError
from spotfill.storage.base import open_storage

log = logging.getLogger(__name__)
_FORMATS = {".txt": "text", ".py": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
            ".parquet": "parquet"}


def _list_sources(cfg: PrepareConfig) -> tuple[list[str], str, object]:
    """Resolve the source to (paths, format, pyarrow filesystem or None)."""
    if cfg.source.startswith("s3://"):
        store = open_storage(cfg.source)
        keys = sorted(k for k in store.list("") if k.endswith(tuple(cfg.suffixes)))
        paths = [store.pyarrow_path(k) for k in keys]
        fs = store.pyarrow_filesystem()
    else:
        src = cfg.source[7:] if cfg.source.startswith("file://") else cfg.source
        if os.path.isfile(src):
            paths = [src]
        elif os.path.isdir(src):
            from spotfill.train.data import iter_corpus_files
            paths = list(iter_corpus_files(src, tuple(cfg.suffixes)))
        else:
            raise ConfigError("data.source", cfg.source, reason="no such file or directory")
        fs = None
    if not paths:
        raise ConfigError("data.source", cfg.source, reason=f"no files ending in {cfg.suffixes}")
    fmt = cfg.format
    if fmt == "auto":
        kinds = {_FORMATS.get(os.path.splitext(p)[1], "text") for p in paths}
        if len(kinds) > 1:
            raise ConfigError("data.format", "auto", reason=f"mixed formats {sorted(kinds)}; set one",
                              accepted=["text", "jsonl", "parquet"])
        fmt = kinds.pop()
    return paths, fmt, fs


def _read(paths: list[str], fmt: str, fs, text_field: str):
    import ray.data

    if fmt == "text":
        ds = ray.data.read_binary_files(paths, filesystem=fs)
        return ds.map_batches(lambda b: {"text": [x.decode("utf-8", "replace") for x in b["bytes"]]},
                              batch_format="numpy")
    ds = ray.data.read_json(paths, lines=True, filesystem=fs) if fmt == "jsonl" else \
        ray.data.read_parquet(paths, filesystem=fs)
    if text_field not in ds.schema().names:
        raise ConfigError("data.text_field", text_field, accepted=ds.schema().names)
    return ds.select_columns([text_field]).rename_columns({text_field: "text"})


def prepare(cfg: PrepareConfig) -> dict:
    """Run the pipeline; returns the manifest (with `seconds` and `documents` added)."""
    import ray
    import ray.data

    t0 = time.time()
    encode, vocab = load_tokenizer(cfg.tokenizer)
    paths, fmt, fs = _list_sources(cfg)
    out = open_storage(cfg.output)
    out.check()
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    seq_len, spec = cfg.seq_len, cfg.tokenizer

    def tokenize_and_pack(batch: dict) -> dict:
        enc, _ = load_tokenizer(spec)
        return {"tokens": pack((enc(t) for t in batch["text"]), seq_len)}

    ds = _read(paths, fmt, fs, cfg.text_field)
    writer = ShardWriter(out, seq_len, vocab, cfg.tokenizer, cfg.rows_per_shard)
    for batch in ds.map_batches(tokenize_and_pack, batch_size=256, batch_format="numpy").iter_batches(
            batch_size=None, batch_format="numpy"):
        writer.add(batch["tokens"])
    manifest = writer.close()
    manifest["files"] = len(paths)
    manifest["seconds"] = round(time.time() - t0, 3)
    log.info("prepared %d sequences of %d tokens in %d shards to %s (%.1fs)", manifest["num_samples"],
             seq_len + 1, len(manifest["shards"]), out.uri, manifest["seconds"])
    return manifest

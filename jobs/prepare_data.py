"""Corpus -> token shards + manifest in storage, with Ray Data.

    ray job submit --working-dir . -- python jobs/prepare_data.py --config examples/prepare-stdlib.yaml

Config file: one top-level key, `data:`, holding spotfill.config.job.PrepareConfig's fields:
    data:
      source: stdlib:json     # file, folder or s3:// prefix; `stdlib:SUB` = Python's stdlib folder SUB
      output: /tmp/spotfill/data/stdlib-json   # local path or s3://bucket/prefix for shards + manifest
      seq_len: 64             # tokens per sample (rows hold seq_len + 1)
      format: auto            # auto | text | jsonl | parquet
      text_field: text        # column/key for jsonl and parquet
      tokenizer: bytes        # bytes | hf:/local/tokenizer/path
      rows_per_shard: 8192
      suffixes: [.py]         # which files a folder source contributes
Flags override the file: --source, --output, --seq-len. Prints one JSON summary line on stdout.
Exit codes: 0 done; 1 the job ran and failed; 2 bad usage/config/input (one line on stderr).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform"))
try:
    from spotfill.cli import jobkit
except ImportError as exc:  # neither shipped with the working dir nor installed
    sys.exit(print(f"prepare_data.py: error: cannot import spotfill ({exc}); submit with --working-dir "
                   "at the repository root or pip install it", file=sys.stderr) or 2)


def main(args) -> dict:
    from spotfill.config.job import load_prepare_config

    overrides = {k: v for k, v in (("source", args.source), ("output", args.output),
                                    ("seq_len", args.seq_len)) if v is not None}
    cfg = load_prepare_config(args.config, overrides)
    cfg.source = jobkit.absolute("data.source", cfg.source)    # `stdlib:SUB` is resolved by the loader
    cfg.output = jobkit.absolute("data.output", cfg.output)
    jobkit.init_ray(jobkit.runtime_env())
    from spotfill.train.prepare import prepare

    manifest = prepare(cfg)
    return {"ok": True, "output": cfg.output, "samples": manifest["num_samples"],
            "shards": len(manifest["shards"]), "seq_len": manifest["seq_len"], "files": manifest["files"],
            "seconds": manifest["seconds"], "spotfill": jobkit.library_dir(), "shipped": jobkit.shipped()}


def build_parser():
    ap = jobkit.parser("prepare_data.py", "Tokenize and pack a corpus into shards with Ray Data.")
    ap.add_argument("--config", required=True, metavar="FILE", help="YAML with a top-level `data:` section")
    ap.add_argument("--source", metavar="URI", help="override data.source")
    ap.add_argument("--output", metavar="URI", help="override data.output")
    ap.add_argument("--seq-len", type=int, metavar="N", help="override data.seq_len")
    return ap


if __name__ == "__main__":
    sys.exit(jobkit.run_main(main, build_parser()))

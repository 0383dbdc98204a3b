"""`spotfill export RUN_URI [--step N] --out DIR`: a run's checkpoint as a Hugging Face folder
(train/export.py). Exit 2 with one line on a run without committed checkpoints, a step it has none at, or
a non-empty DIR; 1 when the exported model's logits do not match spotfill's."""
from __future__ import annotations

import argparse
import sys


def step_number(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def register(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder (config, safetensors, "
                                      "tokenizer, generation config)")
    p.add_argument("run_uri", metavar="RUN_URI",
                   help="the run's storage: <training storage>/<job name> (local path or s3://)")
    p.add_argument("--step", type=step_number, default=None, metavar="N",
                   help="the committed checkpoint at step N (default: the newest intact one)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty local folder")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the folder back with transformers to compare logits")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotfill.train.export import check_out, export_run

    check_out(args.out)                     # before any storage or torch work
    rec = export_run(args.run_uri, args.out, step=args.step, verify=not args.no_verify)
    diff = "not checked" if rec["max_abs_diff"] is None else f"max |logit diff| {rec['max_abs_diff']:.2g}"
    print(f"{rec['out']}: {rec['architecture']} from {rec['tag']} (step {rec['step']}, model card "
          f"{rec['card']}), tokenizer {rec['tokenizer']}; {diff}")
    print("files: " + ", ".join(rec["files"]), file=sys.stderr)
    return 0

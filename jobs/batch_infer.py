"""Batch evaluation and generation over a run's checkpoint, on lent GPUs, exactly once (Ray Data).

    ray job submit --working-dir . -- python jobs/batch_infer.py --config examples/batch-tiny.yaml

Config file: spotfill.config.batch.BatchConfig as YAML (unknown keys are rejected):
    name: eval-tiny
    checkpoint: /tmp/spotfill/checkpoints/tiny-cpu/tiny-cpu   # storage/name of the run; newest commit pinned
    output: s3://bucket/batch/eval-tiny         # parquet: eval/part-*.parquet, generate/part-*.parquet
    eval: {data: /tmp/spotfill/data/heldout, rows: 0, rows_per_unit: 32, batch_size: 16}
    generate: {prompts: /data/prompts.jsonl, max_tokens: 32, rows_per_unit: 4}
    cluster: {gpu_resource: GPU_SLOT, max_units: 2, grace_s: 5.0}
    grant: {units: 0}                           # 0: GPUs the fill-in arbiter lends; N: N GPUs of its own
Flags override the file: --output, --checkpoint, --name, --units, --wait-timeout. Rerunning with the same
output resumes: committed units are skipped, uncommitted ones redone. Prints one JSON summary line on stdout
(report.json's fillin.batch: rows_target, rows_written, duplicates, missing, output, eval loss/perplexity).
Exit codes: 0 done; 1 the job ran and failed; 2 bad usage/config/input.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform"))
try:
    from spotfill.cli import jobkit
except ImportError as exc:  # neither shipped with the working dir nor installed
    sys.exit(print(f"batch_infer.py: error: cannot import spotfill ({exc}); submit with --working-dir "
                   "at the repository root or pip install it", file=sys.stderr) or 2)


def main(args) -> dict:
    from spotfill.config.batch import load_batch_config

    flags = {"output": args.output, "checkpoint": args.checkpoint, "name": args.name, "grant.units": args.units}
    cfg = load_batch_config(args.config, {k: v for k, v in flags.items() if v is not None})
    for name in ("output", "checkpoint"):
        setattr(cfg, name, jobkit.absolute(name, getattr(cfg, name)))
    cfg.eval.data = jobkit.absolute("eval.data", cfg.eval.data)
    cfg.generate.prompts = jobkit.absolute("generate.prompts", cfg.generate.prompts)
    from spotfill.fillin.batch import run_batch

    jobkit.second_on_cpu()

    return run_batch(cfg, jobkit.runtime_env(), wait_timeout_s=args.wait_timeout)


def build_parser():
    ap = jobkit.parser("batch_infer.py", "Batch evaluation and generation on lent GPUs (Ray Data).")
    ap.add_argument("--config", required=True, metavar="FILE", help="batch YAML (spotfill.config.batch)")
    ap.add_argument("--output", metavar="URI", help="override output (parquet + commit markers)")
    ap.add_argument("--checkpoint", metavar="URI", help="override checkpoint (a run's storage)")
    ap.add_argument("--name", help="override name")
    ap.add_argument("--units", type=int, metavar="N", help="override grant.units (0: lent by the arbiter)")
    ap.add_argument("--wait-timeout", type=float, metavar="S", help="fail (exit 1) after S s with nothing lent")
    return ap


if __name__ == "__main__":
    sys.exit(jobkit.run_main(main, build_parser()))

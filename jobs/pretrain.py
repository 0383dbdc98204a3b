"""Elastic DeepSpeed pretraining on Ray Train; checkpoints in object storage; RUN_DIR/report.json.

    ray job submit --working-dir . -- python jobs/pretrain.py --config examples/tiny-cpu.yaml

Config file: spotfill.config.job.JobConfig as YAML (unknown keys are rejected):
    name: tiny-cpu
    run_dir: /tmp/spotfill/runs/tiny-cpu      # report.json + events.jsonl, on the driver's node
    storage: /tmp/spotfill/ckpt/tiny-cpu      # checkpoints: local path or s3://bucket/prefix
    data: {path: /tmp/spotfill/data/stdlib-json}  # prepared shards (jobs/prepare_data.py's output)
    training: {model: tiny, workers: [1, 2], steps: 20, global_batch: 16, checkpoint_every: 5, ...}
    cluster: {gpu_resource: GPU_SLOT, gpus_per_worker: 1, cpus_per_worker: 1}
Flags override the file: --steps, --storage, --run-dir, --data, --name. Use absolute paths or s3:// URIs:
inside a Ray job the cwd is a temporary copy of the working dir. Prints one JSON summary line on stdout;
progress goes to stderr: a live panel on a terminal, one line per event otherwise (--no-progress: none).
Exit codes: 0 done; 1 the job ran and failed (report.json says why); 2 bad usage/config/input.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform"))
try:
    from spotfill.cli import jobkit
except ImportError as exc:  # neither shipped with the working dir nor installed
    sys.exit(print(f"pretrain.py: error: cannot import spotfill ({exc}); submit with --working-dir "
                   "at the repository root or pip install it", file=sys.stderr) or 2)


def main(args) -> dict:
    from spotfill.config.job import load_job_config

    flags = {"training.steps": args.steps, "storage": args.storage, "run_dir": args.run_dir,
             "data.path": args.data, "name": args.name}
    cfg = load_job_config(args.config, {k: v for k, v in flags.items() if v is not None})
    cfg.storage = jobkit.absolute("storage", cfg.storage)          # driver and workers: same place
    cfg.run_dir = jobkit.absolute("run_dir", cfg.run_dir)
    cfg.data.path = jobkit.absolute("data.path", cfg.data.path)
    from spotfill.fillin.bubble_fill import bubble_filler
    from spotfill.train.job import TrainingJob, ray_train_env

    env = jobkit.runtime_env(ray_train_env())
    job = TrainingJob(cfg, runtime_env=env, live=not args.no_progress, bubble_filler=bubble_filler)
    # Config, storage, dataset and model first; then (connected to Ray with `env`) the cluster's resources.
    job.validate()                      # ConfigError (exit 2) in seconds, before any worker starts
    report = job.fit()                  # JobFailed (exit 1) when training did not finish
    t = report["training"]
    return {"ok": report["ok"], "run_dir": job.run_dir, "report": os.path.join(job.run_dir, "report.json"),
            "steps_completed": t.get("steps_completed"), "final_loss": t.get("final_loss"),
            "checkpoints": report.get("checkpoints", {}).get("committed"),
            "spotfill": jobkit.library_dir(), "shipped": jobkit.shipped()}


def build_parser():
    ap = jobkit.parser("pretrain.py", "Elastic DeepSpeed pretraining on Ray Train.")
    ap.add_argument("--config", required=True, metavar="FILE", help="job YAML (spotfill.config.job.JobConfig)")
    ap.add_argument("--steps", type=int, metavar="N", help="override training.steps")
    ap.add_argument("--storage", metavar="URI", help="override storage (checkpoints)")
    ap.add_argument("--run-dir", metavar="DIR", help="override run_dir (report.json, events.jsonl)")
    ap.add_argument("--data", metavar="URI", help="override data.path (prepared shards)")
    ap.add_argument("--name", help="override name")
    ap.add_argument("--no-progress", action="store_true", help="no live progress on stderr")
    return ap


if __name__ == "__main__":
    sys.exit(jobkit.run_main(main, build_parser()))

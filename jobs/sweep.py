"""A Ray Tune hyper-parameter sweep of a small model that runs only on GPUs the fill-in arbiter lends.

    ray job submit --working-dir . -- python jobs/sweep.py --config examples/sweep-tiny.yaml

Config file: spotfill.config.sweep.SweepJobConfig as YAML (unknown keys are rejected):
    name: sweep-tiny
    run_dir: /tmp/spotfill/runs/sweep-tiny        # report.json (fillin.sweep) + events.jsonl, driver-local
    storage: /tmp/spotfill/sweeps/sweep-tiny      # Tune storage_path (trial checkpoints): path or s3://
    data: {path: /tmp/spotfill/data/stdlib-json}  # prepared shards (jobs/prepare_data.py's output)
    sweep: {model: tiny, steps: 60, batch: 8, search: {lr: [0.001, 0.003], warmup_steps: [0, 10]}}
    fillin: {grant: arbiter, max_units: 4, grace_s: 5.0}   # grant: fixed = max_units GPUs of one's own
    cluster: {gpu_resource: GPU_SLOT, cpus_per_trial: 1}
Trials (1 GPU unit each) start only while the arbiter lends the sweep a unit; when training claims GPUs,
trials beyond the grant are paused with a checkpoint within the grace (the newest-started first) and are
resumed from that checkpoint when units are lent again -- from the copy the pause kept in host memory
(sweep.keep_in_memory_mb, default 1024; report.json fillin.sweep.resumed_from says memory or storage). A rerun with the same storage and name continues
the experiment a stopped driver left (completed trials kept, the others from their last checkpoint;
report.json fillin.sweep.restored). Flags override the file: --storage, --run-dir,
--data, --name, --trials, --steps. Prints one JSON summary line on stdout.
Exit codes: 0 every trial finished; 1 the sweep ran and a trial failed; 2 bad usage/config/input.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform"))
try:
    from spotfill.cli import jobkit
except ImportError as exc:  # neither shipped with the working dir nor installed
    sys.exit(print(f"sweep.py: error: cannot import spotfill ({exc}); submit with --working-dir "
                   "at the repository root or pip install it", file=sys.stderr) or 2)


def main(args) -> dict:
    from spotfill.config.sweep import load_sweep_config

    flags = {"storage": args.storage, "run_dir": args.run_dir, "data.path": args.data, "name": args.name,
             "sweep.trials": args.trials, "sweep.steps": args.steps}
    cfg = load_sweep_config(args.config, {k: v for k, v in flags.items() if v is not None})
    cfg.storage = jobkit.absolute("storage", cfg.storage)
    cfg.run_dir = jobkit.absolute("run_dir", cfg.run_dir)
    cfg.data.path = jobkit.absolute("data.path", cfg.data.path)
    from spotfill.fillin.sweep_job import run_sweep_job

    jobkit.second_on_cpu()

    report = run_sweep_job(cfg, runtime_env=jobkit.runtime_env(), step_sleep_s=args.step_sleep_s)
    s = report["fillin"]["sweep"]
    return {"ok": report["ok"], "run_dir": cfg.run_dir, "report": os.path.join(cfg.run_dir, "report.json"),
            "trials": s["trials"], "completed": s["completed"], "paused": s["paused"], "resumed": s["resumed"],
            "resumed_from": s["resumed_from"], "restored": s["restored"], "carried_over": s["carried_over"], "best": s["best"], "spotfill": jobkit.library_dir(), "shipped": jobkit.shipped()}


def build_parser():
    ap = jobkit.parser("sweep.py", "Ray Tune sweep of a small model on lent GPUs.")
    ap.add_argument("--config", required=True, metavar="FILE", help="job YAML (spotfill.config.sweep.SweepJobConfig)")
    ap.add_argument("--storage", metavar="URI", help="override storage (trial checkpoints)")
    ap.add_argument("--run-dir", metavar="DIR", help="override run_dir (report.json, events.jsonl)")
    ap.add_argument("--data", metavar="URI", help="override data.path (prepared shards)")
    ap.add_argument("--name", help="override name")
    ap.add_argument("--trials", type=int, metavar="N", help="override sweep.trials (the grid's first N)")
    ap.add_argument("--steps", type=int, metavar="N", help="override sweep.steps (per trial)")
    ap.add_argument("--step-sleep-s", type=float, default=0.0, help=argparse_hide())
    return ap


def argparse_hide():
    import argparse
    return argparse.SUPPRESS     # tests: slow each report down so a reclaim lands mid-trial


if __name__ == "__main__":
    sys.exit(jobkit.run_main(main, build_parser()))

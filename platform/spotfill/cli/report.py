"""`spotfill report RUN_DIR`: (re)write report.html and timeline.png from RUN_DIR/events.jsonl (+ report.json)."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("report", help="(re)write RUN_DIR/report.html and RUN_DIR/timeline.png")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotfill.telemetry.report import write_report

    out = write_report(args.run_dir)
    s = out["summary"]
    gs = s["gpu_seconds"]
    goodput = "n/a" if s.get("goodput") is None else f"{s['goodput']:.1%}"
    print(f"goodput {goodput}; GPU-seconds: " + ", ".join(
        f"{k} {gs[k]:,.0f}" for k in ("training", "checkpoint_stall", "recovering", "fillin", "idle", "unaccounted",
                                      "total") if k in gs))
    print(f"wrote {out['html']} and {out['png']}", file=sys.stderr)
    return 0

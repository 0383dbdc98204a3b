"""`spotfill report RUN_DIR`: (re)write report.html and timeline.png."""
from __future__ import annotations

from spotfill.cli.main import pending


def register(sub) -> None:
    p = sub.add_parser("report", help="(re)write RUN_DIR/report.html and RUN_DIR/timeline.png")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=pending("spotfill report", "the telemetry and report issue"))

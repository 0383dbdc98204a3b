"""`spotfill demo`: run a scenario on the embedded local cluster."""
from __future__ import annotations

from spotfill.cli import pending


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a scenario (preemption, node return, hard loss) on an embedded local Ray cluster")
    p.add_argument("--scenario", metavar="FILE", help="scenario YAML (default: the built-in scenario)")
    p.add_argument("--out", metavar="DIR", help="run directory for report.json and events.jsonl")
    p.add_argument("--storage", metavar="URI", help="checkpoint storage: local path or s3://bucket/prefix")
    p.add_argument("--quick", action="store_true", help="shorter run")
    p.set_defaults(func=pending("spotfill demo", "issue #4"))

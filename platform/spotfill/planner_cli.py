"""`spotfill plan` (the planner helper replaces this with the full flag set)."""
from __future__ import annotations

from spotfill.cli import pending


def register(sub) -> None:
    p = sub.add_parser("plan", help="size memory, compute, time, cost and IO for a training run")
    p.set_defaults(func=pending("spotfill plan", "issue #2"))

"""`spotfill bench`: side-by-side benchmarks (benchmarks/)."""
from __future__ import annotations

from spotfill.cli import pending


def register(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks, JSON out")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--json", metavar="PATH", help="write the benchmark JSON here")
    p.set_defaults(func=pending("spotfill bench", "issue #3"))

"""`spotfill spot-watch`: AWS spot notice -> Ray drain (PREEMPTION, deadline)."""
from __future__ import annotations

from spotfill.cli import pending


def register(sub) -> None:
    p = sub.add_parser("spot-watch", help="watch the instance-metadata service for a spot notice and drain this Ray node")
    p.add_argument("--imds-endpoint", metavar="URL", default="http://169.254.169.254",
                   help="instance-metadata endpoint (default: %(default)s)")
    p.add_argument("--poll-s", metavar="S", type=float, default=2.0, help="poll interval in seconds")
    p.add_argument("--once", action="store_true", help="poll once and exit")
    p.set_defaults(func=pending("spotfill spot-watch", "issue #4"))

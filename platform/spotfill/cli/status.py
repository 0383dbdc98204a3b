"""`spotfill status`: the arbiter's view of GPUs per node and workload."""
from __future__ import annotations

from spotfill.cli.main import pending


def register(sub) -> None:
    p = sub.add_parser("status", help="arbiter view: GPUs per node and workload, leases, reclaims")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster address (default: auto)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=pending("spotfill status", "the fill-in arbiter issue"))

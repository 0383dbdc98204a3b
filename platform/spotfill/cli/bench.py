"""`spotfill bench`: side-by-side benchmarks (the repo's benchmarks/ folder), JSON out.

    spotfill bench [--quick] [--json PATH] [--only recovery,preemption,checkpoint,overhead,gpu,upload,fillin,eventlog,
                    pipeline,serve,elastic_load]

The benchmark code lives in the top-level benchmarks/ folder of a spotfill checkout (runnable scripts, not
part of the installed package); this command finds it next to the package (`pip install -e .`), in the
current directory, or where SPOTFILL_BENCHMARKS_DIR points.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from spotfill.config.errors import ConfigError

# benchmarks/run.py's sections, named here too so `--only` is checked without importing the benchmarks
SECTIONS = ("recovery", "preemption", "checkpoint", "overhead", "gpu", "upload", "fillin", "eventlog", "pipeline",
            "serve", "elastic_load")


def register(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks, JSON out",
                       description="Measure spotfill against stock Ray Train / plain DeepSpeed / raw boto3 "
                       "on this machine, in one run: recovery after node loss and preemption (vs stock Ray Train with its "
                       "defaults and with spotfill's Ray timeouts, 'stock-tuned'), checkpoint stall and upload, "
                       "training overhead, GPU MFU; fill-in (--only fillin): hand-back, harvest ratio, training "
                       "tokens/s with vs without Serve fill-in; serving (--only serve): tokens/s of the generation engine at "
                       "batch 1 and 8 against the first serving loop, with and without a speculative draft.")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (about 10 minutes on 2 cores)")
    p.add_argument("--json", metavar="PATH", help="write the benchmark JSON here")
    p.add_argument("--only", metavar="SECTION,...",
                   help=f"run only these sections ({', '.join(SECTIONS)}; default all but upload, eventlog "
                   "and elastic_load)")
    p.set_defaults(func=run)


def benchmarks_root() -> str:
    """The checkout folder holding benchmarks/run.py (ConfigError when there is none)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("SPOTFILL_BENCHMARKS_DIR", ""), os.path.join(here, "..", "..", "benchmarks"),
                  os.path.join(os.getcwd(), "benchmarks")]
    for cand in candidates:
        if cand and os.path.isfile(os.path.join(cand, "run.py")):
            return os.path.dirname(os.path.abspath(cand))
    raise ConfigError("spotfill bench", reason="benchmarks/ not found: run it from a spotfill checkout "
                      "(pip install -e .) or set SPOTFILL_BENCHMARKS_DIR to its benchmarks/ folder")


def parse_sections(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if not names or bad:
        raise ConfigError("--only", value, accepted=", ".join(SECTIONS))
    return names


def run(args: argparse.Namespace) -> int:
    sections = parse_sections(args.only)
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise ConfigError("--json", args.json, reason="its folder does not exist")
    root = benchmarks_root()
    if root not in sys.path:
        sys.path.insert(0, root)
    bench_run = importlib.import_module("benchmarks.run")
    result = bench_run.run_all(args.quick, sections,
                               progress=lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True))
    return bench_run.finish(result, args.json)

"""The `spotfill` console script.

Exit codes (CONTRACTS): 0 success; 1 the job ran and failed; 2 bad usage, config or input, reported as
one line on stderr naming the field, the bad value and what is accepted -- never a traceback.
Each subcommand lives in its own module with `register(subparsers)`; heavy imports (ray, torch) happen
inside the command functions so `--help` and usage errors stay fast.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from spotfill.config.errors import ConfigError, SpotfillError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise usage_error(self.prog, message)


def usage_error(prog: str, message: str) -> ConfigError:
    """argparse's message as a ConfigError that names the argument first:
    "argument --seq-len: invalid int value: 'x'" -> "--seq-len: invalid int value: 'x'"."""
    field, reason = (prog.split(" ", 1)[1] if " " in prog else "arguments"), message
    if message.startswith("argument ") and ": " in message:
        field, reason = message[len("argument "):].split(": ", 1)
        field = field.split("/")[-1]           # "-o/--out" -> "--out"
    elif message.startswith("the following arguments are required: "):
        field, reason = message.split(": ", 1)[1], "required"
    return ConfigError(field, reason=reason, accepted=f"see `{prog} --help`")


def build_parser() -> OneLineParser:
    from spotfill.cli import bench as bench_cli
    from spotfill.cli import demo as demo_cli
    from spotfill.cli import export as export_cli
    from spotfill.cli import plan as planner_cli
    from spotfill.cli import report as report_cli
    from spotfill.cli import serve as serve_cli
    from spotfill.cli import spot_watch as spot_cli
    from spotfill.cli import status as status_cli

    parser = OneLineParser(prog="spotfill", description=(
        "Elastic DeepSpeed training on Ray across spot GPUs, with spare-GPU fill-in."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for module in (planner_cli, demo_cli, report_cli, status_cli, spot_cli, bench_cli, serve_cli, export_cli):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from spotfill.config import constants

        constants.check_env()   # every numeric SPOTFILL_* variable, before any subcommand runs
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand they were given to, not the top-level parser
            raise usage_error(f"spotfill {args.command}", f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"spotfill: error: {exc}", file=sys.stderr)
        return 2
    except SpotfillError as exc:
        print(f"spotfill: failed: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("spotfill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

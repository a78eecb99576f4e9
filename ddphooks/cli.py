"""The ``ddphooks`` command line: ``demo``, ``experiment`` and ``report``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddphooks", description="Silent-inconsistency statistics for PyTorch DDP.")
    commands = parser.add_subparsers(dest="command", required=True)
    from ddphooks import demo

    demo_parser = commands.add_parser("demo", help="a 2-process CPU run in which one rank silently goes wrong")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)

    from ddphooks.experiment import report, run

    experiment_parser = commands.add_parser("experiment", help="DP fine-tuning of a causal LM under synchronised and desynchronised settings")
    run.add_arguments(experiment_parser)
    experiment_parser.set_defaults(run=run.main)
    report_parser = commands.add_parser("report", help="figures and a summary table from experiment run files")
    report.add_arguments(report_parser)
    report_parser.set_defaults(run=report.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

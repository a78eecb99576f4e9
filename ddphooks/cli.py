"""The ``ddphooks`` command line: ``ddphooks demo``."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``ddphooks`` command line: ``demo``, ``experiment``, ``report`` and ``detect``.

Every error a user can fix is one line on stderr, ``ddphooks <command>: error: <message>``, and exit
status 2; see :func:`main` for where the line between user errors and bugs is drawn.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import NoReturn

PACKAGE = Path(__file__).resolve().parent
DEBUG_VARIABLE = "DDPHOOKS_TRACEBACK"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the full usage is a ``--help`` away);
    subcommand parsers inherit it through ``add_subparsers``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddphooks", description="Silent-inconsistency statistics for PyTorch DDP.")
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
    detect_parser = commands.add_parser("detect", help="alerts of the online detector, run offline on run files: which rank, since when, where")
    report.add_detect_arguments(detect_parser)
    detect_parser.set_defaults(run=report.detect_main)
    return parser


def _one_line(error: BaseException) -> str:
    """The error's message on one line; OS errors as ``<path>: <reason>``."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        message = f"{error.filename}: {error.strerror}"
    elif isinstance(error, SystemExit):
        message = str(error.code)
    else:
        message = str(error) or type(error).__name__
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _show_warning(prog: str):
    """A ``warnings.showwarning`` that prints ddphooks' own warnings (a skipped truncated line, figures
    skipped) as one line under the command's name and leaves other libraries' warnings as they are,
    with the file and line that tell where they come from."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if Path(filename).resolve().is_relative_to(PACKAGE):
            print(f"{prog}: warning: {message}", file=sys.stderr if file is None else file)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    """Run one ``ddphooks`` command; returns its exit status.

    Where the line is: an exception is a *user error* when its message alone tells the user what
    to fix, and is then printed as ``ddphooks <command>: error: <message>`` (one line, status 2):

    - ``SystemExit`` with a message: the commands' own argument checks;
    - ``ValueError`` (``UnicodeDecodeError`` included): a bad value or a malformed input file; ddphooks'
      messages name the value or ``file:line``;
    - ``OSError``: a path that is missing, unreadable or unwritable; the message names the path.

    Anything else (``TypeError``, ``KeyError``, ``RuntimeError``, including the ``WorkerError`` that
    carries a spawned rank's traceback, ...) is a bug or an environment failure whose traceback is
    the useful part, so it propagates. Argument-parser errors are one line too (status 2), and
    ``DDPHOOKS_TRACEBACK=1`` re-raises user errors, for the rare ValueError that is really a bug.

    Args:
        argv: the arguments after ``ddphooks`` (None: ``sys.argv[1:]``).

    Example::

        $ ddphooks report missing.jsonl -o out
        ddphooks report: error: missing.jsonl: No such file or directory
    """
    args = build_parser().parse_args(argv)
    prog = f"ddphooks {args.command}"
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning(prog)
        try:
            return args.run(args)
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int) or os.environ.get(DEBUG_VARIABLE):
                raise  # a status, not a message
            error: BaseException = exit_
        except (OSError, ValueError) as caught:
            if os.environ.get(DEBUG_VARIABLE):
                raise
            error = caught
    print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

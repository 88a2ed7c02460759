"""Command line: `tree-attention-edu demo | bench | calibrate | generate | speed | fetch-model |
launch | cluster | student | grade`.

Device setup must happen before JAX computes anything, so every subcommand parses its
arguments, calls `simulate_devices`, and only then computes. One module per subcommand
(`demo`, `bench`, `calibrate`, `generate`, `speed`, `fetch_model`, `launch`, `cluster`,
`student`, `grade`), each with `add_arguments`, `validate` and `run`; what they share is in
`plumbing` (the parser, argument types, one-line errors), `memory` (what each run needs) and
`common` (the decode problem and device setup). `worker` is the entry point of the
launchers' worker processes, `forwarder` that of a cluster's delay forwarder.
Every entry point of the package is here.

Every argument is checked before any work starts: a bad flag, an unwritable output path or
a size this machine cannot hold ends in one line on stderr and exit status 2; a failure
while running ends in one line and exit status 1 (set `TREE_ATTENTION_EDU_TRACEBACK=1` to
see the traceback instead).
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import (
    bench,
    calibrate,
    cluster,
    demo,
    fetch_model,
    generate,
    grade,
    launch,
    speed,
    student,
)
from . import plumbing as cl

COMMANDS = (demo, bench, calibrate, generate, speed, fetch_model, launch, cluster, student, grade)


def build_parser() -> argparse.ArgumentParser:
    parser = cl.Parser(
        prog=cl.PROG, description=__doc__.split("\n")[0], formatter_class=cl.HelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="show the installed version and exit",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="what to run; 'COMMAND --help' lists its options",
    )
    for command in COMMANDS:
        p = sub.add_parser(
            command.NAME,
            help=command.HELP,
            description=command.HELP,
            formatter_class=cl.HelpFormatter,
        )
        p.set_defaults(command_module=command, subparser=p)
        command.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and check every argument, then run the subcommand.

    Returns the exit status: 0, or 1 when the run fails (one line on stderr). Bad arguments
    raise `SystemExit(2)` after one usage line, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_module.validate(args.subparser, args)
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        print("note: XLA_FLAGS sets a device count; --devices is applied on top", file=sys.stderr)
    try:
        return args.command_module.run(args)
    except KeyboardInterrupt:
        print(f"{cl.PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(cl.TRACEBACK_ENV):
            raise
        print(f"{cl.PROG}: error: {cl.one_line(e)}", file=sys.stderr)
        return 1

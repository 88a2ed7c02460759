"""`tree-attention-edu student`: the student release of the course's notebooks
(`course.release`, by nbgrader): solutions cleared, stubs and tests kept, outputs cleared.
`--check` then autogrades it as released and with the solutions put back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import plumbing as cl

NAME = "student"
HELP = "write the student release of the notebooks (nbgrader): no solutions, no outputs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/student", metavar="DIR", help="where to write it")
    p.add_argument(
        "--notebooks",
        default="notebooks",
        metavar="DIR",
        help="the lecturer's copy: the committed notebooks, with solutions and outputs",
    )
    p.add_argument(
        "--only",
        type=lambda s: [n.strip() for n in s.split(",") if n.strip()],
        default=None,
        metavar="NN,...",
        help="only these notebooks (their numbers, e.g. 01,03); default all",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="then autograde the release as released (exactly the exercises' tests must fail) "
        "and with the solutions put back (full marks): executes every notebook twice",
    )
    p.add_argument(
        "--timeout",
        type=cl.positive,
        default=600,
        metavar="S",
        help="seconds a cell may run when checking",
    )


def chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Path]:
    """The lecturer's notebooks `--notebooks` and `--only` select (one usage line if none)."""
    import importlib.util

    from ..course.release import lecturer_notebooks

    if importlib.util.find_spec("nbgrader") is None:
        parser.error('needs nbgrader: pip install -c requirements-lock.txt -e ".[dev]"')
    folder = Path(args.notebooks)
    if not folder.is_dir():
        parser.error(f"--notebooks {folder}: no such folder")
    try:
        found = lecturer_notebooks(folder)
    except ValueError as err:
        parser.error(f"--notebooks {err}")
    if args.only is not None:
        unknown = set(args.only) - {p.name[:2] for p in found}
        if unknown:
            parser.error(f"--only: no notebook numbered {', '.join(sorted(unknown))}")
        found = [p for p in found if p.name[:2] in args.only]
    return found


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.lecturer = chosen(parser, args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: is a file, not a folder")
    if out.resolve() == Path(args.notebooks).resolve():
        parser.error(f"--out {out}: would overwrite the lecturer's copy")


def run(args: argparse.Namespace) -> int:
    from ..course import release

    written = release.release(args.lecturer, Path(args.out), timeout_s=args.timeout)
    n = sum(len(release.exercises(release.read(p), p.name)) for p in written)
    print(f"student release: {len(written)} notebooks, {n} exercises, in {args.out}/")
    if not args.check:
        return 0
    print("checking: autograding it as released and with the solutions put back ...")
    problems = release.check_release(written, args.lecturer, timeout_s=args.timeout)
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    if problems:
        raise cl.CommandFailed(f"the release failed {len(problems)} check(s); listed above")
    print("as released, exactly the exercises' tests fail; with the solutions, full marks")
    return 0

"""`tree-attention-edu grade SUBMISSIONS`: autograde submitted notebooks with nbgrader
(`course.release.grade`) and print a score per notebook and per test (grade_id)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import plumbing as cl
from .student import chosen

NAME = "grade"
HELP = "autograde submitted notebooks (nbgrader); a score per notebook and per exercise"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "submissions",
        metavar="SUBMISSIONS",
        help="a folder of submitted notebooks (one student), or of one folder per student",
    )
    p.add_argument(
        "--notebooks",
        default="notebooks",
        metavar="DIR",
        help="the lecturer's copy, whose tests grade the submissions",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the scores here")
    p.add_argument(
        "--timeout", type=cl.positive, default=600, metavar="S", help="seconds a cell may run"
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from ..course.release import submissions

    args.only = None
    args.lecturer = chosen(parser, args)
    try:
        args.by_student = submissions(Path(args.submissions))
    except ValueError as err:
        parser.error(str(err))
    known = {p.name for p in args.lecturer}
    for paths in args.by_student.values():
        for path in paths:
            if path.name not in known:
                parser.error(f"{path}: the course has no notebook {path.name}")
    if args.json:
        cl.check_output(parser, "--json", args.json)


def run(args: argparse.Namespace) -> int:
    from ..course import release

    results = release.grade(args.by_student, args.lecturer, timeout_s=args.timeout)
    print(release.score_table(results))
    if args.json:
        record = {
            student: {g.notebook: {"scores": g.scores, "failed": g.failed} for g in graded}
            for student, graded in results.items()
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0

"""The plumbing every subcommand shares: a parser whose usage errors are one line with exit
status 2, argument types that say what they expect, the check of an output path before any
work, and the one line a failed run prints (exit status 1). Imports nothing of the package
(and not JAX).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

PROG = "tree-attention-edu"
TRACEBACK_ENV = "TREE_ATTENTION_EDU_TRACEBACK"
MAX_DEVICES = 1024  # simulated CPU devices: 1024 already take ~30 s and 1.3 GB to sum a vector
MAX_POSITION = 2**31 - 1  # positions and lengths are int32


class CommandFailed(Exception):
    """A subcommand ran but its check failed; the message is the one line to print."""


def one_line(e: BaseException) -> str:
    """What a failed run prints: the error's first line; for an error that is not a plain
    `ValueError`/`TypeError`/`CommandFailed`, its type too, and how to see the traceback."""
    text = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    if isinstance(e, ValueError | TypeError | CommandFailed):
        return text or type(e).__name__
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__) + (
        f" (set {TRACEBACK_ENV}=1 for the traceback)"
    )


def report_worker_failure(e: BaseException, prefix: str) -> int:
    """A worker process's failure: one line `prefix Type: first line` on stderr, which the
    launcher reads back (`cluster.processes.worker_summary`); the traceback too when
    `TRACEBACK_ENV` is set. Returns the exit status, 1."""
    import os
    import sys

    line = next((s for s in str(e).splitlines() if s.strip()), "")
    print(f"{prefix} {type(e).__name__}: {line}", file=sys.stderr, flush=True)
    if os.environ.get(TRACEBACK_ENV):
        raise e
    return 1


# ---------------------------------------------------------------------------------------
# The parser


class Parser(argparse.ArgumentParser):
    """Usage errors are one line (the usage itself is one `--help` away), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (None, or a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:  # flags: --no-check, --version, ...
            return action.help
        return super()._get_help_string(action)


# ---------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse turns into one usage line.


def integer(text: str) -> int:
    """An integer; also accepts integral floats such as 1e6 and underscores (65_536)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not (math.isfinite(value) and value.is_integer()):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)


def positive(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def devices(text: str) -> int:
    value = positive(text)
    if value > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices is more than the {MAX_DEVICES} this command allows "
            "(each one is an XLA CPU device with its own threads and buffers)"
        )
    return value


def seed(text: str) -> int:
    value = integer(text)
    if not 0 <= value < 2**63 - 1:
        raise argparse.ArgumentTypeError(f"must be in 0..{2**63 - 2}, got {text!r}")
    return value


def lengths(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return [positive(s) for s in parts]


def token_ids(text: str) -> list[int]:
    """A prompt as comma-separated token ids (non-negative integers)."""
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}"
        )
    ids = [integer(s) for s in parts]
    if min(ids) < 0 or max(ids) > MAX_POSITION:
        raise argparse.ArgumentTypeError(f"token ids must be non-negative integers, got {text!r}")
    return ids


def finite(text: str, what: str, ok: Callable[[float], bool], requirement: str) -> float:
    """A finite float flag value that satisfies `ok`, or an ArgumentTypeError saying why."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
    return value


def temperature(text: str) -> float:
    return finite(text, "a number", lambda t: t >= 0, "a finite number >= 0 (0 is greedy)")


def seconds(text: str) -> float:
    return finite(text, "a number of seconds", lambda t: t > 0, "a positive number of seconds")


def port(text: str) -> int:
    value = integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: pick a free one), got {text!r}")
    return value


def names(known: tuple[str, ...], allow_empty: bool = False) -> Callable[[str], list[str]]:
    """A comma list of names from `known` (repeats dropped, order kept)."""

    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [n for n in names if n not in known]
        if bad or not (names or allow_empty):
            what = ", ".join(map(repr, bad)) or "empty list " + repr(text)
            none = " ('' for none)" if allow_empty else ""
            raise argparse.ArgumentTypeError(
                f"unknown {what}; use one or more of {','.join(known)}, comma-separated{none}"
            )
        return list(dict.fromkeys(names))

    return parse


def layout(min_nodes: int = 1) -> Callable[[str], tuple[int, int, int]]:
    """A cluster layout "NODESxPROCESSESxDEVICES" (e.g. 2x2x1): three positive ints, at
    least `min_nodes` nodes."""

    def parse(text: str) -> tuple[int, int, int]:
        parts = text.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"expected NODESxPROCESSESxDEVICES, got {text!r}")
        nodes, procs, devs = (int(p) for p in parts)
        if nodes < min_nodes:
            raise argparse.ArgumentTypeError(f"needs at least {min_nodes} nodes, got {text!r}")
        return nodes, procs, devs

    return parse


# ---------------------------------------------------------------------------------------
# Output paths, checked after parsing and before any work


def check_output(
    parser: argparse.ArgumentParser, flag: str, path: str, formats: set[str] | None = None
) -> None:
    """Fail now, not after the run, if `path` cannot be written."""
    p = Path(path)
    if formats is not None and p.suffix and p.suffix[1:].lower() not in formats:
        parser.error(
            f"{flag} {path}: unknown image format {p.suffix!r}; use one of "
            f"{', '.join(sorted(formats))}"
        )
    if p.is_dir():
        parser.error(f"{flag} {path}: is a directory; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            open(p, "ab").close()  # append mode: the file is not truncated
        else:
            open(p, "xb").close()
            p.unlink()
    except OSError as e:
        parser.error(f"{flag} {path}: cannot write there ({e.strerror or e})")


def figure_formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())

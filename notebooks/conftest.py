"""Per-notebook XLA flags for nbval (`make nbval`); not part of the course.

nbval starts one kernel per notebook, when the notebook's first cell is set up, and the kernel
inherits this process's environment. `make nbval` names extra XLA flags in `TAE_NBVAL_XLA_FLAGS`
(the cheap compilation of `make unit-cheap`) and the notebooks that must not get them in
`TAE_NBVAL_DEFAULT_COMPILE` (file names, space-separated): those whose time is their programs'
run rather than their compilation (the Makefile says which and why). Every other notebook's
kernel starts with `XLA_FLAGS` plus the extra flags. Without `TAE_NBVAL_XLA_FLAGS` (a plain
`pytest --nbval` run) this does nothing: each kernel compiles as a student's does.
"""

import os
from pathlib import Path

import pytest

BASE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


def notebook_xla_flags(notebook: Path, environ: dict[str, str]) -> str:
    """The `XLA_FLAGS` a kernel for `notebook` starts with, given `TAE_NBVAL_XLA_FLAGS` and
    `TAE_NBVAL_DEFAULT_COMPILE` in `environ` (see the module's docstring); "" for none."""
    extra = environ.get("TAE_NBVAL_XLA_FLAGS", "").strip()
    default = set(environ.get("TAE_NBVAL_DEFAULT_COMPILE", "").split())
    if not extra or notebook.name in default:
        return BASE_XLA_FLAGS
    return f"{BASE_XLA_FLAGS} {extra}".strip()


@pytest.hookimpl(tryfirst=True)  # before the runner sets up the notebook, which starts its kernel
def pytest_runtest_setup(item):
    if item.path.suffix != ".ipynb" or "TAE_NBVAL_XLA_FLAGS" not in os.environ:
        return
    flags = notebook_xla_flags(item.path, dict(os.environ))
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)

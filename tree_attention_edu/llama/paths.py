"""Filesystem paths the Llama tools take: checkpoint folders, GGUF files, the model cache.

`check_path` turns a `str` or `os.PathLike` into a `pathlib.Path` (anything else is a
TypeError naming the argument); `make_folder` creates a folder and checks it can be written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.validate import describe

StrPath = str | os.PathLike[str]
"""A filesystem path: a `str` or a `pathlib.Path` (any `os.PathLike`)."""


def check_path(path: Any, name: str = "path", what: str = "a path") -> Path:
    """A filesystem path (str or os.PathLike), returned as a `pathlib.Path`; `what` says
    what it should point to ("a folder", "a .gguf file or a folder")."""
    if isinstance(path, bool) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"`{name}` must be {what} (str or pathlib.Path), got {describe(path)}.")
    return Path(path)


def make_folder(path: Any, name: str = "path") -> Path:
    """Create the folder `path` (and its parents) if needed and return it; a path that is a
    file, cannot be created or cannot be written to is a ValueError naming `name`."""
    folder = check_path(path, name, "a folder")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"`{name}` {str(folder)!r} is a file, not a folder; pick another path.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"`{name}` {str(folder)!r} cannot be used as a folder: "
            f"{err.strerror or err}; pick another path."
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"`{name}` {str(folder)!r} is not writable; pick another path.")
    return folder

"""Prose numbers are claims: every number in a notebook's Markdown is computed or sourced.

A figure that depends on data or arithmetic belongs in a code cell's output (printed, or
rendered as Markdown by `IPython.display.Markdown`), where strict nbval checks it. What may
stay in Markdown is listed, with its reason, in `tests/prose_numbers/<notebook>.txt`, one
`number | reason` per line: a paper figure with its table or equation, a hardware constant with
its source, or a parameter the notebook sets. Integers below 10 (counts like "8 devices") and
section numbers of headings are free.

The scan covers LaTeX too: `$5184$` is as much a claim as 5184.
"""

import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))  # not conftest.py
ALLOW = Path(__file__).parent / "prose_numbers"

NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)(?![\w])")
IGNORED = [
    re.compile(r"`[^`]*`"),  # inline code: names and calls, not claims
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"https?://\S+"),
    re.compile(r"arXiv[ :]*\d{4}\.\d{4,5}", re.I),
    re.compile(r"^#+\s*[\d.]+", re.M),  # heading numbers ("## 4.2")
    re.compile(r"<[^>]+>"),  # HTML tags (<details>, <summary>)
]


def prose_numbers(path: Path) -> list[str]:
    found = []
    for cell in jupytext.read(path).cells:
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        for pattern in IGNORED:
            text = pattern.sub(" ", text)
        for token in NUMBER.findall(text):
            token = token.rstrip(",")
            plain = token.replace(",", "")
            if re.fullmatch(r"\d", plain):
                continue  # small counts are free
            found.append(token)
    return found


def allowed(path: Path) -> dict[str, str]:
    listing = ALLOW / f"{path.stem}.txt"
    if not listing.exists():
        return {}
    entries = {}
    for line in listing.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        number, _, reason = line.partition("|")
        assert reason.strip(), f"{listing.name}: '{line}' gives no reason"
        entries[number.strip()] = reason.strip()
    return entries


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_prose_number_is_computed_or_sourced(path):
    unexplained = sorted(set(prose_numbers(path)) - set(allowed(path)))
    assert not unexplained, (
        f"{path.name} states {unexplained} in Markdown. Print them from a code cell, assert "
        f"them, or list them with a source in tests/prose_numbers/{path.stem}.txt."
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_allow_list_has_no_stale_entries(path):
    stale = sorted(set(allowed(path)) - set(prose_numbers(path)))
    assert not stale, (
        f"tests/prose_numbers/{path.stem}.txt lists {stale}, which the notebook no longer states"
    )


def test_the_scan_catches_a_claim(tmp_path):
    nb = tmp_path / "x.py"
    nb.write_text(
        "# %% [markdown]\n# ## 1.2 Title\n# The Hessian has $5184$ entries, "
        "or 576 (`f(576)`), on 8 devices.\n"
    )
    assert prose_numbers(nb) == ["5184", "576"]

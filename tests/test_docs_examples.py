"""The API pages' examples run: every ```python block of docs/api is executed, in a fresh
namespace, and its assertions must hold (a page that shows an out-of-date call fails here,
not in a reader's session)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PAGES = sorted((ROOT / "docs" / "api").rglob("*.md"))
EXAMPLES = [
    (page, i, code) for page in PAGES for i, code in enumerate(BLOCK.findall(page.read_text()))
]


def test_every_api_page_has_an_example():
    with_examples = {page for page, _, _ in EXAMPLES}
    assert [
        p.relative_to(ROOT)
        for p in PAGES
        if p not in with_examples and p.name not in ("index.md", "cli.md", "fetch.md")
    ] == []  # command lines


@pytest.mark.parametrize(
    ("page", "i", "code"),
    EXAMPLES,
    ids=[f"{p.relative_to(ROOT / 'docs' / 'api')}[{i}]" for p, i, _ in EXAMPLES],
)
def test_api_example_runs(page, i, code, tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # examples that save files leave nothing behind
    exec(compile(code, f"{page.name}[{i}]", "exec"), {"__name__": "__example__"})

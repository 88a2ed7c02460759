"""Notebook hygiene: sources and notebooks in sync, executed, no errors, normalised kernel.

nbval (run by `make test`) checks that the committed outputs reproduce; this checks that what
nbval runs is what the reviewed jupytext sources say.
"""

import ast
import json
import os
import re
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_notebooks():
    """The nine notebooks of the course, numbered 01 to 09 in reading order."""
    assert [p.stem[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, 10)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_paired_source_in_sync(path):
    source = path.with_suffix(".py")
    assert source.exists(), f"{source.name} (the jupytext source) is missing"
    assert cells(jupytext.read(path)) == cells(jupytext.read(source)), (
        f"{path.name} and {source.name} differ: run `make notebooks`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_without_errors(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "unexecuted cells"
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), "cells were not run top to bottom once"
    assert not any(o["output_type"] == "error" for c in code for o in c["outputs"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_device_setup_comes_first(path):
    """Devices are set up before JAX starts, and on the CPU whatever the runtime: on a GPU
    machine the course still runs on its 8 simulated CPU devices, and says so."""
    first = next(c for c in jupytext.read(path).cells if c.cell_type == "code").source
    assert "simulate_devices(" in first and "assert jax.device_count()" in first
    assert 'jax.config.update("jax_platforms", "cpu")' in first
    assert first.index("simulate_devices(") < first.index("import jax\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_ignore_output_only_on_timing_cells(path):
    for c in jupytext.read(path).cells:
        if "NBVAL_IGNORE_OUTPUT" in c.source:
            timing = (
                "median_time",
                "benchmark.run",
                "speedup",
                "calibrate.",
                "step_s",
                "run_cluster",
            )
            assert any(w in c.source for w in timing), c.source


# C0 controls and DEL, but \t and \n. A control character in a notebook's source is almost
# always a LaTeX command that a Python string swallowed: "\\text" written in a normal string
# is a tab and "ext", "\\beta" a backspace and "eta". The site then shows garbled math.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def control_characters(path: Path) -> list[str]:
    """Control characters in a notebook's cells (a jupytext .py or an .ipynb): any in
    Markdown (tabs included), and any but tabs in code. Each as 'cell N (type): repr'."""
    if path.suffix == ".ipynb":
        raw = json.loads(path.read_text())["cells"]
        found_cells = [(c["cell_type"], "".join(c["source"])) for c in raw]
    else:
        found_cells = [(c.cell_type, c.source) for c in jupytext.read(path).cells]
    found = []
    for i, (kind, source) in enumerate(found_cells):
        for m in CONTROL.finditer(source):
            context = source[max(0, m.start() - 20) : m.end() + 10]
            found.append(f"cell {i} ({kind}): {m.group()!r} in {context!r}")
        if kind != "code" and "\t" in source:
            found.append(f"cell {i} ({kind}): a tab in Markdown")
    return found


@pytest.mark.parametrize(
    "path", NOTEBOOKS + [p.with_suffix(".py") for p in NOTEBOOKS], ids=lambda p: p.name
)
def test_no_control_characters(path):
    found = control_characters(path)
    assert not found, f"{path.name}: {found}"


def test_control_characters_are_caught(tmp_path):
    """Notebook 9's old formula: "\\t" and "\\b" became a tab and a backspace."""
    broken = "$t = a + \text{bytes}/\beta$"  # a tab and a backspace, as the bug made them
    source = tmp_path / "x.py"
    source.write_text(
        f"# %% [markdown]\n# {broken}\n\n# %%\nx = 1\tif True else 2  # a tab in code\n"
    )
    found = control_characters(source)
    assert len(found) == 2 and "'\\x08'" in found[0] and "tab in Markdown" in found[1], found
    nb = tmp_path / "x.ipynb"
    nb.write_text(
        json.dumps(
            {
                "cells": [
                    {"cell_type": "markdown", "metadata": {}, "source": [broken]},
                    {
                        "cell_type": "code",
                        "metadata": {},
                        "source": ["x = 1\t# fine\n", "y = '\x07'"],
                        "outputs": [],
                        "execution_count": None,
                    },
                ]
            }
        )
    )
    found = control_characters(nb)
    assert len(found) == 3 and "(code): '\\x07'" in found[2], found
    clean = tmp_path / "clean.py"
    clean.write_text("# %% [markdown]\n# $t = a + \\text{bytes}/\\beta$\n\n# %%\nx\t= 1\n")
    assert control_characters(clean) == []


# The site's MathJax (docs/hooks.py) ships no TeX web fonts. Letters from the script,
# calligraphic, double-struck and fraktur alphabets make it request one (MathJax_Script,
# MathJax_AMS, ...), which 404s; `make browser-check` fails on the console error (as CI did
# on notebook 8's \mathcal{N}). Caught here, in `make test`, before the browser runs.
UNSHIPPED_FONT = re.compile(r"\\(?:mathcal|mathscr|mathbb|mathfrak|Bbb)\b")
PAGES = NOTEBOOKS + sorted((Path(__file__).parent.parent / "docs").rglob("*.md"))


def unshipped_font_math(path: Path) -> list[str]:
    """Math commands in a page (an .ipynb, its cells and outputs, or a Markdown file) that
    need a font the site does not serve, each with a little context."""
    text = path.read_text()
    if path.suffix == ".ipynb":  # JSON doubles the backslashes: read the strings back
        nb = json.loads(text)
        parts = ["".join(c["source"]) for c in nb["cells"]]
        for c in nb["cells"]:
            for o in c.get("outputs", []):
                parts += [
                    "".join(v) if isinstance(v, list) else str(v)
                    for v in o.get("data", {}).values()
                ]
        text = "\n".join(parts)
    return [text[max(0, m.start() - 15) : m.end() + 5] for m in UNSHIPPED_FONT.finditer(text)]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_math_uses_only_the_fonts_the_site_serves(path):
    found = unshipped_font_math(path)
    assert not found, (
        f"{path.name}: {found} need a MathJax web font the site does not serve; "
        "use a plain letter, \\mathrm or \\mathbf"
    )


def test_unshipped_font_math_is_caught(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("the numerator $\\mathcal{N} = \\sum_i w_i o_i$ and $\\mathbf{R}$")
    assert unshipped_font_math(page) == ["the numerator $\\mathcal{N} ="]
    nb = tmp_path / "x.ipynb"
    output = {"output_type": "execute_result", "data": {"text/latex": ["$\\mathbb{E}$"]}}
    cell = {"cell_type": "code", "source": [], "outputs": [output], "metadata": {}}
    nb.write_text(json.dumps({"cells": [cell]}))
    assert len(unshipped_font_math(nb)) == 1


# Python's own exponent format (two exponent digits: 2.95e-07) for a number below 10^-5 is
# how a rounding residue looks when a cell prints it by accident, and such digits differ
# between CPUs. A committed output prints the bound it asserted or a constant, written with
# `course.printing.sci` / `power_of_ten` (2.95·10^-7, 10^-7). Outputs that nbval ignores
# (timings, a live cluster run) are not committed claims and are skipped.
TINY_PRINTED = re.compile(r"(?<![\w.])\d(?:\.\d+)?e-(?:0[6-9]|[1-9]\d)\b")


def tiny_numbers_printed(path: Path) -> list[str]:
    """Numbers below 10^-5 in Python's exponent format in a notebook's checked outputs,
    each as 'cell N: number'."""
    found = []
    for i, c in enumerate(json.loads(path.read_text())["cells"]):
        if c["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in "".join(c["source"]):
            continue
        for o in c.get("outputs", []):
            texts = [o.get("text", ""), *o.get("data", {}).values()]
            text = "".join("".join(t) if isinstance(t, list) else str(t) for t in texts)
            found += [f"cell {i}: {m.group()}" for m in TINY_PRINTED.finditer(text)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_print_bounds_not_rounding_digits(path):
    found = tiny_numbers_printed(path)
    assert not found, (
        f"{path.name}: {found} print a number below 1e-5 as Python formats it; assert a "
        "bound and print it with course.printing.sci or power_of_ten"
    )


def test_tiny_numbers_printed_are_caught(tmp_path):
    def nb(source: str, text: str) -> Path:
        out = {"output_type": "stream", "name": "stdout", "text": [text]}
        cell = {"cell_type": "code", "source": [source], "outputs": [out], "metadata": {}}
        (path := tmp_path / "x.ipynb").write_text(json.dumps({"cells": [cell]}))
        return path

    assert tiny_numbers_printed(nb("print(err)", "error 8.3e-08, 1e-14 and 4.4e-06")) == [
        "cell 0: 8.3e-08",
        "cell 0: 1e-14",
        "cell 0: 4.4e-06",
    ]
    kept = "2.95·10^-7, 10^-14, 1.5e-05, 3.0e+38, tolerance 1e-5, width 2e-3, x1e-08"
    assert tiny_numbers_printed(nb("print(bound)", kept)) == []
    assert tiny_numbers_printed(nb("# NBVAL_IGNORE_OUTPUT\nprint(t)", "took 8.3e-08 s")) == []


def test_nbval_gives_most_kernels_the_cheap_compilation(monkeypatch):
    """notebooks/conftest.py's hook sets a notebook kernel's `XLA_FLAGS` to the base flags
    plus `TAE_NBVAL_XLA_FLAGS`, unless `TAE_NBVAL_DEFAULT_COMPILE` names the notebook, and
    does nothing without the variable; the Makefile's nbval recipe sets both, naming
    notebooks that exist."""
    import importlib.util
    from types import SimpleNamespace

    root = NOTEBOOKS[0].parent.parent
    spec = importlib.util.spec_from_file_location("nbval_lanes", root / "notebooks" / "conftest.py")
    lanes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lanes)
    monkeypatch.setattr(lanes, "BASE_XLA_FLAGS", "--base=1")

    def kernel_flags(name):
        monkeypatch.setenv("XLA_FLAGS", "--stale=1")  # what the previous notebook left
        lanes.pytest_runtest_setup(SimpleNamespace(path=Path("notebooks") / name))
        return os.environ.get("XLA_FLAGS")

    monkeypatch.delenv("TAE_NBVAL_XLA_FLAGS", raising=False)
    assert kernel_flags("01_y.ipynb") == "--stale=1"  # a plain `pytest --nbval`: untouched
    monkeypatch.setenv("TAE_NBVAL_XLA_FLAGS", " --a=0 --b=false ")
    monkeypatch.setenv("TAE_NBVAL_DEFAULT_COMPILE", "07_x.ipynb 6.ipynb")
    assert kernel_flags("01_y.ipynb") == "--base=1 --a=0 --b=false"
    assert kernel_flags("07_x.ipynb") == "--base=1"
    assert kernel_flags("test_x.py") == "--stale=1"  # not a notebook
    monkeypatch.setattr(lanes, "BASE_XLA_FLAGS", "")
    assert kernel_flags("07_x.ipynb") is None  # no flags at all: unset, not ""
    assert lanes.pytest_runtest_setup.pytest_impl["tryfirst"]  # before the kernel starts

    makefile = (root / "Makefile").read_text()
    named = nbval_default_compile(makefile)
    assert named and all((root / "notebooks" / name).is_file() for name in named), named
    recipe = makefile.splitlines()[makefile.splitlines().index("nbval: $(STAMP) $(MODEL)") + 1]
    assert "$(NBVAL_LANES)" in recipe and "--nbval" in recipe, recipe


def nbval_default_compile(makefile: str) -> list[str]:
    """The notebooks the Makefile's nbval lane leaves at XLA's default compilation."""
    found = re.search(r'TAE_NBVAL_DEFAULT_COMPILE="([^"]*)"', makefile)
    return found.group(1).replace("\\", " ").split() if found else []


# A notebook asserting that two compiled programs give the same bits says so in these words.
SAME_BITS = re.compile(r"bit for bit|bitwise", re.I)
# Such a notebook runs under nbval with the cheap compilation only if a `codegen` test checks
# its claim with XLA's defaults, as users compile (FMA contraction can make bits that agree at
# -O0 differ there): notebook -> (test file, test).
SAME_BITS_CHECKED_BY = {
    "03_associativity_and_trees.ipynb": ("test_states.py", "test_combine_commutative_exactly"),
    "08_which_merge_when.ipynb": (
        "test_patterns.py",
        "test_one_pass_falls_back_exactly_past_its_window",
    ),
}


def test_notebooks_claiming_the_same_bits_are_checked_as_users_compile():
    """Each notebook whose source `SAME_BITS` matches keeps XLA's defaults under nbval, or
    names a `codegen` test of its claim, which exists and is marked so."""
    root = NOTEBOOKS[0].parent.parent
    claiming = {p.name for p in NOTEBOOKS if SAME_BITS.search(p.with_suffix(".py").read_text())}
    assert set(SAME_BITS_CHECKED_BY) <= claiming  # no stale entry
    default = set(nbval_default_compile((root / "Makefile").read_text()))
    assert claiming <= default | set(SAME_BITS_CHECKED_BY), claiming - default
    for notebook, (path, name) in SAME_BITS_CHECKED_BY.items():
        tree = ast.parse((root / "tests" / path).read_text())
        test = next((f for f in tree.body if getattr(f, "name", None) == name), None)
        assert test is not None, (notebook, path, name)
        marks = [ast.unparse(d) for d in test.decorator_list]
        assert "pytest.mark.codegen" in marks, (notebook, name, marks)

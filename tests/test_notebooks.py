"""Notebook hygiene: sources and notebooks in sync, executed, no errors, normalised kernel.

nbval (run by `make test`) checks that the committed outputs reproduce; this checks that what
nbval runs is what the reviewed jupytext sources say.
"""

import json
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

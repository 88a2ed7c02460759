"""Packaging: one version, licence and citation consistent with the metadata, what the sdist
and the wheel carry, pinned extras, and no private JAX API. Reads files only; builds nothing."""

import ast
import importlib.metadata
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
import yaml

import tree_attention_edu as tae
from tree_attention_edu.core import kernels

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tree_attention_edu"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
AUTHORS = ["Shyam", "Pilault", "Shepperd", "Anthony", "Millidge"]


def requirement_name(req: str) -> str:
    """`jax[cuda12]>=0.8.3` -> `jax`, normalised as pip does."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req).group()).lower()


def pinned(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {requirement_name(n): v for n, v in (line.split("==") for line in lines if line)}


# --- one version --------------------------------------------------------------------------


def test_version_is_defined_once():
    version = PROJECT["version"]
    assert tae.__version__ == version
    installed = importlib.metadata.version("tree_attention_edu")
    assert installed == version, "stale metadata: pip install -e ."
    literals = [
        p for p in PACKAGE.glob("*.py") if re.search(r"__version__\s*=\s*['\"]", p.read_text())
    ]
    assert not literals, f"version literal in {literals}; it lives in pyproject.toml only"
    assert yaml.safe_load((ROOT / "CITATION.cff").read_text())["version"] == version


# --- licence and citation -----------------------------------------------------------------


def test_license_matches_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 The tree_attention_edu authors" in text
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"]), (
        "an SPDX `license` excludes License classifiers"
    )
    # The SPDX string and license-files need setuptools >= 77.
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if "setuptools" in r]
    assert setuptools == "setuptools>=77"


def test_citation_cites_the_package_and_the_paper():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["license"] == PROJECT["license"]
    paper = cff["preferred-citation"]
    assert paper["title"] == (
        "Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU clusters"
    )
    assert [a["family-names"] for a in paper["authors"]] == AUTHORS
    assert paper["year"] == 2024 and paper["url"] == "https://arxiv.org/abs/2408.04093"
    assert PROJECT["urls"]["Paper"] == paper["url"]


# --- what the sdist and the wheel carry ---------------------------------------------------


def test_sdist_carries_what_the_tests_read():
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    # tests/ whole (conftest.py and reference.py, which the test modules import), and the
    # notebooks that test_notebooks.py reads.
    assert {"graft tests", "graft notebooks", "include CITATION.cff", "include Makefile"} <= set(
        manifest
    )
    imported = {
        node.names[0].name if isinstance(node, ast.Import) else node.module
        for path in (ROOT / "tests").glob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    assert {"conftest", "reference"} <= imported
    assert (ROOT / "tests" / "conftest.py").exists() and (ROOT / "tests" / "reference.py").exists()


def test_wheel_carries_py_typed():
    assert (PACKAGE / "py.typed").exists()
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["tree_attention_edu"] == ["py.typed"]


# --- extras and locks ---------------------------------------------------------------------


def test_notebooks_extra_has_no_developer_tools():
    extras = PROJECT["optional-dependencies"]
    names = {requirement_name(r) for r in extras["notebooks"]}
    assert {"jupyterlab", "ipykernel"} <= names
    assert not names & {"selenium", "mkdocs", "mkdocs-material", "ruff", "pytest", "nbval"}
    assert "tree_attention_edu[notebooks]" in extras["dev"]


def test_lock_pins_everything_make_installs():
    lock = pinned(ROOT / "requirements-lock.txt")
    extras = PROJECT["optional-dependencies"]
    wanted = {
        requirement_name(r) for r in PROJECT["dependencies"] + extras["notebooks"] + extras["dev"]
    } - {"tree-attention-edu"}
    assert wanted <= lock.keys(), f"not pinned: {sorted(wanted - lock.keys())}"
    assert lock["jax"] == lock["jaxlib"]


def test_cuda_lock_pins_the_nvidia_wheels():
    cuda = pinned(ROOT / "requirements-cuda-lock.txt")
    lock = pinned(ROOT / "requirements-lock.txt")
    assert any(n.startswith("nvidia-") for n in cuda)
    assert cuda["jax-cuda12-plugin"] == cuda["jax-cuda12-pjrt"] == lock["jax"]
    clashes = {n for n in cuda.keys() & lock.keys() if cuda[n] != lock[n]}
    assert not clashes, f"the two locks disagree on {sorted(clashes)}"


# --- private APIs -------------------------------------------------------------------------


def test_no_private_jax_api():
    for path in PACKAGE.glob("*.py"):
        assert "jax._src" not in path.read_text(), f"{path.name} uses jax._src"


@pytest.fixture
def fake_flash(monkeypatch):
    """A stand-in flash_attn_jax package, installed as release `version`."""

    def install(version, *, private_name=True):
        flash = types.ModuleType(kernels.flash.MODULE)
        if private_name:
            setattr(flash, kernels.flash.FORWARD, lambda *a, **k: None)
        monkeypatch.setitem(sys.modules, "flash_attn_jax", types.ModuleType("flash_attn_jax"))
        monkeypatch.setitem(sys.modules, kernels.flash.MODULE, flash)
        real = importlib.metadata.version

        def version_of(name):
            return version if name == "flash-attn-jax" else real(name)

        monkeypatch.setattr(importlib.metadata, "version", version_of)
        monkeypatch.setattr(kernels.flash.importlib.util, "find_spec", lambda name: object())

    return install


def test_flash_rejects_an_untested_release(fake_flash):
    import jax.numpy as jnp

    fake_flash("0.7.0")
    reason = kernels.flash.unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu")
    assert "tested with flash-attn-jax 0.6.x" in reason and "0.7.0 is installed" in reason
    q = jnp.zeros((1, 1, 2, 8), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"0\.7\.0 is installed"):
        kernels.flash_state(q, q, q)


def test_flash_private_name_missing_is_a_clear_error(fake_flash):
    import jax.numpy as jnp

    fake_flash("0.6.2", private_name=False)
    assert kernels.flash.unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu") is None
    q = jnp.zeros((1, 1, 2, 8), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"has no such name.*local_kernel='xla'"):
        kernels.flash_state(q, q, q)


def test_flash_installed_but_not_importable_is_refused(fake_flash, monkeypatch):
    """The second GPU lease: flash-attn-jax 0.6.2 installed beside JAX's CUDA 13 failed to
    import (`libcudart.so.12`), yet `available()` said True, so "auto" would have picked it."""
    import jax.numpy as jnp

    fake_flash("0.6.2")
    real = importlib.import_module

    def import_module(name, *args, **kw):
        if name == "flash_attn_jax":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return real(name, *args, **kw)

    monkeypatch.setattr(kernels.flash.importlib, "import_module", import_module)
    reason = kernels.flash.unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu")
    assert "installed but cannot be imported" in reason and "libcudart.so.12" in reason
    q = jnp.zeros((1, 1, 2, 8), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="libcudart"):
        kernels.flash_state(q, q, q)

    # A copy without package metadata (a source tree on sys.path) is imported all the same.
    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    reason = kernels.flash.unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu")
    assert "installed but cannot be imported" in reason

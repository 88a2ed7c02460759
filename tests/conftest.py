"""Test session setup: 8 simulated CPU devices and float64, before JAX initialises.

With `TAE_TESTS_ON_ACCELERATOR=1` the suite runs on the default backend (a GPU) instead, and
what needs the simulated devices is skipped, saying so: the fixtures `mesh8` and `mesh2x4`,
tests marked `cpu_only`, and any test whose mesh asks for more devices than JAX sees
(`make_mesh`'s ValueError). The command is in `results/gpu/README.md`.
"""

import os
import re
from pathlib import Path

# Most of this suite's time is XLA compiling (about 80% of a test file's time on 2 cores:
# tests/test_patterns.py takes 100 s, 18 s once its programs are cached). Many tests, the
# two xdist workers and the command-line tests' subprocesses compile the same programs, so
# they share JAX's persistent compilation cache, keyed by the program, the JAX and XLA
# versions, the flags and the devices: a stale entry is never used. It lives in the
# checkout's .cache/ (make clean removes it); set JAX_COMPILATION_CACHE_DIR to move it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "jax-tests")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tree_attention_edu as tae

ON_ACCELERATOR = os.environ.get("TAE_TESTS_ON_ACCELERATOR") == "1"
NEEDS_DEVICES = "needs the CPU backend and its simulated devices (TAE_TESTS_ON_ACCELERATOR=1)"
if not ON_ACCELERATOR:
    tae.simulate_devices(8)
jax.config.update("jax_enable_x64", True)

# Derandomised in CI so that a failure reproduces; random locally to explore more.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tolerances by dtype, for outputs of size O(1) compared with a float64 reference computed
# from the *same rounded inputs*:
# - float64: only summation-order rounding, ~ Tk·eps64 ≈ 1e-14;
# - float32: accumulation in float32, ~ Tk·eps32 ≈ 1e-5 for Tk up to ~100;
# - bfloat16: inputs are exact in the reference, the result is rounded to bf16 once
#   (relative 2^-8 ≈ 4e-3 on values up to ~3), plus float32 accumulation.
TOL = {
    np.dtype("float64"): dict(rtol=1e-12, atol=1e-12),
    np.dtype("float32"): dict(rtol=2e-5, atol=2e-5),
    np.dtype(jax.numpy.bfloat16): dict(rtol=1e-2, atol=1.6e-2),
}


def tol(dtype) -> dict:
    return TOL[np.dtype(dtype)]


def rand_qkv(seed, B=2, Tq=3, Hq=4, Hkv=2, D=8, Dv=6, Tk=17, dtype=jax.numpy.float64):
    """Unit-normal q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` from an
    explicit seed, drawn in float64 and rounded once to `dtype`.

    Drawn by NumPy, not `jax.random`: each new shape would compile `jax.random.normal` anew
    (about 2 s of XLA:CPU time in float64), two thirds of `tests/test_kernels.py`'s compile
    time before this changed."""
    rng = np.random.default_rng(seed)
    shapes = ((B, Tq, Hq, D), (B, Tk, Hkv, D), (B, Tk, Hkv, Dv))
    return tuple(jax.numpy.asarray(rng.standard_normal(s)).astype(dtype) for s in shapes)


@pytest.fixture(scope="session")
def mesh8():
    if ON_ACCELERATOR:
        pytest.skip(NEEDS_DEVICES)
    return tae.make_mesh(8, "x")


@pytest.fixture(scope="session")
def mesh2x4():
    if ON_ACCELERATOR:
        pytest.skip(NEEDS_DEVICES)
    return tae.make_mesh((2, 4), ("node", "gpu"))


# `make unit` compiles most tests cheaply: LLVM at -O0 (`--xla_backend_optimization_level=0`)
# and XLA:CPU's elemental emitters instead of its fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`), in about half the compile time. For the decoders
# the optimised programs are the same: tests/test_codegen_marks.py compiles decodes both ways
# and compares every instruction and its operands (the fusion emitters only wrap an op that
# fuses with nothing in a one-op fusion). Elsewhere the elemental emitters' pipeline lowers a
# few ops its own way (a scatter as a loop of dynamic slices, a copy as a bitcast), with the
# same values. What changes is the machine code, and with it the last bits: FMA
# contraction, the order inside a reduction, the math library's exp, log, tanh and rsqrt
# (1 to 8 units in the last place). Tests marked `codegen` compare bits across programs or
# hold a bound of a few roundings, and run with XLA's defaults, as users compile.
LOW_OPT_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
LOW_OPT = re.compile(
    r"--xla_backend_optimization_level=[0-2]\b|--xla_cpu_use_fusion_emitters=(?i:false|0)\b"
)


# `make unit` hands whole files to its workers (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`). xdist's own order, most tests first, puts these last: few tests
# that each decode a real model, start processes or build a cluster (tens of seconds a
# file). Started last, one of them kept a worker busy long after the other had finished;
# started first, the many short files fill in around them.
HEAVY_FIRST = (
    "test_smollm2.py",
    "test_cluster.py",
    "test_launch.py",
    "test_student_release.py",
    "test_docs_examples.py",
    "test_model.py",
)


def schedule_order(items: list) -> list:
    """`items` with `HEAVY_FIRST`'s files first, in that order, then the other files by
    their number of tests, most first (xdist's order), each file's tests kept together and
    in order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    heavy = [name for name in HEAVY_FIRST if name in files]
    rest = sorted((n for n in files if n not in HEAVY_FIRST), key=lambda n: -len(files[n]))
    return [item for name in heavy + rest for item in files[name]]


@pytest.hookimpl(trylast=True)  # after -m deselects: files ordered by the tests that run
def pytest_collection_modifyitems(config, items):
    if ON_ACCELERATOR:
        for item in items:
            if item.get_closest_marker("cpu_only"):
                item.add_marker(pytest.mark.skip(reason=NEEDS_DEVICES))
    items[:] = schedule_order(items)


def pytest_runtest_setup(item):
    """A `codegen` test selected under `LOW_OPT`'s flags fails at once, naming the fix (per test: a
    collection error in an xdist worker would crash the run without its message)."""
    if item.get_closest_marker("codegen") and LOW_OPT.search(os.environ.get("XLA_FLAGS", "")):
        pytest.fail(
            "marked `codegen`: must run with XLA's default code generation; deselect it "
            "with -m 'not codegen' under --xla_backend_optimization_level=0 or "
            "--xla_cpu_use_fusion_emitters=false, or drop the flags (`make unit` does both)",
            pytrace=False,
        )


# The package's two messages for "JAX sees fewer devices than asked for" (make_mesh,
# simulate_devices), in the exception's own text (a test of a subprocess puts the process's
# stderr there; CLI tests run in-process are marked `cpu_only` instead).
_TOO_FEW = re.compile(
    r"needs \d+ devices but JAX sees \d+|JAX is already initialised with \d+ "
    r"\w+ device\(s\), fewer than the \d+ requested"
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On an accelerator, a test that failed because it asked for more devices than JAX
    sees is reported as skipped (the package's exact messages, nothing broader)."""
    report = yield
    if (
        ON_ACCELERATOR
        and report.failed
        and call.excinfo is not None
        and _TOO_FEW.search(str(call.excinfo.value))
    ):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {NEEDS_DEVICES}")
    return report


def padded(decoder):
    """`decoder`, with the cache padded once to a multiple of the sequence devices
    (`tae.pad_cache`) where they do not divide it: the decoders themselves never pad."""
    from tree_attention_edu.core import devices, inputs

    def run(q, k, v, *, mesh, seq_axes=None, layout="bthd", kv_lengths=None, **kw):
        p = devices.axis_size(mesh, devices.check_seq_axes(seq_axes, mesh))
        tk = k.shape[inputs.SEQ_AXIS[layout]]
        if tk % p:
            k, v, kv_lengths = tae.pad_cache(k, v, p, kv_lengths=kv_lengths, layout=layout)
        return decoder(
            q, k, v, mesh=mesh, seq_axes=seq_axes, layout=layout, kv_lengths=kv_lengths, **kw
        )

    run.__name__ = decoder.__name__
    return run

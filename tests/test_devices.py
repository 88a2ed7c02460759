"""simulate_devices with JAX's public API only, in fresh processes (the device count is fixed
once JAX starts, and this test session has already started it with 8)."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import tree_attention_edu as tae

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )


@pytest.mark.cpu_only
def test_simulate_devices_before_and_after_jax_starts():
    r = run_python("""
        import tree_attention_edu as tae
        tae.simulate_devices(4)            # before JAX starts: takes effect
        import jax
        assert jax.device_count() == 4, jax.device_count()
        tae.simulate_devices(4)            # after: the same count is a no-op
        tae.simulate_devices(2)            # after: fewer than JAX has is a no-op
        try:
            tae.simulate_devices(8)        # after: more than JAX has cannot happen
        except RuntimeError as e:
            print(e)
        else:
            raise AssertionError("no error")
        assert jax.device_count() == 4
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already initialised with 4 cpu device(s), fewer than the 8 requested" in r.stdout
    assert "simulate_devices(8)` before any JAX computation" in r.stdout


def test_simulate_devices_after_jax_started_by_default():
    r = run_python("""
        import jax
        assert jax.device_count() == 1     # JAX started on its own, one CPU device
        import tree_attention_edu as tae
        tae.simulate_devices(1)
        try:
            tae.simulate_devices(2)
        except RuntimeError as e:
            print(e)
        else:
            raise AssertionError("no error")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fewer than the 2 requested" in r.stdout


@pytest.mark.cpu_only
def test_simulate_devices_in_this_session_is_a_no_op():
    assert jax.device_count() == 8  # conftest asked for 8; this starts JAX if nothing has
    tae.simulate_devices(8)
    with pytest.raises(RuntimeError, match="fewer than the 9 requested"):
        tae.simulate_devices(9)


@pytest.mark.parametrize(
    ("n", "error", "message"),
    [
        (0, ValueError, "`n` must be a positive int"),
        (-1, ValueError, "`n` must be a positive int"),
        (2.0, TypeError, "`n` must be an int"),
        ("8", TypeError, "`n` must be an int"),
    ],
)
def test_simulate_devices_rejects_non_counts(n, error, message):
    with pytest.raises(error, match=message):
        tae.simulate_devices(n)

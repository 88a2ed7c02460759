"""Associative memory: sharded retrieval equals single-device, and retrieval is a Hopfield step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_attention_edu.theory import hopfield as hf


@pytest.mark.codegen
def test_sharded_retrieval_is_identical(mesh8):
    sizes, betas = (13, 200), (2.0, 32.0)  # 13 patterns: not divisible by 8 devices
    one = hf.accuracy_grid(jax.random.key(0), sizes, betas, queries=16)
    many = hf.accuracy_grid(jax.random.key(0), sizes, betas, queries=16, mesh=mesh8)
    np.testing.assert_array_equal(one, many)
    mem = hf.make_memory(jax.random.key(1), 200, 64)
    idx = jnp.arange(20)
    q = hf.noisy_queries(jax.random.key(2), mem, idx, 0.2)
    a, b = hf.retrieve(q, mem, 16.0), hf.retrieve(q, mem, 16.0, mesh=mesh8)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(hf.retrieved(a, mem, idx), hf.retrieved(b, mem, idx))


def test_retrieval_depends_on_load_and_temperature():
    grid = hf.accuracy_grid(jax.random.key(0), (16, 4096), (1.0, 64.0), queries=32)
    assert grid[0, 1] == 1.0  # few patterns, sharp softmax: everything retrieved
    assert grid[1, 0] == 0.0  # many patterns, flat softmax: the readout is a blur
    assert grid[1, 1] < grid[0, 1] or grid[1, 1] == 1.0


def test_retrieval_is_one_gradient_step_on_the_energy():
    mem = hf.make_memory(jax.random.key(3), 50, 32)
    xi = hf.noisy_queries(jax.random.key(4), mem, jnp.arange(4), 0.25)
    auto = hf.Memory(mem.keys, mem.keys)  # values = keys: auto-associative
    step = jax.vmap(lambda x: hf.hopfield_step(x, mem.keys, 8.0))(xi)
    np.testing.assert_allclose(step, hf.retrieve(xi, auto, 8.0), rtol=0, atol=1e-5)


def test_bad_arguments():
    mem = hf.make_memory(jax.random.key(0), 4, 8)
    with pytest.raises(ValueError, match=r"`flip` must be in \[0, 0.5\]"):
        hf.noisy_queries(jax.random.key(0), mem, jnp.arange(2), 0.7)
    with pytest.raises(ValueError, match="`num_patterns` must be a positive int"):
        hf.make_memory(jax.random.key(0), 0, 8)


@pytest.mark.parametrize("bad", [4, 100, -1])
def test_out_of_range_indices_read_nan(bad):
    """Index 4 of 4 patterns once read pattern 3 (JAX clamps). An index is a value, not
    inspected (that would differ under `jit`): it reads NaN instead, eagerly and under
    `jit`, so it can never pass as a retrieval."""
    mem = hf.make_memory(jax.random.key(0), 4, 8)
    idx = jnp.array([0, bad])
    for noisy in (hf.noisy_queries, jax.jit(hf.noisy_queries, static_argnums=3)):
        out = np.asarray(noisy(jax.random.key(1), mem, idx, 0.1))
        assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    perfect = mem.values[jnp.array([0, 0])]  # even a readout equal to a stored value
    assert hf.retrieved(perfect, mem, idx).tolist() == [True, False]


def test_bad_beta_is_reported_as_beta():
    """`beta` reached attention as `scale`; the message must name `beta`."""
    mem = hf.make_memory(jax.random.key(0), 4, 8)
    q = mem.keys[:2]
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="`beta` must be"):
            hf.retrieve(q, mem, bad)
    with pytest.raises(TypeError, match="`beta` must be a real number"):
        hf.retrieve(q, mem, "8")
    with pytest.raises(TypeError, match="`beta` is a traced value"):
        jax.jit(lambda b: hf.retrieve(q, mem, b))(8.0)
    with pytest.raises(ValueError, match="`beta` must be > 0"):
        hf.hopfield_step(q[0], mem.keys, 0.0)


def test_bad_shapes_and_types_name_the_argument():
    mem = hf.make_memory(jax.random.key(0), 4, 8, value_dim=6)
    assert mem.values.shape == (4, 6)
    with pytest.raises(ValueError, match="`value_dim` must be a positive int, got 0"):
        hf.make_memory(jax.random.key(0), 4, 8, value_dim=0)  # was silently `dim`
    with pytest.raises(ValueError, match=r"`queries` must have shape \[Q, D\] = \(2, 8\)"):
        hf.retrieve(jnp.ones((2, 5)), mem, 8.0)
    with pytest.raises(TypeError, match="`memory` must be a Memory"):
        hf.retrieve(jnp.ones((2, 8)), (mem.keys, mem.values), 8.0)
    with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
        hf.accuracy_grid(0, (16,), (1.0,))
    with pytest.raises(ValueError, match=r"`sizes\[1\]` must be a positive int"):
        hf.accuracy_grid(jax.random.key(0), (16, 0), (1.0,))


def _patterns(seed, m, d):
    """`m` distinct ±1 patterns of dimension `d` (float32), from numpy."""
    x = np.sign(np.random.default_rng(seed).standard_normal((m, d))).astype(np.float32)
    assert len({tuple(r) for r in x}) == m  # distinct: no ties in the softmax
    return x


@pytest.mark.codegen
def test_beta_up_to_the_float32_maximum_retrieves_exactly(mesh8):
    """Scores of ±1 patterns are at most beta: at float32's largest beta the readout of a
    clean key is exactly its value (one-hot softmax), on one device and sharded; above it
    beta is refused (the scores would overflow to inf and the readout be NaN)."""
    mem = hf.Memory(_patterns(0, 8, 16), _patterns(1, 8, 16))
    top = float(np.finfo(np.float32).max)
    for mesh in (None, mesh8):
        np.testing.assert_array_equal(hf.retrieve(mem.keys, mem, top, mesh=mesh), mem.values)
    with pytest.raises(ValueError, match="`beta` = 1e\\+39 overflows float32"):
        hf.retrieve(mem.keys, mem, 1e39)


@pytest.mark.codegen
def test_energy_is_the_same_eagerly_and_under_jit_with_a_static_beta():
    """beta is concrete in both (a traced one is refused), and the values agree with a
    float64 numpy reference of -(1/s) log Σ exp(s x·ξ) + ½ ξ·ξ, s = beta / D."""
    keys = _patterns(2, 8, 16)
    xi = keys[0] * np.where(np.arange(16) < 4, -1, 1).astype(np.float32)  # 4 signs flipped
    x, q = keys.astype(np.float64), xi.astype(np.float64)
    s = 4.0 / 16
    scores = s * x @ q
    want = -(scores.max() + np.log(np.exp(scores - scores.max()).sum())) / s + 0.5 * q @ q
    eager = hf.hopfield_energy(xi, keys, 4.0)
    jitted = jax.jit(hf.hopfield_energy, static_argnames="beta")(xi, keys, beta=4.0)
    assert float(eager) == float(jitted)
    np.testing.assert_allclose(float(eager), want, rtol=1e-6)

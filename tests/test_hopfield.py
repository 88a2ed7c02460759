"""Associative memory: sharded retrieval equals single-device, and retrieval is a Hopfield step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_attention_edu import hopfield as hf


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
    with pytest.raises(ValueError, match="`flip` must be in"):
        hf.noisy_queries(jax.random.key(0), mem, jnp.arange(2), 0.7)
    with pytest.raises(ValueError, match="`num_patterns` must be a positive int"):
        hf.make_memory(jax.random.key(0), 0, 8)

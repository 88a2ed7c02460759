"""Attention as an associative memory: store key→value patterns, retrieve from noisy keys.

A memory of `M` patterns is a pair of ±1 matrices, keys `X [M, D]` and values `Y [M, Dv]`.
A query is a stored key with a fraction `flip` of its signs flipped. Reading the memory is one
attention step with inverse temperature `beta` on the normalised overlap:

    out = softmax(beta · X ξ / D)ᵀ Y,

and a query counts as retrieved when `sign(out)` equals its pattern's value exactly.

This is the modern Hopfield network (Ramsauer et al., "Hopfield Networks is All You Need",
2020). With `s = beta / D` its energy is

    E(ξ) = -(1/s) log Σ_a exp(s x_a·ξ) + ½ ξ·ξ,

whose first term is (-1/s times) the package's energy `F` at ζ = 0: the log-partition of
the attention weights. Its gradient is `ξ - Xᵀ softmax(s X ξ)`, so one gradient step of size
1 from the query lands on `Xᵀ softmax(s X ξ)`: auto-associative retrieval (`Y = X`) *is*
attention, and a gradient step on the energy (`hopfield_step`, checked against `jax.grad`).

A memory too large for one device is sharded along `M` and read with `tree_decode`, which
returns the same answer as one device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from . import _checks
from .attention import attention
from .decode import tree_decode


class Memory(NamedTuple):
    """`keys [M, D]` and `values [M, Dv]`, entries ±1 (float32)."""

    keys: Array
    values: Array


def make_memory(key: Array, num_patterns: int, dim: int, value_dim: int | None = None
                ) -> Memory:
    """`num_patterns` random ±1 key and value patterns from `key`."""
    _checks.check_positive(num_patterns, "num_patterns")
    _checks.check_positive(dim, "dim")
    kk, kv = jax.random.split(key)
    shape_v = (num_patterns, value_dim or dim)
    return Memory(jax.random.rademacher(kk, (num_patterns, dim), jnp.float32),
                  jax.random.rademacher(kv, shape_v, jnp.float32))


def noisy_queries(key: Array, memory: Memory, indices: Array, flip: float) -> Array:
    """Stored keys `memory.keys[indices]` with a random fraction `flip` of signs flipped."""
    if not 0.0 <= flip <= 0.5:
        raise ValueError(f"`flip` must be in [0, 0.5] (0.5 erases the key), got {flip}.")
    clean = memory.keys[indices]
    flips = jax.random.bernoulli(key, flip, clean.shape)
    return jnp.where(flips, -clean, clean)


def retrieve(queries: Array, memory: Memory, beta: float, *, mesh: Mesh | None = None
             ) -> Array:
    """Read the memory: `softmax(beta · X ξ / D)ᵀ Y` for each query `[Q, D]` -> `[Q, Dv]`.

    With `mesh`, the patterns are sharded along `M` over the mesh and combined by
    `tree_decode` (a pattern count not divisible by the devices is padded and masked).
    """
    q = queries[None, :, None, :]  # [1, Q, 1, D]: one sequence, Q queries, one head
    k, v = memory.keys[None, :, None, :], memory.values[None, :, None, :]
    scale = float(beta) / memory.keys.shape[1]
    if mesh is None:
        out = attention(q, k, v, scale=scale)
    else:
        out = tree_decode(q, k, v, mesh=mesh, scale=scale, local_kernel="xla")
    return out[0, :, 0]


def retrieved(out: Array, memory: Memory, indices: Array) -> Array:
    """`[Q]` bools: is `sign(out)` exactly the stored value of each query's pattern?"""
    return jnp.all(jnp.sign(out) == memory.values[indices], axis=-1)


def hopfield_energy(xi: Array, keys: Array, beta: float) -> Array:
    """Modern Hopfield energy `-(1/s) logsumexp(s X ξ) + ½ ξ·ξ`, `s = beta / D`, of one
    state `xi [D]`."""
    s = beta / keys.shape[1]
    return -jax.nn.logsumexp(s * keys @ xi) / s + 0.5 * xi @ xi


def hopfield_step(xi: Array, keys: Array, beta: float) -> Array:
    """One gradient step of size 1 on `hopfield_energy`: `ξ - ∇E(ξ) = Xᵀ softmax(s X ξ)`."""
    return xi - jax.grad(hopfield_energy)(xi, keys, beta)


def accuracy_grid(key: Array, sizes, betas, *, dim: int = 64, flip: float = 0.2,
                  queries: int = 64, mesh: Mesh | None = None) -> np.ndarray:
    """Fraction of `queries` noisy keys retrieved exactly, `[len(sizes), len(betas)]`.

    The same memories and queries (from `key`) are used for every `beta`.
    """
    grid = np.zeros((len(sizes), len(betas)))
    for i, m in enumerate(sizes):
        km, ki, kq = jax.random.split(jax.random.fold_in(key, int(m)), 3)
        mem = make_memory(km, int(m), dim)
        idx = jax.random.randint(ki, (queries,), 0, int(m))
        q = noisy_queries(kq, mem, idx, flip)
        for j, beta in enumerate(betas):
            grid[i, j] = float(jnp.mean(retrieved(retrieve(q, mem, beta, mesh=mesh), mem, idx)))
    return grid

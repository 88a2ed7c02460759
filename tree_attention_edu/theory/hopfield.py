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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from ..core import validate
from ..core.decode import tree_decode
from ..core.devices import pad_cache
from ..core.numerics import PRECISION, accum_dtype
from ..core.reference import attention


class Memory(NamedTuple):
    """`keys [M, D]` and `values [M, Dv]`, entries ±1 (float32)."""

    keys: Array
    values: Array


_MEMORY_HINT = "build one with make_memory(key, num_patterns, dim) or Memory(keys, values)"


def _check_memory(memory: Memory) -> tuple[int, int, int]:
    """`(M, D, Dv)` of a valid memory."""
    validate.check_instance(memory, Memory, "memory", _MEMORY_HINT)
    m, d = validate.check_array(memory.keys, "memory.keys", rank=2, layout="[M, D]", kind="float")
    mv, dv = validate.check_array(
        memory.values, "memory.values", rank=2, layout="[M, Dv]", kind="float"
    )
    validate.check_shape(
        (mv, dv), (m, dv), "memory.values", "[M, Dv]", "one value pattern per key pattern"
    )
    validate.check_no_empty_axis((m, d), "memory.keys", "[M, D]")
    return m, d, dv


def _check_indices(indices: Array, m: int, name: str = "indices") -> int:
    """`indices [Q]` into `m` patterns; returns Q. Their values are not inspected (that would
    differ under `jax.jit`): an index outside `[0, m)` reads NaN (`_rows`), never another
    pattern, eagerly and under `jit` alike."""
    (q,) = validate.check_array(indices, name, rank=1, layout="[queries]", kind="int")
    return q


def _rows(patterns: Array, indices: Array) -> Array:
    """`patterns[indices]`, with NaN rows for indices outside `[0, M)` (JAX would clamp them
    to the nearest row: a wrong pattern that looks right)."""
    return (
        jnp.asarray(patterns)
        .at[indices]
        .get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
    )


def _check_beta(beta: float, *, name: str = "beta", dtype: Any = None) -> float:
    """A concrete `beta > 0` (a traced one is a TypeError: the check must not depend on
    `jit`); with `dtype`, at most the largest finite value of the dtype the scores are
    formed in, where the score `beta` of a ±1 pattern against itself still fits."""
    value = validate.check_real(
        beta, name, low=0.0, low_open=True, hint="beta is the inverse temperature, e.g. 8.0"
    )
    if dtype is not None and value > float(jnp.finfo(dtype).max):
        raise ValueError(
            f"`{name}` = {value:g} overflows {jnp.dtype(dtype).name} (largest "
            f"{float(jnp.finfo(dtype).max):.3g}), the dtype the scores beta·x·ξ/D are formed "
            f"in: a score becomes inf before the softmax subtracts its max, and the result "
            f"NaN. Use a smaller beta (the softmax is one-hot long before), or float64 "
            f"queries."
        )
    return value


def make_memory(key: Array, num_patterns: int, dim: int, value_dim: int | None = None) -> Memory:
    """`num_patterns` random ±1 key and value patterns from `key` (values of `value_dim`,
    default `dim`)."""
    validate.check_prng_key(key)
    validate.check_int(num_patterns, "num_patterns")
    validate.check_int(dim, "dim")
    if value_dim is not None:
        validate.check_int(value_dim, "value_dim")
    kk, kv = jax.random.split(key)
    shape_v = (num_patterns, dim if value_dim is None else value_dim)
    return Memory(
        jax.random.rademacher(kk, (num_patterns, dim), jnp.float32),
        jax.random.rademacher(kv, shape_v, jnp.float32),
    )


def noisy_queries(key: Array, memory: Memory, indices: Array, flip: float) -> Array:
    """Stored keys `memory.keys[indices]` with a random fraction `flip` of signs flipped.

    `indices [Q]` index the stored patterns, `[0, M)`; an index outside reads a pattern of
    NaN (never another pattern, whose retrieval would look like a success).
    """
    validate.check_prng_key(key)
    m, _, _ = _check_memory(memory)
    _check_indices(indices, m)
    flip = validate.check_real(
        flip, "flip", low=0.0, high=0.5, hint="the fraction of signs flipped; 0.5 erases the key"
    )
    clean = _rows(memory.keys, indices)
    flips = jax.random.bernoulli(key, flip, clean.shape)
    return jnp.where(flips, -clean, clean)


def retrieve(queries: Array, memory: Memory, beta: float, *, mesh: Mesh | None = None) -> Array:
    """Read the memory: `softmax(beta · X ξ / D)ᵀ Y` for each query `[Q, D]` -> `[Q, Dv]`.

    `beta > 0` is the inverse temperature, a concrete number. With `mesh`, the patterns are
    sharded along `M` over the mesh and combined by `tree_decode` (a pattern count that the
    devices do not divide is padded and masked, `pad_cache`).

    The scores `beta · x_a·ξ / D` are formed in the queries' accumulation dtype (float32
    unless they are float64) before the softmax subtracts their max, so they must stay
    inside its range: a score that overflows is inf, and inf - inf makes the readout NaN.
    For ±1 patterns and queries `|x_a·ξ| <= D`, so every score is at most `beta`, and
    `beta` up to the dtype's largest value (3.4e38 in float32) is safe; a larger one is
    refused. Queries with larger entries scale the bound down by their largest `|ξ_i|`.
    """
    _, d, _ = _check_memory(memory)
    nq, dq = validate.check_array(queries, "queries", rank=2, layout="[Q, D]", kind="float")
    validate.check_shape((nq, dq), (nq, d), "queries", "[Q, D]", "D is the memory's key dim")
    scale = _check_beta(beta, dtype=accum_dtype(queries.dtype)) / d
    if mesh is not None:
        validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...), or pass None")
    q = queries[None, :, None, :]  # [1, Q, 1, D]: one sequence, Q queries, one head
    k, v = memory.keys[None, :, None, :], memory.values[None, :, None, :]
    if mesh is None:
        out = attention(q, k, v, scale=scale)
    else:
        k, v, lengths = pad_cache(k, v, mesh)
        padded = k.shape[1] != memory.keys.shape[0]
        out = tree_decode(
            q,
            k,
            v,
            mesh=mesh,
            scale=scale,
            local_kernel="xla",
            kv_lengths=lengths if padded else None,
        )
    return out[0, :, 0]


def retrieved(out: Array, memory: Memory, indices: Array) -> Array:
    """`[Q]` bools: is `sign(out)` exactly the stored value of each query's pattern?"""
    m, _, dv = _check_memory(memory)
    q = _check_indices(indices, m)
    validate.check_shape(
        validate.check_array(out, "out", rank=2, layout="[Q, Dv]", kind="float"),
        (q, dv),
        "out",
        "[Q, Dv]",
        "one readout per index, as `retrieve` returns",
    )
    return jnp.all(jnp.sign(out) == _rows(memory.values, indices), axis=-1)


def _check_state(xi: Array, keys: Array) -> None:
    _, d = validate.check_array(keys, "keys", rank=2, layout="[M, D]", kind="float")
    validate.check_shape(
        validate.check_array(xi, "xi", rank=1, layout="[D]", kind="float"),
        (d,),
        "xi",
        "[D]",
        "one state of the keys' dim (vmap over a batch)",
    )


def hopfield_energy(xi: Array, keys: Array, beta: float) -> Array:
    """Modern Hopfield energy `-(1/s) logsumexp(s X ξ) + ½ ξ·ξ`, `s = beta / D`, of one
    state `xi [D]`.

    `beta > 0` is a concrete number, also under `jax.jit` (mark it static, or close over
    it): a traced `beta` is a TypeError, so that a bad value is refused the same way
    eagerly and under `jit`. As in `retrieve`, `s X ξ` must stay inside the dtype of `xi`
    and `keys` (at most `beta` for ±1 states and patterns): a larger `beta` is refused.
    """
    _check_state(xi, keys)
    beta = _check_beta(beta, dtype=jnp.result_type(xi, keys))
    s = beta / keys.shape[1]
    scores = jnp.matmul(keys, xi, precision=PRECISION)
    return -jax.nn.logsumexp(s * scores) / s + 0.5 * jnp.dot(xi, xi, precision=PRECISION)


def hopfield_step(xi: Array, keys: Array, beta: float) -> Array:
    """One gradient step of size 1 on `hopfield_energy`: `ξ - ∇E(ξ) = Xᵀ softmax(s X ξ)`;
    `beta` as there (a concrete number)."""
    _check_state(xi, keys)
    _check_beta(beta, dtype=jnp.result_type(xi, keys))
    return xi - jax.grad(hopfield_energy)(xi, keys, beta)


def accuracy_grid(
    key: Array,
    sizes,
    betas,
    *,
    dim: int = 64,
    flip: float = 0.2,
    queries: int = 64,
    mesh: Mesh | None = None,
) -> np.ndarray:
    """Fraction of `queries` noisy keys retrieved exactly, `[len(sizes), len(betas)]`.

    The same memories and queries (from `key`) are used for every `beta`. Every argument is
    checked before any work is done.
    """
    validate.check_prng_key(key)
    sizes = validate.check_sequence(sizes, "sizes", "pattern counts", "(16, 256)")
    for i, m in enumerate(sizes):
        validate.check_int(m, f"sizes[{i}]", example="`sizes=(16, 256)`")
    betas = validate.check_sequence(betas, "betas", "inverse temperatures", "(1.0, 8.0)")
    for i, beta in enumerate(betas):
        _check_beta(beta, name=f"betas[{i}]", dtype=jnp.float32)  # retrieve's scores
    validate.check_int(dim, "dim")
    validate.check_real(flip, "flip", low=0.0, high=0.5)
    validate.check_int(queries, "queries")
    if mesh is not None:
        validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...), or pass None")
    grid = np.zeros((len(sizes), len(betas)))
    for i, m in enumerate(sizes):
        km, ki, kq = jax.random.split(jax.random.fold_in(key, int(m)), 3)
        mem = make_memory(km, int(m), dim)
        idx = jax.random.randint(ki, (queries,), 0, int(m))
        q = noisy_queries(kq, mem, idx, flip)
        for j, beta in enumerate(betas):
            grid[i, j] = float(jnp.mean(retrieved(retrieve(q, mem, beta, mesh=mesh), mem, idx)))
    return grid

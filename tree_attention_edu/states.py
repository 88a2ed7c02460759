"""Partial attention states and their algebra: the heart of tree attention.

A state summarises attention over a chunk of keys:

* `out [B, Tq, Hq, Dv]`: the output normalised over the chunk alone;
* `lse [B, Tq, Hq]`: log-sum-exp of the chunk's visible scores.

`combine` merges two states into the state of the union of their chunks. It is
associative and commutative, and the state of an empty (fully masked) chunk,
`lse = -inf`, is its exact identity: states form a commutative monoid. That is why
the chunks can be reduced in any tree shape, and why a reduction across `p`
devices takes `O(N/p + log p)` steps (paper, Theorem 1).

`allreduce_combine` is the same merge written with collectives (paper, Algorithm 3):
Allreduce(max) of the lse, then Allreduce(sum) of numerator and denominator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax.numpy as jnp
from jax import Array, lax

from . import _checks
from .attention import (
    accum_dtype,
    finite_or_zero,
    grouped_values,
    lse_from_parts,
    masked_softmax_parts,
    safe_positive,
    scaled_scores,
)

T = TypeVar("T")


class AttentionState(NamedTuple):
    """Attention over a chunk of keys. A pytree, so it passes through `jit` and `shard_map`.

    Attributes:
      out: `[B, Tq, Hq, Dv]` output normalised over the chunk (zeros if nothing visible).
      lse: `[B, Tq, Hq]` log-sum-exp of the visible scores (-inf if nothing visible).
    """

    out: Array
    lse: Array


def identity_state(batch: int, q_len: int, q_heads: int, v_dim: int, dtype=jnp.float32):
    """The state of an empty chunk: `combine(identity, s) == s` exactly."""
    return AttentionState(
        jnp.zeros((batch, q_len, q_heads, v_dim), dtype),
        jnp.full((batch, q_len, q_heads), -jnp.inf, dtype),
    )


def local_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> AttentionState:
    """State of one chunk of the cache whose first key sits at global position `kv_offset`.

    Args:
      q: `[B, Tq, Hq, D]`.
      k_chunk: `[B, Tc, Hkv, D]`.
      v_chunk: `[B, Tc, Hkv, Dv]`.
      kv_offset: global position of the chunk's first key (may be traced, e.g. a device index
        times the shard length).
      kv_lengths: `[B]` global valid lengths. `None` means the cache ends with this chunk.

    Returns:
      `AttentionState` in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    dims = _checks.check_qkv(q, k_chunk, v_chunk, kv_lengths)
    s, mask = scaled_scores(
        q,
        k_chunk,
        scale=_checks.resolve_scale(scale, dims.head_dim),
        causal=causal,
        kv_lengths=kv_lengths,
        kv_offset=kv_offset,
    )
    p, l, m = masked_softmax_parts(s, mask)  # [B, Hq, Tq, Tc], [B, Hq, Tq], [B, Hq, Tq]
    num = grouped_values(p, v_chunk.astype(p.dtype))  # [B, Tq, Hq, Dv]
    l = l.transpose(0, 2, 1)
    m = m.transpose(0, 2, 1)
    return AttentionState(num / safe_positive(l)[..., None], lse_from_parts(l, m))


def _merge(num: Array, den: Array, m: Array) -> AttentionState:
    """State from a shared shift `m`.

    `num = Σ_i e^{lse_i - m} out_i` `[..., Dv]` and `den = Σ_i e^{lse_i - m}` `[...]`.
    """
    return AttentionState(num / safe_positive(den)[..., None], lse_from_parts(den, m))


def _weighted(state: AttentionState, m: Array) -> tuple[Array, Array]:
    """`(e^{lse - m} · out, e^{lse - m})` for a finite shift `m`; empty states give exact zeros."""
    w = jnp.exp(state.lse - m)
    num = jnp.where(w[..., None] > 0, w[..., None] * state.out, 0)
    return num, w


def combine(a: AttentionState, b: AttentionState) -> AttentionState:
    """State of the union of two disjoint chunks.

    `lse = log(e^{lse_a} + e^{lse_b})` and `out = (e^{lse_a} out_a + e^{lse_b} out_b) / e^{lse}`,
    computed with the shift `m = max(lse_a, lse_b)` so that nothing overflows, and with
    `m = 0` when both are empty so that (-inf) - (-inf) never happens.
    """
    m = finite_or_zero(jnp.maximum(a.lse, b.lse))
    num_a, w_a = _weighted(a, m)
    num_b, w_b = _weighted(b, m)
    return _merge(num_a + num_b, w_a + w_b, m)


def finalize(state: AttentionState, dtype=None) -> Array:
    """The attention output of a (fully reduced) state, optionally cast to `dtype`."""
    return state.out if dtype is None else state.out.astype(dtype)


def tree_reduce(
    states: Sequence[T], branching: int = 2, op: Callable[[T, T], T] = combine
) -> T:
    """Reduce with a `branching`-ary tree: `ceil(log_branching(n))` levels of `op`.

    `op` defaults to `combine`; any associative operation works (e.g. `max`, or a counter
    that measures the tree's depth).
    """
    _checks.check_nonempty(states)
    _checks.check_branching(branching)
    level = list(states)
    while len(level) > 1:
        level = [
            functools.reduce(op, level[i : i + branching])
            for i in range(0, len(level), branching)
        ]
    return level[0]


def sequential_reduce(states: Sequence[T], op: Callable[[T, T], T] = combine) -> T:
    """Reduce one after another, left to right: the order Ring Attention visits the blocks."""
    _checks.check_nonempty(states)
    return functools.reduce(op, states)


def chunk_states(
    q: Array,
    k: Array,
    v: Array,
    chunk_sizes: Sequence[int],
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> list[AttentionState]:
    """Split the cache into consecutive chunks of the given sizes and return each chunk's state.

    `sum(chunk_sizes)` must equal `Tk`; a size of 0 gives an identity state.
    """
    dims = _checks.check_qkv(q, k, v, kv_lengths)
    sizes = [int(c) for c in chunk_sizes]
    if sum(sizes) != dims.kv_len or min(sizes) < 0:
        raise ValueError(
            f"`chunk_sizes` {sizes} must be non-negative and sum to kv_len = {dims.kv_len}."
        )
    if kv_lengths is None:
        kv_lengths = jnp.full((dims.batch,), dims.kv_len, jnp.int32)
    out, start = [], 0
    for size in sizes:
        if size == 0:
            acc = accum_dtype(q.dtype)
            out.append(identity_state(dims.batch, dims.q_len, dims.q_heads, dims.v_dim, acc))
            continue
        sl = slice(start, start + size)
        out.append(
            local_state(
                q, k[:, sl], v[:, sl], kv_offset=start, scale=scale, causal=causal,
                kv_lengths=kv_lengths,
            )
        )
        start += size
    return out


def allreduce_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Combine the states held by all devices along mesh `axes` (inside `shard_map`).

    Paper, Algorithm 3: `m = Allreduce(max, lse)`, then `Allreduce(sum)` of the numerator
    `e^{lse - m} out` `[B, Tq, Hq, Dv]` and denominator `e^{lse - m}` `[B, Tq, Hq]`. Only
    `B·Tq·Hq·(Dv + 2)` numbers per device cross the wire, whatever the sequence length.

    `axes` are given outermost first; each Allreduce runs over the innermost axis first
    (e.g. over "gpu" inside a node, then over "node"), which is the topology-aware schedule:
    the slow inter-node links carry one already-reduced message per node position.
    """
    inner_first = tuple(reversed(tuple(axes)))
    m = state.lse
    for ax in inner_first:
        m = lax.pmax(m, ax)
    m = finite_or_zero(m)
    num, den = _weighted(state, m)
    for ax in inner_first:
        num, den = lax.psum((num, den), ax)
    return _merge(num, den, m)

"""Partial attention states and their algebra: the heart of tree attention.

A state summarises attention over a chunk of keys:

* `out [B, Tq, Hq, Dv]`: the output normalised over the chunk alone;
* `lse [B, Tq, Hq]`: log-sum-exp of the chunk's visible scores, carried as a double word
  (`lse`, and its rounding error `lse_lo`) so that merging chunks at huge logits is as exact
  as one pass over all keys.

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
from typing import Any, NamedTuple, TypeVar

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from . import _checks
from .attention import (
    accum_dtype,
    finite_or_zero,
    grouped_values,
    lse_pair,
    masked_softmax_parts,
    nonzero_or_one,
    scaled_scores,
    select_valid_keys,
)

T = TypeVar("T")


class AttentionState(NamedTuple):
    """Attention over a chunk of keys. A pytree, so it passes through `jit` and `shard_map`.

    Attributes:
      out: `[B, Tq, Hq, Dv]` output normalised over the chunk (zeros if nothing visible).
      lse: `[B, Tq, Hq]` natural-log log-sum-exp of the visible scores, rounded to its dtype
        (-inf if nothing visible).
      lse_lo: `[B, Tq, Hq]` (or a scalar 0) the rounding error of `lse`: the exact
        log-sum-exp is `lse + lse_lo`, a double-word number. In float32 an lse near 1e8 has
        a spacing of 8, so the log of a chunk's sum would round away and merging chunks
        would weigh them wrongly; `lse_lo` keeps it, and makes merges as exact as a single
        pass over the keys. `AttentionState(out, lse)` (error 0) is a valid state.
    """

    out: Array
    lse: Array
    lse_lo: Array | float = 0.0


def identity_state(batch: int, q_len: int, q_heads: int, v_dim: int, dtype=jnp.float32):
    """The state of an empty chunk, `(0, -inf)`: `combine(identity, s) == s` exactly."""
    for name, n in (("batch", batch), ("q_len", q_len), ("q_heads", q_heads),
                    ("v_dim", v_dim)):
        _checks.check_size(n, name)
    _checks.check_float_dtype(dtype, "dtype")
    return AttentionState(
        jnp.zeros((batch, q_len, q_heads, v_dim), dtype),
        jnp.full((batch, q_len, q_heads), -jnp.inf, dtype),
        jnp.zeros((batch, q_len, q_heads), dtype),
    )


def from_parts(out_num: Array, l: Array, m: Array) -> AttentionState:
    """State from an unnormalised numerator `[..., Dv]`, a sum of `exp(s - m)` `[...]` and the
    shift `m` `[...]` (finite). `l == 0` (nothing visible) gives exactly `(0, -inf, 0)`."""
    lse, lse_lo = lse_pair(l, m)
    return AttentionState(out_num / nonzero_or_one(l)[..., None], lse, lse_lo)


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
        Keys and values past them are selected away: they may hold anything.

    Returns:
      `AttentionState` in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    dims = _checks.check_qkv(q, k_chunk, v_chunk, kv_lengths, chunk=True)
    s, mask = scaled_scores(
        q,
        k_chunk,
        scale=_checks.resolve_scale(scale, dims.head_dim, q.dtype),
        causal=causal,
        kv_lengths=kv_lengths,
        kv_offset=kv_offset,
    )
    if kv_lengths is not None:
        v_chunk = select_valid_keys(v_chunk, kv_lengths, kv_offset)
    p, l, m = masked_softmax_parts(s, mask)  # [B, Hq, Tq, Tc], [B, Hq, Tq], [B, Hq, Tq]
    num = grouped_values(p, v_chunk.astype(p.dtype))  # [B, Tq, Hq, Dv]
    return from_parts(num, l.transpose(0, 2, 1), m.transpose(0, 2, 1))


def _weight(state: AttentionState, shift: Array) -> Array:
    """`e^{lse - shift}` with the double-word lse; exactly 0 for an empty state."""
    return jnp.exp((state.lse - shift) + state.lse_lo)


def _weighted_out(w: Array, out: Array) -> Array:
    """`w · out`, selecting 0 where the weight is exactly 0 (an empty state's out may hold
    anything); a NaN weight stays NaN."""
    return jnp.where(w[..., None] == 0, jnp.zeros((), out.dtype), w[..., None] * out)


def _check_state(state: Any, name: str) -> None:
    """An AttentionState of float arrays whose lse is never +inf (checked when concrete)."""
    if not isinstance(state, AttentionState):
        raise TypeError(f"`{name}` must be an AttentionState, got {type(state).__name__}; "
                        f"make one with local_state(...) or identity_state(...).")
    for part in ("out", "lse"):
        _checks.check_float(getattr(state, part), f"{name}.{part}")
    lse = _checks.concrete(state.lse)
    if lse is not None and np.isposinf(lse).any():
        raise ValueError(f"`{name}.lse` holds +inf, which is no log-sum-exp of finite scores; "
                         f"an empty chunk's state has lse = -inf.")


def _check_pair(a: AttentionState, b: AttentionState) -> None:
    _check_state(a, "a")
    _check_state(b, "b")
    shapes = [(tuple(st.out.shape), tuple(jnp.shape(st.lse))) for st in (a, b)]
    for name, (out, lse) in zip(("a", "b"), shapes, strict=True):
        if out[:-1] != lse:
            raise ValueError(f"`{name}` has out {out} and lse {lse}; lse must be out's shape "
                             f"without its last axis, [B, Tq, Hq].")
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"`a` and `b` must have the same shapes to combine, got out {shapes[0][0]} and "
            f"{shapes[1][0]}: they must be states of the same queries (no broadcasting)."
        )


def combine(a: AttentionState, b: AttentionState) -> AttentionState:
    """State of the union of two disjoint chunks.

    `lse = log(e^{lse_a} + e^{lse_b})` and `out = (e^{lse_a} out_a + e^{lse_b} out_b) / e^{lse}`,
    computed with the shift `m = max(lse_a, lse_b)` so that nothing overflows, and with
    `m = 0` when both are empty so that (-inf) - (-inf) never happens. The lse is carried
    as a double word (`lse`, `lse_lo`), so merges at huge logits lose nothing.

    An empty state `(0, -inf)` is the exact identity: the other state is selected, bit for
    bit. A NaN in either state gives NaN.
    """
    _check_pair(a, b)
    m = finite_or_zero(lax.stop_gradient(jnp.maximum(a.lse, b.lse)))
    w_a, w_b = _weight(a, m), _weight(b, m)
    merged = from_parts(_weighted_out(w_a, a.out) + _weighted_out(w_b, b.out), w_a + w_b, m)
    a_empty, b_empty = jnp.isneginf(a.lse), jnp.isneginf(b.lse)

    def pick(x_a, x_b, x_merged, empty_a, empty_b):  # select, never multiply
        return jnp.where(empty_a, x_b, jnp.where(empty_b, x_a, x_merged))

    lo_a, lo_b = (jnp.broadcast_to(x.lse_lo, x.lse.shape) for x in (a, b))
    return AttentionState(
        pick(a.out, b.out, merged.out, a_empty[..., None], b_empty[..., None]),
        pick(a.lse, b.lse, merged.lse, a_empty, b_empty),
        pick(lo_a, lo_b, merged.lse_lo, a_empty, b_empty),
    )


def finalize(state: AttentionState, dtype=None) -> Array:
    """The attention output of a (fully reduced) state, optionally cast to `dtype`."""
    if not isinstance(state, AttentionState):
        raise TypeError(f"`state` must be an AttentionState, got {type(state).__name__}.")
    if dtype is None:
        return state.out
    _checks.check_float_dtype(dtype, "dtype")
    return state.out.astype(dtype)


def tree_reduce(
    states: Sequence[T], branching: int = 2, op: Callable[[T, T], T] = combine
) -> T:
    """Reduce with a `branching`-ary tree: `ceil(log_branching(n))` levels of `op`.

    `op` defaults to `combine`; any associative operation works (e.g. `max`, or a counter
    that measures the tree's depth).
    """
    states = _checks.check_states_sequence(states)
    _checks.check_branching(branching)
    _checks.check_callable(op, "op", "an associative function of two states, like combine")
    level = list(states)
    while len(level) > 1:
        level = [
            functools.reduce(op, level[i : i + branching])
            for i in range(0, len(level), branching)
        ]
    return level[0]


def sequential_reduce(states: Sequence[T], op: Callable[[T, T], T] = combine) -> T:
    """Reduce one after another, left to right: the order Ring Attention visits the blocks."""
    states = _checks.check_states_sequence(states)
    _checks.check_callable(op, "op", "an associative function of two states, like combine")
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
    sizes = [_checks.check_int(c, "chunk_sizes", minimum=None, example="[4, 4, 5]")
             for c in _checks.check_sequence(chunk_sizes, "chunk_sizes", "chunk sizes",
                                             "[4, 4, 5]")]
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


def _check_axes(state: Any, axes: Any) -> tuple[str, ...]:
    if not isinstance(state, AttentionState):
        raise TypeError(f"`state` must be an AttentionState, got {type(state).__name__}.")
    if isinstance(axes, str) or not (isinstance(axes, list | tuple)
                                     and all(isinstance(a, str) for a in axes)):
        raise TypeError(f"`axes` must be a list or tuple of mesh axis names, outermost first, "
                        f"got {axes!r}.")
    return tuple(axes)


def allreduce_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Combine the states held by all devices along mesh `axes` (inside `shard_map`).

    Paper, Algorithm 3: `m = Allreduce(max, lse)`, then `Allreduce(sum)` of the numerator
    `e^{lse - m} out` `[B, Tq, Hq, Dv]` and denominator `e^{lse - m}` `[B, Tq, Hq]`. Only
    `B·Tq·Hq·(Dv + 2)` numbers per device cross the wire, whatever the sequence length.

    `axes` are given outermost first; each Allreduce runs over the innermost axis first
    (e.g. over "gpu" inside a node, then over "node"), which is the topology-aware schedule:
    the slow inter-node links carry one already-reduced message per node position.
    """
    axes = _check_axes(state, axes)
    m = _shared_max(state, axes)
    w = _weight(state, m)
    num, den = _psum_inner_first((_weighted_out(w, state.out), w), axes)
    return from_parts(num, den, m)


def _shared_max(state: AttentionState, axes: Sequence[str]) -> Array:
    """Allreduce(max) of the lse over `axes` (innermost first), 0 where every device is
    empty. A constant for autodiff (pmax has no derivative, and the merge does not depend on
    the shift), so gradients flow through the sums only."""
    m = lax.stop_gradient(state.lse)
    for ax in reversed(tuple(axes)):
        m = lax.pmax(m, ax)
    return finite_or_zero(m)


def _psum_inner_first(x: T, axes: Sequence[str]) -> T:
    """Allreduce(sum) of a pytree over `axes`, innermost (e.g. "gpu" inside a node) first."""
    for ax in reversed(tuple(axes)):
        x = lax.psum(x, ax)
    return x


def _allreduce_lse(state: AttentionState, axes: Sequence[str]) -> tuple[Array, Array]:
    """Paper, Algorithm 1: every row's log-sum-exp over all devices, as a double word, from
    Allreduce(max) of the local lse and Allreduce(sum) of the shifted sum-exps (no outputs)."""
    m = _shared_max(state, axes)
    return lse_pair(_psum_inner_first(_weight(state, m), axes), m)


# --- other merge patterns -----------------------------------------------------------------
#
# The same algebra, other collectives. Each function runs inside `shard_map` on the state a
# device holds for its own shard of keys, and returns a state: the merged state of every
# query head ("allgather", "one_pass"), or of the device's own slice of heads
# ("reduce_scatter", "all_to_all": `heads_per_device` heads, those of its index along `axes`;
# the query heads are padded with empty states to a multiple of the device count).


def _pack(state: AttentionState) -> Array:
    """`[..., Dv + 2]`: out, lse and lse_lo side by side, so that one collective moves them."""
    lo = jnp.broadcast_to(state.lse_lo, state.lse.shape).astype(state.out.dtype)
    return jnp.concatenate([state.out, state.lse[..., None].astype(state.out.dtype),
                            lo[..., None]], axis=-1)


def _unpack(packed: Array) -> AttentionState:
    return AttentionState(packed[..., :-2], packed[..., -2], packed[..., -1])


def merge_stacked(stacked: AttentionState) -> AttentionState:
    """Merge states stacked along a leading axis `[p, ...]` in one pass: the local half of
    the all-gather and all-to-all patterns. The same shift, weights and selection as
    `allreduce_combine`, with sums over the stack in place of collectives."""
    if not isinstance(stacked, AttentionState):
        raise TypeError(f"`stacked` must be an AttentionState of arrays stacked along a leading "
                        f"axis, got {type(stacked).__name__}.")
    m = finite_or_zero(lax.stop_gradient(jnp.max(stacked.lse, axis=0)))
    w = _weight(stacked, m)
    return from_parts(jnp.sum(_weighted_out(w, stacked.out), axis=0), jnp.sum(w, axis=0), m)


def _pad_heads(state: AttentionState, heads: int) -> AttentionState:
    """Pad the query-head axis (2) to `heads` with empty states `(0, -inf, 0)`."""
    extra = heads - state.lse.shape[2]
    if not extra:
        return state
    lo = jnp.broadcast_to(state.lse_lo, state.lse.shape)
    pad = [(0, 0), (0, 0), (0, extra)]
    return AttentionState(jnp.pad(state.out, [*pad, (0, 0)]),
                          jnp.pad(state.lse, pad, constant_values=-jnp.inf), jnp.pad(lo, pad))


def heads_per_device(q_heads: int, p: int) -> int:
    """Query heads each device ends with in the head-scattered patterns: `ceil(Hq / p)`."""
    return -(-q_heads // p)


def allgather_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """One all-gather of the packed states `[B, Tq, Hq, Dv + 2]`, then a local merge.

    One collective in place of two, with p× the payload: it wins when the collectives'
    latency dominates their bandwidth (small batch × heads, many devices).
    """
    axes = _check_axes(state, axes)
    gathered = lax.all_gather(_pack(state), axes, axis=0, tiled=False)  # [p, B, Tq, Hq, Dv+2]
    return merge_stacked(_unpack(gathered))


def all_to_all_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Helix-style: one all-to-all over heads, then a local merge of the p partial states of
    the device's own heads.

    Returns the state of `heads_per_device(Hq, p)` query heads `[B, Tq, Hs, ·]`: those of the
    device's index along `axes` after padding the heads to a multiple of p.
    """
    axes = _check_axes(state, axes)
    p = lax.axis_size(axes)
    B, Tq, Hq, Dv = state.out.shape
    hs = heads_per_device(Hq, p)
    packed = _pack(_pad_heads(state, hs * p)).reshape(B, Tq, p, hs, Dv + 2)
    packed = jnp.moveaxis(packed, 2, 0)  # [p (destination), B, Tq, Hs, Dv + 2]
    received = lax.all_to_all(packed, axes, 0, 0, tiled=True)  # [p (source), ...]
    return merge_stacked(_unpack(received))


def reduce_scatter_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """DCP-style: all-gather the lse pairs `[B, Tq, Hq, 2]`, rescale the local output by its
    share of the global sum, and reduce-scatter the rescaled outputs over heads.

    Returns the state of the device's `heads_per_device(Hq, p)` query heads, as
    `all_to_all_combine` does; the lse of those heads is known to every device anyway.
    """
    axes = _check_axes(state, axes)
    p = lax.axis_size(axes)
    hs = heads_per_device(state.lse.shape[2], p)
    state = _pad_heads(state, hs * p)
    lo = jnp.broadcast_to(state.lse_lo, state.lse.shape)
    pairs = lax.all_gather(jnp.stack([state.lse, lo], -1), axes, axis=0, tiled=False)
    every = AttentionState(jnp.zeros(()), pairs[..., 0], pairs[..., 1])  # [p, B, Tq, Hq]
    m = finite_or_zero(lax.stop_gradient(jnp.max(every.lse, axis=0)))
    total = jnp.sum(_weight(every, m), axis=0)
    share = _weight(state, m) / nonzero_or_one(total)  # this shard's weight in the union
    mine = lax.psum_scatter(_weighted_out(share, state.out), axes, scatter_dimension=2,
                            tiled=True)  # [B, Tq, Hs, Dv]
    lse, lse_lo = lse_pair(total, m)
    start = lax.axis_index(axes) * hs
    return AttentionState(mine, lax.dynamic_slice_in_dim(lse, start, hs, 2),
                          lax.dynamic_slice_in_dim(lse_lo, start, hs, 2))


def one_pass_window(dtype, p: int) -> tuple[float, float]:
    """The range of `lse - shift` inside which the one-pass merge is exact: every weight
    `e^{lse - shift}` is a normal number and p of them sum without overflow."""
    big = float(np.log(np.finfo(np.dtype(dtype)).max))  # 88.7 in float32, 709.8 in float64
    return -0.9 * big, 0.9 * big - float(np.log(max(p, 1)))


def one_pass_combine(state: AttentionState, axes: Sequence[str],
                     shift: float = 0.0) -> AttentionState:
    """FlashDecoding++'s unified max: one Allreduce(sum) with a shared shift in place of the
    Allreduce(max).

    Every device weighs its state by `e^{lse - shift}` with the same fixed `shift`, so the
    numerators and denominators can be summed at once. That is exact while every weight is
    a normal float and their sum does not overflow (`one_pass_window`); a device whose lse
    leaves the window raises a flag that travels in the same Allreduce, and if any flag is up
    all devices fall back to `allreduce_combine` (a conditional: the exact two-collective
    merge runs only then).
    """
    axes = _check_axes(state, axes)
    p = lax.axis_size(axes)
    low, high = one_pass_window(state.out.dtype, p)
    x = (state.lse - shift) + state.lse_lo
    outside = ~jnp.isneginf(state.lse) & ((x < low) | (x > high))
    flag = jnp.any(outside).astype(state.out.dtype)
    w = _weight(state, jnp.asarray(shift, state.out.dtype))
    num, den, flag = _psum_inner_first((_weighted_out(w, state.out), w, flag), axes)

    def exact(_):
        return allreduce_combine(state, axes)

    def fast(_):
        return from_parts(num, den, jnp.full(den.shape, shift, den.dtype))

    return lax.cond(flag > 0, exact, fast, None)

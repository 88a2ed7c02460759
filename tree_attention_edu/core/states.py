"""Partial attention states and their algebra: the heart of tree attention.

A state summarises attention over a chunk of keys:

* `out [B, Tq, Hq, Dv]`: the output normalised over the chunk alone;
* `lse [B, Tq, Hq]`: log-sum-exp of the chunk's visible scores, carried as a double word
  (`lse`, and its rounding error `lse_lo`) so that merging chunks at huge logits is as exact
  as one pass over all keys.

`combine` merges two states into the state of the union of their chunks. It is
associative and commutative, and the state of an empty (fully masked) chunk,
`(0, -inf)`, is its exact identity: states form a commutative monoid. That is why
the chunks can be reduced in any tree shape, and why a reduction across `p`
devices takes `O(N/p + log p)` steps (paper, Theorem 1). The collective merges that run
the same algebra across devices are in `core.merges`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from . import inputs, masks, validate
from .numerics import (
    accum_dtype,
    finite_or_zero,
    lse_pair,
    masked_softmax_parts,
    nonzero_or_one,
    two_sum,
)
from .reference import grouped_values, scaled_scores

T = TypeVar("T")


class AttentionState(NamedTuple):
    """Attention over a chunk of keys. A pytree, so it passes through `jit`, `vmap`, `scan`
    and `shard_map`.

    Attributes:
      out: `[B, Tq, Hq, Dv]` output normalised over the chunk (zeros if nothing visible).
      lse: `[B, Tq, Hq]` natural-log log-sum-exp of the visible scores, rounded to its dtype
        (-inf if nothing visible).
      lse_lo: `[B, Tq, Hq]` the rounding error of `lse`: the exact log-sum-exp is
        `lse + lse_lo`, a double-word number. In float32 an lse near 1e8 has a spacing of 8,
        so the log of a chunk's sum would round away and merging chunks would weigh them
        wrongly; `lse_lo` keeps it, and makes merges as exact as a single pass over the
        keys. A state from another kernel that has no such error term is
        `AttentionState.from_lse(out, lse)`.
    """

    out: Array
    lse: Array
    lse_lo: Array

    @classmethod
    def from_lse(cls, out: Array, lse: Array) -> AttentionState:
        """A state from an output and a plain (single-word) lse: `lse_lo` is zeros."""
        lse = jnp.asarray(lse)
        return cls(jnp.asarray(out), lse, jnp.zeros_like(lse))


def identity_state(
    batch: int, q_len: int, q_heads: int, v_dim: int, dtype: DTypeLike = jnp.float32
) -> AttentionState:
    """The state of an empty chunk, `(0, -inf)`: `combine(identity, s) == s` exactly."""
    for name, n in (("batch", batch), ("q_len", q_len), ("q_heads", q_heads), ("v_dim", v_dim)):
        validate.check_size(n, name)
    validate.check_float_dtype(dtype, "dtype")
    return identity_core(batch, q_len, q_heads, v_dim, dtype)


def identity_core(
    batch: int, q_len: int, q_heads: int, v_dim: int, dtype: DTypeLike
) -> AttentionState:
    """`identity_state` without its checks, for sizes read off checked arrays."""
    return AttentionState(
        jnp.zeros((batch, q_len, q_heads, v_dim), dtype),
        jnp.full((batch, q_len, q_heads), -jnp.inf, dtype),
        jnp.zeros((batch, q_len, q_heads), dtype),
    )


def from_parts(out_num: Array, l: Array, m: Array) -> AttentionState:
    """State from an unnormalised numerator `[..., Dv]`, a sum of `exp(s - m)` `[...]` and the
    shift `m` `[...]` (finite). `l == 0` (nothing visible) gives exactly `(0, -inf, 0)`."""
    lse, lse_lo = lse_pair(l, m)
    return AttentionState(ratio(out_num, nonzero_or_one(l)[..., None]), lse, lse_lo)


@jax.custom_jvp
def ratio(x: Array, y: Array) -> Array:
    """`x / y`, whose derivative is `(dx - (x/y)·dy) / y`. JAX's own rule for a division
    goes through `y^-2`, which under- or overflows long before `x/y` does: with the
    one-pass merge's denominators near `e^{±60}` in float32 the gradient came out wrong or
    NaN while the value was exact."""
    return x / y


@ratio.defjvp
def _ratio_jvp(primals: tuple[Array, Array], tangents: tuple[Array, Array]):
    (x, y), (dx, dy) = primals, tangents
    out = x / y
    return out, (dx - out * dy) / y


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
      kv_lengths: `[B]` global valid lengths, used as given (the whole cache's length is
        not known here, so nothing is clamped). `None` means the cache ends with this chunk.
        Keys and values past them are selected away: they may hold anything.

    Returns:
      `AttentionState` in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    dims = inputs.check_qkv(q, k_chunk, v_chunk, kv_lengths)
    kv_offset = inputs.check_kv_offset(kv_offset)
    if kv_lengths is not None:
        kv_lengths = masks.as_lengths(kv_lengths)
    s, mask = scaled_scores(
        q,
        k_chunk,
        scale=inputs.resolve_scale(scale, dims.head_dim, q.dtype),
        causal=causal,
        kv_lengths=kv_lengths,
        kv_offset=kv_offset,
    )
    if kv_lengths is not None:
        v_chunk = masks.select_valid_keys(v_chunk, kv_lengths, kv_offset)
    p, l, m = masked_softmax_parts(s, mask)  # [B, Hq, Tq, Tc], [B, Hq, Tq], [B, Hq, Tq]
    num = grouped_values(p, v_chunk.astype(p.dtype))  # [B, Tq, Hq, Dv]
    return from_parts(num, l.transpose(0, 2, 1), m.transpose(0, 2, 1))


def lse_weight(lse: Array, lse_lo: Array, shift: Array) -> Array:
    """`e^{lse + lse_lo - shift}` of a double-word lse; exactly 0 where `lse = -inf` (an empty
    state), whatever its `lse_lo` holds (NaN included: another kernel may hand one over).

    The exponent is split, `e^{hi} · e^{r}` with `hi + r = lse + lse_lo - shift` to double
    precision (`two_sum` twice, so an `lse_lo` of any size is renormalised), and `|r|` at most
    half a unit in the last place of `hi`: under `jit` the weight is then within about two
    units of the exact one at any `|lse - shift|` (checked in the tests). Rounding
    `(lse - shift) + lse_lo` to one word first would err by `u·|lse - shift|` relative: 40
    units in the last place at `|x| = 80` in float32, which a fixed shift (`one_pass`)
    reaches. The empty rows are selected away before the exponent too (so a NaN there
    reaches neither the value nor its gradient)."""
    empty = jnp.isneginf(lse)
    zero = jnp.zeros((), lse_lo.dtype)
    a, lo_in = jnp.where(empty, shift, lse), jnp.where(empty, zero, lse_lo)
    x = (a - shift) + lo_in  # the exponent in one word: right wherever the split is not
    hi, lo = two_sum(a, -shift)
    hi, r = two_sum(hi, lo + lo_in)
    e = jnp.exp(hi)
    # e·e^r as e + e·expm1(r): XLA rewrites exp(a)·exp(b) into exp(a + b), which is the
    # rounding this split avoids; it leaves expm1 alone (checked under jit by the tests).
    # The split is used only where e is a positive finite number and r a nonzero finite
    # one; elsewhere (an exponent that under- or overflows, where r may be thousands or
    # NaN) e^x of the one-word exponent is the weight, 0 or inf as it should be. Each
    # branch's inputs are selected first, so that neither carries NaN into a gradient.
    split = jnp.isfinite(r) & (r != 0) & (e > 0) & jnp.isfinite(e)
    es, rs = jnp.where(split, e, zero), jnp.where(split, r, zero)
    w = jnp.where(split, es + es * jnp.expm1(rs), jnp.exp(jnp.where(split, zero, x)))
    return jnp.where(empty, jnp.zeros((), w.dtype), w)


def state_weight(state: AttentionState, shift: Array) -> Array:
    """`e^{lse - shift}` of a state's double-word lse `[B, Tq, Hq]`; exactly 0 if empty."""
    return lse_weight(state.lse, state.lse_lo, shift)


def weighted_out(w: Array, out: Array) -> Array:
    """`w · out` `[..., Dv]`, selecting 0 where the weight is exactly 0 (an empty state's out
    may hold anything); a NaN weight stays NaN. `out` is selected before the product too,
    so that the gradient in `w` is `0`, not `0·NaN`, where `out` holds garbage; the product
    is selected after it, so that XLA cannot fuse it with the sum that follows into an FMA
    (whose rounding depends on the operands' order: `combine` would lose its bit-for-bit
    commutativity under `jit`)."""
    zero = jnp.zeros((), out.dtype)
    empty = w[..., None] == 0
    return jnp.where(empty, zero, w[..., None] * jnp.where(empty, zero, out))


def check_state(state: Any, name: str) -> AttentionState:
    """An AttentionState of float arrays with matching shapes (static checks only)."""
    if not isinstance(state, AttentionState):
        raise TypeError(
            f"`{name}` must be an AttentionState, got {type(state).__name__}; "
            f"make one with local_state(...), identity_state(...) or "
            f"AttentionState.from_lse(out, lse)."
        )
    shapes = []
    for part in ("out", "lse", "lse_lo"):
        x = getattr(state, part)
        shapes.append(validate.shape_of(x, f"{name}.{part}"))  # an array first, then its dtype
        validate.check_float(x, f"{name}.{part}")
    out, lse, lo = shapes
    if out[:-1] != lse or lo != lse:
        raise ValueError(
            f"`{name}` has out {out}, lse {lse} and lse_lo {lo}; lse and lse_lo "
            f"must be out's shape without its last axis, [B, Tq, Hq]."
        )
    return state


def combine(a: AttentionState, b: AttentionState) -> AttentionState:
    """State of the union of two disjoint chunks.

    `lse = log(e^{lse_a} + e^{lse_b})` and `out = (e^{lse_a} out_a + e^{lse_b} out_b) / e^{lse}`,
    computed with the shift `m = max(lse_a, lse_b)` so that nothing overflows, and with
    `m = 0` when both are empty so that (-inf) - (-inf) never happens. The lse is carried
    as a double word (`lse`, `lse_lo`), so merges at huge logits lose nothing.

    An empty state (`lse = -inf`) is the exact identity: the other state is selected, bit
    for bit. Two empty states give the canonical empty state `(0, -inf, 0)`, whatever their
    `out` and `lse_lo` held (a state from another kernel may carry garbage, NaN included,
    in an empty row). A NaN in a non-empty state gives NaN. Works under `jax.vmap` and `lax.scan`.
    """
    check_state(a, "a")
    check_state(b, "b")
    if a.out.shape != b.out.shape:
        raise ValueError(
            f"`a` and `b` must have the same shapes to combine, got out {a.out.shape} and "
            f"{b.out.shape}: they must be states of the same queries (no broadcasting)."
        )
    return combine_core(a, b)


def combine_core(a: AttentionState, b: AttentionState) -> AttentionState:
    """`combine` without its checks, for states of the same shape that the caller built
    (the ring's online fold, the reductions): the decoders check their inputs once, at
    their own door."""
    m = finite_or_zero(lax.stop_gradient(jnp.maximum(a.lse, b.lse)))
    w_a, w_b = state_weight(a, m), state_weight(b, m)
    merged = from_parts(weighted_out(w_a, a.out) + weighted_out(w_b, b.out), w_a + w_b, m)
    a_empty, b_empty = jnp.isneginf(a.lse), jnp.isneginf(b.lse)

    def pick(x_a, x_b, x_merged, empty_a, empty_b):  # select, never multiply
        return jnp.where(empty_a, x_b, jnp.where(empty_b, x_a, x_merged))

    both = (a_empty & b_empty)[..., None]
    out = pick(a.out, b.out, merged.out, a_empty[..., None], b_empty[..., None])
    lo = pick(a.lse_lo, b.lse_lo, merged.lse_lo, a_empty, b_empty)
    return AttentionState(
        jnp.where(both, jnp.zeros((), out.dtype), out),
        pick(a.lse, b.lse, merged.lse, a_empty, b_empty),
        jnp.where(both[..., 0], jnp.zeros((), lo.dtype), lo),  # canonical: (0, -inf, 0)
    )


def merge_stacked(stacked: AttentionState) -> AttentionState:
    """Merge states stacked along a leading axis `[p, B, Tq, Hq, ...]` in one pass: the local
    half of the all-gather and all-to-all patterns (`core.merges`). One shared shift, the
    weights `e^{lse_i - m}`, and selection where a weight is 0; all empty gives
    `(0, -inf, 0)`."""
    if not isinstance(stacked, AttentionState):
        raise TypeError(
            f"`stacked` must be an AttentionState of arrays stacked along a leading "
            f"axis, got {type(stacked).__name__}."
        )
    m = finite_or_zero(lax.stop_gradient(jnp.max(stacked.lse, axis=0)))
    w = state_weight(stacked, m)
    return from_parts(jnp.sum(weighted_out(w, stacked.out), axis=0), jnp.sum(w, axis=0), m)


def finalize(state: AttentionState, dtype: DTypeLike | None = None) -> Array:
    """The attention output `[B, Tq, Hq, Dv]` of a (fully reduced) state, optionally cast."""
    if not isinstance(state, AttentionState):
        raise TypeError(f"`state` must be an AttentionState, got {type(state).__name__}.")
    if dtype is None:
        return state.out
    validate.check_float_dtype(dtype, "dtype")
    return state.out.astype(dtype)


def _check_states_sequence(states: Any) -> list:
    """A reduction's input: a non-empty list or tuple (a generator would be consumed)."""
    if not isinstance(states, list | tuple):
        raise TypeError(
            f"`states` must be a list or tuple of states, got "
            f"{type(states).__name__}; wrap an iterator in `list(...)`."
        )
    if not states:
        raise ValueError("`states` is empty; a reduction needs at least one state.")
    return list(states)


def tree_reduce(
    states: Sequence[T],
    branching: int = 2,
    op: Callable[[T, T], T] = combine,  # type: ignore[assignment]
) -> T:
    """Reduce with a `branching`-ary tree: `ceil(log_branching(n))` levels, each group of up
    to `branching` merged left to right by `branching − 1` binary `op`s (so a ternary level
    is two sequential binary steps, not one).

    `op` defaults to `combine`; any associative operation works (e.g. `max`). Neighbours are
    merged first and an odd one out moves up a level unchanged. A counter such as
    `max(x, y) + 1` on leaves of 0 measures the tree's depth: it is not associative, which is
    why it sees the tree's shape.
    """
    level = _check_states_sequence(states)
    validate.check_int(branching, "branching", minimum=2, example="`branching=2` (a binary tree)")
    validate.check_callable(op, "op", "an associative function of two states, like combine")
    while len(level) > 1:
        level = [
            functools.reduce(op, level[i : i + branching]) for i in range(0, len(level), branching)
        ]
    return level[0]


def sequential_reduce(
    states: Sequence[T],
    op: Callable[[T, T], T] = combine,  # type: ignore[assignment]
) -> T:
    """Reduce one after another, left to right: the order Ring Attention visits the blocks."""
    level = _check_states_sequence(states)
    validate.check_callable(op, "op", "an associative function of two states, like combine")
    return functools.reduce(op, level)


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

    `sum(chunk_sizes)` must equal `Tk`; a size of 0 gives an identity state. `kv_lengths`
    is clamped into `[0, Tk]`, as `attention` reads it.
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    sizes = [
        validate.check_int(c, "chunk_sizes", minimum=None, example="[4, 4, 5]")
        for c in validate.check_sequence(chunk_sizes, "chunk_sizes", "chunk sizes", "[4, 4, 5]")
    ]
    if sum(sizes) != dims.kv_len or min(sizes) < 0:
        raise ValueError(
            f"`chunk_sizes` {sizes} must be non-negative and sum to kv_len = {dims.kv_len}."
        )
    kv_lengths = masks.clamp_lengths(kv_lengths, dims.batch, dims.kv_len)
    out, start = [], 0
    for size in sizes:
        if size == 0:
            acc = accum_dtype(q.dtype)
            out.append(identity_state(dims.batch, dims.q_len, dims.q_heads, dims.v_dim, acc))
            continue
        sl = slice(start, start + size)
        out.append(
            local_state(
                q,
                k[:, sl],
                v[:, sl],
                kv_offset=start,
                scale=scale,
                causal=causal,
                kv_lengths=kv_lengths,
            )
        )
        start += size
    return out

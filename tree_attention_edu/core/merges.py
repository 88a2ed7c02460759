"""Merging the devices' states: the paper's Algorithm 3 and the patterns of today's serving
systems, all from the algebra of `core.states`.

Each merge runs inside `shard_map` on the state a device holds for its own shard of keys,
and returns a state: the merged state of every query head ("allreduce", "allgather",
"one_pass"), or of the device's own slice of heads ("reduce_scatter", "all_to_all":
`heads_per_device(Hq, p)` heads, those of its index along `axes`, the query heads padded
with empty states to a multiple of the device count).

`axes` are mesh axis names, outermost first. Sums run over the innermost axis first (e.g.
over "gpu" inside a node, then over "node"): the topology-aware schedule, where the slow
inter-node links carry one already-reduced message per node position.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import AxisType
from jax.typing import DTypeLike

from . import validate
from .names import MERGE_NAMES, MergeChoice, MergeName
from .numerics import finite_or_zero, lse_pair, nonzero_or_one
from .states import (
    AttentionState,
    combine_core,
    from_parts,
    lse_weight,
    merge_stacked,
    state_weight,
    weighted_out,
)

T = TypeVar("T")
Merge = Callable[[AttentionState, Sequence[str]], AttentionState]


def check_axes(state: Any, axes: Any) -> tuple[str, ...]:
    """A merge's arguments: an AttentionState and a list or tuple of mesh axis names, each a
    manual axis of the enclosing `jax.shard_map` (the merges are collectives over them)."""
    if not isinstance(state, AttentionState):
        raise TypeError(f"`state` must be an AttentionState, got {type(state).__name__}.")
    if isinstance(axes, str) or not (
        isinstance(axes, list | tuple) and all(isinstance(a, str) for a in axes)
    ):
        raise TypeError(
            f"`axes` must be a list or tuple of mesh axis names, outermost first, got {axes!r}."
        )
    mesh = jax.sharding.get_abstract_mesh()
    manual = (
        ()
        if mesh.empty
        else tuple(
            a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual
        )
    )
    outside = [a for a in axes if a not in manual]
    if outside:
        where = (
            f"the enclosing shard_map's manual axes are {manual}"
            if manual
            else "this call is not inside jax.shard_map"
        )
        raise ValueError(
            f"`axes` {tuple(axes)} names {outside}, but {where}. A merge is a collective over "
            f"the devices of a shard_map: call it inside `jax.shard_map(..., mesh=mesh)` with "
            f"axes of that mesh (tree_decode does this for you)."
        )
    return tuple(axes)


def shared_max(state: AttentionState, axes: Sequence[str]) -> Array:
    """Allreduce(max) of the lse `[B, Tq, Hq]` over `axes` (innermost first), 0 where every
    device is empty. A constant for autodiff (the merge does not depend on the shift), so
    gradients flow through the sums only."""
    m = lax.stop_gradient(state.lse)
    for ax in reversed(tuple(axes)):
        m = lax.pmax(m, ax)
    return finite_or_zero(m)


def psum_inner_first(x: T, axes: Sequence[str]) -> T:
    """Allreduce(sum) of a pytree over `axes`, innermost (e.g. "gpu" inside a node) first."""
    for ax in reversed(tuple(axes)):
        x = lax.psum(x, ax)
    return x


def allreduce_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Paper, Algorithm 3: `m = Allreduce(max, lse)`, then `Allreduce(sum)` of the numerator
    `e^{lse - m} out` `[B, Tq, Hq, Dv]` and denominator `e^{lse - m}` `[B, Tq, Hq]`.

    Only `B·Tq·Hq·(Dv + 2)` numbers per device cross the wire, whatever the sequence length.
    """
    return allreduce_core(state, check_axes(state, axes))


def allreduce_core(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """`allreduce_combine` without its checks (the decoders' form)."""
    m = shared_max(state, axes)
    w = state_weight(state, m)
    num, den = psum_inner_first((weighted_out(w, state.out), w), axes)
    return from_parts(num, den, m)


def global_lse(state: AttentionState, axes: Sequence[str]) -> tuple[Array, Array, Array]:
    """Paper, Algorithm 1: every row's log-sum-exp over all devices, from Allreduce(max) of
    the local lse and Allreduce(sum) of the shifted sum-exps (no outputs).

    Returns `(lse, lse_lo, m)`: the global lse as a double word, and the shared shift `m`
    it was summed at (what a backward pass needs to weigh the shards exactly as
    `allreduce_combine` does).
    """
    m = shared_max(state, axes)
    lse, lse_lo = lse_pair(psum_inner_first(state_weight(state, m), axes), m)
    return lse, lse_lo, m


def pack(state: AttentionState) -> Array:
    """`[..., Dv + 2]`: out, lse and lse_lo side by side, so that one collective moves them."""
    dt = state.out.dtype
    return jnp.concatenate(
        [state.out, state.lse[..., None].astype(dt), state.lse_lo[..., None].astype(dt)], axis=-1
    )


def unpack(packed: Array) -> AttentionState:
    """The inverse of `pack`."""
    return AttentionState(packed[..., :-2], packed[..., -2], packed[..., -1])


def heads_per_device(q_heads: int, p: int) -> int:
    """Query heads each device ends with in the head-scattered patterns: `ceil(Hq / p)`."""
    validate.check_size(q_heads, "q_heads")
    validate.check_positive(p, "p")
    return -(-q_heads // p)


def pad_heads(state: AttentionState, heads: int) -> AttentionState:
    """Pad the query-head axis (2) to `heads` with empty states `(0, -inf, 0)`."""
    extra = heads - state.lse.shape[2]
    if not extra:
        return state
    pad = [(0, 0), (0, 0), (0, extra)]
    return AttentionState(
        jnp.pad(state.out, [*pad, (0, 0)]),
        jnp.pad(state.lse, pad, constant_values=-jnp.inf),
        jnp.pad(state.lse_lo, pad),
    )


def allgather_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """One all-gather of the packed states `[p, B, Tq, Hq, Dv + 2]`, then a local merge.

    One collective in place of two, with p× the payload: it wins when the collectives'
    latency dominates their bandwidth (small batch × heads, many devices). The gather is
    typed invariant (every device holds the same stack), so the merged result is provably
    replicated.
    """
    return allgather_core(state, check_axes(state, axes))


def allgather_core(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """`allgather_combine` without its checks (the decoders' form)."""
    gathered = lax.all_gather(pack(state), axes, axis=0, tiled=False, to="invarying")
    return merge_stacked(unpack(gathered))


def all_to_all_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Helix-style: one all-to-all over heads, then a local merge of the p partial states of
    the device's own heads.

    Returns the state of `heads_per_device(Hq, p)` query heads `[B, Tq, Hs, ·]`: those of the
    device's index along `axes` after padding the heads to a multiple of p.
    """
    return all_to_all_core(state, check_axes(state, axes))


def all_to_all_core(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """`all_to_all_combine` without its checks (the decoders' form)."""
    p = lax.axis_size(axes)
    B, Tq, Hq, Dv = state.out.shape
    hs = -(-Hq // p)  # heads_per_device, on sizes the decoder checked
    packed = pack(pad_heads(state, hs * p)).reshape(B, Tq, p, hs, Dv + 2)
    packed = jnp.moveaxis(packed, 2, 0)  # [p (destination), B, Tq, Hs, Dv + 2]
    received = lax.all_to_all(packed, axes, 0, 0, tiled=True)  # [p (source), ...]
    return merge_stacked(unpack(received))


def reduce_scatter_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """DCP-style: all-gather the lse pairs `[p, B, Tq, Hq, 2]`, rescale the local output by
    its share of the global sum, and reduce-scatter the rescaled outputs over heads.

    Returns the state of the device's `heads_per_device(Hq, p)` query heads, as
    `all_to_all_combine` does; the lse of those heads is known to every device anyway.
    """
    return reduce_scatter_core(state, check_axes(state, axes))


def reduce_scatter_core(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """`reduce_scatter_combine` without its checks (the decoders' form)."""
    p = lax.axis_size(axes)
    hs = -(-state.lse.shape[2] // p)  # heads_per_device, on sizes the decoder checked
    state = pad_heads(state, hs * p)
    pairs = lax.all_gather(jnp.stack([state.lse, state.lse_lo], -1), axes, axis=0, tiled=False)
    lse_all, lo_all = pairs[..., 0], pairs[..., 1]  # [p, B, Tq, Hq]
    m = finite_or_zero(lax.stop_gradient(jnp.max(lse_all, axis=0)))
    total = jnp.sum(lse_weight(lse_all, lo_all, m), axis=0)
    share = state_weight(state, m) / nonzero_or_one(total)  # this shard's weight in the union
    mine = lax.psum_scatter(
        weighted_out(share, state.out), axes, scatter_dimension=2, tiled=True
    )  # [B, Tq, Hs, Dv]
    lse, lse_lo = lse_pair(total, m)
    start = lax.axis_index(axes) * hs
    return AttentionState(
        mine,
        lax.dynamic_slice_in_dim(lse, start, hs, 2),
        lax.dynamic_slice_in_dim(lse_lo, start, hs, 2),
    )


def butterfly_combine(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """Recursive doubling: log2 p rounds in which each device swaps its state with the
    device whose index along `axes` (numbered in the mesh's axis order, whatever the order
    of `axes`) differs in bit r (r = 0, 1, ...: the mesh's innermost axis first, so on a
    `("node", "gpu")` mesh the first rounds stay inside a node) and combines the two.

    A tree by construction: every collective is one `ppermute` of the packed state
    `[B, Tq, Hq, Dv + 2]`, and a call pays log2 p message latencies, where an Allreduce
    that a transport runs as a ring pays 2(p - 1). Both partners of a round combine the
    same two states in the same order (the lower index's first), read from one buffer, so
    they hold the same bits, and so every device ends with the same result (typed
    varying: the decoder declares it replicated with `check_vma` off,
    `VARYING_REPLICATED`).

    Any p: with p = 2^k + e, devices 2^k + i first fold their state into device i, the
    2^k run the butterfly, and device i sends the result back (k + 2 rounds).
    """
    return butterfly_core(state, check_axes(state, axes))


def butterfly_core(state: AttentionState, axes: Sequence[str]) -> AttentionState:
    """`butterfly_combine` without its checks (the decoders' form)."""
    # `ppermute` over a tuple of axes numbers the devices in the mesh's axis order whatever
    # the tuple's order, and `axis_index` in the tuple's: use the mesh's order for both, so
    # that the device a pair names is the device that `idx` selects (any numbering makes a
    # butterfly; two different ones make a wrong answer, or partners that disagree on who
    # is the lower and combine in opposite orders).
    axes = _in_mesh_order(axes)
    p = lax.axis_size(axes)
    low = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - low
    idx = lax.axis_index(axes)
    if extra:  # fold the devices past 2^k into their partners idx - 2^k
        got = _permute(state, axes, [(low + i, i) for i in range(extra)])
        state = _select(idx < extra, combine_core(state, got), state)
    for r in range((low - 1).bit_length()):
        got = _permute(state, axes, [(i, i ^ (1 << r)) for i in range(low)])
        # Both partners combine (lower index's state, higher's) from one buffer: the same
        # operands, in the same order, read the same way (`_in_order`).
        upper = (idx >> r) & 1 == 1
        pair = _in_order(_select(upper, got, state), _select(upper, state, got))
        # Devices past 2^k receive nothing this round (zeros): they keep their state,
        # which the last round overwrites.
        state = _select(idx < low, combine_core(pair[0], pair[1]), state)
    if extra:  # the result goes back to the devices that folded
        got = _permute(state, axes, [(i, low + i) for i in range(extra)])
        state = _select(idx >= low, got, state)
    return state


def _in_mesh_order(axes: Sequence[str]) -> tuple[str, ...]:
    """`axes` sorted into the order of the enclosing `shard_map`'s mesh (the order in which
    `ppermute` numbers devices); innermost last, so the butterfly's first rounds pair
    devices along the mesh's inner axis (inside a node on a `("node", "gpu")` mesh)."""
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if not all(a in names for a in axes):  # no mesh in context: keep the given order
        return tuple(axes)
    return tuple(sorted(axes, key=names.index))


def _permute(
    state: AttentionState, axes: Sequence[str], perm: list[tuple[int, int]]
) -> AttentionState:
    """`ppermute` of a state as one packed message (one collective per round)."""
    return unpack(lax.ppermute(pack(state), tuple(axes), perm))


def _in_order(
    first: AttentionState, second: AttentionState
) -> tuple[AttentionState, AttentionState]:
    """The two states of a round, written side by side into one buffer first (an
    optimization barrier), as the all-gather pattern's merge reads them. Combined straight
    from the two buffers they came in, the partners' programs read them from different
    places, and XLA:CPU's FMA contraction rounded the two results apart (measured: 4 of
    64 outputs a unit apart on 2 devices, none with `--xla_cpu_max_isa=SSE4_2`)."""
    both = lax.optimization_barrier(jnp.stack([pack(first), pack(second)]))
    return unpack(both[0]), unpack(both[1])


def _select(pred: Array, a: AttentionState, b: AttentionState) -> AttentionState:
    """`a` where the scalar `pred` holds, else `b`: a select, never a product."""
    return AttentionState(*(jnp.where(pred, x, y) for x, y in zip(a, b, strict=True)))


def one_pass_window(
    dtype: DTypeLike, p: int, out_max: float = 1.0, out_min: float = 1.0
) -> tuple[float, float]:
    """The range of `x = lse - shift` inside which the one-pass merge is exact to the dtype's
    rounding, for p devices whose outputs' nonzero entries lie in `[out_min, out_max]` in
    magnitude.

    The merge sums p terms `e^x` (the denominator L) and p terms `e^x·out` (the numerator N),
    then divides. XLA:CPU flushes subnormal results to zero, so a result below `tiny` reads
    0. Three things must hold:

    * **No term, and no partial sum that matters, is flushed.** The numerator's terms may
      have opposite signs and cancel: `e^x·1 - e^x·0.9` is a tenth of each term, and a
      sum of terms that are each just above `tiny` flushes to 0 (the answer 0.05 read 0).
      So each nonzero term is held at least `tiny/ε` (ε the dtype's machine epsilon): a
      partial sum below `tiny` is then below ε times each of its terms, and flushing it
      errs by less than the rounding of the sum already allows (`ε·Σ|terms|`), the bound
      every merge meets. Low end: `e^x · min(out_min, 1) >= tiny/ε`, i.e.
      `x >= ln(tiny) + ln(1/ε) - min(ln out_min, 0)` (-71.39 in float32 for outputs of size
      at least 1, before the margin below; the earlier bound without `ln(1/ε)`, -87.34, let
      that sum flush).
    * **No sum overflows:** `p · e^x · max(out_max, 1) <= max`.
    * **The division stays exact:** XLA divides by a broadcast denominator as a
      multiplication by its reciprocal, and a subnormal reciprocal is flushed to zero (N/L
      would read 0), so `p · e^x <= 1/tiny`.

    High end: `x <= min(ln(max) - max(ln out_max, 0), -ln(tiny)) - ln(p)` (87.34 - ln p in
    float32 for outputs of size at most 1: 85.26 on 8 devices).

    Each end is then moved `WINDOW_MARGIN` (2^-8) inward, for the rounding of the test
    itself (85.25 on 8 devices; -71.39 at the bottom).

    `one_pass_combine` applies these bounds row by row, with each row's own smallest nonzero
    and largest `|out|`, and weighs each state by a split exponent (`states.lse_weight`), so
    that inside the window its error is the exact merge's, at any `|x|`.

    Args:
      dtype: a floating dtype (float16, bfloat16, float32 or float64).
      p: the number of devices, >= 1.
      out_max: a positive finite bound above the outputs' nonzero magnitudes.
      out_min: a positive finite bound below them.
    """
    validate.check_float_dtype(dtype)
    validate.check_positive(p, "p")
    out_max = validate.check_real(out_max, "out_max", low=0.0, low_open=True)
    out_min = validate.check_real(out_min, "out_min", low=0.0, low_open=True)
    tiny, big, top = _window_logs(dtype, p)
    low = tiny - min(math.log(out_min), 0.0)
    high = min(big - max(math.log(out_max), 0.0), top)
    return low, high


WINDOW_MARGIN = 2.0**-8
"""How far inside each of its three bounds `one_pass_window` keeps `x`: the test of a row
runs on a rounded `x = (lse - shift) + lse_lo` (off by half a unit in its last place and
`lse_lo`'s own half unit), against bounds rounded to the test's dtype, and `exp`, `log` and
the sum of p terms each add a few units more. 2^-8 is far more than all of them (under 1e-5
at |x| = 90 in float32), and costs nothing of the window's width that matters. Without it
a row exactly at the top bound, or a hair past it that rounds inside, had a subnormal
reciprocal and the merge returned 0."""


def _window_logs(dtype: DTypeLike, p: int) -> tuple[float, float, float]:
    """`one_pass_window`'s three constants for outputs of size one, each `WINDOW_MARGIN`
    inside: the lowest term `ln(tiny/ε)`, the largest sum `ln(max) - ln p`, and the
    largest denominator whose reciprocal is normal, `-ln(tiny) - ln p`."""
    info = jnp.finfo(dtype)
    tiny = math.log(float(info.tiny))
    return (
        tiny - math.log(float(info.eps)) + WINDOW_MARGIN,
        math.log(float(info.max)) - math.log(p) - WINDOW_MARGIN,
        -tiny - math.log(p) - WINDOW_MARGIN,
    )


def one_pass_combine(
    state: AttentionState, axes: Sequence[str], shift: float = 0.0
) -> AttentionState:
    """FlashDecoding++'s unified max: one Allreduce(sum) with a shared shift in place of the
    Allreduce(max).

    Every device weighs its state by `e^{lse - shift}` with the same fixed `shift`, so the
    numerators and denominators can be summed at once. That is exact to rounding while every
    term is at least `tiny/ε` (so no partial sum that cancels is flushed), no sum overflows
    and the denominator's reciprocal is normal (`one_pass_window`, with each row's own
    smallest nonzero and largest `|out|`); a device with a row outside its window raises a
    flag that travels in the same Allreduce, and if any flag is up all devices fall back to
    `allreduce_combine` (a conditional: the exact two-collective merge runs only then).
    """
    return one_pass_core(state, check_axes(state, axes), shift)


def one_pass_core(state: AttentionState, axes: Sequence[str], shift: float = 0.0) -> AttentionState:
    """`one_pass_combine` without its checks (the decoders' form)."""
    p = lax.axis_size(axes)
    dt = state.out.dtype
    ct = jnp.promote_types(dt, jnp.float32)  # the test runs in at least float32
    empty = jnp.isneginf(state.lse)
    x = (state.lse.astype(ct) - shift) + state.lse_lo.astype(ct)  # rounded: see the margin
    mag = jnp.abs(jnp.where(empty[..., None], jnp.zeros((), dt), state.out)).astype(ct)
    big = jnp.log(jnp.maximum(jnp.max(mag, axis=-1), 1.0))  # >= 0
    small = jnp.log(jnp.minimum(jnp.min(jnp.where(mag > 0, mag, 1.0), axis=-1), 1.0))  # <= 0
    low, top, recip = _window_logs(dt, p)
    outside = ~empty & ((x + small < low) | (x + big > top) | (x > recip))
    flag = jnp.any(outside).astype(dt)
    # The fast sums see the rows outside at the shift itself (weight 1): their result is
    # discarded (the flag is up), and an overflowed weight there would put inf, and through
    # its zero cotangent NaN, into the gradient.
    fast_state = AttentionState(
        state.out,
        jnp.where(outside, jnp.asarray(shift, state.lse.dtype), state.lse),
        jnp.where(outside, jnp.zeros((), state.lse_lo.dtype), state.lse_lo),
    )
    w = state_weight(fast_state, jnp.asarray(shift, dt))
    num, den, flag = psum_inner_first((weighted_out(w, state.out), w, flag), axes)

    def exact(_):
        return allreduce_core(state, axes)

    def fast(_):
        return from_parts(num, den, jnp.full(den.shape, shift, den.dtype))

    return lax.cond(flag > 0, exact, fast, None)


MERGES: dict[MergeName, Merge] = {
    "allreduce": allreduce_combine,
    "allgather": allgather_combine,
    "reduce_scatter": reduce_scatter_combine,
    "all_to_all": all_to_all_combine,
    "one_pass": one_pass_combine,
    "butterfly": butterfly_combine,
}
"""How `tree_decode` merges the devices' states (`merge=`), name -> merge:

* "allreduce": Allreduce(max) of the lse, then Allreduce(sum) of numerator and
  denominator (paper, Algorithm 3);
* "allgather": one all-gather of the states, then a local merge;
* "reduce_scatter": all-gather of the lse, reduce-scatter of the rescaled outputs over heads
  (vLLM/SGLang decode context parallelism);
* "all_to_all": one all-to-all over heads, then a local merge (TensorRT-LLM Helix);
* "one_pass": one Allreduce(sum) with a shared shift in place of the max, and an exact
  fallback when a device's lse leaves the safe window (FlashDecoding++'s unified max);
* "butterfly": recursive doubling with `ppermute`, log2 p exchange rounds of the states
  (a tree by construction, whatever algorithm the transport runs its all-reduce with).

All six compute the same attention (exact to rounding); only the collectives differ. The
head-scattered patterns leave each device with its own heads' output
(`P(None, None, seq_axes, None)`); the others are replicated.
"""
MERGE_CORES: dict[MergeName, Merge] = {
    "allreduce": allreduce_core,
    "allgather": allgather_core,
    "reduce_scatter": reduce_scatter_core,
    "all_to_all": all_to_all_core,
    "one_pass": one_pass_core,
    "butterfly": butterfly_core,
}
"""`MERGES` without their checks: what the decoders call, on states their own kernels made
inside their own `shard_map` (the checks ran once, at the decoder's door)."""
HEAD_SCATTERED: tuple[MergeName, ...] = ("reduce_scatter", "all_to_all")
"""Patterns whose result is split over query heads across the devices."""
VARYING_REPLICATED: tuple[MergeName, ...] = ("butterfly",)
"""Patterns whose result is the same on every device, bit for bit, but typed varying (it
comes from `ppermute`s, and JAX has no free cast to invariant): their `shard_map` declares
it replicated with `check_vma=False` (tests check that the copies are identical)."""
AUTO_MERGES: tuple[MergeName, ...] = tuple(
    m for m in MERGE_NAMES if m not in ("one_pass", "butterfly")
)
"""The patterns "auto" chooses from. "one_pass" is left out: its cost depends on the data
(past its window it runs the exact merge as well, and costs more than "allreduce").
"butterfly" is left out: the cost model prices its rounds by level
(`perf.links.butterfly_time`), but the regret of "auto" (its pick against each pattern it
could pick, timed in the same rounds) has not been measured with the butterfly among the
choices."""


class MergeProblem(NamedTuple):
    """What a merge policy sees of one decode: sizes, dtype and the sequence axes' sizes
    (outermost first), all static."""

    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    kv_len: int
    dtype: Any
    axis_sizes: tuple[int, ...]


MergePolicy = Callable[[MergeProblem], str]
"""What decides `merge="auto"`: a function of a `MergeProblem` that returns one of
`AUTO_MERGES`."""
DEFAULT_POLICY = "tree_attention_edu.perf.crossover:auto_merge"
"""Who decides `merge="auto"` when the caller passes no `merge_policy`: the cost model's
pick (`perf.crossover.auto_merge`), named here as a `module:function` path and imported
only when "auto" is asked for, so that the core imports nothing of `perf`."""


def default_policy() -> MergePolicy:
    """The function `DEFAULT_POLICY` names."""
    module, name = DEFAULT_POLICY.split(":")
    return getattr(importlib.import_module(module), name)


def resolve_merge(
    merge: MergeChoice, problem: MergeProblem, policy: MergePolicy | None = None
) -> MergeName:
    """The pattern a `merge=` argument names: itself, or, for "auto", `policy`'s choice
    (`default_policy()` when None)."""
    if merge != "auto":
        return merge
    choice = (policy or default_policy())(problem)
    if choice not in AUTO_MERGES:
        raise ValueError(
            f"the auto merge policy returned {choice!r}; it must return one of {AUTO_MERGES}."
        )
    return choice

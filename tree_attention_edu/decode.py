"""Sequence-parallel decoding: the KV cache is split along the sequence over mesh axes.

Four methods, one signature:

* `tree_decode` (paper, Algorithm 3): each device reduces its own shard to a partial state
  `(out, lse)`; the states meet in Allreduce(max) and Allreduce(sum). `B·Tq·Hq·(Dv+2)`
  numbers per device cross the wire, whatever the sequence length. `merge=` swaps those two
  Allreduces for the other patterns of today's serving systems (`MERGES`), all built from
  the same algebra in `states`, and "auto" lets `costmodel` choose.
* `tree_decode_from_energy` (paper, Algorithms 1-2): attention is `jax.grad` of the
  distributed energy `tree_energy`, whose forward pass reduces the max and then the sum-exp
  across devices and whose backward pass is one Allreduce(sum) (a custom VJP). The shard is
  streamed by the same kernel as `tree_decode`.
* `ring_decode` (Ring Attention, Liu et al. 2023): KV blocks travel around a ring of
  devices with `ppermute` for p−1 steps, each device folding every block into its online
  softmax. A `lax.scan` whose carry holds the block in use while the next is in flight: the
  strongest ring, and whole K/V shards still cross the wire.
* `ring_decode_pass_q` (Meta's context-parallel inference, arXiv 2411.01783): the queries
  travel the ring and the K/V stay put; the partial states go home in one all-to-all. The
  cheaper ring when `Tq·Hq ≪ Tk·Hkv`.

Queries are replicated; keys and values are sharded along axis 1 over `seq_axes`. A KV
length that is not a multiple of the device count is padded and masked here, never by the
user. With a 2-level mesh `("node", "gpu")`, tree reductions run over "gpu" first (inside
a node) and "node" second: the topology-aware schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _checks, costmodel, devices, kernels
from .attention import accum_dtype, finite_or_zero
from .kernels import _varying_like
from .states import (
    AttentionState,
    _allreduce_lse,
    _pack,
    _psum_inner_first,
    _unpack,
    _weighted_out,
    all_to_all_combine,
    allgather_combine,
    allreduce_combine,
    combine,
    heads_per_device,
    identity_state,
    merge_stacked,
    one_pass_combine,
    reduce_scatter_combine,
)


@dataclass(frozen=True)
class _Plan:
    """Static facts of one sharded decode, fixed at trace time."""

    mesh: Mesh
    axes: tuple[str, ...]
    p: int  # devices along the sequence
    shard_len: int  # keys per device after padding
    scale: float
    causal: bool
    kernel: str
    layout: str
    masked: bool  # some key is padding, or beyond a length, or causally hidden


def _prepare(q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel, layout):
    """Validate, pad K/V to a multiple of the device count, and fix the plan."""
    _check_mesh(mesh)
    dims = _checks.check_qkv(q, kernels.bthd_view(k, layout), kernels.bthd_view(v, layout),
                             kv_lengths)
    axes = _checks.check_seq_axes(seq_axes, tuple(mesh.axis_names))
    p = devices.axis_size(mesh, axes)
    pad = (-dims.kv_len) % p
    ragged = kv_lengths is not None and not _is_full(kv_lengths, dims)
    masked = bool(pad) or ragged or (causal and dims.q_len > 1)
    kernel = kernels.resolve(
        local_kernel, dtype=q.dtype, head_dim=dims.head_dim, v_dim=dims.v_dim,
        needs_mask=masked, layout=layout,
    )
    if kv_lengths is None:
        kv_lengths = jnp.full((dims.batch,), dims.kv_len, jnp.int32)
    # Under jit the range cannot be checked: clip, so the padding below is never visible and
    # every path reads a length outside [0, Tk] the way `attention` does.
    kv_lengths = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, dims.kv_len)
    if pad:
        widths = [(0, 0)] * 4
        widths[kernels.SEQ_AXIS[layout]] = (0, pad)
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    kv_sharding = NamedSharding(mesh, kv_spec(axes, layout))
    q, k, v = _on_mesh(q, NamedSharding(mesh, P())), _on_mesh(k, kv_sharding), _on_mesh(
        v, kv_sharding)
    kv_lengths = _on_mesh(kv_lengths, NamedSharding(mesh, P()))
    plan = _Plan(mesh, axes, p, (dims.kv_len + pad) // p,
                 _checks.resolve_scale(scale, dims.head_dim, q.dtype), bool(causal), kernel,
                 layout, masked)
    return plan, dims, q, k, v, kv_lengths


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            f"build one with tree_attention_edu.make_mesh(...)."
        )
    explicit = [name for name, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t != AxisType.Auto]
    if explicit:
        raise ValueError(
            f"`mesh` has axes {explicit} of type Explicit or Manual (jax.make_mesh's default); "
            f"the decoders run shard_map over Auto axes. Build the mesh with "
            f"tree_attention_edu.make_mesh(...), or jax.make_mesh(..., axis_types="
            f"(jax.sharding.AxisType.Auto,) * n)."
        )


def _on_mesh(x, sharding: NamedSharding):
    """A concrete array committed elsewhere (another device, another mesh) is moved onto the
    mesh, as `jit` would refuse it; uncommitted and traced values are left to `jit`."""
    try:
        if not (isinstance(x, jax.Array) and x.committed) or x.sharding == sharding:
            return x
    except (AttributeError, jax.errors.ConcretizationTypeError):
        return x
    return jax.device_put(x, sharding)


def _is_full(kv_lengths, dims) -> bool:
    """True if `kv_lengths` is concretely all `kv_len` (a traced value counts as not full)."""
    try:
        return bool(jnp.all(jnp.asarray(kv_lengths) == dims.kv_len))
    except jax.errors.ConcretizationTypeError:
        return False


def _shard_index(plan: _Plan) -> Array:
    return devices.shard_index(plan.mesh, plan.axes)


def _local(plan: _Plan, q, k, v, lengths, offset):
    # Unmasked, every key of the shard holds data and is visible (a single causal query sees
    # them all): the kernel then needs no lengths and selects nothing.
    return kernels.KERNELS[plan.kernel](
        q, k, v, kv_offset=offset, scale=plan.scale, causal=plan.causal and plan.masked,
        kv_lengths=lengths if plan.masked else None, layout=plan.layout,
    )


def kv_spec(axes: Sequence[str], layout: str = "bthd") -> P:
    """PartitionSpec of a K or V array sharded along its sequence axis over mesh `axes`."""
    spec = [None] * (kernels.SEQ_AXIS[layout] + 1)
    spec[-1] = tuple(axes)
    return P(*spec)


def _specs(plan: _Plan):
    kv = kv_spec(plan.axes, plan.layout)
    return (P(), kv, kv, P())


MERGES = costmodel.MERGES
"""How `tree_decode` merges the devices' states (`merge=`; "auto" asks `costmodel`):

* "allreduce": Allreduce(max) of the lse, then Allreduce(sum) of numerator and
  denominator (paper, Algorithm 3);
* "allgather": one all-gather of the states, then a local merge;
* "reduce_scatter": all-gather of the lse, reduce-scatter of the rescaled outputs over heads
  (vLLM/SGLang decode context parallelism);
* "all_to_all": one all-to-all over heads, then a local merge (TensorRT-LLM Helix);
* "one_pass": one Allreduce(sum) with a shared shift in place of the max, and an exact
  fallback when a device's lse leaves the safe window (FlashDecoding++'s unified max).

All five compute the same attention (exact to rounding); only the collectives differ. The
head-scattered patterns leave each device with its own heads' output, so their result is
sharded over heads (`P(None, None, seq_axes, None)`); the others are replicated.
"""
HEAD_SCATTERED = ("reduce_scatter", "all_to_all")
_COMBINE = {
    "allreduce": allreduce_combine,
    "allgather": allgather_combine,
    "reduce_scatter": reduce_scatter_combine,
    "all_to_all": all_to_all_combine,
    "one_pass": one_pass_combine,
}


@functools.lru_cache(maxsize=64)
def _tree_fn(plan: _Plan, merge: str = "allreduce") -> Callable:
    def body(q, k, v, lengths):
        state = _local(plan, q, k, v, lengths, _shard_index(plan) * plan.shard_len)
        return _COMBINE[merge](state, plan.axes).out.astype(q.dtype)

    if merge not in HEAD_SCATTERED:
        # An all-gather's result is the same on every device, but it is typed as varying.
        return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan),
                                     out_specs=P(), check_vma=merge != "allgather"))
    scattered = jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan),
                              out_specs=P(None, None, plan.axes, None))

    def run(q, k, v, lengths):  # [B, Tq, Hs·p, Dv] over the devices: drop the padded heads
        out = scattered(q, k, v, lengths)
        if out.shape[2] == q.shape[2]:
            return out  # each device keeps its own heads: no further collective
        # Heads that p does not divide cannot be split evenly: one all-gather replicates them.
        return lax.with_sharding_constraint(out, NamedSharding(plan.mesh, P()))[:, :, :q.shape[2]]

    return jax.jit(run)


def _ring_perm(plan: _Plan) -> list[tuple[int, int]]:
    return [(i, (i + 1) % plan.p) for i in range(plan.p)]


@functools.lru_cache(maxsize=64)
def _ring_fn(plan: _Plan) -> Callable:
    perm = _ring_perm(plan)

    def body(q, k, v, lengths):
        idx = _shard_index(plan)

        def visit(state, k, v, step):  # fold the block that started on device idx − step
            block = _local(plan, q, k, v, lengths, ((idx - step) % plan.p) * plan.shard_len)
            return combine(state, block)

        def step(carry, i):
            k, v, state = carry
            # Send the block onwards before computing on it: the permute's buffer is the only
            # other block alive, and the transfer overlaps the compute.
            k_next, v_next = lax.ppermute((k, v), plan.axes, perm)
            return (k_next, v_next, visit(state, k, v, i)), None

        state = _varying_like(_empty_state(plan, q, v), k)
        (k, v, state), _ = lax.scan(step, (k, v, state), jnp.arange(plan.p - 1))
        return visit(state, k, v, plan.p - 1).out.astype(q.dtype)

    # Every device ends with the same answer, but ppermute outputs are typed as varying,
    # so the replicated out_spec cannot be checked statically.
    return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan), out_specs=P(),
                                 check_vma=False))


def _empty_state(plan: _Plan, q, v) -> AttentionState:
    B, Tq, Hq, _ = q.shape
    return identity_state(B, Tq, Hq, v.shape[-1], accum_dtype(q.dtype))


@functools.lru_cache(maxsize=64)
def _pass_q_fn(plan: _Plan) -> Callable:
    perm = _ring_perm(plan)
    head_axis = 3 - kernels.SEQ_AXIS[plan.layout]  # 2 in "bthd", 1 in "bhtd"

    def body(q, k, v, lengths):
        idx = _shard_index(plan)
        B, Tq, Hq, D = q.shape
        hkv = k.shape[head_axis]
        group = Hq // hkv
        hs = heads_per_device(hkv, plan.p)  # kv heads per query block
        # Query blocks by kv head, padded with zero queries: [p, B, Tq, Hs·G, D].
        qb = jnp.pad(q.reshape(B, Tq, hkv, group, D),
                     [(0, 0), (0, 0), (0, hs * plan.p - hkv), (0, 0), (0, 0)])
        qb = jnp.moveaxis(qb.reshape(B, Tq, plan.p, hs * group, D), 2, 0)
        # A padded block reads the last real heads (the slice start is clamped); its queries
        # are dropped at the end.
        start = jnp.minimum(jnp.arange(plan.p) * hs, hkv - hs)

        def partial(q_blk, block):  # this shard's state for query block `block`
            offset = idx * plan.shard_len
            if plan.kernel == "xla":  # the kernel reads the window block by block: no copy
                return kernels.xla_state(
                    q_blk, k, v, kv_offset=offset, scale=plan.scale,
                    causal=plan.causal and plan.masked,
                    kv_lengths=lengths if plan.masked else None, layout=plan.layout,
                    kv_head_window=(start[block], hs))
            kb = lax.dynamic_slice_in_dim(k, start[block], hs, head_axis)
            vb = lax.dynamic_slice_in_dim(v, start[block], hs, head_axis)
            return _local(plan, q_blk, kb, vb, lengths, offset)

        def step(q_blk, i):
            q_next = lax.ppermute(q_blk, plan.axes, perm)  # in flight during the compute
            return q_next, _pack(partial(q_blk, (idx - i) % plan.p))

        q_blk = qb[idx]  # every device starts with its own block of queries
        q_blk, parts = lax.scan(step, q_blk, jnp.arange(plan.p - 1))
        last = _pack(partial(q_blk, (idx + 1) % plan.p))
        parts = jnp.concatenate([parts, last[None]])  # by step: block (idx − step) mod p
        by_block = parts[(idx - jnp.arange(plan.p)) % plan.p]
        # The partial states go home (block j to device j), are merged there, and the finished
        # outputs are shared.
        mine = merge_stacked(_unpack(lax.all_to_all(by_block, plan.axes, 0, 0, tiled=True)))
        out = lax.all_gather(mine.out, plan.axes, axis=0, tiled=False)  # [p, B, Tq, Hs·G, Dv]
        out = jnp.moveaxis(out, 0, 2).reshape(B, Tq, plan.p * hs, group, -1)
        return out[:, :, :hkv].reshape(B, Tq, Hq, -1).astype(q.dtype)

    return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan), out_specs=P(),
                                 check_vma=False))


@functools.lru_cache(maxsize=64)
def _energy_sharded(plan: _Plan) -> Callable:
    """F(ζ) of the whole cache on every device, streamed by the xla kernel, with a custom
    VJP whose ζ-cotangent is Algorithm 2: `Σ_devices e^{lse_i − lse} out_i`, one Allreduce(sum)
    of values each device already holds."""

    def local(q, k, v, lengths, zeta):  # the shard's state under the tilted scores s + ζ·v
        return kernels.xla_state(
            q, k, v, kv_offset=_shard_index(plan) * plan.shard_len, scale=plan.scale,
            causal=plan.causal and plan.masked, kv_lengths=lengths if plan.masked else None,
            layout=plan.layout, zeta=zeta)

    def total(lse, lse_lo):  # a row that sees no key adds 0 to F
        return jnp.sum(jnp.where(jnp.isneginf(lse), jnp.zeros_like(lse), lse + lse_lo))

    def plain(q, k, v, lengths, zeta):  # the same energy, for autodiff in q, k and v
        return total(*_allreduce_lse(local(q, k, v, lengths, zeta), plan.axes))

    @jax.custom_vjp
    def energy(q, k, v, lengths, zeta):
        return plain(q, k, v, lengths, zeta)

    def forward(q, k, v, lengths, zeta):
        state = local(q, k, v, lengths, zeta)
        lse, lse_lo = _allreduce_lse(state, plan.axes)
        return total(lse, lse_lo), (q, k, v, lengths, zeta, state, lse, lse_lo)

    def backward(res, g):
        q, k, v, lengths, zeta, state, lse, lse_lo = res
        # Algorithm 2: this shard's share of each row's weights, times its tilted mean of v.
        w = jnp.exp((state.lse - finite_or_zero(lse)) + (state.lse_lo - lse_lo))
        num = _psum_inner_first(_weighted_out(w, state.out), plan.axes)
        # q, k and v: autodiff of the same energy (compiled away when only ζ is asked for).
        _, pullback = jax.vjp(lambda q, k, v: plain(q, k, v, lengths, zeta), q, k, v)
        return (*pullback(g), None, g * num)

    energy.defvjp(forward, backward)
    return jax.shard_map(energy, mesh=plan.mesh, in_specs=(*_specs(plan), P()), out_specs=P())


@functools.lru_cache(maxsize=64)
def _energy_fn(plan: _Plan) -> Callable:
    sharded = _energy_sharded(plan)
    return jax.jit(lambda q, k, v, lengths, zeta: jax.grad(sharded, argnums=4)(
        q, k, v, lengths, zeta).astype(q.dtype))


@functools.lru_cache(maxsize=64)
def _energy_value_fn(plan: _Plan) -> Callable:
    return jax.jit(_energy_sharded(plan))


_DOC_ARGS = """
    Args:
      q: `[B, Tq, Hq, D]` queries, replicated on every device.
      k: `[B, Tk, Hkv, D]` keys (or `[B, Hkv, Tk, D]` with `layout="bhtd"`), sharded (or
        to be sharded) along Tk over `seq_axes`.
      v: `[B, Tk, Hkv, Dv]` values (or `[B, Hkv, Tk, Dv]`), sharded like `k`.
      mesh: a `jax.sharding.Mesh` (see `make_mesh`).
      seq_axes: mesh axes the sequence is split over, outermost first (default: all).
      scale: score scale; `None` means `1/sqrt(D)`.
      causal: decode-convention causal mask (query i at position `L_b - Tq + i`).
      kv_lengths: `[B]` ints in `[0, Tk]`; keys at positions `>= kv_lengths[b]` are masked
        and may hold anything (NaN included). The range is checked when the lengths are
        concrete; under `jax.jit` they are clipped to `[0, Tk]`, as `attention` reads them.
      local_kernel: "auto", "xla", "flash" or "cudnn" (see `tree_attention_edu.kernels`).
      layout: "bthd" (default) or "bhtd", the head-major cache layout that the xla kernel
        streams fastest (see `tree_attention_edu.kernels`).

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype, replicated (empty if `B` or `Tq` is 0). Traceable
      under `jax.jit`, and differentiable in q, k and v (`jax.grad`): the shared max is a
      shift that carries no gradient, so only the sums are differentiated.
"""


def _decode(make: Callable, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
            layout="bthd", extra=(), merge=None):
    plan, dims, q, k, v, lengths = _prepare(q, k, v, mesh, seq_axes, scale, causal,
                                            kv_lengths, local_kernel, layout)
    if dims.batch == 0 or dims.q_len == 0:  # nothing to attend: an empty result, no collective
        return jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), q.dtype)
    if merge is None:
        return make(plan)(q, k, v, lengths, *extra)
    if merge == "auto":
        merge = auto_merge(plan.mesh, plan.axes, dims, q.dtype)
    return make(plan, merge)(q, k, v, lengths, *extra)


AUTO_MERGES = tuple(m for m in MERGES if m != "one_pass")
"""The patterns "auto" chooses from. "one_pass" is left out: its cost depends on the data
(past its window it runs the exact merge as well, and costs more than "allreduce")."""


def auto_merge(mesh: Mesh, axes: Sequence[str], dims: _checks.Dims, dtype) -> str:
    """The merge pattern `costmodel.best_merge` predicts fastest for this problem, among
    `AUTO_MERGES`, on DGX H100 links shaped like the mesh: the innermost sequence axis inside
    a node, the others across nodes."""
    sizes = [mesh.shape[a] for a in axes]
    per_node = sizes[-1]
    topo = dataclasses.replace(costmodel.DGX_H100, nodes=math.prod(sizes) // per_node,
                               devices_per_node=per_node)
    return costmodel.best_merge(
        dims.kv_len, topo, batch=dims.batch, q_heads=dims.q_heads, kv_heads=dims.kv_heads,
        head_dim=dims.head_dim, v_dim=dims.v_dim, itemsize=jnp.dtype(dtype).itemsize,
        q_len=dims.q_len, stat_itemsize=accum_dtype(dtype).itemsize, patterns=AUTO_MERGES)


def tree_decode(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "auto", layout: str = "bthd", merge: str = "allreduce",
) -> Array:
    _checks.check_choice(merge, (*MERGES, "auto"), "merge")
    return _decode(_tree_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
                   layout, merge=merge)


def ring_decode(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "auto", layout: str = "bthd",
) -> Array:
    return _decode(_ring_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
                   layout)


def ring_decode_pass_q(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "auto", layout: str = "bthd",
) -> Array:
    return _decode(_pass_q_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths,
                   local_kernel, layout)


def tree_decode_from_energy(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "xla", layout: str = "bthd",
) -> Array:
    _checks.check_kernel_name(local_kernel, kernels.KERNEL_NAMES)
    dims = _checks.check_qkv(q, kernels.bthd_view(k, layout), kernels.bthd_view(v, layout),
                             kv_lengths)
    if local_kernel in ("flash", "cudnn"):
        raise ValueError(f"`local_kernel`={local_kernel!r}: tree_decode_from_energy "
                         "differentiates the energy in JAX and has no flash or cudnn kernel. "
                         "Use local_kernel='xla' (or tree_decode for flash or cudnn).")
    zeta = jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), accum_dtype(q.dtype))
    return _decode(_energy_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, "xla",
                   layout, extra=(zeta,))


def tree_energy(
    q: Array, k: Array, v: Array, zeta: Array, *, mesh: Mesh,
    seq_axes: str | Sequence[str] | None = None, scale: float | None = None,
    causal: bool = False, kv_lengths: Array | None = None, layout: str = "bthd",
) -> Array:
    """The energy F(ζ) of the whole sharded cache (paper, Algorithm 1), streamed by the xla
    kernel, as a scalar replicated on every device; `energy.energy` of the same arguments.

    Its gradient in ζ is Algorithm 2 (a custom VJP: one Allreduce(sum) of the states the
    forward pass left on each device), so `jax.grad(tree_energy, argnums=3)` at ζ = 0 is
    attention: `tree_decode_from_energy`. Gradients in q, k and v are JAX's autodiff of the
    same streaming computation.

    The other arguments are those of `tree_decode` (the kernel is always "xla").

    Args:
      zeta: `[B, Tq, Hq, Dv]` the source, shaped like the attention output.

    Returns:
      A scalar in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    dims = _checks.check_qkv(q, kernels.bthd_view(k, layout), kernels.bthd_view(v, layout),
                             kv_lengths)
    _checks.check_zeta(zeta, dims)
    acc = accum_dtype(q.dtype)
    plan, dims, q, k, v, lengths = _prepare(q, k, v, mesh, seq_axes, scale, causal,
                                            kv_lengths, "xla", layout)
    if dims.batch == 0 or dims.q_len == 0:
        return jnp.zeros((), acc)
    return _energy_value_fn(plan)(q, k, v, lengths, jnp.asarray(zeta, acc))


tree_decode.__doc__ = """Tree decoding: local states, then Allreduce(max) and Allreduce(sum).

    `merge` chooses how the states meet (see `MERGES`): "allreduce" (default, the paper's),
    "allgather", "reduce_scatter", "all_to_all", "one_pass", or "auto" (the fastest by
    `costmodel.best_merge` on DGX H100 links shaped like the mesh, among `AUTO_MERGES`).
    "reduce_scatter" and "all_to_all" leave each device with its own heads: the result is
    sharded over heads (`P(None, None, seq_axes, None)`) when p divides Hq, and replicated
    by one more all-gather when it does not.
""" + _DOC_ARGS
ring_decode.__doc__ = """Ring Attention decoding: K/V blocks pass around the ring for p−1 steps.

    Faithful to Ring Attention (Liu, Zaharia, Abbeel 2023) for one query block per device:
    each device starts from its own shard and, at every step, forwards the block it holds
    to its ring neighbour while folding that block into its online-softmax state. The loop
    is a `lax.scan` with two K/V buffers alive, the block in use and the one in flight (the
    device's own shard is an argument and is never overwritten: the cache outlives the step),
    so the compiled temp is two shards plus the kernel's block buffers. (XLA copies the
    loop-carried block before sending it, as the permute's result takes the same loop slot;
    on the 8 simulated CPU devices that copy made the loop 6-19% slower than the unrolled
    ring it replaces, which held four shards.)
""" + _DOC_ARGS
ring_decode_pass_q.__doc__ = """Pass-Q ring decoding: the queries travel, the K/V stay put.

    The query heads are split into p blocks by kv head (`ceil(Hkv/p)` kv heads each, padded
    with zero queries). Device i starts with block i; at every step it forwards its query
    block to its ring neighbour while computing that block's partial state against its own
    shard (the kernel reads just those heads' window of the cache). After p steps each device
    holds one partial state of every block: one all-to-all sends block j's partials to device
    j, which merges them, and one all-gather shares the finished outputs. `(p−1)·B·Tq·Hq·D/p`
    query elements travel instead of `(p−1)·B·Tk·Hkv·(D+Dv)/p` cache elements.
""" + _DOC_ARGS
tree_decode_from_energy.__doc__ = """Attention as `jax.grad` of the tree-reduced energy (Alg. 1-2).

    The forward pass reduces the max and then the sum-exp across devices; the backward pass
    that `jax.grad` derives is Algorithm 2: local `exp(r - lse)·v`, one Allreduce(sum).
""" + _DOC_ARGS

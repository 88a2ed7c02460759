"""Sequence-parallel decoding: the KV cache is split along the sequence over mesh axes.

Three methods, one signature:

* `tree_decode` (paper, Algorithm 3): each device reduces its own shard to a partial state
  `(out, lse)`; the states meet in Allreduce(max) and Allreduce(sum). `B·Tq·Hq·(Dv+2)`
  numbers per device cross the wire, whatever the sequence length.
* `tree_decode_from_energy` (paper, Algorithms 1-2): the energy is reduced across devices
  with max then sum Allreduces, and attention is `jax.grad` of that distributed energy.
* `ring_decode` (Ring Attention, Liu et al. 2023): KV blocks travel around a ring of
  devices with `ppermute` for p−1 steps, each device folding every block into its online
  softmax. Whole K/V shards cross the wire: the baseline.

Queries are replicated; keys and values are sharded along axis 1 over `seq_axes`. A KV
length that is not a multiple of the device count is padded and masked here, never by the
user. With a 2-level mesh `("node", "gpu")`, tree reductions run over "gpu" first (inside
a node) and "node" second: the topology-aware schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _checks, devices, kernels
from .energy import energy_terms
from .states import allreduce_combine, combine


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


@functools.lru_cache(maxsize=64)
def _tree_fn(plan: _Plan) -> Callable:
    def body(q, k, v, lengths):
        state = _local(plan, q, k, v, lengths, _shard_index(plan) * plan.shard_len)
        return allreduce_combine(state, plan.axes).out.astype(q.dtype)

    return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan), out_specs=P()))


@functools.lru_cache(maxsize=64)
def _ring_fn(plan: _Plan) -> Callable:
    perm = [(i, (i + 1) % plan.p) for i in range(plan.p)]

    def body(q, k, v, lengths):
        idx = _shard_index(plan)
        state = None
        for step in range(plan.p):
            if step < plan.p - 1:  # send the block onwards before computing on it (overlap)
                k_next = lax.ppermute(k, plan.axes, perm)
                v_next = lax.ppermute(v, plan.axes, perm)
            src = (idx - step) % plan.p  # the device whose shard we hold at this step
            block = _local(plan, q, k, v, lengths, src * plan.shard_len)
            state = block if state is None else combine(state, block)
            if step < plan.p - 1:
                k, v = k_next, v_next
        return state.out.astype(q.dtype)

    # Every device ends with the same answer, but ppermute outputs are typed as varying,
    # so the replicated out_spec cannot be checked statically.
    return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=_specs(plan), out_specs=P(),
                                 check_vma=False))


@functools.lru_cache(maxsize=64)
def _energy_fn(plan: _Plan) -> Callable:
    def body(q, k, v, lengths, zeta):
        return energy_terms(q, k, v, zeta, scale=plan.scale, causal=plan.causal and plan.masked,
                            kv_lengths=lengths if plan.masked else None,
                            kv_offset=_shard_index(plan) * plan.shard_len, axes=plan.axes)

    energy = jax.shard_map(body, mesh=plan.mesh, in_specs=(*_specs(plan), P()), out_specs=P())
    return jax.jit(lambda q, k, v, lengths, zeta: jax.grad(energy, argnums=4)(
        q, k, v, lengths, zeta).astype(q.dtype))


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
      local_kernel: "auto", "xla" or "flash" (see `tree_attention_edu.kernels`).
      layout: "bthd" (default) or "bhtd", the head-major cache layout that the xla kernel
        streams fastest (see `tree_attention_edu.kernels`).

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype, replicated (empty if `B` or `Tq` is 0). Traceable
      under `jax.jit`, and differentiable in q, k and v (`jax.grad`): the shared max is a
      shift that carries no gradient, so only the sums are differentiated.
"""


def _decode(make: Callable, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
            layout="bthd", extra=()):
    plan, dims, q, k, v, lengths = _prepare(q, k, v, mesh, seq_axes, scale, causal,
                                            kv_lengths, local_kernel, layout)
    if dims.batch == 0 or dims.q_len == 0:  # nothing to attend: an empty result, no collective
        return jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), q.dtype)
    return make(plan)(q, k, v, lengths, *extra)


def tree_decode(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "auto", layout: str = "bthd",
) -> Array:
    return _decode(_tree_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
                   layout)


def ring_decode(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "auto", layout: str = "bthd",
) -> Array:
    return _decode(_ring_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, local_kernel,
                   layout)


def tree_decode_from_energy(
    q: Array, k: Array, v: Array, *, mesh: Mesh, seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None, causal: bool = False, kv_lengths: Array | None = None,
    local_kernel: str = "xla", layout: str = "bthd",
) -> Array:
    _checks.check_kernel_name(local_kernel, kernels.KERNEL_NAMES)
    dims = _checks.check_qkv(q, kernels.bthd_view(k, layout), kernels.bthd_view(v, layout),
                             kv_lengths)
    if local_kernel == "flash":
        raise ValueError("`local_kernel`='flash': tree_decode_from_energy differentiates the "
                         "energy in JAX and has no flash kernel. Use local_kernel='xla' (or "
                         "tree_decode for flash).")
    # The energy is written for "bthd"; a head-major cache is viewed in that order (a copy).
    k, v = kernels.to_layout(k, layout, "bthd"), kernels.to_layout(v, layout, "bthd")
    zeta = jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim),
                     jnp.promote_types(q.dtype, jnp.float32))
    return _decode(_energy_fn, q, k, v, mesh, seq_axes, scale, causal, kv_lengths, "xla",
                   extra=(zeta,))


tree_decode.__doc__ = """Tree decoding: local states, then Allreduce(max) and Allreduce(sum).
""" + _DOC_ARGS
ring_decode.__doc__ = """Ring Attention decoding: K/V blocks pass around the ring for p−1 steps.

    Faithful to Ring Attention (Liu, Zaharia, Abbeel 2023) for one query block per device:
    each device starts from its own shard and, at every step, forwards the block it holds
    to its ring neighbour while folding that block into its online-softmax state.
""" + _DOC_ARGS
tree_decode_from_energy.__doc__ = """Attention as `jax.grad` of the tree-reduced energy (Alg. 1-2).

    The forward pass reduces the max and then the sum-exp across devices; the backward pass
    that `jax.grad` derives is Algorithm 2: local `exp(r - lse)·v`, one Allreduce(sum).
""" + _DOC_ARGS

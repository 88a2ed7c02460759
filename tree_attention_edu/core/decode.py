"""Sequence-parallel decoding: the KV cache is split along the sequence over mesh axes.

Four methods, one signature:

* `tree_decode` (paper, Algorithm 3): each device reduces its own shard to a partial state
  `(out, lse)`; the states meet in Allreduce(max) and Allreduce(sum). `B·Tq·Hq·(Dv+2)`
  numbers per device cross the wire, whatever the sequence length. `merge=` swaps those two
  Allreduces for the other patterns of today's serving systems (`core.merges.MERGES`).
* `tree_decode_from_energy` (paper, Algorithms 1-2): attention is `jax.grad` of the
  distributed energy `tree_energy`, whose forward pass reduces the max and then the sum-exp
  across devices and whose backward pass is one Allreduce(sum) (a custom VJP).
* `ring_decode` (Ring Attention, Liu et al. 2023): KV blocks travel around a ring of
  devices with `ppermute` for p−1 steps, each device folding every block into its online
  softmax. With one query block per device (decoding), every device folds all p blocks: p
  times the tree's local work, plus whole K/V shards on the wire.
* `ring_decode_pass_q` (Meta's context-parallel inference, arXiv 2411.01783): the queries
  travel the ring and the K/V stay put; the partial states go home in one all-to-all. Each
  device computes each query block once: no redundant compute.

Queries are replicated; keys and values are sharded along the sequence over `seq_axes` in
equal shards, so the cache's length must be a multiple of their device count (`pad_cache`
pads once). Every public function here is a jitted program of its static arguments: the
same program eagerly, under `jax.jit` and under `jax.grad`, and it never inspects a value.
With a 2-level mesh `("node", "gpu")`, tree reductions run over "gpu" first (inside a
node) and "node" second: the topology-aware schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from . import devices, inputs, kernels, masks, merges, validate
from .names import KernelChoice, KernelName, Layout, MergeChoice, MergeName
from .numerics import accum_dtype
from .states import (
    AttentionState,
    combine_core,
    from_parts,
    identity_core,
    merge_stacked,
    state_weight,
    weighted_out,
)


@dataclass(frozen=True)
class Plan:
    """The static facts of one sharded decode, fixed before tracing (hashable: a `jit`
    static argument)."""

    mesh: Mesh
    axes: tuple[str, ...]  # mesh axes the sequence is split over, outermost first
    p: int  # devices along the sequence
    shard_len: int  # keys per device
    scale: float
    causal: bool
    kernel: KernelName  # a concrete name of `kernels.CORES`
    layout: Layout
    masked: bool  # kv_lengths were given, or a causal mask over several queries

    @property
    def kv_spec(self) -> P:
        return kv_spec(self.axes, self.layout)

    def local(self, q: Array, k: Array, v: Array, lengths: Array, **kw: Any) -> AttentionState:
        """Inside `shard_map`: this device's state for its own shard. Unmasked, every key of
        the shard holds data and is visible (a single causal query sees them all), and the
        kernel is given no lengths."""
        offset = devices.shard_index(self.mesh, self.axes) * self.shard_len
        return kernels.CORES[self.kernel](
            q,
            k,
            v,
            kv_offset=offset,
            scale=self.scale,
            causal=self.causal and self.masked,
            kv_lengths=lengths if self.masked else None,
            layout=self.layout,
            **kw,
        )


def kv_spec(axes: Sequence[str], layout: Layout = "bthd") -> P:
    """PartitionSpec of a K or V array sharded along its sequence axis over mesh `axes`."""
    spec: list[Any] = [None] * (inputs.SEQ_AXIS[layout] + 1)
    spec[-1] = tuple(axes)
    return P(*spec)


def make_plan(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh | None,
    seq_axes: str | Sequence[str] | None,
    scale: float | None,
    causal: bool,
    kv_lengths: Array | None,
    local_kernel: KernelChoice,
    layout: Layout,
) -> tuple[Plan, inputs.Dims]:
    """Check every argument (shapes, dtypes and static values only) and fix the plan: the
    decoders' one door. What runs after it, inside `jit` and `shard_map`, calls the
    unchecked forms (`kernels.CORES`, `merges.MERGE_CORES`, `states.combine_core`)."""
    dims = inputs.check_qkv(q, k, v, kv_lengths, layout=layout)
    the_mesh: Any = devices.resolve_mesh(mesh)  # a Mesh, or the abstract mesh of set_mesh
    axes = devices.check_seq_axes(seq_axes, the_mesh)
    validate.check_bool(causal, "causal")
    p = devices.axis_size(the_mesh, axes)
    devices.check_divisible(dims.kv_len, p, axes)
    masked = kv_lengths is not None or (causal and dims.q_len > 1)
    # The kernels compute in the common dtype (a bfloat16 q with a float64 cache is float64
    # work), so that is what decides whether flash or cudnn can take it.
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    kernel = kernels.resolve(
        kernels.check_name(local_kernel),
        dtype=dtype,
        head_dim=dims.head_dim,
        v_dim=dims.v_dim,
        needs_mask=masked,
        layout=layout,
    )
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    return Plan(
        the_mesh, axes, p, dims.kv_len // p, scale, bool(causal), kernel, layout, masked
    ), dims


def _sharded(
    plan: Plan,
    body: Callable[..., Any],
    out_specs: Any,
    q: Array,
    k: Array,
    v: Array,
    kv_lengths: Array | None,
    *extra: Array,
    check_vma: bool = True,
) -> Any:
    """Run `body(q, k, v, lengths, *extra)` under `shard_map`: q, the lengths and `extra`
    replicated, K and V sharded along the sequence. On an Explicit mesh the inputs are
    resharded first (`jax.reshard`); on an Auto mesh `jit` places them. `check_vma=False`
    only for a body whose replicated output is identical on every device by construction
    (`merges.VARYING_REPLICATED`)."""
    lengths = masks.clamp_lengths(kv_lengths, q.shape[0], plan.p * plan.shard_len)
    args = (q, k, v, lengths, *extra)
    specs = (P(), plan.kv_spec, plan.kv_spec, P(), *(P() for _ in extra))
    if devices.is_explicit(plan.mesh):
        args = tuple(
            jax.reshard(x, NamedSharding(plan.mesh, s)) for x, s in zip(args, specs, strict=True)
        )
    return jax.shard_map(
        body, mesh=plan.mesh, in_specs=specs, out_specs=out_specs, check_vma=check_vma
    )(*args)


def _place(plan: Plan, q: Any, k: Any, v: Any, kv_lengths: Any, *extra: Any) -> tuple:
    """Arrays already placed on other devices than the mesh's (committed to one device, or
    sharded on another mesh) are moved onto it, as `jit` would place uncommitted ones.
    Under an outer `jit` the arguments are traced and cannot be moved here: arguments of
    that outer program committed to other devices than the mesh's (one device, another
    order) are refused by JAX itself ("incompatible devices"); place them on the mesh, or
    leave them uncommitted, before calling it.

    `jit` needs the mesh's devices *in its order*: the same devices in another order (a
    mesh built from a reversed device list) are refused as "incompatible devices", so an
    array is kept as it is only on a mesh whose flat device list equals this one's (or on
    this mesh's only device); there `jit` reshards it, if it must, inside the program."""
    want = tuple(plan.mesh.devices.flat) if isinstance(plan.mesh, Mesh) else None
    specs = (P(), plan.kv_spec, plan.kv_spec, P(), *(P() for _ in extra))

    def same_devices(sharding: jax.sharding.Sharding) -> bool:
        if isinstance(sharding, NamedSharding):
            return tuple(sharding.mesh.devices.flat) == want
        # Other shardings do not say their order publicly: only one device is unambiguous.
        return len(sharding.device_set) == 1 and tuple(sharding.device_set) == want

    def place(x: Any, spec: P) -> Any:
        if (
            want is None
            or not isinstance(x, jax.Array)
            or isinstance(x, jax.core.Tracer)
            or not x.is_fully_addressable
            or same_devices(x.sharding)
        ):
            return x
        return jax.device_put(x, NamedSharding(plan.mesh, spec))

    return tuple(place(x, s) for x, s in zip((q, k, v, kv_lengths, *extra), specs, strict=True))


def _nothing_to_attend(dims: inputs.Dims) -> bool:
    """An empty output (no batch, query or head): no collective runs."""
    return dims.batch == 0 or dims.q_len == 0 or dims.q_heads == 0


def _empty(dims: inputs.Dims, dtype: DTypeLike) -> Array:
    return jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), dtype)


# --- tree --------------------------------------------------------------------------------


def _merge_problem(plan: Plan, dims: inputs.Dims, dtype: DTypeLike) -> merges.MergeProblem:
    """What `merge="auto"`'s policy decides from: the problem's sizes and the mesh."""
    return merges.MergeProblem(
        dims.batch,
        dims.q_len,
        dims.q_heads,
        dims.kv_heads,
        dims.head_dim,
        dims.v_dim,
        dims.kv_len,
        jnp.dtype(dtype),
        tuple(plan.mesh.shape[a] for a in plan.axes),
    )


def tree_decode(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh | None = None,
    seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    local_kernel: KernelChoice = "auto",
    layout: Layout = "bthd",
    merge: MergeChoice = "allreduce",
    merge_policy: merges.MergePolicy | None = None,
) -> Array:
    """Tree decoding (paper, Algorithm 3): local states, then Allreduce(max) and
    Allreduce(sum).

    Args:
      q: `[B, Tq, Hq, D]` queries, replicated on every device.
      k: `[B, Tk, Hkv, D]` keys (or `[B, Hkv, Tk, D]` with `layout="bhtd"`), sharded (or
        to be sharded) along Tk over `seq_axes`; Tk must be a multiple of their device
        count (`pad_cache` pads a cache once).
      v: `[B, Tk, Hkv, Dv]` values (or `[B, Hkv, Tk, Dv]`), sharded like `k`.
      mesh: a `jax.sharding.Mesh` with Auto (`make_mesh`) or Explicit (`jax.make_mesh`)
        axes; `None` uses the mesh of `jax.set_mesh`.
      seq_axes: mesh axes the sequence is split over, outermost first (default: all).
      scale: score scale; `None` means `1/sqrt(D)`.
      causal: decode-convention causal mask (query i at position `L_b - Tq + i`).
      kv_lengths: `[B]` ints; keys at positions `>= kv_lengths[b]` are masked and may hold
        anything (NaN included). Clamped into `[0, Tk]`, never inspected.
      local_kernel: "auto", "xla", "flash" or "cudnn" (see `core.kernels`).
      layout: "bthd" (default) or "bhtd", the head-major layout the xla kernel streams
        fastest.
      merge: how the states meet (`core.merges.MERGES`): "allreduce" (the paper's),
        "allgather", "reduce_scatter", "all_to_all", "one_pass", or "auto" (the pattern
        `merge_policy` picks). "reduce_scatter" and "all_to_all" leave each device with its
        own heads (`P(None, None, seq_axes, None)`) when p divides Hq.
      merge_policy: who decides `merge="auto"`: a function of a `merges.MergeProblem` that
        returns a pattern name; `None` is `merges.DEFAULT_POLICY`, the cost model's pick
        (`perf.crossover.auto_merge`).

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype (replicated, or sharded over heads as above).
      Differentiable in q, k and v with every kernel but "flash" (forward-only).
    """
    plan, dims = make_plan(
        q,
        k,
        v,
        mesh=mesh,
        seq_axes=seq_axes,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        local_kernel=local_kernel,
        layout=layout,
    )
    validate.check_str_choice(merge, (*merges.MERGES, "auto"), "merge")
    if _nothing_to_attend(dims):  # no collective, and no pattern to pick
        return _empty(dims, q.dtype)
    if merge_policy is not None:
        validate.check_callable(
            merge_policy, "merge_policy", "a function of a MergeProblem that returns a pattern name"
        )
    merge = merges.resolve_merge(merge, _merge_problem(plan, dims, q.dtype), merge_policy)
    return _tree(plan, merge, *_place(plan, q, k, v, kv_lengths))


@partial(jax.jit, static_argnums=(0, 1))
def _tree(
    plan: Plan, merge: MergeName, q: Array, k: Array, v: Array, kv_lengths: Array | None
) -> Array:
    def body(q, k, v, lengths):
        state = plan.local(q, k, v, lengths)  # this device's shard -> state
        merged = merges.MERGE_CORES[merge](state, plan.axes)  # the states meet
        return merged.out.astype(q.dtype)

    if merge not in merges.HEAD_SCATTERED:
        varying = merge in merges.VARYING_REPLICATED  # identical copies, typed varying
        return _sharded(plan, body, P(), q, k, v, kv_lengths, check_vma=not varying)
    out = _sharded(plan, body, P(None, None, plan.axes, None), q, k, v, kv_lengths)
    if out.shape[2] == q.shape[2]:
        return out  # each device keeps its own heads: no further collective
    # Heads that p does not divide were padded: replicate, then drop the padding.
    return _replicate(plan, out)[:, :, : q.shape[2]]


def _replicate(plan: Plan, x: Array) -> Array:
    sharding = NamedSharding(plan.mesh, P())
    if devices.is_explicit(plan.mesh):
        return jax.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


# --- rings -------------------------------------------------------------------------------


def ring_decode(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh | None = None,
    seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    local_kernel: KernelChoice = "auto",
    layout: Layout = "bthd",
) -> Array:
    """Ring Attention decoding: K/V blocks pass around the ring for p−1 steps.

    Faithful to Ring Attention (Liu, Zaharia, Abbeel 2023) for one query block per device:
    each device starts from its own shard and, at every step, forwards the block it holds
    to its ring neighbour while folding that block into its online-softmax state. The loop
    is a `lax.scan` with two K/V buffers alive, the block in use and the one in flight (the
    device's own shard is an argument and is never overwritten: the cache outlives the
    step). The queries are replicated, so every device folds all p blocks: the whole Tk,
    p times the tree's local work. The devices fold the blocks in different orders, so
    their results differ by rounding; device 0's is broadcast (one Allreduce of the output,
    `B·Tq·Hq·Dv` numbers) so that the replicated output is the same on every device, bit
    for bit.

    The arguments are `tree_decode`'s (without `merge`).

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype, replicated.
    """
    plan, dims = make_plan(
        q,
        k,
        v,
        mesh=mesh,
        seq_axes=seq_axes,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        local_kernel=local_kernel,
        layout=layout,
    )
    if _nothing_to_attend(dims):
        return _empty(dims, q.dtype)
    return _ring(plan, *_place(plan, q, k, v, kv_lengths))


@partial(jax.jit, static_argnums=0)
def _ring(plan: Plan, q: Array, k: Array, v: Array, kv_lengths: Array | None) -> Array:
    perm = devices.ring_permutation(plan.mesh, plan.axes)

    def body(q, k, v, lengths):
        idx = devices.shard_index(plan.mesh, plan.axes)

        def visit(state, k, v, step):  # fold the block that started on shard idx − step
            offset = ((idx - step) % plan.p) * plan.shard_len
            block = kernels.CORES[plan.kernel](
                q,
                k,
                v,
                kv_offset=offset,
                scale=plan.scale,
                causal=plan.causal and plan.masked,
                kv_lengths=lengths if plan.masked else None,
                layout=plan.layout,
            )
            return combine_core(state, block)

        def step(carry, i):
            k, v, state = carry
            # Send the block onwards before computing on it: the permute's buffer is the only
            # other block alive, and the transfer overlaps the compute.
            k_next, v_next = lax.ppermute((k, v), plan.axes, perm)
            return (k_next, v_next, visit(state, k, v, i)), None

        B, Tq, Hq, _ = q.shape
        state = identity_core(B, Tq, Hq, v.shape[-1], accum_dtype(q.dtype))
        state = devices.varying_like(state, k)
        (k, v, state), _ = lax.scan(step, (k, v, state), jnp.arange(plan.p - 1))
        out = visit(state, k, v, plan.p - 1).out.astype(q.dtype)
        # Every device holds the answer, each rounded in its own order: broadcast shard 0's.
        return lax.psum(jnp.where(idx == 0, out, jnp.zeros((), out.dtype)), plan.axes)

    return _sharded(plan, body, P(), q, k, v, kv_lengths)


def ring_decode_pass_q(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh | None = None,
    seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    local_kernel: KernelChoice = "auto",
    layout: Layout = "bthd",
) -> Array:
    """Pass-Q ring decoding: the queries travel, the K/V stay put.

    The kv heads are split into p query blocks of `hs = ceil(Hkv/p)` kv heads (with their
    `Hq/Hkv` query heads each). Block j reads kv heads `[s_j, s_j + hs)` with
    `s_j = min(j·hs, Hkv − hs)`: when p does not divide Hkv the last blocks overlap the ones
    before (and repeat the last head when p > Hkv), and each kv head's output is taken from
    the block that owns it, `h // hs`. Device i starts with block i; at every step it
    forwards its query block to its ring neighbour while computing that block's partial
    state against its own shard (the xla kernel reads just those heads' window of the
    cache). After p steps each device holds one partial state of every block: one
    all-to-all sends block j's partials to device j, which merges them, and one all-gather
    shares the finished outputs. `(p−1)·B·Tq·hs·G·D` query elements travel instead of
    `(p−1)·B·Tk·Hkv·(D+Dv)/p` cache elements.

    The arguments are `tree_decode`'s (without `merge`).

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype, replicated.
    """
    plan, dims = make_plan(
        q,
        k,
        v,
        mesh=mesh,
        seq_axes=seq_axes,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        local_kernel=local_kernel,
        layout=layout,
    )
    if _nothing_to_attend(dims):
        return _empty(dims, q.dtype)
    return _pass_q(plan, *_place(plan, q, k, v, kv_lengths))


def pass_q_blocks(kv_heads: int, p: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The pass-Q ring's query blocks: `(hs, start [p], owner [Hkv], slot [Hkv])`.

    Block j reads kv heads `[start[j], start[j] + hs)`; kv head h's output comes from block
    `owner[h]`, at position `slot[h]` inside it. Every block reads real heads only (no
    padding), so a block never scores queries against another head's keys.
    """
    hs = -(-kv_heads // p)
    start = np.minimum(np.arange(p) * hs, kv_heads - hs)
    owner = np.arange(kv_heads) // hs
    return hs, start, owner, np.arange(kv_heads) - start[owner]


@partial(jax.jit, static_argnums=0)
def _pass_q(plan: Plan, q: Array, k: Array, v: Array, kv_lengths: Array | None) -> Array:
    perm = devices.ring_permutation(plan.mesh, plan.axes)
    head_axis = 3 - inputs.SEQ_AXIS[plan.layout]  # 2 in "bthd", 1 in "bhtd"
    B, Tq, Hq, D = q.shape
    hkv = k.shape[head_axis]
    group = Hq // hkv
    hs, start, owner, slot = pass_q_blocks(hkv, plan.p)

    def body(q, k, v, lengths):
        idx = devices.shard_index(plan.mesh, plan.axes)
        qg = q.reshape(B, Tq, hkv, group, D)
        # Query blocks by kv head window: [p, B, Tq, hs·G, D] (blocks may overlap).
        windows = start[:, None] + np.arange(hs)[None, :]  # [p, hs]
        qb = jnp.moveaxis(qg[:, :, windows], 2, 0).reshape(plan.p, B, Tq, hs * group, D)
        starts = jnp.asarray(start, jnp.int32)

        def partial_state(q_blk, block):  # this shard's state for query block `block`
            if plan.kernel == "xla":  # the kernel reads the window block by block: no copy
                return plan.local(q_blk, k, v, lengths, kv_head_window=(starts[block], hs))
            kb = lax.dynamic_slice_in_dim(k, starts[block], hs, head_axis)
            vb = lax.dynamic_slice_in_dim(v, starts[block], hs, head_axis)
            return plan.local(q_blk, kb, vb, lengths)

        def step(q_blk, i):
            q_next = lax.ppermute(q_blk, plan.axes, perm)  # in flight during the compute
            return q_next, merges.pack(partial_state(q_blk, (idx - i) % plan.p))

        q_blk, parts = lax.scan(step, qb[idx], jnp.arange(plan.p - 1))
        last = merges.pack(partial_state(q_blk, (idx + 1) % plan.p))
        parts = jnp.concatenate([parts, last[None]])  # by step: block (idx − step) mod p
        by_block = parts[(idx - jnp.arange(plan.p)) % plan.p]
        # The partial states go home (block j to device j) and are merged there; the
        # finished outputs are shared (typed invariant: the same on every device).
        mine = merge_stacked(merges.unpack(lax.all_to_all(by_block, plan.axes, 0, 0, tiled=True)))
        out = lax.all_gather(mine.out, plan.axes, axis=0, tiled=False, to="invarying")
        out = out.reshape(plan.p, B, Tq, hs, group, -1)[owner, :, :, slot]  # [Hkv, B, Tq, G, Dv]
        return jnp.moveaxis(out, 0, 2).reshape(B, Tq, Hq, -1).astype(q.dtype)

    return _sharded(plan, body, P(), q, k, v, kv_lengths)


# --- the energy path -----------------------------------------------------------------------


def tree_energy(
    q: Array,
    k: Array,
    v: Array,
    zeta: Array,
    *,
    mesh: Mesh | None = None,
    seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: Layout = "bthd",
) -> Array:
    """The energy F(ζ) of the whole sharded cache (paper, Algorithm 1), streamed by the xla
    kernel, as a scalar replicated on every device; `theory.energy.energy` of the same
    arguments.

    Its gradient in ζ is Algorithm 2 (a custom VJP: one Allreduce(sum) of the states the
    forward pass left on each device, weighed exactly as `tree_decode` weighs them), so
    `jax.grad(tree_energy, argnums=3)` at ζ = 0 is attention: `tree_decode_from_energy`.
    Gradients in q, k and v are JAX's autodiff of the same streaming computation.

    The other arguments are `tree_decode`'s (the kernel is always "xla").

    Args:
      zeta: `[B, Tq, Hq, Dv]` the source, shaped like the attention output.

    Returns:
      A scalar in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    plan, dims = make_plan(
        q,
        k,
        v,
        mesh=mesh,
        seq_axes=seq_axes,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        local_kernel="xla",
        layout=layout,
    )
    inputs.check_zeta(zeta, dims)
    acc = accum_dtype(q.dtype)
    if _nothing_to_attend(dims):
        return jnp.zeros((), acc)
    return _energy(plan, *_place(plan, q, k, v, kv_lengths, zeta.astype(acc)))


def tree_decode_from_energy(
    q: Array,
    k: Array,
    v: Array,
    *,
    mesh: Mesh | None = None,
    seq_axes: str | Sequence[str] | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    local_kernel: KernelChoice = "xla",
    layout: Layout = "bthd",
) -> Array:
    """Attention as `jax.grad` of the tree-reduced energy (paper, Algorithms 1-2).

    The forward pass reduces the max and then the sum-exp across devices; the backward pass
    that `jax.grad` derives is Algorithm 2: local `e^{lse_i − lse} out_i`, one
    Allreduce(sum).

    The arguments are `tree_decode`'s (without `merge`); the energy is differentiated in
    JAX, so `local_kernel` must be "xla".

    Returns:
      `[B, Tq, Hq, Dv]` in q's dtype, replicated.
    """
    kernels.check_name(local_kernel)
    if local_kernel in ("flash", "cudnn"):
        raise ValueError(
            f"`local_kernel`={local_kernel!r}: tree_decode_from_energy "
            "differentiates the energy in JAX and has no flash or cudnn kernel. "
            "Use local_kernel='xla' (or tree_decode for flash or cudnn)."
        )
    plan, dims = make_plan(
        q,
        k,
        v,
        mesh=mesh,
        seq_axes=seq_axes,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        local_kernel="xla",
        layout=layout,
    )
    if _nothing_to_attend(dims):
        return _empty(dims, q.dtype)
    return _energy_grad(plan, *_place(plan, q, k, v, kv_lengths))


@partial(jax.jit, static_argnums=0)
def _energy(
    plan: Plan, q: Array, k: Array, v: Array, kv_lengths: Array | None, zeta: Array
) -> Array:
    return _sharded(plan, partial(_sharded_energy, plan), P(), q, k, v, kv_lengths, zeta)


@partial(jax.jit, static_argnums=0)
def _energy_grad(plan: Plan, q: Array, k: Array, v: Array, kv_lengths: Array | None) -> Array:
    B, Tq, Hq, _ = q.shape
    zeta = jnp.zeros((B, Tq, Hq, v.shape[-1]), accum_dtype(q.dtype))
    grad = jax.grad(lambda z: _energy(plan, q, k, v, kv_lengths, z))(zeta)
    return grad.astype(q.dtype)


def _sharded_energy(plan: Plan, q: Array, k: Array, v: Array, lengths: Array, zeta: Array) -> Array:
    """Inside `shard_map`: F(ζ) of the whole cache, with Algorithm 2 as the ζ-cotangent."""

    def total(lse: Array, lse_lo: Array) -> Array:  # a row that sees no key adds 0 to F
        return jnp.sum(jnp.where(jnp.isneginf(lse), jnp.zeros_like(lse), lse + lse_lo))

    def plain(q, k, v, lengths, zeta):  # the same energy, for autodiff in q, k and v
        state = plan.local(q, k, v, lengths, zeta=zeta)
        lse, lse_lo, _ = merges.global_lse(state, plan.axes)
        return total(lse, lse_lo)

    @jax.custom_vjp
    def energy(q, k, v, lengths, zeta):
        return plain(q, k, v, lengths, zeta)

    def forward(q, k, v, lengths, zeta):
        state = plan.local(q, k, v, lengths, zeta=zeta)
        lse, lse_lo, m = merges.global_lse(state, plan.axes)
        return total(lse, lse_lo), (q, k, v, lengths, zeta, state, m)

    def backward(res, g):
        q, k, v, lengths, zeta, state, m = res
        # Algorithm 2: each shard's tilted mean weighed by its share e^{lse_i − lse}, summed
        # at the forward pass's shared shift m exactly as `allreduce_combine` does.
        w = state_weight(state, m)
        num, den = merges.psum_inner_first((weighted_out(w, state.out), w), plan.axes)
        mean = from_parts(num, den, m).out
        # q, k and v: autodiff of the same energy (compiled away when only ζ is asked for).
        _, pullback = jax.vjp(lambda q, k, v: plain(q, k, v, lengths, zeta), q, k, v)
        return (*pullback(g), None, g * mean)

    energy.defvjp(forward, backward)
    return energy(q, k, v, lengths, zeta)

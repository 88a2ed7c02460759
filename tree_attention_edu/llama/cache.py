"""The KV cache, sharded along the sequence: its partitioning rule (`cache_sharding`), an
empty cache, and writing keys and values into the shards that own their positions.

**The partitioning rule.** Each layer's cache is `k, v [B, Hkv, S, D]` (head-major, the
layout `kernels.xla_state` streams fastest) with a fixed capacity `S`, a multiple of the
device count `p`. Along `S` it is cut into `p` contiguous blocks of `S/p` positions, one per
device in mesh order (first mesh axis outermost): global position `pos` lives on device
`pos // (S/p)` at local slot `pos % (S/p)`. This is the sharding `tree_decode` and
`ring_decode` read (`kv_offset = shard_index · S/p`), so attention never moves the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import devices, validate
from ..core.decode import kv_spec
from .config import Config, check_config


def check_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with its axes made Auto. The model places its own arrays with sharding
    constraints, which an Explicit mesh (`jax.make_mesh`'s default) refuses; the devices and
    the partitioning are the same either way."""
    validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...)")
    devices.resolve_mesh(mesh)  # refuses Manual or mixed axis types by name
    if devices.is_explicit(mesh):
        mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    return mesh


class KVCache(NamedTuple):
    """Per-layer `(k, v)`, each `[B, Hkv, S, D]` sharded along `S`, and `lengths [B]`."""

    layers: tuple[tuple[Array, Array], ...]
    lengths: Array


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The partitioning rule: axis 2 (`S`) split over every mesh axis, first axis outermost."""
    mesh = check_mesh(mesh)
    return NamedSharding(mesh, kv_spec(tuple(mesh.axis_names), "bhtd"))


def empty_cache(cfg: Config, batch: int, capacity: int, mesh: Mesh) -> KVCache:
    """A zero cache of `capacity` positions (rounded up to a multiple of the device count)."""
    check_config(cfg)
    validate.check_int(batch, "batch")
    validate.check_int(capacity, "capacity")
    mesh = check_mesh(mesh)
    p = mesh.size
    capacity = -(-capacity // p) * p
    shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
    sh = cache_sharding(mesh)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sh)
    return KVCache(
        tuple((zeros(), zeros()) for _ in range(cfg.layers)), jnp.zeros((batch,), jnp.int32)
    )


def write(
    cache_k: Array, cache_v: Array, k: Array, v: Array, start: Array, mesh: Mesh
) -> tuple[Array, Array]:
    """Write `k, v [B, Hkv, T, D]` at global positions `start[b] + t` of a sharded cache.

    Each device writes only the positions it owns. For `T == 1` (a decode step) that is one
    slot updated in place; for a prefill chunk each device gathers its part of the chunk.
    Positions outside `[0, capacity)` are dropped (`start` is a value: it is not inspected).
    """
    mesh = _check_write(cache_k, cache_v, k, v, start, mesh)
    spec = kv_spec(tuple(mesh.axis_names), "bhtd")
    T = k.shape[2]

    def body(ck, cv, k, v, start):
        S_loc = ck.shape[2]
        first = devices.shard_index(mesh, mesh.axis_names) * S_loc  # first owned position
        if T == 1:
            local = start - first  # [B]
            owned = (local >= 0) & (local < S_loc)
            slot = jnp.clip(local, 0, S_loc - 1)

            def put(c, new, slot, owned):  # one sequence: c [Hkv, S_loc, D], new [Hkv, 1, D]
                old = lax.dynamic_slice_in_dim(c, slot, 1, axis=1)
                return lax.dynamic_update_slice_in_dim(c, jnp.where(owned, new, old), slot, axis=1)

            put_b = jax.vmap(put)
            return put_b(ck, k, slot, owned), put_b(cv, v, slot, owned)
        src = first + jnp.arange(S_loc)[None, :] - start[:, None]  # [B, S_loc] chunk index
        inside = ((src >= 0) & (src < T))[:, None, :, None]
        idx = jnp.clip(src, 0, T - 1)[:, None, :, None]
        take = functools.partial(jnp.take_along_axis, indices=idx, axis=2)
        return jnp.where(inside, take(k), ck), jnp.where(inside, take(v), cv)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, P(), P(), P()), out_specs=(spec, spec)
    )(cache_k, cache_v, k, v, start)


def _check_write(
    cache_k: Array, cache_v: Array, k: Array, v: Array, start: Array, mesh: Mesh
) -> Mesh:
    layout = "[B, Hkv, S, D]"
    ck = validate.check_array(cache_k, "cache_k", rank=4, layout=layout, kind="float")
    validate.check_shape(
        validate.check_array(cache_v, "cache_v", rank=4, layout=layout, kind="float"),
        ck,
        "cache_v",
        layout,
        "like cache_k",
    )
    ks = validate.check_array(k, "k", rank=4, layout="[B, Hkv, T, D]", kind="float")
    validate.check_shape(
        ks,
        (ck[0], ck[1], ks[2], ck[3]),
        "k",
        "[B, Hkv, T, D]",
        "batch, heads and head_dim of the cache",
    )
    validate.check_shape(
        validate.check_array(v, "v", rank=4, layout="[B, Hkv, T, D]", kind="float"),
        ks,
        "v",
        "[B, Hkv, T, D]",
        "like k",
    )
    validate.check_shape(
        validate.check_array(start, "start", kind="int"),
        ck[:1],
        "start",
        "[B]",
        "one start position per sequence",
    )
    return check_mesh(mesh)


def append(cache: KVCache, new: Sequence[tuple[Array, Array]], mesh: Mesh) -> KVCache:
    """`cache` with each layer's `new` `(k, v)`, `[B, Hkv, 1, D]`, written at `lengths`, in
    place (`write`), and its lengths advanced by one."""
    validate.check_instance(cache, KVCache, "cache", "build one with empty_cache(...)")
    validate.check_instance(new, (list, tuple), "new", "one (k, v) pair per layer")
    if len(new) != len(cache.layers):
        validate.check_shape(
            (len(new),),
            (len(cache.layers),),
            "new",
            "[layers]",
            "one (k, v) pair per layer of the cache",
        )
    layers = tuple(
        write(ck, cv, k, v, cache.lengths, mesh)
        for (ck, cv), (k, v) in zip(cache.layers, new, strict=True)
    )
    return KVCache(layers, cache.lengths + 1)

"""Which keys a query may see, from global positions.

Conventions (shared by every function in the package):

* Key `a` of a chunk whose first key sits at global position `kv_offset` has global
  position `kv_offset + a`.
* Keys at positions `>= kv_lengths[b]` are padding and are never seen.
* With `causal=True`, query `i` of the `Tq` queries sits at absolute position
  `L_b - Tq + i`, where `L_b` is the sequence's KV length: the queries are the newest
  tokens (the decode convention). It sees keys at positions `<=` its own.

Because masks are built from global positions, a chunk of the cache computes exactly
the part of the mask that the full cache would have there; that is what makes chunked
and sharded attention exact.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array


def visible(
    q_len: int,
    chunk_len: int,
    kv_lengths: Array,
    *,
    kv_offset: int | Array = 0,
    causal: bool = False,
) -> Array:
    """Boolean visibility `[B, Tq, Tk_chunk]`: may query `i` see key `a` of the chunk?

    Args:
      q_len: Tq, the number of queries.
      chunk_len: number of keys in the chunk.
      kv_lengths: `[B]` valid KV length of each sequence (global).
      kv_offset: global position of the chunk's first key (may be traced).
      causal: apply the decode-convention causal mask.
    """
    pos = jnp.asarray(kv_offset, jnp.int32) + jnp.arange(chunk_len, dtype=jnp.int32)  # [Tk_chunk]
    lengths = kv_lengths[:, None, None]  # [B, 1, 1]
    mask = pos[None, None, :] < lengths  # [B, 1, Tk_chunk]
    if causal:
        q_pos = lengths - q_len + jnp.arange(q_len)[None, :, None]  # [B, Tq, 1]
        mask = mask & (pos[None, None, :] <= q_pos)
    return jnp.broadcast_to(mask, (kv_lengths.shape[0], q_len, chunk_len))


def valid_keys(chunk_len: int, kv_lengths: Array, *, kv_offset: int | Array = 0) -> Array:
    """Boolean `[B, Tk_chunk]`: does key `a` of the chunk hold data (global position below
    `kv_lengths[b]`)? Keys that fail it are padding, whatever they store."""
    pos = jnp.asarray(kv_offset, jnp.int32) + jnp.arange(chunk_len, dtype=jnp.int32)
    return pos[None, :] < kv_lengths[:, None]


def full_lengths(batch: int, kv_len: int) -> Array:
    """`[B]` lengths meaning "every key is valid"."""
    return jnp.full((batch,), kv_len, dtype=jnp.int32)


def clamp_lengths(kv_lengths: Array | None, batch: int, kv_len: int) -> Array:
    """`[B]` int32 lengths clamped into `[0, kv_len]`; `None` means every key is valid.

    Lengths are values, so they are never checked (a check would raise eagerly and be
    skipped under `jax.jit`): one below 0 acts as 0 and one above the cache as the cache's
    length, the same on every path, eagerly and under `jit` (wide integers saturate first,
    `as_lengths`: 2**32 + 3 acts as `kv_len`, not as 3).
    """
    if kv_lengths is None:
        return full_lengths(batch, kv_len)
    return jnp.clip(as_lengths(kv_lengths), 0, kv_len)


def as_lengths(kv_lengths: Any) -> Array:
    """Integer lengths as int32, saturated (not wrapped) into int32's range.

    Lengths wider than int32 (int64, uint32, uint64) are saturated in their own dtype
    before they are narrowed, so 2**32 + 3 stays the largest int32 instead of becoming 3.
    No length of a real cache comes near 2**31, so no mask changes. (Without
    `jax_enable_x64`, JAX narrows an int64 argument of a jitted function to int32 before
    this code sees it; numpy arrays passed eagerly are saturated here first.)
    """
    info = np.iinfo(np.int32)

    def saturate(x: Any, clip: Any) -> Any:
        if np.iinfo(x.dtype).max <= info.max:
            return x  # every value fits (int8/16/32, uint8/16)
        signed = np.issubdtype(x.dtype, np.signedinteger)
        return clip(x, int(info.min) if signed else 0, int(info.max))

    if isinstance(kv_lengths, np.ndarray | np.generic):  # before JAX narrows it
        kv_lengths = saturate(np.asarray(kv_lengths), np.clip)
    return saturate(jnp.asarray(kv_lengths), jnp.clip).astype(jnp.int32)


def select_valid_keys(
    x: Array, kv_lengths: Array, kv_offset: int | Array = 0, seq_axis: int = 1
) -> Array:
    """Zero the keys or values of `x` at global positions `>= kv_lengths[b]` (with `where`).

    Such slots hold an uninitialised cache or another sequence's leftovers; a zero weight
    times a stored NaN is NaN, so masked data is selected away before any product.
    `x` is `[B, ..., Tk, ...]` with the keys along `seq_axis`.
    """
    valid = valid_keys(x.shape[seq_axis], kv_lengths, kv_offset=kv_offset)  # [B, Tk]
    shape = [1] * x.ndim
    shape[0], shape[seq_axis] = valid.shape
    return jnp.where(valid.reshape(shape), x, jnp.zeros((), x.dtype))

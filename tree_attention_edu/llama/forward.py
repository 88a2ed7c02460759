"""The forward pass over a sharded cache: each layer writes its keys and values into the
shards that own their positions (`cache.write`), then attends to the cache with the
decoding method's attention (`attend_fn`: one device, `tree_decode` or `ring_decode`).

`forward_with_shard_stats` also returns what each device's shard of the cache contributed at
every layer (`ShardStats`): the per-shard lse whose weights `exp(lse_i - lse)` are the
posterior over shards (`llama.shards`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import devices, validate
from ..core.decode import kv_spec, ring_decode, tree_decode
from ..core.kernels import xla_state
from ..core.kernels.xla import Padding
from ..core.names import Method
from ..core.states import AttentionState, combine
from .cache import KVCache, check_mesh, write
from .config import Config, Params, check_config
from .layers import project_qkv, rms_norm, rope, swiglu

METHODS: tuple[Method, ...] = ("single", "tree", "ring")
"""The decoding methods the model runs, a subset of `core.names.METHODS`: "single" (the
streaming kernel over the whole cache on one device), "tree" (`tree_decode`) and "ring"
(`ring_decode`)."""

Attend = Callable[[Array, Array, Array, Array], Array]
"""`attend(q [B, T, Hq, D], k, v [B, Hkv, S, D], lengths [B]) -> [B, T, Hq, D]`, causal: the
attention a decoding method runs over the cache (`attend_fn`)."""


def attend_fn(method: Method, mesh: Mesh) -> Attend:
    """`attend(q [B, T, Hq, D], k, v [B, Hkv, S, D], lengths [B]) -> [B, T, Hq, D]`, causal."""
    validate.check_choice(method, METHODS, "method")
    if method == "single":

        def single(q, k, v, lengths):
            # The streaming kernel over the whole cache: it reads the head-major cache block
            # by block. (Plain attention on this layout writes a transposed, masked copy of
            # each layer's K and V first: a copy of the whole cache at every decode step.)
            state = xla_state(q, k, v, causal=True, kv_lengths=lengths, layout="bhtd")
            return state.out.astype(q.dtype)

        return single
    decode = tree_decode if method == "tree" else ring_decode
    return functools.partial(_sharded_attend, decode, mesh)


def _sharded_attend(
    decode: Callable[..., Array], mesh: Mesh, q: Array, k: Array, v: Array, lengths: Array
) -> Array:
    return decode(
        q, k, v, mesh=mesh, causal=True, kv_lengths=lengths, layout="bhtd", local_kernel="xla"
    )


def forward(
    params: Params, cfg: Config, tokens: Array, cache: KVCache, attend: Attend, mesh: Mesh
) -> tuple[Array, KVCache]:
    """Run `tokens [B, T]` at positions `cache.lengths[b] + t`; return logits `[B, T, vocab]`
    and the cache with their k/v written (lengths advanced by `T`).

    Token ids index the embedding, `[0, vocab)`; their values are not inspected (that
    would differ under `jit`): an id outside gives NaN logits for its sequence, eagerly and
    under `jit` alike, and so does a sequence whose `lengths + T` passes the cache's
    capacity. `Generator` checks prompts before they reach the device."""
    x, new, _ = trunk(params, cfg, tokens, cache, attend, mesh)
    assert isinstance(new, KVCache)  # not read-only: the cache with the tokens written
    return unembed(params, cfg, x), new


def forward_with_shard_stats(
    params: Params, cfg: Config, tokens: Array, cache: KVCache, attend: Attend, mesh: Mesh
) -> tuple[Array, KVCache, ShardStats]:
    """`forward`, and what each device's shard of every layer's cache contributed to each
    query (`_shard_stats` at every layer, stacked: each field `[layers, p, B, T, Hq]`).

    The per-shard states are computed next to the attention the model uses (`attend`), so
    they cost one more pass over the cache; the logits and the cache are `forward`'s."""
    x, new, stats = trunk(params, cfg, tokens, cache, attend, mesh, probe=True)
    assert isinstance(new, KVCache) and stats is not None
    return unembed(params, cfg, x), new, stats


class ShardStats(NamedTuple):
    """Each device's local attention state of its own shard of the cache, summarised per
    query and head: `lse [p, B, T, Hq]`, natural-log `log Σ exp(q·k/√D)` over the keys of
    shard `i` that the query sees (`-inf` where it sees none), and the size of its local
    output `out_i` (the softmax mean of the shard's values): `out_max`, the largest
    `|out_i|` over the head's features (0 for an empty shard), and `out_min`, the smallest
    nonzero one (`inf` where there is none). A stack over layers puts `[layers]` in front.

    The merged attention is `Σ_i w_i out_i` with `w_i = exp(lse_i - lse)` and
    `lse = log Σ_i exp(lse_i)`: `w_i` is the posterior probability that the answer lies in
    shard `i`."""

    lse: Array
    out_max: Array
    out_min: Array


def _shard_stats(q: Array, k: Array, v: Array, lengths: Array, mesh: Mesh) -> ShardStats:
    """Each device's local state of its shard of `k, v [B, Hkv, S, D]` (sharded along `S`
    by the model's rule, `cache_sharding`) for the causal queries `q [B, T, Hq, D]` at
    positions `lengths[b] - T + t`, summarised as `ShardStats` with `p = mesh.size`.

    Inside `shard_map`, device `i` runs the same streaming kernel as tree decoding
    (`kernels.xla_state`) on its own shard, with its keys at global positions
    `i·S/p + j`; nothing is merged."""
    validate.check_array(q, "q", rank=4, layout="[B, T, Hq, D]", kind="float")
    validate.check_array(k, "k", rank=4, layout="[B, Hkv, S, D]", kind="float")
    mesh = check_mesh(mesh)
    axes = tuple(mesh.axis_names)
    spec = kv_spec(axes, "bhtd")

    def local(q, k, v, lengths):
        offset = devices.shard_index(mesh, axes) * k.shape[2]
        state = xla_state(q, k, v, kv_offset=offset, causal=True, kv_lengths=lengths, layout="bhtd")
        mag = jnp.abs(state.out)
        small = jnp.min(jnp.where(mag > 0, mag, jnp.inf), axis=-1)
        return state.lse[None], jnp.max(mag, axis=-1)[None], small[None]

    stacked = P(axes)
    lse, big, small = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), spec, spec, P()), out_specs=(stacked, stacked, stacked)
    )(q, k, v, lengths)
    return ShardStats(lse, big, small)


def trunk(
    params: Params,
    cfg: Config,
    tokens: Array,
    cache: KVCache,
    attend: Attend,
    mesh: Mesh,
    probe: bool = False,
    read_only: bool = False,
    padding: Padding = "finite",
) -> tuple[Array, KVCache | tuple[tuple[Array, Array], ...], ShardStats | None]:
    """`forward` up to the final RMSNorm: hidden states `[B, T, dim]` (float32), the cache,
    and with `probe` the `_shard_stats` of every layer (stacked), else None.

    `read_only` (a decode step, `T == 1`, on one device: `read_only_step`): the cache is
    only read, as `padding` says its padding may be read (`xla_state`), and each layer's
    new `(k, v)`, `[B, Hkv, 1, D]`, comes back in its place, for `append`."""
    check_config(cfg)
    validate.check_instance(params, dict, "params", "build them with init_params(cfg, key)")
    validate.check_instance(cache, KVCache, "cache", "build one with empty_cache(...)")
    if len(cache.layers) != cfg.layers:
        validate.check_shape(
            (len(cache.layers),),
            (cfg.layers,),
            "cache",
            "[layers]",
            "one (k, v) pair per layer of cfg",
        )
    ts = validate.check_array(tokens, "tokens", rank=2, layout="[B, T]", kind="int")
    validate.check_shape(
        ts[:1], tuple(cache.lengths.shape), "tokens", "[B, T] with B", "the cache's batch"
    )
    validate.check_callable(
        attend, "attend", "attention of q, k, v and lengths, as the Generator builds it"
    )
    mesh = check_mesh(mesh)
    B, T = tokens.shape
    if read_only and (T != 1 or mesh.size != 1):
        raise ValueError(
            f"a read-only step decodes one token on one device, got T={T} on {mesh.size} devices"
        )
    start = cache.lengths
    positions = start[:, None] + jnp.arange(T)[None, :]
    split = _split_tokens(mesh, T)
    # An id outside the vocabulary embeds as NaN (JAX would clamp it to another token).
    x = split(
        jnp.asarray(params["embed"])
        .at[tokens]
        .get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
        .astype(jnp.float32)
    )
    new_layers, stats = [], []
    for layer, (ck, cv) in zip(params["layers"], cache.layers, strict=True):
        h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
        q, k, v = project_qkv(h, layer, cfg)
        q = rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
        k = rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if read_only:
            o = _attend_then_append(q, ck, cv, k, v, start, padding)
            ck, cv = k, v
        else:
            ck, cv = write(ck, cv, k, v, start, mesh)
            o = split(attend(q, ck, cv, start + T))
        if probe:
            stats.append(_shard_stats(q, ck, cv, start + T, mesh))
        x = x + o.reshape(B, T, -1) @ layer["wo"]
        x = x + swiglu(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer)
        new_layers.append((ck, cv))
    stacked = ShardStats(*(jnp.stack(f) for f in zip(*stats, strict=True))) if probe else None
    # Past the capacity no device owns the slot: the token's k/v were not written, and its
    # attention would silently read a cache without it. Its row is NaN instead (a select on
    # values, the same eagerly and under jit), as for an id outside the vocabulary.
    over = start + T > cache.layers[0][0].shape[2]
    x = jnp.where(over[:, None, None], jnp.nan, rms_norm(x, params["final_norm"], cfg.norm_eps))
    return x, (tuple(new_layers) if read_only else KVCache(tuple(new_layers), start + T)), stacked


def read_only_step(
    params: Params, cfg: Config, tokens: Array, cache: KVCache, attend: Attend, mesh: Mesh
) -> tuple[Array, tuple[tuple[Array, Array], ...]]:
    """One decode step on one device that reads the cache and writes none of it (the
    `read_step` program of a one-device `Generator`): logits `[B, 1, vocab]` for `tokens
    [B, 1]`, and each layer's new `(k, v)` for `append`.

    Every layer reads its cache in one pass (`padding="finite"`). A cache this model fills
    holds finite padding (zeros, or the k/v of the pad id 0 that `prefill` writes), but one
    handed in may not, and 0·NaN is NaN: a sequence whose logits come out non-finite is run
    again with every read selecting the padding away (`padding="any"`, exact whatever the
    padding holds), and takes that run's results. Sequences whose first run was finite keep
    it, so a sequence's result does not depend on what the others hold.

    One `lax.cond` per step, not one per layer. Measured on an H200 (results/gpu/README.md,
    second lease), a SmolLM2-shaped step at a 4k context took 7.33 ms with a cond in each of
    its 30 layers and 4.58 ms with none (nor their finiteness checks), on two machines of
    that kind: 91 µs per layer, about a trivial jitted call's round trip from the host
    (82 µs), as a branch chosen on the host would cost (not profiled). The program only reads
    the cache, so the cond copies none of it."""

    def run(padding: Padding) -> tuple[Array, tuple[tuple[Array, Array], ...]]:
        x, new, _ = trunk(params, cfg, tokens, cache, attend, mesh, read_only=True, padding=padding)
        return unembed(params, cfg, x), new  # type: ignore[return-value]

    fast = run("finite")
    # A non-finite read makes the rest of its sequence's step, and so its logits, non-finite.
    # Rows that are NaN by design (an id outside the vocabulary, a step past the capacity:
    # `trunk`) would be NaN again: they are not read twice.
    by_design = jnp.any((tokens < 0) | (tokens >= cfg.vocab), axis=1) | (
        cache.lengths + tokens.shape[1] > cache.layers[0][0].shape[2]
    )
    ok = jnp.all(jnp.isfinite(fast[0]), axis=(1, 2)) | by_design  # [B]

    def mend() -> tuple[Array, tuple[tuple[Array, Array], ...]]:
        return jax.tree.map(
            lambda f, s: jnp.where(ok.reshape((-1,) + (1,) * (f.ndim - 1)), f, s),
            fast,
            run("any"),
        )

    return lax.cond(jnp.all(ok), lambda: fast, mend)


def _attend_then_append(
    q: Array, cache_k: Array, cache_v: Array, k: Array, v: Array, start: Array, padding: Padding
) -> Array:
    """One decode step's attention on one device, reading the cache and writing none of it:
    the state of the cache's first `start[b]` keys, merged with the state of the step's own
    key (`combine`, the tree's merge of two states). `q [B, 1, Hq, D]`, cache
    `[B, Hkv, S, D]`, `k, v [B, Hkv, 1, D]`; returns `[B, 1, Hq, D]`.

    Why not write first and attend over the written cache, as a sharded step does: XLA
    copies a buffer that one operation updates in place while another reads it whole, so a
    program that writes the donated cache and reads it with one matrix product copies the
    cache (`tests/test_speed.py`). This step reads it in one pass, selecting only the scores
    (`padding="finite"`; `read_only_step` reads again with "any" the sequences that need
    it), and `append` writes the new keys in a second program, in place."""
    old = xla_state(q, cache_k, cache_v, kv_lengths=start, layout="bhtd", padding=padding)
    return combine(old, _one_key_state(q, k, v)).out.astype(q.dtype)


def _one_key_state(q: Array, k: Array, v: Array) -> AttentionState:
    """The state of attention over a single key, in closed form: its softmax weight is 1, so
    `out = v` and `lse = q·k/√D`. `q [B, 1, Hq, D]`, `k, v [B, Hkv, 1, D]` (GQA: query head
    `h` reads kv head `h // (Hq/Hkv)`). Elementwise products and a sum, where `xla_state`
    would call a matrix-product kernel for a dot of 64 numbers, per layer and step."""
    B, _, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D)
    lse = jnp.sum(qg * k.astype(jnp.float32), axis=-1) / math.sqrt(D)  # [B, Hkv, G]
    out = jnp.broadcast_to(v.astype(jnp.float32), qg.shape)
    return AttentionState.from_lse(out.reshape(B, 1, Hq, D), lse.reshape(B, 1, Hq))


def unembed(params: Params, cfg: Config, x: Array) -> Array:
    """Logits `[..., vocab]` of final hidden states `x [..., dim]` (float32)."""
    unembed = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    return x @ unembed


def _split_tokens(mesh: Mesh, T: int) -> Callable[[Array], Array]:
    """Spread a prefill chunk's `T` tokens (axis 1) over the devices, when they divide `T`.

    The weights are replicated, so without this every device would compute every token's
    projections and MLP; sharding the tokens (sequence parallelism, as for the cache) gives
    each device `T/p` rows. Attention still reads the whole chunk's queries. A decode step
    (`T == 1`) and a one-device mesh are left as they are.
    """
    if mesh.size == 1 or T % mesh.size:
        return lambda x: x
    spec = NamedSharding(mesh, P(None, tuple(mesh.axis_names)))
    return lambda x: lax.with_sharding_constraint(x, spec)

"""A small Llama-style decoder in pure JAX, with a KV cache sharded along the sequence.

Architecture (Llama 3 style): token embedding, `layers` × [RMSNorm → grouped-query
attention with rotary position embeddings → residual, RMSNorm → SwiGLU MLP → residual],
final RMSNorm, output projection (untied by default, as in Llama 3.1-8B). Weights come
from an explicit PRNG key (`init_params`), or from a Hugging Face Llama checkpoint on disk
(`tree_attention_edu.checkpoint.load_checkpoint`); nothing is trained or downloaded.

**Numerics.** Activations, the KV cache and every accumulation are float32, whatever the
weights' dtype: bfloat16 weights (a checkpoint loaded with `dtype=jnp.bfloat16`) are promoted
to float32 inside each matrix product. Rotary embeddings follow Hugging Face's
`rotate_half` convention (feature `i` pairs with `i + D/2`), with Llama 3.1's `"llama3"`
frequency scaling when `Config.rope_scaling` is set.

**KV-cache partitioning rule.** Each layer's cache is `k, v [B, Hkv, S, D]` (head-major, the
layout `kernels.xla_state` streams fastest) with a fixed capacity `S`, a multiple of the
device count `p`. Along `S` it is cut into `p` contiguous blocks of `S/p` positions, one per
device in mesh order (first mesh axis outermost): global position `pos` lives on device
`pos // (S/p)` at local slot `pos % (S/p)`. This is the sharding `tree_decode` and
`ring_decode` read (`kv_offset = shard_index · S/p`), so attention never moves the cache.

* **Prefill** runs the prompt through the model in chunks of `prefill_chunk` tokens. Each
  chunk's k/v are written into the shards that own their positions, then its queries attend
  to the cache with the causal mask, by `prefill_method`: by default the decoding method, so
  prefill is sequence-parallel with the same tree (or ring, or single-device) attention.
  The chunk's tokens are also split across the devices for the projections and the MLP
  (when the device count divides `prefill_chunk`), so no device recomputes another's rows,
  and only each prompt's last position is projected onto the vocabulary.
  `prefill_method="tree"` with `method="ring"` fills the cache with tree attention and
  decodes with ring: ring prefill passes every K/V shard around the ring once per chunk
  and layer, which is slow on long prompts, and the cache it leaves is the same.
* **Decode** appends one token per sequence: every device checks whether it owns position
  `lengths[b]` and, if so, writes that one slot in place (`write`). Attention for the step
  is `tree_decode` or `ring_decode` over the written cache, masked to `lengths + 1`. On one
  device the step is two programs instead: the first reads the cache in one pass (the
  streaming kernel `kernels.xla_state` with `padding="finite"`) and merges in the step's
  own key in closed form (`_attend_then_append`, the tree's `combine` of two states); the
  second writes the new keys and values (`append`). The cache is donated and updated in
  place: no step copies it (`tests/test_speed.py` reads the compiled programs).
* Prompts of different lengths are right-padded; a sequence's padding positions are masked
  (`kv_lengths`) and overwritten by its own generated tokens.

The whole step is one jitted function of fixed shapes, so generation compiles once, and
`Generator`s of the same model, mesh and methods share their compiled programs.

**A Python loop over the layers, not `lax.scan`.** A scan over weights stacked along a
`[layers]` axis compiles one layer instead of 30 (SmolLM2's decode step: 4 s instead of
13 s), but XLA:CPU copies each layer's slice of a stacked weight out of the stack before its
matrix product (a dot reads whole buffers, not a dynamic slice of one). Measured on SmolLM2
at a 4k context, float32, steps interleaved: 176 ms per token with the scan against 130 ms
with the loop on one device, and 1,780 ms against 787 ms on 8 simulated devices, which all
copy. Each layer's weights are therefore separate arrays and the loop is unrolled.

`Generator.teacher_force` runs given tokens and returns, with the logits, what each device's
shard of the cache contributed at every layer (`ShardStats`, from `_shard_stats`): the per-shard
lse whose weights `exp(lse_i - lse)` are the posterior over shards (`llama.shards`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import devices, inputs, validate
from ..core.decode import kv_spec, ring_decode, tree_decode
from ..core.kernels import xla_state
from ..core.states import AttentionState, combine

METHODS = ("single", "tree", "ring")


def check_prompts(prompts: Any, vocab: int) -> list[np.ndarray]:
    """Prompts: a non-empty sequence of non-empty sequences of token ids in [0, vocab)."""
    example = "[[1, 2, 3], [4, 5]]"
    if isinstance(prompts, str | bytes) or not isinstance(prompts, list | tuple | np.ndarray):
        raise TypeError(f"`prompts` must be a list of prompts, each a sequence of token ids, "
                        f"e.g. {example}, got {validate.describe(prompts)}.")
    if len(prompts) == 0:
        raise ValueError(f"`prompts` is empty; pass at least one prompt, e.g. {example}.")
    out = []
    for i, p in enumerate(prompts):
        name = f"prompts[{i}]"
        if isinstance(p, str | bytes) or not (isinstance(p, list | tuple | range)
                                              or hasattr(p, "shape")):
            raise TypeError(f"`{name}` must be a sequence of token ids (ints), e.g. [1, 2, 3], "
                            f"got {validate.describe(p)}.")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"`{name}` must be a flat sequence of token ids, got shape "
                             f"{arr.shape}.")
        if arr.size == 0:
            raise ValueError(f"`{name}` is empty; every prompt needs at least one token.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"`{name}` must hold int token ids, got dtype {arr.dtype}; "
                            f"convert with `[int(t) for t in {name}]`.")
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"`{name}` has token id {arr[j]} at position {j}; token ids must "
                             f"lie in [0, vocab) = [0, {vocab}).")
        out.append(arr.astype(np.int32))
    return out


def _check_capacity(capacity: int, longest: int, padded: int, new_tokens: int = 0) -> None:
    """The cache holds the prompts padded to whole prefill chunks, and the new tokens."""
    need = max(padded, longest + new_tokens)
    if capacity < need:
        plus = f" plus {new_tokens} new tokens" if new_tokens else ""
        raise ValueError(
            f"`capacity` {capacity} cannot hold the longest prompt ({longest} tokens, "
            f"{padded} once padded to whole prefill chunks){plus}; pass capacity >= {need} "
            f"(or None for the smallest that fits)."
        )


def _check_even_head_dim(head_dim: int, name: str = "head_dim") -> None:
    if head_dim % 2 and name == "head_dim":
        raise ValueError(f"`head_dim` must be even for rotary embeddings (they rotate pairs of "
                         f"features), got {head_dim}; use e.g. {head_dim + 1}.")
    if head_dim % 2:
        raise ValueError(f"`{name}` must have an even last axis (head_dim) for rotary "
                         f"embeddings, which rotate pairs of features; got {head_dim}.")


def _params_mismatch(path: str, got: Any, want: Any) -> None:
    """A model's weights against the shapes its `Config` implies."""
    if got is None:
        raise ValueError(f"`params` lacks {path}; build params with `init_params(cfg, key)` "
                         f"for the same `cfg`.")
    if got != want:
        raise ValueError(f"`params` {path} has shape {got} but `cfg` implies {want}; params "
                         f"and cfg must come from the same Config (`init_params(cfg, key)`).")



@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's `"llama3"` rescaling of the rotary frequencies (Hugging Face's
    `rope_scaling` / `rope_parameters` with `rope_type: "llama3"`).

    With wavelength `λ = 2π / f` of each inverse frequency `f` and `L` =
    `original_max_position_embeddings`: `f` is kept where `λ < L / high_freq_factor`, divided
    by `factor` where `λ > L / low_freq_factor`, and interpolated between the two in between
    (smoothly in `L / λ`). Llama 3.1 uses factor 8, low 1, high 4, L = 8192.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        validate.check_real(self.factor, "factor", low=1.0, hint="Llama 3.1 uses 8.0")
        validate.check_real(self.low_freq_factor, "low_freq_factor", low=0.0, low_open=True,
                           hint="Llama 3.1 uses 1.0")
        validate.check_real(self.high_freq_factor, "high_freq_factor",
                           low=float(self.low_freq_factor), low_open=True,
                           hint="it must exceed low_freq_factor; Llama 3.1 uses 4.0")
        validate.check_int(self.original_max_position_embeddings,
                          "original_max_position_embeddings", example="8192")


@dataclass(frozen=True)
class Config:
    """Model sizes. `hidden` is the SwiGLU width; `q_heads` must be a multiple of `kv_heads`.

    `rope_scaling` is None (plain RoPE) or a `RopeScaling` (Llama 3.1's long-context
    frequencies)."""

    vocab: int = 256
    dim: int = 128
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 352
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_scale: float = 1.0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        for name in ("vocab", "dim", "layers", "q_heads", "kv_heads", "head_dim", "hidden"):
            validate.check_int(getattr(self, name), name)
        inputs.check_head_groups(self.q_heads, self.kv_heads)
        _check_even_head_dim(self.head_dim)
        # A base <= 1 gives frequencies >= 1 that grow without bound over the head (1e-300
        # overflows them to inf, and the logits to NaN); real models use 1e4 to 1e6.
        validate.check_real(self.rope_theta, "rope_theta", low=1.0, low_open=True,
                           hint="the RoPE base, e.g. 500000.0")
        validate.check_real(self.norm_eps, "norm_eps", low=0.0, hint="e.g. 1e-5")
        # Weights of scale s give logits of order s**(2 * layers + 1): past ~100 float32
        # overflows after a few layers.
        validate.check_real(self.init_scale, "init_scale", low=0.0, high=100.0, low_open=True,
                           hint="the weights' scale relative to 1/sqrt(fan_in), e.g. 1.0")
        validate.check_bool(self.tie_embeddings, "tie_embeddings")
        if self.rope_scaling is not None:
            validate.check_instance(self.rope_scaling, RopeScaling, "rope_scaling",
                                   "None, or RopeScaling(factor=8.0, ...) for Llama 3.1")


PRESETS = {
    "tiny": Config(),
    "small": Config(vocab=4096, dim=512, layers=8, q_heads=8, kv_heads=2, head_dim=64,
                    hidden=1408),
}
"""`tiny` runs a 32k-token context on a laptop CPU; `small` (~30M parameters) shows scale."""

Params = dict


def init_params(cfg: Config, key: Array) -> Params:
    """Random float32 weights from `key`: normal, scaled by 1/sqrt(fan_in), RMSNorm gains 1."""
    check_config(cfg)
    validate.check_prng_key(key)
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape, fan_in):  # float32 whatever jax_enable_x64 says
        return (cfg.init_scale / math.sqrt(fan_in)) * jax.random.normal(next(keys), shape,
                                                                        jnp.float32)

    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layers = [
        dict(attn_norm=jnp.ones(cfg.dim, jnp.float32), wq=dense((cfg.dim, qd), cfg.dim),
             wk=dense((cfg.dim, kd), cfg.dim), wv=dense((cfg.dim, kd), cfg.dim),
             wo=dense((qd, cfg.dim), qd), mlp_norm=jnp.ones(cfg.dim, jnp.float32),
             w_gate=dense((cfg.dim, cfg.hidden), cfg.dim),
             w_up=dense((cfg.dim, cfg.hidden), cfg.dim),
             w_down=dense((cfg.hidden, cfg.dim), cfg.hidden))
        for _ in range(cfg.layers)
    ]
    params = dict(embed=jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32),
                  layers=layers, final_norm=jnp.ones(cfg.dim, jnp.float32))
    if not cfg.tie_embeddings:
        params["unembed"] = dense((cfg.dim, cfg.vocab), cfg.dim)
    return params


def check_config(cfg: Config) -> None:
    validate.check_instance(cfg, Config, "cfg", "e.g. Config() or PRESETS['tiny']")


def _check_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with its axes made Auto. The model places its own arrays with sharding
    constraints, which an Explicit mesh (`jax.make_mesh`'s default) refuses; the devices and
    the partitioning are the same either way."""
    validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...)")
    devices.resolve_mesh(mesh)  # refuses Manual or mixed axis types by name
    if devices.is_explicit(mesh):
        mesh = Mesh(mesh.devices, mesh.axis_names,
                    axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh


def rms_norm(x: Array, gain: Array, eps: float) -> Array:
    """`x / rms(x) · gain` over the last axis; `gain` is `[x.shape[-1]]`, `eps >= 0`."""
    s = validate.check_array(x, "x", kind="float", min_rank=1)
    validate.check_shape(validate.check_array(gain, "gain", rank=1, layout="[dim]", kind="float"),
                        s[-1:], "gain", "[x.shape[-1]]", "one gain per feature")
    validate.check_real(eps, "eps", low=0.0, hint="e.g. 1e-5")
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _inverse_frequencies(head_dim: int, theta: float,
                         scaling: RopeScaling | None) -> np.ndarray:
    """`1 / theta^(2i / D)` for `i < D/2`, in float64, then Llama 3.1's rescaling (the steps
    of transformers' `_compute_llama3_parameters`)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope(x: Array, positions: Array, theta: float, scaling: RopeScaling | None = None
         ) -> Array:
    """Rotary embedding of `x [B, T, H, D]` at integer `positions [B, T]`.

    Feature `i` is rotated together with feature `i + D/2` by the angle `pos · f_i`, with
    `f_i = theta^(-2i/D)` (rescaled by `scaling`, Llama 3.1's `"llama3"` rule): this is
    Hugging Face's `rotate_half` convention, `x · cos + rotate_half(x) · sin`, so Llama
    checkpoints need no permutation of their q/k weights. The frequencies are computed in
    float64 and rounded once to float32; angles and the rotation are float32.
    """
    s = validate.check_array(x, "x", rank=4, layout="[B, T, H, D]", kind="float")
    _check_even_head_dim(s[3], "x")
    validate.check_shape(validate.check_array(positions, "positions", kind="int"), s[:2],
                        "positions", "[B, T] (x's first two axes)", "one position per token")
    validate.check_real(theta, "theta", low=0.0, low_open=True, hint="the RoPE base, e.g. 1e4")
    if scaling is not None:
        validate.check_instance(scaling, RopeScaling, "scaling",
                               "None, or RopeScaling(factor=8.0, ...) for Llama 3.1")
    half = x.shape[-1] // 2
    freqs = jnp.asarray(_inverse_frequencies(2 * half, float(theta), scaling), jnp.float32)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def swiglu(x: Array, layer: dict) -> Array:
    if "w_gate_up" in layer:  # packed (`pack_projections`): one product, then split
        gate, up = jnp.split(x @ layer["w_gate_up"], 2, axis=-1)
    else:
        gate, up = x @ layer["w_gate"], x @ layer["w_up"]
    return (jax.nn.silu(gate) * up) @ layer["w_down"]


def _project_qkv(h: Array, layer: dict, cfg: Config) -> tuple[Array, Array, Array]:
    """Queries `[B, T, Hq, D]`, keys and values `[B, T, Hkv, D]` of `h [B, T, dim]`, from
    separate projections or from a packed `wqkv` (`pack_projections`)."""
    B, T, _ = h.shape
    nq, nkv = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if "wqkv" in layer:
        q, k, v = jnp.split(h @ layer["wqkv"], [nq, nq + nkv], axis=-1)
    else:
        q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    return (q.reshape(B, T, cfg.q_heads, cfg.head_dim), k.reshape(B, T, cfg.kv_heads, cfg.head_dim),
            v.reshape(B, T, cfg.kv_heads, cfg.head_dim))


PACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
"""The layer weights `pack_projections` concatenates (along their output axis), by name."""


def pack_projections(params: Params, cfg: Config) -> Params:
    """`params` with each layer's query, key and value projections packed into one matrix
    `wqkv [dim, (Hq + 2·Hkv)·D]`, and the gate and up projections into `w_gate_up
    [dim, 2·hidden]` (`PACKED`); every other weight is shared, not copied.

    The same numbers in fewer, larger matrix products: on XLA:CPU, which runs a decode
    step's products one at a time, three products a layer fewer make a one-device SmolLM2
    step at a 4k context about 5% faster (`scripts/decode_variants.py`). `forward`
    and the `Generator` take either form; a one-device `Generator` packs its own copy
    (the packed matrices are new arrays, the size of the five they replace)."""
    check_config(cfg)
    check_params(params, cfg)

    @jax.jit
    def pack(layers):
        return [{**{n: w for n, w in layer.items() if all(n not in parts
                                                            for parts in PACKED.values())},
                 **{name: jnp.concatenate([layer[n] for n in parts], axis=1)
                    for name, parts in PACKED.items()}} for layer in layers]

    return {**params, "layers": pack(params["layers"])}


# --- the sharded cache ----------------------------------------------------------------------

class KVCache(NamedTuple):
    """Per-layer `(k, v)`, each `[B, Hkv, S, D]` sharded along `S`, and `lengths [B]`."""

    layers: tuple[tuple[Array, Array], ...]
    lengths: Array


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The partitioning rule: axis 2 (`S`) split over every mesh axis, first axis outermost."""
    mesh = _check_mesh(mesh)
    return NamedSharding(mesh, kv_spec(tuple(mesh.axis_names), "bhtd"))


def empty_cache(cfg: Config, batch: int, capacity: int, mesh: Mesh) -> KVCache:
    """A zero cache of `capacity` positions (rounded up to a multiple of the device count)."""
    check_config(cfg)
    validate.check_int(batch, "batch")
    validate.check_int(capacity, "capacity")
    mesh = _check_mesh(mesh)
    p = mesh.size
    capacity = -(-capacity // p) * p
    shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
    sh = cache_sharding(mesh)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sh)
    return KVCache(tuple((zeros(), zeros()) for _ in range(cfg.layers)),
                   jnp.zeros((batch,), jnp.int32))


def write(cache_k: Array, cache_v: Array, k: Array, v: Array, start: Array, mesh: Mesh
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
                return lax.dynamic_update_slice_in_dim(c, jnp.where(owned, new, old), slot,
                                                       axis=1)

            put_b = jax.vmap(put)
            return put_b(ck, k, slot, owned), put_b(cv, v, slot, owned)
        src = first + jnp.arange(S_loc)[None, :] - start[:, None]  # [B, S_loc] chunk index
        inside = ((src >= 0) & (src < T))[:, None, :, None]
        idx = jnp.clip(src, 0, T - 1)[:, None, :, None]
        take = functools.partial(jnp.take_along_axis, indices=idx, axis=2)
        return jnp.where(inside, take(k), ck), jnp.where(inside, take(v), cv)

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P(), P(), P()),
                         out_specs=(spec, spec))(cache_k, cache_v, k, v, start)


def _check_write(cache_k, cache_v, k, v, start, mesh) -> Mesh:
    layout = "[B, Hkv, S, D]"
    ck = validate.check_array(cache_k, "cache_k", rank=4, layout=layout, kind="float")
    validate.check_shape(validate.check_array(cache_v, "cache_v", rank=4, layout=layout,
                                            kind="float"), ck, "cache_v", layout, "like cache_k")
    ks = validate.check_array(k, "k", rank=4, layout="[B, Hkv, T, D]", kind="float")
    validate.check_shape(ks, (ck[0], ck[1], ks[2], ck[3]), "k", "[B, Hkv, T, D]",
                        "batch, heads and head_dim of the cache")
    validate.check_shape(validate.check_array(v, "v", rank=4, layout="[B, Hkv, T, D]",
                                            kind="float"), ks, "v", "[B, Hkv, T, D]", "like k")
    validate.check_shape(validate.check_array(start, "start", kind="int"), ck[:1], "start", "[B]",
                        "one start position per sequence")
    return _check_mesh(mesh)


# --- the model ------------------------------------------------------------------------------

def _attend_fn(method: str, mesh: Mesh) -> Callable:
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


def _sharded_attend(decode, mesh, q, k, v, lengths):
    return decode(q, k, v, mesh=mesh, causal=True, kv_lengths=lengths, layout="bhtd",
                  local_kernel="xla")


def forward(params: Params, cfg: Config, tokens: Array, cache: KVCache, attend: Callable,
            mesh: Mesh) -> tuple[Array, KVCache]:
    """Run `tokens [B, T]` at positions `cache.lengths[b] + t`; return logits `[B, T, vocab]`
    and the cache with their k/v written (lengths advanced by `T`).

    Token ids index the embedding, `[0, vocab)`; their values are not inspected (that
    would differ under `jit`): an id outside gives NaN logits for its sequence, eagerly and
    under `jit` alike, and so does a sequence whose `lengths + T` passes the cache's
    capacity. `Generator` checks prompts before they reach the device."""
    x, cache, _ = _trunk(params, cfg, tokens, cache, attend, mesh)
    return _unembed(params, cfg, x), cache


def _forward_with_shard_stats(params: Params, cfg: Config, tokens: Array, cache: KVCache,
                             attend: Callable, mesh: Mesh
                             ) -> tuple[Array, KVCache, ShardStats]:
    """`forward`, and what each device's shard of every layer's cache contributed to each
    query (`_shard_stats` at every layer, stacked: each field `[layers, p, B, T, Hq]`).

    The per-shard states are computed next to the attention the model uses (`attend`), so
    they cost one more pass over the cache; the logits and the cache are `forward`'s."""
    x, cache, stats = _trunk(params, cfg, tokens, cache, attend, mesh, probe=True)
    assert stats is not None
    return _unembed(params, cfg, x), cache, stats


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
    mesh = _check_mesh(mesh)
    axes = tuple(mesh.axis_names)
    spec = kv_spec(axes, "bhtd")

    def local(q, k, v, lengths):
        offset = devices.shard_index(mesh, axes) * k.shape[2]
        state = xla_state(q, k, v, kv_offset=offset, causal=True, kv_lengths=lengths,
                          layout="bhtd")
        mag = jnp.abs(state.out)
        small = jnp.min(jnp.where(mag > 0, mag, jnp.inf), axis=-1)
        return state.lse[None], jnp.max(mag, axis=-1)[None], small[None]

    stacked = P(axes)
    lse, big, small = jax.shard_map(local, mesh=mesh, in_specs=(P(), spec, spec, P()),
                                    out_specs=(stacked, stacked, stacked))(q, k, v, lengths)
    return ShardStats(lse, big, small)


def _trunk(params: Params, cfg: Config, tokens: Array, cache: KVCache, attend: Callable,
           mesh: Mesh, probe: bool = False, read_only: bool = False
           ) -> tuple[Array, Any, ShardStats | None]:
    """`forward` up to the final RMSNorm: hidden states `[B, T, dim]` (float32), the cache,
    and with `probe` the `_shard_stats` of every layer (stacked), else None.

    `read_only` (a decode step, `T == 1`, on one device: the `read_step` program of a
    one-device `Generator`): the cache is only read, and each layer's new `(k, v)`,
    `[B, Hkv, 1, D]`, comes back in its place, for `append`."""
    check_config(cfg)
    validate.check_instance(params, dict, "params", "build them with init_params(cfg, key)")
    validate.check_instance(cache, KVCache, "cache", "build one with empty_cache(...)")
    if len(cache.layers) != cfg.layers:
        validate.check_shape((len(cache.layers),), (cfg.layers,), "cache", "[layers]",
                            "one (k, v) pair per layer of cfg")
    ts = validate.check_array(tokens, "tokens", rank=2, layout="[B, T]", kind="int")
    validate.check_shape(ts[:1], tuple(cache.lengths.shape), "tokens", "[B, T] with B",
                        "the cache's batch")
    validate.check_callable(attend, "attend", "attention of q, k, v and lengths, as the "
                                             "Generator builds it")
    mesh = _check_mesh(mesh)
    B, T = tokens.shape
    if read_only and (T != 1 or mesh.size != 1):
        raise ValueError(f"a read-only step decodes one token on one device, got T={T} on "
                         f"{mesh.size} devices")
    start = cache.lengths
    positions = start[:, None] + jnp.arange(T)[None, :]
    split = _split_tokens(mesh, T)
    # An id outside the vocabulary embeds as NaN (JAX would clamp it to another token).
    x = split(jnp.asarray(params["embed"]).at[tokens].get(
        mode="fill", fill_value=jnp.nan, wrap_negative_indices=False).astype(jnp.float32))
    new_layers, stats = [], []
    for layer, (ck, cv) in zip(params["layers"], cache.layers, strict=True):
        h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
        q, k, v = _project_qkv(h, layer, cfg)
        q = rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
        k = rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if read_only:
            o = _attend_then_append(q, ck, cv, k, v, start)
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


def _attend_then_append(q: Array, cache_k: Array, cache_v: Array, k: Array, v: Array,
                        start: Array) -> Array:
    """One decode step's attention on one device, reading the cache and writing none of it:
    the state of the cache's first `start[b]` keys, merged with the state of the step's own
    key (`combine`, the tree's merge of two states). `q [B, 1, Hq, D]`, cache
    `[B, Hkv, S, D]`, `k, v [B, Hkv, 1, D]`; returns `[B, 1, Hq, D]`.

    Why not write first and attend over the written cache, as a sharded step does: XLA
    copies a buffer that one operation updates in place while another reads it whole, so a
    program that writes the donated cache and reads it with one matrix product copies the
    cache (`tests/test_speed.py`). This step reads it in one pass, selecting only the scores
    (`padding="finite"`), and `append` writes the new keys in a second program, in place.

    A cache this model fills holds finite padding (zeros, or the k/v of the pad id 0 that
    `prefill` writes), but one handed in may not, and 0·NaN is NaN. So a non-finite result
    of the one pass is read again blockwise, selecting the padding away in K and V
    (`padding="any"`): exact whatever the padding holds. Rows whose one pass was finite keep
    it, so a sequence's result does not depend on what the others hold. The program only
    reads the cache, so the `lax.cond` copies none of it."""
    def read(padding: str) -> AttentionState:
        return xla_state(q, cache_k, cache_v, kv_lengths=start, layout="bhtd", padding=padding)

    fast = read("finite")
    ok = jnp.all(jnp.isfinite(fast.out), axis=(1, 2, 3))  # [B]: a broken row is read again

    def mend() -> AttentionState:  # only the rows that need it take the blockwise read
        slow = read("any")
        return jax.tree.map(lambda f, s: jnp.where(ok.reshape((-1,) + (1,) * (f.ndim - 1)), f, s),
                            fast, slow)

    old = lax.cond(jnp.all(ok), lambda: fast, mend)
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


def append(cache: KVCache, new: Sequence[tuple[Array, Array]], mesh: Mesh) -> KVCache:
    """`cache` with each layer's `new` `(k, v)`, `[B, Hkv, 1, D]`, written at `lengths`, in
    place (`write`), and its lengths advanced by one."""
    validate.check_instance(cache, KVCache, "cache", "build one with empty_cache(...)")
    validate.check_instance(new, (list, tuple), "new", "one (k, v) pair per layer")
    if len(new) != len(cache.layers):
        validate.check_shape((len(new),), (len(cache.layers),), "new", "[layers]",
                            "one (k, v) pair per layer of the cache")
    layers = tuple(write(ck, cv, k, v, cache.lengths, mesh)
                   for (ck, cv), (k, v) in zip(cache.layers, new, strict=True))
    return KVCache(layers, cache.lengths + 1)


def _unembed(params: Params, cfg: Config, x: Array) -> Array:
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


def sample(logits: Array, key: Array, temperature: float) -> Array:
    """Greedy (`temperature == 0`) or softmax sampling at `temperature` from `[B, vocab]`.

    `temperature` is a concrete number >= 0 (not NaN or inf); `key` is a PRNG key.
    """
    validate.check_array(logits, "logits", rank=2, layout="[B, vocab]", kind="float")
    temperature = _check_temperature(temperature)
    validate.check_prng_key(key)
    return _draw(logits, key, jnp.float32(temperature), temperature == 0)


def _draw(logits: Array, key: Array, temperature: Array, greedy: bool) -> Array:
    """`sample` without the checks; `temperature` may be traced (> 0 unless `greedy`).

    The Gumbel-max trick: argmax(l/T + g) with g ~ Gumbel is a sample of softmax(l/T), and
    so is argmax(l + T·g) for T > 0. Below T = 1 the second form is selected: l/T overflows
    for tiny T (1e-45 made every logit inf, and every sample token 0), while T·g only
    shrinks, and the sample tends to the greedy token as T -> 0."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    g = jax.random.gumbel(key, logits.shape, logits.dtype)
    t = temperature.astype(logits.dtype)
    z = jnp.where(t >= 1, logits / t + g, logits + t * g)
    return jnp.argmax(z, axis=-1).astype(jnp.int32)


def _check_temperature(temperature: float) -> float:
    return validate.check_real(temperature, "temperature", low=0.0,
                              hint="0 is greedy, 1 samples the model's distribution")


def check_params(params: Params, cfg: Config) -> None:
    """`params` has the structure and shapes `init_params(cfg, ...)` gives."""
    validate.check_instance(params, dict, "params", "build them with init_params(cfg, key)")
    want = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    got_leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
        got = got_leaves.get(path)
        _params_mismatch(jax.tree_util.keystr(path),
                             None if got is None else tuple(getattr(got, "shape", ())),
                             tuple(leaf.shape))
        dtype = getattr(got, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"`params` {jax.tree_util.keystr(path)} has dtype {dtype}; the "
                            "weights must be floating (float32, bfloat16, ...): cast them, "
                            "e.g. `jax.tree.map(lambda x: x.astype(jnp.float32), params)`.")


class Generation(NamedTuple):
    """`tokens [B, new_tokens]`, the `logits [B, new_tokens, vocab]` each was drawn from,
    `step_s`: wall seconds of each decode step after the first token (the first of them
    includes compiling the step), and `prefill_s`: wall seconds of the prefill (compiling
    included)."""

    tokens: np.ndarray
    logits: np.ndarray
    step_s: list[float]
    prefill_s: float


class _Programs:
    """The jitted decode step, prefill chunk and teacher-forced pass of one model on one
    mesh: built once per `(cfg, mesh, method, prefill_method)` (`_programs`) and shared by
    every `Generator` of those, so that a second one compiles nothing. Each function takes
    the params first; the cache (second) is donated."""

    def __init__(self, cfg: Config, mesh: Mesh, method: str, prefill_method: str):
        attend, attend_prefill = _attend_fn(method, mesh), _attend_fn(prefill_method, mesh)
        self.caller: Any = None  # the Generator calling now: compilations are counted on it

        def step(params, cache, tokens, key, temperature, greedy):
            # `temperature` is traced (a new value compiles nothing); only greedy is static.
            if self.caller is not None:  # runs only while tracing: counts compilations
                self.caller.traces += 1
            logits, cache = forward(params, cfg, tokens[:, None], cache, attend, mesh)
            logits = logits[:, 0]
            return _draw(logits, key, temperature, greedy), logits, cache

        def read_step(params, cache, tokens, key, temperature, greedy):
            # One device: read the cache here, write it in `append` (`_attend_then_append`).
            if self.caller is not None:
                self.caller.traces += 1
            x, new, _ = _trunk(params, cfg, tokens[:, None], cache, attend, mesh,
                               read_only=True)
            logits = _unembed(params, cfg, x)[:, 0]
            return _draw(logits, key, temperature, greedy), logits, new

        def prefill(params, cache, tokens, last_index):
            # last_index [B]: which position of this chunk holds each prompt's last token
            # (-1 if it is not in this chunk). Only that position is projected onto the
            # vocabulary: with a large vocabulary the projection would cost more than the rest.
            x, cache, _ = _trunk(params, cfg, tokens, cache, attend_prefill, mesh)
            last = jnp.take_along_axis(x, jnp.clip(last_index, 0)[:, None, None], 1)[:, 0]
            return _unembed(params, cfg, last), cache

        def probe(params, cache, tokens):
            return _forward_with_shard_stats(params, cfg, tokens, cache, attend, mesh)

        if method == "single":
            self.read_step = jax.jit(read_step, static_argnums=5)
            self.append = jax.jit(functools.partial(append, mesh=mesh), donate_argnums=0)
        self.step = jax.jit(step, static_argnums=5, donate_argnums=1)
        self.prefill = jax.jit(prefill, donate_argnums=1)
        self.probe = jax.jit(probe, donate_argnums=1)


@functools.lru_cache(maxsize=16)
def _programs(cfg: Config, mesh: Mesh, method: str, prefill_method: str) -> _Programs:
    return _Programs(cfg, mesh, method, prefill_method)


def _under_own_mesh(method: Callable) -> Callable:
    """Run a `Generator` method under the generator's own (Auto) mesh: a mesh the caller set
    with `jax.set_mesh` (an Explicit one, say) would otherwise give the arrays made here its
    axis types, which clash with the programs' shardings."""
    @functools.wraps(method)
    def wrapped(self, *args, **kw):
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kw)
    return wrapped


class Generator:
    """Jitted prefill and decode for one model, method and mesh; compiled once per shape.

    Generators of the same `cfg`, mesh and methods share their compiled programs: the
    second compiles nothing (its `traces` stays 0). `traces` counts the compilations of the
    decode step that this generator's calls caused.

    Args:
      params: the model's weights (`init_params(cfg, key)`; checked against `cfg`).
      cfg: the model's sizes.
      mesh: the devices the cache is sharded over (`single` uses the mesh's first device).
        With `single`, a decode step reads the cache in one program and appends the step's
        keys and values in a second (`_attend_then_append`), and the generator keeps its
        weights packed (`pack_projections`): both measured to matter on XLA:CPU.
      method: "single", "tree" or "ring": the attention of each decode step.
      prefill_chunk: prompt tokens per prefill step.
      prefill_method: the attention that fills the cache from the prompt; defaults to
        `method`. With `method="single"` everything runs on the mesh's first device.
    """

    def __init__(self, params: Params, cfg: Config, mesh: Mesh, method: str = "tree",
                 prefill_chunk: int = 512, prefill_method: str | None = None):
        check_config(cfg)
        check_params(params, cfg)
        mesh = _check_mesh(mesh)
        validate.check_choice(method, METHODS, "method")
        prefill_method = method if prefill_method is None else prefill_method
        validate.check_choice(prefill_method, METHODS, "prefill_method")
        if prefill_method == "single" and method != "single":
            # xla_state outside shard_map on a sequence-sharded cache: GSPMD would gather the
            # whole cache onto every device, at every layer of every chunk.
            raise ValueError(f"`prefill_method` 'single' needs `method` 'single' (the cache of "
                             f"method {method!r} is sharded over the mesh); use 'tree' to "
                             f"prefill it.")
        validate.check_int(prefill_chunk, "prefill_chunk", example="`prefill_chunk=512`")
        if method == "single":
            mesh = Mesh(np.array(mesh.devices).ravel()[:1], ("x",))
        self.cfg, self.mesh, self.method, self.chunk = cfg, mesh, method, prefill_chunk
        self.prefill_method = prefill_method
        self._rep = rep = NamedSharding(mesh, P())
        self.params = jax.device_put(params, rep)
        if method == "single":  # one device runs one product at a time: fewer, larger ones
            self.params = pack_projections(self.params, cfg)
        self.traces = 0
        self._programs = _programs(cfg, mesh, method, prefill_method)

    def _run(self, name: str, *args):
        """Call the shared program `name`, counting any compilation it does as this
        generator's (`traces`)."""
        programs = self._programs
        programs.caller = self
        try:
            return getattr(programs, name)(self.params, *args)
        finally:
            programs.caller = None

    @_under_own_mesh
    def step(self, cache: KVCache, tokens: Array, key: Array | None = None,
             temperature: float = 0.0) -> tuple[Array, Array, KVCache]:
        """One decode step: `tokens [B]` at positions `cache.lengths`; returns the next
        tokens `[B]` (greedy at temperature 0), their logits `[B, vocab]` and the cache
        with the step's keys and values written. `cache` is donated: its buffers are
        updated in place and must not be used again."""
        validate.check_instance(cache, KVCache, "cache", "build one with prefill(...)")
        temperature = _check_temperature(temperature)
        key = jax.random.key(0) if key is None else key
        validate.check_prng_key(key)
        ts = validate.check_array(tokens, "tokens", rank=1, layout="[B]", kind="int")
        validate.check_shape(ts, tuple(cache.lengths.shape), "tokens", "[B]",
                            "one token per sequence of the cache")
        # Placed on this generator's mesh: arrays made under another (say an Explicit
        # context mesh) carry its axis types.
        tokens, key = jax.device_put((jnp.asarray(tokens, jnp.int32), key), self._rep)
        return self._step(cache, tokens, key, temperature)

    def _step(self, cache: KVCache, tokens: Array, key: Array, temperature: float
              ) -> tuple[Array, Array, KVCache]:
        """The decode step's programs, on checked arguments placed on this mesh."""
        args = (tokens, key, jnp.float32(temperature), temperature == 0)
        if self.method != "single":
            return self._run("step", cache, *args)
        # One device: a program that reads the cache, then one that appends to it in place.
        tokens, logits, new = self._run("read_step", cache, *args)
        return tokens, logits, self._programs.append(cache, new)

    @_under_own_mesh
    def teacher_force(self, cache: KVCache, tokens: Array) -> tuple[Array, KVCache,
                                                                     ShardStats]:
        """Run `tokens [B, T]` (given, not sampled) at positions `cache.lengths` with this
        generator's attention: their logits `[B, T, vocab]`, the cache with them written,
        and what each device's shard contributed at every layer (`ShardStats`, each field
        `[layers, p, B, T, Hq]`, `p` this generator's devices). `cache` is donated."""
        validate.check_instance(cache, KVCache, "cache", "build one with prefill(...)")
        validate.check_array(tokens, "tokens", rank=2, layout="[B, T]", kind="int")
        return self._run("probe", cache, jax.device_put(jnp.asarray(tokens, jnp.int32),
                                                        self._rep))

    def _padded(self, longest: int) -> int:
        """`longest` rounded up to whole prefill chunks."""
        return -(-longest // self.chunk) * self.chunk

    @_under_own_mesh
    def prefill(self, prompts: Sequence[Sequence[int]] | Sequence[np.ndarray], capacity: int,
                progress: bool | None = False) -> tuple[Array, KVCache]:
        """Fill a fresh cache from right-padded prompts; return each prompt's last logits.

        `prompts` are non-empty sequences of token ids in `[0, vocab)`; `capacity` must hold
        the longest, padded to whole `prefill_chunk`s. `progress` shows a bar over the
        prompt's chunks (`None`: when there are more than 8). Everything is checked before
        any work is done.
        """
        from tqdm import tqdm

        checked = check_prompts(prompts, self.cfg.vocab)
        validate.check_int(capacity, "capacity")
        validate.check_bool(progress, "progress", optional=True)
        lengths = np.array([len(p) for p in checked])
        padded = self._padded(int(lengths.max()))
        _check_capacity(capacity, int(lengths.max()), padded)
        tokens = np.zeros((len(checked), padded), np.int32)
        for b, p in enumerate(checked):
            tokens[b, : len(p)] = p
        cache = empty_cache(self.cfg, len(checked), capacity, self.mesh)
        last = jnp.zeros((len(checked), self.cfg.vocab), jnp.float32)
        n_chunks = padded // self.chunk
        bar = tqdm(total=n_chunks, desc=f"{self.prefill_method} prefill", unit="chunk",
                   disable=(n_chunks <= 8) if progress is None else not progress)
        for c in range(0, padded, self.chunk):
            idx = lengths - 1 - c
            inside = (idx >= 0) & (idx < self.chunk)
            chunk = jnp.asarray(tokens[:, c:c + self.chunk])
            pick, cache = self._run("prefill", cache, chunk,
                                        jnp.asarray(np.where(inside, idx, -1)))
            last = jnp.where(jnp.asarray(inside)[:, None], pick, last)
            if not bar.disable:
                jax.block_until_ready(last)  # so the bar tracks the work, not the dispatch
                bar.update(1)
        bar.close()
        # Each sequence continues right after its own prompt; padding slots get overwritten.
        lengths = jax.device_put(jnp.asarray(lengths, jnp.int32), self._rep)
        return last, cache._replace(lengths=lengths)

    @_under_own_mesh
    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, *, key: Array,
                 temperature: float = 0.0, capacity: int | None = None,
                 progress: bool | None = None, stop_at: int | None = None) -> Generation:
        """Prefill, then decode `new_tokens` tokens per prompt (greedy at temperature 0).

        Args:
          prompts: a non-empty list of non-empty sequences of token ids in `[0, vocab)`.
          new_tokens: tokens to generate per prompt, >= 1.
          key: a PRNG key (`jax.random.key(0)`), used when `temperature > 0`.
          temperature: >= 0; 0 is greedy.
          capacity: cache positions; it must hold the longest prompt padded to whole
            `prefill_chunk`s and the longest prompt plus `new_tokens`. `None` (the default)
            picks the padded prompt length plus `new_tokens`.
          progress: `None` shows progress bars for decoding more than 64 tokens and for
            prefilling more than 8 chunks; `True` or `False` forces both on or off.
          stop_at: a token id (e.g. the end-of-sequence id): decoding stops once every
            prompt has produced it, so fewer than `new_tokens` may come back (a prompt that
            stopped early continues after its stop token until the others stop). None
            decodes `new_tokens`.

        Every argument is checked before any work is done.
        """
        import time

        from tqdm import tqdm

        checked = check_prompts(prompts, self.cfg.vocab)
        validate.check_int(new_tokens, "new_tokens", example="`new_tokens=32`")
        validate.check_prng_key(key)
        temperature = _check_temperature(temperature)
        key = jax.device_put(key, self._rep)  # made under another mesh, maybe (see `step`)
        validate.check_bool(progress, "progress", optional=True)
        if stop_at is not None:
            validate.check_int(stop_at, "stop_at", minimum=0, example="the EOS id, e.g. 2")
        longest = max(len(p) for p in checked)
        padded = self._padded(longest)
        if capacity is None:
            capacity = padded + new_tokens
        validate.check_int(capacity, "capacity", example="`capacity=None` (the smallest that fits)")
        _check_capacity(capacity, longest, padded, new_tokens)
        t0 = time.perf_counter()
        logits, cache = self.prefill(checked, capacity, progress=progress)
        jax.block_until_ready(logits)
        prefill_s = time.perf_counter() - t0
        tok = jax.device_put(sample(logits, jax.random.fold_in(key, 0), temperature), self._rep)
        toks, all_logits, times = [tok], [logits], []
        bar = tqdm(total=new_tokens, desc=f"{self.method} decode", unit="tok",
                   disable=(new_tokens <= 64) if progress is None else not progress)
        bar.update(1)
        stopped = np.asarray(tok) == stop_at
        for i in range(1, new_tokens):
            if stopped.all():
                break
            t0 = time.perf_counter()
            tok, logits, cache = self._step(cache, tok, jax.random.fold_in(key, i), temperature)
            jax.block_until_ready(tok)
            times.append(time.perf_counter() - t0)
            toks.append(tok)
            all_logits.append(logits)
            stopped |= np.asarray(tok) == stop_at
            bar.update(1)
        bar.close()
        return Generation(np.stack([np.asarray(t) for t in toks], 1),
                          np.stack([np.asarray(x) for x in all_logits], 1), times, prefill_s)

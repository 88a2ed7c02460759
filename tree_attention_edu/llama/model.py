"""A small Llama-style decoder in pure JAX, with a KV cache sharded along the sequence.

Architecture (Llama 3 style): token embedding, `layers` × [RMSNorm → grouped-query
attention with rotary position embeddings → residual, RMSNorm → SwiGLU MLP → residual],
final RMSNorm, output projection (untied by default, as in Llama 3.1-8B). Weights come
from an explicit PRNG key (`init_params`), or from a Hugging Face Llama checkpoint on disk
(`tree_attention_edu.llama.checkpoint.load_checkpoint`); nothing is trained or downloaded.

This module is the model's front door: it gathers the names of the modules that hold them,
in the order a reader meets them:

| module | what it holds |
|---|---|
| `llama.config` | `Config`, `RopeScaling`, `PRESETS`, `init_params`, `check_params` |
| `llama.layers` | `rms_norm`, `rope`, `swiglu`, `pack_projections` |
| `llama.cache` | `KVCache`, `cache_sharding`, `empty_cache`, `write`, `append` |
| `llama.forward` | `METHODS`, `forward`, `ShardStats`: one pass over the sharded cache |
| `llama.generator` | `Generator`, `Generation`, `sample`: prefill and decode |

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
  own key in closed form (`forward._attend_then_append`, the tree's `combine` of two
  states); the second writes the new keys and values (`append`). The cache is donated and
  updated in place: no step copies it (`tests/test_speed.py` reads the compiled programs).
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
shard of the cache contributed at every layer (`ShardStats`, from
`forward.forward_with_shard_stats`): the per-shard lse whose weights `exp(lse_i - lse)` are
the posterior over shards (`llama.shards`).
"""

from __future__ import annotations

from .cache import KVCache, append, cache_sharding, check_mesh, empty_cache, write
from .config import (
    PRESETS,
    Config,
    Params,
    RopeScaling,
    check_config,
    check_params,
    init_params,
)
from .forward import METHODS, ShardStats, forward
from .generator import Generation, Generator, check_prompts, sample
from .layers import PACKED, pack_projections, rms_norm, rope, swiglu

__all__ = [
    "METHODS",
    "PACKED",
    "PRESETS",
    "Config",
    "Generation",
    "Generator",
    "KVCache",
    "Params",
    "RopeScaling",
    "ShardStats",
    "append",
    "cache_sharding",
    "check_config",
    "check_mesh",
    "check_params",
    "check_prompts",
    "empty_cache",
    "forward",
    "init_params",
    "pack_projections",
    "rms_norm",
    "rope",
    "sample",
    "swiglu",
    "write",
]

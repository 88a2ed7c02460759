"""Local decode kernels: the per-device computation of an `AttentionState` for one KV shard.

* `"xla"`: pure JAX (`states.local_state`); works on every backend, dtype and mask.
* `"flash"`: flash-attn-jax's FlashAttention-2 forward on a CUDA GPU, which returns the
  log-sum-exp the tree combine needs. It takes fp16/bf16, head_dim ≤ 256, `Dv == D`, and
  no key mask, so it serves shards that are fully valid (no padding, no `kv_lengths`,
  and no causal mask, or a single causal query, which sees every key anyway).
* `"auto"`: flash where all of that holds and flash-attn-jax is installed, else xla.

Every kernel has the signature of `states.local_state`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from . import _checks
from .states import AttentionState, local_state

KERNEL_NAMES = ("auto", "xla", "flash")
Kernel = Callable[..., AttentionState]


def flash_available() -> bool:
    """flash-attn-jax is importable and JAX's default backend is a CUDA GPU."""
    return jax.default_backend() == "gpu" and importlib.util.find_spec("flash_attn_jax") is not None


def flash_unsupported_reason(
    dtype, head_dim: int, v_dim: int, needs_mask: bool, backend: str | None = None
) -> str | None:
    """Why the flash kernel cannot run this problem, or None if it can."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return (f"local_kernel='flash' needs a CUDA GPU, but JAX's default backend is "
                f"{backend!r}; use local_kernel='xla' (or 'auto', which picks xla here).")
    if importlib.util.find_spec("flash_attn_jax") is None:
        return ("local_kernel='flash' needs flash-attn-jax: "
                "`pip install 'tree_attention_edu[flash]'` (it pins jax<0.9 and needs CUDA).")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (f"local_kernel='flash' takes float16 or bfloat16 inputs, got {jnp.dtype(dtype)}; "
                f"cast q, k, v or use local_kernel='xla'.")
    if head_dim > 256 or v_dim != head_dim:
        return (f"local_kernel='flash' needs head_dim <= 256 and v_dim == head_dim, got "
                f"head_dim={head_dim}, v_dim={v_dim}; use local_kernel='xla'.")
    if needs_mask:
        return ("local_kernel='flash' cannot mask keys: this call has padding (kv_len not a "
                "multiple of the device count), `kv_lengths`, or a causal mask over several "
                "queries; use local_kernel='xla' (or 'auto').")
    return None


def resolve(name: str, *, dtype, head_dim: int, v_dim: int, needs_mask: bool) -> str:
    """Turn "auto" into a concrete kernel name; check an explicit "flash" can run."""
    _checks.check_kernel_name(name, KERNEL_NAMES)
    if name == "xla":
        return name
    reason = flash_unsupported_reason(dtype, head_dim, v_dim, needs_mask)
    if name == "auto":
        return "xla" if reason else "flash"
    if reason:
        raise ValueError(reason)
    return name


def flash_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> AttentionState:
    """FlashAttention-2 forward on an unmasked shard; `kv_offset`, `causal` and `kv_lengths`
    are accepted for a uniform signature and ignored (`resolve` only picks flash when no mask
    applies)."""
    del kv_offset, causal, kv_lengths
    from flash_attn_jax.flash import _flash_mha_fwd  # lazy: CUDA-only, optional extra

    scale = 1.0 / float(q.shape[-1]) ** 0.5 if scale is None else float(scale)
    out, lse = _flash_mha_fwd(q, k_chunk, v_chunk, softmax_scale=scale, is_causal=False,
                              window_size=(-1, -1))
    # flash returns out [B, Tq, Hq, D] in the input dtype and lse float32 [B, Hq, Tq].
    return AttentionState(out.astype(jnp.float32), jnp.transpose(lse, (0, 2, 1)))


KERNELS: dict[str, Kernel] = {"xla": local_state, "flash": flash_state}

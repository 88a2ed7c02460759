"""Local decode kernels: the per-device computation of an `AttentionState` for one KV shard.

* `"xla"`: pure JAX (`xla_state`): a streaming, flash-decoding style kernel that reads the
  cache once and makes no copy of it; works on every backend, dtype, mask and layout.
* `"flash"`: flash-attn-jax's FlashAttention-2 forward on a CUDA GPU, which returns the
  log-sum-exp the tree combine needs. It takes fp16/bf16, head_dim ≤ 256, `Dv == D`, and
  no key mask, so it serves shards that are fully valid (no padding, no `kv_lengths`,
  and no causal mask, or a single causal query, which sees every key anyway).
* `"auto"`: flash where all of that holds and flash-attn-jax is installed, else xla.

Every kernel has the signature of `states.local_state` plus `layout`.

Cache layouts (`layout`):

* `"bthd"`: `k [B, Tk, Hkv, D]`, the layout of `jax.nn.dot_product_attention`. A decode
  step is a matrix-vector product per head, and a head's keys are strided in this layout:
  handed to `einsum` whole, XLA first copies K and V into head-major order (a copy as big
  as the cache, and most of the time). `xla_state` instead walks the cache in blocks of
  `block` keys, transposes each block while it is in cache, and folds it into an
  online-softmax state (`lax.scan`), so nothing as large as the cache is ever written.
* `"bhtd"`: `k [B, Hkv, Tk, D]`, head-major. Each head's keys are contiguous, so the
  scores are one batched matrix-vector product that streams the cache at close to the
  machine's read bandwidth. This is the layout to give a KV cache you own
  (see `tree_attention_edu.model`).

`tree_attention_edu.benchmark.bandwidth` measures each against the machine's read bandwidth.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

from . import _checks, masks
from .attention import accum_dtype, finite_or_zero, lse_pair, nonzero_or_one
from .states import AttentionState

KERNEL_NAMES = ("auto", "xla", "flash")
LAYOUTS = ("bthd", "bhtd")
SEQ_AXIS = {"bthd": 1, "bhtd": 2}
"""Axis of `k` and `v` that holds the keys, per layout."""
DEFAULT_BLOCK = 256
"""Keys per block of the streaming kernel on the "bthd" layout: 256 keys × 16 heads × 128
× 4 bytes is 2 MiB per block of K, small enough to transpose in cache. Measured on a 2-core
CPU at Tk=65536: 128 to 512 stream at 12-15 GB/s; 64 and below pay for the loop when 8
simulated devices share the cores, and 1024 and up spill and drop to ~6 GB/s."""
Kernel = Callable[..., AttentionState]


def bthd_view(x: Any, layout: str) -> Any:
    """Shape-and-dtype stand-in of a K or V array in "bthd" order, for validation."""
    _checks.check_layout(layout, LAYOUTS)
    if layout == "bthd":
        return x
    s = _checks.shape_of(x, "k or v")
    if len(s) != 4:
        return x  # let check_qkv report the rank
    return jax.ShapeDtypeStruct((s[0], s[2], s[1], s[3]), x.dtype)


def to_layout(x: Array, src: str, dst: str) -> Array:
    """Move a K or V array between the "bthd" and "bhtd" layouts (a copy if they differ)."""
    _checks.check_choice(src, LAYOUTS, "src")
    _checks.check_choice(dst, LAYOUTS, "dst")
    if len(_checks.shape_of(x, "x")) != 4:
        raise ValueError(f"`x` must have rank 4, [batch, kv_len, kv_heads, dim] or [batch, "
                         f"kv_heads, kv_len, dim], got shape {tuple(x.shape)}.")
    return x if src == dst else jnp.swapaxes(x, 1, 2)


def _fold(carry, qg, kb, vb, visible, valid, zg=None):
    """Fold one head-major block into the running online-softmax state.

    `qg [B, Hkv, G·Tq, D]` (scaled), `kb [B, Hkv, C, D]`, `vb [B, Hkv, C, Dv]`,
    `visible [B, 1, 1, Tq, C]`, `valid [B, C]` (keys that hold data, or None when all do),
    `zg [B, Hkv, G·Tq, Dv]` an energy source ζ added to the scores as `ζ·v` (or None);
    carry `(m, l, o)`:
    running max `[B, Hkv, G·Tq]` (-inf while nothing is visible), sum of `exp(s - m)`, and
    unnormalised numerator `[..., Dv]`.
    """
    m, l, o = carry
    B, Hkv, M, _ = qg.shape
    C = kb.shape[2]
    acc = qg.dtype
    if valid is not None:  # padding may hold anything (NaN, inf): select it away first
        keep = valid[:, None, :, None]
        kb = jnp.where(keep, kb, jnp.zeros((), kb.dtype))
        vb = jnp.where(keep, vb, jnp.zeros((), vb.dtype))
    s = jnp.einsum("bhmd,bhcd->bhmc", qg, kb.astype(acc))
    if zg is not None:  # the tilted scores s + ζ·v of the energy F(ζ)
        s = s + jnp.einsum("bhmv,bhcv->bhmc", zg, vb.astype(acc))
    Tq = visible.shape[3]
    s = jnp.where(visible, s.reshape(B, Hkv, M // Tq, Tq, C), -jnp.inf).reshape(B, Hkv, M, C)
    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))  # a shift: no gradient
    shift = finite_or_zero(m_new)  # a block with nothing visible yet: exp(-inf - 0) = 0
    p = jnp.exp(s - shift[..., None])
    rescale = jnp.exp(m - shift)
    l = l * rescale + jnp.sum(p, axis=-1)
    o = o * rescale[..., None] + jnp.einsum("bhmc,bhcv->bhmv", p, vb.astype(acc))
    return m_new, l, o


def _varying_like(tree, *refs):
    """Inside `shard_map`, give a fresh scan carry the varying mesh axes of `refs` (the
    carry a block produces varies wherever the shard does); outside, a no-op."""
    axes: set[str] = set()
    for r in refs:
        aval = jax.typeof(r)
        mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `.vma` before
        axes |= set(mat.varying if mat is not None else getattr(aval, "vma", ()))
    if not axes:
        return tree
    return jax.tree.map(lambda x: lax.pcast(x, tuple(sorted(axes)), to="varying"), tree)


def xla_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: str = "bthd",
    block: int = DEFAULT_BLOCK,
    zeta: Array | None = None,
) -> AttentionState:
    """State of one chunk of the cache, streaming it once without copying it.

    Same contract as `states.local_state` (which it matches to rounding), plus:

    Args:
      k_chunk: `[B, Tc, Hkv, D]` ("bthd") or `[B, Hkv, Tc, D]` ("bhtd").
      v_chunk: `[B, Tc, Hkv, Dv]` or `[B, Hkv, Tc, Dv]`, like `k_chunk`.
      layout: "bthd" or "bhtd" (see the module docstring).
      kv_lengths: `[B]` global valid lengths; keys past them are selected away (`where`), so
        they may hold anything. `None`: every key of the chunk holds data.
      block: keys per block on the "bthd" layout, and on "bhtd" when `kv_lengths` is given;
        an unmasked "bhtd" chunk is read in one pass.
      zeta: `[B, Tq, Hq, Dv]` energy source ζ, or None. The scores become `s + ζ·v_a`, so
        `lse` is the chunk's energy F(ζ) and `out` the mean of v under the tilted weights
        (`energy.energy`); the streaming energy path of `decode.tree_decode_from_energy`.

    Returns:
      `AttentionState` (`out [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`) in the accumulation dtype.
    """
    dims = _checks.check_qkv(q, bthd_view(k_chunk, layout), bthd_view(v_chunk, layout),
                             kv_lengths, chunk=True)
    _checks.check_positive(block, "block")
    B, Tq, Hq, D = q.shape
    Hkv, Tc, G = dims.kv_heads, dims.kv_len, dims.group
    acc = accum_dtype(q.dtype)
    scale = _checks.resolve_scale(scale, D, q.dtype)
    if B == 0 or Tq == 0:
        return AttentionState(jnp.zeros((B, Tq, Hq, dims.v_dim), acc),
                              jnp.full((B, Tq, Hq), -jnp.inf, acc), jnp.zeros((B, Tq, Hq), acc))
    # With `kv_lengths`, keys past them are selected away block by block; without, every key
    # holds data and the "bhtd" layout is read in one pass (a where over the whole chunk would
    # be a cache-sized copy).
    padded = kv_lengths is not None
    if kv_lengths is None:
        kv_lengths = masks.full_lengths(B, Tc) + kv_offset
    # Queries of one kv head side by side: [B, Hkv, G·Tq, D], so K and V keep their layout.
    qg = (q.astype(acc) * jnp.asarray(scale, acc)).reshape(B, Tq, Hkv, G, D)
    qg = qg.transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
    zg = None
    if zeta is not None:
        _checks.check_zeta(zeta, dims)
        zg = zeta.astype(acc).reshape(B, Tq, Hkv, G, dims.v_dim)
        zg = zg.transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, dims.v_dim)
    carry = (jnp.full((B, Hkv, G * Tq), -jnp.inf, acc), jnp.zeros((B, Hkv, G * Tq), acc),
             jnp.zeros((B, Hkv, G * Tq, dims.v_dim), acc))
    carry = _varying_like(carry, q, k_chunk, v_chunk, kv_lengths, kv_offset)

    def fold(carry, start, size):
        ax = SEQ_AXIS[layout]
        kb = lax.dynamic_slice_in_dim(k_chunk, start, size, ax)
        vb = lax.dynamic_slice_in_dim(v_chunk, start, size, ax)
        if layout == "bthd":
            kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
        vis = masks.visible(Tq, size, kv_lengths, kv_offset=kv_offset + start, causal=causal)
        valid = masks.valid_keys(size, kv_lengths, kv_offset=kv_offset + start) if padded else None
        return _fold(carry, qg, kb, vb, vis[:, None, None], valid, zg)

    if layout == "bhtd" and not padded:
        carry = fold(carry, 0, Tc)
    else:
        n_blocks, tail = divmod(Tc, block)
        if n_blocks:
            carry, _ = lax.scan(lambda c, i: (fold(c, i * block, block), None), carry,
                                jnp.arange(n_blocks))
        if tail:
            carry = fold(carry, n_blocks * block, tail)
    m, l, o = carry
    out = (o / nonzero_or_one(l)[..., None]).reshape(B, Hkv, G, Tq, dims.v_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, Tq, Hq, dims.v_dim)

    def per_query(x):  # [B, Hkv, G·Tq] -> [B, Tq, Hq]
        return x.reshape(B, Hkv, G, Tq).transpose(0, 3, 1, 2).reshape(B, Tq, Hq)

    lse, lse_lo = lse_pair(l, finite_or_zero(m))
    return AttentionState(out, per_query(lse), per_query(lse_lo))


def flash_available() -> bool:
    """flash-attn-jax (the tested release) is importable and JAX's default backend is a CUDA
    GPU."""
    return (jax.default_backend() == "gpu"
            and importlib.util.find_spec("flash_attn_jax") is not None
            and _flash_version_reason() is None)


FLASH_TESTED = ("0", "6")
"""flash-attn-jax release line (0.6.x) whose private `_flash_mha_fwd` `flash_state` calls."""


def _flash_version_reason() -> str | None:
    """Why the installed flash-attn-jax is not the tested release, or None if it is.

    `flash_state` needs the log-sum-exp, which only flash-attn-jax's private
    `flash_attn_jax.flash._flash_mha_fwd` returns; a private name can change in any release,
    so only the tested 0.6.x line is accepted. A copy without package metadata (a source tree
    on `sys.path`) passes here, and `flash_state` still checks that the name exists.
    """
    from importlib import metadata

    try:
        version = metadata.version("flash-attn-jax")
    except metadata.PackageNotFoundError:
        return None
    if tuple(version.split(".")[:2]) == FLASH_TESTED:
        return None
    return (f"local_kernel='flash' is tested with flash-attn-jax {'.'.join(FLASH_TESTED)}.x "
            f"only (it calls the private `flash_attn_jax.flash._flash_mha_fwd` for the "
            f"log-sum-exp), but {version} is installed; `pip install 'tree_attention_edu[flash]'` "
            f"installs the tested release, or use local_kernel='xla'.")


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
    return _flash_version_reason()


def _flash_layout_reason(layout: str) -> str:
    return (f"local_kernel='flash' reads the 'bthd' `layout`, got layout={layout!r}; "
            f"use local_kernel='xla'.")


def resolve(name: str, *, dtype, head_dim: int, v_dim: int, needs_mask: bool,
            layout: str = "bthd") -> str:
    """Turn "auto" into a concrete kernel name; check an explicit "flash" can run."""
    _checks.check_kernel_name(name, KERNEL_NAMES)
    _checks.check_layout(layout, LAYOUTS)
    _checks.check_float_dtype(dtype, "dtype")
    _checks.check_int(head_dim, "head_dim")
    _checks.check_int(v_dim, "v_dim")
    if name == "xla":
        return name
    reason = flash_unsupported_reason(dtype, head_dim, v_dim, needs_mask)
    if reason is None and layout != "bthd":
        reason = _flash_layout_reason(layout)
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
    layout: str = "bthd",
) -> AttentionState:
    """FlashAttention-2 forward on an unmasked "bthd" shard; `kv_offset`, `causal` and
    `kv_lengths` are accepted for a uniform signature and ignored (`resolve` only picks flash
    when no mask applies)."""
    del kv_offset, causal, kv_lengths
    _checks.check_qkv(q, k_chunk, v_chunk)
    if layout != "bthd":
        raise ValueError(_flash_layout_reason(layout))
    scale = _checks.resolve_scale(scale, q.shape[-1], q.dtype)
    reason = _flash_version_reason()
    if reason:
        raise RuntimeError(reason)
    flash = importlib.import_module("flash_attn_jax.flash")  # lazy: CUDA-only, optional extra

    # Private API (the public `flash_mha` returns no lse); see `_flash_version_reason`.
    forward = getattr(flash, "_flash_mha_fwd", None)
    if forward is None:
        raise RuntimeError(
            "local_kernel='flash' calls flash-attn-jax's private "
            "`flash_attn_jax.flash._flash_mha_fwd` (tested with flash-attn-jax "
            f"{'.'.join(FLASH_TESTED)}.x), and the installed flash-attn-jax has no such name; "
            "`pip install 'tree_attention_edu[flash]'` installs the tested release, or use "
            "local_kernel='xla'.")
    out, lse = forward(q, k_chunk, v_chunk, softmax_scale=scale, is_causal=False,
                       window_size=(-1, -1))
    # flash returns out [B, Tq, Hq, D] in the input dtype and lse float32 [B, Hq, Tq].
    return AttentionState(out.astype(jnp.float32), jnp.transpose(lse, (0, 2, 1)))


KERNELS: dict[str, Kernel] = {"xla": xla_state, "flash": flash_state}

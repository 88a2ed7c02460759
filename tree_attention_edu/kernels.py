"""Local decode kernels: the per-device computation of an `AttentionState` for one KV shard.

* `"xla"`: pure JAX (`xla_state`): a streaming, flash-decoding style kernel that reads the
  cache once and makes no copy of it; works on every backend, dtype, mask and layout.
* `"flash"`: flash-attn-jax's FlashAttention-2 forward on a CUDA GPU, which returns the
  log-sum-exp the tree combine needs. It takes fp16/bf16, head_dim ≤ 256, `Dv == D`, and
  no key mask, so it serves shards that are fully valid (no padding, no `kv_lengths`,
  and no causal mask, or a single causal query, which sees every key anyway).
* `"cudnn"`: cuDNN's flash attention through JAX itself
  (`jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)`, see
  `cudnn_state`): no extra dependency and no cap on the JAX version. It takes fp16/bf16,
  head_dim a multiple of 8 up to 128 (256 on Hopper and later), `Dv == D`, and masks keys
  (`kv_lengths`, the decode-convention causal mask). Its lse comes back in the input dtype
  (a bf16 lse near 10 has a spacing of 0.0625); the merge is kept in float32.
* `"auto"`: on a CUDA GPU, flash where all of its limits hold and flash-attn-jax (the tested
  release) is installed, else cudnn where its limits hold and the layout is "bthd", else
  xla. On any other backend, xla.

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
from .attention import (
    accum_dtype,
    finite_or_zero,
    lse_pair,
    nonzero_or_one,
    select_valid_keys,
)
from .states import AttentionState

KERNEL_NAMES = ("auto", "xla", "flash", "cudnn")
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
    kv_head_window: tuple[int | Array, int] | None = None,
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
      kv_head_window: `(start, count)`: read only kv heads `[start, start + count)` of the
        chunk (`start` may be traced), as if the chunk held those heads alone; q then has
        `count·G` heads. Each block is sliced out of the cache as it is read, so no copy of
        the window is made: the pass-Q ring's query blocks use it.

    Returns:
      `AttentionState` (`out [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`) in the accumulation dtype.
    """
    _checks.check_layout(layout, LAYOUTS)
    head_ax = 3 - SEQ_AXIS[layout]
    window = kv_head_window
    if window is not None:  # validate against the window's view of the chunk
        count = _checks.check_int(window[1], "kv_head_window[1]")
        k_view, v_view = (jax.ShapeDtypeStruct(
            tuple(count if i == head_ax else n for i, n in enumerate(x.shape)), x.dtype)
            for x in (k_chunk, v_chunk))
    else:
        k_view, v_view = k_chunk, v_chunk
    dims = _checks.check_qkv(q, bthd_view(k_view, layout), bthd_view(v_view, layout),
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
        if window is None:
            kb = lax.dynamic_slice_in_dim(k_chunk, start, size, ax)
            vb = lax.dynamic_slice_in_dim(v_chunk, start, size, ax)
        else:
            kb, vb = (lax.dynamic_slice(x, _starts(ax, start, head_ax, window[0]),
                                        _sizes(x.shape, ax, size, head_ax, Hkv))
                      for x in (k_chunk, v_chunk))
        if layout == "bthd":
            kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
        vis = masks.visible(Tq, size, kv_lengths, kv_offset=kv_offset + start, causal=causal)
        valid = masks.valid_keys(size, kv_lengths, kv_offset=kv_offset + start) if padded else None
        return _fold(carry, qg, kb, vb, vis[:, None, None], valid, zg)

    if layout == "bhtd" and not padded and window is None:
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


def _backend() -> str:
    """JAX's default backend ("cpu", "gpu", "tpu"); one place for tests to stand in a GPU."""
    return jax.default_backend()


def _starts(seq_ax: int, seq_start, head_ax: int, head_start) -> list:
    starts = [0, 0, 0, 0]
    starts[seq_ax], starts[head_ax] = seq_start, head_start
    return [jnp.asarray(x, jnp.int32) for x in starts]  # one index dtype, as x64 may differ


def _sizes(shape, seq_ax: int, seq_size: int, head_ax: int, heads: int) -> list[int]:
    sizes = list(shape)
    sizes[seq_ax], sizes[head_ax] = seq_size, heads
    return sizes


def flash_available() -> bool:
    """flash-attn-jax (the tested release) is importable and JAX's default backend is a CUDA
    GPU."""
    return (_backend() == "gpu"
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
    backend = _backend() if backend is None else backend
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
    """Turn "auto" into a concrete kernel name; check an explicit "flash" or "cudnn" can run.

    "auto" picks, on a CUDA GPU, flash (when `flash_unsupported_reason` has no objection and
    the layout is "bthd"), else cudnn (when `cudnn_unsupported_reason` has none and the
    layout is "bthd": on "bhtd" the cudnn kernel would copy the cache into "bthd" first,
    while xla streams "bhtd" as it lies), else xla; on any other backend, xla. An explicit
    "flash" or "cudnn" that cannot run here raises a ValueError that says why and what to
    use instead.
    """
    _checks.check_kernel_name(name, KERNEL_NAMES)
    _checks.check_layout(layout, LAYOUTS)
    _checks.check_float_dtype(dtype, "dtype")
    _checks.check_int(head_dim, "head_dim")
    _checks.check_int(v_dim, "v_dim")
    if name == "xla":
        return name
    if name in ("auto", "flash"):
        flash = flash_unsupported_reason(dtype, head_dim, v_dim, needs_mask)
        if flash is None and layout != "bthd":
            flash = _flash_layout_reason(layout)
        if name == "flash":
            if flash:
                raise ValueError(flash)
            return name
        if flash is None:
            return "flash"
    cudnn = cudnn_unsupported_reason(dtype, head_dim, v_dim)
    if name == "cudnn":
        if cudnn:
            raise ValueError(cudnn)
        return name
    return "cudnn" if cudnn is None and layout == "bthd" else "xla"


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


# --- cuDNN through JAX ---------------------------------------------------------------------

CUDNN_IMPLEMENTATIONS = ("cudnn", "xla")
"""`implementation` values of `cudnn_state`: "cudnn" on an NVIDIA GPU; "xla", JAX's own
implementation of the same call, runs anywhere (how the adapter is tested on CPU)."""


def _cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the first device, e.g. (9, 0) on an H100; None if it is not a
    CUDA device (a CPU, a TPU, a ROCm GPU)."""
    try:
        cc = jax.devices()[0].compute_capability
    except (AttributeError, RuntimeError):
        return None
    try:
        major, minor, *_ = (int(x) for x in str(cc).split("."))
    except ValueError:
        return None
    return major, minor


def cudnn_head_dim_limit(capability: tuple[int, int] | None) -> int:
    """Largest head_dim cuDNN's bf16/fp16 flash attention takes: 256 from Hopper (compute
    capability 9.0) on, 128 before (JAX's `check_is_flash_attention`)."""
    return 256 if capability is not None and tuple(capability) >= (9, 0) else 128


def cudnn_unsupported_reason(
    dtype, head_dim: int, v_dim: int, backend: str | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why `local_kernel='cudnn'` cannot run this problem here, or None if it can.

    It needs JAX's default backend to be a CUDA GPU, float16 or bfloat16 inputs, a head_dim
    that is a multiple of 8 and at most `cudnn_head_dim_limit` of the GPU, and `v_dim ==
    head_dim`. Masks are no objection. `capability` defaults to the first device's.
    """
    backend = _backend() if backend is None else backend
    if backend != "gpu":
        return _checks.cudnn_needs_gpu(backend)
    if capability is None:
        capability = _cuda_capability()
    if capability is None:
        return _checks.cudnn_needs_gpu("a GPU that is not CUDA")
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return _checks.cudnn_dtype(dt)
    limit = cudnn_head_dim_limit(capability)
    if head_dim % 8 or head_dim > limit or v_dim != head_dim:
        return _checks.cudnn_head_dim(head_dim, v_dim, limit, capability)
    return None


def cudnn_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: str = "bthd",
    implementation: str = "cudnn",
) -> AttentionState:
    """State of one chunk of the cache from `jax.nn.dot_product_attention`, which returns
    the log-sum-exp with `return_residual=True`; through cuDNN's flash attention on an
    NVIDIA GPU (`implementation="cudnn"`), or anywhere through JAX's xla implementation of
    the same call (`implementation="xla"`, how the adapter is tested on CPU).

    Same contract as `xla_state` and `states.local_state`. What the adapter does:

    * **lse precision.** JAX returns the lse in the input dtype (cuDNN computes it in
      float32; JAX rounds it). A bfloat16 lse near 10 has a spacing of 0.0625: each chunk's
      weight in a merge, `exp(lse_i - lse)`, is off by up to half that, about 3%. The lse is
      cast to float32 here and every merge after this runs in float32, so the cost is one
      rounding per chunk, not one per merge. Measured (tests/test_kernels.py, bf16 inputs,
      two chunks of 256 keys with lse in [8.5, 14.5], against float64 attention): lse
      error 0.030; merged output error 1.5e-2, and 1.5e-2 from the bf16 lse alone (5.5e-3
      from the bf16 output alone), where `xla_state` (float32 lse) is within 1.6e-6.
    * **Masks** go through `key_value_seq_lengths`. `kv_lengths` are global and the chunk
      starts at `kv_offset`, so the chunk's own lengths are `clip(kv_lengths - kv_offset,
      0, Tc)`. The causal mask of this package puts query `i` at `L_b - Tq + i` (the decode
      convention, `masks`); `dot_product_attention`'s `is_causal` aligns the diagonal top-left
      instead, so with `causal=True` and `Tq > 1` the exact visibility (`masks.visible`) is
      passed as a boolean `mask [B, 1, Tq, Tc]` (cuDNN adds it as a bias: Tq·Tc numbers, small
      next to the cache's 2·Tc·Hkv·D). A single causal query sees every valid key, so it
      needs no mask.
    * **Rows that see nothing** (a chunk wholly past a length, a causal row before the
      chunk) get whatever the library returns there; they are replaced (`where`) by the
      identity `(0, -inf)` exactly.
    * **Layout.** cuDNN reads "bthd" through this API; a "bhtd" chunk is transposed to it
      first, which is a copy as large as the chunk (use `xla_state` for "bhtd" caches).
    * **GQA** (`Hq` a multiple of `Hkv`) is native. `Dv` must equal `D`. Inputs of mixed
      dtypes are cast to a common one (a copy of the arrays that differ).
    * **Padding.** cuDNN skips keys past the lengths; the xla implementation would weigh
      them by 0 (0·NaN is NaN), so on it they are selected away first (`where`): masked keys
      may hold anything on both.

    Args:
      implementation: "cudnn" (needs a CUDA GPU, fp16/bf16, head_dim a multiple of 8 and at
        most 128, or 256 on Hopper and later) or "xla".

    Returns:
      `AttentionState` (`out [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`) in the accumulation dtype
      (float32, or float64 for float64 inputs on the xla implementation).
    """
    dims = _checks.check_qkv(q, bthd_view(k_chunk, layout), bthd_view(v_chunk, layout),
                             kv_lengths, chunk=True)
    _checks.check_choice(implementation, CUDNN_IMPLEMENTATIONS, "implementation")
    _checks.check_bool(causal, "causal")
    B, Tq, Hq, D = q.shape
    Tc = dims.kv_len
    scale = _checks.resolve_scale(scale, D, q.dtype)
    if dims.v_dim != D:
        raise ValueError(_checks.cudnn_v_dim(D, dims.v_dim))
    if implementation == "cudnn":
        reason = cudnn_unsupported_reason(q.dtype, D, dims.v_dim)
        if reason:
            raise ValueError(reason)
    dt = jnp.result_type(q.dtype, k_chunk.dtype, v_chunk.dtype)
    acc = accum_dtype(dt)
    if B == 0 or Tq == 0:
        return AttentionState(jnp.zeros((B, Tq, Hq, D), acc), jnp.full((B, Tq, Hq), -jnp.inf, acc),
                              jnp.zeros((B, Tq, Hq), acc))
    q, k, v = (jnp.asarray(x) for x in (q, k_chunk, v_chunk))
    q, k, v = (x if x.dtype == dt else x.astype(dt) for x in (q, k, v))
    k, v = to_layout(k, layout, "bthd"), to_layout(v, layout, "bthd")  # "bhtd": a copy

    local = mask = None
    if kv_lengths is not None:  # the chunk's own lengths
        local = jnp.clip(jnp.asarray(kv_lengths, jnp.int32) - jnp.asarray(kv_offset, jnp.int32),
                         0, Tc).astype(jnp.int32)
    if causal and Tq > 1:  # decode convention, bottom-right aligned: an explicit mask
        lengths = (masks.full_lengths(B, Tc) + kv_offset if kv_lengths is None
                   else jnp.asarray(kv_lengths, jnp.int32))
        vis = masks.visible(Tq, Tc, lengths, kv_offset=kv_offset, causal=True)  # [B, Tq, Tc]
        mask = vis[:, None]
        seen = jnp.any(vis, axis=-1)  # [B, Tq]
    elif local is not None:
        seen = jnp.broadcast_to((local > 0)[:, None], (B, Tq))
    else:
        seen = None  # every key of the chunk holds data and is visible (Tc >= 1)
    if implementation == "xla" and kv_lengths is not None:
        # JAX's xla implementation weighs keys past the lengths by 0 (and 0·NaN is NaN):
        # select them away first. cuDNN does not read them.
        k = select_valid_keys(k, kv_lengths, kv_offset)
        v = select_valid_keys(v, kv_lengths, kv_offset)
    out, lse = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=False, key_value_seq_lengths=local,
        implementation=implementation, return_residual=True)
    out, lse = out.astype(acc), lse.astype(acc)  # the lse comes in the input dtype
    if seen is not None:  # select, never multiply: the library's empty rows may hold NaN
        out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), acc))
        lse = jnp.where(seen[:, :, None], lse, jnp.asarray(-jnp.inf, acc))
    return AttentionState(out, lse, jnp.zeros_like(lse))


KERNELS: dict[str, Kernel] = {"xla": xla_state, "flash": flash_state, "cudnn": cudnn_state}

"""The streaming local kernel in pure JAX: a flash-decoding style pass over one KV shard that
reads the cache once and makes no copy of it. Works on every backend, dtype, mask and
layout, and is differentiable by JAX's autodiff.

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
  (see `tree_attention_edu.llama.model`).

Padding (keys past `kv_lengths`) is selected away in K and V before any product by default,
which makes the state exact whatever the padding holds, at the price of a copy of each
block. A cache whose padding is known to be finite can say so (`padding="finite"`): then a
decode step reads a head-major chunk in one pass and copies nothing.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from .. import inputs, masks, validate
from ..devices import varying_like
from ..inputs import SEQ_AXIS
from ..names import Layout
from ..numerics import PRECISION, accum_dtype, finite_or_zero, lse_pair, nonzero_or_one
from ..states import AttentionState

Padding = Literal["any", "finite"]
"""What `xla_state`'s `padding` may say the keys past `kv_lengths` hold."""
PADDINGS: tuple[Padding, ...] = get_args(Padding)

DEFAULT_BLOCK = 256
"""Keys per block of the streaming kernel on the "bthd" layout: 256 keys × 16 heads × 128
× 4 bytes is 2 MiB per block of K, small enough to transpose in cache. Measured on a 2-core
CPU at Tk=65536: 128 to 512 stream at 12-15 GB/s; 64 and below pay for the loop when 8
simulated devices share the cores, and 1024 and up spill and drop to ~6 GB/s."""


def _fold(carry, qg, kb, vb, visible, valid, zg=None, scale=None):
    """Fold one head-major block into the running online-softmax state.

    `qg [B, Hkv, G·Tq, D]`, `kb [B, Hkv, C, D]`, `vb [B, Hkv, C, Dv]`,
    `visible [B, 1, 1, Tq, C]`, `valid [B, C]` (keys that hold data, or None when all do),
    `zg [B, Hkv, G·Tq, Dv]` an energy source ζ added to the scores as `ζ·v` (or None);
    carry `(m, l, o)`:
    running max `[B, Hkv, G·Tq]` (-inf while nothing is visible), sum of `exp(s - m)`, and
    unnormalised numerator `[..., Dv]`.

    `qg` is in the accumulation dtype. `scale` None: `qg` is scaled, and the scores' product
    runs on float32 (or float64) upcasts at `PRECISION`. `scale` a float: `qg` is unscaled and
    holds q's 16-bit values exactly (`_exact_products`); the product takes them and K in that
    dtype with float32 accumulation (`_scores16`), and the scores are scaled after it.
    """
    m, l, o = carry
    B, Hkv, M, _ = qg.shape
    C = kb.shape[2]
    acc = qg.dtype
    if valid is not None:  # padding may hold anything (NaN, inf): select it away first
        keep = valid[:, None, :, None]
        kb = jnp.where(keep, kb, jnp.zeros((), kb.dtype))
        vb = jnp.where(keep, vb, jnp.zeros((), vb.dtype))
    if scale is None:
        s = jnp.einsum("bhmd,bhcd->bhmc", qg, kb.astype(acc), precision=PRECISION)
    else:
        s = _scores16(*varying_like((qg, kb), qg, kb)) * scale  # alike for its cotangents
    if zg is not None:  # the tilted scores s + ζ·v of the energy F(ζ)
        s = s + jnp.einsum("bhmv,bhcv->bhmc", zg, vb.astype(acc), precision=PRECISION)
    Tq = visible.shape[3]
    s = jnp.where(visible, s.reshape(B, Hkv, M // Tq, Tq, C), -jnp.inf).reshape(B, Hkv, M, C)
    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))  # a shift: no gradient
    shift = finite_or_zero(m_new)  # a block with nothing visible yet: exp(-inf - 0) = 0
    p = jnp.exp(s - shift[..., None])
    rescale = jnp.exp(m - shift)
    l = l * rescale + jnp.sum(p, axis=-1)
    o = o * rescale[..., None] + jnp.einsum(
        "bhmc,bhcv->bhmv", p, vb.astype(acc), precision=PRECISION
    )
    return m_new, l, o


def _check_window(window: Any, kv_heads: int) -> tuple[int | Array, int]:
    """`kv_head_window = (start, count)`: `count` a Python int in `[1, Hkv]`; `start` a Python
    int in `[0, Hkv - count]`, or an integer JAX scalar (a traced start cannot be checked:
    `lax.dynamic_slice` clamps it into that range)."""
    example = "`kv_head_window=(0, 2)` reads kv heads 0 and 1"
    if not (isinstance(window, tuple) and len(window) == 2):
        raise TypeError(
            f"`kv_head_window` must be a (start, count) pair, got "
            f"{validate.describe(window)}; e.g. {example}."
        )
    start, count = window
    count = validate.check_int(count, "kv_head_window[1]", example=example)
    if count > kv_heads:
        raise ValueError(
            f"`kv_head_window[1]` = {count} exceeds the chunk's {kv_heads} kv "
            f"heads; a window reads at most all of them."
        )
    if isinstance(start, int | np.integer) and not isinstance(start, bool | np.bool_):
        if not 0 <= start <= kv_heads - count:
            raise ValueError(
                f"`kv_head_window[0]` = {start} is out of range: a window of "
                f"{count} kv heads starts in [0, {kv_heads - count}]."
            )
        return int(start), count
    dtype = getattr(start, "dtype", None)
    if (
        dtype is None
        or validate.shape_of(start, "kv_head_window[0]") != ()
        or not jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(
            f"`kv_head_window[0]` must be an int or an integer JAX scalar, got "
            f"{validate.describe(start)}; e.g. {example}."
        )
    return start, count


def _window_view(
    k_chunk: Array, v_chunk: Array, window: tuple[int | Array, int] | None, layout: Layout
) -> tuple[tuple[int | Array, int] | None, Any, Any]:
    """The checked `kv_head_window` and the shapes of K and V as the window shows them (a
    `jax.ShapeDtypeStruct` each), which is what `check_qkv` validates against."""
    if window is None:
        return None, k_chunk, v_chunk
    ks = validate.shape_of(k_chunk, "k_chunk")
    if len(ks) != 4:  # check_qkv names the rank error
        return window, k_chunk, v_chunk
    head_ax = 3 - SEQ_AXIS[layout]
    window = _check_window(window, ks[head_ax])
    k_view, v_view = (
        jax.ShapeDtypeStruct(
            tuple(window[1] if i == head_ax else n for i, n in enumerate(x.shape)), x.dtype
        )
        for x in (k_chunk, v_chunk)
    )
    return window, k_view, v_view


def xla_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: Layout = "bthd",
    block: int = DEFAULT_BLOCK,
    zeta: Array | None = None,
    kv_head_window: tuple[int | Array, int] | None = None,
    padding: Padding = "any",
) -> AttentionState:
    """State of one chunk of the cache, streaming it once without copying it.

    Same contract as `core.states.local_state` (which it matches to rounding), plus:

    Args:
      k_chunk: `[B, Tc, Hkv, D]` ("bthd") or `[B, Hkv, Tc, D]` ("bhtd").
      v_chunk: `[B, Tc, Hkv, Dv]` or `[B, Hkv, Tc, Dv]`, like `k_chunk`.
      layout: "bthd" or "bhtd" (see the module docstring).
      kv_lengths: `[B]` global valid lengths, used as given; keys past them (the padding)
        are masked as `padding` says. `None`: every key of the chunk holds data.
      padding: what the keys past `kv_lengths` may hold.
        "any" (the default): anything, NaN and inf included. They are selected away in K
        and V before any product (`where`, block by block), so the state is exact whatever
        they hold.
        "finite": the caller promises finite padding (a cache it owns and fills with finite
        keys and values, as `llama.model` does). Only the scores are selected, so a padding
        key weighs exactly 0 and `0·v = 0`; a decode step ("bhtd", `G·Tq <= D`) then reads
        the chunk in one pass with no copy of K or V, about twice as fast on XLA:CPU
        (`scripts/decode_variants.py`). A broken promise is never silent: a value of inf or
        NaN in the padding makes `0·v` NaN, so those rows of `out` come out NaN.
      block: keys per block on the "bthd" layout, and on "bhtd" when `kv_lengths` is given
        (unless `padding="finite"` and `G·Tq <= D`); an unmasked "bhtd" chunk, whose scores
        are selected only by the causal mask, is read in one pass.
      zeta: `[B, Tq, Hq, Dv]` energy source ζ, or None. The scores become `s + ζ·v_a`, so
        `lse` is the chunk's energy F(ζ) and `out` the mean of v under the tilted weights
        (`theory.energy.energy`); the streaming energy path of `core.decode.tree_energy`.
      kv_head_window: `(start, count)`: read only kv heads `[start, start + count)` of the
        chunk, as if the chunk held those heads alone; q then has `count·G` heads. `count`
        is a Python int in `[1, Hkv]`; `start` a Python int in `[0, Hkv - count]` (checked)
        or an integer JAX scalar (traced: clamped into that range, as `lax.dynamic_slice`
        does). Each block is sliced out of the cache as it is read, so no copy of the
        window is made: the pass-Q ring's query blocks use it.

    Returns:
      `AttentionState` (`out [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`) in the accumulation dtype.
    """
    inputs.check_layout(layout)
    window, k_view, v_view = _window_view(k_chunk, v_chunk, kv_head_window, layout)
    dims = inputs.check_qkv(q, k_view, v_view, kv_lengths, layout=layout)
    kv_offset = inputs.check_kv_offset(kv_offset)
    validate.check_positive(block, "block")
    validate.check_choice(padding, PADDINGS, "padding")
    if zeta is not None:
        inputs.check_zeta(zeta, dims)
    return xla_core(
        q,
        k_chunk,
        v_chunk,
        kv_offset=kv_offset,
        scale=inputs.resolve_scale(scale, dims.head_dim, q.dtype),
        causal=bool(causal),
        kv_lengths=None if kv_lengths is None else masks.as_lengths(kv_lengths),
        layout=layout,
        block=block,
        zeta=zeta,
        kv_head_window=window,
        padding=padding,
    )


def xla_core(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array,
    scale: float,
    causal: bool,
    kv_lengths: Array | None,
    layout: Layout,
    block: int = DEFAULT_BLOCK,
    zeta: Array | None = None,
    kv_head_window: tuple[int | Array, int] | None = None,
    padding: Padding = "any",
) -> AttentionState:
    """`xla_state` without its checks: the arguments as `xla_state` hands them on (`scale`
    resolved to a float, `kv_lengths` int lengths or None, the window checked). The
    decoders call this on arguments they checked once, at their own door."""
    B, Tq, Hq, D = q.shape
    seq_ax = SEQ_AXIS[layout]
    head_ax = 3 - seq_ax
    window = kv_head_window
    Hkv = k_chunk.shape[head_ax] if window is None else window[1]
    Tc, Dv, G = k_chunk.shape[seq_ax], v_chunk.shape[-1], Hq // Hkv
    acc = accum_dtype(q.dtype)
    if B == 0 or Tq == 0:
        return AttentionState(
            jnp.zeros((B, Tq, Hq, Dv), acc),
            jnp.full((B, Tq, Hq), -jnp.inf, acc),
            jnp.zeros((B, Tq, Hq), acc),
        )
    # With `kv_lengths` and padding that may hold anything, keys past them are selected away
    # block by block (a where over the whole chunk would be a cache-sized copy). Without
    # them, or with finite padding, only scores are selected, and a head-major chunk is read
    # in one pass when its scores are no larger than its keys (a decode step).
    padded = kv_lengths is not None
    select = padded and padding == "any"
    lengths = masks.full_lengths(B, Tc) + kv_offset if kv_lengths is None else kv_lengths
    # Queries of one kv head side by side: [B, Hkv, G·Tq, D], so K and V keep their layout.
    exact = _exact_products(q.dtype, k_chunk.dtype)
    qa = q.astype(acc)  # exact for a 16-bit q: `_scores16` takes its values back unchanged
    qg = _by_kv_head(qa if exact else qa * jnp.asarray(scale, acc), Hkv)
    zg = None if zeta is None else _by_kv_head(zeta.astype(acc), Hkv)
    carry = (
        jnp.full((B, Hkv, G * Tq), -jnp.inf, acc),
        jnp.zeros((B, Hkv, G * Tq), acc),
        jnp.zeros((B, Hkv, G * Tq, Dv), acc),
    )
    carry = varying_like(carry, q, k_chunk, v_chunk, lengths, kv_offset)

    def fold(carry, start, size):
        if window is None:
            kb = lax.dynamic_slice_in_dim(k_chunk, start, size, seq_ax)
            vb = lax.dynamic_slice_in_dim(v_chunk, start, size, seq_ax)
        else:
            kb, vb = (
                lax.dynamic_slice(
                    x,
                    _starts(seq_ax, start, head_ax, window[0]),
                    _sizes(x.shape, seq_ax, size, head_ax, Hkv),
                )
                for x in (k_chunk, v_chunk)
            )
        if layout == "bthd":
            kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
        vis = masks.visible(Tq, size, lengths, kv_offset=kv_offset + start, causal=causal)
        valid = masks.valid_keys(size, lengths, kv_offset=kv_offset + start) if select else None
        return _fold(carry, qg, kb, vb, vis[:, None, None], valid, zg, scale if exact else None)

    if layout == "bhtd" and window is None and not select and (not padded or G * Tq <= D):
        carry = fold(carry, 0, Tc)
    else:
        carry = _walk(fold, carry, Tc, block)
    return _finish(carry, Tq)


def _exact_products(q_dtype: Any, k_dtype: Any) -> bool:
    """Whether the scores' product may take q and K in their own dtype, with float32
    accumulation: both are the same 16-bit float, whose products are exact in float32
    (8 or 11 significant bits twice is at most 22 of float32's 24), so the result is what the
    float32 upcasts at `PRECISION` compute, rounded differently only in the sums.

    Measured on an H200 (results/gpu/README.md, second lease): a bf16 GQA decode step on a
    head-major cache at 128k keys read 2,479 GB/s this way against 1,449 with the upcasts
    (1.71x), at about the same error against float64 (1.40e-8 and 1.24e-8 of max|v| at 16k,
    within 13%). The
    weighted sum keeps float32 weights at `PRECISION`: rounding them to bf16 (flash
    attention's choice) was faster still (2,933 GB/s) but at 1,133 times the error.

    One difference remains: the scores are scaled after the product, so for bf16 (float32's
    exponent range) a product above float32's largest number (3.4e38) overflows where the
    upcast form, scaled first, overflowed only above 3.4e38 / scale (√D times more: scores
    of order 1e38, far outside attention's range). fp16 products cannot overflow float32."""
    q, k = jnp.dtype(q_dtype), jnp.dtype(k_dtype)
    return q == k and q in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@jax.custom_vjp
def _scores16(q32: Array, k: Array) -> Array:
    """`q32 [B, H, M, D]` float32 holding 16-bit values exactly, `k [B, H, C, D]` in that
    16-bit dtype -> float32 scores `[B, H, M, C]`: the product of the 16-bit operands with
    float32 accumulation, at XLA's default precision (what the second lease timed).

    Its derivative is the upcast form's, at `PRECISION`: dq in float32 (so a scan over
    blocks sums q's gradient in float32 and rounds it once, at the kernel's input), dk in
    K's dtype. JAX's own derivative of the 16-bit product would round each block's dq to
    bf16, sum them in bf16 (10 times the old error in dq over 256 blocks), and multiply at
    the default precision (TF32 on NVIDIA GPUs)."""
    return jnp.einsum("bhmd,bhcd->bhmc", q32.astype(k.dtype), k, preferred_element_type=q32.dtype)


def _scores16_fwd(q32: Array, k: Array) -> tuple[Array, tuple[Array, Array]]:
    return _scores16(q32, k), (q32, k)


def _scores16_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    q32, k = res
    dq = jnp.einsum("bhmc,bhcd->bhmd", g, k.astype(g.dtype), precision=PRECISION)
    dk = jnp.einsum("bhmc,bhmd->bhcd", g, q32, precision=PRECISION)
    return dq, dk.astype(k.dtype)


_scores16.defvjp(_scores16_fwd, _scores16_bwd)


def _by_kv_head(x: Array, kv_heads: int) -> Array:
    """`[B, Tq, Hq, ·]` -> `[B, Hkv, G·Tq, ·]`: the queries of one kv head side by side."""
    B, Tq, Hq, d = x.shape
    x = x.reshape(B, Tq, kv_heads, Hq // kv_heads, d).transpose(0, 2, 3, 1, 4)
    return x.reshape(B, kv_heads, Hq // kv_heads * Tq, d)


def _walk(fold: Any, carry: Any, length: int, block: int) -> Any:
    """Fold `[0, length)` block by block: a `lax.scan` over whole blocks, then the tail."""
    n_blocks, tail = divmod(length, block)
    if n_blocks:
        carry, _ = lax.scan(
            lambda c, i: (fold(c, i * block, block), None), carry, jnp.arange(n_blocks)
        )
    if tail:
        carry = fold(carry, n_blocks * block, tail)
    return carry


def _finish(carry: Any, q_len: int) -> AttentionState:
    """The online-softmax carry `(m, l, o)` `[B, Hkv, G·Tq, ·]` as a state `[B, Tq, Hq, ·]`."""
    m, l, o = carry
    B, Hkv, M = o.shape[:3]
    G, Tq = M // q_len, q_len

    def per_query(x):  # [B, Hkv, G·Tq, ...] -> [B, Tq, Hq, ...]
        x = x.reshape(B, Hkv, G, Tq, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1).reshape(B, Tq, Hkv * G, *x.shape[4:])

    lse, lse_lo = lse_pair(l, finite_or_zero(m))
    out = per_query(o / nonzero_or_one(l)[..., None])
    return AttentionState(out, per_query(lse), per_query(lse_lo))


def _starts(seq_ax: int, seq_start, head_ax: int, head_start) -> list:
    starts = [0, 0, 0, 0]
    starts[seq_ax], starts[head_ax] = seq_start, head_start
    return [jnp.asarray(x, jnp.int32) for x in starts]  # one index dtype, as x64 may differ


def _sizes(shape, seq_ax: int, seq_size: int, head_ax: int, heads: int) -> list[int]:
    sizes = list(shape)
    sizes[seq_ax], sizes[head_ax] = seq_size, heads
    return sizes

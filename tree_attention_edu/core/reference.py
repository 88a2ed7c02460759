"""Plain softmax attention on one device: the definition every other path must reproduce.

Layout follows `jax.nn.dot_product_attention`:
`q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`, output `[B, Tq, Hq, Dv]`.
Query head `h` reads kv head `h // (Hq // Hkv)` (grouped-query attention).

Low-precision inputs (bf16, fp16) are computed in float32 and the result is cast back;
float64 inputs stay float64, which the identities in the tests rely on.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from . import inputs, masks
from .numerics import PRECISION, accum_dtype, masked_softmax_parts, nonzero_or_one


def grouped_scores(a: Array, b: Array) -> Array:
    """Per-head dot products with grouped heads: `a [B, Tq, Hq, E]`, `b [B, Tk, Hkv, E]`.

    Returns `[B, Hq, Tq, Tk]` with `out[b, h, i, j] = a[b, i, h] · b[b, j, h // G]`.
    Used for q·k (the scores) and for ζ·v (the source term of the energy).
    """
    B, Tq, Hq, E = a.shape
    Hkv = b.shape[2]
    ag = a.reshape(B, Tq, Hkv, Hq // Hkv, E)
    s = jnp.einsum("bqhge,bkhe->bhgqk", ag, b, precision=PRECISION)
    return s.reshape(B, Hq, Tq, b.shape[1])


def grouped_values(p: Array, v: Array) -> Array:
    """Weighted values: `p [B, Hq, Tq, Tk]`, `v [B, Tk, Hkv, Dv]` -> `[B, Tq, Hq, Dv]`."""
    B, Hq, Tq, Tk = p.shape
    Hkv = v.shape[2]
    pg = p.reshape(B, Hkv, Hq // Hkv, Tq, Tk)
    out = jnp.einsum("bhgqk,bkhv->bqhgv", pg, v, precision=PRECISION)
    return out.reshape(B, Tq, Hq, v.shape[3])


def scaled_scores(
    q: Array,
    k: Array,
    *,
    scale: float,
    causal: bool,
    kv_lengths: Array | None,
    kv_offset: int | Array = 0,
) -> tuple[Array, Array]:
    """Scores `scale·q·k` `[B, Hq, Tq, Tk]` in the accumulation dtype, and the visibility mask.

    The mask is `[B, 1, Tq, Tk]`. `kv_lengths=None` means the cache ends with this chunk
    (`L_b = kv_offset + Tk` for every sequence). Keys past `kv_lengths` are zeroed before the
    product, so whatever they store (NaN, inf) reaches neither the scores nor their gradient.
    """
    acc = accum_dtype(q.dtype)
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    if kv_lengths is None:
        kv_lengths = masks.full_lengths(B, Tk) + kv_offset
    else:
        k = masks.select_valid_keys(k, kv_lengths, kv_offset)
    s = grouped_scores(q.astype(acc) * jnp.asarray(scale, acc), k.astype(acc))
    mask = masks.visible(Tq, Tk, kv_lengths, kv_offset=kv_offset, causal=causal)
    return s, mask[:, None]


def weights(
    q: Array,
    k: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Attention weights `[B, Hq, Tq, Tk]` (accumulation dtype). A row with no visible key is 0.

    `kv_lengths` is clamped into `[0, Tk]` (see `attention`).
    """
    _, ks = inputs.check_qk(q, k)
    inputs.check_kv_lengths(kv_lengths, ks[0])
    if kv_lengths is not None:
        kv_lengths = masks.clamp_lengths(kv_lengths, ks[0], ks[1])
    s, mask = scaled_scores(
        q,
        k,
        scale=inputs.resolve_scale(scale, ks[3], q.dtype),
        causal=causal,
        kv_lengths=kv_lengths,
    )
    p, l, _ = masked_softmax_parts(s, mask)
    return p / nonzero_or_one(l)[..., None]


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Softmax attention `softmax(scale·q·kᵀ) v`, `[B, Tq, Hq, Dv]` in q's dtype.

    Args:
      q: `[B, Tq, Hq, D]` queries.
      k: `[B, Tk, Hkv, D]` keys; `Hq` must be a multiple of `Hkv`.
      v: `[B, Tk, Hkv, Dv]` values.
      scale: score scale; `None` means `1/sqrt(D)`.
      causal: decode-convention causal mask (query i sits at position `L_b - Tq + i`).
      kv_lengths: `[B]` ints; keys at positions `>= kv_lengths[b]` are masked. Lengths are
        clamped into `[0, Tk]` (values are never inspected, so this holds eagerly and under
        `jax.jit` alike).

    A query that sees no key (e.g. `kv_lengths[b] == 0`) gets an output of zeros: the
    empty sum, and the identity of `core.states.combine`. Keys and values past `kv_lengths`
    are selected away, never multiplied by a zero weight, so they may hold anything.
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    if dims.batch == 0 or dims.q_len == 0:
        return jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), q.dtype)
    if kv_lengths is not None:
        kv_lengths = masks.clamp_lengths(kv_lengths, dims.batch, dims.kv_len)
        v = masks.select_valid_keys(v, kv_lengths)
    w = weights(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)
    return grouped_values(w, v.astype(w.dtype)).astype(q.dtype)

"""Reference softmax attention on one device, and the numerics every other module shares.

Layout follows `jax.nn.dot_product_attention`:
`q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`, output `[B, Tq, Hq, Dv]`.
Query head `h` reads kv head `h // (Hq // Hkv)` (grouped-query attention).

Low-precision inputs (bf16, fp16) are computed in float32 and the result is cast back;
float64 inputs stay float64, which the identities in the tests rely on.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array

from . import _checks, masks


def accum_dtype(dtype) -> jnp.dtype:
    """The dtype sums are carried in: float64 stays, everything else accumulates in float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def grouped_scores(a: Array, b: Array) -> Array:
    """Per-head dot products with grouped heads: `a [B, Tq, Hq, E]`, `b [B, Tk, Hkv, E]`.

    Returns `[B, Hq, Tq, Tk]` with `out[b, h, i, j] = a[b, i, h] · b[b, j, h // G]`.
    Used for q·k (the scores) and for ζ·v (the source term of the energy).
    """
    B, Tq, Hq, E = a.shape
    Hkv = b.shape[2]
    ag = a.reshape(B, Tq, Hkv, Hq // Hkv, E)
    s = jnp.einsum("bqhge,bkhe->bhgqk", ag, b)
    return s.reshape(B, Hq, Tq, b.shape[1])


def grouped_values(p: Array, v: Array) -> Array:
    """Weighted values: `p [B, Hq, Tq, Tk]`, `v [B, Tk, Hkv, Dv]` -> `[B, Tq, Hq, Dv]`."""
    B, Hq, Tq, Tk = p.shape
    Hkv = v.shape[2]
    pg = p.reshape(B, Hkv, Hq // Hkv, Tq, Tk)
    out = jnp.einsum("bhgqk,bkhv->bqhgv", pg, v)
    return out.reshape(B, Tq, Hq, v.shape[3])


def finite_or_zero(m: Array) -> Array:
    """Replace -inf (a fully masked row's max) by 0 so that `x - m` never makes (-inf) - (-inf)."""
    return jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))


def safe_positive(x: Array) -> Array:
    """`x` where positive, else 1: a denominator or log argument that cannot produce NaN."""
    return jnp.where(x > 0, x, jnp.ones_like(x))


def masked_softmax_parts(
    s: Array, mask: Array, axes: Sequence[str] = ()
) -> tuple[Array, Array, Array]:
    """Safe-max softmax pieces along the last axis.

    Args:
      s: scores `[..., Tk]`.
      mask: boolean, broadcastable to `s`; False entries are excluded.
      axes: mesh axes (inside `shard_map`) the keys are sharded over, outermost first.
        If given, the max is Allreduced (max) and the sum Allreduced (sum) over them,
        innermost axis first: paper, Algorithm 1.

    Returns:
      `(p, l, m)`: unnormalised weights `p = exp(s - m)` (0 where masked), their sum `l`
      `[...]`, and the row max `m` `[...]` (0 for a fully masked row, where `l` is 0).
      The max carries no gradient: log-sum-exp does not depend on the shift (see
      `symbolic.shift_invariance`).
    """
    s = jnp.where(mask, s, -jnp.inf)
    # The shift carries no gradient (and pmax has no differentiation rule), so stop it first.
    # An empty row's max is -inf: pmax must see that, not a stand-in 0.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    for ax in reversed(tuple(axes)):
        m = jax.lax.pmax(m, ax)
    m = finite_or_zero(m)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    for ax in reversed(tuple(axes)):
        l = jax.lax.psum(l, ax)
    return p, l, m


def lse_from_parts(l: Array, m: Array) -> Array:
    """log-sum-exp `m + log l`, and exactly -inf where nothing was visible (`l == 0`)."""
    return jnp.where(l > 0, m + jnp.log(safe_positive(l)), -jnp.inf)


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
    (`L_b = kv_offset + Tk` for every sequence).
    """
    acc = accum_dtype(q.dtype)
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    if kv_lengths is None:
        kv_lengths = masks.full_lengths(B, Tk) + kv_offset
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
    """Attention weights `[B, Hq, Tq, Tk]` (accumulation dtype). A row with no visible key is 0."""
    _, ks = _checks.check_qk(q, k)
    _checks.check_kv_lengths(kv_lengths, ks[0])
    s, mask = scaled_scores(
        q, k, scale=_checks.resolve_scale(scale, ks[3]), causal=causal, kv_lengths=kv_lengths
    )
    p, l, _ = masked_softmax_parts(s, mask)
    return p / safe_positive(l)[..., None]


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
      kv_lengths: `[B]` ints; keys at positions `>= kv_lengths[b]` are masked.

    A query that sees no key (e.g. `kv_lengths[b] == 0`) gets an output of zeros: the
    empty sum, and the identity of `states.combine`.
    """
    _checks.check_qkv(q, k, v, kv_lengths)
    w = weights(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)
    return grouped_values(w, v.astype(w.dtype)).astype(q.dtype)

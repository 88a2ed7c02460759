"""Reference softmax attention on one device, and the numerics every other module shares.

Layout follows `jax.nn.dot_product_attention`:
`q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`, output `[B, Tq, Hq, Dv]`.
Query head `h` reads kv head `h // (Hq // Hkv)` (grouped-query attention).

Low-precision inputs (bf16, fp16) are computed in float32 and the result is cast back;
float64 inputs stay float64, which the identities in the tests rely on.
"""

from __future__ import annotations

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
    """Replace ±inf and NaN (e.g. a fully masked row's max) by 0 so that `x - m` never makes
    (-inf) - (-inf). A NaN row still ends NaN: its scores carry the NaN into the sum."""
    return jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))


def nonzero_or_one(x: Array) -> Array:
    """`x`, with exact zeros replaced by 1: a denominator or log argument for an empty sum.

    NaN passes through (a NaN sum must stay visible, never become a 1).
    """
    return jnp.where(x == 0, jnp.ones_like(x), x)


def two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """Knuth's TwoSum: `hi = fl(a + b)` and the exact rounding error `lo`, so `a + b = hi + lo`.

    Six flops, no branch, exact in round-to-nearest for finite inputs (XLA does not
    reassociate floating-point sums).
    """
    hi = a + b
    bb = hi - a
    lo = (a - (hi - bb)) + (b - bb)
    return hi, lo


def masked_softmax_parts(s: Array, mask: Array) -> tuple[Array, Array, Array]:
    """Safe-max softmax pieces along the last axis.

    Args:
      s: scores `[..., Tk]`.
      mask: boolean, broadcastable to `s`; False entries are excluded (selected away, so a
        NaN or inf score there never reaches the result).

    Returns:
      `(p, l, m)`: unnormalised weights `p = exp(s - m)` (0 where masked), their sum `l`
      `[...]`, and the row max `m` `[...]` (0 for a fully masked row, where `l` is 0).
      The max carries no gradient: log-sum-exp does not depend on the shift (see
      `symbolic.shift_invariance`).
    """
    s = jnp.where(mask, s, -jnp.inf)
    # The shift carries no gradient: the log-sum-exp does not depend on it.
    m = finite_or_zero(jax.lax.stop_gradient(jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[..., None])
    return p, jnp.sum(p, axis=-1), m


def lse_from_parts(l: Array, m: Array) -> Array:
    """log-sum-exp `m + log l`, and exactly -inf where nothing was visible (`l == 0`)."""
    return lse_pair(l, m)[0]


def lse_pair(l: Array, m: Array) -> tuple[Array, Array]:
    """`m + log l` as a double-word number `(hi, lo)`: `hi` is the rounded log-sum-exp and `lo`
    its rounding error (`-inf, 0` where `l == 0`).

    In float32 a log-sum-exp of 1e8 has a spacing of 8, so `log l` (a few units) would round
    away entirely; `lo` keeps it, which is what makes merging such states exact
    (`states.combine`).
    """
    hi, lo = two_sum(m, jnp.log(nonzero_or_one(l)))
    empty = l == 0
    return jnp.where(empty, -jnp.inf, hi), jnp.where(empty, jnp.zeros_like(lo), lo)


def select_valid_keys(x: Array, kv_lengths: Array, kv_offset: int | Array = 0,
                      seq_axis: int = 1) -> Array:
    """Zero the keys or values of `x` at global positions `>= kv_lengths[b]` (with `where`).

    Such slots hold an uninitialised cache or another sequence's leftovers; a zero weight
    times a stored NaN is NaN, so masked data is selected away before any product.
    `x` is `[B, ..., Tk, ...]` with the keys along `seq_axis`.
    """
    valid = masks.valid_keys(x.shape[seq_axis], kv_lengths, kv_offset=kv_offset)  # [B, Tk]
    shape = [1] * x.ndim
    shape[0], shape[seq_axis] = valid.shape
    return jnp.where(valid.reshape(shape), x, jnp.zeros((), x.dtype))


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
        k = select_valid_keys(k, kv_lengths, kv_offset)
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
    _checks.check_kv_lengths(kv_lengths, ks[0], ks[1])
    s, mask = scaled_scores(
        q, k, scale=_checks.resolve_scale(scale, ks[3], q.dtype), causal=causal,
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
      kv_lengths: `[B]` ints in `[0, Tk]` (checked when concrete; under `jax.jit` a length
        below 0 acts as 0 and one above Tk as Tk); keys at positions `>= kv_lengths[b]` are
        masked.

    A query that sees no key (e.g. `kv_lengths[b] == 0`) gets an output of zeros: the
    empty sum, and the identity of `states.combine`. Keys and values past `kv_lengths` are
    selected away, never multiplied by a zero weight, so they may hold anything.
    """
    dims = _checks.check_qkv(q, k, v, kv_lengths)
    if dims.batch == 0 or dims.q_len == 0:
        return jnp.zeros((dims.batch, dims.q_len, dims.q_heads, dims.v_dim), q.dtype)
    w = weights(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)
    if kv_lengths is not None:
        v = select_valid_keys(v, kv_lengths)
    return grouped_values(w, v.astype(w.dtype)).astype(q.dtype)

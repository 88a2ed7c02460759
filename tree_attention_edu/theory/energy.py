"""Attention as the gradient of an energy (paper, section 4).

    F(ζ) = Σ_b Σ_i Σ_h log Σ_{a visible} exp(scale · q_{bih} · k_a + ζ_{bih} · v_a)

F is a cumulant-generating function of the values under the attention weights:

* ∂F/∂ζ at ζ = 0 is the weights' mean of v: softmax attention (`attention_from_energy`);
* ∂²F/∂ζ² at ζ = 0 is their covariance (`value_covariance`).

A query that sees no key contributes 0 to F (its log of an empty sum is left out), so
its gradient, like `attention`'s output there, is zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from ..core import inputs, masks
from ..core.numerics import PRECISION, accum_dtype, lse_pair, masked_softmax_parts
from ..core.reference import grouped_scores, scaled_scores, weights


def energy(
    q: Array,
    k: Array,
    v: Array,
    zeta: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """The scalar energy F_tot(ζ), summed over batch, queries and heads.

    Args:
      q: `[B, Tq, Hq, D]` queries.
      k: `[B, Tk, Hkv, D]` keys.
      v: `[B, Tk, Hkv, Dv]` values.
      zeta: the source, shaped like the output `[B, Tq, Hq, Dv]`.
      scale: score scale; `None` means `1/sqrt(D)`.
      causal: decode-convention causal mask.
      kv_lengths: `[B]` valid lengths.

    Stable for huge logits: every log-sum-exp is shifted by its row max.
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    inputs.check_zeta(zeta, dims)
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    if kv_lengths is not None:
        kv_lengths = masks.clamp_lengths(kv_lengths, dims.batch, dims.kv_len)
    return energy_terms(q, k, v, zeta, scale=scale, causal=causal, kv_lengths=kv_lengths)


def energy_terms(
    q: Array,
    k: Array,
    v: Array,
    zeta: Array,
    *,
    scale: float,
    causal: bool,
    kv_lengths: Array | None,
) -> Array:
    """F_tot, unchecked (shapes as in `energy`, lengths already clamped): the einsum energy
    on one device. The sharded, streaming energy (paper, Algorithm 1) is
    `core.decode.tree_energy`."""
    s, mask = scaled_scores(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)
    acc = s.dtype
    if kv_lengths is not None:  # padding may hold NaN: select it away before ζ·v
        v = masks.select_valid_keys(v, kv_lengths)
    s = s + grouped_scores(zeta.astype(acc), v.astype(acc))  # + ζ·v_a, [B, Hq, Tq, Tk]
    _, l, m = masked_softmax_parts(s, mask)
    # An empty row (l == 0) contributes 0; a NaN row stays NaN.
    return jnp.sum(jnp.where(l == 0, jnp.zeros_like(l), lse_pair(l, m)[0]))


def _zero_source(q: Array, v: Array) -> Array:
    B, Tq, Hq, _ = q.shape
    return jnp.zeros((B, Tq, Hq, v.shape[3]), accum_dtype(q.dtype))


def attention_from_energy(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Attention `[B, Tq, Hq, Dv]` as `jax.grad` of `energy` in ζ at ζ = 0 (q's dtype)."""
    inputs.check_qkv(q, k, v, kv_lengths)
    grad = jax.grad(energy, argnums=3)(
        q, k, v, _zero_source(q, v), scale=scale, causal=causal, kv_lengths=kv_lengths
    )
    return grad.astype(q.dtype)


def value_covariance(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Hessian of `energy` in ζ at 0, per query and head: `[B, Tq, Hq, Dv, Dv]`.

    F_tot is a sum of one term per (b, i, h) row, each depending only on its own ζ row, so
    the full Hessian is block diagonal. One Hessian-vector product with the j-th unit
    vector placed in *every* row returns column j of every block at once, so `Dv`
    forward-over-reverse products give all blocks. The result equals the covariance
    `E[v vᵀ] - E[v] E[v]ᵀ` under the attention weights (tested against that formula).
    """
    inputs.check_qkv(q, k, v, kv_lengths)
    zeta0 = _zero_source(q, v)
    dv = zeta0.shape[-1]

    def grad_f(zeta):
        return jax.grad(energy, argnums=3)(
            q, k, v, zeta, scale=scale, causal=causal, kv_lengths=kv_lengths
        )

    basis = jnp.broadcast_to(
        jnp.eye(dv, dtype=zeta0.dtype)[:, None, None, None, :], (dv, *zeta0.shape)
    )
    # cols[j] = column j of every block: [Dv(j), B, Tq, Hq, Dv(i)]
    cols = jax.vmap(lambda t: jax.jvp(grad_f, (zeta0,), (t,))[1])(basis)
    return jnp.moveaxis(cols, 0, -1)  # [B, Tq, Hq, Dv(i), Dv(j)]


def value_covariance_formula(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """The hand-derived covariance `Σ_a p_a v_a v_aᵀ − (Σ_a p_a v_a)(Σ_a p_a v_a)ᵀ`.

    `[B, Tq, Hq, Dv, Dv]`, with `p` the attention weights. This is the closed form that
    `value_covariance` (autodiff) must reproduce.
    """
    inputs.check_qkv(q, k, v, kv_lengths)
    p = weights(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)  # [B, Hq, Tq, Tk]
    _B, Hq = p.shape[:2]
    if kv_lengths is not None:
        v = masks.select_valid_keys(v, masks.clamp_lengths(kv_lengths, _B, v.shape[1]))
    vh = jnp.repeat(v.astype(p.dtype), Hq // v.shape[2], axis=2)  # [B, Tk, Hq, Dv]
    return value_moments(p, vh)[1]


def value_moments(p: Array, vh: Array) -> tuple[Array, Array]:
    """Mean `[B, Tq, Hq, Dv]` and covariance `[B, Tq, Hq, Dv, Dv]` of the values under weights
    `p [B, Hq, Tq, Tk]`, with the values repeated per query head, `vh [B, Tk, Hq, Dv]`:
    `Σ_a p_a v_a` and `Σ_a p_a v_a v_aᵀ − (Σ_a p_a v_a)(Σ_a p_a v_a)ᵀ`."""
    mean = jnp.einsum("bhqk,bkhv->bqhv", p, vh, precision=PRECISION)
    second = jnp.einsum("bhqk,bkhv,bkhu->bqhvu", p, vh, vh, precision=PRECISION)
    return mean, second - mean[..., :, None] * mean[..., None, :]

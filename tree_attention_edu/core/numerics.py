"""The safe-softmax numerics every path shares: accumulation dtype, shifts that never make
(-inf) - (-inf), and log-sum-exps carried as double words.

Everything here is elementwise or a reduction along the last axis; nothing knows about
heads, devices or masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

PRECISION = lax.Precision.HIGHEST
"""The precision of every matrix product in the attention kernels, the references and the
theory: float32 products in float32 on every backend, as the float32 accumulation of 16-bit
inputs promises. XLA's default on NVIDIA GPUs rounds float32 operands to TF32 (10 mantissa
bits). Measured on an H200 (results/gpu/README.md): float32 attention then differed from a
float64 reference by up to 7.9e-4, forty times the float32 tolerance of the tests, and the
xla kernel's float32 output over a bfloat16 cache by 1.4e-4 (1.6e-6 on a CPU). With this setting
every such test passed there. Its cost there, from runs on two machines of that kind: none
clear on float32 caches; on a bfloat16 head-major cache with grouped queries (32/8, batch
8, 128k keys) the xla kernel fell from 2,995 to about 1,400 GB/s, while "auto" picks the
cudnn kernel for bfloat16 caches in the "bthd" layout. On CPUs it changes nothing. Since the
second lease, the xla kernel multiplies q and K in their own 16-bit dtype with float32
accumulation instead (`kernels.xla._exact_products`: the same exact products), measured there
at 1.71x the upcast form."""

PRECISION_NAME = PRECISION.name.lower()
"""`PRECISION` as `jax.default_matmul_precision` names it, for products the package does not
write itself (`jax.nn.dot_product_attention`'s xla implementation)."""


def accum_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype sums are carried in: float64 stays, everything else accumulates in float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


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
      `theory.symbolic.shift_invariance`).
    """
    s = jnp.where(mask, s, -jnp.inf)
    m = finite_or_zero(jax.lax.stop_gradient(jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[..., None])
    return p, jnp.sum(p, axis=-1), m


def softmax(s: Array, mask: Array) -> Array:
    """Normalised weights along the last axis; an all-zero row where nothing is visible."""
    p, l, _ = masked_softmax_parts(s, mask)
    return p / nonzero_or_one(l)[..., None]


def logsumexp(s: Array, mask: Array) -> Array:
    """Log-sum-exp of the visible scores along the last axis; -inf where nothing is visible."""
    _, l, m = masked_softmax_parts(s, mask)
    return lse_pair(l, m)[0]


def lse_pair(l: Array, m: Array) -> tuple[Array, Array]:
    """`m + log l` as a double-word number `(hi, lo)`: `hi` is the rounded log-sum-exp and `lo`
    its rounding error (`-inf, 0` where `l == 0`).

    In float32 a log-sum-exp of 1e8 has a spacing of 8, so `log l` (a few units) would round
    away entirely; `lo` keeps it, which is what makes merging such states exact
    (`core.states.combine`).
    """
    hi, lo = two_sum(m, jnp.log(nonzero_or_one(l)))
    empty = l == 0
    return jnp.where(empty, -jnp.inf, hi), jnp.where(empty, jnp.zeros_like(lo), lo)

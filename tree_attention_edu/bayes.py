"""Attention as Bayesian retrieval (paper, appendix C).

Read the weights as a posterior over which memory (key) a query retrieves:

    p(a | q) = exp(scale·q·k_a) / Σ_b exp(scale·q·k_b)         (`posterior`)

Attention is then the posterior mean of the value, E[v_a | q], which is also the gradient
of the log-evidence F(ζ) in the source ζ at ζ = 0 (`energy.attention_from_energy`).

Appendix C.2 writes a log-likelihood Γ(ζ, z) = Σ z·ζ − F(ζ) (`log_likelihood`). Its
stationary point is ζ* = 0 (from ∂Γ/∂z = ζ = 0) and z* = ∂F/∂ζ(0) (from ∂Γ/∂ζ = 0): the
attention output is the MAP estimate. `map_estimate` finds that point numerically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.scipy.sparse.linalg import gmres

from . import _checks
from .attention import accum_dtype, weights
from .energy import energy


def posterior(
    q: Array,
    k: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Posterior `[B, Hq, Tq, Tk]` over the memory each query retrieves (the attention weights).

    Rows sum to 1 over the visible keys; a query that sees no key has an all-zero row.
    Larger `scale` (inverse temperature) sharpens the posterior towards the best match.
    """
    return weights(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)


def log_likelihood(
    z: Array,
    zeta: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Γ(ζ, z) = Σ z·ζ − F(ζ), a scalar. `z` and `zeta` are float `[B, Tq, Hq, Dv]`."""
    dims = _checks.check_qkv(q, k, v, kv_lengths)
    _checks.check_like_output(z, "z", dims)
    _checks.check_like_output(zeta, "zeta", dims)
    f = energy(q, k, v, zeta, scale=scale, causal=causal, kv_lengths=kv_lengths)
    return jnp.sum(z * zeta) - f


def map_estimate(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    tol: float | None = None,
    max_newton: int = 20,
    seed: int = 0,
) -> tuple[Array, Array]:
    """Solve ∇Γ(z, ζ) = 0 numerically and return `(z_star, zeta_star)`, each `[B, Tq, Hq, Dv]`.

    Newton's method on the stationarity conditions, starting from a random point (explicit
    `seed`): each step solves `J δ = −∇Γ` with GMRES, where `J` (the Hessian of Γ) is only
    ever applied as a Jacobian-vector product of `jax.grad(log_likelihood)`. `attention` is
    never called; the solution agrees with it because the stationary point *is* attention.

    Raises:
      RuntimeError: if Newton does not reach `tol` (default 1e-12 in float64, 1e-5 otherwise)
        within `max_newton` steps.
    """
    dims = _checks.check_qkv(q, k, v, kv_lengths)
    _checks.resolve_scale(scale, dims.head_dim)  # fail here, not inside the Newton solver
    if tol is not None:
        tol = _checks.check_real(tol, "tol", low=0.0, low_open=True,
                                 hint="a residual bound such as 1e-10")
    _checks.check_int(max_newton, "max_newton", example="`max_newton=20`")
    _checks.check_int(seed, "seed", minimum=0, example="`seed=0`")
    acc = accum_dtype(q.dtype)
    tol = (1e-12 if acc == jnp.float64 else 1e-5) if tol is None else tol
    shape = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    kw = dict(scale=scale, causal=causal, kv_lengths=kv_lengths)

    residual = jax.jit(
        lambda x: jax.grad(log_likelihood, argnums=(0, 1))(x[0], x[1], q, k, v, **kw)
    )

    @jax.jit
    def newton_step(x):
        r = residual(x)
        jvp = lambda t: jax.jvp(residual, (x,), (t,))[1]  # noqa: E731
        neg_r = jax.tree.map(jnp.negative, r)
        delta, _ = gmres(jvp, neg_r, tol=tol * 1e-2, atol=0.0, restart=40, maxiter=20)
        return jax.tree.map(jnp.add, x, delta)

    key_z, key_zeta = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(key_z, shape, acc), jax.random.normal(key_zeta, shape, acc))
    err = np.inf
    for _ in range(max_newton):
        x = newton_step(x)
        err = float(max(jnp.max(jnp.abs(r)) for r in residual(x)))
        if err < tol:
            return x
    raise RuntimeError(
        f"map_estimate: Newton did not converge (max |∇Γ| = {err:.3g} after {max_newton} "
        f"steps, tol = {tol:g}); raise `max_newton` or loosen `tol`."
    )

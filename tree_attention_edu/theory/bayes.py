"""Attention as Bayesian retrieval, and what the paper's appendix C.2 gets right and wrong.

Read the weights as a posterior over which memory (key) a query retrieves:

    p(a | q) = exp(scale·q·k_a) / Σ_b exp(scale·q·k_b)         (`posterior`)

Attention is the posterior mean of the value, E[v_a | q]: the Bayes estimate under squared
loss (`posterior_risk` is smallest there). The posterior's mode, the MAP memory, is the key
with the largest score; reading its value is hard attention (`hard_attention`), the limit of
attention as the scale grows. Per query and head, F(ζ) = log Σ_a exp(scale·q·k_a + ζ·v_a)
is the log-partition (`energy.energy` sums it over rows); ∇F(0) is attention and ∇²F(0) the
value covariance Σ.

The paper's appendix C.2 writes Γ(ζ, z) = Σ z·ζ − F(ζ) (its eq. 30, `log_likelihood`) and
calls its stationary point ζ* = 0, z* = ∇F(0) = attention (eqs. 31–33, `stationary_point`)
a MAP estimate, z*, ζ* = argmax e^{−Γ} (eq. 34). The stationary point is right; the word MAP
is not:

* Γ is linear in z, so it is unbounded above and below: argmax e^{−Γ} does not exist.
* Its Hessian at the stationary point is [[−Σ, I], [I, 0]] (`gamma_hessian`). For each
  eigenvalue c ≥ 0 of Σ the 2×2 block [[−c, 1], [1, 0]] has eigenvalues
  (−c ± √(c² + 4))/2, one of each sign: a saddle, whatever the data.

What is true instead (each function here computes one side of it):

* **Legendre (min–max).** F*(z) = max_ζ Γ(ζ, z) is the convex conjugate of F
  (`conjugate_energy`, by a concave maximisation over ζ). Attention = argmin_z F*(z), with
  min F* = −F(0), and ∇F*(z) is the maximising ζ.
* **Cramér (large deviations).** With K(ζ) = F(ζ) − F(0), the cumulant-generating function
  of v under the posterior, the rate function I(z) = K*(z) = F*(z) + F(0) (`rate_function`)
  equals min{KL(Q‖P) : E_Q[v] = z} (`min_kl_with_mean`, attained by the tilted posterior
  Q ∝ P e^{ζ·v}, `tilted_posterior`). I ≥ 0 and I = 0 only at attention; near it
  I(z) ≈ ½ (z − μ)ᵀ Σ⁻¹ (z − μ). For the mean of n draws from the posterior
  (`sample_means`), attention is the exact expected value for every n, and Cramér's theorem
  gives the probability of a set A as ≈ e^{−n inf_A I}. The draws come from finitely many
  values, so the mean has no density; Daniels' saddle-point approximation
  (`saddlepoint_density`, ∝ e^{−n I(z)}) describes its histogram, whose peak sits about
  −k₃/(2 k₂ n) from attention (k₂, k₃ the cumulants of v): attention is the most probable
  value only as n → ∞.

Shapes: queries `q [B, Tq, Hq, D]`, keys `k [B, Tk, Hkv, D]`, values `v [B, Tk, Hkv, Dv]`;
estimates `z` and sources `zeta` are shaped like attention's output, `[B, Tq, Hq, Dv]`;
per-row results are `[B, Tq, Hq]`. A row (query, head) that sees no key has F ≡ 0, as in
`energy`: its attention is 0, F*(0) = I(0) = 0, and F*(z) = I(z) = +inf for any other z.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.scipy.sparse.linalg import gmres

from ..core import inputs, masks, numerics, validate
from ..core.numerics import PRECISION, accum_dtype
from ..core.reference import grouped_scores, scaled_scores, weights
from .energy import energy, value_moments


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
    """Γ(ζ, z) = Σ z·ζ − F_tot(ζ), a scalar; `z` and `zeta` are float `[B, Tq, Hq, Dv]`.

    The paper's name (appendix C.2, eq. 30, and its Table I: "attention log-likelihood").
    Γ is not the log-likelihood of any distribution: it is linear in `z`, so e^{−Γ} cannot be
    normalised and has no maximum. Its stationary point is a saddle (`gamma_hessian`); its
    maximum over ζ is the convex conjugate F*(z) (`conjugate_energy`).
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    inputs.check_like_output(z, "z", dims)
    inputs.check_like_output(zeta, "zeta", dims)
    f = energy(q, k, v, zeta, scale=scale, causal=causal, kv_lengths=kv_lengths)
    return jnp.sum(z * zeta) - f


_MAX_SEED = 2**63 - 1
"""Largest seed `jax.random.key` takes (a 64-bit signed integer)."""


def stationary_point(
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
    """Solve ∇Γ(ζ, z) = 0 numerically and return `(z_star, zeta_star)`, each `[B, Tq, Hq, Dv]`.

    The point the paper's eqs. 31–33 find: ζ* = 0 and z* = ∇F(0) = attention. It is a saddle
    of Γ, not a maximum of e^{−Γ} (see `gamma_hessian`), so Newton's method is used: it
    solves for a zero of the gradient whatever the curvature. Each step solves `J δ = −∇Γ`
    with GMRES, where `J` (the indefinite Hessian of Γ) is only ever applied as a
    Jacobian-vector product of `jax.grad(log_likelihood)`, from a random start (explicit
    `seed`). `attention` is never called; the solution agrees with it because the
    stationary point *is* attention.

    The whole solve is one jitted program (a `lax.while_loop`), so it runs the same eagerly
    and under `jax.jit`. If Newton does not reach `tol` (default 1e-12 in float64, 1e-5
    otherwise) within `max_newton` steps, both results are NaN: a jitted program cannot
    raise on a value, and NaN cannot be mistaken for an answer.
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    validate.check_bool(causal, "causal")
    if tol is not None:
        tol = validate.check_real(
            tol, "tol", low=0.0, low_open=True, hint="a residual bound such as 1e-10"
        )
    validate.check_int(max_newton, "max_newton", example="`max_newton=20`")
    validate.check_int(seed, "seed", minimum=0, example="`seed=0`")
    if seed > _MAX_SEED:  # jax.random.key takes a C long
        raise ValueError(
            f"`seed` = {seed} is more than the largest PRNG seed, 2**63 - 1; "
            f"pass a smaller one, e.g. `seed % 2**63`."
        )
    acc = accum_dtype(q.dtype)
    tol = (1e-12 if acc == jnp.float64 else 1e-5) if tol is None else tol
    shape = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    key_z, key_zeta = jax.random.split(jax.random.key(seed))
    x0 = (jax.random.normal(key_z, shape, acc), jax.random.normal(key_zeta, shape, acc))
    return _newton(
        q,
        k,
        v,
        kv_lengths,
        x0,
        scale=scale,
        causal=bool(causal),
        tol=float(tol),
        max_newton=int(max_newton),
    )


@partial(jax.jit, static_argnames=("scale", "causal", "tol", "max_newton"))
def _newton(q, k, v, kv_lengths, x0, *, scale, causal, tol, max_newton):
    """Newton's method on ∇Γ = 0 as one `lax.while_loop`; NaN if it does not converge."""
    kw = dict(scale=scale, causal=causal, kv_lengths=kv_lengths)

    def residual(x):
        return jax.grad(log_likelihood, argnums=(0, 1))(x[0], x[1], q, k, v, **kw)

    def size(r):  # max |∇Γ|
        return jnp.maximum(jnp.max(jnp.abs(r[0])), jnp.max(jnp.abs(r[1])))

    def step(carry):
        i, x, _ = carry
        r = residual(x)
        jvp = lambda t: jax.jvp(residual, (x,), (t,))[1]  # noqa: E731
        delta, _ = gmres(
            jvp, jax.tree.map(jnp.negative, r), tol=tol * 1e-2, atol=0.0, restart=40, maxiter=20
        )
        x = jax.tree.map(jnp.add, x, delta)
        return i + 1, x, size(residual(x))

    def unfinished(carry):
        i, _, err = carry
        return (i < max_newton) & ~(err < tol)

    _, x, err = lax.while_loop(unfinished, step, (0, x0, jnp.asarray(jnp.inf, x0[0].dtype)))
    return jax.tree.map(lambda a: jnp.where(err < tol, a, jnp.nan), x)


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
    """Deprecated: the paper's name for `stationary_point`, which it returns unchanged.

    The paper (appendix C.2, eq. 34) calls the stationary point of Γ a MAP estimate,
    argmax e^{−Γ}. That is not correct: Γ is linear in z, so e^{−Γ} has no maximum, and the
    point is a saddle of Γ (`gamma_hessian`). Attention is the posterior *mean* over memories;
    the MAP memory gives `hard_attention`. Use `stationary_point`.
    """
    warnings.warn(
        "map_estimate is the paper's name for a saddle point, not a MAP estimate; "
        "use stationary_point",
        DeprecationWarning,
        stacklevel=2,
    )
    return stationary_point(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        kv_lengths=kv_lengths,
        tol=tol,
        max_newton=max_newton,
        seed=seed,
    )


def gamma_hessian(
    q: Array,
    k: Array,
    v: Array,
    *,
    zeta: Array | None = None,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Hessian of Γ in `(ζ, z)` per query and head, by autodiff: `[B, Tq, Hq, 2·Dv, 2·Dv]`.

    Rows and columns are ordered `(ζ_1..ζ_Dv, z_1..z_Dv)`. Γ is a sum of one term per
    (b, i, h) row, so its full Hessian is block diagonal and these are its blocks; Γ is linear
    in z, so the Hessian does not depend on z. At `zeta` (default 0, the stationary point) it
    is [[−∇²F(ζ), I], [I, 0]], which has eigenvalues of both signs for any data: the
    stationary point is a saddle. Computed as `2·Dv` Jacobian-vector products of
    `jax.grad(log_likelihood)`, each with one unit vector placed in every row.
    """
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    shape = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    if zeta is None:
        zeta = jnp.zeros(shape, accum_dtype(q.dtype))
    inputs.check_like_output(zeta, "zeta", dims)
    return _gamma_hessian(q, k, v, kv_lengths, zeta, scale=scale, causal=causal)


@partial(jax.jit, static_argnames=("scale", "causal"))
def _gamma_hessian(q, k, v, kv_lengths, zeta, *, scale, causal):
    acc = accum_dtype(q.dtype)
    B, Tq, Hq, Dv = zeta.shape
    kw = dict(scale=scale, causal=causal, kv_lengths=kv_lengths)

    def grad(x):  # x = (ζ, z) stacked: [2, B, Tq, Hq, Dv]
        g_z, g_zeta = jax.grad(log_likelihood, argnums=(0, 1))(x[1], x[0], q, k, v, **kw)
        return jnp.stack([g_zeta, g_z])

    x0 = jnp.stack([zeta.astype(acc), jnp.zeros(zeta.shape, acc)])
    n = 2 * Dv
    eye = jnp.eye(n, dtype=acc).reshape(n, 2, 1, 1, 1, Dv)
    basis = jnp.broadcast_to(eye, (n, *x0.shape))
    cols = jax.vmap(lambda t: jax.jvp(grad, (x0,), (t,))[1])(basis)  # [n(j), 2, B, Tq, Hq, Dv]
    cols = jnp.moveaxis(cols, 1, -2).reshape(n, B, Tq, Hq, n)  # [n(j), B, Tq, Hq, n(i)]
    return jnp.moveaxis(cols, 0, -1)  # [B, Tq, Hq, n(i), n(j)]


# ---------------------------------------------------------------- tilted posteriors (private)
# Each public function below validates its arguments in Python, then runs one jitted program
# per shape: `_prepare` (scores, mask, values per query head), the Newton ascent
# `_conjugate_step`, and `_at_maximiser` (every quantity read off the maximising ζ).


def _rows(q, k, v, scale, causal, kv_lengths):
    """Validated sizes, scores `s [B, Hq, Tq, Tk]`, mask (same shape), values per query head
    `vh [B, Tk, Hq, Dv]` and the rows that see at least one key, `nonempty [B, Tq, Hq]`."""
    dims = inputs.check_qkv(q, k, v, kv_lengths)
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    validate.check_bool(causal, "causal")
    if kv_lengths is not None:
        kv_lengths = masks.clamp_lengths(kv_lengths, dims.batch, dims.kv_len)
    return (
        dims,
        *_prepare(q, k, v, kv_lengths, scale=scale, causal=bool(causal), group=dims.group),
    )


@partial(jax.jit, static_argnames=("scale", "causal", "group"))
def _prepare(q, k, v, kv_lengths, *, scale, causal, group):
    s, mask = scaled_scores(q, k, scale=scale, causal=causal, kv_lengths=kv_lengths)
    mask = jnp.broadcast_to(mask, s.shape)
    if kv_lengths is not None:  # padding may hold NaN: select it away before any product
        v = masks.select_valid_keys(v, kv_lengths)
    vh = jnp.repeat(v.astype(s.dtype), group, axis=2)
    return s, mask, vh, jnp.swapaxes(mask.any(-1), 1, 2)


def _logits(s, mask, vh, zeta):
    """Tilted log-weights `scale·q·k_a + ζ·v_a` `[B, Hq, Tq, Tk]`, −inf where masked."""
    return jnp.where(mask, s + grouped_scores(zeta.astype(s.dtype), vh), -jnp.inf)


def _lse(logits):
    """Per-row log-sum-exp `[B, Tq, Hq]`; 0 for a row with no visible key (as in `energy`)."""
    lse = numerics.logsumexp(logits, jnp.isfinite(logits))
    return jnp.swapaxes(jnp.where(jnp.isneginf(lse), 0.0, lse), 1, 2)


def _softmax(logits):
    """Normalised weights `[B, Hq, Tq, Tk]`; an all-zero row where nothing is visible."""
    return numerics.softmax(logits, jnp.isfinite(logits))


@jax.jit
def _conjugate_step(zeta, z, s, mask, vh, nonempty):
    """One damped Newton step of max_ζ z·ζ − F(ζ), per row. Returns `(new ζ, max |∇|)`.

    The objective is concave (its Hessian is −Cov under the tilted weights), so Newton's
    direction Cov⁺ (z − E[v]) ascends; a backtracking search over steps 2^-j keeps the
    largest that satisfies Armijo's condition in every row separately.
    """
    eps = jnp.finfo(s.dtype).eps

    def objective(x):
        lse = _lse(_logits(s, mask, vh, x))
        return jnp.sum(z * x, -1) - lse, lse

    g0, lse0 = objective(zeta)
    mean, cov = value_moments(_softmax(_logits(s, mask, vh, zeta)), vh)
    r = jnp.where(nonempty[..., None], z - mean, 0.0)
    lam, u = jnp.linalg.eigh(cov)
    cut = 100 * eps * jnp.maximum(lam[..., -1:], jnp.finfo(s.dtype).tiny)
    inv = jnp.where(lam > cut, 1.0 / jnp.where(lam > cut, lam, 1.0), 0.0)
    delta = jnp.einsum(
        "...ij,...j->...i",
        u,
        inv * jnp.einsum("...ji,...j->...i", u, r, precision=PRECISION),
        precision=PRECISION,
    )
    slope = jnp.sum(r * delta, -1)
    ts = 2.0 ** -jnp.arange(40, dtype=s.dtype)
    g, _ = jax.vmap(lambda t: objective(zeta + t * delta))(ts)  # [40, B, Tq, Hq]
    slack = 32 * eps * (1 + jnp.abs(g0) + jnp.abs(lse0))  # rounding near the optimum
    ok = g >= g0 + 1e-4 * ts[:, None, None, None] * slope - slack
    t = jnp.where(ok.any(0), ts[jnp.argmax(ok, axis=0)], 0.0)
    return zeta + t[..., None] * delta, jnp.max(jnp.abs(r))


def _maximise(z, s, mask, vh, nonempty, tol, max_newton):
    """Damped Newton ascent from ζ = 0 as one `lax.while_loop`, until every row's
    |z − E[v]| is below `tol` or `max_newton` steps are spent. Returns the last ζ whose
    residual was measured, and that residual's maximum."""

    def step(carry):
        i, _, new, _ = carry
        newer, err = _conjugate_step(new, z, s, mask, vh, nonempty)  # err at `new`
        return i + 1, new, newer, err

    def unfinished(carry):
        i, _, _, err = carry
        return (i < max_newton) & ~(err < tol)

    zeta0 = jnp.zeros_like(z)
    new, err = _conjugate_step(zeta0, z, s, mask, vh, nonempty)
    _, zeta, _, err = lax.while_loop(unfinished, step, (1, zeta0, new, err))
    return zeta


@partial(jax.jit, static_argnames=("tol", "max_newton"))
def _solve_rows(z, s, mask, vh, nonempty, *, tol, max_newton):
    """The maximiser ζ̂ of z·ζ − F(ζ) and what the public functions read off it, each
    `[B, Tq, Hq]`: F*(z), I(z), KL(Q‖P) summed from the weights, and log det Cov_Q[v] (Q the
    tilted posterior). Rows that see no key follow F ≡ 0: 0 at z = 0 and +inf elsewhere.
    Rows whose residual |z − E_Q[v]| did not fall below `tol` are NaN."""
    zeta = _maximise(z, s, mask, vh, nonempty, tol, max_newton)
    logits = _logits(s, mask, vh, zeta)
    f0 = _lse(jnp.where(mask, s, -jnp.inf))
    conj = jnp.sum(z * zeta, -1) - _lse(logits)
    rate = jnp.sum(z * zeta, -1) - (_lse(logits) - f0)
    log_p = jax.nn.log_softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.swapaxes(jnp.sum(jnp.where(mask, jnp.exp(log_q) * (log_q - log_p), 0.0), -1), 1, 2)
    mean, cov = value_moments(_softmax(logits), vh)
    logdet = jnp.linalg.slogdet(cov)[1]
    # Not converged (e.g. z outside the convex hull, where F* is +inf): NaN, not a number
    # that could be mistaken for an answer.
    solved = ~nonempty | (jnp.max(jnp.abs(z - mean), axis=-1) < tol)
    empty = jnp.where(jnp.all(z == 0, axis=-1), 0.0, jnp.inf)

    def pick(x):
        return jnp.where(nonempty, jnp.where(solved, x, jnp.nan), empty)

    return jnp.where(solved[..., None], zeta, jnp.nan), dict(
        conj=pick(conj),
        rate=pick(rate),
        kl=pick(kl),
        logdet=jnp.where(solved, logdet, jnp.nan),
        nonempty=nonempty,
    )


def _check_solver(tol, max_newton, dtype):
    if tol is not None:
        tol = validate.check_real(
            tol, "tol", low=0.0, low_open=True, hint="a gradient bound such as 1e-10"
        )
    validate.check_int(max_newton, "max_newton", example="`max_newton=100`")
    return (1e-11 if accum_dtype(dtype) == jnp.float64 else 1e-4) if tol is None else tol


def _solve(z, q, k, v, scale, causal, kv_lengths, tol, max_newton):
    """Validate, find the maximiser ζ̂(z) and read everything off it."""
    dims, s, mask, vh, nonempty = _rows(q, k, v, scale, causal, kv_lengths)
    inputs.check_like_output(z, "z", dims)
    tol = _check_solver(tol, max_newton, q.dtype)
    zeta, out = _solve_rows(
        z.astype(s.dtype), s, mask, vh, nonempty, tol=float(tol), max_newton=int(max_newton)
    )
    return dims, zeta, out


def conjugate_energy(
    z: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    tol: float | None = None,
    max_newton: int = 100,
) -> tuple[Array, Array]:
    """The convex conjugate F*(z) = max_ζ Γ(ζ, z) = max_ζ (z·ζ − F(ζ)), per row.

    Args:
      z: `[B, Tq, Hq, Dv]`, one point per row; F*(z) is finite for z strictly inside the
        convex hull of the row's visible values.
      q: `[B, Tq, Hq, D]` queries.
      k: `[B, Tk, Hkv, D]` keys.
      v: `[B, Tk, Hkv, Dv]` values.
      scale: score scale; `None` means `1/sqrt(D)`.
      causal: decode-convention causal mask, as in `attention`.
      kv_lengths: `[B]` valid lengths, as in `attention`.
      tol: bound on max |z − ∇F(ζ)| at the returned ζ (default 1e-11 in float64, 1e-4
        otherwise).
      max_newton: Newton steps allowed.

    Returns:
      `(value [B, Tq, Hq], zeta [B, Tq, Hq, Dv])`: F*(z) and the maximising ζ, which is
      ∇F*(z). Γ is concave in ζ (its Hessian there is −Cov), so the maximum is found by
      damped Newton ascent; nothing here calls `attention`. The minimum of F* over z is
      −F(0), at z = attention (the Legendre reading of the paper's stationary point).
      The solve is one jitted program (a `lax.while_loop`), the same eagerly and under
      `jax.jit`; a row where it does not converge within `max_newton` steps, as when `z`
      lies outside the convex hull of the values (F* is +inf there), is NaN in both.
    """
    _, zeta, out = _solve(z, q, k, v, scale, causal, kv_lengths, tol, max_newton)
    return out["conj"], zeta


def rate_function(
    z: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    tol: float | None = None,
    max_newton: int = 100,
) -> Array:
    """Cramér's rate function I(z) = K*(z) = F*(z) + F(0) per row, `[B, Tq, Hq]`.

    K(ζ) = F(ζ) − F(0) = log E_p[e^{ζ·v}] is the cumulant-generating function of the values
    under the posterior p, and I its convex conjugate. I ≥ 0, with I = 0 only at attention;
    near attention μ, I(z) ≈ ½ (z − μ)ᵀ Σ⁻¹ (z − μ) (Σ the value covariance); and the mean
    of n draws from p falls in a set A with probability ≈ e^{−n inf_A I} (Cramér's theorem;
    its smoothed density is `saddlepoint_density`). `z` is `[B, Tq, Hq, Dv]`;
    `tol`, `max_newton` and the NaN rows are those of `conjugate_energy`.
    """
    return _solve(z, q, k, v, scale, causal, kv_lengths, tol, max_newton)[2]["rate"]


def tilted_posterior(
    zeta: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """The exponentially tilted posterior Q_ζ(a) ∝ p(a | q) e^{ζ·v_a}, `[B, Hq, Tq, Tk]`.

    `zeta` is `[B, Tq, Hq, Dv]`; ζ = 0 gives `posterior`. Its mean E_Q[v] is ∇F(ζ), and among
    all distributions over the memories with that mean it is the one closest to the posterior
    in KL(Q‖P) (`min_kl_with_mean`). A row with no visible key is all zeros.
    """
    dims, s, mask, vh, _ = _rows(q, k, v, scale, causal, kv_lengths)
    inputs.check_like_output(zeta, "zeta", dims)
    return _tilted(s, mask, vh, zeta)


@jax.jit
def _tilted(s, mask, vh, zeta):
    return _softmax(_logits(s, mask, vh, zeta))


def min_kl_with_mean(
    z: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    tol: float | None = None,
    max_newton: int = 100,
) -> Array:
    """min { KL(Q‖P) : E_Q[v] = z } per row, `[B, Tq, Hq]`, with P the posterior.

    The minimiser is the tilted posterior Q ∝ P e^{ζ·v} whose mean is z (exponential
    tilting; ζ from the same concave maximisation as `conjugate_energy`), and the KL is
    summed directly as Σ_a Q_a log(Q_a / P_a). It equals the rate function I(z). `z` is
    `[B, Tq, Hq, Dv]`; `tol`, `max_newton` and the NaN rows are those of `conjugate_energy`.
    """
    return _solve(z, q, k, v, scale, causal, kv_lengths, tol, max_newton)[2]["kl"]


def saddlepoint_density(
    z: Array,
    n: int,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    tol: float | None = None,
    max_newton: int = 100,
) -> Array:
    """Density of the mean of `n` draws from the posterior at `z`, `[B, Tq, Hq]` (Daniels).

    Daniels' saddle-point approximation (1954):
    (n / 2π)^{Dv/2} det(Cov_Q[v])^{−1/2} e^{−n I(z)}, with Q the tilted posterior whose mean is
    z. Its exponent is −n times the rate function, and its relative error is O(1/n) inside the
    convex hull of the values. The draws are discrete, so this is the density of their
    histogram on scales larger than the spacing of attainable means. A row with no visible
    key has mean exactly 0: +inf at z = 0 and 0 elsewhere.
    """
    n = validate.check_int(n, "n", example="`n=16` draws")
    dims, _, out = _solve(z, q, k, v, scale, causal, kv_lengths, tol, max_newton)
    log_density = 0.5 * dims.v_dim * np.log(n / (2 * np.pi)) - 0.5 * out["logdet"] - n * out["rate"]
    # A row with no key: its mean is exactly 0, a point mass (+inf at z = 0, 0 elsewhere).
    point_mass = jnp.where(out["rate"] == 0, jnp.inf, 0.0)
    return jnp.where(out["nonempty"], jnp.exp(log_density), point_mass)


def sample_means(
    key: Array,
    n: int,
    num_samples: int,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Means of `n` memories' values drawn i.i.d. from the posterior, `[num_samples, B, Tq,
    Hq, Dv]`.

    Each sample draws `n` keys per row from p(a | q) (with `key`, a JAX PRNG key) and averages
    their values. Their expected value is attention for every n, and they concentrate there
    (law of large numbers); by Cramér's theorem a set A away from attention has probability
    ≈ e^{−n inf_A I} (`rate_function`), and their histogram follows `saddlepoint_density`.
    A row with no visible key gives 0.
    """
    validate.check_prng_key(key)
    n = validate.check_int(n, "n", example="`n=16` draws")
    num_samples = validate.check_int(num_samples, "num_samples", example="`num_samples=10_000`")
    _, s, mask, vh, nonempty = _rows(q, k, v, scale, causal, kv_lengths)
    return _sample_means(key, s, mask, vh, nonempty, n=n, num_samples=num_samples)


@partial(jax.jit, static_argnames=("n", "num_samples"))
def _sample_means(key, s, mask, vh, nonempty, *, n, num_samples):
    # Inverse-CDF sampling: one uniform per draw (the Gumbel trick would need one per key).
    cdf = jnp.cumsum(_softmax(jnp.where(mask, s, -jnp.inf)), axis=-1)  # [B, Hq, Tq, Tk]
    u = jax.random.uniform(key, (num_samples, n, *cdf.shape[:3], 1), cdf.dtype)
    # idx = #{a : cdf_a <= u·total}, so P(idx = a) = p_a (a key of weight 0 is never drawn)
    idx = jnp.minimum(jnp.sum(u * cdf[..., -1:] >= cdf, axis=-1), cdf.shape[-1] - 1)
    b = jnp.arange(s.shape[0])[:, None, None]
    h = jnp.arange(s.shape[1])[None, :, None]
    draws = vh[b, idx, h]  # [num_samples, n, B, Hq, Tq, Dv]
    means = jnp.swapaxes(jnp.mean(draws, axis=1), 2, 3)  # [num_samples, B, Tq, Hq, Dv]
    return jnp.where(nonempty[..., None], means, 0.0)


def posterior_risk(
    z: Array,
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """Expected squared loss E_p |v_a − z|² of an estimate `z [B, Tq, Hq, Dv]`, `[B, Tq, Hq]`.

    It equals tr Σ + |z − μ|² (μ the posterior mean, Σ the value covariance), so attention
    (z = μ) is the Bayes estimate under squared loss. A row with no visible key gives 0.
    """
    dims, s, mask, vh, _ = _rows(q, k, v, scale, causal, kv_lengths)
    inputs.check_like_output(z, "z", dims)
    return _risk(s, mask, vh, z)


@jax.jit
def _risk(s, mask, vh, z):
    p = _softmax(jnp.where(mask, s, -jnp.inf))
    diff = vh[:, None] - z.astype(s.dtype)[:, :, None]  # [B, Tq, Tk, Hq, Dv]
    return jnp.einsum("bhqk,bqkh->bqh", p, jnp.sum(diff**2, axis=-1), precision=PRECISION)


def hard_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
) -> Array:
    """The value of the MAP memory, argmax_a p(a | q): `[B, Tq, Hq, Dv]` in q's dtype.

    The posterior's mode is the visible key with the largest score `scale·q·k_a` (ties go
    to the first); reading its value is hard attention. As the scale grows (β → ∞) the
    posterior concentrates there and attention converges to this. A row with no visible
    key gives 0.
    """
    _, s, mask, vh, nonempty = _rows(q, k, v, scale, causal, kv_lengths)
    return _hard(s, mask, vh, nonempty).astype(q.dtype)


@jax.jit
def _hard(s, mask, vh, nonempty):
    best = jnp.argmax(jnp.where(mask, s, -jnp.inf), axis=-1)  # [B, Hq, Tq]
    b = jnp.arange(s.shape[0])[:, None, None]
    h = jnp.arange(s.shape[1])[None, :, None]
    out = jnp.swapaxes(vh[b, best, h], 1, 2)  # [B, Tq, Hq, Dv]
    return jnp.where(nonempty[..., None], out, 0.0)
